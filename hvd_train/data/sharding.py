"""The sharding arithmetic: plain integers, no TensorFlow (importing this module loads only NumPy).

Which positions of an epoch's permutation each rank takes, how many steps every rank runs, how
TFRecord files are split, how many steps are left after a resume, and each rank's part of the
validation data. `pipeline.py` and `order.py` build their tf.data pipelines from these numbers, so
`shard_dataset` and `train_dataset` apply the same rules and raise the same `DataError`s; the
permutation itself (`index_shuffle` of (seed, epoch)) stays a TensorFlow op in `order.py`, where
resumed runs depend on its exact output.

The rules:
  - every rank runs the same number of steps per epoch (a rank with more steps than the others
    would wait forever in its last allreduce): the full batches of the smallest shard;
  - training: rank r takes positions start + r, start + r + size, ... of the epoch's permutation,
    `steps * batch` of them (start > 0 only in the first epoch of a resumed run);
  - validation: rank r takes samples r, r + size, ... (sizes may differ by one sample: no
    collective runs during evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hvd_train.data.errors import DataError


def check_ranks(rank: int, size: int) -> None:
    """Raises DataError unless `size` >= 1 and `rank` is one of its ranks."""
    if size < 1:
        raise DataError(f"size {size}: need at least one rank")
    if not 0 <= rank < size:
        raise DataError(f"rank {rank} is outside 0..{size - 1}")


def sample_count(lengths: Sequence[int]) -> int:
    """The samples of arrays that are sharded together (x, y, ...): their common length.

    Raises:
      DataError: no arrays, or arrays that differ in length.
    """
    lengths = list(lengths)
    if not lengths:
        raise DataError("no arrays to shard")
    if any(n != lengths[0] for n in lengths):
        raise DataError(f"arrays differ in length: {lengths}")
    return lengths[0]


def shard_steps(per_rank: int, batch: int, what: str, max_steps: int | None = None) -> int:
    """Steps every rank runs per epoch when each rank can count on `per_rank` samples.

    Args:
      per_rank: samples of the smallest shard.
      batch: batch on each rank.
      what: the data, for the message (e.g. "40 training samples on 2 ranks").
      max_steps: a cap on the steps (None or 0: none).

    Raises:
      DataError: a batch < 1, or fewer samples per rank than one batch.
    """
    if batch < 1:
        raise DataError(f"per-rank batch size {batch}: must be >= 1")
    steps = per_rank // batch
    if steps < 1:
        raise DataError(f"{what}: {per_rank} per rank, not one batch of {batch}")
    return min(steps, max_steps) if max_steps else steps


def steps_per_epoch(
    num_samples: int,
    size: int,
    per_rank_batch_size: int,
    max_steps: int | None = None,
    what: str = "training samples",
) -> int:
    """Steps every rank runs per epoch (the smallest shard's full batches).

    Args:
      num_samples: samples sharded one by one (arrays, image files, decoded records).
      size: the worker count.
      per_rank_batch_size: batch on each rank.
      max_steps: a cap on the steps (None or 0: none).
      what: what the samples are, for the message ("training samples", "training images").

    Raises:
      DataError: size < 1, fewer samples than ranks, or fewer than one batch on every rank.
    """
    if size < 1:
        raise DataError(f"size {size}: need at least one rank")
    if num_samples < size:
        raise DataError(f"{num_samples} {what} are fewer than the {size} ranks")
    return shard_steps(
        num_samples // size, per_rank_batch_size, f"{num_samples} {what} on {size} ranks", max_steps
    )


def rank_of(position: Any, size: int) -> Any:
    """The rank that takes permutation position `position` (an int, or an array or tensor of them):
    position % size, so rank r takes r, r + size, ... (`shard_positions`, `rank_positions`)."""
    return position % size


def shard_positions(num_samples: int, rank: int, size: int) -> range:
    """The positions of a permutation of `num_samples` that rank `rank` of `size` takes: all of
    its shard (`shard_indices`; TFRecord files sharded by file)."""
    check_ranks(rank, size)
    return range(rank, num_samples, size)


def rank_positions(rank: int, size: int, steps: int, batch: int, start: int = 0) -> range:
    """The `steps * batch` permutation positions rank `rank` trains on in one epoch, from `start` on
    (the positions before it were consumed already): start + rank, start + rank + size, ...."""
    first = start + rank
    return range(first, first + steps * batch * size, size)


def remaining_steps(steps: int, per_rank_batch_size: int, size: int, position: int) -> int:
    """Steps left in an epoch on `size` ranks once `position` positions of its permutation are used.

    A data position counts samples, not steps, so it means the same at any worker count: global
    step s covers positions [s * batch * size, (s + 1) * batch * size). An epoch of `steps` steps
    ends at position steps * batch * size; the positions left are spread over the `size` ranks of
    now, and a last part smaller than one global batch is dropped (as `drop_remainder` does).

    Raises:
      DataError (a ValueError): a negative position, or a batch or size < 1.
    """
    if position < 0 or per_rank_batch_size < 1 or size < 1:
        raise DataError(
            f"need position >= 0, batch >= 1 and size >= 1, got {position}, "
            f"{per_rank_batch_size}, {size}"
        )
    global_batch = per_rank_batch_size * size
    return max(0, (steps * global_batch - position) // global_batch)


def check_start_position(start_position: int, by_file: bool) -> None:
    """Raises DataError for a start_position < 0, or > 0 where data are sharded by file."""
    if start_position < 0 or (start_position and by_file):
        raise DataError(
            f"start_position {start_position}: must be >= 0, and 0 for TFRecord files that are "
            "not decoded into memory (they are sharded by file, not by permutation position)"
        )


def records_per_rank(counts: list[int], size: int) -> tuple[str, int]:
    """How TFRecord files are split over `size` ranks, and the records every rank can count on.

    Returns:
      ("file", records of the floor(files / size) smallest files) when there are at least as many
      files as ranks, else ("record", records // size).
    """
    if len(counts) >= size:
        return "file", sum(sorted(counts)[: len(counts) // size])
    return "record", sum(counts) // size


def record_steps(
    counts: list[int], size: int, batch: int, where: str, max_steps: int | None = None
) -> tuple[str, int]:
    """How TFRecord files are split over `size` ranks (`records_per_rank`), and the steps of every
    epoch: the full batches of the records the poorest rank can count on in any epoch.

    Raises:
      DataError: size < 1, fewer records than ranks, or fewer than one batch on every rank.
    """
    if size < 1:
        raise DataError(f"size {size}: need at least one rank")
    total = sum(counts)
    if total < size:
        raise DataError(f"{where}: {total} training records are fewer than the {size} ranks")
    how, per_rank = records_per_rank(counts, size)
    what = f"{where}: {total} training records in {len(counts)} files on {size} ranks by {how}"
    return how, shard_steps(per_rank, batch, what, max_steps)


def validation_positions(
    num_samples: int, rank: int, size: int, what: str = "validation samples", where: str = ""
) -> range:
    """The validation samples rank `rank` evaluates: r, r + size, ... (sizes differ by <= 1).

    Args:
      what, where: what the samples are and where they come from, for the message.

    Raises:
      DataError: fewer validation samples than ranks (a rank would have nothing to evaluate).
    """
    check_ranks(rank, size)
    if num_samples < size:
        prefix = f"{where}: " if where else ""
        raise DataError(f"{prefix}{num_samples} {what} are fewer than the {size} ranks")
    return range(rank, num_samples, size)


def validation_by_file(counts: list[int], size: int) -> bool:
    """Whether validation TFRecord files are split by file (rank r reads files r, r + size, ...):
    when every rank gets at least one record that way; else by record, r, r + size, ...."""
    return len(counts) >= size and all(sum(counts[r::size]) for r in range(size))
