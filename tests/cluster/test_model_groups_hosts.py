"""Model groups across real hosts (2 hosts x 2 slots, h1: ranks 0, 1; h2: 2, 3): a table split
by rows over groups of 2 (one per host) is looked up without a byte of it crossing the hosts,
where the table split over all 4 ranks sends the closed form through h2's job interface.

Closed form per lookup (`hvd_train.bench.lookups`: every rank asks `batch` ids, `asked[s][d]` of
rank s's owned by rank d): h2 sends the ids its ranks ask of h1's (8 bytes each) and the rows h1's
ranks ask of it (dim float32 each), and receives the same the other way.
"""

from __future__ import annotations

import json
import re

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import pytest
from hosts import Cluster, counters

ROWS, DIM, BATCH = 65536, 64, 16384
CALLS = 11  # one warmup, ten timed
H1, H2 = (0, 1), (2, 3)
# TCP/IP and Ethernet headers, ACKs, Horovod's negotiation and the launch's own traffic, on top
# of the payload.
OVERHEAD = 0.10
ON_H1 = ["bash", "mpi_scripts/cluster/cluster.sh", "exec", "h1"]  # horovodrun's driver: on h1
CASES = [("mpirun", 4), ("mpirun", 2), ("horovodrun", 2)]


def closed_form(asked: list[list[int]]) -> tuple[int, int]:
    """Bytes h2 sends and receives per lookup: ids out and rows back, between the hosts."""
    ids_out = sum(asked[s][d] for s in H2 for d in H1) * 8
    rows_out = sum(asked[s][d] for s in H1 for d in H2) * DIM * 4
    ids_in = sum(asked[s][d] for s in H1 for d in H2) * 8
    rows_in = sum(asked[s][d] for s in H2 for d in H1) * DIM * 4
    return ids_out + rows_out, ids_in + rows_in


def lookups(cluster: Cluster, launcher: str, group_size: int):
    """The lookup benchmark on h1:2,h2:2, and what crossed h2's interfaces meanwhile."""
    argv = [*(ON_H1 if launcher == "horovodrun" else []), jobs.PYTHON, "-m"]
    argv += ["hvd_train.core.launch", "--np", "4", "--hosts", "h1:2,h2:2", "--launcher", launcher]
    argv += ["--", jobs.PYTHON, "-m", "hvd_train.bench.lookups", "--group-size", str(group_size)]
    argv += ["--rows", str(ROWS), "--dim", str(DIM), "--batch", str(BATCH)]
    argv += ["--warmup", "1", "--iters", str(CALLS - 1)]
    start = counters("h2")
    job = jobs.run(argv, 600, env=cluster.env())
    end = counters("h2")
    found = re.findall(r"^(?:\[(?:1,)?0\]<stdout>:)?lookups (\{.*\})$", job.output, re.M)
    assert job.returncode == 0 and len(found) == 1, job.tail()
    return json.loads(found[0]), {key: end[key] - start[key] for key in start}, job


@pytest.mark.parametrize(
    ("launcher", "group_size"), CASES, ids=[f"{name}-g{g}" for name, g in CASES]
)
def test_lookups_cross_the_hosts_only_where_a_group_spans_them(
    cluster: Cluster, launcher, group_size
):
    result, grown, job = lookups(cluster, launcher, group_size)
    tx, rx = grown["data0.tx"], grown["data0.rx"]
    want_tx, want_rx = (CALLS * b for b in closed_form(result["asked"]))
    print(
        f"{launcher} G={group_size}: {job.seconds:.1f} s, median lookup "
        f"{result['median_s'] * 1e3:.1f} ms; h2 sent {tx / 1e6:.2f} MB (closed form "
        f"{want_tx / 1e6:.2f}), received {rx / 1e6:.2f} MB ({want_rx / 1e6:.2f})"
    )
    assert (result["size"], result["local_size"], result["cross_size"]) == (4, 2, 2)
    assert result["exact"], "the rows found differ from the one-process table's"
    assert result["table_rows_here"] == ROWS // group_size
    # The ids a rank asks of a rank outside its group: none (each group answers its own).
    asked = result["asked"]
    outside = [
        asked[s][d] for s in range(4) for d in range(4) if s // group_size != d // group_size
    ]
    assert not any(outside), asked
    # Half of each of the 4 ranks' ids (and their rows) cross the hosts where one group spans
    # them.
    spanning = CALLS * BATCH * (DIM * 4 + 8)
    if group_size == 4:
        assert 0.9 * spanning < want_tx < 1.1 * spanning, (want_tx, spanning)
        for got, want in ((tx, want_tx), (rx, want_rx)):
            assert want <= got <= want * (1 + OVERHEAD), (got, want)
    else:
        # Groups inside the hosts: what crosses is the launch and Horovod's negotiation, a small
        # part of what one group spanning both hosts sends for the same lookups.
        assert want_tx == want_rx == 0
        assert tx < 0.25 * spanning and rx < 0.25 * spanning, (tx, rx, spanning)
