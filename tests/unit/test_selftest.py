"""`hvd-train selftest`'s pure parts: the pair schedule, the problem rules on gathered numbers, the
table, the options; one pair's measurement over loopback; how doctor finds NCCL. The collective
part runs in tests/integration/test_selftest_one_host.py (one host) and
tests/cluster/test_selftest.py (three)."""

import argparse
import itertools
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from hvd_train import cli, doctor, selftest
from hvd_train.errors import UserError
from hvd_train.selftest import Link, Options, RankReport

BUILD = {"mpi": True, "gloo": True, "nccl": False, "cuda": False}
VERSIONS = {"horovod": "0.28.1", "tensorflow": "2.21.0"}


def rank(r, host, step_ms=10.0, **fields):
    """Rank r on `host`, on the data network at 198.18.1.<host number>."""
    n = int(host.lstrip("h"))
    values = dict(
        rank=r,
        host=host,
        local_rank=0,
        controller="mpi",
        build=dict(BUILD),
        versions=dict(VERSIONS),
        nccl=None,
        gpus=0,
        interface="data0",
        address=f"198.18.1.{n}",
        network="198.18.1.0/24",
        step_ms=step_ms,
        port=40000 + n,
    )
    values.update(fields)
    return RankReport(**values)


def link(a, b, mb_per_s, latency_us=50.0):
    return Link(a, b, mb_per_s, mb_per_s, mb_per_s + 100, latency_us)


THREE = [rank(0, "h1"), rank(1, "h2"), rank(2, "h3")]
HEALTHY_LINKS = [link("h1", "h2", 900.0), link("h1", "h3", 1000.0), link("h2", "h3", 1100.0)]


def problems(ranks=THREE, links=HEALTHY_LINKS, **options):
    return selftest.find_problems(ranks, links, Options(**options))


# --- the pair schedule ---------------------------------------------------------------------------


@pytest.mark.parametrize("hosts", range(0, 9))
def test_every_pair_up_to_eight_hosts(hosts):
    pairs = selftest.pair_schedule(hosts)
    assert len(pairs) == hosts * (hosts - 1) // 2
    assert sorted(pairs) == list(itertools.combinations(range(hosts), 2))


def test_one_host_has_no_pairs_and_two_have_one():
    assert selftest.pair_schedule(1) == []
    assert selftest.pair_schedule(2) == [(0, 1)]


@pytest.mark.parametrize("hosts", [9, 16, 100])
def test_a_ring_beyond_eight_hosts(hosts):
    pairs = selftest.pair_schedule(hosts)
    assert pairs == [(a, (a + 1) % hosts) for a in range(hosts)]
    for host in range(hosts):  # each host in two pairs, each pair once
        assert sum(host in pair for pair in pairs) == 2
    assert len({frozenset(p) for p in pairs}) == hosts


# --- the rules -----------------------------------------------------------------------------------


def test_a_healthy_job_has_no_problem():
    assert problems() == []
    assert problems(ranks=[rank(0, "h1"), rank(1, "h1", local_rank=1)], links=[]) == []


def test_a_rank_slower_than_the_median_by_more_than_max_skew():
    ranks = [rank(0, "h1", 10.0), rank(1, "h2", 10.0), rank(2, "h3", 13.0)]
    found = problems(ranks, max_skew=0.25)
    assert found == [
        "rank 2 on host h3: compute step 13.0 ms, 30% slower than the median 10.0 ms "
        "(--max-skew 0.25)"
    ]
    assert problems(ranks, max_skew=0.3) == []  # 13 = 10 * (1 + 0.3): not more than
    # A faster rank is no problem, nor a slow median.
    assert problems([rank(0, "h1", 5.0), rank(1, "h2", 10.0), rank(2, "h3", 10.0)]) == []


