"""Faults a distributed job must survive: stop signals, and ranks that die or freeze.

A rank that dies or freezes holds every other rank in the step's collective forever: MPI has no
timeout of its own, and Horovod's stall check runs in the background thread that the collective
itself blocks. So each rank runs a `Watchdog` thread beside the training loop. Every rank tells
rank 0 its progress over UDP every `heartbeat_s` (a heartbeat, constant size); rank 0 answers
each with a `Summary` of the job (who is silent or behind, at most `SUMMARY_RANKS` named, so one
small datagram at any worker count): the traffic grows linearly with the ranks. When a rank has
finished no step within the stall bound (`StallRule`: derived from the step times measured in
this run), it names the ranks that did not arrive (silent for 5 heartbeats, else those behind) and
ends its process with EXIT_RANK_FAILED; the launcher then ends the others (mpirun and horovodrun
stop a job when one rank exits non-zero).

Rank 0 listens on the address other hosts reach it at (`chief_address`: the user's choice, else
the interface the launcher says the job uses, else the route to the launcher's host) and makes a
random token per job; one broadcast gives every rank both (`Contact`). Datagrams without the token
(another job's watchdog on a reused port, stray traffic) are counted and ignored.

Stop signals (scheduler preemption, SLURM's early warning) only set a flag here (`StopRequest`);
the ranks agree on the step to stop at through the gradient allreduce
(`keras.stop.stop_agreed`), so that no rank leaves a collective the others still run.

Plain Python (sockets, threads, signals): no Horovod, no TensorFlow.
"""

from __future__ import annotations

import contextlib
import faulthandler
import ipaddress
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hvd_train.core import network
from hvd_train.core.environment import LauncherEnvironmentError
from hvd_train.core.outcome import EXIT_DIVERGED, EXIT_RANK_FAILED

log = logging.getLogger("hvd_train")

SILENT_HEARTBEATS = 5  # a rank not heard from for this many heartbeats is named as silent
SUMMARY_RANKS = 32  # ranks a summary names per list: keeps it one small datagram at any size
TOKEN_BYTES = 8  # the job's token: tells this job's datagrams from any other's, not a secret


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


