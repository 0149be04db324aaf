"""The TCP rate from this host to another, measured before a job starts: `--launcher auto` picks
the controller by it where CPU-only hosts are filled by the ranks (`core.launch.choose_launcher`);
and the parts of the same probe that the ranks of a job run at start where no launcher gave them
the rate (`comm.linkprobe`: `listen`, `send_phases`, `send`, `receive`).

`python -m hvd_train.core.linkrate --receive` runs on the other host over the launcher's remote
shell: it listens on a free port, names it in one JSON line, reads one connection to its end and
answers with the bytes that arrived and over how long, leaving out the first SKIP_S (TCP's slow
start). This host sends zeros for SEND_S to the address of the other host's name, the route the
job's traffic takes unless --network-interface names another network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hvd_train.core import network
from hvd_train.core.environment import LauncherEnvironmentError

SEND_S = 0.5
SKIP_S = 0.1
ANSWER_TIMEOUT_S = 30  # the remote shell's start and Python's, as the other launch probes
CHUNK = 1 << 20
TOKEN_BYTES = 16
# Inside a job every rank is up already: a peer that does not connect or send within this is gone.
PEER_TIMEOUT_S = 10


@dataclass(frozen=True)
class LinkRate:
    """What arrived at `host` from this host: `megabytes` (10^6 bytes) in `seconds`."""

    host: str
    megabytes: float
    seconds: float

    @property
    def gbit_s(self) -> float:
        return self.megabytes * 8e-3 / self.seconds


def measure(host: str, remote_shell: Sequence[str], send_s: float = SEND_S) -> LinkRate:
    """The rate of TCP from this host to `host`: this host sends for `send_s` to a receiver
    started there over `remote_shell` (`ssh`, or Open MPI's agent).

    Raises:
      LauncherEnvironmentError: `host` does not resolve, its receiver does not start or answer
        within ANSWER_TIMEOUT_S, or the connection to it fails or stalls.
    """
    try:
        address = socket.gethostbyname(host)
    except OSError as err:
        raise LauncherEnvironmentError(f"host {host!r} does not resolve: {err}") from None
    remote = shlex.join([sys.executable, "-m", "hvd_train.core.linkrate", "--receive"])
    receiver = subprocess.Popen(
        [*remote_shell, host, remote],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so that a stop takes the remote shell's children as well
    )
    try:
        port = _answer(receiver)
        if port is None:
            raise _failed(receiver, host, "its port")
        try:
            with socket.create_connection((address, port["port"]), timeout=ANSWER_TIMEOUT_S) as out:
                zeros = memoryview(bytes(CHUNK))
                end = time.perf_counter() + send_s
                while time.perf_counter() < end:
                    out.sendall(zeros)
        except OSError as err:
            raise LauncherEnvironmentError(
                f"host {host}: the link-rate probe's connection to {address} failed: {err}"
            ) from None
        got = _answer(receiver)
        if got is None or got["seconds"] <= 0:
            raise _failed(receiver, host, "what arrived")
    finally:
        _stop(receiver)
    return LinkRate(host, got["bytes"] / 1e6, got["seconds"])


def _answer(receiver: subprocess.Popen) -> dict[str, Any] | None:
    assert receiver.stdout is not None
    ready, _, _ = select.select([receiver.stdout], [], [], ANSWER_TIMEOUT_S)
    try:
        return json.loads(receiver.stdout.readline()) if ready else None
    except ValueError:
        return None


def _failed(receiver: subprocess.Popen, host: str, what: str) -> LauncherEnvironmentError:
    _stop(receiver)
    _, err = receiver.communicate()
    last = (err.strip().splitlines() or [f"no answer in {ANSWER_TIMEOUT_S} s"])[-1]
    return LauncherEnvironmentError(
        f"host {host}: the link-rate probe's receiver did not send {what} "
        f"(exit {receiver.returncode}): {last}"
    )


def _stop(receiver: subprocess.Popen) -> None:
    try:
        receiver.wait(timeout=1)  # it ends by itself after its last answer
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it ended after all
            os.killpg(receiver.pid, signal.SIGKILL)
        receiver.wait()


def receive(listener: socket.socket, token: bytes = b"") -> dict[str, float]:
    """Read one connection on `listener` to its end: the bytes that arrived after the first
    SKIP_S and the seconds from then to the last. With a `token`, a connection whose first bytes
    are not the token is closed unread and the next one taken (another program found the port)."""
    while True:
        conn, _ = listener.accept()
        conn.settimeout(listener.gettimeout())
        with conn:
            if token and _read_exactly(conn, len(token)) != token:
                continue
            return _count(conn)


def _read_exactly(conn: socket.socket, count: int) -> bytes:
    got = b""
    while len(got) < count and (part := conn.recv(count - len(got))):
        got += part
    return got


def _count(conn: socket.socket) -> dict[str, float]:
    buffer = memoryview(bytearray(CHUNK))
    first = start = last = 0.0
    total = skipped = 0
    while count := conn.recv_into(buffer):
        last = time.perf_counter()
        if not total:
            first = start = last
        total += count
        if last - first < SKIP_S:
            start, skipped = last, total
    return {"bytes": total - skipped, "seconds": last - start}


def listen(address: str) -> tuple[socket.socket, bytes]:
    """A listener on a free port of `address` for one probe inside a job, and the token its
    sender must send first (`send`, `receive`)."""
    listener = socket.create_server((address, 0))
    listener.settimeout(PEER_TIMEOUT_S)
    return listener, os.urandom(TOKEN_BYTES)


def send(address: str, port: int, token: bytes, send_s: float = SEND_S) -> None:
    """Send `token`, then zeros for `send_s`, to a `listen`er at `address`:`port`."""
    with socket.create_connection((address, port), timeout=PEER_TIMEOUT_S) as out:
        out.sendall(token)
        zeros = memoryview(bytes(CHUNK))
        end = time.perf_counter() + send_s
        while time.perf_counter() < end:
            out.sendall(zeros)


def send_phases(hosts: int) -> list[int]:
    """In which phase host i sends to host i + 1 (mod `hosts`), so that no host sends and
    receives in the same phase: on a host whose one core also runs the TCP stack, a probe sent
    while another arrives reads a fraction of the link (a 10 Gbit/s link read 6-8 Gbit/s both
    ways at once against 9.5 one way). Alternate phases around the ring, and a third for the
    last host of an odd ring."""
    if hosts < 2:
        return []
    phases = [i % 2 for i in range(hosts)]
    if hosts % 2:
        phases[-1] = 2
    return phases


def main(argv: Sequence[str]) -> int:
    """`python -m hvd_train.core.linkrate HOST`: the TCP rate from this host to HOST (reached as
    mpirun reaches it, `core.network.remote_shell`), as one JSON line ({"host", "gbit_s",
    "megabytes", "seconds"}). `--receive`: the receiver `measure` starts, two JSON lines."""
    if argv[:1] != ["--receive"]:
        if len(argv) != 1:
            print("usage: python -m hvd_train.core.linkrate HOST", file=sys.stderr)
            return 2
        try:
            rate = measure(argv[0], network.remote_shell("mpirun"))
        except LauncherEnvironmentError as err:
            print(f"linkrate: {err}", file=sys.stderr)
            return 1
        print(json.dumps(dataclasses.asdict(rate) | {"gbit_s": round(rate.gbit_s, 3)}))
        return 0
    with socket.create_server(("", 0)) as listener:
        listener.settimeout(ANSWER_TIMEOUT_S)
        print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
        print(json.dumps(receive(listener)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
