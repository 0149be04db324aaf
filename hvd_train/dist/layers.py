"""Synchronised BatchNormalization: batch moments over the global batch, not each rank's slice.

With small per-rank batches, each rank's BatchNorm normalises by the statistics of a few samples,
and training differs from one process with the global batch. This layer sums each channel's count,
sum and sum of squares over ranks (one grouped allreduce per layer per training step; its gradient
is the allreduce of the upstream gradients, Horovod's registered gradient) and normalises by the
global mean and variance, so N ranks with batch b train like one process with batch N*b. Inference
uses the moving statistics and runs no collective. Costs one small allreduce per BatchNorm layer
per step: use it where per-rank batches are small (detection, segmentation), not by default.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="hvd_train")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` whose training moments span all ranks."""

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None or hvd.size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype)
        local = [
            tf.reshape(count, [1]),
            tf.reduce_sum(inputs, axis=axes),
            tf.reduce_sum(tf.square(inputs), axis=axes),
        ]
        total, summed, squares = hvd.grouped_allreduce(local, op=hvd.Sum)
        mean = summed / total
        variance = tf.maximum(squares / total - tf.square(mean), 0.0)
        return mean, variance


def convert_sync_batchnorm(model: Any) -> Any:
    """A copy of a functional or Sequential model with every BatchNormalization synchronised
    (same configuration; weights are fresh, so convert before training or restoring).

    Raises:
      ValueError: a subclassed model (its layers cannot be rebuilt from configs).
    """

    def clone(layer: Any) -> Any:
        if type(layer) is keras.layers.BatchNormalization:
            return SyncBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    try:
        return keras.models.clone_model(model, clone_function=clone)
    except ValueError as err:  # Keras clones only functional and Sequential models
        raise ValueError(f"sync_batchnorm cannot convert model {model.name!r}: {err}") from None
