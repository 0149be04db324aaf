"""Faults a distributed job must survive: stop signals, and ranks that die or freeze.

A rank that dies or freezes holds every other rank in the step's collective forever: MPI has no
timeout of its own, and Horovod's stall check runs in the background thread that the collective
itself blocks. So each rank runs a `Watchdog` thread beside the training loop. Every rank tells
rank 0 its progress over UDP every `heartbeat_s`; rank 0 answers each with the table of everyone's
(one datagram). When a rank has finished no step within the stall bound (`StallRule`: derived from
the step times measured in this run), it names the ranks that did not arrive (`laggards`: those
silent for 5 heartbeats, else those behind) and ends its process with EXIT_RANK_FAILED; the launcher
then ends the others (mpirun and horovodrun stop a job when one rank exits non-zero).

Stop signals (scheduler preemption, SLURM's early warning) only set a flag here (`StopRequest`);
the ranks agree on the step to stop at through the gradient allreduce
(`keras.stop.stop_agreed`), so that no rank leaves a collective the others still run.

Plain Python (sockets, threads, signals): no Horovod, no TensorFlow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from hvd_train.core.outcome import EXIT_DIVERGED, EXIT_RANK_FAILED

log = logging.getLogger("hvd_train")

SILENT_HEARTBEATS = 5  # a rank not heard from for this many heartbeats is named as silent


class JobFailure(Exception):
    """The job cannot go on; `hvd-train` prints the message as one line and exits `exit_code`."""

    exit_code = EXIT_RANK_FAILED


class RankLost(JobFailure):
    """A collective failed because ranks died (named in the message)."""


class Diverged(JobFailure):
    """Ranks whose weights differ from rank 0's (raised on every rank alike)."""

    exit_code = EXIT_DIVERGED


# --- stop signals --------------------------------------------------------------------------------


class StopRequest:
    """Remembers that a stop signal arrived; training stops at the next step all ranks agree on.

    The handler only sets a flag: nothing may run a collective or write a file from inside a
    signal handler, and each rank gets the signal at a different moment (or alone).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        for name in names:
            signum = getattr(signal, f"SIG{name}")
            self._previous[signum] = signal.signal(signum, self._handle)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name = name
            # Stderr directly: the logging lock may be held by the interrupted frame.
            os.write(2, f"hvd-train: {name} received: stopping at the next agreed step\n".encode())

    def close(self) -> None:
        """Put the previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


# --- the stall bound and who did not arrive -------------------------------------------------------


@dataclass(frozen=True)
class StallRule:
    """How long a rank may go without finishing a step before the job is declared stalled.

    bound = max(floor_s, factor x the slowest recent step); `startup_s` until the phase (training,
    validation) has finished its first step, which includes tracing and compiling it.
    """

    floor_s: float
    factor: float
    startup_s: float

    def bound(self, recent_steps: Sequence[float], started: bool) -> float:
        if not started or not recent_steps:
            return self.startup_s
        return max(self.floor_s, self.factor * max(recent_steps))

    def explain(self, recent_steps: Sequence[float], started: bool) -> str:
        if not started or not recent_steps:
            return f"fault.startup_s {self.startup_s:g} s, before the first step"
        slowest = max(recent_steps)
        return (
            f"max(fault.stall_floor_s {self.floor_s:g} s, {self.factor:g} x slowest recent step "
            f"{slowest:.3f} s)"
        )


@dataclass(frozen=True)
class Peer:
    """What rank 0 last heard from one rank."""

    age_s: float  # seconds since its last heartbeat (inf: never heard)
    steps: int  # batches it has finished (training and validation)
    busy: bool  # doing legitimate long work outside steps (rank 0 writing a checkpoint)


