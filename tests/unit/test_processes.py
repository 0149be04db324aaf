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


class Recorder(processes.LineFilter):
    """Drops lines that say "drop", shows the others; remembers every call, in order."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def line(self, text: str) -> str:
        self.calls.append((self.name, text))
        return "" if "drop" in text else text

    def end(self) -> str:
        self.calls.append((self.name, None))
        return f"[{self.name} ended]\n"


def test_a_filtered_stream_is_shown_line_by_line_as_it_arrives(tmp_path, capfd):
    seen = tmp_path / "seen"
    code = f"""
        import os, sys, time
        sys.stdout.write("to stdout, unfiltered\\n"); sys.stdout.flush()
        sys.stderr.write("one\\ndrop me\\n"); sys.stderr.flush()
        for _ in range(200):  # until the filter has shown "one", or 10 s
            if os.path.exists({str(seen)!r}):
                break
            time.sleep(0.05)
        sys.stderr.write(("two" if os.path.exists({str(seen)!r}) else "too late") + "\\r50%\\r")
        time.sleep(1)  # an unfinished line is shown after a pause
        sys.stderr.write("unfinished"); sys.stderr.flush()
        time.sleep(1)
        sys.stderr.write(" line\\r\\nlast, no newline")
    """
    calls = []

    class Marks(Recorder):
        def line(self, text: str) -> str:
            if text == "one\n":
                seen.touch()
            return super().line(text)

    done = processes.run(
        python(code), timeout_s=BOUND_S, capture=None, stderr_filter=Marks("err", calls)
    )
    assert done.ok and (done.output, done.errors) == (None, None)
    assert calls == [
        ("err", "one\n"),
        ("err", "drop me\n"),
        ("err", "two\r"),
        ("err", "50%\r"),
        ("err", "unfinished"),
        ("err", " line\r\n"),
        ("err", "last, no newline"),
        ("err", None),
    ]
    shown = capfd.readouterr()
    assert shown.out == "to stdout, unfiltered\n"  # the child's own, inherited
    assert shown.err == "one\ntwo\r50%\runfinished line\r\nlast, no newline[err ended]\n"


def test_every_filter_ends_after_both_streams_did_and_bytes_come_back_unchanged(capfdbinary):
    code = r"""
        import sys
        for i in range(3):
            sys.stdout.buffer.write(b"out %d \xff\n" % i); sys.stdout.flush()
            sys.stderr.buffer.write(b"err %d \xc3\xa9\n" % i); sys.stderr.flush()
    """
    calls = []
    done = processes.run(
        python(code),
        timeout_s=BOUND_S,
        capture=None,
        stdout_filter=Recorder("out", calls),
        stderr_filter=Recorder("err", calls),
    )
    assert done.ok
    ends = [i for i, (_, text) in enumerate(calls) if text is None]
    assert len(calls) == 8 and ends == [6, 7]  # out's end, then err's, after every line
    assert ("out", "out 0 \udcff\n") in calls  # an undecodable byte, kept as a surrogate
    shown = capfdbinary.readouterr()
    assert shown.out == b"out 0 \xff\nout 1 \xff\nout 2 \xff\n[out ended]\n"
    assert shown.err == "err 0 é\nerr 1 é\nerr 2 é\n[err ended]\n".encode()


def test_a_failing_filter_leaves_the_output_unfiltered_and_is_raised_at_the_end(capfd):
    class Fails(processes.LineFilter):
        def line(self, text: str) -> str:
            if "boom" in text:
                raise RuntimeError("filter bug")
            return ""

    code = "import sys; sys.stderr.write('hidden\\nboom\\nafter\\n')"
    with pytest.raises(RuntimeError, match="filter bug"):
        processes.run(python(code), timeout_s=BOUND_S, capture=None, stderr_filter=Fails())
    assert capfd.readouterr().err == "boom\nafter\n"


def test_a_filter_needs_the_stream_uncaptured():
    with pytest.raises(ValueError, match="capture=None"):
        processes.run(python("pass"), timeout_s=BOUND_S, stderr_filter=processes.LineFilter())


def test_after_ctrl_c_a_child_in_this_session_is_still_shown_until_it_ends(tmp_path):
    # A supervisor in a session of its own runs a child in its session, its stderr filtered; INT
    # to that session (a terminal's Ctrl-C) reaches both: the child says goodbye after a while.
    ready = tmp_path / "ready"
    supervisor = f"""
        import signal, sys
        from hvd_train.core import processes
        # Ctrl-C raises KeyboardInterrupt, as where a terminal starts Python, even when this test
        # runs as a shell's background job, which starts with INT ignored (inherited).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        child = '''
        import signal, sys, time
        def bye(*_):
            time.sleep(0.5)
            sys.stderr.write("child: bye\\\\n")
            sys.exit(5)
        signal.signal(signal.SIGINT, bye)
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        '''
        processes.run(
            [sys.executable, "-c", child],
            capture=None,
            new_session=False,
            stderr_filter=processes.LineFilter(),
        )
    """

    def interrupt(proc) -> None:
        assert wait_until(ready.exists), "the child never got ready"
        os.killpg(proc.pid, signal.SIGINT)

    done = processes.run(python(supervisor), timeout_s=BOUND_S, during=interrupt)
    assert not done.timed_out and done.during is None, done.tail()
    lines = done.output.splitlines()
    assert "child: bye" in lines and lines[-1] == "KeyboardInterrupt", done.output
    assert lines.index("child: bye") < lines.index("Traceback (most recent call last):")
