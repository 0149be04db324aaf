"""`hvd-train selftest` across the cluster's hosts, one rank each, launched from the root namespace
(as from a login node): healthy on h1 and h2, then on all three with h3's data link shaped slow,
which names h3's two pairs and not h1 - h2 (three hosts: each pair has two others to take a median
of).

The healthy run leaves h3 out: on a 2-core machine h3 shares h1's CPU, so their pair's TCP stream
and its replies take turns on one core (about half the rate, millisecond round trips). Selftest
rightly calls such a pair slow against the others; it is this machine, not a fault to find."""

from __future__ import annotations

import json
import re
import subprocess

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import pytest
from hosts import Cluster, on_host

SELFTEST = [jobs.PYTHON, "-m", "hvd_train.cli", "launch", "--np"]
HEALTHY = ["h1", "h2"]  # on their own CPUs (the module's docstring)
# h3's link to the data bridge, both ways: the host's end (data0, in h3) and the bridge's end
# (hvdc-h3d, in the root namespace) each shape what they send.
SLOW = ["tbf", "rate", "50mbit", "burst", "64kb", "latency", "50ms"]


def selftest(cluster: Cluster, name: str, hosts: list[str]) -> tuple[jobs.Job, dict]:
    """The selftest on these hosts, one rank each; its output and rank 0's JSON report."""
    report = cluster.state / "shared" / f"{name}.json"  # rank 0 writes it on h1
    placed = ",".join(f"{host}:1" for host in hosts)
    argv = [*SELFTEST, str(len(hosts)), "--hosts", placed, "--", "selftest", "--json", str(report)]
    job = jobs.run(argv, 120, env=cluster.env())
    print(f"{name}: {job.seconds:.1f} s, exit {job.returncode}\n{job.output}")
    return job, json.loads(report.read_text())


def test_a_healthy_cluster_exits_0_with_its_data_network(cluster: Cluster):
    job, report = selftest(cluster, "selftest-healthy", HEALTHY)
    assert job.returncode == 0, job.tail()
    assert "selftest: 2 rank(s) on 2 host(s)" in job.output and "selftest: ok" in job.output
    for n, host in enumerate(HEALTHY, start=1):
        row = rf"^{host}\s+{n - 1}\s+data0\s+198\.18\.1\.{n}\s+198\.18\.1\.0/24\s"
        assert re.search(row, job.output, re.M), job.tail()
    assert [f"{x['a']} - {x['b']}" for x in report["links"]] == ["h1 - h2"]
    for link in report["links"]:
        assert link["error"] is None and link["mb_per_s"] > 50 and link["latency_us"] > 0, link
        assert re.search(rf"^{link['a']} - {link['b']}\s+\d+\.\d", job.output, re.M)
    assert report["ok"] and report["problems"] == []
    allreduce = report["allreduce"]  # one rank per host: the ring carries S across each link
    assert allreduce["hosts"] == 2 and allreduce["nbytes"] == 32 << 20, allreduce
    assert allreduce["mb_per_s"] == pytest.approx(32 * 2**20 / allreduce["seconds"] / 1e6)
    assert re.search(r"^allreduce of 33\.6 MB on 2 rank\(s\): .* MB/s across", job.output, re.M)
    assert job.seconds < 60


def test_a_slow_link_names_the_pairs_of_its_host(cluster: Cluster):
    try:
        on_host("h3", "tc", "qdisc", "replace", "dev", "data0", "root", *SLOW)
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", "hvdc-h3d", "root", *SLOW], check=True, timeout=30
        )
        job, report = selftest(cluster, "selftest-slow-h3", cluster.hosts)
    finally:
        on_host("h3", "tc", "qdisc", "del", "dev", "data0", "root")
        subprocess.run(["tc", "qdisc", "del", "dev", "hvdc-h3d", "root"], check=True, timeout=30)
    assert "tbf" not in on_host("h3", "tc", "qdisc", "show", "dev", "data0")
    assert job.returncode != 0, job.tail()
    slow = re.findall(r"^PROBLEM: hosts (h\d - h\d): .* below half the median", job.output, re.M)
    assert slow == ["h1 - h3", "h2 - h3"], job.tail()
    assert len(report["problems"]) == 2, report["problems"]
    speed = {f"{x['a']} - {x['b']}": x["mb_per_s"] for x in report["links"]}
    assert speed["h1 - h3"] < 50 / 8 * 1.2 and speed["h2 - h3"] < 50 / 8 * 1.2, speed
    assert speed["h1 - h2"] > 4 * max(speed["h1 - h3"], speed["h2 - h3"]), speed
    # The job's allreduce crosses h3's link: it cannot move faster than that link carries.
    assert report["allreduce"]["mb_per_s"] < 50 / 8 * 1.2, report["allreduce"]
