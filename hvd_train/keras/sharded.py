"""Sharded optimizer state (ZeRO stage 1): each rank holds and updates 1/N of the optimizer's state.

`DistributedOptimizer(opt, shard_state=True)` (modern stack) gives the optimizer this mixin in front
of the plain distributed one (`keras/optimizer.py`). One update:

  grads -> one grouped reduce-scatter (Average; or Sum) per gradient bucket: rank r keeps the
           mean gradient's r-th shard of every variable
        -> one small allreduce (Sum) of each shard's sum of squares, the count of non-finite
           entries and the stop flag (`keras/stop.py`)
        -> Keras's own apply on the shards: loss-scale finite check (global: the count over all
           shards), unscaling, clipping (clipnorm and global_clipnorm from the global sums), the
           update of this rank's slots and weight shard
        -> one grouped allgather per bucket (the same buckets) of the updated shards into the
           model's variables.

The shard: per variable, its elements in row-major order cut into N contiguous pieces, as
Horovod's reduce-scatter cuts the first axis of the flattened gradient (rank r gets elements
[r*q + min(r, m), ...) of N*q + m, the first m ranks one more: `split_of`). Not along the first
axis: a conv kernel's is its height (1, 3 or 7 in ResNet-50), which would leave most ranks nothing.
Not one flat buffer over all variables: a piece of one variable keeps that variable's rank (its
shape is (count, 1, ..., 1)) and its name, so the rules Keras and the toolkit apply per tensor
stay right (AdamW and Lion skip weight decay on tensors of rank <= 1; `exclude_from_weight_decay`
by name or variable), and elementwise updates (SGD with momentum, Adam, AdamW, Lion, clipvalue)
are exactly the unsharded ones on the elements held; clipnorm takes each tensor's norm from the
allreduced sums. What needs a whole tensor is refused (`check`): a trust ratio (LARS, LAMB),
updates that depend on the tensor's shape (Adafactor's factored moments, Muon's orthogonalised
matrices), Keras's moving average of the weights (`use_ema`) and its own gradient accumulation.

Per rank, the optimizer holds its slots and a copy of its weight shard (the variables the update
writes; refreshed from the model's variable at each update, so a broadcast, a restore or
`set_weights` is seen), each 1/N of the unsharded size plus at most one element per variable. The
model keeps whole weights and gradients on every rank (stage 1 shards only the optimizer state).
`variables` lists only the optimizer's scalars (iterations, learning rate, loss scale, counters),
equal on every rank, so that the start-of-training broadcast sends only them; `shard_variables`
the per-rank rest (`state_bytes` counts both). A checkpoint of the optimizer's `variables` alone
(Keras's `model.save`) would hold no slots: `hvd-train train` saves `saved_variables`, each shard
gathered whole (`gather_stream`: collective, one variable at a time, written by rank 0 as it
comes), and puts them back on every rank at any worker count (`restore_whole`: each rank takes
its piece by `split_of` at its own count). With one worker the sharded optimizer holds its slots
and one copy of the weights: more than the unsharded one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvd_train import comm
from hvd_train.core.checkpoint import CheckpointError
from hvd_train.errors import everywhere
from hvd_train.keras import compat, embedding, large_batch
from hvd_train.keras import optimizer as distributed
from hvd_train.keras import stop as stop_flags


def split_of(length: int, size: int, rank: int) -> tuple[int, int]:
    """(first, count) of rank `rank`'s piece of a first axis of `length` over `size` ranks, as
    Horovod's reduce-scatter cuts it: the first `length % size` ranks one more."""
    quotient, remainder = divmod(length, size)
    return rank * quotient + min(rank, remainder), quotient + (1 if rank < remainder else 0)


