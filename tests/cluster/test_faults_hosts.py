"""Faults across hosts: a rank on h2 killed or frozen, h2's links down or dropping everything,
and another TensorFlow on h2 (docs/failure-modes.md, docs/cluster.md#faults-across-hosts).

Every job runs from the root namespace under `hvd-train launch` (mpirun over the cluster's ssh),
with rank 0 on h1 and rank 1 on h2, through `jobs.run` (a hard timeout; processes tagged with the
job's id that outlive it fail the test). A fault hits once the run has written a step checkpoint
inside epoch 2, so it lands mid-epoch. Afterwards every host must run its daemons alone: the ranks,
Open MPI's orted and ssh sessions are all gone, the frozen rank and the one cut off included.
Each link or qdisc changed is put back in a `finally`, so the session's cluster stays usable.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import pytest
from hosts import REPO, Cluster, on_host

from hvd_train.core import launch
from hvd_train.core.outcome import EXIT_RANK_FAILED, EXIT_USAGE

HVD_TRAIN = [jobs.PYTHON, "-m", "hvd_train.cli"]
CLASSIC_PYTHON = str(REPO / ".venv-classic" / "bin" / "python")
# 179 steps an epoch on 2 ranks of 4: a step checkpoint at step 20 of epoch 2 leaves more than
# 150 steps of training after it, so the fault lands inside an epoch. The fastest watchdog the
# product allows for this job: a 4 s stall floor, heartbeats every 0.5 s (silent after 2.5 s).
TRAIN = [
    "train",
    "--config",
    "configs/digits.yaml",
    "--set",
    "train.epochs=6",
    "--set",
    "train.per_rank_batch_size=4",
    "--set",
    "optimizer.warmup_epochs=0",
    "--set",
    "checkpoint.every_steps=20",
    "--set",
    "logging.tensorboard=false",
    "--set",
    "fault.stall_floor_s=4",
    "--set",
    "fault.heartbeat_s=0.5",
]
# Seconds from the fault to the job's end (docs/failure-modes.md): the 4 s stall bound, 2.5 s of
# silence, the launcher's teardown across hosts, on 2 busy cores.
BOUND_S = 30
# A host cut off: the same, or, where the launcher waits on the lost host's daemon (mpirun does
# when Open MPI's own channel crosses the cut link), `hvd-train launch` kills it
# LAUNCHER_TEARDOWN_S after rank 0's watchdog line.
CUT_BOUND_S = 4 + launch.LAUNCHER_TEARDOWN_S + 10
# After the job: how long the hosts' orted and ssh sessions may take to go.
SETTLE_S = 15


def _left_on_hosts(cluster: Cluster) -> dict[str, list[str]]:
    """Each host's processes other than its daemons (empty lists when the hosts are clean)."""
    return {
        host: [p for p in _netns_pids(host) if p not in cluster.daemons[host]]
        for host in cluster.hosts
    }


def _netns_pids(host: str) -> list[str]:
    done = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, timeout=30)
    return done.stdout.split()


def assert_hosts_clean(cluster: Cluster, job: jobs.Job, settle_s: float = SETTLE_S) -> float:
    """Wait until every host runs its daemons alone; the seconds that took after the job ended."""
    start = time.monotonic()
    while any((left := _left_on_hosts(cluster)).values()):
        if time.monotonic() - start > settle_s:
            described = {
                host: [_describe(pid) for pid in pids] for host, pids in left.items() if pids
            }
            raise AssertionError(f"processes left on the hosts: {described}\n{job.tail()}")
        time.sleep(0.2)
    return time.monotonic() - start


def _describe(pid: str) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return pid
    return f"{pid} {cmdline.decode(errors='replace')[:120]}"


