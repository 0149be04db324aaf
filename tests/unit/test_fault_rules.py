"""Fault handling without a launcher: the stall rule, who did not arrive, the watchdog over real
UDP sockets (two watchdogs in one process; its token, send failures, rank 0's address), stop
signals, checkpoint positions, exit codes."""

import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from hvd_train import cli
from hvd_train.core import checkpoint, faults, guards, launch
from hvd_train.core.environment import LauncherEnvironmentError
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
    summary = faults.summarize({0: alive, 1: silent, 2: alive}, silence_s=5)
    assert summary.culprits == [1] and "rank 1 (no heartbeat for 9.0 s, at step 9)" in summary.why()
    behind = Peer(age_s=0.2, steps=7, busy=False)
    summary = faults.summarize({0: alive, 1: behind, 2: behind}, silence_s=5)
    assert summary.culprits == [1, 2] and "alive, at step 7; others at up to 10" in summary.why()
    summary = faults.summarize({0: alive, 1: alive}, silence_s=5)
    assert summary.culprits == [] and "every rank is alive at step 10" in summary.why()


def make_pair(**rule):
    """Watchdogs of a two-rank job in this process; rank 0's stalls are collected, not fatal."""
    rule = StallRule(**{"floor_s": 0.5, "factor": 5, "startup_s": 30, **rule})
    stalls = {0: [], 1: []}
    sock0, contact = faults.open_socket(0, spans_hosts=False)
    sock1, _ = faults.open_socket(1, spans_hosts=False)
    dogs = [
        faults.Watchdog(r, 2, s, contact, rule, 0.05, on_stall=stalls[r].append)
        for r, s in ((0, sock0), (1, sock1))
    ]
    return dogs, stalls, contact


def run_steps(dogs, n, seconds=0.01):
    for _ in range(n):
        time.sleep(seconds)
        for dog in dogs:
            dog.step_done()


def test_watchdog_names_a_rank_that_went_silent():
    (dog0, dog1), stalls, _ = make_pair()
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
    (dog0, dog1), stalls, _ = make_pair()
    dog0.phase("train"), dog1.phase("train")
    run_steps([dog0, dog1], 60)  # 0.6 s of steady steps: longer than the bound
    with dog0.busy():
        time.sleep(1.5)  # rank 0 writes a long checkpoint; rank 1 waits for it
    run_steps([dog0, dog1], 5)
    dog0.close(), dog1.close()
    assert stalls == {0: [], 1: []}


