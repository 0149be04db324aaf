"""Keras layers the zoo needs and Keras lacks. This module imports Keras: builders import it
inside themselves, never `models/__init__.py`, so listing the models still needs no TensorFlow.

The layers are registered as Keras serializables, so `model.save` / `keras.saving.load_model`
round-trip the models that use them.
"""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="hvd_train")
class ZeroPadShortcut(keras.layers.Layer):
    """Option A shortcut of He et al. 2016: subsample by `stride`, then append zero channels.

    Args:
      filters: the output channels (at least the input's).
      stride: the spatial subsampling (1: none), matching the block's strided 3x3 convolution.
    """

    def __init__(self, filters: int, stride: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = filters
        self.stride = stride

    def call(self, inputs: Any) -> Any:
        # TensorFlow's own ops: the toolkit's backend on both stacks (Keras 2 has no keras.ops).
        import tensorflow as tf

        x = inputs[:, :: self.stride, :: self.stride, :]
        extra = self.filters - x.shape[-1]
        return tf.pad(x, [[0, 0], [0, 0], [0, 0], [0, extra]])

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "filters": self.filters, "stride": self.stride}


@keras.saving.register_keras_serializable(package="hvd_train")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a (batch, length, dim) input (fixed length).

    Args:
      initializer: of the (length, dim) table; "uniform", as `keras.layers.Embedding`.
    """

    def __init__(self, initializer: str = "uniform", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.initializer = initializer

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.embeddings = self.add_weight(
            shape=tuple(input_shape[-2:]), initializer=self.initializer, name="embeddings"
        )

    def call(self, inputs: Any) -> Any:
        return inputs + self.embeddings

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "initializer": self.initializer}


# Keras 3 on TensorFlow: its BatchNormalization runs unfused (Keras 2's runs the fused kernel).
FUSED_KERNEL = int(keras.__version__.split(".")[0]) >= 3 and keras.backend.backend() == "tensorflow"


@keras.saving.register_keras_serializable(package="hvd_train")
class FusedBatchNormalization(keras.layers.BatchNormalization):
    """Keras 3's BatchNormalization computed by TensorFlow's fused kernel: the same variables,
    configuration, outputs and moving statistics, one op forward and one backward.

    Keras 3's layer has no `fused` option: on the TensorFlow backend it normalises with separate
    moments and elementwise ops, and on a CPU that costs several times the fused kernel Keras 2
    used (docs/performance.md has the measurements). Where the kernel does not apply (not Keras 3 on
    TensorFlow, not a 4-D channels-last input, a mask, renorm, synchronized) it is Keras's layer.
    """

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if not self._fusable(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        import tensorflow as tf

        # As Keras's layer: float32 inside (float16 or bfloat16 statistics overflow).
        x = tf.cast(inputs, "float32")
        channels = x.shape[-1]
        gamma = tf.cast(self.gamma, "float32") if self.scale else tf.ones([channels])
        beta = tf.cast(self.beta, "float32") if self.center else tf.zeros([channels])
        if training and self.trainable:
            # The raw op: tf.nn's wrapper raises epsilon to cuDNN's minimum, Keras does not.
            y, mean, unbiased, *_ = tf.raw_ops.FusedBatchNormV3(
                x=x,
                scale=gamma,
                offset=beta,
                mean=tf.zeros([0]),
                variance=tf.zeros([0]),
                epsilon=self.epsilon,
                data_format="NHWC",
                is_training=True,
            )
            # The kernel returns the sample variance; Keras's moving average takes the batch's.
            count = tf.cast(tf.size(x) // channels, "float32")
            variance = unbiased * (count - 1.0) / count
            momentum = self.momentum
            self.moving_mean.assign(self.moving_mean * momentum + mean * (1.0 - momentum))
            self.moving_variance.assign(
                self.moving_variance * momentum + variance * (1.0 - momentum)
            )
        else:
            y, *_ = tf.raw_ops.FusedBatchNormV3(
                x=x,
                scale=gamma,
                offset=beta,
                mean=tf.cast(self.moving_mean, "float32"),
                variance=tf.cast(self.moving_variance, "float32"),
                epsilon=self.epsilon,
                data_format="NHWC",
                is_training=False,
            )
        return tf.cast(y, self.compute_dtype)

    def _fusable(self, inputs: Any, mask: Any) -> bool:
        return (
            FUSED_KERNEL
            and mask is None
            and not self.renorm
            and not self.synchronized
            and len(inputs.shape) == 4
            and self.axis in (3, -1)
        )


def batch_normalization(**kwargs: Any) -> keras.layers.Layer:
    """The zoo's BatchNormalization: fused on Keras 3 with TensorFlow (Keras 2's own is fused)."""
    return (FusedBatchNormalization if FUSED_KERNEL else keras.layers.BatchNormalization)(**kwargs)


def with_fused_batchnorm(model: keras.Model) -> keras.Model:
    """A functional model with each plain BatchNormalization fused (fresh weights); the model
    itself where nothing changes (Keras 2, or no BatchNormalization)."""
    if not FUSED_KERNEL or not any(
        type(layer) is keras.layers.BatchNormalization for layer in model.layers
    ):
        return model

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if type(layer) is keras.layers.BatchNormalization:
            return FusedBatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    return keras.models.clone_model(model, clone_function=clone)