def test_max_skew_zero_names_every_rank_above_the_median():
    ranks = [rank(0, "h1", 10.0), rank(1, "h2", 10.1)]  # the median of two is their mean
    assert [p.split(":")[0] for p in problems(ranks, links=[], max_skew=0)] == ["rank 1 on host h2"]


def test_a_collective_mismatch_names_the_rank():
    ranks = [*THREE[:2], rank(2, "h3", collective_errors=["allreduce sum gave [5.0], expected 6"])]
    assert problems(ranks) == ["rank 2 on host h3: allreduce sum gave [5.0], expected 6"]


def test_a_host_on_another_network():
    ranks = [*THREE[:2], rank(2, "h3", interface="eth1", address="10.0.0.3", network="10.0.0.0/24")]
    assert problems(ranks) == [
        "host h3 (rank 2): interface eth1 10.0.0.3 is on 10.0.0.0/24, the other ranks on "
        "198.18.1.0/24 (ranks 0,1)"
    ]


def test_the_decoy_address_on_every_host():
    decoy = {"interface": "docker0", "address": "198.19.255.1", "network": "198.19.255.0/24"}
    ranks = [rank(0, "h1", **decoy), rank(1, "h2", **decoy), rank(2, "h3", **decoy)]
    assert problems(ranks) == [
        "hosts h1 (docker0), h2 (docker0), h3 (docker0) all have the job's address 198.19.255.1: "
        "a host-local interface (docker0 and other bridges) carries no traffic between hosts; "
        "name the job's network (HVD_TRAIN_IFACE=a.b.c.d/n)"
    ]
    # Two ranks of one host share its address: no problem.
    same = [rank(0, "h1"), rank(1, "h1", local_rank=1), rank(2, "h2")]
    assert problems(same, links=[link("h1", "h2", 900.0)]) == []


def test_no_interface_is_fine_on_one_host_only():
    alone = [rank(0, "h1", interface=None, address=None, network=None)]
    assert problems(alone, links=[]) == []
    ranks = [*THREE[:2], rank(2, "h3", interface=None, address=None, network=None)]
    (found,) = problems(ranks, links=HEALTHY_LINKS)
    assert found.startswith("rank 2 on host h3: no job interface in a job across hosts")
    error = "HVD_TRAIN_IFACE='nosuch0' matches no interface with an IPv4 address on host h3"
    ranks[2] = rank(2, "h3", interface=None, address=None, network=None, interface_error=error)
    assert problems(ranks) == [f"rank 2 on host h3: {error}"]


def test_a_slow_link_below_half_the_median_of_the_others():
    # h3 shaped to 50 Mbit/s: both of its pairs; h1 - h2 is not below the others' median (6 MB/s).
    links = [link("h1", "h2", 900.0), link("h1", "h3", 6.0), link("h2", "h3", 6.1)]
    assert problems(links=links) == [
        "hosts h1 - h3: 6.0 MB/s, below half the median of the other pairs (453.1 MB/s)",
        "hosts h2 - h3: 6.1 MB/s, below half the median of the other pairs (453.0 MB/s)",
    ]
    # Exactly half is not below; a single pair has no others to compare with.
    assert problems(links=[link("h1", "h2", 100.0), link("h1", "h3", 50.0)]) == []
    assert problems(THREE[:2], links=[link("h1", "h2", 1.0)]) == []


def test_min_bandwidth_is_a_floor_in_mb_per_s():
    assert problems(min_bandwidth=900.0) == []
    assert problems(min_bandwidth=950.0) == [
        "hosts h1 - h2: 900.0 MB/s, below --min-bandwidth 950 MB/s"
    ]


def test_a_pair_not_measured():
    links = [*HEALTHY_LINKS[:2], Link("h2", "h3", error="TimeoutError: timed out")]
    assert problems(links=links) == ["hosts h2 - h3: not measured: TimeoutError: timed out"]