def check(
    optimizer: Any, backward_passes_per_step: int, reduction: str, groups: Any, process_set: Any
) -> None:
    """Refuse what sharding the state would get wrong or cannot do yet (before the optimizer is
    made distributed).

    Raises:
      ValueError: the classic stack, accumulation over several passes, the two-level reduction,
        explicit `groups` or a `process_set`, LARS or LAMB (a trust ratio needs whole tensors),
        Adafactor or Muon (shape-dependent updates), Keras's `use_ema` or its
        `gradient_accumulation_steps`.
    """
    if compat.CLASSIC:
        raise ValueError("shard_state needs the modern stack (Keras 3); the classic stack has none")
    if backward_passes_per_step > 1:
        raise ValueError(
            f"shard_state with backward_passes_per_step={backward_passes_per_step} is not "
            "supported: accumulate with 1, or use the unsharded optimizer"
        )
    if reduction == "two_level":
        raise ValueError(
            "shard_state reduce-scatters over all ranks: reduction must not be two_level"
        )
    if groups is not None or process_set is not None:
        raise ValueError(
            "shard_state shards over all ranks in its own buckets: no groups or process_set"
        )
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, large_batch.Lars | large_batch.Lamb | keras.optimizers.Lamb):
        raise ValueError(
            f"shard_state with {type(inner).__name__}: its trust ratio needs each whole tensor's "
            "norms, which a shard does not hold; use sgd, adam, adamw or lion"
        )
    if isinstance(inner, keras.optimizers.Adafactor | keras.optimizers.Muon):
        raise ValueError(
            f"shard_state with {type(inner).__name__}: its update depends on each whole "
            "tensor's shape, which a shard does not keep; use sgd, adam, adamw or lion"
        )
    if inner.use_ema or inner.gradient_accumulation_steps:
        raise ValueError(
            "shard_state with Keras's use_ema or gradient_accumulation_steps is not supported "
            "(both act on the whole weights)"
        )