def laggards(peers: dict[int, Peer], silence_s: float) -> tuple[list[int], str]:
    """The ranks that did not arrive, and why: silent ones first, else those behind the others."""
    silent = sorted(r for r, p in peers.items() if p.age_s > silence_s)
    if silent:
        ages = ", ".join(
            f"rank {r} (no heartbeat for {peers[r].age_s:.1f} s, at step {peers[r].steps})"
            for r in silent
        )
        return silent, ages
    steps = {p.steps for p in peers.values()}
    if len(steps) > 1:
        lowest = min(steps)
        behind = sorted(r for r, p in peers.items() if p.steps == lowest)
        ahead = max(steps)
        names = ", ".join(f"rank {r}" for r in behind)
        return behind, f"{names} (alive, at step {lowest}; others at up to {ahead})"
    return [], (
        f"none silent or behind: every rank is alive at step {steps.pop() if steps else 0} "
        "(a rank stuck inside the step, e.g. reading input, or a collective not called on all)"
    )


# --- the watchdog ---------------------------------------------------------------------------------


def open_socket() -> tuple[socket.socket, tuple[str, int]]:
    """A UDP socket for the watchdog and the address other hosts reach it at.

    The host is HVD_TRAIN_WATCHDOG_HOST if set, else this host name's address.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    host = os.environ.get("HVD_TRAIN_WATCHDOG_HOST")
    if not host:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return sock, (host, sock.getsockname()[1])


class Watchdog:
    """Ends this rank's process, naming the ranks that did not arrive, when the job stalls.

    Feed it from the training loop (`step_done`, `busy`); it runs in a daemon thread.

    Args:
      rank, size: this rank and the worker count.
      sock: from `open_socket` on every rank.
      chief_address: rank 0's address (from its `open_socket`, broadcast).
      rule: the stall bound.
      heartbeat_s: the heartbeat period.
      on_stall: called with the message instead of exiting (tests).
      before_exit: called with the message before this rank exits (rank 0 records the status).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        sock: socket.socket,
        chief_address: tuple[str, int],
        rule: StallRule,
        heartbeat_s: float,
        on_stall: Callable[[str], None] | None = None,
        before_exit: Callable[[str], None] | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.rule = rule
        self.heartbeat_s = heartbeat_s
        self.silence_s = SILENT_HEARTBEATS * heartbeat_s
        self._sock = sock
        self._sock.settimeout(heartbeat_s)
        self._chief = chief_address
        self._on_stall = on_stall
        self._before_exit = before_exit
        self._lock = threading.Lock()
        self._steps = 0
        self._last_progress = time.monotonic()
        self._recent: deque[float] = deque(maxlen=50)
        self._started_phases: set[str] = set()
        self._phase = "startup"
        self._busy = 0
        # Time a rank was last seen busy: the others' idle time counts from the end of it.
        self._busy_seen = 0.0
        # Rank 0: what each rank last said, and where it speaks from; others: the last table.
        self._heard: dict[int, tuple[float, int, bool]] = {}
        self._addresses: dict[int, Any] = {}
        self._table: dict[int, Peer] = {}
        self._table_time = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvd_train-watchdog", daemon=True)
        self._thread.start()

    # -- fed by the training loop --

    def phase(self, name: str) -> None:
        """A phase (training, validation) begins; its first step may take the startup bound."""
        with self._lock:
            self._phase = name
            self._last_progress = time.monotonic()

    def step_done(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._phase in self._started_phases:
                self._recent.append(now - self._last_progress)
            else:
                self._started_phases.add(self._phase)
            self._steps += 1
            self._last_progress = now

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Long legitimate work outside steps (writing a checkpoint): no rank declares a stall."""
        with self._lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self._last_progress = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.heartbeat_s + 1)
        self._sock.close()

    # -- the thread --

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.heartbeat_s
                with contextlib.suppress(OSError):
                    self._beat()
            with contextlib.suppress(OSError, ValueError):
                self._receive(max(0.01, next_beat - time.monotonic()))
            self._check()

    def _beat(self) -> None:
        with self._lock:
            mine = (self._steps, self._busy > 0)
        if self.rank != 0:
            self._sock.sendto(json.dumps([self.rank, *mine]).encode(), self._chief)
            return
        self._heard[0] = (time.monotonic(), *mine)
        self._table = self._peers()
        self._table_time = time.monotonic()
        table = json.dumps({r: [p.age_s, p.steps, p.busy] for r, p in self._table.items()})
        for address in self._addresses.values():
            self._sock.sendto(table.encode(), address)

    def _receive(self, timeout: float) -> None:
        self._sock.settimeout(timeout)
        try:
            data, address = self._sock.recvfrom(65536)
        except TimeoutError:
            return
        message = json.loads(data)
        if self.rank == 0:
            rank, steps, busy = message
            self._heard[int(rank)] = (time.monotonic(), int(steps), bool(busy))
            self._addresses[int(rank)] = address
            busy = bool(busy)
        else:
            self._table = {int(r): Peer(*v) for r, v in message.items()}
            self._table_time = time.monotonic()
            busy = any(p.busy for p in self._table.values())
        if busy:
            self._busy_seen = time.monotonic()

    def _peers(self) -> dict[int, Peer]:
        """Rank 0's view of every rank (never heard: infinitely silent, step 0)."""
        now = time.monotonic()
        peers = {}
        for r in range(self.size):
            heard, steps, busy = self._heard.get(r, (None, 0, False))
            age = float("inf") if heard is None else now - heard
            peers[r] = Peer(age, steps, busy)
        return peers

    def _check(self) -> None:
        with self._lock:
            idle = time.monotonic() - max(self._last_progress, self._busy_seen)
            started = self._phase in self._started_phases
            recent = list(self._recent)
            busy = self._busy > 0
        bound = self.rule.bound(recent, started)
        if busy or idle <= bound:
            return
        peers = self._peers() if self.rank == 0 else dict(self._table)
        chief_age = time.monotonic() - self._table_time
        if self.rank != 0 and chief_age > self.silence_s:
            # Rank 0 is gone or frozen: the lowest rank still in its last table speaks for it.
            peers[0] = Peer(chief_age, peers.get(0, Peer(0, 0, False)).steps, False)
        elif any(p.busy for p in peers.values()):
            return
        elif self.rank != 0 and idle <= bound + self.silence_s:
            return  # rank 0 is alive: it reports and aborts first
        culprits, why = laggards(peers, self.silence_s)
        speaker = min(r for r in range(self.size) if r not in culprits or r == self.rank)
        message = (
            f"hvd-train: watchdog on rank {self.rank}: no step finished for {idle:.1f} s "
            f"(bound {bound:.1f} s = {self.rule.explain(recent, started)}); "
            f"did not arrive: {why}; aborting the job (exit {EXIT_RANK_FAILED})"
        )
        if self._on_stall is not None:
            self._on_stall(message)
            self._stop.set()
            return
        if speaker == self.rank:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        if self._before_exit is not None:
            with contextlib.suppress(Exception):
                self._before_exit(message)
        # Not sys.exit: the main thread is blocked in a collective that will never return.
        os._exit(EXIT_RANK_FAILED)

    def lost_ranks(self, wait: bool = True) -> str | None:
        """After a collective failed: the ranks that went silent, or None if every rank is still
        heard from. With `wait`, gives a rank that just died the time to count as silent."""
        deadline = time.monotonic() + (self.silence_s + self.heartbeat_s if wait else 0)
        while True:
            peers = self._peers() if self.rank == 0 else dict(self._table)
            if self.rank != 0 and time.monotonic() - self._table_time > self.silence_s:
                peers[0] = Peer(time.monotonic() - self._table_time, 0, False)
            silent = [r for r, p in peers.items() if p.age_s > self.silence_s]
            if silent or time.monotonic() >= deadline:
                break
            time.sleep(self.heartbeat_s / 2)
        if not silent:
            return None
        return laggards({r: peers[r] for r in silent}, self.silence_s)[1]