def test_builds_and_versions_that_differ_between_hosts():
    ranks = [
        rank(0, "h1"),
        rank(1, "h2", versions={"horovod": "0.28.0", "tensorflow": "2.21.0"}),
        rank(2, "h3", build={**BUILD, "gloo": False}),
    ]
    assert problems(ranks) == [
        "Horovod versions differ between hosts: h1 0.28.1, h2 0.28.0, h3 0.28.1",
        "Horovod builds differ between hosts: h1 mpi+gloo, h2 mpi+gloo, h3 mpi",
    ]


def test_the_controller_in_use_missing_from_the_build():
    ranks = [rank(0, "h1", controller="gloo", build={**BUILD, "gloo": False})]
    (found,) = problems(ranks, links=[])
    assert found.startswith("rank 0 on host h1: the job runs Horovod's gloo controller, which")


def test_nccl_rules():
    nccl = {**BUILD, "nccl": True, "cuda": True}
    ok = [
        rank(0, "h1", build=nccl, nccl="2.28.9", gpus=1),
        rank(1, "h2", build=nccl, nccl="2.28.9"),
    ]
    assert problems(ok, links=[link("h1", "h2", 900.0)]) == []
    absent = [ok[0], rank(1, "h2", build=nccl, nccl=None)]
    assert problems(absent, links=[link("h1", "h2", 900.0)])[0].startswith(
        "host h2: Horovod was built with NCCL, but no NCCL library is found"
    )
    skew = [ok[0], rank(1, "h2", build=nccl, nccl="2.21.5")]
    assert problems(skew, links=[link("h1", "h2", 900.0)]) == [
        "NCCL versions differ between hosts (NCCL needs one): h1 2.28.9, h2 2.21.5"
    ]
    gpus_without_nccl = [rank(0, "h1", gpus=2)]
    assert problems(gpus_without_nccl, links=[])[0].startswith(
        "host h1: 2 GPU(s), but Horovod was built without NCCL"
    )
    assert problems([rank(0, "h1", nccl=None)], links=[]) == []  # a CPU job: absent is fine


# --- the table and the JSON ----------------------------------------------------------------------


def test_the_table_of_a_healthy_job():
    ranks = [rank(0, "h1", 20.0), rank(1, "h2", 10.0), rank(2, "h3", 20.0)]
    text = selftest.table(ranks, HEALTHY_LINKS, [])
    assert text.splitlines() == [
        "selftest: 3 rank(s) on 3 host(s), controller mpi; Horovod 0.28.1 (built: mpi+gloo), "
        "TensorFlow 2.21.0",
        "host  ranks  interface  address     network        step ms  skew  nccl",
        "h1    0      data0      198.18.1.1  198.18.1.0/24  20.0     +0%   absent",
        "h2    1      data0      198.18.1.2  198.18.1.0/24  10.0     -50%  absent",
        "h3    2      data0      198.18.1.3  198.18.1.0/24  20.0     +0%   absent",
        "pair     MB/s    a->b MB/s  b->a MB/s  latency us",
        "h1 - h2  900.0   900.0      1000.0     50",
        "h1 - h3  1000.0  1000.0     1100.0     50",
        "h2 - h3  1100.0  1100.0     1200.0     50",
        "collectives (allreduce sum and average, allgather, broadcast): as expected on 3 rank(s)",
        "selftest: ok",
    ]


def test_the_table_of_one_host_with_problems():
    ranks = [
        rank(0, "h1", interface=None, address=None, network=None),
        rank(1, "h1", 30.0, local_rank=1, collective_errors=["x"]),
    ]
    text = selftest.table(ranks, [], ["rank 1 on host h1: x"])
    assert "h1    0,1    - (none)   -        -        30.0     +50%  absent" in text
    assert "pairs: none (one host)" in text
    assert "wrong on 1 rank(s)" in text
    assert text.endswith("PROBLEM: rank 1 on host h1: x\nselftest: 1 problem(s)")


