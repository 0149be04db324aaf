"""Summary statistics and the bandwidth definitions of nccl-tests."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


def summary(values: Sequence[float]) -> dict[str, float]:
    """min, median, mean, and the 1.96-sigma half-width Horovod's benchmarks report."""
    mean = statistics.fmean(values)
    sigma = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "n": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "mean": mean,
        "max": max(values),
        "ci95": 1.96 * sigma,
    }


def bandwidth(nbytes: int, seconds: float, size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes): algbw = S/t; busbw = algbw * 2(n-1)/n, the bytes each
    rank must move in a ring allreduce, so that it compares across rank counts and to the link."""
    alg = nbytes / seconds / 1e9
    return alg, alg * 2 * (size - 1) / size


def shutdown_and_report(tag: str, result: dict[str, Any], out: Path | None) -> None:
    """End Horovod on every rank (a collective); rank 0 prints one line `tag {json}`, which the
    launching side reads from the job's output, and writes the result to `out` if given."""
    from hvd_train import comm

    rank = comm.rank()
    comm.shutdown()
    if rank == 0:
        print(f"{tag} {json.dumps(result)}", flush=True)
        if out:
            out.write_text(json.dumps(result, indent=1))