class ShardedOptimizer:
    """Mixin placed in front of `keras.optimizer._DistributedOptimizer` (see the module)."""

    _hvd_sharded = True

    def build(self, var_list: list[Any]) -> None:
        full = list(var_list)
        if any(map(embedding.is_row_sharded, full)):
            raise ValueError(
                "shard_state with a ShardedEmbedding: its table is split by rows already; "
                "use one or the other"
            )
        size, rank = comm.size(), comm.rank()
        starts, shards = [], []
        for variable in full:
            start, count = split_of(math.prod(variable.shape), size, rank)
            starts.append(start)
            shards.append(
                self.add_variable(
                    # The variable's rank kept: Keras's and the toolkit's rules go by it.
                    shape=(count, *[1] * (len(variable.shape) - 1)),
                    dtype=variable.dtype,
                    name=f"{variable.name}_shard",
                )
            )
        inner = getattr(self, "inner_optimizer", self)
        excluded = getattr(inner, "_exclude_from_weight_decay", None)
        if excluded:  # `exclude_from_weight_decay(var_list=...)` named the model's variables
            excluded |= {id(s) for v, s in zip(full, shards, strict=True) if id(v) in excluded}
        # Plain attributes, out of Keras's tracking (which would list the variables again).
        object.__setattr__(self, "_hvd_full", full)
        object.__setattr__(self, "_hvd_shards", shards)
        object.__setattr__(self, "_hvd_starts", starts)
        object.__setattr__(self, "_hvd_sums", None)
        if inner is not self:  # a LossScaleOptimizer: the inner one clips
            object.__setattr__(inner, "_clip_gradients", lambda grads: _clip(inner, self, grads))
        super().build(shards)

    @property
    def variables(self) -> list[Any]:
        """The optimizer's scalars, equal on every rank (what is broadcast)."""
        return [v for v in super().variables if len(v.shape) == 0]

    @property
    def shard_variables(self) -> list[Any]:
        """This rank's shards: slots and the weight shard the update writes."""
        return [v for v in super().variables if len(v.shape) > 0]

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        self._hvd_build_now(trainable_variables)
        if self._hvd_local:
            raise ValueError("shard_state reduce-scatters every gradient: no register_local_var")
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        shards = [self._hvd_shards[i] for i in present]
        for i, shard in zip(present, shards, strict=True):
            start, flat = self._hvd_starts[i], tf.reshape(compat.value(self._hvd_full[i]), [-1])
            shard.assign(tf.reshape(flat[start : start + shard.shape[0]], shard.shape))
        flats = [tf.reshape(tf.convert_to_tensor(grads[i]), [-1]) for i in present]
        # Buckets as the unsharded optimizer's, last layers first, so that the traced step starts
        # each reduce-scatter while the backward pass still computes the earlier gradients; the
        # allgathers take the same buckets. One worker sends nothing: no buckets.
        layout = (
            []
            if comm.size() == 1
            else distributed.bucket_layout(flats, self._hvd_bucket_mb, self._hvd_alone_mb)
        )
        pieces = [
            tf.reshape(piece, shard.shape)
            for piece, shard in zip(self._hvd_scatter(flats, layout), shards, strict=True)
        ]
        object.__setattr__(self, "_hvd_sums", self._hvd_global_sums(pieces))
        super(distributed._DistributedOptimizer, self).apply(pieces, shards)
        self._hvd_allreduce_count.assign_add(1)
        for i, whole in zip(present, self._hvd_gather(shards, layout), strict=True):
            self._hvd_full[i].assign(tf.reshape(whole, self._hvd_full[i].shape))

    def _hvd_gather(self, shards: list[Any], layout: list[list[int]]) -> list[tf.Tensor]:
        """Every rank's updated piece of each variable, in rank order: the whole (flat) variables
        again, on every rank; one grouped allgather per bucket."""
        flats = [tf.reshape(shard.value, [-1]) for shard in shards]
        if comm.size() == 1:
            return flats
        gathered = [comm.grouped_allgather([flats[j] for j in bucket]) for bucket in layout]
        return distributed.in_place_of(flats, list(range(len(flats))), layout, gathered)

    def _hvd_scatter(self, rows: list[tf.Tensor], layout: list[list[int]]) -> list[tf.Tensor]:
        """Each (flattened) gradient's mean over ranks, this rank's piece of it; one grouped
        reduce-scatter per bucket of `layout`."""
        if comm.size() == 1:
            # One worker: its gradient is the mean and its shard the whole; no Horovod op.
            return rows
        scattered = [
            comm.grouped_reducescatter(
                [rows[j] for j in bucket],
                op=self._hvd_op,
                compression=self._hvd_compression,
                prescale_factor=1.0 / self._hvd_predivide,
                postscale_factor=self._hvd_predivide,
            )
            for bucket in layout
        ]
        return distributed.in_place_of(rows, list(range(len(rows))), layout, scattered)

    def _hvd_global_sums(self, pieces: list[tf.Tensor]) -> tf.Tensor:
        """Over all ranks' shards: each gradient's sum of squares, then the count of non-finite
        entries, in one allreduce that also carries the stop flag."""
        local = tf.stack(
            [tf.reduce_sum(tf.square(tf.cast(p, tf.float32))) for p in pieces]
            + [sum(tf.reduce_sum(tf.cast(~tf.math.is_finite(p), tf.float32)) for p in pieces)]
        )
        if comm.size() == 1:
            return local  # one worker: its sums are the global ones
        flags = stop_flags.flags_of(self)
        # Every rank runs this allreduce at every update, outside any condition: the stop flag
        # rides it, and the finite check below reads its count, so all ranks skip alike.
        sent = stop_flags.with_flag([local], flags)
        reduced = comm.grouped_allreduce(sent, op=comm.Sum)
        return stop_flags.without_flag(reduced, flags, 1)[0]

    def check_finite(self, grads: Any) -> tf.Tensor:
        """A LossScaleOptimizer's finite check, over every rank's shards (not this rank's only)."""
        return tf.equal(self._hvd_sums[-1], 0.0)

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        return _clip(self, self, grads)


def _clip(settings: Any, sharded: Any, grads: list[Any]) -> list[Any]:
    """Keras's `_clip_gradients` on the shards of the gradients, with the whole tensors' norms (the
    global sums of squares; under loss scaling the sums are of the scaled gradients)."""
    sums = sharded._hvd_sums[: len(grads)]
    if compat.is_loss_scale_optimizer(sharded):
        sums = sums / tf.square(sharded.dynamic_scale)
    if settings.clipnorm and settings.clipnorm > 0:
        out = []
        for g, l2sum in zip(grads, tf.unstack(sums), strict=True):
            positive = l2sum > 0
            l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, 1.0)), l2sum)
            out.append(g * settings.clipnorm / tf.maximum(l2norm, settings.clipnorm))
        return out
    if settings.global_clipnorm and settings.global_clipnorm > 0:
        norm = tf.sqrt(tf.reduce_sum(sums))
        clip = settings.global_clipnorm
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [g * scale for g in grads]
    return keras.optimizers.Optimizer._clip_gradients(settings, grads)


