"""The classic stack (Keras 2): Horovod's own `horovod.tensorflow.keras.DistributedOptimizer`.

Keras 2's `train_step` calls `optimizer.minimize`, which calls `compute_gradients` and then
`apply_gradients`; Horovod's wrapper allreduces in `compute_gradients`, so the allreduce comes
before gradient clipping (in `apply_gradients`) and, under mixed precision, before the
LossScaleOptimizer's finite check (Keras 2's LossScaleOptimizer calls the inner `compute_gradients`
first and checks the unscaled result): every rank sees the same averaged gradient and takes the
same skip decision. Imported only on the classic stack (`compat.CLASSIC`).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvd_train import comm

# Horovod's own Keras 2 optimizer is part of the backend: the one use of it outside hvd_train.comm.
from hvd_train.comm import horovod as backend
from hvd_train.keras import compat
from hvd_train.keras import optimizer as optimizer_lib
from hvd_train.keras import stop as stop_flags


@keras.saving.register_keras_serializable(package="hvd_train")
class PerUpdate(keras.optimizers.schedules.LearningRateSchedule):
    """A schedule read in updates, where Horovod's optimizer counts batches.

    With `backward_passes_per_step=k` Horovod's accumulation advances `iterations` on every batch
    (k per update); the toolkit's schedules count updates, as on the modern stack. The update made
    at the k-th batch sees `iterations = k*u + k - 1`, which is update u.
    """

    def __init__(self, schedule: Any, passes: int) -> None:
        self.schedule = schedule
        self.passes = passes

    def __call__(self, step: Any) -> Any:
        return self.schedule(tf.math.floordiv(tf.cast(step, tf.int64), self.passes))

    def get_config(self) -> dict[str, Any]:
        return {
            "schedule": keras.optimizers.schedules.serialize(self.schedule),
            "passes": self.passes,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PerUpdate:
        schedule = keras.optimizers.schedules.deserialize(config["schedule"])
        return cls(schedule, config["passes"])


def distributed_optimizer(
    optimizer: Any,
    op: Any,
    compression: Any,
    gradient_predivide_factor: float,
    backward_passes_per_step: int,
    average_aggregated_gradients: bool,
    bucket_mb: float | None,
    alone_mb: float | None,
    reduction: str,
) -> Any:
    """Horovod's DistributedOptimizer around a Keras 2 optimizer (a new object, Horovod's way).

    Arguments as `hvd_train.keras.optimizer.DistributedOptimizer`, already checked there.
    """
    loss_scaled = keras.mixed_precision.global_policy().name == "mixed_float16"
    if compat.is_loss_scale_optimizer(optimizer):
        optimizer, loss_scaled = optimizer.inner_optimizer, True
    if loss_scaled and backward_passes_per_step > 1:
        # The finite check would look at one rank's local, not yet averaged, accumulation on the
        # batches between allreduces: ranks could skip different batches and fall out of step.
        raise ValueError(
            "backward_passes_per_step > 1 with mixed_float16 is not supported on the classic stack "
            "(Keras 2): the loss-scale check would run on un-averaged gradients"
        )
    distributed = backend.keras2_distributed_optimizer(
        optimizer,
        compression=compression,
        # Embedding gradients (IndexedSlices) densified join the fused allreduce, as on modern.
        sparse_as_dense=True,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        # One group where there is one bucket, instead of Horovod's default of one allreduce per
        # tensor (docs/knobs.md has the measurements: no worse where tensors are few, faster where
        # they are many); more buckets are given as groups once the variables are known.
        groups=1,
    )
    flags = stop_flags.attach(distributed)
    _reduce_in_buckets(
        distributed,
        flags,
        bucket_mb,
        alone_mb,
        reduction,
        dict(
            compression=compression,
            sparse_as_dense=True,
            op=op,
            gradient_predivide_factor=gradient_predivide_factor,
        ),
    )
    schedule = distributed._learning_rate
    if backward_passes_per_step > 1 and isinstance(
        schedule, keras.optimizers.schedules.LearningRateSchedule
    ):
        distributed._learning_rate = PerUpdate(schedule, backward_passes_per_step)
    if loss_scaled:
        # Outside Horovod's optimizer, where Keras 2 compiles it in too (see the module docstring).
        return keras.mixed_precision.LossScaleOptimizer(distributed)
    return distributed


def _reduce_in_buckets(
    optimizer: Any,
    flags: stop_flags.StopFlags,
    bucket_mb: float | None,
    alone_mb: float | None,
    reduction: str,
    options: dict[str, Any],
) -> None:
    """Send the gradients in the buckets of `core.buckets` (Horovod's `groups`, given as lists of
    variables when the step is traced: the variables are unknown before), count the runs of the
    allreduce in a variable (shows accumulation is local: one per update), and send the stop flag
    with the gradients (keras/stop.py). Two-level reduction (`comm.reduction`) sends the same
    buckets through `comm.allreduce_groups` instead of Horovod's function. Horovod calls
    `_allreduce_grads` directly, or through its accumulation helper on every k-th batch; both are
    wrapped. None run with one worker."""
    count = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvd_allreduce_count")
    object.__setattr__(optimizer, "_hvd_train_allreduce_count", count)
    if comm.size() == 1:
        return
    one_group = optimizer._allreduce_grads

    def reduce(grads: Any, variables: Any, use_generic_names: bool) -> Any:
        present = [i for i, g in enumerate(grads) if g is not None]
        chosen = [variables[i] for i in present] if variables else []
        layout = optimizer_lib.bucket_layout(chosen, bucket_mb, alone_mb)
        if reduction == "two_level":
            return _two_level(grads, present, layout, options)
        if len(layout) <= 1:
            return one_group(grads, variables, use_generic_names)
        groups = [[variables[present[j]] for j in bucket] for bucket in layout]
        reduce_groups = backend.keras2_allreduce_grads_fn(optimizer._name, groups, **options)
        return reduce_groups(grads, variables, use_generic_names)

    def counted(grads: Any, variables: Any = None, use_generic_names: bool = False) -> Any:
        out = reduce(grads, variables, use_generic_names)
        count.assign_add(1)
        # The stop flag: a scalar allreduce issued beside the gradients', in the same step and
        # Horovod cycle. Not inside their group as on Keras 3: Horovod caches this gradient
        # function (a tf.function) across optimizers, and one traced with another optimizer's
        # flag fails once that optimizer is gone ("referencing variables which have been deleted").
        local = tf.cast(flags.local, tf.float32)
        flags.agreed.assign(comm.allreduce(local, op=comm.Sum, name="hvd_train_stop_flag"))
        return out

    optimizer._allreduce_grads = counted
    if optimizer._agg_helper is not None:
        optimizer._agg_helper.allreduce_grads = counted


def _two_level(
    grads: list[Any], present: list[int], layout: list[list[int]], options: dict[str, Any]
) -> list[Any]:
    """The buckets reduced within each host, across hosts and within each host again, with
    Horovod's meaning of op, compression and predivide factor (its function's, for flat)."""
    tensors = [tf.convert_to_tensor(grads[i]) for i in present]  # sparse_as_dense
    predivide = options["gradient_predivide_factor"]
    reduced = comm.allreduce_groups(
        [[tensors[j] for j in bucket] for bucket in layout],
        op=options["op"],
        compression=options["compression"],
        prescale_factor=1.0 / predivide,
        postscale_factor=predivide,
        reduction="two_level",
    )
    return optimizer_lib.in_place_of(grads, present, layout, reduced)


def is_distributed(optimizer: Any) -> bool:
    """True for Horovod's Keras DistributedOptimizer, also inside a LossScaleOptimizer (Keras 2's
    calls the inner `compute_gradients`, where Horovod allreduces, before its finite check)."""
    if compat.is_loss_scale_optimizer(optimizer):
        optimizer = optimizer.inner_optimizer
    return hasattr(optimizer, "_allreduce_grads")


def allreduce_count(optimizer: Any) -> int:
    """How many gradient allreduces the optimizer has run."""
    if compat.is_loss_scale_optimizer(optimizer):
        optimizer = optimizer.inner_optimizer
    return int(optimizer._hvd_train_allreduce_count.numpy())
