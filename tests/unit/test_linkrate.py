"""The link-rate probe `--launcher auto` runs before a job (hvd_train.core.linkrate): its timing
against senders of known rate, a real receiver started over a remote shell, and its failures.
The rate of a shaped link between two hosts: tests/cluster/test_cluster.py."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time

import pytest

from hvd_train.core import linkrate
from hvd_train.core.environment import LauncherEnvironmentError

# A remote shell (as Open MPI's agent) that runs the command here, whatever the host.
HERE = shlex.split("sh -c 'eval \"$1\"'")


def _paced(megabytes_per_s: float, seconds: float) -> dict[str, float]:
    """What `receive` reports of a sender that sends 64 KiB chunks at `megabytes_per_s`."""
    chunk = 1 << 16
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)

        def send() -> None:
            with socket.create_connection(listener.getsockname()) as out:
                start = time.perf_counter()
                for sent in range(int(megabytes_per_s * 1e6 * seconds / chunk)):
                    due = start + sent * chunk / (megabytes_per_s * 1e6)
                    time.sleep(max(0.0, due - time.perf_counter()))
                    out.sendall(bytes(chunk))

        sender = threading.Thread(target=send)
        sender.start()
        got = linkrate.receive(listener)
        sender.join()
    return got


@pytest.mark.parametrize("megabytes_per_s", [20.0, 80.0])
def test_receive_reports_the_pace_of_its_sender_after_the_skipped_start(megabytes_per_s):
    got = _paced(megabytes_per_s, seconds=0.6)
    rate = got["bytes"] / got["seconds"] / 1e6
    # The first SKIP_S is left out: what is counted spans the rest of the 0.6 s.
    assert 0.6 - linkrate.SKIP_S - 0.1 < got["seconds"] < 0.6 - linkrate.SKIP_S + 0.1, got
    assert rate == pytest.approx(megabytes_per_s, rel=0.15), got


def test_receive_tells_senders_four_times_apart():
    # Negative control of the band above: a four times faster sender is far outside it.
    slow, fast = (_paced(r, seconds=0.4) for r in (20.0, 80.0))
    ratio = (fast["bytes"] / fast["seconds"]) / (slow["bytes"] / slow["seconds"])
    assert ratio == pytest.approx(4.0, rel=0.2)


def test_measure_sends_to_a_receiver_it_starts_over_the_remote_shell():
    rate = linkrate.measure("localhost", HERE, send_s=0.3)
    assert rate.host == "localhost" and rate.megabytes > 0
    assert 0.3 - linkrate.SKIP_S - 0.1 < rate.seconds < 0.3 + 0.5, rate
    assert rate.gbit_s == pytest.approx(rate.megabytes * 8 / 1000 / rate.seconds)
    # The receiver ended with its answer: nothing listens any more.
    done = subprocess.run(["pgrep", "-f", "hvd_train.core.linkrate"], capture_output=True)
    assert done.returncode == 1, done.stdout


def test_measure_names_a_host_without_an_address():
    with pytest.raises(LauncherEnvironmentError, match=r"host 'no-such-host\.invalid' does not"):
        linkrate.measure("no-such-host.invalid", HERE)


def test_measure_names_a_receiver_that_fails_to_start():
    with pytest.raises(LauncherEnvironmentError) as err:
        linkrate.measure("localhost", ["false"])
    assert "host localhost: the link-rate probe's receiver did not send its port (exit 1)" in str(
        err.value
    )


def test_measure_stops_a_receiver_that_never_answers(monkeypatch):
    monkeypatch.setattr(linkrate, "ANSWER_TIMEOUT_S", 1)
    # A remote shell that hangs, with a child of its own: both must be gone afterwards.
    hung = ["sh", "-c", "sleep 300 & wait", "hung"]
    start = time.monotonic()
    with pytest.raises(LauncherEnvironmentError, match=r"did not send its port .*no answer in 1 s"):
        linkrate.measure("localhost", hung)
    assert time.monotonic() - start < 10
    left = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True)
    assert left.returncode == 1, left.stdout


def test_the_module_measures_to_a_host_as_mpirun_reaches_it():
    env = {**os.environ, "OMPI_MCA_plm_rsh_agent": shlex.join(HERE)}
    argv = [sys.executable, "-m", "hvd_train.core.linkrate", "localhost"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["host"] == "localhost" and got["gbit_s"] > 0
    assert got["gbit_s"] == pytest.approx(got["megabytes"] * 8 / 1000 / got["seconds"], abs=1e-3)
    bad = subprocess.run([*argv[:3], "a", "b"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr == "usage: python -m hvd_train.core.linkrate HOST\n"


@pytest.mark.parametrize("hosts", range(2, 10))
def test_no_host_sends_and_receives_in_the_same_phase(hosts):
    phases = linkrate.send_phases(hosts)
    # Host i receives from host i - 1 in that host's phase.
    assert all(phases[i] != phases[i - 1] for i in range(hosts)), phases
    assert max(phases) + 1 == (2 if hosts % 2 == 0 else 3)  # each phase costs SEND_S
    assert linkrate.send_phases(1) == []


def test_receive_passes_over_a_connection_without_the_token():
    listener, token = linkrate.listen("127.0.0.1")
    with listener:
        port = listener.getsockname()[1]

        def stranger_then_sender() -> None:
            with socket.create_connection(("127.0.0.1", port)) as stranger:
                stranger.sendall(bytes(len(token)) + bytes(1 << 20))  # zeros: not the token
            linkrate.send("127.0.0.1", port, token, send_s=0.3)

        sender = threading.Thread(target=stranger_then_sender)
        sender.start()
        got = linkrate.receive(listener, token)
        sender.join()
    # What was counted is the sender's 0.3 s (less the skipped start), not the stranger's burst.
    assert 0.3 - linkrate.SKIP_S - 0.1 < got["seconds"] < 0.3 + 0.1, got
    assert got["bytes"] > 0


def test_receive_without_a_sender_ends_at_its_timeout():
    listener, token = linkrate.listen("127.0.0.1")
    listener.settimeout(0.5)
    start = time.monotonic()
    with listener, pytest.raises(TimeoutError):
        linkrate.receive(listener, token)
    assert time.monotonic() - start < 3
