"""The link probe the ranks of a job run at start where no launcher gave them the rate
(hvd_train.comm.linkprobe), on one machine: 3 ranks stand for the hosts by the names
linkprobe_ranks.py gives them. On the cluster's shaped links: tests/cluster/test_cluster.py."""

from __future__ import annotations

import json
import re

from jobs import PYTHON, run

from hvd_train.core import linkrate

LAUNCH = [PYTHON, "-m", "hvd_train.core.launch", "--np", "3", "--"]


def test_the_ranks_agree_on_the_slowest_link_or_the_failure_that_stopped_it():
    job = run([*LAUNCH, PYTHON, "tests/integration/linkprobe_ranks.py"], 180)
    assert job.returncode == 0, job.tail()
    (line,) = re.findall(r"^linkprobe (\{.*\})$", job.output, re.M)
    report = json.loads(line)
    for case in report.values():
        # Every rank got the same answer (the buckets follow it, and must be alike everywhere).
        assert all(got == case["ranks"][0] for got in case["ranks"]), case
    ring = report["ring of 3"]
    # Loopback carries more than any threshold of the rule; each of the odd ring's three phases
    # sends for SEND_S, one after the other.
    assert ring["ranks"][0][0] > 1.0, ring
    assert re.fullmatch(r"the slowest of 3 link\(s\): (a -> b|b -> c|c -> a)", ring["ranks"][0][1])
    assert 3 * linkrate.SEND_S <= ring["seconds"] < 3 * linkrate.SEND_S + 5, ring
    two = report["2 hosts, 2 ranks on a"]
    assert two["ranks"][0][0] > 1.0 and "of 2 link(s)" in two["ranks"][0][1], two
    assert 2 * linkrate.SEND_S <= two["seconds"] < 2 * linkrate.SEND_S + 5, two
    # A host that cannot listen is named, and no sender waits for it.
    cannot = report["c cannot listen"]
    assert cannot["ranks"][0][0] is None, cannot
    assert cannot["ranks"][0][1].startswith("c: no listener for the link probe: "), cannot
    assert cannot["seconds"] < 5, cannot
    # A sender refused: its receiver waits out its timeout (2 s here), and the cause is named.
    refused = report["a's sender refused"]
    assert refused["ranks"][0][0] is None, refused
    assert re.match(
        r"the link probe's connection to b \(.*\) failed: .*refused", refused["ranks"][0][1]
    )
    assert 2 <= refused["seconds"] < 10, refused
