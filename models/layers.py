"""Keras layers the zoo needs and Keras lacks. This module imports Keras: builders import it
inside themselves, never `models/__init__.py`, so listing the models still needs no TensorFlow.

Both layers are registered as Keras serializables, so `model.save` / `keras.saving.load_model`
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