def state_bytes(optimizer: Any) -> int:
    """Bytes of the variables this rank's optimizer holds: all of them unsharded; the scalars and
    this rank's shards when sharded."""
    held = compat.optimizer_variables(optimizer) + list(getattr(optimizer, "shard_variables", []))
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in held)


def is_sharded(optimizer: Any) -> bool:
    """True for an optimizer made by `DistributedOptimizer(..., shard_state=True)`."""
    return bool(getattr(optimizer, "_hvd_sharded", False))


def saved_variables(optimizer: Any) -> list[Any]:
    """What a checkpoint holds of a sharded optimizer, in Keras's order: its scalars and its
    shards (slots and the weight shards), each shard saved whole (`gather_whole`)."""
    return list(super(ShardedOptimizer, optimizer).variables)


def gather_stream(optimizer: Any) -> Iterator[np.ndarray | None]:
    """Collective (every rank, to its end): `saved_variables` one at a time, each shard gathered
    into the whole variable's elements in rank order (shape (elements, 1, ...)): arrays on rank 0,
    None elsewhere. Rank 0 can write each before the next is gathered (`core.checkpoint.write`
    reads an iterable as it writes), so it holds one whole variable at a time."""
    chief = comm.is_chief()
    for index, variable in enumerate(saved_variables(optimizer)):
        value = variable.value
        if len(variable.shape) and comm.size() > 1:
            value = comm.allgather(value, name=f"hvd_train.shard_state.gather.{index}")
        yield np.asarray(value) if chief else None


def gather_whole(optimizer: Any) -> list[np.ndarray] | None:
    """Collective (every rank): `gather_stream` as a list on rank 0 (the whole state at once);
    None elsewhere."""
    whole = list(gather_stream(optimizer))
    return whole if comm.is_chief() else None


def restore_whole(optimizer: Any, values: list[np.ndarray] | None, source: str) -> None:
    """Collective (every rank): rank 0's `values` (`gather_whole`'s arrays, from a checkpoint
    `source`) into every rank's shards, each rank taking its piece at this worker count; the
    scalars on rank 0 (the start-of-training broadcast takes them to the others).

    Raises:
      CheckpointError: on every rank alike, when the values do not match this optimizer's
        variables.
    """
    variables = saved_variables(optimizer)
    shapes, error = None, None
    if comm.is_chief():
        shapes = [tuple(v.shape) for v in values or []]
        error = _mismatch(variables, shapes, source)
    shapes, error = comm.broadcast_object((shapes, error), name="hvd_train.shard_state.shapes")
    if error:
        raise everywhere(CheckpointError(error))
    for index, (variable, shape) in enumerate(zip(variables, shapes, strict=True)):
        if not shape:
            if comm.is_chief():
                variable.assign(values[index])
            continue
        mine = values[index] if comm.is_chief() else np.zeros(shape, variable.dtype)
        if comm.size() > 1:
            name = f"hvd_train.shard_state.restore.{index}"
            mine = comm.broadcast(mine, root_rank=0, name=name)
        start, count = split_of(shape[0], comm.size(), comm.rank())
        variable.assign(mine[start : start + count])


def _mismatch(variables: list[Any], shapes: list[tuple[int, ...]], source: str) -> str | None:
    """Why saved shapes cannot go into a sharded optimizer's variables at this worker count, or
    None: a whole variable must split into this rank's shard (same rank, piece as long)."""
    if len(shapes) != len(variables):
        return (
            f"{source}: it holds {len(shapes)} optimizer variables; this sharded optimizer "
            f"saves {len(variables)} (was it written with another optimizer or "
            f"optimizer.shard_state setting?)"
        )
    for variable, shape in zip(variables, shapes, strict=True):
        mine = tuple(variable.shape)
        fits = shape == mine  # a scalar
        if shape and len(shape) == len(mine):
            fits = (split_of(shape[0], comm.size(), comm.rank())[1], *shape[1:]) == mine
        if not fits:
            return (
                f"{source}: optimizer variable {compat.variable_name(variable)} is saved with "
                f"shape {shape}, which does not split into this rank's shard {mine}"
            )
    return None
