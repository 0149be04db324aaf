"""The job runner with real child processes: exit codes, timeouts that end the whole process
group, forwarded signals, captured output. Every child runs under a timeout of its own."""

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hvd_train.core import processes

PYTHON = sys.executable
BOUND_S = 30  # no test's child may run longer than this


def python(code: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which nobody may reap in a container, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_the_exit_status_is_returned():
    done = processes.run(python("raise SystemExit(3)"), timeout_s=BOUND_S)
    assert (done.returncode, done.exit_code, done.timed_out, done.ok) == (3, 3, False, False)
    assert done.outcome() == "exit 3"


def test_a_signal_that_ends_the_child_is_128_plus_its_number():
    done = processes.run(python("import os; os.kill(os.getpid(), 9)"), timeout_s=BOUND_S)
    assert (done.returncode, done.exit_code) == (-9, 137)
    assert done.outcome() == "killed by signal 9"


def test_output_is_captured_merged_or_separately():
    code = "import sys; print('to out', flush=True); print('to err', file=sys.stderr)"
    merged = processes.run(python(code), timeout_s=BOUND_S)
    assert merged.ok and merged.errors is None
    assert merged.output.splitlines() == ["to out", "to err"]
    separate = processes.run(python(code), timeout_s=BOUND_S, capture="separate")
    assert (separate.output, separate.errors) == ("to out\n", "to err\n")
    assert separate.tail(1) == "to err"


def test_a_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = f"""
        import subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(grandchild.pid))
        print("started", flush=True)
        time.sleep(600)
    """
    called = []
    start = time.monotonic()
    done = processes.run(python(code), timeout_s=3, on_timeout=lambda: called.append(True))
    assert time.monotonic() - start < BOUND_S
    assert done.timed_out and not done.ok and done.returncode == -signal.SIGKILL
    assert done.outcome(3) == "timed out after 3 s"
    assert called == [True]
    assert "started" in done.output
    grandchild = int(pid_file.read_text())
    assert wait_until(lambda: not alive(grandchild)), "the grandchild outlived the timeout"


def test_an_escaped_process_holding_the_output_counts_as_a_timeout(tmp_path):
    # The grandchild leaves the group (a session of its own) and keeps the output pipe open:
    # the job is not over until its output closes.
    pid_file = tmp_path / "escaped.pid"
    code = f"""
        import subprocess, sys
        escaped = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
        )
        open({str(pid_file)!r}, "w").write(str(escaped.pid))
    """

    def kill_escaped() -> None:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    done = processes.run(python(code), timeout_s=3, on_timeout=kill_escaped)
    assert done.timed_out and done.returncode == 0  # the child itself had exited
    assert wait_until(lambda: not alive(int(pid_file.read_text())))


def test_a_forwarded_sigterm_reaches_the_child_as_the_signal_asked_for(tmp_path):
    ready = tmp_path / "ready"
    code = f"""
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(7))
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """
    received = []

    def mine(signum, _frame):
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)  # should forwarding fail, pytest lives on
    try:

        def terminate_me(proc) -> int:
            assert wait_until(ready.exists), "the child never got ready"
            os.kill(os.getpid(), signal.SIGTERM)  # to this process, not to the child
            return proc.pid

        done = processes.run(
            python(code),
            timeout_s=BOUND_S,
            new_session=False,  # as `hvd-train launch` runs its launcher
            forward_signals={signal.SIGTERM: signal.SIGUSR1},
            during=terminate_me,
        )
        assert signal.getsignal(signal.SIGTERM) is mine  # this process's handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not done.timed_out
    assert done.exit_code == 7, done.tail()
    assert isinstance(done.during, int)
    assert received == []  # forwarded, not handled here


def test_what_during_raises_is_reported():
    def fails(proc):
        raise RuntimeError("from during")

    done = processes.run(python("import time; time.sleep(1)"), timeout_s=BOUND_S, during=fails)
    assert done.ok and isinstance(done.during, RuntimeError)


def test_run_all_shares_one_timeout_and_keeps_each_exit():
    quick, slow = python("raise SystemExit(2)"), python("import time; time.sleep(600)")
    start = time.monotonic()
    done = processes.run_all([quick, slow], [None, None], timeout_s=3)
    assert time.monotonic() - start < BOUND_S
    assert (done[0].returncode, done[0].timed_out) == (2, False)
    assert (done[1].timed_out, done[1].returncode) == (True, -signal.SIGKILL)


def test_run_all_reads_every_output_while_the_children_run():
    # Each writes more than a pipe holds before the other may exit: no child may block on it.
    code = "import sys; sys.stdout.write('x' * (1 << 20))"
    done = processes.run_all([python(code)] * 3, [None] * 3, timeout_s=BOUND_S)
    assert [len(d.output) for d in done] == [1 << 20] * 3


def test_child_env_puts_this_python_first_and_extra_last(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")
    env = processes.child_env({"A_NAME": "1"})
    assert env["PATH"].split(os.pathsep)[0] == str(Path(PYTHON).parent)
    assert (env["TF_CPP_MIN_LOG_LEVEL"], env["A_NAME"]) == ("2", "1")
    assert processes.child_env({"TF_CPP_MIN_LOG_LEVEL": "0"})["TF_CPP_MIN_LOG_LEVEL"] == "0"


def test_a_bad_capture_is_refused():
    with pytest.raises(ValueError, match="capture must be"):
        processes.run(python("pass"), timeout_s=BOUND_S, capture="stdout")
