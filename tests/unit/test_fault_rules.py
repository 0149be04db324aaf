"""Fault handling without a launcher: the stall rule, who did not arrive, the watchdog over real
UDP sockets (two watchdogs in one process), stop signals, checkpoint positions, exit codes."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from hvd_train import cli
from hvd_train.core import checkpoint, faults, guards, launch
from hvd_train.core.faults import Peer, StallRule


def test_stall_bound_is_the_startup_bound_until_a_step_then_follows_the_slowest_step():
    rule = StallRule(floor_s=60, factor=20, startup_s=600)
    assert rule.bound([], started=False) == 600
    assert rule.bound([0.5], started=False) == 600  # a new phase: tracing again
    assert rule.bound([0.1, 0.2], started=True) == 60  # 20 x 0.2 < the floor
    assert rule.bound([0.1, 5.0, 0.2], started=True) == 100  # 20 x the slowest
    assert "20 x slowest recent step 5.000 s" in rule.explain([5.0], started=True)


def test_laggards_are_the_silent_ranks_first_then_those_behind():
    alive = Peer(age_s=0.2, steps=10, busy=False)
    silent = Peer(age_s=9.0, steps=9, busy=False)
    ranks, why = faults.laggards({0: alive, 1: silent, 2: alive}, silence_s=5)
    assert ranks == [1] and "rank 1 (no heartbeat for 9.0 s, at step 9)" in why
    behind = Peer(age_s=0.2, steps=7, busy=False)
    ranks, why = faults.laggards({0: alive, 1: behind, 2: behind}, silence_s=5)
    assert ranks == [1, 2] and "alive, at step 7; others at up to 10" in why
    ranks, why = faults.laggards({0: alive, 1: alive}, silence_s=5)
    assert ranks == [] and "every rank is alive at step 10" in why


def make_pair(**rule):
    """Watchdogs of a two-rank job in this process; rank 0's stalls are collected, not fatal."""
    rule = StallRule(**{"floor_s": 0.5, "factor": 5, "startup_s": 30, **rule})
    stalls = {0: [], 1: []}
    sock0, address0 = faults.open_socket()
    sock1, _ = faults.open_socket()
    address0 = ("127.0.0.1", address0[1])
    dogs = [
        faults.Watchdog(r, 2, s, address0, rule, 0.05, on_stall=stalls[r].append)
        for r, s in ((0, sock0), (1, sock1))
    ]
    return dogs, stalls


def run_steps(dogs, n, seconds=0.01):
    for _ in range(n):
        time.sleep(seconds)
        for dog in dogs:
            dog.step_done()


