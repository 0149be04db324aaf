"""Model-parallel embeddings: a table split by rows over the ranks, looked up with two alltoalls.

`ShardedEmbedding(rows, dim)` is a Keras 3 embedding whose table no rank holds whole: row g lives on
rank g mod N (local row g div N), so Zipf-skewed ids, whose hot rows are the small ones, spread
over all ranks instead of landing on the first. With model groups of G ranks (`comm.groups`), the
table is split over the G ranks of each group instead (row g on the group's rank g mod G), every
collective of a lookup stays inside the group, and each group holds the table once: the groups
are data parallel, and a row's gradient is summed over the ranks holding it in the other groups
(its replicas, `keras/optimizer.py`). One lookup in the traced step:

  ids -> sorted by owner -> alltoall (each owner receives the local rows asked of it)
      -> gather from the local table -> alltoall back (Horovod's registered gradient is the
      alltoall of the upstream gradient the other way) -> unsorted into the ids' order

The dense layers stay data parallel. The table's gradient on its owner sums what every rank's
batch (of its group) sent back; the loss of one process on the global batch is the mean of the
ranks' losses, so the distributed optimizer divides that gradient by N and never allreduces it
over all ranks (a local variable, `keras/optimizer.py`), only sums it over the row's replicas
where there are model groups. Its optimizer slots are row shards too (marked when created).

Row shards are per rank by design: the start-of-training broadcast, the weight digests and the
consistency checks skip them (`is_row_sharded`); a checkpoint holds each whole, in global row
order (`gather_rows`: collective, in chunks), so it resumes at any worker count (`scatter_rows`).
The initial values depend on the global row only (`_RowInitializer`), so N ranks start from the
rows one process holding the whole table would draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvd_train import comm
from hvd_train.keras import compat

# Rows drawn per block by the initializer, and bytes per collective of a checkpoint's gather.
_INIT_BLOCK_ROWS = 8192
_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class RowShards:
    """A variable split by rows: `rows` in all, rank `rank` of the `shards` ranks of its model
    group (`comm.groups`) holds rows g = rank + k * shards (k = 0, 1, ...), in that order.
    `group`: the group's process set (None: all ranks); `replicas`: the ranks holding the same
    rows in the other groups (None: none)."""

    rows: int
    shards: int
    rank: int
    group: Any = field(default=None, compare=False)
    replicas: Any = field(default=None, compare=False)

    def count(self, rank: int | None = None) -> int:
        """How many rows rank `rank` (default: this one) holds."""
        rank = self.rank if rank is None else rank
        return len(range(rank, self.rows, self.shards))


def row_shards(variable: Any) -> RowShards | None:
    """How this variable is split by rows, or None for a variable every rank holds whole."""
    return getattr(variable, "_hvd_rows", None)


def is_row_sharded(variable: Any) -> bool:
    """True for a table row shard (`ShardedEmbedding`) or an optimizer slot of one: per rank."""
    shards = row_shards(variable)
    return shards is not None and shards.shards > 1


def mark_like(variable: Any, reference: Any) -> None:
    """Give `variable` (an optimizer slot) the row split of the model variable it mirrors."""
    shards = row_shards(reference)
    if shards is not None:
        variable._hvd_rows = shards


def whole_shape(variable: Any) -> tuple[int, ...]:
    """The shape of the whole variable (a row shard's is its table's)."""
    shards = row_shards(variable)
    shape = tuple(variable.shape)
    return shape if shards is None else (shards.rows, *shape[1:])


def has_row_shards(model: Any) -> bool:
    """True if the model holds a table split by rows: its forward pass is a collective."""
    return any(is_row_sharded(v) for v in model.variables)


def splits_rows(model: Any) -> bool:
    """True if the model holds a `ShardedEmbedding` that splits its table over all ranks (at one
    worker too, where the one shard is the whole table)."""
    return any(
        isinstance(layer, ShardedEmbedding) and layer.shards is None
        for layer in model._flatten_layers()
    )


class _RowInitializer(keras.initializers.Initializer):
    """Uniform in [-scale, scale], a function of (seed, global row) alone: rows are drawn in blocks
    of `_INIT_BLOCK_ROWS` (one stateless draw each) and each rank keeps its own, so every worker
    count starts from the same table."""

    def __init__(self, seed: int, scale: float, shards: RowShards) -> None:
        self.seed, self.scale, self.shards = seed, scale, shards

    def __call__(self, shape: Any, dtype: Any = None) -> tf.Tensor:
        n, rank, width = self.shards.shards, self.shards.rank, shape[-1]
        parts = []
        for block in range(math.ceil(self.shards.rows / _INIT_BLOCK_ROWS)):
            start = block * _INIT_BLOCK_ROWS
            rows = min(_INIT_BLOCK_ROWS, self.shards.rows - start)
            drawn = tf.random.stateless_uniform(
                (rows, width), seed=[self.seed, block], minval=-self.scale, maxval=self.scale
            )
            parts.append(drawn[(rank - start) % n :: n])
        return tf.cast(tf.concat(parts, axis=0), dtype or "float32")

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed, "scale": self.scale}


@keras.saving.register_keras_serializable(package="hvd_train")
class ShardedEmbedding(keras.layers.Layer):
    """An embedding of `rows` ids into `dim` values whose table is split by rows over the ranks of
    its model group: all ranks, or G consecutive ranks each (`hvd_train.init(model_group_size=G)`),
    the groups data parallel (each holds the whole table once).

    Call it on integer ids of any shape (or floats holding integers, as a packed input carries
    them); returns shape + (dim,). With one worker it is a plain lookup. On every rank alike: the
    lookup is a collective of the group (two alltoalls per call, also in evaluation and
    prediction, so every rank must run the same number of batches). Modern stack (Keras 3) only.

    Args:
      rows: the number of ids (the table's rows).
      dim: values per id.
      seed: the table's initial values (the same at every worker count).
      scale: initial values are uniform in [-scale, scale] (Keras's Embedding: 0.05).
      shards: 1 holds the whole table on this rank (no collective: a one-process reference);
        None (default) splits it over the ranks of this rank's model group.
      group_size: G ranks per model group (`comm.model_groups`; a divisor of the worker count);
        None (default): the job's (`hvd_train.init(model_group_size=...)`), else all ranks.
    """

    def __init__(
        self,
        rows: int,
        dim: int,
        seed: int = 0,
        scale: float = 0.05,
        shards: int | None = None,
        group_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if compat.CLASSIC:
            # Horovod's Keras 2 optimizer would allreduce the row shards as if they were whole.
            raise ValueError("ShardedEmbedding: the modern stack (Keras 3) only")
        if rows < 1 or dim < 1:
            raise ValueError(f"ShardedEmbedding needs rows >= 1 and dim >= 1, got {rows}, {dim}")
        if shards not in (None, 1):
            raise ValueError(f"shards must be None (all ranks) or 1 (whole here), got {shards!r}")
        self.rows, self.dim, self.seed, self.scale, self.shards = rows, dim, seed, scale, shards
        self.group_size = group_size

    def build(self, input_shape: Any) -> None:
        several = self.shards is None and comm.is_initialized() and comm.size() > 1
        groups = comm.model_groups(self.group_size) if several else None
        if groups is None or groups.size == 1:
            shards = RowShards(self.rows, 1, 0)
        else:
            shards = RowShards(self.rows, groups.size, groups.rank, groups.group, groups.replicas)
        self.embeddings = self.add_weight(
            shape=(shards.count(), self.dim),
            initializer=_RowInitializer(self.seed, self.scale, shards),
            name="embeddings",
        )
        self.embeddings._hvd_rows = shards
        self.built = True

    def call(self, ids: Any) -> tf.Tensor:
        ids = tf.cast(ids, "int64")
        flat = tf.reshape(ids, [-1])
        table = self.embeddings.value
        shards = row_shards(self.embeddings)
        n, group = shards.shards, shards.group
        if n == 1:
            found = tf.gather(table, flat)
        else:
            owner = flat % n
            order = tf.argsort(owner, stable=True)
            splits = tf.math.bincount(
                tf.cast(owner, "int32"), minlength=n, maxlength=n, dtype="int32"
            )
            asked, asked_splits = comm.alltoall(
                tf.gather(flat, order) // n, splits, process_set=group
            )
            answered, _ = comm.alltoall(tf.gather(table, asked), asked_splits, process_set=group)
            found = tf.gather(answered, tf.math.invert_permutation(order))
        found = tf.reshape(found, tf.concat([tf.shape(ids), [self.dim]], axis=0))
        return tf.cast(found, self.compute_dtype)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        # Given, so that Keras does not trace `call` (and its collectives) to infer it.
        return (*input_shape, self.dim)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(rows=self.rows, dim=self.dim, seed=self.seed, scale=self.scale)
        config.update(group_size=self.group_size)
        return config


def _chunk_rows(variable: Any) -> int:
    """Local rows per rank in one collective of a gather or scatter (>= 1)."""
    row_bytes = math.prod(variable.shape[1:]) * tf.as_dtype(variable.dtype).size
    return max(1, _CHUNK_BYTES // max(1, row_bytes * row_shards(variable).shards))


def gather_rows(variable: Any) -> np.ndarray | None:
    """Collective (every rank): the whole table of a row shard, in global row order, on rank 0
    (None elsewhere); one allgather per chunk of rows within each model group, so rank 0 holds
    the table once plus one chunk. A variable every rank holds whole is returned as it is (no
    collective)."""
    shards = row_shards(variable)
    value = variable.value if hasattr(variable, "value") else variable
    if shards is None or shards.shards == 1:
        return np.asarray(value) if comm.is_chief() else None
    n, chief = shards.shards, comm.is_chief()
    whole = (
        np.empty(whole_shape(variable), tf.as_dtype(variable.dtype).as_numpy_dtype)
        if chief
        else None
    )
    step = _chunk_rows(variable)
    # Rank 0 holds the most rows: its count of chunks is every rank's.
    for chunk in range(math.ceil(shards.count(0) / step)):
        first = chunk * step
        got = comm.allgather(
            value[first : first + step],
            name=f"hvd_train.rows.gather.{chunk}",
            process_set=shards.group,
        )
        if chief:
            got, offset = np.asarray(got), 0
            for rank in range(n):
                count = min(step, max(0, shards.count(rank) - first))
                whole[rank + n * first :: n][:count] = got[offset : offset + count]
                offset += count
    return whole


def scatter_rows(variable: Any, whole: np.ndarray | None) -> None:
    """Collective (every rank): rank 0's whole table (`gather_rows`'s array, global row order) into
    every rank's row shard at this worker count and group size (one broadcast to all ranks per
    chunk of rows). Rank 0 checks
    the shape first (`whole_shape`): the caller has."""
    shards = row_shards(variable)
    if shards is None or shards.shards == 1:
        if comm.is_chief():
            variable.assign(whole)
        return
    n, rank = shards.shards, shards.rank
    mine = np.empty(tuple(variable.shape), tf.as_dtype(variable.dtype).as_numpy_dtype)
    step = _chunk_rows(variable) * n
    for chunk in range(math.ceil(shards.rows / step)):
        first = chunk * step
        rows = min(step, shards.rows - first)
        piece = (
            whole[first : first + rows]
            if comm.is_chief()
            else np.zeros((rows, *mine.shape[1:]), mine.dtype)
        )
        piece = np.asarray(comm.broadcast(piece, 0, name=f"hvd_train.rows.scatter.{chunk}"))
        # first is a multiple of n: this rank's rows of the chunk are rank, rank + n, ...
        taken = piece[rank::n]
        mine[first // n : first // n + len(taken)] = taken
    variable.assign(mine)
