"""Synchronised BatchNormalization: batch moments over the global batch, not each rank's slice.

With small per-rank batches, each rank's BatchNorm normalises by the statistics of a few samples,
and training differs from one process with the global batch. This layer sums each channel's count,
sum and sum of squares over ranks (one grouped allreduce per layer per training step; its gradient
is the allreduce of the upstream gradients, Horovod's registered gradient) and normalises by the
global mean and variance, so N ranks with batch b train like one process with batch N*b. Inference
uses the moving statistics and runs no collective. Costs one small allreduce per BatchNorm layer
per step: use it where per-rank batches are small (detection, segmentation), not by default.

Both stacks use the toolkit's own layer (the same moments, the same single grouped allreduce), each
overriding the hook its Keras has: Keras 3's `_moments(inputs, mask)`, Keras 2's
`_calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask)` (with the fused kernel off, as
it computes the moments itself). Horovod's `hvd.SyncBatchNormalization` (Keras 2 only) is not used:
it averages per-rank means and mean squares, exact only when every rank's batch has the same size
(a last partial batch does not), and it rejects the `fused=None` that a plain layer's config holds,
so `convert_sync_batchnorm` could not clone into it; one layer on both stacks keeps one behaviour.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from hvd_train import comm
from hvd_train.keras import compat
from models.layers import FusedBatchNormalization


def _global_moments(inputs: Any, axes: Any, keepdims: bool = False) -> tuple[Any, Any]:
    """Mean and variance over `axes` of the inputs of all ranks together (one grouped allreduce)."""
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
    local = [
        tf.reshape(count, [1]),
        tf.reduce_sum(inputs, axis=axes, keepdims=keepdims),
        tf.reduce_sum(tf.square(inputs), axis=axes, keepdims=keepdims),
    ]
    total, summed, squares = comm.grouped_allreduce(local, op=comm.Sum)
    mean = summed / total
    variance = tf.maximum(squares / total - tf.square(mean), 0.0)
    return mean, variance


class _Keras3Moments:
    """Keras 3's hook: `BatchNormalization._moments(inputs, mask)`."""

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None or comm.size() == 1:
            return super()._moments(inputs, mask)
        return _global_moments(inputs, self._reduction_axes)


class _Keras2Moments:
    """Keras 2's hook: `BatchNormalization._calculate_mean_and_var(...)`, fused kernel off."""

    def __init__(self, **kwargs: Any) -> None:
        # The fused kernel computes the moments itself, without calling the hook.
        super().__init__(**{**kwargs, "fused": False})

    def _calculate_mean_and_var(
        self, inputs: Any, reduction_axes: Any, keep_dims: bool, mask: Any = None
    ) -> tuple[Any, Any]:
        if mask is not None or comm.size() == 1:
            return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
        return _global_moments(inputs, reduction_axes, keepdims=keep_dims)


@keras.saving.register_keras_serializable(package="hvd_train")
class SyncBatchNormalization(
    _Keras2Moments if compat.CLASSIC else _Keras3Moments, keras.layers.BatchNormalization
):
    """`keras.layers.BatchNormalization` whose training moments span all ranks."""


def convert_sync_batchnorm(model: Any) -> Any:
    """A copy of a functional or Sequential model with every BatchNormalization synchronised
    (same configuration; weights are fresh, so convert before training or restoring).

    Raises:
      ValueError: a subclassed model (its layers cannot be rebuilt from configs).
    """

    def clone(layer: Any) -> Any:
        if type(layer) in (keras.layers.BatchNormalization, FusedBatchNormalization):
            return SyncBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    try:
        return keras.models.clone_model(model, clone_function=clone)
    except ValueError as err:  # Keras clones only functional and Sequential models
        raise ValueError(f"sync_batchnorm cannot convert model {model.name!r}: {err}") from None
