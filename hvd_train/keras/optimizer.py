"""DistributedOptimizer: Horovod's gradient averaging where Keras actually calls it.

On the classic stack (Keras 2) that is Horovod's own `horovod.tensorflow.keras.DistributedOptimizer`
(`keras/classic.py`); on the modern stack (Keras 3) it is the toolkit's own, below.

Horovod 0.28's `horovod.tensorflow.keras.DistributedOptimizer` does not work on Keras 3: it calls
`var.ref()`, `keras.backend.get_value` and `optimizer.variables()`, none of which exist there, and
it allreduces in `get_gradients`/`_compute_gradients`, hooks Keras 3's `fit()` never calls, so
gradients would silently not be averaged. Keras 3's `train_step` calls `optimizer.apply_gradients`,
which calls `apply(grads, variables)`; this optimizer averages the raw gradients at the top of
`apply`:

  apply(grads) -> [accumulate locally k times] -> one grouped allreduce per gradient bucket
                  -> Keras's own apply (loss-scale finite check, unscaling, clipping, the update)

so the allreduce is outermost: before clipping (clipnorm acts on the averaged gradient, as one
process with the global batch would) and before a LossScaleOptimizer's finite check (every rank sees
the same averaged gradient, so all take the same skip decision; an overflow on one rank makes the
average non-finite everywhere, and no rank skips a collective the others run). The buckets
(`core.buckets`: last layers first, fixed membership) let the traced step send the late layers'
gradients while the backward pass still computes the early ones.
"""

from __future__ import annotations

import itertools
import logging
import os
import warnings
from typing import Any

import keras
import tensorflow as tf

from hvd_train import comm
from hvd_train.core import buckets, environment
from hvd_train.keras import compat, embedding
from hvd_train.keras import stop as stop_flags

log = logging.getLogger("hvd_train")

_classes: dict[tuple[type, bool], type] = {}


