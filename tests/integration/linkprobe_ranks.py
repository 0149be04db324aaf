"""Every rank's view of the in-job link probe (hvd_train.comm.linkprobe) under host names given
here, so that the ranks of one machine stand for the hosts of a job; for test_linkprobe.py:

    python -m hvd_train.core.launch --np 3 -- .venv/bin/python tests/integration/linkprobe_ranks.py

Rank 0 prints one JSON line: for each case, every rank's (Gbit/s, why) and the seconds it took.
"""

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from hvd_train import comm
from hvd_train.comm import linkprobe
from hvd_train.core import linkrate

comm.init(threads=1)
rank = comm.rank()
linkrate.PEER_TIMEOUT_S = 2  # the failures below wait out one timeout


def refused(*_args, **_kwargs):
    raise ConnectionRefusedError(111, "Connection refused")


# (name, host of each rank, what this rank breaks)
CASES = [
    ("ring of 3", ["a", "b", "c"], None),
    ("2 hosts, 2 ranks on a", ["a", "a", "b"], None),
    ("c cannot listen", ["a", "b", "c"], (2, "_address", lambda: "192.0.2.1")),
    ("a's sender refused", ["a", "b", "c"], (0, "send", refused)),
]
report = {}
for name, hosts, broken in CASES:
    saved = None
    if broken and broken[0] == rank:
        module = linkprobe if broken[1] == "_address" else linkrate
        saved = (module, broken[1], getattr(module, broken[1]))
        setattr(module, broken[1], broken[2])
    start = time.monotonic()
    probed = linkprobe.measure(hosts, rank)
    seconds = time.monotonic() - start
    if saved:
        setattr(*saved)
    every = comm.allgather_object((probed.gbit_s, probed.why))
    report[name] = {"ranks": every, "seconds": round(seconds, 2)}
if rank == 0:
    print("linkprobe " + json.dumps(report), flush=True)
comm.shutdown()
