"""Elastic training across real hosts (docs/cluster.md#elastic-training-across-hosts): a host added
to the discovery output joins with the current state, a host removed leaves, a host whose worker
dies is blacklisted alone, rank 0's host lost hands rank 0 to another process, and a frozen worker
is evicted (docs/elastic.md#frozen-workers).

Every job is `horovodrun` elastic, its driver on h1 (it looks its interface up by name, so it runs
on a host), one slot per host, the discovery script reading a hosts file in the shared run area
that the test rewrites, `--network-interfaces data0` (left to choose, horovodrun may take mgmt0
for Gloo). The job's own record is rank 0's run_dir/elastic.jsonl: a "start" line after every
(re)start with each worker's rank, pid, host and weight digest, which the test reads while the job
runs to find the process to signal (pids are the machine's: the hosts share its pid namespace).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import pytest
from hosts import REPO, SCRIPT, Cluster

from hvd_train.core import launch

DISCOVER = str(REPO / "mpi_scripts" / "discover_hosts.sh")
JOB_TIMEOUT_S = 150
WAIT_S = 90  # for one event of a job


COMMIT_EVERY = 5  # steps: a commit every few tens of milliseconds


def train_argv(run_dir: Path, epochs: int, *settings: str) -> list[str]:
    return [
        *(jobs.PYTHON, "-m", "hvd_train.cli", "train", "--elastic"),
        *("--config", "configs/digits.yaml", "--set", f"run_dir={run_dir}"),
        *("--set", f"train.epochs={epochs}", "--set", f"elastic.commit_every_steps={COMMIT_EVERY}"),
        *("--set", "logging.tensorboard=false", "--set", "checkpoint.keep_last=2"),
        *(arg for setting in settings for arg in ("--set", setting)),
    ]


def write_hosts(path: Path, hosts: list[str]) -> None:
    """Replace the discovery file at once (horovodrun may run the script at any moment)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{host}:1\n" for host in hosts))
    tmp.replace(path)