def launch_train(cluster: Cluster, name: str, fault: Callable[[str], object]) -> tuple:
    """The job across h1 and h2, with `fault(tag)` once it has written a step checkpoint inside
    epoch 2; (the job, seconds from the fault to the job's end)."""
    run_dir = cluster.state / "shared" / name

    def act(proc: subprocess.Popen, tag: str) -> float:
        jobs.wait_for(
            lambda: next(iter((run_dir / "checkpoints").glob("epoch-0001-step-*")), None),
            240,
            "a checkpoint inside epoch 2",
        )
        fault(tag)
        return time.monotonic()

    argv = [*HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1", "--", *TRAIN]
    started = time.monotonic()
    job = jobs.run(
        [*argv, "--set", f"run_dir={run_dir}"], timeout=300, env=cluster.env(), during=act
    )
    assert isinstance(job.during, float), f"the fault did not happen: {job.during!r}\n{job.tail()}"
    return job, started + job.seconds - job.during


# --- a rank on h2 killed or frozen ----------------------------------------------------------------


def signal_rank_1(signum: int) -> Callable[[str], None]:
    def fault(tag: str) -> None:
        pid = jobs.wait_for(lambda: jobs.rank_pid(tag, 1), 30, "rank 1's process")
        assert str(pid) in _netns_pids("h2")  # it runs on h2
        os.kill(pid, signum)

    return fault


def test_a_killed_rank_on_h2_ends_the_job_naming_it_and_its_host(cluster: Cluster):
    job, seconds = launch_train(cluster, "kill", signal_rank_1(signal.SIGKILL))

    # mpirun reports the rank's signal as the job's exit: 128 + 9 (docs/failure-modes.md).
    assert job.returncode == 128 + signal.SIGKILL, job.tail()
    assert seconds < BOUND_S, f"{seconds:.1f} s from the kill to the job's end\n{job.tail()}"
    assert re.search(r"process rank 1 with PID \d+ on node h2 exited on signal 9", job.output), (
        job.tail()
    )
    settled = assert_hosts_clean(cluster, job)
    print(f"SIGKILL of rank 1 on h2: job ended {seconds:.1f} s later, hosts clean +{settled:.1f} s")


def test_a_frozen_rank_on_h2_is_named_with_its_host_and_the_job_ends(cluster: Cluster):
    job, seconds = launch_train(cluster, "stop", signal_rank_1(signal.SIGSTOP))

    assert job.returncode == EXIT_RANK_FAILED, job.tail()
    assert seconds < BOUND_S, f"{seconds:.1f} s from the freeze to the job's end\n{job.tail()}"
    line = next((x for x in job.output.splitlines() if "watchdog on rank 0" in x), job.tail())
    assert "did not arrive: rank 1 on 198.18.1.2 (no heartbeat for" in line, line
    status = json.loads((cluster.state / "shared" / "stop" / "status.json").read_text())
    assert status["status"] == "stalled"
    settled = assert_hosts_clean(cluster, job)  # the stopped rank too
    print(f"SIGSTOP of rank 1 on h2: exit 3 {seconds:.1f} s later, clean +{settled:.1f} s: {line}")


# --- h2's links down, or dropping everything --------------------------------------------------


def _links(host: str, which: str) -> list[str]:
    """The root-namespace ends (the switch's ports) of `host`'s links: data, or all."""
    n = host.removeprefix("h")
    return [f"hvdc-h{n}d"] + ([f"hvdc-h{n}m"] if which == "all" else [])


@contextlib.contextmanager
def links_down(host: str, which: str) -> Iterator[Callable[[str], None]]:
    """A fault that sets `host`'s links down at the switch (a cable pulled); put back after."""
    links = _links(host, which)

    def fault(tag: str) -> None:
        for link in links:
            subprocess.run(["ip", "link", "set", link, "down"], check=True, timeout=30)

    try:
        yield fault
    finally:
        for link in links:
            subprocess.run(["ip", "link", "set", link, "up"], check=True, timeout=30)


# A token bucket of 1 byte passes no packet: each is larger than the bucket, and tbf drops what
# can never fit (the kernel has no netem to drop with). Checked below on each end alone.
DROP_ALL = ["tbf", "rate", "1kbit", "burst", "1", "latency", "1ms"]


def tc(where: str, *argv: str) -> str:
    """`tc argv` in the root namespace ("") or on host `where`."""
    if where:
        return on_host(where, "tc", *argv)
    return subprocess.run(
        ["tc", *argv], check=True, capture_output=True, text=True, timeout=30
    ).stdout


@contextlib.contextmanager
def links_dropping(host: str, which: str) -> Iterator[Callable[[str], None]]:
    """A fault that makes `host`'s links (data, or all) drop every packet, both ways: a qdisc on
    the host's end (what it sends) and on the switch's end (what it receives); taken off after."""
    n = host.removeprefix("h")
    names = [("data0", f"hvdc-h{n}d")] + ([("mgmt0", f"hvdc-h{n}m")] if which == "all" else [])
    ends = [end for inside, outside in names for end in ((host, inside), ("", outside))]
    before = [tc(where, "qdisc", "show", "dev", dev) for where, dev in ends]

    def fault(tag: str) -> None:
        for where, dev in ends:
            tc(where, "qdisc", "replace", "dev", dev, "root", *DROP_ALL)

    try:
        yield fault
    finally:
        for where, dev in ends:
            if "tbf" in tc(where, "qdisc", "show", "dev", dev):
                tc(where, "qdisc", "del", "dev", dev, "root")
        assert [tc(where, "qdisc", "show", "dev", dev) for where, dev in ends] == before


def sent_and_dropped(where: str, dev: str) -> tuple[int, int]:
    """Packets the root qdisc of `dev` sent and dropped."""
    shown = tc(where, "-s", "qdisc", "show", "dev", dev)
    found = re.search(r"Sent \d+ bytes (\d+) pkt \(dropped (\d+),", shown)
    assert found, shown
    return int(found[1]), int(found[2])


# A TCP connection attempt to a closed port: "refused" when the SYN gets there and the RST back.
PROBE = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], 9), timeout=1)\n"
    "except ConnectionRefusedError:\n"
    "    print('refused')\n"
    "except OSError as err:\n"
    "    print('unreachable', err)\n"
)


