"""Faults across hosts without a cluster: the watchdog's addresses of silent ranks, the guards'
host names of ranks that differ, and `hvd-train launch` ending a launcher left waiting on a lost
host (the jobs themselves: tests/cluster/test_faults_hosts.py)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_train.core import faults, guards, launch
from hvd_train.core.faults import Peer


def test_why_names_the_address_of_the_ranks_it_is_given():
    alive = Peer(age_s=0.2, steps=10, busy=False)
    silent = Peer(age_s=9.0, steps=9, busy=False)
    summary = faults.summarize({0: alive, 1: silent, 2: silent}, silence_s=5)
    assert summary.why({1: "10.1.0.8"}) == (
        "rank 1 on 10.1.0.8 (no heartbeat for 9.0 s, at step 9), "
        "rank 2 (no heartbeat for 9.0 s, at step 9)"
    )
    assert summary.why() == summary.why({}) == summary.why({0: "10.1.0.7"})
    chief = summary.with_silent_chief(6.0).why({0: "10.1.0.7"})
    assert chief.startswith("rank 0 on 10.1.0.7 (no heartbeat for 6.0 s, at step 10), rank 1 (")
    behind = faults.summarize({0: alive, 1: Peer(0.2, 7, False)}, silence_s=5)
    assert behind.why({1: "10.1.0.8"}).startswith("rank 1 on 10.1.0.8 (alive, at step 7;")


def test_the_summary_datagram_does_not_grow_with_addresses():
    silent = {r: Peer(age_s=9.0, steps=9, busy=False) for r in range(1, 40)}
    summary = faults.summarize({0: Peer(0.2, 10, False), **silent}, silence_s=5)
    assert len(summary.pack(b"t" * faults.TOKEN_BYTES)) == faults.MAX_DATAGRAM


def test_guards_name_what_differs_and_the_hosts_when_the_job_spans_hosts():
    modern = guards.job_fingerprint({"a": 1}, {"tensorflow": "2.21.0", "keras": "3.15.1"})
    classic = guards.job_fingerprint({"a": 1}, {"tensorflow": "2.15.1", "keras": "2.15.0"})
    prints = [modern, classic, classic, modern]
    with pytest.raises(guards.InconsistentRanks) as err:
        guards.compare(prints, hosts=["h1", "h2", "h2", "h3"])
    assert str(err.value) == (
        "rank(s) 1, 2 on h2 differ from rank 0 on h1 in their versions (tensorflow 2.15.1 vs "
        "2.21.0, keras 2.15.0 vs 3.15.1): install the same TensorFlow, Keras, Horovod and "
        "hvd_train on every host"
    )
    with pytest.raises(guards.InconsistentRanks, match=r"^rank\(s\) 1, 2 differ from rank 0 in"):
        guards.compare(prints, hosts=["h1"] * 4)  # one host: none named
    other = guards.job_fingerprint({"a": 2}, {"tensorflow": "2.21.0", "keras": "3.15.1"})
    with pytest.raises(guards.InconsistentRanks, match=r"^rank\(s\) 1 on h2 differ from rank 0 on"):
        guards.compare([modern, other], hosts=["h1", "h2"])


def test_a_rank_ending_the_job_starts_the_launchers_teardown_clock():
    for line in (
        "[1,0]<stderr>:hvd-train: error: lost rank 1 (no heartbeat for 2.7 s, at step 2)\n",
        "hvd-train: watchdog on rank 0: no step finished for 4.2 s (bound 4.0 s = ...); did not "
        "arrive: rank 1 on 198.18.1.2 (no heartbeat for 4.5 s, at step 9); aborting the job "
        "(exit 3)\n",
    ):
        shown = launch.LaunchOutput()
        stream = shown.stream()
        assert stream.line("Epoch 2/6\n") == "Epoch 2/6\n" and not shown.job_ending.is_set()
        assert stream.line(line) == line and shown.job_ending.is_set()


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_launcher_outliving_the_job_is_killed_with_what_it_started(monkeypatch):
    monkeypatch.setattr(launch, "LAUNCHER_TEARDOWN_S", 0.5)
    # A "launcher" with a child of its own (an ssh client to a lost host), both hanging.
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); "
         "time.sleep(60)"],
    )  # fmt: skip
    time.sleep(0.5)
    (child,) = launch._descendants(launcher.pid)
    shown = launch.LaunchOutput()
    watch = launch._end_if_late(shown, "mpirun")
    shown.job_ending.set()
    started = time.monotonic()
    assert watch(launcher) is True
    assert launcher.wait(5) == -9 and time.monotonic() - started < 3
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_launcher_that_ends_in_time_is_left_alone():
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    shown = launch.LaunchOutput()
    shown.job_ending.set()
    assert launch._end_if_late(shown, "mpirun")(launcher) is False
    quiet = subprocess.Popen([sys.executable, "-c", "pass"])
    assert launch._end_if_late(launch.LaunchOutput(), "mpirun")(quiet) is False
