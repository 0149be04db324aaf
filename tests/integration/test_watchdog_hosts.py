"""The watchdog across hosts: rank 0 and rank 1 in two network namespaces joined by a veth pair.

Each namespace is a host with its own loopback, like two machines: a heartbeat sent to rank 0's
loopback address from the other one goes nowhere. The addresses are in 198.18.0.0/15 (RFC 2544's
benchmarking range), on the veth pair only; the fixture removes the namespaces, the pair and any
process left in them. The ranks are `tests/integration/watchdog_peer.py` (no Horovod: the contact
that `_start_watchdog` broadcasts goes on the command line).
"""

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest
from jobs import PYTHON, REPO

PEER = str(REPO / "tests" / "integration" / "watchdog_peer.py")
ADDRESS_A, ADDRESS_B = "198.18.12.1", "198.18.12.2"


@dataclass
class Hosts:
    a: str  # network namespaces
    b: str
    veth_a: str  # the veth pair's ends, one in each
    veth_b: str


def ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def namespace_pids(name):
    return [int(p) for p in ip("netns", "pids", name, check=False).stdout.split()]


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or ip("netns", "list", check=False).returncode != 0:
        pytest.skip("`ip netns` (iproute2) is unavailable")
    tag = os.getpid() % 100_000  # unique per test process; interface names fit 15 characters
    hosts = Hosts(f"hvdwd{tag}a", f"hvdwd{tag}b", f"hvwd{tag}a", f"hvwd{tag}b")
    try:
        ip("netns", "add", hosts.a)
        ip("netns", "add", hosts.b)
        ip("link", "add", hosts.veth_a, "type", "veth", "peer", "name", hosts.veth_b)
        ends = [(hosts.a, hosts.veth_a, ADDRESS_A), (hosts.b, hosts.veth_b, ADDRESS_B)]
        for name, veth, address in ends:
            ip("link", "set", veth, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", veth)
            ip("-n", name, "link", "set", veth, "up")
            ip("-n", name, "link", "set", "lo", "up")  # a host's loopback works, as on a machine
        yield hosts
    finally:
        for name in (hosts.a, hosts.b):
            for pid in namespace_pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        ip("link", "del", hosts.veth_a, check=False)  # still here if it was never moved
        ip("netns", "del", hosts.a, check=False)  # takes its end of the pair, and the pair
        ip("netns", "del", hosts.b, check=False)
        left = ip("netns", "list").stdout
        assert hosts.a not in left and hosts.b not in left, left


class Rank:
    """watchdog_peer.py in a namespace; its output lines, read in a thread."""

    def __init__(self, namespace, *args, env=None):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, PYTHON, PEER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        self.output = []
        self._lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            self._lines.put(line.rstrip())

    def wait_for(self, prefix, timeout):
        """The next output line starting with `prefix`."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(queue.Empty):
                line = self._lines.get(timeout=left)
                if line.startswith(prefix):
                    return line
        raise AssertionError(f"no {prefix!r} line within {timeout} s:\n" + "\n".join(self.output))

    def traffic(self):
        """The counters of its last traffic line."""
        lines = [x for x in self.output if x.startswith("traffic ")]
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[-1])} if lines else {}

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def run_pair(hosts, chief_env, until):
    """Rank 0 in namespace a and rank 1 in b; `until(chief, rank1)` acts on them. Both are
    killed after it, whatever happens."""
    ranks = []
    try:
        chief = Rank(hosts.a, "chief", "2", env=chief_env)
        ranks.append(chief)
        contact = chief.wait_for("contact ", 30).split()[1:]
        rank1 = Rank(hosts.b, "rank", "1", "2", *contact)
        ranks.append(rank1)
        return contact, until(chief, rank1)
    finally:
        for rank in ranks:
            rank.kill()


def both_heard(chief, rank1, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if chief.traffic().get("received", 0) >= 5 and rank1.traffic().get("received", 0) >= 5:
            return
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not hear each other: {chief.output} {rank1.output}")


def test_rank_0_listens_on_the_address_other_hosts_reach(two_hosts):
    environs = [
        {},
        {"HOROVOD_GLOO_IFACE": two_hosts.veth_a},
        {"OMPI_MCA_btl_tcp_if_include": "198.18.12.0/24"},
        {"OMPI_MCA_oob_tcp_if_include": f"nosuch0,{two_hosts.veth_a}"},
        {"NCCL_SOCKET_IFNAME": two_hosts.veth_a[:-1]},  # a prefix, as NCCL reads it
        {"NCCL_SOCKET_IFNAME": "^lo"},  # an exclusion names nothing: no choice
        {"HOROVOD_GLOO_RENDEZVOUS_ADDR": ADDRESS_B},  # the route to it
        {"OMPI_MCA_orte_hnp_uri": f"4242.0;tcp://{ADDRESS_B}:40001;tcp6://[fd00::2]:40002"},
        {"HVD_TRAIN_WATCHDOG_IFACE": two_hosts.veth_a, "HOROVOD_GLOO_IFACE": "lo"},
        {"HVD_TRAIN_WATCHDOG_IFACE": "nosuch0"},
    ]

    def chosen(environs):
        out = ip("netns", "exec", two_hosts.a, PYTHON, PEER, "address", json.dumps(environs))
        return json.loads(out.stdout)

    before = chosen(environs)
    ip("-n", two_hosts.a, "route", "add", "default", "via", ADDRESS_B)
    after = chosen([{}])

    loopback, veth = "127.0.0.1", ADDRESS_A
    assert [address for address, _ in before["chosen"]] == [
        loopback, veth, veth, veth, veth, loopback, veth, veth, veth, "error"
    ], before  # fmt: skip
    hows = [how for _, how in before["chosen"]]
    assert hows[0] == hows[5] == "no other address found"  # what open_socket warns about
    assert hows[1] == f"interface {two_hosts.veth_a}, from HOROVOD_GLOO_IFACE"
    assert hows[2] == f"interface {two_hosts.veth_a}, from OMPI_MCA_btl_tcp_if_include"
    assert hows[6] == f"the route to {ADDRESS_B}, from HOROVOD_GLOO_RENDEZVOUS_ADDR"
    assert hows[7] == f"the route to {ADDRESS_B}, from OMPI_MCA_orte_hnp_uri"
    assert hows[8] == f"interface {two_hosts.veth_a}, from HVD_TRAIN_WATCHDOG_IFACE"
    assert "HVD_TRAIN_WATCHDOG_IFACE='nosuch0' matches no interface" in hows[9]
    assert after["chosen"] == [[ADDRESS_A, "the default route"]]
    # The old rule (this host name's address) gives loopback here, as 127.0.1.1 on Debian.
    assert before["old"].startswith("127.")


def test_rank_0_names_a_frozen_rank_on_another_host(two_hosts):
    def freeze_rank_1(chief, rank1):
        both_heard(chief, rank1)
        os.kill(rank1.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        os.kill(chief.proc.pid, signal.SIGUSR1)  # rank 0 now waits for rank 1 in a collective
        line = chief.wait_for("stall ", 20)
        took = time.monotonic() - frozen
        return line, took, chief.traffic(), rank1.traffic(), "\n".join(chief.output)

    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": ADDRESS_B}  # horovodrun's server, on the other host
    contact, (line, took, chief, rank1, output) = run_pair(two_hosts, env, freeze_rank_1)

    assert contact[0] == ADDRESS_A  # the veth's address, not loopback
    listens = f"watchdog: rank 0 listens on {ADDRESS_A}:{contact[1]} (the route to {ADDRESS_B}"
    assert listens in output and "WARNING" not in output, output
    # Named with the address its heartbeats came from: the other host's.
    assert f"did not arrive: rank 1 on {ADDRESS_B} (no heartbeat for" in line, line
    steps = int(re.search(r"rank 1 on \S+ \(no heartbeat for [\d.]+ s, at step (\d+)\)", line)[1])
    assert steps > 0  # rank 0 heard rank 1's progress before the freeze
    assert took < 10, f"{took:.1f} s from the freeze to rank 0's verdict"
    assert chief["ignored"] == rank1["ignored"] == 0
    assert chief["send_failures"] == rank1["send_failures"] == 0
    print(f"rank 1 frozen on the other host: named after {took:.1f} s: {line}")


def test_with_the_old_address_rank_0_never_hears_the_other_host(two_hosts):
    """Negative control: rank 0 on its host name's address (the old rule) hears nothing from the
    other host, and so calls a healthy rank 1 silent."""
    old = json.loads(ip("netns", "exec", two_hosts.a, PYTHON, PEER, "address", "[]").stdout)["old"]

    def run_healthy(chief, rank1):
        time.sleep(3)  # both step and beat: 30 heartbeats each way
        heard = chief.traffic(), rank1.traffic()
        os.kill(chief.proc.pid, signal.SIGUSR1)  # rank 0 waits; rank 1 keeps stepping
        return heard, chief.wait_for("stall ", 20), "\n".join(chief.output)

    env = {"HVD_TRAIN_WATCHDOG_HOST": old}
    contact, ((chief, rank1), line, output) = run_pair(two_hosts, env, run_healthy)

    assert contact[0] == old and old.startswith("127.")
    assert "a loopback address, but the job spans hosts" in output, output  # said, not silent
    assert chief["received"] == 0 and rank1["received"] == 0, (chief, rank1)
    assert rank1["sent"] >= 10 and rank1["send_failures"] == 0  # sent, silently, to nobody
    assert "rank 1 (no heartbeat for inf s, at step 0)" in line, line