def test_watchdog_names_a_rank_that_went_silent():
    (dog0, dog1), stalls = make_pair()
    dog0.phase("train"), dog1.phase("train")
    run_steps([dog0, dog1], 5)
    dog1.close()  # rank 1 freezes: no heartbeats, no steps
    deadline = time.monotonic() + 10
    while not stalls[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    dog0.close()
    assert len(stalls[0]) == 1, "rank 0's watchdog did not fire"
    message = stalls[0][0]
    assert "watchdog on rank 0: no step finished for" in message
    assert "bound 0.5 s = max(fault.stall_floor_s 0.5 s" in message
    assert "did not arrive: rank 1 (no heartbeat for" in message and ", at step " in message


def test_watchdog_stays_quiet_while_steps_finish_and_while_a_rank_is_busy():
    (dog0, dog1), stalls = make_pair()
    dog0.phase("train"), dog1.phase("train")
    run_steps([dog0, dog1], 60)  # 0.6 s of steady steps: longer than the bound
    with dog0.busy():
        time.sleep(1.5)  # rank 0 writes a long checkpoint; rank 1 waits for it
    run_steps([dog0, dog1], 5)
    dog0.close(), dog1.close()
    assert stalls == {0: [], 1: []}


def test_watchdog_on_another_rank_names_rank_0_when_it_goes_silent():
    (dog0, dog1), stalls = make_pair()
    dog0.phase("train"), dog1.phase("train")
    run_steps([dog0, dog1], 5)
    dog0.close()
    deadline = time.monotonic() + 10
    while not stalls[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    dog1.close()
    assert stalls[1] and "did not arrive: rank 0 (no heartbeat for" in stalls[1][0]


def test_lost_ranks_after_a_failed_collective():
    (dog0, dog1), _ = make_pair()
    run_steps([dog0, dog1], 3)
    assert dog0.lost_ranks(wait=False) is None
    dog1.close()
    assert "rank 1 (no heartbeat for" in dog0.lost_ranks()
    dog0.close()


def test_stop_request_only_records_the_signal():
    stop = faults.StopRequest(["USR1"])
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.signal_name == "SIGUSR1"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_checkpoints_order_by_training_position(tmp_path):
    values = [np.zeros(2, np.float32)]
    for epoch, step in [(1, 0), (0, 0), (1, 40), (2, 0), (1, 20)]:
        checkpoint.write(tmp_path, epoch, values, values, {}, step_in_epoch=step)
    names = [p.name for p in checkpoint.epochs_on_disk(tmp_path)]
    # "epoch-0001-step-...": inside epoch 1 (0-based), after epoch-0000 and before epoch-0001.
    assert names == [
        "epoch-0000",
        "epoch-0001-step-000020",
        "epoch-0001-step-000040",
        "epoch-0001",
        "epoch-0002",
    ]
    meta = checkpoint.verify(tmp_path / "epoch-0001-step-000040")
    assert meta["epoch"] == 0 and meta["epoch_step"] == 40  # resume: epoch 1, after 40 steps
    assert checkpoint.verify(tmp_path / "epoch-0001")["epoch_step"] == 0
    assert checkpoint.prune(tmp_path, 2)[-1].name == "epoch-0001-step-000040"


def test_launch_exit_code_comes_from_this_launch_status(tmp_path):
    status = tmp_path / "status.json"
    assert cli._launch_exit_code(1, status, time.time()) == 1  # no status: the launcher's
    for name, code in [("preempted", 75), ("stalled", 3), ("lost", 3), ("diverged", 4)]:
        status.write_text(json.dumps({"status": name, "time": time.time()}))
        assert cli._launch_exit_code(1, status, time.time() - 5) == code
    assert cli._launch_exit_code(1, status, time.time() + 5) == 1  # an older launch's status
    assert cli._launch_exit_code(0, status, 0) == 0


def test_mpirun_gets_usr1_for_a_stop_and_others_the_signal_itself():
    assert launch.forwarded_signal("mpirun", signal.SIGTERM) == signal.SIGUSR1
    assert launch.forwarded_signal("mpirun", signal.SIGUSR2) == signal.SIGUSR2
    assert launch.forwarded_signal("horovodrun", signal.SIGTERM) == signal.SIGTERM
    assert launch.forwarded_signal("srun", signal.SIGTERM) == signal.SIGTERM


def test_guards_name_the_first_differing_rank_and_item():
    same = guards.fingerprint({"a": 1}, {"tf": "2.21"}, [[3, 3]])
    guards.compare([same, same, same])
    other = guards.fingerprint({"a": 2}, {"tf": "2.21"}, [[3, 3]])
    with pytest.raises(guards.InconsistentRanks, match=r"rank\(s\) 2 differ from rank 0 in"):
        guards.compare([same, same, other])
    newer = guards.fingerprint({"a": 1}, {"tf": "2.22"}, [[3, 3]])
    with pytest.raises(guards.InconsistentRanks, match=r"in their versions .*install the same"):
        guards.compare([same, newer, same])


def test_watchdog_threads_do_not_outlive_close():
    (dog0, dog1), _ = make_pair()
    dog0.close(), dog1.close()
    assert not [t for t in threading.enumerate() if t.name == "hvd_train-watchdog"]
