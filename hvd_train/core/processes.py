"""The one way the toolkit, its benchmarks and its tests run a job as a child process.

A job is an argv run without a shell. By default it runs in a session (process group) of its own,
with no stdin: when its timeout passes, or the wait for it ends in an exception (Ctrl-C, a
SIGTERM turned into `SystemExit`), the whole group is killed, so a launcher's ranks go with it and
nothing else does. A child that stays in this process group (`new_session=False`, as
`hvd-train launch` keeps its launcher, so that a terminal's INT reaches it directly) is killed
alone on a timeout and left to end by itself otherwise. Output is read by threads while the job
runs (no pipe fills up, whatever the number of children), and a timeout counts until the child has
exited and closed its output. A stream that is not captured either goes straight to this process's
own (inherited), or through a `LineFilter`, line by line as it arrives. Standard library only:
this is the framework-free core.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Capture = Literal["merged", "separate"] | None

# After a kill, how long the output of what was killed may take to close (a process that escaped
# the group can hold it open for ever).
_DRAIN_AFTER_KILL_S = 10.0

# How long a filtered stream's unfinished line waits for its end before the filter gets it as it
# is (a prompt, or a progress bar that rewrites its line after a "\r").
_PARTIAL_LINE_S = 0.2

# A filtered stream's lines end with "\n", "\r" (a progress bar's rewrite) or "\r\n".
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


class LineFilter:
    """What this process shows of a child's output stream, decided line by line.

    `run` calls `line` from the stream's reader thread with each line as it arrives, its ending
    included ("\n", "\r" or "\r\n"; none for what was left unfinished, after a pause or at the
    end), and writes what it returns at once; `end` once every filtered stream of the child has
    ended, for what the filter held back. The text is the child's bytes decoded as UTF-8, with
    undecodable bytes kept as surrogates (written back unchanged). The filters of one child are
    called from one thread per stream. This base class shows every line unchanged.
    """

    def line(self, text: str) -> str:
        """What to show for one line of the child's output ("": nothing)."""
        return text

    def end(self) -> str:
        """What is left to show once the child's output has ended."""
        return ""


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child job, then `extra` on top.

    The running Python's bin directory comes first on PATH (the launchers, horovodrun among them,
    and the ranks' python are taken from there), and TensorFlow's C++ logging is quiet
    (TF_CPP_MIN_LOG_LEVEL=2) unless `extra` says otherwise.
    """
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})}


@dataclass
class Finished:
    """How a child job ended.

    Attributes:
      argv: what ran.
      returncode: as `subprocess.Popen` has it: the exit status, or -N if signal N ended it.
      output: its stdout (with stderr unless captured separately); None when not captured.
      errors: its stderr when captured separately, else None.
      seconds: from start to the end of its output.
      timed_out: the timeout passed and the job was killed.
      during: what the `during` function returned or raised (None without one, or while running).
    """

    argv: list[str]
    returncode: int
    output: str | None
    errors: str | None
    seconds: float
    timed_out: bool
    during: object = None

    @property
    def exit_code(self) -> int:
        """The shell's convention: the exit status, or 128 + N if signal N ended the job."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def outcome(self, timeout_s: float | None = None) -> str:
        """ "exit 3", "killed by signal 9", "timed out after 600 s": for error messages."""
        if self.timed_out:
            return "timed out" + ("" if timeout_s is None else f" after {timeout_s:g} s")
        if self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        return f"exit {self.returncode}"

    def tail(self, lines: int = 30) -> str:
        """The last `lines` lines of what was captured (stdout, then stderr)."""
        text = (self.output or "") + (self.errors or "")
        return "\n".join(text.splitlines()[-lines:])