def probe(source: str, address: str) -> str:
    return on_host(source, jobs.PYTHON, "-c", PROBE, address).split()[0]


def test_a_drop_all_qdisc_drops_every_packet_on_each_end_alone(cluster: Cluster):
    """The fault the tests below use, checked: either end's qdisc alone cuts the data link."""
    assert probe("h1", "198.18.1.2") == "refused"
    for where, dev in (("h2", "data0"), ("", "hvdc-h2d")):
        tc(where, "qdisc", "replace", "dev", dev, "root", *DROP_ALL)
        try:
            assert probe("h1", "198.18.1.2") == "unreachable"
            assert probe("h2", "198.18.1.1") == "unreachable"
            sent, dropped = sent_and_dropped(where, dev)
            assert sent == 0 and dropped > 0, (where, dev, sent, dropped)
        finally:
            tc(where, "qdisc", "del", "dev", dev, "root")
    assert probe("h1", "198.18.1.2") == "refused"


FAULTS = {"down": links_down, "drops": links_dropping}


# (how, which links): CI's 90 minutes take one of each; `make test-full` every pair.
CUTS = [("down", "data"), ("drops", "all"), ("down", "all"), ("drops", "data")]


@pytest.mark.parametrize(
    ("how", "which"),
    [
        pytest.param(how, which, id=f"{how}-{which}", marks=() if i < 2 else jobs.FULL_ONLY)
        for i, (how, which) in enumerate(CUTS)
    ],
)
def test_h2_cut_off_ends_the_job_naming_it_and_leaves_nothing(cluster, how, which):
    name = f"cut-{how}-{which}"
    with FAULTS[how]("h2", which) as fault:
        job, seconds = launch_train(cluster, name, fault)
        # Every rank has exited (jobs.run: nothing tagged is left), h2's still cut off: rank 1
        # ended on its own, its watchdog no longer hearing rank 0.
    assert job.returncode == EXIT_RANK_FAILED, job.tail()
    assert seconds < CUT_BOUND_S, f"{seconds:.1f} s from the cut to the job's end\n{job.tail()}"
    line = next((x for x in job.output.splitlines() if "watchdog on rank 0" in x), job.tail())
    assert "did not arrive: rank 1 on 198.18.1.2 (no heartbeat for" in line, line
    status = json.loads((cluster.state / "shared" / name / "status.json").read_text())
    assert status["status"] == "stalled"
    settled = assert_hosts_clean(cluster, job)
    killed = "killing it" in job.output  # hvd-train launch ended a launcher left waiting
    print(f"h2 {how} ({which}): exit 3 {seconds:.1f} s later, launcher killed: {killed}, hosts "
          f"clean +{settled:.1f} s: {line}")  # fmt: skip


# --- another TensorFlow on h2 -----------------------------------------------------------------


def test_another_tensorflow_on_h2_is_refused_at_start_naming_what_differs(cluster: Cluster):
    run_dir = cluster.state / "shared" / "skew"
    train = [*TRAIN, "--set", f"run_dir={run_dir}"]
    # MPMD: rank 0 on h1 with the modern stack, rank 1 on h2 with the classic one.
    argv = launch.build("mpirun", 1, [*HVD_TRAIN, *train], hosts=["h1:1"])
    argv += [":", "-np", "1", "-H", "h2:1", CLASSIC_PYTHON, "-m", "hvd_train.cli", *train]
    job = jobs.run(argv, timeout=180, env=cluster.env())

    assert job.returncode == EXIT_USAGE, job.tail()
    errors = [line for line in job.output.splitlines() if "hvd-train: error:" in line]
    assert len(errors) == 1, job.tail()
    assert errors[0].startswith(
        "hvd-train: error: rank(s) 1 on h2 differ from rank 0 on h1 in their versions ("
    ), errors[0]
    assert re.search(r"tensorflow 2\.15\.\d+ vs 2\.21\.\d+", errors[0]), errors[0]
    assert not (run_dir / "checkpoints").exists()
    settled = assert_hosts_clean(cluster, job)
    print(f"TF 2.15 on h2: exit 2 after {job.seconds:.1f} s, clean +{settled:.1f} s: {errors[0]}")