def test_watchdog_on_another_rank_names_rank_0_when_it_goes_silent():
    (dog0, dog1), stalls, _ = make_pair()
    dog0.phase("train"), dog1.phase("train")
    run_steps([dog0, dog1], 5)
    dog0.close()
    deadline = time.monotonic() + 10
    while not stalls[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    dog1.close()
    assert stalls[1] and "did not arrive: rank 0 (no heartbeat for" in stalls[1][0]


def test_lost_ranks_after_a_failed_collective():
    (dog0, dog1), *_ = make_pair()
    run_steps([dog0, dog1], 3)
    assert dog0.lost_ranks(wait=False) is None
    dog1.close()
    assert "rank 1 (no heartbeat for" in dog0.lost_ranks()
    dog0.close()


@contextlib.contextmanager
def watchdog_warnings():
    """The warnings the watchdog logs (on the "hvd_train" logger) while the block runs."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("hvd_train")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_datagrams_without_the_jobs_token_are_ignored_and_counted():
    def rank_1_gone_and_someone_sends_as_rank_1(token_of):
        (dog0, dog1), stalls, contact = make_pair()
        dog0.phase("train"), dog1.phase("train")
        run_steps([dog0, dog1], 5)
        dog1.close()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
            heartbeat = faults.pack_heartbeat(token_of(contact), 1, 10**6, False)
            deadline = time.monotonic() + 10
            while not stalls[0] and time.monotonic() < deadline:
                stray.sendto(heartbeat, (contact.host, contact.port))
                stray.sendto(b"not a heartbeat", (contact.host, contact.port))
                time.sleep(0.02)
        dog0.close()
        return stalls[0][0], dog0.traffic

    with watchdog_warnings() as warnings:
        message, traffic = rank_1_gone_and_someone_sends_as_rank_1(
            lambda contact: bytes(b ^ 0xFF for b in contact.token)  # another job's token
        )
    assert "did not arrive: rank 1 (no heartbeat for" in message, message
    assert traffic.ignored >= 20 and traffic.received >= 1  # rank 1's own, before it went
    assert [w.getMessage().split(" (the first")[0] for w in warnings] == [
        "watchdog on rank 0: ignoring datagrams that are not this job's"
    ]
    # Negative control: the same heartbeats with the job's token are taken as rank 1's.
    message, traffic = rank_1_gone_and_someone_sends_as_rank_1(lambda contact: contact.token)
    assert "rank 1 (no heartbeat" not in message and "rank 0 (alive, at step 5;" in message
    assert traffic.ignored >= 10  # the malformed ones only


def test_a_send_failure_is_counted_and_logged_once():
    sock, _ = faults.open_socket(1, spans_hosts=False)
    # The broadcast address without SO_BROADCAST: every sendto fails at once (EACCES).
    nowhere = faults.Contact("255.255.255.255", 9, b"\0" * faults.TOKEN_BYTES)
    with watchdog_warnings() as warnings:
        dog = faults.Watchdog(1, 2, sock, nowhere, StallRule(0.5, 5, 30), 0.02, on_stall=print)
        deadline = time.monotonic() + 10
        while dog.traffic.send_failures < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        dog.close()
    assert dog.traffic.send_failures >= 5 and dog.traffic.sent == 0
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    assert "rank 1: sending to 255.255.255.255:9 failed" in warnings[0].getMessage()
    # Negative control: a pair that can reach each other logs nothing and fails nothing.
    with watchdog_warnings() as warnings:
        (dog0, dog1), *_ = make_pair()
        run_steps([dog0, dog1], 10)
        dog0.close(), dog1.close()
    assert warnings == [] and dog0.traffic.send_failures == dog1.traffic.send_failures == 0
    assert dog0.traffic.sent > 0 and dog1.traffic.sent > 0


def test_rank_0_listens_where_the_user_says_and_warns_on_loopback_across_hosts():
    chief = faults.chief_address
    assert chief({"HVD_TRAIN_WATCHDOG_HOST": "192.0.2.77"}, True) == (
        "192.0.2.77",
        "HVD_TRAIN_WATCHDOG_HOST",
    )
    named = {"HVD_TRAIN_WATCHDOG_IFACE": "lo", "HOROVOD_GLOO_IFACE": "lo"}
    assert chief(named, True) == ("127.0.0.1", "interface lo, from HVD_TRAIN_WATCHDOG_IFACE")
    assert chief({"HOROVOD_GLOO_IFACE": "eth0"}, False) == (
        "127.0.0.1",
        "every rank runs on this host",
    )
    with pytest.raises(LauncherEnvironmentError, match=r"IFACE='nosuch9' matches no interface"):
        chief({"HVD_TRAIN_WATCHDOG_IFACE": "nosuch9"}, True)
    # Across hosts, a launcher's loopback is passed over (whatever else this host offers).
    address, how = chief({"HOROVOD_GLOO_IFACE": "lo", "NCCL_SOCKET_IFNAME": "lo"}, True)
    assert not ipaddress.ip_address(address).is_loopback or how == "no other address found"
    # Loopback in a job that spans hosts: never silent.
    with watchdog_warnings() as warnings:
        sock, contact = faults.open_socket(0, True, {"HVD_TRAIN_WATCHDOG_HOST": "127.0.0.1"})
        sock.close()
    assert contact.host == "127.0.0.1" and len(contact.token) == faults.TOKEN_BYTES
    assert len(warnings) == 1 and "listens on 127.0.0.1:" in warnings[0].getMessage()
    assert "a loopback address, but the job spans hosts" in warnings[0].getMessage()
    with watchdog_warnings() as warnings:
        sock, again = faults.open_socket(0, False, {})
        sock.close()
    assert warnings == [] and again.token != contact.token  # a token per job


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
    same = guards.job_fingerprint({"a": 1}, {"tf": "2.21"})
    guards.compare([same, same, same])
    other = guards.job_fingerprint({"a": 2}, {"tf": "2.21"})
    with pytest.raises(guards.InconsistentRanks, match=r"rank\(s\) 2 differ from rank 0 in") as err:
        guards.compare([same, same, other])
    assert err.value.everywhere  # shown once, by rank 0
    newer = guards.job_fingerprint({"a": 1}, {"tf": "2.22"})
    with pytest.raises(guards.InconsistentRanks, match=r"in their versions .*install the same"):
        guards.compare([same, newer, same])
    model = guards.model_fingerprint([[3, 3]])
    with pytest.raises(guards.InconsistentRanks, match=r"rank\(s\) 1 .* model variable shapes"):
        guards.compare([model, guards.model_fingerprint([[3, 4]])])


def test_watchdog_threads_do_not_outlive_close():
    (dog0, dog1), *_ = make_pair()
    dog0.close(), dog1.close()
    assert not [t for t in threading.enumerate() if t.name == "hvd_train-watchdog"]