def test_the_json_holds_every_number():
    data = selftest.report_json(THREE, HEALTHY_LINKS, [], Options(max_skew=0.5))
    assert data["ok"] and data["hosts"] == ["h1", "h2", "h3"]
    assert data["options"] == {"max_skew": 0.5, "min_bandwidth_mb_per_s": 0.0}
    assert [r["address"] for r in data["ranks"]] == ["198.18.1.1", "198.18.1.2", "198.18.1.3"]
    assert data["links"][0] == {
        "a": "h1",
        "b": "h2",
        "mb_per_s": 900.0,
        "a_to_b_mb_per_s": 900.0,
        "b_to_a_mb_per_s": 1000.0,
        "latency_us": 50.0,
        "error": None,
    }


def test_the_allreduce_rate_across_each_hosts_link():
    # 2 hosts x 2 ranks: a flat ring carries 1.5 x 32 MiB across each host's link each way.
    timing = selftest.allreduce_timing(32 << 20, 0.1, ranks=4, hosts=2)
    assert timing.mb_per_s == pytest.approx(1.5 * (32 << 20) / 0.1 / 1e6)
    assert selftest.allreduce_timing(32 << 20, 0.1, ranks=2, hosts=2).mb_per_s == pytest.approx(
        (32 << 20) / 0.1 / 1e6
    )
    assert selftest.allreduce_timing(32 << 20, 0.1, ranks=2, hosts=1).mb_per_s is None  # no link


def test_the_allreduce_size_follows_the_slowest_link():
    assert selftest.allreduce_bytes([]) == 32 << 20  # one host: no link to wait for
    assert selftest.allreduce_bytes(HEALTHY_LINKS) == 32 << 20  # 900 MB/s x 0.25 s is more
    slow = [link("h1", "h2", 40.0), link("h1", "h3", 2.0)]
    assert selftest.allreduce_bytes(slow) == 1 << 20  # 0.5 MB would be less than the floor
    tc_50mbit = [link("h1", "h3", 6.25)]  # the cluster test's slow host
    assert selftest.allreduce_bytes(tc_50mbit) == 1_562_500
    middle = [link("h1", "h2", 40.0)]
    assert selftest.allreduce_bytes(middle) == 10_000_000  # 40 MB/s x 0.25 s
    unmeasured = [selftest.Link("h1", "h2", error="timed out")]
    assert selftest.allreduce_bytes(unmeasured) == 32 << 20


def test_the_allreduce_in_the_table_and_the_json():
    timing = selftest.allreduce_timing(32 << 20, 0.05, ranks=3, hosts=3)
    text = selftest.table(THREE, HEALTHY_LINKS, [], timing)
    line = "allreduce of 33.6 MB on 3 rank(s): 50.0 ms, 894.8 MB/s across each host's link"
    assert line in text.splitlines()
    one_host = selftest.allreduce_timing(1 << 20, 0.002, ranks=2, hosts=1)
    assert "allreduce of 1.0 MB on 2 rank(s): 2.0 ms" in selftest.table(THREE, [], [], one_host)
    data = selftest.report_json(THREE, HEALTHY_LINKS, [], Options(), timing)
    assert data["allreduce"] == {
        "nbytes": 32 << 20,
        "seconds": 0.05,
        "ranks": 3,
        "hosts": 3,
        "mb_per_s": pytest.approx(4 / 3 * (32 << 20) / 0.05 / 1e6),
    }


# --- the options ---------------------------------------------------------------------------------


def parse(*argv):
    return cli._selftest_options(list(argv))


def test_options_defaults_and_values(tmp_path):
    assert parse() == Options(max_skew=0.25, min_bandwidth=0.0, json_path=None)
    out = tmp_path / "r.json"
    assert parse("--max-skew", "0", "--min-bandwidth", "125", "--json", str(out)) == Options(
        0.0, 125.0, out
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-skew", "-0.1"], "--max-skew must be >= 0, got -0.1"),
        (["--min-bandwidth", "-1"], "--min-bandwidth must be >= 0 MB/s, got -1.0"),
        (["--max-skew", "nan"], "--max-skew must be >= 0, got nan"),
    ],
)
def test_bad_options_are_one_line(argv, message):
    with pytest.raises(UserError, match=message):
        parse(*argv)
    with pytest.raises(cli.UsageError, match="unrecognized arguments: --nope"):
        parse("--nope")


