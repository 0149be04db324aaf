"""The TCP rate between a job's hosts, measured by its ranks at start (`comm.init`) where no
launcher gave it (HVD_TRAIN_LINK_GBIT) and the gradient buckets depend on it (`core.buckets`):
a job started by mpirun, srun or an sbatch script sizes its buckets as one started by
`hvd-train launch --launcher auto`.

The first rank of each host sends zeros for `core.linkrate.SEND_S` to the first rank of the next
host, around the ring of hosts, on the job's network (`core.network.job_interface`), in phases in
which no host both sends and receives (`core.linkrate.send_phases`); the job's rate is the
slowest of the ring's links. Every step is bounded (`core.linkrate.PEER_TIMEOUT_S`), and a probe
that fails leaves the rate unknown, so the buckets keep the slow link's choice.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hvd_train.comm import collectives
from hvd_train.core import linkrate, network

log = logging.getLogger("hvd_train")


@dataclass(frozen=True)
class Probed:
    """What the ring of hosts measured: `gbit_s`, the slowest link's rate (None where some link
    was not measured), and a line naming that link, or the first failure."""

    gbit_s: float | None
    why: str


def measure(hosts: Sequence[str], rank: int) -> Probed:
    """Measure the links between the hosts of the job; collective: every rank calls it, with the
    host name of every rank, in rank order.

    Args:
      hosts: the host name of each rank (rank order): the first rank of each host probes.
      rank: this rank.
    """
    first: dict[str, int] = {}
    for r, host in enumerate(hosts):
        first.setdefault(host, r)
    leaders = list(first)
    index = leaders.index(hosts[rank]) if first[hosts[rank]] == rank else None
    listener = None
    contact: tuple[str, int, bytes] | str | None = None
    # (how telling, what failed): a host that cannot listen or send is the cause; the receiver
    # that then waits in vain only its consequence.
    failures: list[tuple[int, str]] = []
    if index is not None:
        try:
            address = _address()
            listener, token = linkrate.listen(address)
            contact = (address, listener.getsockname()[1], token)
        except (OSError, ValueError) as err:  # told to the others: their sender skips this host
            contact = f"{hosts[rank]}: no listener for the link probe: {err}"
            failures.append((0, contact))
    try:
        contacts = collectives.allgather_object(contact, name="hvd_train.linkprobe.contacts")
        phases = linkrate.send_phases(len(leaders))
        received: float | None = None
        for phase in range(max(phases, default=-1) + 1):
            if index is not None and phases[index] == phase:
                to = leaders[(index + 1) % len(leaders)]
                if failed := _send(contacts[first[to]], to):
                    failures.append((1, failed))
            elif index is not None and phases[index - 1] == phase and listener is not None:
                got = _receive(listener, contact, leaders[index - 1], hosts[rank])
                if isinstance(got, str):
                    failures.append((2, got))
                else:
                    received = round(got, 2)
            # One phase at a time on every host: the next starts when this one has ended.
            collectives.barrier()
        found = collectives.allgather_object(
            (index, received, failures), name="hvd_train.linkprobe.rates"
        )
    finally:
        if listener is not None:
            listener.close()
    return _summary(leaders, [entry for entry in found if entry[0] is not None])


def _address() -> str:
    """The address this host's probe listens on: the job's interface, else the host name's."""
    chosen = network.job_interface(os.environ)
    return chosen.address if chosen else socket.gethostbyname(socket.gethostname())


def _send(contact: tuple[str, int, bytes] | str | None, to: str) -> str | None:
    if not isinstance(contact, tuple):
        return None  # `to` said why itself
    address, port, token = contact
    try:
        linkrate.send(address, port, token)
    except OSError as err:
        return f"the link probe's connection to {to} ({address}:{port}) failed: {err}"
    return None


def _receive(
    listener: socket.socket, contact: tuple[str, int, bytes] | str | None, sender: str, here: str
) -> float | str:
    assert isinstance(contact, tuple)
    try:
        got = linkrate.receive(listener, contact[2])
    except OSError as err:
        return f"{sender} -> {here}: nothing arrived ({err})"
    if got["seconds"] <= 0:
        return f"{sender} -> {here}: too little arrived to time"
    return got["bytes"] * 8e-9 / got["seconds"]


def _summary(
    leaders: list[str], found: list[tuple[int, float | None, list[tuple[int, str]]]]
) -> Probed:
    """The slowest link of the ring (host i received from host i - 1), or the most telling
    failure."""
    if failures := sorted(failure for _, _, listed in found for failure in listed):
        return Probed(None, failures[0][1])
    rates = {i: rate for i, rate, _ in found if rate is not None}
    if len(rates) < len(leaders):
        return Probed(None, "some host received no probe")
    slowest = min(rates, key=lambda i: rates[i])
    link = f"{leaders[slowest - 1]} -> {leaders[slowest]}"
    return Probed(rates[slowest], f"the slowest of {len(leaders)} link(s): {link}")