class _DistributedOptimizer:
    """Mixin placed in front of a Keras optimizer class (see `DistributedOptimizer`)."""

    _hvd_distributed = True

    def build(self, var_list: list[Any]) -> None:
        if self._hvd_process_set is not None and any(map(embedding.is_row_sharded, var_list)):
            raise ValueError(
                "a ShardedEmbedding's table is split over all ranks: its gradient cannot be "
                "averaged over a process set (process_set=None)"
            )
        super().build(var_list)
        # Runs of the grouped allreduce, counted on the device: shows accumulation is local.
        self._hvd_allreduce_count = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", name="hvd_allreduce_count"
        )
        if self._hvd_passes > 1:
            self._hvd_pass_count = self.add_variable(
                shape=(), dtype="int64", initializer="zeros", name="hvd_pass_count"
            )
            self._hvd_accumulators = [
                self.add_variable_from_reference(v, name="hvd_accumulator") for v in var_list
            ]

    def add_variable_from_reference(
        self, reference_variable: Any, name: str | None = None, initializer: Any = "zeros"
    ) -> Any:
        variable = super().add_variable_from_reference(reference_variable, name, initializer)
        # A slot of a table's row shard holds that shard's rows: per rank, like the shard.
        embedding.mark_like(variable, reference_variable)
        return variable

    def _hvd_build_now(self, trainable_variables: Any) -> None:
        if not self.built and trainable_variables is not None:
            # Keras builds lazily inside its apply; our counters and accumulators are needed sooner.
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        grads = list(grads)
        self._hvd_build_now(trainable_variables)
        variables = list(
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        if self._hvd_passes == 1:
            super().apply(self._hvd_allreduce(grads, variables), trainable_variables)
            return
        for acc, grad in zip(self._hvd_accumulators, grads, strict=True):
            if grad is not None:
                acc.assign_add(tf.convert_to_tensor(grad))
        passes = self._hvd_pass_count.assign_add(1)

        def reduce_and_apply() -> tf.Tensor:
            summed = [
                None if g is None else acc.value
                for g, acc in zip(grads, self._hvd_accumulators, strict=True)
            ]
            if self._hvd_average_aggregated:
                summed = [None if g is None else g / self._hvd_passes for g in summed]
            # Explicit super(): zero-argument super() does not work inside a nested function.
            super(_DistributedOptimizer, self).apply(
                self._hvd_allreduce(summed, variables), trainable_variables
            )
            for acc in self._hvd_accumulators:
                acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        # The pass counter is identical on all ranks, so all take the same branch: the allreduce
        # inside it runs on every rank or on none.
        tf.cond(passes % self._hvd_passes == 0, reduce_and_apply, lambda: tf.constant(False))

    # Keras's saved form (model.save, save_weights) holds the wrapped optimizer's variables only,
    # not the counters and accumulators added here: a saved model loads as the plain optimizer,
    # with its state.
    def _hvd_saved_variables(self) -> list[Any]:
        added = [self._hvd_allreduce_count, *getattr(self, "_hvd_accumulators", ())]
        added += [getattr(self, "_hvd_pass_count", None)]
        ids = {id(v) for v in added if v is not None}
        return [v for v in self.variables if id(v) not in ids]

    def save_own_variables(self, store: Any) -> None:
        if not self.built:
            super().save_own_variables(store)
            return
        for i, variable in enumerate(self._hvd_saved_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        if not self.built:
            super().load_own_variables(store)  # Keras's warning: nothing to load into yet
            return
        variables = self._hvd_saved_variables()
        if len(store.keys()) != len(variables):
            warnings.warn(
                f"Skipping variable loading for optimizer {self.name!r}: it has "
                f"{len(variables)} variables, the saved optimizer {len(store.keys())}",
                stacklevel=2,
            )
            return
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def register_local_var(self, var: Any) -> None:
        """Keep this variable's gradient local: it is never allreduced (a layer each rank trains
        on its own, e.g. model parallelism); with `scale_local_gradients`, it is divided by the
        number of ranks, as Horovod does. Register before the first step (it is traced then)."""
        self._hvd_local.add(id(var))

    def _hvd_allreduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        ranks = len(comm.process_set_ranks(self._hvd_process_set))
        if ranks == 1:
            # Nothing to average; keeps the one-worker step free of Horovod.
            return [one_slice_per_row(g) for g in grads]
        # A table's row shard is local too, and always divided: its owner's gradient sums what
        # every rank's batch sent back (`keras/embedding.py`).
        sharded_rows = {i for i, v in enumerate(variables) if embedding.is_row_sharded(v)}
        local = sharded_rows | {i for i, v in enumerate(variables) if id(v) in self._hvd_local}
        divided = local if self._hvd_scale_local else sharded_rows
        grads = [
            _divided(g, ranks) if i in divided and g is not None else g for i, g in enumerate(grads)
        ]
        for i in sharded_rows:
            replicas = embedding.row_shards(variables[i]).replicas
            if replicas is not None and grads[i] is not None:
                # Model groups: each group's owner summed its own group's lookups; the other
                # groups hold the same rows, and their sum is the global batch's.
                grads[i] = summed_over(grads[i], replicas)
        present = [i for i, g in enumerate(grads) if g is not None and i not in local]
        if not present:
            return grads
        # Embedding gradients arrive as IndexedSlices; densified, they join their bucket's fused
        # allreduce (Horovod would otherwise allgather them, one collective each).
        tensors = [tf.convert_to_tensor(grads[i]) for i in present]
        # One grouped allreduce per bucket, last layers first: each depends only on its own
        # gradients, so the traced step starts it while the backward pass is still running.
        if self._hvd_groups is None:
            layout = bucket_layout(tensors, self._hvd_bucket_mb, self._hvd_alone_mb)
        else:
            layout = group_layout(self._hvd_groups, [variables[i] for i in present])
        groups = [[tensors[j] for j in bucket] for bucket in layout]
        # The stop flag travels with the last bucket: see keras/stop.py.
        flags = stop_flags.flags_of(self)
        groups[-1] = stop_flags.with_flag(groups[-1], flags)
        reduced = comm.allreduce_groups(
            groups,
            op=self._hvd_op,
            compression=self._hvd_compression,
            prescale_factor=1.0 / self._hvd_predivide,
            # Horovod's Average divides by size after this postscale: together, a mean.
            postscale_factor=self._hvd_predivide,
            process_set=self._hvd_process_set,
            reduction=self._hvd_reduction,
        )
        reduced[-1] = stop_flags.without_flag(reduced[-1], flags, len(layout[-1]))
        self._hvd_allreduce_count.assign_add(1)
        return in_place_of(grads, present, layout, reduced)

    @property
    def allreduce_count(self) -> int:
        """How many updates' gradients this optimizer has allreduced (0 before the first step)."""
        return int(self._hvd_allreduce_count.numpy()) if self.built else 0


def _divided(grad: Any, ranks: int) -> Any:
    """A gradient divided by the number of ranks; an embedding's stays sparse, a slice per row."""
    if isinstance(grad, tf.IndexedSlices):
        grad = one_slice_per_row(grad)
        return tf.IndexedSlices(grad.values / ranks, grad.indices, grad.dense_shape)
    return tf.convert_to_tensor(grad) / ranks


def summed_over(grad: Any, process_set: Any) -> Any:
    """Collective (the process set's ranks): a gradient summed over the ranks of `process_set`;
    an embedding's stays sparse (its slices allgathered, one per row after), a dense one is
    allreduced."""
    if not isinstance(grad, tf.IndexedSlices):
        return comm.allreduce(grad, op=comm.Sum, process_set=process_set)
    grad = one_slice_per_row(grad)
    values = comm.allgather(grad.values, process_set=process_set)
    indices = comm.allgather(grad.indices, process_set=process_set)
    return one_slice_per_row(tf.IndexedSlices(values, indices, grad.dense_shape))


def one_slice_per_row(grad: Any) -> Any:
    """An embedding's gradient (IndexedSlices) with the slices of each row summed into one; any
    other gradient as it is.

    A lookup's gradient holds one slice per id looked up, so a row asked for twice comes twice.
    Keras 3's optimizers apply their element-wise steps to the slices as they come (Adam squares
    each one) where a row's gradient is their sum; Keras 2's summed them first, as here."""
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    rows, slot = tf.unique(grad.indices)
    summed = tf.math.unsorted_segment_sum(grad.values, slot, tf.shape(rows)[0])
    return tf.IndexedSlices(summed, rows, grad.dense_shape)


def bucket_layout(
    values: list[Any], bucket_mb: float | None, alone_mb: float | None = None
) -> list[list[int]]:
    """The buckets of gradients shaped like these tensors or variables (indices into `values`, in
    the order sent): fixed by their sizes and the job's topology (`core.buckets`)."""
    nbytes = [v.shape.num_elements() * v.dtype.size for v in values]
    # An elastic job runs Gloo too, and keeps one bucket (comm.init: no peer agrees at start).
    gloo = comm.controller() == "gloo" and os.environ.get("HOROVOD_ELASTIC") != "1"
    link = comm.link_gbit()
    size = buckets.bucket_bytes(
        sum(nbytes),
        comm.cross_size(),
        bucket_mb,
        comm.spare_cpu(),
        comm.oversubscribed(),
        gloo,
        link,
    )
    alone = buckets.alone_bytes(alone_mb, comm.cross_size(), comm.controller() == "gloo", link)
    layout = buckets.layout(nbytes, size, alone)
    if comm.rank() == 0:
        log.info(
            "gradient buckets: %d, %s, %s (%.1f MiB of gradients; %s, link %s)",
            len(layout),
            f"{size / buckets.MIB:g} MiB each" if size else "one group",
            f"alone from {alone / buckets.MIB:g} MiB" if alone else "none alone",
            sum(nbytes) / buckets.MIB,
            comm.controller(),
            _link_said(link, comm.link_gbit_from()),
        )
    return layout


def _link_said(link: float | None, source: str | None) -> str:
    """The link's part of the bucket line: "9.52 Gbit/s, from HVD_TRAIN_LINK_GBIT",
    "0.95 Gbit/s, measured at start: ...", "unknown, not measured: ...", "unknown"."""
    said = "unknown" if link is None else f"{link:g} Gbit/s"
    if source == environment.LINK_GBIT:
        return f"{said}, from {source}"
    return f"{said}, {source}" if source else said


def group_layout(groups: int | list[list[Any]], variables: list[Any]) -> list[list[int]]:
    """Explicit groups (Horovod's `groups`) as a bucket layout over `variables`, the variables
    whose gradients are sent, in order: an int n splits them into n contiguous groups of near
    equal count; a list of lists of variables makes each list one group, and every variable in
    none a group of its own, after them."""
    if isinstance(groups, int):
        count, extra = divmod(len(variables), groups)
        bounds = [i * count + min(i, extra) for i in range(groups + 1)]
        return [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]
    group_of = {id(v): g for g, group in enumerate(groups) for v in group}
    layout: list[list[int]] = [[] for _ in groups]
    alone = []
    for j, var in enumerate(variables):
        if id(var) in group_of:
            layout[group_of[id(var)]].append(j)
        else:
            alone.append([j])
    return [bucket for bucket in layout if bucket] + alone


def in_place_of(
    grads: list[Any], present: list[int], layout: list[list[int]], reduced: list[list[Any]]
) -> list[Any]:
    """`grads` with each present gradient replaced by its reduced value (`reduced` per bucket of
    `layout`, whose indices count the present gradients only)."""
    out = list(grads)
    for bucket, group in zip(layout, reduced, strict=True):
        for j, tensor in zip(bucket, group, strict=True):
            out[present[j]] = tensor
    return out


BF16_NEEDS = (
    "bf16 compression needs a Horovod that reduces bfloat16, the installer's (build recipe r6, "
    "mpi_scripts/patches/horovod-0.28.1-bfloat16.patch): rerun make install"
)


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    op: Any = comm.Average,
    compression: Any = comm.Compression.none,
    gradient_predivide_factor: float = 1.0,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = True,
    bucket_mb: float | None = None,
    alone_mb: float | None = None,
    reduction: str = "auto",
    groups: int | list[list[Any]] | None = None,
    process_set: Any = None,
    scale_local_gradients: bool = True,
    shard_state: bool = False,
) -> keras.optimizers.Optimizer:
    """Make a Keras optimizer average its gradients over all ranks before each update.

    The contract, on both stacks: pass the returned optimizer to `model.compile` and use only it
    from then on; the argument is consumed (Keras 3 changes it in place, Keras 2 wraps a copy).
    The returned optimizer is of the argument's class, keeps its config and serialised form (a
    saved model loads as the plain optimizer), and satisfies `is_distributed`. Under the
    "mixed_float16" policy it is a `keras.mixed_precision.LossScaleOptimizer` whose allreduce sits
    outside the loss-scale finite check, so one rank's overflow never skips the collective that the
    others run (Keras's compile would wrap the other way round on Keras 3).

    How, per stack: Keras 3 (modern) gains the toolkit's distributed `apply`; Keras 2 (classic)
    is Horovod's own DistributedOptimizer, given the same buckets as its `groups`. On both, each
    update sends one grouped allreduce per gradient bucket (`core.buckets`).

    Args:
      optimizer: a Keras optimizer, or a LossScaleOptimizer.
      op: `Average` (default) or `Sum`.
      compression: `Compression.none`, `Compression.fp16` or `Compression.bf16` (each 16-bit one
        halves the bytes sent; bf16 keeps float32's range and needs the installer's Horovod).
      gradient_predivide_factor: with Average, divide by this before the sum and by size/this after
        (guards fp16 sums against overflow); 1.0 = plain average.
      backward_passes_per_step: k >= 1: gradients of k consecutive batches are summed locally and
        allreduced once; the update happens every k-th batch.
      average_aggregated_gradients: divide the k-batch sum by k (default), so that k passes of batch
        b update like one pass of batch k*b. Horovod's Keras default is the sum (False).
      bucket_mb: gradients per grouped allreduce, in MiB, taken from the last layer backwards, so
        that early buckets are sent while the backward pass runs; 0: one bucket of all (but
        those `alone_mb` sends alone); None
        (default): derived from the topology, the controller and the link's rate
        (`core.buckets.bucket_bytes`).
      alone_mb: a gradient of at least this many MiB is a bucket of its own, which Horovod
        reduces in place instead of copying it into its fusion buffer and out; 0: none alone;
        None (default): derived from the controller, the hosts and the link's rate
        (`core.buckets.alone_bytes`).
      reduction: how each bucket is reduced: "flat" (one ring over all ranks), "two_level"
        (within each host, across hosts, within each host again: `comm.reduction`), or "auto"
        (the topology's rule, `comm.resolve_reduction`; HVD_TRAIN_REDUCTION overrides it). Choosing
        is a collective where the mode is not "flat": every rank creates its optimizer alike.
      groups: explicit buckets instead of `bucket_mb`'s (Horovod's `groups`): an int n > 0, n
        groups of near equal count in variable order; or lists of the model's variables, one
        group each (the others one group apiece). Modern stack only.
      process_set: reduce over these ranks only (a `comm.ProcessSet`; None: all ranks, Average
        then divides by the set's size; reduction "flat"). Modern stack only.
      scale_local_gradients: divide the gradients of variables registered with
        `optimizer.register_local_var` (never allreduced) by the number of ranks (Horovod's).
      shard_state: each rank holds and updates 1/N of the optimizer's state: gradients
        reduce-scattered, updated shards allgathered (ZeRO stage 1, `keras.sharded`). Modern
        stack only.

    Returns:
      The optimizer to compile with (see the contract above).

    Raises:
      ValueError: an unsupported op, a non-positive factor or pass count, a negative bucket or
        alone size, an unknown reduction or "two_level" where it cannot run, bf16 compression on
        a Horovod that cannot reduce bfloat16 (not the installer's), bad `groups`, `groups` or
        `process_set` on the classic stack, an optimizer that is already distributed, or
        `shard_state` with what it cannot shard (`keras.sharded.check`).
    """
    if op not in (comm.Average, comm.Sum):
        raise ValueError(f"op must be hvd_train.Average or hvd_train.Sum, got {op!r}")
    if gradient_predivide_factor <= 0 or (gradient_predivide_factor != 1.0 and op != comm.Average):
        raise ValueError(
            "gradient_predivide_factor must be positive, and other than 1.0 only with op=Average; "
            f"got {gradient_predivide_factor} with op={op}"
        )
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
        )
    if bucket_mb is not None and not bucket_mb >= 0:
        raise ValueError(f"bucket_mb must be >= 0 or None, got {bucket_mb!r}")
    if alone_mb is not None and not alone_mb >= 0:
        raise ValueError(f"alone_mb must be >= 0 or None, got {alone_mb!r}")
    if groups is not None and not (
        (isinstance(groups, int) and groups > 0)
        or (isinstance(groups, list) and all(isinstance(g, list | tuple) for g in groups))
    ):
        raise ValueError(f"groups must be an int > 0 or a list of lists of variables: {groups!r}")
    if compat.CLASSIC and (groups is not None or process_set is not None):
        raise ValueError(
            "groups and process_set: modern stack only (on Keras 2, Horovod's own "
            "horovod.tensorflow.keras.DistributedOptimizer takes them)"
        )
    if compression is comm.Compression.bf16 and not comm.reduces_bfloat16():
        raise ValueError(BF16_NEEDS)
    if is_distributed(optimizer):
        raise ValueError(f"optimizer {optimizer.name!r} is already distributed")
    if compat.optimizer_built(optimizer):
        raise ValueError(f"optimizer {optimizer.name!r} is already built: distribute it before use")
    # Every rank alike; with one worker (or before `init`) flat, the mode still checked.
    several = comm.is_initialized() and comm.size() > 1
    if process_set is not None and reduction == "auto":
        reduction = "flat"  # two-level runs over all ranks only
    reduction = comm.resolve_reduction(reduction) if several else _checked(reduction)
    if shard_state:
        from hvd_train.keras import sharded  # imports this module

        sharded.check(optimizer, backward_passes_per_step, reduction, groups, process_set)
    if compat.CLASSIC:
        from hvd_train.keras import classic

        return classic.distributed_optimizer(
            optimizer,
            op,
            compression,
            gradient_predivide_factor,
            backward_passes_per_step,
            average_aggregated_gradients,
            bucket_mb,
            alone_mb,
            reduction,
        )
    if keras.mixed_precision.global_policy().name == "mixed_float16" and not (
        compat.is_loss_scale_optimizer(optimizer)
    ):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    base = type(optimizer)
    mixins: tuple[type, ...] = (_DistributedOptimizer,)
    if shard_state:
        mixins = (sharded.ShardedOptimizer, *mixins)
    if (base, shard_state) not in _classes:
        _classes[base, shard_state] = type(
            base.__name__,
            (*mixins, base),
            {"__module__": base.__module__, "__qualname__": base.__qualname__},
        )
    object.__setattr__(optimizer, "__class__", _classes[base, shard_state])
    optimizer._hvd_op = op
    optimizer._hvd_compression = compression
    optimizer._hvd_predivide = float(gradient_predivide_factor)
    optimizer._hvd_passes = backward_passes_per_step
    optimizer._hvd_average_aggregated = average_aggregated_gradients
    optimizer._hvd_bucket_mb = bucket_mb
    optimizer._hvd_alone_mb = alone_mb
    optimizer._hvd_reduction = reduction
    optimizer._hvd_groups = groups
    optimizer._hvd_process_set = process_set
    optimizer._hvd_scale_local = scale_local_gradients
    optimizer._hvd_local = set()
    stop_flags.attach(optimizer)
    return optimizer