def test_launch_checks_selftest_options_before_any_worker(capsys):
    assert cli.main(["launch", "--np", "2", "--", "selftest", "--max-skew", "-1"]) == 2
    assert (
        "hvd-train: error: hvd-train selftest: --max-skew must be >= 0" in capsys.readouterr().err
    )
    assert cli.main(["launch", "--np", "2", "--dry-run", "--", "selftest"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("mpirun -np 2 -H localhost:2") and "hvd_train.cli selftest" in shown


def test_selftest_options_parse_with_argparse_namespace():
    namespace = argparse.Namespace(max_skew=1.0, min_bandwidth=0.0, json=None)
    assert selftest.options(namespace) == Options(1.0, 0.0, None)


# --- NCCL, as doctor finds it --------------------------------------------------------------------


def test_nccl_versions_from_the_library_code():
    assert doctor.nccl_version(22809) == "2.28.9"  # NCCL >= 2.9: major*10000 + minor*100 + patch
    assert doctor.nccl_version(2708) == "2.7.8"  # before: major*1000 + minor*100 + patch


def test_nccl_from_a_wheel_folder(tmp_path, monkeypatch):
    folder = tmp_path / "site" / "nvidia" / "nccl"  # as nvidia-nccl-cu13: no __init__.py
    (folder / "include").mkdir(parents=True)
    (folder / "lib").mkdir()
    (folder / "include" / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 9\n"
        '#define NCCL_SUFFIX ""\n'
    )
    (folder / "lib" / "libnccl.so.2").write_bytes(b"")
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = doctor.nccl_library()
    assert found == doctor.NcclLibrary("2.28.9", str(folder / "lib" / "libnccl.so.2"))


def test_nccl_absent_here_and_doctor_says_so(monkeypatch):
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(doctor.ctypes.util, "find_library", lambda name: None)
    assert doctor.nccl_library() is None
    assert doctor.nccl_header_version(Path("/nonexistent/nccl.h")) is None


# --- one pair's measurement, on loopback ----------------------------------------------------------


def leader(r, host, address, port=None):
    return rank(r, host, address=address, network="127.0.0.0/8", port=port)


def test_a_pair_measured_over_loopback():
    me = leader(1, "h2", "127.0.0.1")
    listener = selftest._listen(me)
    assert listener is not None and me.port
    server = threading.Thread(target=selftest._serve, args=(listener, "127.0.0.1"))
    server.start()
    try:
        link = selftest._client(leader(0, "h1", "127.0.0.1"), me)
    finally:
        server.join(timeout=30)
        listener.close()
    assert link.error is None, link.error
    assert (link.a, link.b) == ("h1", "h2")
    assert link.mb_per_s == min(link.a_to_b_mb_per_s, link.b_to_a_mb_per_s) > 0
    assert 0 < link.latency_us < 1e6


def test_a_pair_whose_server_never_answers_fails_within_the_bound(monkeypatch):
    monkeypatch.setattr(selftest, "PAIR_TIMEOUT_S", 0.5)
    with socket.socket() as silent:  # listens, never accepts: the connection opens, no reply
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        peer = leader(1, "h2", "127.0.0.1", port=silent.getsockname()[1])
        start = time.monotonic()
        link = selftest._client(leader(0, "h1", "127.0.0.1"), peer)
    assert time.monotonic() - start < 5
    assert link.mb_per_s is None and "timed out" in link.error, link.error
    unreachable = selftest._client(leader(0, "h1", None), peer)
    assert unreachable.error == "host h1 has no job interface to measure on"
