"""`hvd-train selftest` across the cluster's three hosts, one rank each, launched from the root
namespace (as from a login node): healthy, then with h3's data link shaped slow, which names h3's
two pairs and not h1 - h2 (three hosts: each pair has two others to take a median of)."""

from __future__ import annotations

import json
import re
import subprocess

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
from hosts import Cluster, on_host

SELFTEST = [jobs.PYTHON, "-m", "hvd_train.cli", "launch", "--np", "3", "--hosts"]
PAIRS = ["h1 - h2", "h1 - h3", "h2 - h3"]
# h3's link to the data bridge, both ways: the host's end (data0, in h3) and the bridge's end
# (hvdc-h3d, in the root namespace) each shape what they send.
SLOW = ["tbf", "rate", "50mbit", "burst", "64kb", "latency", "50ms"]


def selftest(cluster: Cluster, name: str) -> tuple[jobs.Job, dict]:
    """The selftest on h1, h2 and h3; its output and rank 0's JSON report."""
    report = cluster.state / "shared" / f"{name}.json"  # rank 0 writes it on h1
    hosts = ",".join(f"{host}:1" for host in cluster.hosts)
    argv = [*SELFTEST, hosts, "--", "selftest", "--json", str(report)]
    job = jobs.run(argv, 120, env=cluster.env())
    print(f"{name}: {job.seconds:.1f} s, exit {job.returncode}\n{job.output}")
    return job, json.loads(report.read_text())


def test_a_healthy_cluster_exits_0_with_its_data_network(cluster: Cluster):
    job, report = selftest(cluster, "selftest-healthy")
    assert job.returncode == 0, job.tail()
    assert "selftest: 3 rank(s) on 3 host(s)" in job.output and "selftest: ok" in job.output
    for n, host in enumerate(cluster.hosts, start=1):
        row = rf"^{host}\s+{n - 1}\s+data0\s+198\.18\.1\.{n}\s+198\.18\.1\.0/24\s"
        assert re.search(row, job.output, re.M), job.tail()
    assert [f"{x['a']} - {x['b']}" for x in report["links"]] == PAIRS
    for link in report["links"]:
        assert link["error"] is None and link["mb_per_s"] > 50 and link["latency_us"] > 0, link
        assert re.search(rf"^{link['a']} - {link['b']}\s+\d+\.\d", job.output, re.M)
    assert report["ok"] and report["problems"] == []
    assert job.seconds < 60


def test_a_slow_link_names_the_pairs_of_its_host(cluster: Cluster):
    try:
        on_host("h3", "tc", "qdisc", "replace", "dev", "data0", "root", *SLOW)
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", "hvdc-h3d", "root", *SLOW], check=True, timeout=30
        )
        job, report = selftest(cluster, "selftest-slow-h3")
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
