"""The job's network: one rule that picks the interface a job spanning hosts uses for everything
(Open MPI's TCP transport, Horovod's Gloo, NCCL's sockets, the watchdog,
`hvd-train selftest`), with one override. docs/cluster.md ("The job's network") states the rule.

`hvd-train launch --hosts` chooses the network on the launching host (`for_hosts`) and hands it
to the ranks as HVD_TRAIN_IFACE=a.b.c.d/n; each rank finds its own interface in it
(`job_interface`), whose name may differ from host to host, and `hvd_train.init()` points Open MPI
and NCCL at it before Horovod starts (`rank_settings`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import shlex
import socket
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hvd_train.core.environment import LauncherEnvironmentError

JOB_IFACE = "HVD_TRAIN_IFACE"  # the override: an interface name or a network a.b.c.d/n
# Where launchers say which interfaces the job's traffic uses, in the order trusted.
LAUNCHER_IFACE_VARIABLES = (
    "HOROVOD_GLOO_IFACE",  # horovodrun --gloo: its --network-interfaces, or those it found
    "OMPI_MCA_btl_tcp_if_include",  # Open MPI (mpirun --mca, or horovodrun over MPI)
    "OMPI_MCA_oob_tcp_if_include",
    "NCCL_SOCKET_IFNAME",  # name prefixes, "=name" exact; "^..." only excludes
)
# The launcher's host: the route from here to it leaves by the job's interface.
PEER_VARIABLES = (
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",  # horovodrun's rendezvous server
    "SLURM_LAUNCH_NODE_IPADDR",  # the node srun ran on
    "OMPI_MCA_orte_hnp_uri",  # mpirun (Open MPI 4): "jobid;tcp://a.b.c.d[,e.f.g.h]:port;..."
)
# Set for the ranks from the job's network where the user set none.
MPI_TRANSPORT = "OMPI_MCA_btl_tcp_if_include"
NCCL_IFACE = "NCCL_SOCKET_IFNAME"

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
_SIOCGIFNETMASK = 0x891B  # and its netmask


@dataclass(frozen=True)
class Interface:
    """One IPv4 interface of this host, and how it was chosen."""

    name: str
    address: str
    network: ipaddress.IPv4Network
    how: str = ""


def interfaces() -> list[Interface]:
    """This host's interfaces that have an IPv4 address, in the kernel's order."""
    found = []
    for _, name in socket.if_nameindex():
        if (address := interface_address(name)) and (mask := _ioctl_address(name, _SIOCGIFNETMASK)):
            network = ipaddress.ip_network(f"{address}/{mask}", strict=False)
            found.append(Interface(name, address, network))
    return found


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None (no such interface, or no IPv4 address)."""
    return _ioctl_address(name, _SIOCGIFADDR)


