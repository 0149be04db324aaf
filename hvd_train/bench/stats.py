"""Summary statistics and the bandwidth definitions of nccl-tests."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

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