@dataclass(frozen=True)
class Summary:
    """Rank 0's verdict on the job: who did not arrive, in constant size (at most SUMMARY_RANKS
    ranks per list, the lowest first). Rank 0 sends it to every rank each heartbeat.

    Attributes:
      silent: (rank, seconds since its last heartbeat, its steps) of the first silent ranks.
      silent_count: all silent ranks.
      behind: when none is silent, the first ranks at the lowest step (if steps differ).
      behind_count: all ranks at the lowest step (0 when none is silent and all steps agree).
      lowest, highest: the lowest and highest steps of any rank.
      busy: a rank is doing long legitimate work outside steps (writing a checkpoint).
      chief_steps: rank 0's steps.
    """

    silent: tuple[tuple[int, float, int], ...] = ()
    silent_count: int = 0
    behind: tuple[int, ...] = ()
    behind_count: int = 0
    lowest: int = 0
    highest: int = 0
    busy: bool = False
    chief_steps: int = 0

    @property
    def culprits(self) -> list[int]:
        """The ranks named: the silent ones, else those behind."""
        return [r for r, _, _ in self.silent] if self.silent_count else list(self.behind)

    @property
    def truncated(self) -> bool:
        """More ranks did not arrive than the summary names."""
        return self.silent_count > len(self.silent) or self.behind_count > len(self.behind)

    def why(self, where: Mapping[int, str] | None = None) -> str:
        """Who did not arrive, as the watchdog's message says it; `where` adds the address a
        rank's heartbeats come from ("rank 1 on 10.1.0.8"), for the ranks it holds."""
        where = where or {}

        def named(r: int) -> str:
            return f"rank {r} on {where[r]}" if r in where else f"rank {r}"

        if self.silent_count:
            text = ", ".join(
                f"{named(r)} (no heartbeat for {age:.1f} s, at step {steps})"
                for r, age, steps in self.silent
            )
            more = self.silent_count - len(self.silent)
            return text + (f" and {more} more silent" if more else "")
        if self.behind_count:
            names = ", ".join(named(r) for r in self.behind)
            more = self.behind_count - len(self.behind)
            names += f" and {more} more" if more else ""
            return f"{names} (alive, at step {self.lowest}; others at up to {self.highest})"
        return (
            f"none silent or behind: every rank is alive at step {self.lowest} "
            "(a rank stuck inside the step, e.g. reading input, or a collective not called on all)"
        )

    def aged(self, seconds: float) -> Summary:
        """This summary `seconds` after rank 0 made it: the silent ranks have been silent longer."""
        silent = tuple((r, age + seconds, steps) for r, age, steps in self.silent)
        return replace(self, silent=silent)

    def with_silent_chief(self, age_s: float) -> Summary:
        """This summary with rank 0 itself named first as silent (its summaries stopped)."""
        silent = ((0, age_s, self.chief_steps), *self.silent)[:SUMMARY_RANKS]
        return replace(
            self, silent=silent, silent_count=self.silent_count + 1, behind=(), behind_count=0
        )

    def pack(self, token: bytes) -> bytes:
        """The datagram rank 0 sends (`unpack` reads it)."""
        head = _SUMMARY.pack(
            token,
            _KIND_SUMMARY,
            self.chief_steps,
            self.busy,
            self.silent_count,
            len(self.silent),
            self.behind_count,
            len(self.behind),
            self.lowest,
            self.highest,
        )
        silent = b"".join(_SILENT.pack(r, age, steps) for r, age, steps in self.silent)
        return head + silent + b"".join(_BEHIND.pack(r) for r in self.behind)

    @classmethod
    def unpack(cls, token: bytes, data: bytes) -> Summary | None:
        """The summary in `data`, or None if it is not one of this job's (token, kind, length)."""
        if len(data) < _SUMMARY.size:
            return None
        got, kind, chief, busy, n_silent, listed, n_behind, behind, lowest, highest = (
            _SUMMARY.unpack_from(data)
        )
        if got != token or kind != _KIND_SUMMARY:
            return None
        if len(data) != _SUMMARY.size + listed * _SILENT.size + behind * _BEHIND.size:
            return None
        at = _SUMMARY.size
        silent = tuple(_SILENT.unpack_from(data, at + i * _SILENT.size) for i in range(listed))
        at += listed * _SILENT.size
        ranks = tuple(_BEHIND.unpack_from(data, at + i * _BEHIND.size)[0] for i in range(behind))
        return cls(silent, n_silent, ranks, n_behind, lowest, highest, bool(busy), chief)


def summarize(peers: Mapping[int, Peer], silence_s: float) -> Summary:
    """Rank 0's verdict: the ranks silent for more than `silence_s` first, else those behind."""
    silent = sorted(r for r, p in peers.items() if p.age_s > silence_s)
    steps = [p.steps for p in peers.values()]
    lowest, highest = min(steps, default=0), max(steps, default=0)
    behind = []
    if not silent and lowest != highest:
        behind = sorted(r for r, p in peers.items() if p.steps == lowest)
    return Summary(
        silent=tuple((r, peers[r].age_s, peers[r].steps) for r in silent[:SUMMARY_RANKS]),
        silent_count=len(silent),
        behind=tuple(behind[:SUMMARY_RANKS]),
        behind_count=len(behind),
        lowest=lowest,
        highest=highest,
        busy=any(p.busy for p in peers.values()),
        chief_steps=peers[0].steps if 0 in peers else 0,
    )


# --- the wire: heartbeats (rank -> rank 0) and summaries (rank 0 -> rank) -------------------------

# Network byte order, no padding. A heartbeat: token, kind, rank, steps, busy. A summary: token,
# kind, rank 0's steps, busy, silent count and listed, behind count and listed, lowest and highest
# step; then the listed silent ranks (rank, age, steps) and the listed ranks behind.
_KIND_HEARTBEAT, _KIND_SUMMARY = 1, 2
_HEARTBEAT = struct.Struct(f"!{TOKEN_BYTES}sBIQ?")
_SUMMARY = struct.Struct(f"!{TOKEN_BYTES}sBQ?IHIHQQ")
_SILENT = struct.Struct("!IfQ")
_BEHIND = struct.Struct("!I")
# The largest datagram: well under the 1472-byte payload of one 1500-byte Ethernet frame.
MAX_DATAGRAM = _SUMMARY.size + SUMMARY_RANKS * max(_SILENT.size, _BEHIND.size)