class _Child:
    """One started child and the threads that read its output."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None,
        cwd: str | os.PathLike | None,
        capture: Capture,
        new_session: bool,
        filters: Mapping[str, LineFilter] | None = None,
    ) -> None:
        if capture not in ("merged", "separate", None):
            raise ValueError(f"capture must be 'merged', 'separate' or None, got {capture!r}")
        self.filters = dict(filters or {})
        if self.filters and capture is not None:
            raise ValueError("output filters need capture=None: filtered output is shown")
        self.argv = list(argv)
        self.new_session = new_session
        self.capture = capture

        def pipe(name: str) -> int | None:
            return subprocess.PIPE if capture or name in self.filters else None

        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL if new_session else None,
            stdout=pipe("out"),
            stderr=subprocess.STDOUT if capture == "merged" else pipe("err"),
            start_new_session=new_session,
        )
        self.chunks: dict[str, list[bytes]] = {}
        self.relays: dict[str, _Relay] = {}
        self.readers: dict[str, threading.Thread] = {}
        for name, stream in (("out", self.proc.stdout), ("err", self.proc.stderr)):
            if stream is None:
                continue
            if name in self.filters:
                self.relays[name] = _Relay(self.filters[name], 1 if name == "out" else 2)
                target, args = self.relays[name].run, (stream,)
            else:
                self.chunks[name] = []
                target, args = _drain, (stream, self.chunks[name])
            self.readers[name] = threading.Thread(target=target, args=args, daemon=True)
            self.readers[name].start()
        self.end: float | None = None
        self.timed_out = False

    def wait(self, deadline: float | None) -> bool:
        """Wait for the exit and the end of the output; False if `deadline` passed first."""
        try:
            self.proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        for reader in self.readers.values():
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                return False
        self._end_relays()
        self.end = time.monotonic()
        return True

    def kill(self) -> None:
        """SIGKILL the child's group (its own session), or the child alone (it shares ours)."""
        with contextlib.suppress(ProcessLookupError):
            if self.new_session:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self.proc.kill()

    def finish(self) -> None:
        """After a kill: reap the child, give its output a little time to close."""
        self.proc.wait()
        for reader in self.readers.values():
            reader.join(_DRAIN_AFTER_KILL_S)
        self._end_relays()
        self.end = time.monotonic()

    def _end_relays(self) -> None:
        """Once the filtered streams have ended: what their filters held back."""
        for name, relay in self.relays.items():
            if not self.readers[name].is_alive():
                relay.end()

    def result(self) -> Finished:
        def text(name: str) -> str | None:
            if name not in self.chunks:
                return None
            return b"".join(self.chunks[name]).decode("utf-8", errors="replace")

        return Finished(
            self.argv,
            self.proc.returncode,
            text("out"),
            text("err"),
            (self.end or time.monotonic()) - self.start,
            self.timed_out,
        )


def _drain(stream: io.BufferedReader, chunks: list[bytes]) -> None:
    with stream:
        while chunk := stream.read1(1 << 16):
            chunks.append(chunk)


