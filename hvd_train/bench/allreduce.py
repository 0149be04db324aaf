"""Allreduce bandwidth against message size: Horovod, the MPI library (mpi4py), our reference ring,
and the machine's memory-copy bandwidth as the physical reference. Runs under mpirun, every rank.

Method (nccl-tests): float32 buffers of rank-built values; per size, `warmup` untimed calls, then
`iters` calls, each started together (a barrier) and timed on every rank, the slowest rank's time
counting; algbw = S/t, busbw = algbw * 2(n-1)/n. Each result is checked against its closed form
(every element equals n(n+1)/2).

    python -m hvd_train.bench.allreduce --out result.json [--mib 1 4 16 64] [--timeline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

from hvd_train.bench.ring import check_ring, ring_allreduce
from hvd_train.bench.stats import MiB, bandwidth, summary


def _timed(
    comm, fn: Callable[[], np.ndarray], warmup: int, iters: int
) -> tuple[list[float], np.ndarray]:
    times, result = [], None
    for i in range(warmup + iters):
        comm.Barrier()
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        # The collective is as slow as its slowest rank.
        slowest = comm.allreduce(elapsed, op=_max())
        if i >= warmup:
            times.append(slowest)
    return times, result


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _ends(tensor) -> np.ndarray:
    """The first and last element, copied out (also waits for the collective to finish)."""
    return np.array([tensor[0].numpy(), tensor[-1].numpy()])


def horovod_timeline(x: np.ndarray, iters: int, path: Path) -> dict[str, float]:
    """Milliseconds per Horovod activity per allreduce of `x`, from its timeline (rank 0's)."""
    from hvd_train import comm
    from hvd_train.comm import timeline

    x_tf = tf.constant(x)
    with timeline.record(path):
        for _ in range(iters):
            _ends(comm.allreduce(x_tf, op=comm.Sum, name="hvd_train.bench.timeline"))
    if not comm.is_chief():
        return {}
    return {k: v / iters for k, v in sorted(timeline.activity_totals(path).items())}


def run(mib: list[int], warmup: int, iters: int, timeline_dir: Path | None = None) -> dict:
    """Measure every method at every size; returns rank 0's result (others get {})."""
    from hvd_train import comm

    comm.init()
    from mpi4py import MPI  # after Horovod: it initialised MPI, mpi4py reuses it

    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    if n != comm.size():
        raise RuntimeError("mpi4py and Horovod disagree on the world: run under mpirun")
    check_ring(world)
    expected = n * (n + 1) / 2
    rows = []
    for size_mib in mib:
        x = np.full(size_mib * MiB // 4, rank + 1, np.float32)
        out = np.empty_like(x)
        # Horovod gets a TensorFlow tensor made once, as gradients are, and returns only the two
        # checked values: no numpy conversion or 64 MiB copy-out in its time.
        x_tf = tf.constant(x)
        methods = {
            f"horovod_{comm.controller()}": lambda x_tf=x_tf: _ends(
                comm.allreduce(x_tf, op=comm.Sum)
            ),
            "mpi4py_Allreduce": lambda x=x, out=out: (world.Allreduce(x, out, op=MPI.SUM), out)[1],
            "ring_mpi4py_numpy": lambda x=x: ring_allreduce(world, x),
            "memcpy": lambda x=x, out=out: (np.copyto(out, x), out)[1],
        }
        for name, fn in methods.items():
            times, result = _timed(world, fn, warmup, iters)
            if name != "memcpy" and not (result[0] == expected and result[-1] == expected):
                raise AssertionError(f"{name} at {size_mib} MiB: got {result[0]}, want {expected}")
            stats = summary(times)
            algbw, busbw = bandwidth(x.nbytes, stats["median"], n)
            row = {
                "method": name,
                "MiB": size_mib,
                "np": n,
                "ms_median": stats["median"] * 1e3,
                "ms_min": stats["min"] * 1e3,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
            }
            if name == "memcpy":  # one process copying: the bytes per second, not a bus bandwidth
                row["busbw_GBps"] = x.nbytes / stats["median"] / 1e9
            rows.append(row)
    result = {"bench": "allreduce", "np": n, "controller": comm.controller(), "rows": rows}
    if timeline_dir is not None:  # where Horovod's time goes, at the largest size
        x = np.full(max(mib) * MiB // 4, rank + 1, np.float32)
        result["timeline_MiB"] = max(mib)
        result["timeline_ms_per_allreduce"] = horovod_timeline(x, iters, timeline_dir / "tl.json")
    # All ranks end Horovod (and MPI) here together, before rank 0 writes the result: not rank 0's
    # background thread finalizing MPI while its main thread writes, when rank 1 exits first.
    world.Barrier()
    comm.shutdown()
    return result if rank == 0 else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_train.bench.allreduce")
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the JSON here")
    parser.add_argument(
        "--timeline",
        type=Path,
        help="a directory: record Horovod's timeline at the largest size (needs "
        "HOROVOD_TIMELINE=DYNAMIC)",
    )
    args = parser.parse_args(argv)
    result = run(args.mib, args.warmup, args.iters, args.timeline)
    if result:
        result["horovod_env"] = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")}
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