def pack_heartbeat(token: bytes, rank: int, steps: int, busy: bool) -> bytes:
    """The datagram a rank sends rank 0 each heartbeat (`unpack_heartbeat` reads it)."""
    return _HEARTBEAT.pack(token, _KIND_HEARTBEAT, rank, steps, busy)


def unpack_heartbeat(token: bytes, data: bytes, size: int) -> tuple[int, int, bool] | None:
    """(rank, steps, busy) from `data`, or None if it is not a heartbeat of this job's ranks."""
    if len(data) != _HEARTBEAT.size:
        return None
    got, kind, rank, steps, busy = _HEARTBEAT.unpack(data)
    if got != token or kind != _KIND_HEARTBEAT or not 0 < rank < size:
        return None
    return rank, steps, bool(busy)


# --- where rank 0's watchdog listens --------------------------------------------------------------

WATCHDOG_HOST = "HVD_TRAIN_WATCHDOG_HOST"  # the address (or host name) other hosts reach rank 0 at
WATCHDOG_IFACE = "HVD_TRAIN_WATCHDOG_IFACE"  # the interface (or network a.b.c.d/n) to listen on
# A route lookup only (a UDP connect sends nothing): TEST-NET-2 (RFC 5737) is no host's network,
# so the kernel answers with the default route.
_DEFAULT_ROUTE_PROBE = "198.51.100.1"
# Every rank's heartbeat may arrive at once; the kernel caps these at net.core.[rw]mem_max.
_CHIEF_BUFFER_BYTES = 4 << 20


@dataclass(frozen=True)
class Contact:
    """Where rank 0's watchdog listens, and the job's token: rank 0 makes it (`open_socket`), and
    one broadcast tells every rank."""

    host: str
    port: int
    token: bytes


def chief_address(environ: Mapping[str, str], spans_hosts: bool) -> tuple[str, str]:
    """The IPv4 address rank 0's watchdog listens on, and how it was chosen.

    In order: HVD_TRAIN_WATCHDOG_HOST; the address of HVD_TRAIN_WATCHDOG_IFACE; 127.0.0.1 when
    every rank runs on this host; the job's interface (`network.job_interface`: the rule every
    part of the job follows); this host name's address; the default route's source address.
    Past the user's choice, loopback addresses are passed over; 127.0.0.1 when nothing else is
    found.

    Args:
      environ: the process environment (`os.environ`).
      spans_hosts: ranks run on other hosts than this one.

    Returns:
      (address, how), e.g. ("10.1.0.7", "interface ib0, from HOROVOD_GLOO_IFACE").

    Raises:
      LauncherEnvironmentError: HVD_TRAIN_WATCHDOG_HOST does not resolve, or
        HVD_TRAIN_WATCHDOG_IFACE (or HVD_TRAIN_IFACE) names no interface (or network) of this
        host.
    """
    if host := environ.get(WATCHDOG_HOST):
        try:
            return socket.gethostbyname(host), WATCHDOG_HOST
        except OSError as err:
            raise LauncherEnvironmentError(f"{WATCHDOG_HOST}={host!r}: {err}") from None
    if spec := environ.get(WATCHDOG_IFACE):
        for found in network.matching(spec):
            return found.address, f"interface {found.name}, from {WATCHDOG_IFACE}"
        names = ", ".join(name for _, name in socket.if_nameindex())
        raise LauncherEnvironmentError(
            f"{WATCHDOG_IFACE}={spec!r} matches no interface with an IPv4 address on this host "
            f"(it has {names})"
        )
    if not spans_hosts:
        return "127.0.0.1", "every rank runs on this host"
    if chosen := network.job_interface(environ):
        # "interface ib0, from HOROVOD_GLOO_IFACE", or "the route to 10.1.0.9, from ...".
        named = chosen.how.startswith("from ")
        return chosen.address, f"interface {chosen.name}, {chosen.how}" if named else chosen.how
    for address, how in _fallback_addresses():
        if not ipaddress.ip_address(address).is_loopback:
            return address, how
    return "127.0.0.1", "no other address found"


