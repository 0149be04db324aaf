"""Flat against two-level reduction (`comm.allreduce_groups(..., reduction=...)`) of one buffer of
float32, timed, and checked against its closed form. Runs under a launcher, every rank; rank 0
prints one line `two_level {json}` (and writes it to --out).

Method as `bench.allreduce`: rank r's buffer is (r + 1) x (0, 1, ..., 999, 0, 1, ...), so the
Average is exactly (n + 1) / 2 times that on every element; per reduction `warmup` untimed calls,
then `iters` calls, each started together (a barrier), the slowest rank's time counting.

    python -m hvd_train.bench.two_level --mib 64 --reductions flat two_level [--out result.json]

Across hosts, `tests/cluster/test_two_level_hosts.py` counts the bytes each reduction moves
through a host's interface against the closed form (2 hosts x 2 slots: flat 1.5 x S per host each
way, two-level S).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from hvd_train import comm
from hvd_train.bench import stats


def buffer(mib: float, rank: int) -> np.ndarray:
    """This rank's float32 buffer of `mib` MiB: (rank + 1) x (i mod 1000)."""
    count = int(mib * 2**20) // 4
    return ((np.arange(count) % 1000) * (rank + 1)).astype(np.float32)


def run(mib: float, reduction: str, warmup: int, iters: int) -> dict[str, object]:
    """Time `iters` Average allreduces of one `mib` MiB buffer by `reduction` (every rank)."""
    n = comm.size()
    x = tf.constant(buffer(mib, comm.rank()))
    times, result = [], None
    for i in range(warmup + iters):
        comm.barrier()
        start = time.perf_counter()
        result = comm.allreduce_groups([[x]], op=comm.Average, reduction=reduction)[0][0].numpy()
        elapsed = time.perf_counter() - start
        # The reduction is as slow as its slowest rank.
        slowest = float(comm.allreduce(tf.constant(elapsed), op=comm.Max, name="bench.max"))
        if i >= warmup:
            times.append(slowest)
    expected = buffer(mib, 0) * np.float32((n + 1) / 2)
    return {
        "reduction": reduction,
        "seconds": times,
        "median_s": statistics.median(times),
        "calls": warmup + iters,
        "exact": bool(np.array_equal(result, expected)),
        "sha256": hashlib.sha256(result.tobytes()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_train.bench.two_level")
    parser.add_argument("--mib", type=float, default=64.0, help="buffer size in MiB (S)")
    parser.add_argument(
        "--reductions", nargs="+", default=["flat", "two_level"], choices=["flat", "two_level"]
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=Path, help="rank 0 writes the result here (JSON)")
    args = parser.parse_args(argv)
    comm.init()
    here = comm.topology()
    result = {
        "bytes": (int(args.mib * 2**20) // 4) * 4,
        "size": here.size,
        "local_size": here.local_size,
        "cross_size": here.cross_size,
        "controller": comm.controller(),
        "auto": comm.resolve_reduction("auto"),
        "runs": [run(args.mib, r, args.warmup, args.iters) for r in args.reductions],
    }
    stats.shutdown_and_report("two_level", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
