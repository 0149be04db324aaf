"""Elastic training under horovodrun on one machine: a worker is killed, the survivor goes on
without restarting, and a worker added through the discovery file joins with the current state.

One machine, several "hosts": horovodrun starts a worker without ssh when its host name resolves
to an address of this machine, and Horovod blacklists the host of a failed worker (every slot of
it, for the rest of the job without --blacklist-cooldown-range). With all slots on "localhost",
one kill would remove them all. So each worker gets its own name for this machine: "localhost"
and "127.0.0.1" at the start, and this machine's host name (or the address of another of its
interfaces) for the worker added back.

The job's own record is rank 0's run_dir/elastic.jsonl ("start" after every (re)start with each
worker's rank, pid, host and weight digest; "commit" per commit), which the test reads while the
job runs to find the worker to kill and to see the job's progress.
"""

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from jobs import PYTHON, REPO, result_of, run

from hvd_train.core import checkpoint, launch, scaling

CONFIG = str(REPO / "configs" / "digits.yaml")
DISCOVER = str(REPO / "mpi_scripts" / "discover_hosts.sh")
EPOCHS = 40  # about 25 s of training: the kill and the re-join both land inside it
WAIT_S = 120  # for one event of the job
# digits.yaml: 1438 training samples, 32 per rank and step, 2 warmup epochs then a cosine decay.
TRAIN_SAMPLES, BATCH, BASE_LR, WARMUP_EPOCHS = 1438, 32, 0.05, 2


def another_name_for_this_machine() -> str:
    """A host name other than "localhost" and "127.0.0.1" that resolves to a local address."""
    local = {
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET
    }
    for name in [socket.gethostname(), *sorted(local - {"127.0.0.1"})]:
        try:
            resolved = socket.gethostbyname(name)
        except OSError:
            continue
        if name not in ("localhost", "127.0.0.1") and resolved in local:
            return name
    pytest.skip("this machine has no third name that resolves to one of its addresses")


def write_hosts(path: Path, hosts: list[str]) -> None:
    """Replace the discovery file at once (horovodrun may run the script at any moment)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{host}:1\n" for host in hosts))
    tmp.replace(path)


class Events:
    """Rank 0's elastic.jsonl, read while the job runs."""

    def __init__(self, path: Path, job) -> None:
        self.path = path
        self.job = job

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait(self, what: str, found) -> tuple[int, dict]:
        """The first (index, event) with found(index, event) true."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for i, event in enumerate(self.read()):
                if found(i, event):
                    return i, event
            if self.job.done():
                job = self.job.result()
                pytest.fail(f"the job ended (code {job.returncode}) before {what}:\n{job.tail()}")
            time.sleep(0.2)
        pytest.fail(f"no {what} within {WAIT_S}s; events: {self.read()[-5:]}")


def progress(event: dict) -> tuple[int, int, int]:
    return event["epoch"], event["position"], event["updates"]


def last_commit_before(events: list[dict], index: int) -> dict:
    return next(e for e in reversed(events[:index]) if e["event"] == "commit")


def expected_learning_rate(event: dict) -> float:
    """The batch rule for the event's worker count, at its point of the schedule in epochs."""
    size, steps = event["size"], event["steps_per_epoch"]
    assert steps == (TRAIN_SAMPLES // size) // BATCH
    update = event["epoch"] * steps + event["position"] / (BATCH * size)
    peak = scaling.scaled_learning_rate(BASE_LR, BATCH * size, BATCH)
    return scaling.learning_rate(
        update, BASE_LR, peak, WARMUP_EPOCHS * steps, EPOCHS * steps, "cosine"
    )


def test_a_killed_worker_is_dropped_and_a_new_one_joins_with_the_current_state(tmp_path):
    third = another_name_for_this_machine()
    hosts_file, run_dir = tmp_path / "hosts", tmp_path / "run"
    write_hosts(hosts_file, ["localhost", "127.0.0.1"])
    train = [
        *(PYTHON, "-m", "hvd_train.cli", "train", "--elastic", "--config", CONFIG),
        *("--set", f"run_dir={run_dir}", "--set", "model.name=cnn"),
        *("--set", f"train.epochs={EPOCHS}", "--set", "elastic.commit_every_steps=5"),
        *("--set", "logging.tensorboard=false", "--set", "checkpoint.keep_last=2"),
    ]
    argv = launch.horovodrun_elastic_argv(
        2, train, min_np=1, max_np=2, discovery=[DISCOVER, str(hosts_file)]
    )
    with ThreadPoolExecutor(1) as pool:
        events = Events(run_dir / "elastic.jsonl", pool.submit(run, argv, timeout=300))

        # Two workers start from one state; after a commit, rank 1 is killed.
        _, first = events.wait("the first start", lambda i, e: e["event"] == "start")
        assert first["size"] == 2 and len({w["weights"] for w in first["workers"]}) == 1
        chief, victim = sorted(first["workers"], key=lambda w: w["rank"])
        seen, _ = events.wait("a commit", lambda i, e: e["event"] == "commit")
        os.kill(victim["pid"], signal.SIGKILL)

        # The survivor goes on alone, in the same process, from the last commit.
        at_kill, alone = events.wait(
            "the restart after the kill", lambda i, e: i > seen and e["event"] == "start"
        )
        assert alone["size"] == 1
        assert [(w["rank"], w["pid"]) for w in alone["workers"]] == [(0, chief["pid"])]
        history = events.read()
        assert progress(alone) == progress(last_commit_before(history, at_kill))
        assert alone["updates"] >= history[seen]["updates"]
        assert alone["learning_rate"] == pytest.approx(expected_learning_rate(alone), rel=1e-5)
        events.wait("a commit of the survivor", lambda i, e: i > at_kill and e["event"] == "commit")

        # The failed host is gone from the discovery file, another one appears: a worker joins.
        write_hosts(hosts_file, [chief["host"], third])
        at_join, joined = events.wait(
            "the restart with the added worker",
            lambda i, e: i > at_kill and e["event"] == "start",
        )
        job = events.job.result()

    assert job.returncode == 0, job.tail()
    history = events.read()
    assert joined["size"] == 2
    assert progress(joined) == progress(last_commit_before(history, at_join))
    newcomer = next(w for w in joined["workers"] if w["pid"] != chief["pid"])
    assert newcomer["host"] == third and newcomer["pid"] != victim["pid"]
    assert [w["pid"] for w in joined["workers"] if w["rank"] == 0] == [chief["pid"]]
    # The new worker holds rank 0's weights after the sync.
    assert len({w["weights"] for w in joined["workers"]}) == 1
    assert joined["learning_rate"] == pytest.approx(expected_learning_rate(joined), rel=1e-5)
    assert [e["event"] for e in history].count("start") == 3
    assert "a collective failed" in job.output and "hosts were added or removed" in job.output

    # Finished: every epoch logged once, a valid last checkpoint, a sane accuracy.
    result = result_of(job)
    assert result["workers"] == 2 and result["epochs_done"] == EPOCHS
    assert result["final"]["accuracy"] >= 0.95, result
    records = json.loads((run_dir / "metrics.json").read_text())
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    last = checkpoint.load(run_dir / "checkpoints" / checkpoint.epoch_dir_name(EPOCHS - 1))
    assert last.meta["epoch"] == EPOCHS - 1 and last.meta["size"] == 2
    print(
        f"elastic job: {job.seconds:.0f}s; killed at update {alone['updates']} "
        f"(epoch {alone['epoch'] + 1}), joined at update {joined['updates']} "
        f"(epoch {joined['epoch'] + 1}); val accuracy {result['final']['accuracy']:.4f}"
    )
