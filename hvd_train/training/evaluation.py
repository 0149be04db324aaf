"""`evaluate(model, x, ...)` (public: `hvd_train.evaluate`): one evaluation over the data of all
ranks, exact, as an explicit collective.

Each rank evaluates its part with Keras's own `evaluate` (local: no collective, so ranks may run
different numbers of batches), then `hvd_train.keras.metrics.reduce_metrics_over_ranks` sums the
metric states over ranks once and computes the results from the sums. A plain `model.evaluate`
stays local everywhere, so a rank may evaluate alone.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hvd_train import comm
from hvd_train.data.sharding import sample_count, validation_positions
from hvd_train.keras import embedding
from hvd_train.keras.metrics import reduce_metrics_over_ranks


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "__getitem__") and hasattr(value, "__len__")


def _array_shard(arrays: tuple[Any, ...], rank: int, size: int) -> tuple[Any, ...]:
    """Rank `rank`'s samples r, r + size, ... of (x, y, sample_weight) (None stays None)."""
    leaves = [leaf for part in arrays for leaf in tf.nest.flatten(part) if part is not None]
    if not all(_is_array(leaf) for leaf in leaves):
        kinds = sorted({type(leaf).__name__ for leaf in leaves if not _is_array(leaf)})
        raise ValueError(
            f"shard=True needs arrays (NumPy arrays or tensors, or lists or dicts of them) or a "
            f"tf.data.Dataset, got {', '.join(kinds)}: shard the data yourself and pass shard=False"
        )
    mine = validation_positions(sample_count([len(leaf) for leaf in leaves]), rank, size)
    part = slice(mine.start, mine.stop, mine.step)
    return tuple(
        None if a is None else tf.nest.map_structure(lambda leaf: leaf[part], a) for a in arrays
    )


def _batches(x: Any, batch_size: int | None, steps: int | None) -> int | None:
    """How many batches Keras's `evaluate` runs on this part (None: not known in advance)."""
    if isinstance(x, tf.data.Dataset):
        known = int(x.cardinality())
        count = known if known >= 0 else None
    else:
        count = -(-len(tf.nest.flatten(x)[0]) // (batch_size or 32))
    if steps is not None:
        count = steps if count is None else min(steps, count)
    return count


def _check_equal_batches(model: Any, batches: int | None) -> None:
    """A table split by rows makes every batch a collective: refuse, on every rank alike, parts
    whose batch counts differ or are unknown, which would hang in the lookup."""
    counts = comm.allgather_object(batches, name="hvd_train.evaluate.batches")
    if None in counts or len(set(counts)) > 1:
        raise ValueError(
            f"model {model.name!r} holds a table split by rows (ShardedEmbedding), so every rank "
            f"must evaluate the same number of batches; the ranks' counts are {counts} "
            "(None: unknown): pass steps=, or parts with equal batch counts"
        )


def evaluate(
    model: Any,
    x: Any,
    y: Any = None,
    *,
    batch_size: int | None = None,
    sample_weight: Any = None,
    steps: int | None = None,
    shard: bool | None = None,
    verbose: int = 0,
    callbacks: list[Any] | None = None,
) -> dict[str, Any]:
    """Evaluate `model` on the data of all ranks together: a collective, call it on every rank.

    Each rank evaluates its part locally, then the metric states (totals, counts, ...) are summed
    over ranks in one allreduce and the results computed from the sums: the result is exactly one
    process's `evaluate` on all the data, also when the parts differ in size or number of batches,
    and the same dict on every rank. Afterwards the model's metrics hold this rank's states again.

    Args:
      model: a compiled model with the same weights on every rank (e.g. after a fit() with
        `distributed_callbacks()`).
      x, y, sample_weight: what Keras's `evaluate` takes: arrays (NumPy arrays or tensors, or lists
        or dicts of them), or a `tf.data.Dataset` of batches (x only).
      batch_size: per-rank batch size for arrays (Keras's default: 32).
      steps: batches each rank evaluates at most (None: until its data ends).
      shard: whether this function splits the data over ranks. None (the default): arrays yes, a
        dataset (or any other input) no. Arrays: rank r takes samples r, r + size, ... (the rule of
        `hvd_train.data.validation_shard`: no padding, no sample twice; parts differ by at most one
        sample). A dataset with shard=True: `Dataset.shard(size, rank)`, elements (batches, if it
        is batched) r, r + size, ..., so it must yield them in the same order on every rank.
        shard=False: each rank's data is its part already (`data.validation_dataset`, a dataset
        sharded by file, ...), and the parts together hold every sample once.
      verbose: Keras's progress output of this rank's part (0: none).
      callbacks: Keras callbacks of this rank's part (Keras's `evaluate` takes them).

    Returns:
      {metric name: value} for the model's metrics (`model.metrics`), as
      `model.evaluate(..., return_dict=True)` names them: floats, arrays for vector-valued metrics.

    Raises:
      DataError (a ValueError): shard=True for arrays of different lengths, or with fewer samples
        than ranks (a rank would have nothing to evaluate).
      ValueError: shard=True for data that is neither arrays nor a `tf.data.Dataset`; a model
        with a ShardedEmbedding whose parts differ in batch count (or it is unknown), on every
        rank alike.
    """
    rank, size = comm.rank(), comm.size()
    dataset = isinstance(x, tf.data.Dataset)
    if shard is None:
        shard = not dataset and _is_array(next(iter(tf.nest.flatten(x)), None))
    if shard and dataset:
        x = x.shard(size, rank)
    elif shard:
        x, y, sample_weight = _array_shard((x, y, sample_weight), rank, size)
    if embedding.has_row_shards(model):
        _check_equal_batches(model, _batches(x, batch_size, steps))
    model.evaluate(
        x,
        y,
        batch_size=batch_size,
        sample_weight=sample_weight,
        steps=steps,
        verbose=verbose,
        callbacks=callbacks,
        return_dict=True,
    )
    return reduce_metrics_over_ranks(model)