def _fallback_addresses() -> Iterator[tuple[str, str]]:
    """Where no launcher names the job's interface: this host name's, then the default route's."""
    if named := _host_name_address():
        yield named[1], f"the host name {named[0]}"
    if address := network.route_source(_DEFAULT_ROUTE_PROBE):
        yield address, "the default route"


def _host_name_address() -> tuple[str, str] | None:
    """(this host's name, its address) if the name resolves to an address of this host."""
    try:
        name = socket.gethostname()
        address = socket.gethostbyname(name)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))  # names can resolve to another host's address
    except OSError:
        return None
    return name, address


def open_socket(
    rank: int, spans_hosts: bool, environ: Mapping[str, str] | None = None
) -> tuple[socket.socket, Contact | None]:
    """This rank's UDP socket for the watchdog; on rank 0 also the `Contact` to broadcast.

    Rank 0 listens on `chief_address` (logged with how it was chosen; a warning when that is a
    loopback address in a job that spans hosts) and makes the job's token; the other ranks listen
    on any address (rank 0 answers where their heartbeats come from).

    Args:
      rank: this rank.
      spans_hosts: ranks run on other hosts than rank 0's.
      environ: the environment to read the address from (None: `os.environ`).

    Returns:
      (socket, contact); contact is None except on rank 0.

    Raises:
      LauncherEnvironmentError: from `chief_address`.
    """
    if rank != 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        return sock, None
    host, how = chief_address(os.environ if environ is None else environ, spans_hosts)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _CHIEF_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _CHIEF_BUFFER_BYTES)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.bind(("0.0.0.0", 0))  # a named address that is not this host's (NAT): listen on all
    port = sock.getsockname()[1]
    if spans_hosts and ipaddress.ip_address(host).is_loopback:
        log.warning(
            "watchdog: rank 0 listens on %s:%d (%s), a loopback address, but the job spans "
            "hosts: other hosts' heartbeats cannot reach it; name the address with %s or the "
            "interface with %s",
            host,
            port,
            how,
            WATCHDOG_HOST,
            WATCHDOG_IFACE,
        )
    else:
        log.info("watchdog: rank 0 listens on %s:%d (%s)", host, port, how)
    return sock, Contact(host, port, os.urandom(TOKEN_BYTES))


# --- the watchdog ---------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What one rank's watchdog sent and received (read it from any thread; it only grows)."""

    beats: int = 0  # heartbeats (on rank 0 counted once its summaries are sent)
    sent: int = 0  # datagrams
    sent_bytes: int = 0
    largest_sent: int = 0  # bytes of the largest datagram
    send_failures: int = 0  # the first is logged as a warning
    received: int = 0  # datagrams of this job
    received_bytes: int = 0
    ignored: int = 0  # datagrams without this job's token or format; the first is logged
    receive_failures: int = 0  # the first is logged as a warning


