"""The elastic freeze guard (`core.faults.FreezeGuard`): a stopped worker is killed by the child
on its host within its bound; a running one, however long it runs, is left alone."""

import signal
import subprocess
import sys
import time

# A worker: arms the guard, says so, then runs (sleeping in Python) until told to stop by stdin.
WORKER = """
import sys
from hvd_train.core.faults import FreezeGuard
guard = FreezeGuard(bound_s=1.5, heartbeat_s=0.1)
print("armed", flush=True)
sys.stdin.readline()
guard.close()
print("closed", flush=True)
"""


def _start() -> subprocess.Popen:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout.readline().strip() == "armed"
    return worker


def test_a_stopped_worker_is_killed_within_its_bound():
    worker = _start()
    worker.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        code = worker.wait(timeout=30)
    finally:
        worker.kill()
    assert code == -signal.SIGKILL
    assert time.monotonic() - started < 10  # the bound is 1.5 s
    assert "freeze guard: process" in worker.stderr.read()


def test_a_running_worker_outlives_the_bound_and_disarms_it():
    worker = _start()
    time.sleep(3.5)  # more than twice the bound, running
    out, err = worker.communicate("\n", timeout=30)
    assert worker.returncode == 0, err
    assert out.strip() == "closed" and "freeze guard" not in err
