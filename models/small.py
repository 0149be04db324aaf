"""Small models for the embedded data set (digits, 8x8x1) and for exact-equivalence tests.

Keras is imported inside the builders, so listing and checking model names needs no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from models import register

if TYPE_CHECKING:
    import keras


@register("mlp")
def build_mlp(
    input_shape: tuple[int, ...],
    num_classes: int,
    hidden: Sequence[int] = (64, 32),
    activation: str = "tanh",
) -> keras.Model:
    """Multi-layer perceptron returning logits, without BatchNorm or dropout.

    A step is then a pure function of the weights and the batch: what the equivalence tests need.
    """
    import keras

    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    for i, width in enumerate(hidden):
        x = keras.layers.Dense(width, activation=activation, name=f"dense_{i}")(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")


@register("cnn")
def build_cnn(
    input_shape: tuple[int, ...],
    num_classes: int,
    filters: Sequence[int] = (32, 64),
    dense: int = 128,
    dropout: float = 0.25,
) -> keras.Model:
    """LeNet-style CNN: 3x3 conv blocks, the first followed by max-pooling, then a dense layer."""
    import keras

    inputs = keras.Input(input_shape)
    x = inputs
    for i, width in enumerate(filters):
        x = keras.layers.Conv2D(width, 3, padding="same", activation="relu", name=f"conv_{i}")(x)
        if i == 0:
            x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(dense, activation="relu", name="dense")(x)
    x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="cnn")