class _Relay:
    """Shows one output stream of a child on this process's `fd`, through a `LineFilter`.

    If the filter raises, the rest of the stream is shown unfiltered (the child must not block on
    a full pipe) and `run` raises the error once the child has ended. Once writing to `fd` fails
    (nobody reads this process's output any more), the stream is still read to its end, unshown.
    """

    def __init__(self, line_filter: LineFilter, fd: int) -> None:
        self.filter = line_filter
        self.fd = fd
        self.error: Exception | None = None
        self.closed = False
        self.ended = False

    def run(self, stream: io.BufferedReader) -> None:
        source = stream.fileno()
        unfinished = b""
        with stream:
            while True:
                if unfinished and not select.select([source], [], [], _PARTIAL_LINE_S)[0]:
                    self._show(unfinished)
                    unfinished = b""
                chunk = os.read(source, 1 << 16)
                if not chunk:
                    break
                unfinished += chunk
                cut = max(unfinished.rfind(b"\n"), unfinished.rfind(b"\r")) + 1
                for line in _LINE.findall(unfinished[:cut]):
                    self._show(line)
                unfinished = unfinished[cut:]
        if unfinished:
            self._show(unfinished)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._write(self._filtered(self.filter.end))

    def _show(self, line: bytes) -> None:
        text = line.decode("utf-8", "surrogateescape")
        self._write(self._filtered(self.filter.line, text))

    def _filtered(self, method: Callable[..., str], *text: str) -> str:
        if self.error is not None:
            return "".join(text)
        try:
            return method(*text)
        except Exception as err:  # raised again by run(); meanwhile the output goes on as it is
            self.error = err
            return "".join(text)

    def _write(self, text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        while data and not self.closed:
            try:
                data = data[os.write(self.fd, data) :]
            except BlockingIOError:  # a non-blocking terminal: wait until it takes more
                select.select([], [self.fd], [])
            except OSError:
                self.closed = True


def _wait_all(
    children: list[_Child], timeout_s: float | None, on_timeout: Callable[[], object] | None
) -> None:
    """Wait for every child within one shared timeout; on timeout kill those still running.

    If the wait itself is interrupted (an exception), the children in sessions of their own that
    still run are killed with their groups before the exception goes on.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        late = [child for child in children if not child.wait(deadline)]
    except BaseException:
        for child in children:
            if child.new_session and child.proc.poll() is None:
                child.kill()
                child.proc.wait()
        raise
    if not late:
        return
    for child in late:
        child.timed_out = True
        child.kill()
    if on_timeout is not None:
        on_timeout()
    for child in late:
        child.finish()


def run(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    *,
    cwd: str | os.PathLike | None = None,
    capture: Capture = "merged",
    new_session: bool = True,
    forward_signals: Mapping[int, int] | None = None,
    during: Callable[[subprocess.Popen], object] | None = None,
    on_timeout: Callable[[], object] | None = None,
    stdout_filter: LineFilter | None = None,
    stderr_filter: LineFilter | None = None,
) -> Finished:
    """Run one job to its end or `timeout_s` seconds (None: no limit); how it ended.

    Args:
      argv: the program and its arguments (no shell).
      env: its whole environment (`child_env` builds the usual one); None: this process's.
      timeout_s: seconds until it is killed (see the module docstring); None waits for ever.
      cwd: its working directory; None: this process's.
      capture: "merged" (stdout and stderr in `output`), "separate" (stderr in `errors`) or None
        (the child writes to this process's stdout and stderr).
      new_session: run it in a session (process group) of its own, stdin closed.
      forward_signals: {signal received here: signal sent to the child} while it runs, e.g.
        {SIGTERM: SIGUSR1}; only from the main thread. This process's handlers come back after.
      during: called in a thread once the child runs, with its `Popen` (to signal it or watch
        it); what it returns or raises is `Finished.during` if it is done when the job ends.
      on_timeout: called after the timeout's kill, before the output is collected (to kill what
        escaped the group, for example).
      stdout_filter, stderr_filter: show that stream on this process's own (file descriptor 1
        or 2) through this filter, line by line as it arrives (see `LineFilter`), instead of
        letting the child write there itself; only with capture=None. The job ends when its
        output has, so nothing it wrote is lost; if the wait ends in a KeyboardInterrupt (a
        terminal's Ctrl-C) and the child shares this session, it got the same INT, and the wait
        goes on until it ended before the interrupt is raised, so that its last words still show.

    Raises:
      OSError: the program could not be started.
      ValueError: an unknown `capture`, a filter with capture, or `forward_signals` outside the
        main thread.
      Exception: what a filter raised (its stream was then shown unfiltered), once the job ended.
    """
    filters = {"out": stdout_filter, "err": stderr_filter}
    filters = {name: line_filter for name, line_filter in filters.items() if line_filter}
    child = _Child(argv, env, cwd, capture, new_session, filters)
    previous: dict[int, object] = {}
    outcome: list[object] = []
    try:
        for received, sent in (forward_signals or {}).items():
            previous[received] = signal.signal(
                received, lambda _signum, _frame, sent=sent: child.proc.send_signal(sent)
            )
        if during is not None:

            def act() -> None:
                try:
                    outcome.append(during(child.proc))
                except BaseException as err:  # the caller's to judge, through Finished.during
                    outcome.append(err)

            threading.Thread(target=act, daemon=True).start()
        _wait_all([child], timeout_s, on_timeout)
    except BaseException as err:
        if child.new_session and child.proc.poll() is None:
            child.kill()
            child.proc.wait()
        elif isinstance(err, KeyboardInterrupt) and child.relays and not child.new_session:
            child.wait(None)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for relay in child.relays.values():
        if relay.error is not None:
            raise relay.error
    finished = child.result()
    finished.during = outcome[0] if outcome else None
    return finished


def run_all(
    argvs: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str] | None],
    timeout_s: float | None,
    *,
    cwd: str | os.PathLike | None = None,
    capture: Capture = "merged",
) -> list[Finished]:
    """Run several jobs at once, each in a session of its own, within one shared timeout.

    On timeout every job still running is killed (its `timed_out` is set); the others keep their
    own exit. Returns one `Finished` per argv, in order.

    Raises:
      OSError: a program could not be started (those already started are killed).
      ValueError: argvs and envs differ in length, or an unknown `capture`.
    """
    if len(argvs) != len(envs):
        raise ValueError(f"{len(argvs)} argvs but {len(envs)} environments")
    children: list[_Child] = []
    try:
        for argv, env in zip(argvs, envs, strict=True):
            children.append(_Child(argv, env, cwd, capture, new_session=True))
    except BaseException:
        for child in children:
            child.kill()
            child.finish()
        raise
    _wait_all(children, timeout_s, None)
    return [child.result() for child in children]
