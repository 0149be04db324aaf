"""Lookups of a table split by rows (`ShardedEmbedding`) over model groups of G ranks, timed and
checked. Runs under a launcher, every rank; rank 0 prints one line `lookups {json}` (and writes
it to --out).

Each rank looks up the same `batch` ids, uniform over the table and drawn from its rank, every
call; the rows found must equal the one-process table's exactly. The result holds `asked[s][d]`:
how many of rank s's ids rank d owns (d in s's group), so the bytes between any two ranks per
lookup have a closed form: `asked[s][d]` ids (int64) from s to d, and as many rows of `dim`
float32 back.

    python -m hvd_train.bench.lookups --group-size 2 --rows 65536 --dim 64 --batch 16384

Across hosts, `tests/cluster/test_model_groups_hosts.py` counts the bytes that cross a host's
interface against that closed form: with groups inside the hosts, none.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from hvd_train import comm
from hvd_train.bench import stats


def ids_of(rank: int, rows: int, batch: int) -> np.ndarray:
    """Rank `rank`'s ids: `batch` of them, uniform over `rows`."""
    return np.random.default_rng(1000 + rank).integers(0, rows, batch)


def owners(ids: np.ndarray, rank: int, group_size: int) -> np.ndarray:
    """The global rank that owns each id for rank `rank` (its group's rank at place id mod G)."""
    return rank - rank % group_size + ids % group_size


def run(group_size: int, rows: int, dim: int, batch: int, warmup: int, iters: int) -> dict:
    """Time `iters` lookups of `batch` ids (every rank) after `warmup`, and check their rows."""
    from hvd_train.keras.embedding import ShardedEmbedding

    n, rank = comm.size(), comm.rank()
    table = ShardedEmbedding(rows, dim, seed=3, group_size=group_size)
    whole = ShardedEmbedding(rows, dim, seed=3, shards=1)
    ids = tf.constant(ids_of(rank, rows, batch))
    table.build(ids.shape)
    whole.build(ids.shape)
    lookup = tf.function(table)
    times, found = [], None
    for i in range(warmup + iters):
        comm.barrier()
        start = time.perf_counter()
        found = lookup(ids).numpy()
        elapsed = time.perf_counter() - start
        # A lookup is as slow as its slowest rank.
        slowest = float(comm.allreduce(tf.constant(elapsed), op=comm.Max, name="bench.max"))
        if i >= warmup:
            times.append(slowest)
    exact = bool(np.array_equal(found, whole(ids).numpy()))
    counts = np.bincount(owners(ids.numpy(), rank, group_size), minlength=n)
    return {
        "group_size": group_size,
        "table_rows_here": int(table.embeddings.shape[0]),
        "seconds": times,
        "median_s": statistics.median(times),
        "calls": warmup + iters,
        "exact": all(comm.allgather_object(exact, name="bench.exact")),
        "asked": comm.allgather_object(counts.tolist(), name="bench.asked"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_train.bench.lookups")
    parser.add_argument("--group-size", type=int, help="G ranks per model group (default: all)")
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16384, help="ids per rank per lookup")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, help="rank 0 writes the result here (JSON)")
    args = parser.parse_args(argv)
    comm.init(model_group_size=args.group_size)
    here = comm.topology()
    group_size = args.group_size or here.size
    result = {
        "size": here.size,
        "local_size": here.local_size,
        "cross_size": here.cross_size,
        "controller": comm.controller(),
        "rows": args.rows,
        "dim": args.dim,
        "batch": args.batch,
        **run(group_size, args.rows, args.dim, args.batch, args.warmup, args.iters),
    }
    stats.shutdown_and_report("lookups", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