def _checked(reduction: str) -> str:
    if reduction not in comm.REDUCTIONS:
        raise ValueError(f"reduction {reduction!r}: expected one of {', '.join(comm.REDUCTIONS)}")
    return "flat"


def is_distributed(optimizer: Any) -> bool:
    """True if the optimizer averages gradients over ranks (made by `DistributedOptimizer`)."""
    if compat.CLASSIC:
        from hvd_train.keras import classic

        return classic.is_distributed(optimizer)
    return getattr(type(optimizer), "_hvd_distributed", False)


def traces_collectives(optimizer: Any) -> bool:
    """True if a train step with this optimizer contains Horovod ops, which have no XLA kernels.

    The toolkit's optimizer adds none with one worker; Horovod's own (classic stack) always traces
    its allreduce, inside a condition on the worker count.
    """
    if not is_distributed(optimizer):
        return False
    return compat.CLASSIC or comm.size() > 1


def allreduce_count(optimizer: Any) -> int:
    """How many gradient allreduces a distributed optimizer has run (0 with one worker)."""
    if compat.CLASSIC:
        from hvd_train.keras import classic

        return classic.allreduce_count(optimizer)
    return optimizer.allreduce_count


def check_optimizer(optimizer: Any) -> None:
    """Refuse set-ups in which gradients would not be averaged on every rank alike.

    Raises:
      ValueError: an undistributed optimizer with more than one worker, or (Keras 3) a
        LossScaleOptimizer wrapped around the distributed optimizer, where one rank's overflow
        would skip the allreduce the others run. (Keras 2's LossScaleOptimizer computes the
        gradients through the inner optimizer, allreduce included, before its finite check: that
        order is right, and `is_distributed` accepts it.)
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None and is_distributed(inner) and not is_distributed(optimizer):
        raise ValueError(
            "the model's LossScaleOptimizer wraps the distributed optimizer: create the "
            "DistributedOptimizer after setting the mixed_float16 policy (it then wraps the loss "
            "scaling itself, with the allreduce outside the finite check)"
        )
    if comm.size() > 1 and not is_distributed(optimizer):
        raise ValueError(
            f"optimizer {optimizer.name!r} is not distributed: wrap it with "
            "hvd_train.DistributedOptimizer, or gradients are never averaged over ranks"
        )
