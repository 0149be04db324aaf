"""The job's network rule (hvd_train.core.network) on this host's own interfaces; across hosts it
is tested on the cluster tier (tests/cluster/test_cluster.py)."""

import ipaddress
import socket

import pytest

from hvd_train.core import network
from hvd_train.core.environment import LauncherEnvironmentError


def test_interfaces_have_their_networks():
    loopback = next(i for i in network.interfaces() if i.name == "lo")
    assert loopback.address == "127.0.0.1"
    assert loopback.network == ipaddress.ip_network("127.0.0.0/8")


def test_matching_by_name_network_and_nccl_prefix():
    assert [i.name for i in network.matching("lo")] == ["lo"]
    assert [i.name for i in network.matching("127.0.0.0/8")] == ["lo"]
    assert [i.name for i in network.matching("l", prefixes=True)] == ["lo"]
    assert list(network.matching("l")) == []  # a prefix only where NCCL's rule applies
    assert list(network.matching("=l", prefixes=True)) == []  # "=name" is exact
    assert list(network.matching("^lo")) == []  # an exclusion names nothing to use


def test_job_interface_order_override_then_launcher_then_route():
    assert network.job_interface({}) is None
    chosen = network.job_interface({"HVD_TRAIN_IFACE": "127.0.0.0/8"})
    assert (chosen.name, chosen.how) == ("lo", "from HVD_TRAIN_IFACE")
    # Past the override loopback is passed over: one host's launcher variables name no network.
    assert network.job_interface({"HOROVOD_GLOO_IFACE": "lo"}) is None
    # The route to the launcher's host: here, loopback again.
    assert network.job_interface({"SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}) is None


def test_job_interface_override_that_matches_nothing_names_what_there_is():
    with pytest.raises(LauncherEnvironmentError, match=r"HVD_TRAIN_IFACE='nosuch0' matches no"):
        network.job_interface({"HVD_TRAIN_IFACE": "nosuch0"})
    with pytest.raises(LauncherEnvironmentError, match=r"it has lo 127\.0\.0\.1/8"):
        network.job_interface({"HVD_TRAIN_IFACE": "10.255.255.0/24"})


def test_rank_settings_only_across_hosts_or_with_the_override():
    assert network.rank_settings({}, spans_hosts=False) == {}
    assert network.rank_settings({}, spans_hosts=True) == {}  # nothing names a network
    assert network.rank_settings({"HVD_TRAIN_IFACE": "lo"}, spans_hosts=False) == {
        "OMPI_MCA_btl_tcp_if_include": "127.0.0.0/8",
        "NCCL_SOCKET_IFNAME": "=lo",
    }
    # What the user or the launcher set stands.
    settings = network.rank_settings(
        {"HVD_TRAIN_IFACE": "lo", "NCCL_SOCKET_IFNAME": "ib"}, spans_hosts=True
    )
    assert settings == {"OMPI_MCA_btl_tcp_if_include": "127.0.0.0/8"}


def test_for_hosts_on_this_host_and_unknown_hosts():
    assert network.for_hosts(["localhost:2", f"{socket.gethostname()}:1"], None) is None
    assert network.for_hosts(["localhost:2"], "lo").name == "lo"
    with pytest.raises(LauncherEnvironmentError, match=r"host 'no-such-host\.invalid' does not"):
        network.for_hosts(["localhost:1", "no-such-host.invalid:1"], None)
    with pytest.raises(LauncherEnvironmentError, match=r"--network-interface 10\.0\.0\.0/33"):
        network.for_hosts(["localhost:1"], "10.0.0.0/33")


def test_route_source_asks_the_routing_table_only():
    assert network.route_source("127.0.0.1") == "127.0.0.1"
    assert network.route_source("no-such-host.invalid") is None


# A remote shell that runs the probe here, whatever the host: every "host" then has this host's
# interfaces, at this host's addresses, as a decoy has on every host.
HERE = ["sh", "-c", 'eval "$1"']


def test_an_override_whose_address_every_host_has_is_refused():
    with pytest.raises(
        LauncherEnvironmentError, match=r"hosts .* and fake-a both have 127\.0\.0\.1"
    ):
        network.for_hosts(["localhost:1", "fake-a:1", "fake-b:1"], "lo", HERE)


def test_an_override_a_host_lacks_is_refused():
    with pytest.raises(LauncherEnvironmentError, match=r"host fake-a has no interface in 10\.9"):
        network.for_hosts(["fake-a:1", "fake-b:1"], "10.9.0.0/16", HERE)


def test_a_host_the_probe_cannot_reach_is_named():
    with pytest.raises(LauncherEnvironmentError, match=r"host fake-a: the network probe failed"):
        network.for_hosts(["fake-a:1"], "lo", ["false"])


def test_probe_answers_one_json_line(capsys):
    assert network.main(["127.0.0.0/8"]) == 0
    assert (
        capsys.readouterr().out
        == '{"name": "lo", "address": "127.0.0.1", "network": "127.0.0.0/8"}\n'
    )
    network.main(["10.9.0.0/16"])
    assert capsys.readouterr().out == "null\n"