def _ioctl_address(name: str, request: int) -> str | None:
    ifreq = struct.pack("256s", name.encode()[:15])  # struct ifreq: the name, then the address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), request, ifreq)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def route_source(peer: str) -> str | None:
    """This host's address on the route to `peer`, or None (no route, or a name that does not
    resolve). Connecting a UDP socket only asks the routing table: no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address == "0.0.0.0" else address


def matching(spec: str, prefixes: bool = False) -> Iterator[Interface]:
    """This host's interfaces named by a comma-separated list of interface names or networks
    (a.b.c.d/n), as Open MPI's if_include; with `prefixes`, names match as NCCL_SOCKET_IFNAME's."""
    if spec.startswith("^"):
        return  # an exclusion names no interface to use
    present = interfaces()
    for item in (x.strip() for x in spec.split(",")):
        exact = item.startswith("=")
        item = item.lstrip("=")
        if "/" in item:
            try:
                network = ipaddress.ip_network(item, strict=False)
            except ValueError:
                continue
            yield from (i for i in present if ipaddress.ip_address(i.address) in network)
        elif item:
            yield from (
                i
                for i in present
                if i.name == item or (prefixes and not exact and i.name.startswith(item))
            )


def _owner(address: str, how: str) -> Interface | None:
    """The interface holding `address` (the source of a route), or None."""
    for found in interfaces():
        if found.address == address:
            return Interface(found.name, found.address, found.network, how)
    return None


def job_interface(environ: Mapping[str, str]) -> Interface | None:
    """This rank's interface for the job's traffic, by the rule; None when nothing names one.

    In order: HVD_TRAIN_IFACE (a name or a network; `hvd-train launch` sets the network it chose);
    the interfaces the launcher names (`LAUNCHER_IFACE_VARIABLES`); the interface of the route to
    the launcher's host (`PEER_VARIABLES`). Loopback interfaces are passed over past the override.

    Raises:
      LauncherEnvironmentError: HVD_TRAIN_IFACE matches no interface of this host.
    """
    if spec := environ.get(JOB_IFACE):
        for found in matching(spec):
            return Interface(found.name, found.address, found.network, f"from {JOB_IFACE}")
        names = ", ".join(f"{i.name} {i.address}/{i.network.prefixlen}" for i in interfaces())
        raise LauncherEnvironmentError(
            f"{JOB_IFACE}={spec!r} matches no interface with an IPv4 address on host "
            f"{socket.gethostname()} (it has {names})"
        )
    for candidate in _launcher_interfaces(environ):
        if not ipaddress.ip_address(candidate.address).is_loopback:
            return candidate
    return None


def _launcher_interfaces(environ: Mapping[str, str]) -> Iterator[Interface]:
    for variable in LAUNCHER_IFACE_VARIABLES:
        for found in matching(environ.get(variable, ""), prefixes=variable == NCCL_IFACE):
            yield Interface(found.name, found.address, found.network, f"from {variable}")
    for variable in PEER_VARIABLES:
        value = environ.get(variable, "")
        peers = re.findall(r"tcp://([0-9.,]+):", value) if "://" in value else [value]
        for peer in (p for group in peers for p in group.split(",") if p):
            source = route_source(peer)
            if source and (found := _owner(source, f"the route to {peer}, from {variable}")):
                yield found


def rank_settings(environ: Mapping[str, str], spans_hosts: bool) -> dict[str, str]:
    """What `hvd_train.init()` sets before Horovod starts so that Open MPI and NCCL use this
    rank's `job_interface`, in a job that spans hosts or names its network: only variables the
    user or the launcher left unset.

    Left alone, Open MPI's TCP transport tries every interface, and one whose address every host
    has (docker0) hangs the first collective; NCCL takes the first interface it likes.

    Raises:
      LauncherEnvironmentError: from `job_interface`.
    """
    if not spans_hosts and not environ.get(JOB_IFACE):
        return {}
    chosen = job_interface(environ)
    if chosen is None:
        return {}
    wanted = {
        MPI_TRANSPORT: str(chosen.network),
        NCCL_IFACE: f"={chosen.name}",  # exact: NCCL matches prefixes ("eth" is eth0, eth1...)
    }
    return {name: value for name, value in wanted.items() if not environ.get(name)}


def _is_this_host(name: str) -> bool:
    """`name` is this host: localhost, its own name, or a name for one of its addresses
    (Debian's `127.0.1.1 name` line included)."""
    if name in ("localhost", socket.gethostname()):
        return True
    try:
        address = ipaddress.ip_address(socket.gethostbyname(name))
    except OSError:
        return False
    return address.is_loopback or any(str(address) == i.address for i in interfaces())


def other_hosts(hosts: Sequence[str]) -> list[str]:
    """The names in `hosts` ("name:slots" entries) that are not this host, each once."""
    names = [h.rsplit(":", 1)[0] for h in hosts]
    return [n for n in dict.fromkeys(names) if not _is_this_host(n)]


def for_hosts(
    hosts: Sequence[str], override: str | None, remote_shell: Sequence[str] = ("ssh",)
) -> Interface | None:
    """The job's network for a launch on `hosts` ("name:slots" entries), chosen on this host.

    The rule: the override (an interface name or a network) if given, else the interface of the
    route from this host to the other hosts, by the names given. None when every host is this
    one and there is no override (nothing crosses a network).

    An override is checked on every other host (`probe_hosts`, through `remote_shell`, as the
    launcher reaches them): each must have an interface in the override's network, each at its
    own address. An interface whose address every host has (docker0 and other host-local
    bridges) carries nothing between hosts.

    Raises:
      LauncherEnvironmentError: a host name that does not resolve, no route to a host, routes
        to the hosts that leave by different interfaces; an override that matches no interface
        here, that a host lacks, or whose address two hosts share; a host the probe cannot reach.
    """
    others = other_hosts(hosts)
    if override:
        chosen = _override_interface(override)
        if others:
            _check_override(chosen, override, others, remote_shell)
        return chosen
    if not others:
        return None
    routes = {}
    for name in others:
        try:
            address = socket.gethostbyname(name)
        except OSError as err:
            raise LauncherEnvironmentError(f"host {name!r} does not resolve: {err}") from None
        routes[name] = _route_interface(address)
    missing = [name for name, via in routes.items() if via is None]
    if missing:
        raise LauncherEnvironmentError(f"no route from this host to {', '.join(missing)}")
    by = {via.name for via in routes.values() if via}
    if len(by) > 1:
        listed = ", ".join(f"{name} by {via.name}" for name, via in routes.items() if via)
        raise LauncherEnvironmentError(
            f"the routes to the hosts leave by different interfaces ({listed}): name the job's "
            "network with --network-interface"
        )
    first = next(iter(routes.values()))
    assert first is not None
    return Interface(first.name, first.address, first.network, f"the route to {others[0]}")


def _check_override(
    chosen: Interface, override: str, others: Sequence[str], remote_shell: Sequence[str]
) -> None:
    found = probe_hosts(others, str(chosen.network), remote_shell)
    if chosen.address:
        found = {socket.gethostname(): chosen, **found}
    lacking = [host for host, interface in found.items() if interface is None]
    if lacking:
        raise LauncherEnvironmentError(
            f"--network-interface {override}: host {lacking[0]} has no interface in "
            f"{chosen.network}"
        )
    by_address: dict[str, list[str]] = {}
    for host, interface in found.items():
        assert interface is not None
        by_address.setdefault(interface.address, []).append(host)
    for address, sharing in by_address.items():
        if len(sharing) > 1:
            raise LauncherEnvironmentError(
                f"--network-interface {override}: hosts {' and '.join(sharing[:2])} both have "
                f"{address} on it, a host-local interface (docker0 and other host-local bridges "
                "have the same address on every host) that carries nothing between hosts"
            )


OMPI_RSH_AGENT = "OMPI_MCA_plm_rsh_agent"


def remote_shell(launcher: str) -> list[str]:
    """How `launcher` reaches other hosts: Open MPI's agent (OMPI_MCA_plm_rsh_agent, its first
    alternative; default ssh), or horovodrun's ssh from PATH."""
    agent = os.environ.get(OMPI_RSH_AGENT, "") if launcher == "mpirun" else ""
    return shlex.split(agent.split(":")[0]) or ["ssh"]


PROBE_TIMEOUT_S = 30


def probe_hosts(
    hosts: Sequence[str], spec: str, remote_shell: Sequence[str]
) -> dict[str, Interface | None]:
    """Each host's interface matching `spec` (None where it has none), asked over `remote_shell`
    (`ssh`, or the launcher's agent) in parallel, by `python -m hvd_train.core.network` there.

    Raises:
      LauncherEnvironmentError: a host that does not answer within PROBE_TIMEOUT_S, or whose
        answer is no probe result.
    """
    answers = ask_hosts(hosts, ["hvd_train.core.network", spec], remote_shell, "network probe")
    return {
        host: Interface(a["name"], a["address"], ipaddress.ip_network(a["network"])) if a else None
        for host, a in answers.items()
    }


def ask_hosts(
    hosts: Sequence[str], module: Sequence[str], remote_shell: Sequence[str], what: str
) -> dict[str, Any]:
    """Each host's answer to `python -m MODULE ARGS...` (`module`), run there over `remote_shell`
    in parallel with this Python's path: the JSON of its last line of output.

    Raises:
      LauncherEnvironmentError: a host that does not answer within PROBE_TIMEOUT_S, or whose
        last line is no JSON; `what` names the probe.
    """
    import json
    import subprocess
    import sys

    remote = shlex.join([sys.executable, "-m", *module])
    started = {
        host: subprocess.Popen(
            [*remote_shell, host, remote],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in hosts
    }
    found: dict[str, Any] = {}
    for host, proc in started.items():
        try:
            out, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in started.values():
                other.kill()
                other.communicate()
            raise LauncherEnvironmentError(
                f"host {host} did not answer the {what} in {PROBE_TIMEOUT_S} s "
                f"({shlex.join(remote_shell)})"
            ) from None
        try:
            found[host] = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise LauncherEnvironmentError(
                f"host {host}: the {what} failed (exit {proc.returncode}): {last}"
            ) from None
    return found


def main(argv: Sequence[str]) -> int:
    """`python -m hvd_train.core.network SPEC`: this host's first interface matching SPEC, as one
    JSON line ({"name", "address", "network"}, or null)."""
    import json

    found = next(matching(argv[0]), None) if argv else None
    record = found and {"name": found.name, "address": found.address, "network": str(found.network)}
    print(json.dumps(record))
    return 0


def _route_interface(address: str) -> Interface | None:
    source = route_source(address)
    return _owner(source, "") if source else None


def _override_interface(spec: str) -> Interface:
    """The interface or network an override names. A network that no interface of this host is
    in (mpirun started from a login node outside the job's network) stands as it is."""
    for found in matching(spec):
        network = ipaddress.ip_network(spec, strict=False) if "/" in spec else found.network
        return Interface(found.name, found.address, network, "from --network-interface")
    if "/" in spec:
        try:
            network = ipaddress.ip_network(spec, strict=False)
        except ValueError:
            raise LauncherEnvironmentError(f"--network-interface {spec}: not a network") from None
        if isinstance(network, ipaddress.IPv4Network):
            return Interface("", "", network, "from --network-interface")
    names = ", ".join(f"{i.name} {i.address}/{i.network.prefixlen}" for i in interfaces())
    raise LauncherEnvironmentError(
        f"--network-interface {spec}: no such IPv4 interface or network on this host (it has "
        f"{names})"
    )


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