class Watchdog:
    """Ends this rank's process, naming the ranks that did not arrive, when the job stalls.

    Feed it from the training loop (`step_done`, `busy`); it runs in a daemon thread. Its
    `traffic` counts what it sent, received and ignored.

    Args:
      rank, size: this rank and the worker count.
      sock: from `open_socket` on every rank.
      chief: rank 0's `Contact` (from its `open_socket`, broadcast).
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
        chief: Contact,
        rule: StallRule,
        heartbeat_s: float,
        on_stall: Callable[[str], None] | None = None,
        before_exit: Callable[[str], None] | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.rule = rule
        self.heartbeat_s = heartbeat_s
        self.silence_s = SILENT_HEARTBEATS * heartbeat_s
        self.traffic = Traffic()
        self._sock = sock
        self._chief = (chief.host, chief.port)
        self._token = chief.token
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
        # Rank 0: what each rank last said, and where it speaks from.
        self._heard: dict[int, tuple[float, int, bool]] = {}
        self._addresses: dict[int, Any] = {}
        # Other ranks: rank 0's last summary and when it came (one tuple: read by other threads).
        self._last: tuple[Summary, float] = (Summary(), time.monotonic())
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
                self._beat()
            self._receive(max(0.01, next_beat - time.monotonic()))
            self._check()

    def _beat(self) -> None:
        with self._lock:
            steps, busy = self._steps, self._busy > 0
        self._sock.settimeout(self.heartbeat_s)  # a full send buffer waits, up to one heartbeat
        if self.rank != 0:
            self._send(pack_heartbeat(self._token, self.rank, steps, busy), self._chief)
        else:
            self._heard[0] = (time.monotonic(), steps, busy)
            summary = summarize(self._peers(), self.silence_s).pack(self._token)
            for address in list(self._addresses.values()):
                self._send(summary, address)
        self.traffic.beats += 1

    def _send(self, data: bytes, address: Any) -> None:
        traffic = self.traffic
        try:
            self._sock.sendto(data, address)
        except OSError as err:
            traffic.send_failures += 1
            if traffic.send_failures == 1:
                log.warning(
                    "watchdog on rank %d: sending to %s:%d failed (%s); the watchdog may name "
                    "live ranks silent; further failures are counted, not logged",
                    self.rank,
                    *address,
                    err,
                )
            return
        traffic.sent += 1
        traffic.sent_bytes += len(data)
        traffic.largest_sent = max(traffic.largest_sent, len(data))

    def _receive(self, timeout: float) -> None:
        """Take one datagram arriving within `timeout`, then those already queued (at most one
        per rank, so that a flood cannot hold up this rank's own heartbeat)."""
        self._sock.settimeout(timeout)
        try:
            datagram = self._sock.recvfrom(MAX_DATAGRAM + 1)
        except TimeoutError:
            return
        except OSError as err:
            self._receive_failed(err)
            self._stop.wait(timeout)
            return
        self._sock.settimeout(0)
        for _ in range(self.size):
            self._take(*datagram)
            try:
                datagram = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except BlockingIOError:
                return
            except OSError as err:
                self._receive_failed(err)
                return

    def _receive_failed(self, err: OSError) -> None:
        self.traffic.receive_failures += 1
        if self.traffic.receive_failures == 1:
            log.warning(
                "watchdog on rank %d: receiving failed (%s); further failures are counted, not "
                "logged",
                self.rank,
                err,
            )

    def _take(self, data: bytes, address: Any) -> None:
        now = time.monotonic()
        if self.rank == 0:
            message: Any = unpack_heartbeat(self._token, data, self.size)
        else:
            message = Summary.unpack(self._token, data)
        if message is None:
            self.traffic.ignored += 1
            if self.traffic.ignored == 1:
                log.warning(
                    "watchdog on rank %d: ignoring datagrams that are not this job's (the first "
                    "from %s:%d); further ones are counted, not logged",
                    self.rank,
                    *address,
                )
            return
        self.traffic.received += 1
        self.traffic.received_bytes += len(data)
        if self.rank == 0:
            rank, steps, busy = message
            self._heard[rank] = (now, steps, busy)
            self._addresses[rank] = address
        else:
            self._last = (message, now)
            busy = message.busy
        if busy:
            self._busy_seen = now

    def _peers(self) -> dict[int, Peer]:
        """Rank 0's view of every rank (never heard: infinitely silent, step 0)."""
        now = time.monotonic()
        peers = {}
        for r in range(self.size):
            heard, steps, busy = self._heard.get(r, (None, 0, False))
            age = float("inf") if heard is None else now - heard
            peers[r] = Peer(age, steps, busy)
        return peers

    def _view(self) -> tuple[Summary, bool]:
        """What this rank knows of the job now, and whether rank 0 went silent: rank 0 from its
        own table; the others from rank 0's last summary, naming rank 0 when summaries stopped."""
        if self.rank == 0:
            return summarize(self._peers(), self.silence_s), False
        summary, received = self._last
        age = time.monotonic() - received
        if age > self.silence_s:
            return summary.aged(age).with_silent_chief(age), True
        return summary.aged(age), False

    def _check(self) -> None:
        with self._lock:
            idle = time.monotonic() - max(self._last_progress, self._busy_seen)
            started = self._phase in self._started_phases
            recent = list(self._recent)
            busy = self._busy > 0
        bound = self.rule.bound(recent, started)
        if busy or idle <= bound:
            return
        view, chief_silent = self._view()
        if not chief_silent:
            if view.busy:
                return
            if self.rank != 0 and idle <= bound + self.silence_s:
                return  # rank 0 is alive: it reports and aborts first
        culprits = set(view.culprits)
        # The lowest rank not named speaks (every rank, if the summary could not name them all).
        speaker = next(r for r in range(self.size) if r == self.rank or r not in culprits)
        message = (
            f"hvd-train: watchdog on rank {self.rank}: no step finished for {idle:.1f} s "
            f"(bound {bound:.1f} s = {self.rule.explain(recent, started)}); "
            f"did not arrive: {view.why(self._where())}; aborting the job (exit {EXIT_RANK_FAILED})"
        )
        if self._on_stall is not None:
            self._on_stall(message)
            self._stop.set()
            return
        if speaker == self.rank or view.truncated:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
            # Where this rank's Python threads are: the call the job waits in names itself.
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
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
            view, _ = self._view()
            if view.silent_count or time.monotonic() >= deadline:
                break
            time.sleep(self.heartbeat_s / 2)
        return view.why(self._where()) if view.silent_count else None

    def _where(self) -> dict[int, str]:
        """The ranks' addresses this rank knows, where they name another host than loopback: on
        rank 0 where each rank's heartbeats come from, on the others rank 0's."""
        if self.rank == 0:
            known = {r: address[0] for r, address in list(self._addresses.items())}
        else:
            known = {0: self._chief[0]}
        return {r: a for r, a in known.items() if not ipaddress.ip_address(a).is_loopback}


class FreezeGuard:
    """Elastic mode's answer to a frozen worker: evict it, so that the others go on.

    A watchdog thread cannot act for a process that no longer runs at all (SIGSTOP, a host
    thrashing), and horovodrun waits for every worker before it resets. So a child process on the
    same host watches this one: a daemon thread here writes a byte down a pipe every
    `heartbeat_s`; when none came for `bound_s` seconds, the child kills this process (SIGKILL),
    which horovodrun takes for a failed worker (its host is blacklisted, the others reset). The
    child exits when the pipe closes (this process ended, however) or at `close`.

    Args:
      bound_s: how long this process may not run before it is killed.
      heartbeat_s: how often it says it runs.
    """

    def __init__(self, bound_s: float, heartbeat_s: float) -> None:
        read_fd, write_fd = os.pipe()
        watch = "import sys; from hvd_train.core.faults import _guard; _guard(*sys.argv[1:])"
        self._child = subprocess.Popen(
            [sys.executable, "-c", watch, str(os.getpid()), str(bound_s)],
            stdin=read_fd,
            close_fds=True,
        )
        os.close(read_fd)
        os.set_blocking(write_fd, False)
        self._closed = threading.Event()

        def beat() -> None:
            while not self._closed.is_set():
                with contextlib.suppress(BlockingIOError, BrokenPipeError):
                    os.write(write_fd, b".")  # a full pipe: the guard was stopped too
                self._closed.wait(heartbeat_s)
            os.close(write_fd)

        threading.Thread(target=beat, name="hvd_train-freeze-guard", daemon=True).start()

    def close(self) -> None:
        """Disarm it before this process ends: its daemon thread stops beating at interpreter
        shutdown, which may take longer than the bound."""
        self._closed.set()
        self._child.terminate()
        self._child.wait()


def _guard(pid: str, bound_s: str) -> None:
    """The child of `FreezeGuard`: SIGKILL `pid` when its pipe (stdin) is silent."""
    watched, bound = int(pid), float(bound_s)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C ends the worker, then this (EOF)
    while True:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], bound)
        if not ready:
            sys.stderr.write(
                f"hvd-train: freeze guard: process {pid} on {socket.gethostname()} did not run "
                f"for {bound:.1f} s; killing it (elastic: its host leaves the job)\n"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(watched, signal.SIGKILL)
            return
        if not os.read(sys.stdin.fileno(), 4096):
            return  # the worker ended