class ElasticJob:
    """An elastic job across the cluster's hosts, driven from h1, and its elastic.jsonl."""

    def __init__(
        self,
        cluster: Cluster,
        pool: ThreadPoolExecutor,
        name: str,
        hosts: list[str],
        epochs: int,
        *settings: str,
        env: dict[str, str] | None = None,
    ) -> None:
        shared = cluster.state / "shared" / name
        shared.mkdir(parents=True)
        self.hosts_file, self.run_dir = shared / "hosts.txt", shared / "run"
        write_hosts(self.hosts_file, hosts)
        argv = launch.horovodrun_elastic_argv(
            len(hosts),
            train_argv(self.run_dir, epochs, *settings),
            min_np=1,
            max_np=3,
            discovery=[DISCOVER, str(self.hosts_file)],
        )
        argv[1:1] = ["--network-interfaces", "data0"]
        on_h1 = ["bash", str(SCRIPT), "exec", "h1", *argv]
        self._tag = ""
        self.future: Future = pool.submit(
            jobs.run,
            on_h1,
            timeout=JOB_TIMEOUT_S,
            env={**cluster.env(), **(env or {})},
            during=self._remember_tag,
        )

    def _remember_tag(self, proc: object, tag: str) -> None:
        self._tag = tag

    def stop(self) -> None:
        """End the job if it still runs (a test that failed: the next job waits for this one)."""
        if not self.future.done():
            for pid in jobs.tagged_pids(self._tag) if self._tag else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def events(self) -> list[dict]:
        path = self.run_dir / "elastic.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait(self, what: str, found) -> tuple[int, dict]:
        """The first (index, event) with found(index, event) true."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for i, event in enumerate(self.events()):
                if found(i, event):
                    return i, event
            if self.future.done():
                job = self.future.result()
                pytest.fail(f"the job ended (code {job.returncode}) before {what}:\n{job.tail()}")
            time.sleep(0.2)
        pytest.fail(f"no {what} within {WAIT_S}s; events: {self.events()[-5:]}")

    def start_after(self, index: int, what: str) -> tuple[int, dict]:
        return self.wait(what, lambda i, e: i > index and e["event"] == "start")

    def commit_after(self, index: int, what: str) -> int:
        return self.wait(what, lambda i, e: i > index and e["event"] == "commit")[0]

    def finish(self) -> jobs.Job:
        """The job, finished with exit 0 and one result line (from whichever process is rank 0)."""
        job = self.future.result()
        assert job.returncode == 0, job.tail()
        results = re.findall(r"^(?:\[\d+\]<stdout>:)?result (\{.*\})$", job.output, re.MULTILINE)
        assert len(results) == 1, job.tail()
        result = json.loads(results[0])
        assert result["epochs_done"] == result_epochs(self.run_dir), result
        return job


def result_epochs(run_dir: Path) -> int:
    """The epochs metrics.json records, each once and in order (whoever was rank 0)."""
    epochs = [r["epoch"] for r in json.loads((run_dir / "metrics.json").read_text())]
    assert epochs == list(range(1, len(epochs) + 1)), epochs
    return len(epochs)


def by_host(start: dict) -> dict[str, dict]:
    return {w["host"]: w for w in start["workers"]}


def pids(start: dict) -> dict[str, int]:
    return {w["host"]: w["pid"] for w in start["workers"]}


def resumed_from_the_last_commit(
    events: list[dict], index: int, recorder_lost: bool = False
) -> bool:
    """The start at `index` stands where the last commit before it did. With `recorder_lost` (rank
    0, which records each commit just after making it, was killed) it may stand at the next commit
    instead: one that every rank made but rank 0 died before recording (seen in CI)."""
    start = events[index]
    commit = next(e for e in reversed(events[:index]) if e["event"] == "commit")
    if [start[k] for k in ("epoch", "position", "updates")] == [
        commit[k] for k in ("epoch", "position", "updates")
    ]:
        return True
    return recorder_lost and start["updates"] == commit["updates"] + COMMIT_EVERY


def one_state(start: dict) -> bool:
    """Every worker holds the same weights after the sync."""
    return len({w["weights"] for w in start["workers"]}) == 1


def signal_worker(start: dict, host: str, signum: int) -> dict:
    worker = by_host(start)[host]
    os.kill(worker["pid"], signum)
    return worker


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(1) as executor:
        yield executor


@pytest.fixture
def elastic(cluster: Cluster, pool: ThreadPoolExecutor):
    """Start `ElasticJob`s on the session's cluster; any still running at the test's end is
    killed."""
    started: list[ElasticJob] = []

    def start(*args, **kwargs) -> ElasticJob:
        started.append(ElasticJob(cluster, pool, *args, **kwargs))
        return started[-1]

    yield start
    for job in started:
        job.stop()


def test_a_host_added_joins_with_the_current_state_and_a_host_removed_leaves(elastic):
    job = elastic("grow_shrink", ["h1", "h2"], 30)
    _, first = job.wait("the first start", lambda i, e: e["event"] == "start")
    assert sorted(by_host(first)) == ["h1", "h2"] and one_state(first)
    seen = job.commit_after(-1, "a commit")

    # h3 appears: it joins at a commit with the current state, the others in the same processes.
    write_hosts(job.hosts_file, ["h1", "h2", "h3"])
    at_join, grown = job.start_after(seen, "the start with h3")
    assert sorted(by_host(grown)) == ["h1", "h2", "h3"]
    assert {h: p for h, p in pids(grown).items() if h != "h3"} == pids(first)
    assert one_state(grown) and resumed_from_the_last_commit(job.events(), at_join)
    assert (grown["epoch"], grown["position"]) != (0, 0)  # it took the state, not a fresh start
    assert by_host(grown)["h3"]["rank"] == 2  # horovodrun keeps the older hosts first
    seen = job.commit_after(at_join, "a commit at 3 workers")

    # h2 goes from the discovery output: its worker leaves, h1 and h3 go on in the same processes.
    write_hosts(job.hosts_file, ["h1", "h3"])
    at_leave, shrunk = job.start_after(seen, "the start without h2")
    assert pids(shrunk) == {h: p for h, p in pids(grown).items() if h != "h2"}
    assert one_state(shrunk) and resumed_from_the_last_commit(job.events(), at_leave)
    done = job.finish()
    assert "hosts were added or removed" in done.output
    assert "a collective failed" not in done.output  # a removed host is not a failure
    assert [e["event"] for e in job.events()].count("start") == 3
    print(f"grow then shrink: {done.seconds:.0f} s")


def test_a_dead_host_is_blacklisted_alone_and_a_frozen_worker_is_evicted(elastic):
    # The freeze guard's bound at its shortest for this test: 5 s without running.
    job = elastic(
        "kill_freeze",
        ["h1", "h2", "h3"],
        20,  # both faults land in the first epochs; the rest runs on h1 alone (44 steps each)
        "fault.stall_floor_s=5",
        "fault.heartbeat_s=0.5",
    )
    _, first = job.wait("the first start", lambda i, e: e["event"] == "start")
    assert sorted(by_host(first)) == ["h1", "h2", "h3"] and one_state(first)
    seen = job.commit_after(-1, "a commit")

    # h2's worker dies: h2 alone is blacklisted (it stays in the discovery output), h1 and h3 go
    # on in the same processes from the last commit.
    signal_worker(first, "h2", signal.SIGKILL)
    at_kill, survivors = job.start_after(seen, "the start after the kill")
    assert pids(survivors) == {h: p for h, p in pids(first).items() if h != "h2"}
    assert one_state(survivors) and resumed_from_the_last_commit(job.events(), at_kill)
    seen = job.commit_after(at_kill, "a commit of the survivors")

    # h3's worker freezes: the freeze guard on h3 kills it, and h1 goes on alone (h2 stays out:
    # blacklisted for the rest of the job, though it is still listed).
    frozen_at = time.monotonic()
    signal_worker(survivors, "h3", signal.SIGSTOP)
    _, alone = job.start_after(seen, "the start after the freeze")
    evicted_s = time.monotonic() - frozen_at
    assert pids(alone) == {"h1": pids(first)["h1"]}
    assert evicted_s < 5 + 15, f"{evicted_s:.1f} s from SIGSTOP to the next start"
    done = job.finish()
    assert "freeze guard: process" in done.output and "a collective failed" in done.output
    assert all("h2" not in by_host(e) for e in job.events()[at_kill:] if e["event"] == "start")
    print(
        f"kill then freeze: {done.seconds:.0f} s; the frozen worker was replaced {evicted_s:.1f} s"
        " after SIGSTOP"
    )


def test_rank_0_lost_another_rank_takes_over_the_run_directory(elastic):
    # horovodrun ranks the first hosts in the order a Python set of their names iterates: with
    # hash seed 0 (CPython's string hash), {"h1", "h2"} iterates h1 first, so rank 0 is on h1.
    # (Starting from h1 alone does not work: horovodrun's driver then finds no interface for
    # 127.0.0.1, even with --network-interfaces.)
    job = elastic("lose_rank0", ["h1", "h2"], 30, env={"PYTHONHASHSEED": "0"})
    _, first = job.wait("the first start", lambda i, e: e["event"] == "start")
    assert by_host(first)["h1"]["rank"] == 0, first["workers"]
    seen = job.commit_after(-1, "a commit")

    # Only the worker: horovodrun's driver runs on h1 as well.
    chief = signal_worker(first, "h1", signal.SIGKILL)
    assert chief["rank"] == 0
    at_kill, after = job.start_after(seen, "the start after rank 0's loss")
    assert [(w["host"], w["rank"], w["pid"]) for w in after["workers"]] == [
        ("h2", 0, pids(first)["h2"])
    ]
    assert resumed_from_the_last_commit(job.events(), at_kill, recorder_lost=True), job.events()
    job.commit_after(at_kill, "a commit written by the new rank 0")
    done = job.finish()  # metrics.json: every epoch once, across both writers
    # horovodrun prefixes a worker's output with the rank it first had.
    assert "[1]<stdout>:result " in done.output
    print(f"rank 0 lost: {done.seconds:.0f} s")
