"""The batch-size and learning-rate rule, defined once and used everywhere.

Batch: Horovod's convention is a fixed per-rank batch, so the global batch grows with the workers:
    global_batch_size = per_rank_batch_size * size
Learning rate (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): scale the base rate, tuned for
`base_batch_size`, with the global batch, and warm up to it:
    peak_lr = base_lr * global_batch_size / base_batch_size           (rule "linear")
    peak_lr = base_lr * sqrt(global_batch_size / base_batch_size)     (rule "sqrt")
    lr(step) = base_lr + (peak_lr - base_lr) * step / warmup_steps    for step < warmup_steps
    lr(step) = peak_lr * decay(step)                                  after
where step counts optimizer updates, and decay is 1, a step decay (x rate at each boundary), a
cosine to 0 over the remaining updates, or a polynomial to 0 over them (the schedule LARS and LAMB
are usually run with: peak_lr * (1 - progress) ** power, You et al. use power 2). The optimizer
evaluates the schedule itself every update: no per-batch Python callback sets the rate
(`hvd_train.keras.schedules.WarmupSchedule`).

This module is pure Python, so configurations are checked without importing TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

LR_RULES = ("linear", "sqrt")
DECAYS = ("none", "step", "cosine", "polynomial")


def resolve_batch_sizes(
    size: int, per_rank_batch_size: int | None = None, global_batch_size: int | None = None
) -> tuple[int, int]:
    """Both batch sizes from the one the user gave.

    Returns:
      (per_rank_batch_size, global_batch_size).

    Raises:
      ValueError: neither or both given, a size that is not positive, or a global batch not
        divisible by the worker count.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if (per_rank_batch_size is None) == (global_batch_size is None):
        raise ValueError("give exactly one of per_rank_batch_size and global_batch_size")
    if per_rank_batch_size is not None:
        if per_rank_batch_size < 1:
            raise ValueError(f"per_rank_batch_size must be >= 1, got {per_rank_batch_size}")
        return per_rank_batch_size, per_rank_batch_size * size
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if global_batch_size % size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the {size} workers"
        )
    return global_batch_size // size, global_batch_size


def scaled_learning_rate(
    base_lr: float, global_batch_size: int, base_batch_size: int, rule: str = "linear"
) -> float:
    """The peak learning rate for a global batch, by the linear or square-root rule.

    Raises:
      ValueError: an unknown rule, or a rate or batch size that is not positive.
    """
    if rule not in LR_RULES:
        raise ValueError(f"lr rule must be one of {LR_RULES}, got {rule!r}")
    if base_lr <= 0 or global_batch_size < 1 or base_batch_size < 1:
        raise ValueError(
            f"base_lr, global_batch_size and base_batch_size must be positive, got "
            f"{base_lr}, {global_batch_size}, {base_batch_size}"
        )
    ratio = global_batch_size / base_batch_size
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))


def learning_rate(
    step: int,
    base_lr: float,
    peak_lr: float,
    warmup_steps: int,
    total_steps: int | None = None,
    decay: str = "none",
    decay_rate: float = 0.1,
    decay_boundaries: Sequence[int] = (),
    decay_power: float = 2.0,
) -> float:
    """The schedule's value at one update, in plain Python (for logs, plans and checks)."""
    if step < warmup_steps:
        return base_lr + (peak_lr - base_lr) * step / warmup_steps
    if decay == "step":
        return peak_lr * decay_rate ** sum(step >= b for b in decay_boundaries)
    if decay == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "polynomial":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return peak_lr * (1.0 - progress) ** decay_power
    return peak_lr


def validate_schedule(
    base_lr: float,
    peak_lr: float,
    warmup_steps: int,
    total_steps: int | None,
    decay: str,
    decay_rate: float,
    decay_boundaries: Sequence[int],
) -> None:
    """Raise ValueError naming the first inconsistent schedule argument."""
    if base_lr <= 0 or peak_lr <= 0:
        raise ValueError(f"base_lr and peak_lr must be positive, got {base_lr} and {peak_lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    if decay in ("cosine", "polynomial") and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(
            f"decay={decay!r} needs total_steps > warmup_steps, got total_steps={total_steps}"
        )
    if decay == "step" and not (0 < decay_rate < 1 and decay_boundaries):
        raise ValueError(
            "decay='step' needs 0 < decay_rate < 1 and decay_boundaries, got "
            f"decay_rate={decay_rate} decay_boundaries={list(decay_boundaries)}"
        )
