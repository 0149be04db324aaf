"""The CIFAR ResNets of He et al. 2016 ("Deep Residual Learning for Image Recognition", 4.2).

A 3x3 convolution with 16 filters, then 3 stages of n basic blocks (two 3x3 convolutions each)
with 16, 32 and 64 filters, the first block of stages 2 and 3 halving the feature map by stride 2;
global average pooling and a dense layer: 6n + 2 weighted layers (n = 3: ResNet-20, n = 9:
ResNet-56). Every convolution is followed by BatchNorm; ReLU after BatchNorm, and after the
residual addition.

Shortcuts are option A of the paper, as in its CIFAR experiments: the identity, and where a stage
starts, the input subsampled by 2 with its extra channels zero (`layers.ZeroPadShortcut`). They
add no parameters, so the counts are the paper's: 0.27M for ResNet-20 and 0.85M for ResNet-56.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hvd_train.errors import UserError
from models import register

if TYPE_CHECKING:
    import keras

STAGE_FILTERS = (16, 32, 64)


@register("resnet20")
def build_resnet20(
    input_shape: tuple[int, ...], num_classes: int, weight_decay: float = 1e-4
) -> keras.Model:
    """ResNet-20 for CIFAR (He et al. 2016): option A shortcuts, 0.27M parameters.

    `build_cifar_resnet` with depth 20; `weight_decay` is described there.
    """
    return build_cifar_resnet(input_shape, num_classes, depth=20, weight_decay=weight_decay)


@register("resnet56")
def build_resnet56(
    input_shape: tuple[int, ...], num_classes: int, weight_decay: float = 1e-4
) -> keras.Model:
    """ResNet-56 for CIFAR (He et al. 2016): option A shortcuts, 0.85M parameters.

    `build_cifar_resnet` with depth 56; `weight_decay` is described there.
    """
    return build_cifar_resnet(input_shape, num_classes, depth=56, weight_decay=weight_decay)


def build_cifar_resnet(
    input_shape: tuple[int, ...], num_classes: int, depth: int, weight_decay: float = 1e-4
) -> keras.Model:
    """A CIFAR ResNet of `depth` = 6n + 2 layers (20, 32, 44, 56, 110, ...), returning logits.

    Args:
      input_shape: (height, width, channels).
      num_classes: the logits.
      depth: 6n + 2 for n >= 1 blocks per stage.
      weight_decay: the paper's weight decay (1e-4), on every convolution and dense kernel; 0 for
        none. Applied as an L2 loss of weight_decay / 2 * sum(w^2), whose gradient adds
        weight_decay * w, as SGD's weight decay does in the paper.

    Raises:
      UserError: an input shape that is not (height, width, channels), a depth not 6n + 2, or a
        negative weight decay.
    """
    import keras

    if len(input_shape) != 3:
        raise UserError(f"resnet: input_shape must be (height, width, channels), got {input_shape}")
    if depth < 8 or (depth - 2) % 6:
        raise UserError(f"resnet: depth must be 6n + 2 with n >= 1 (20, 56, ...), got {depth}")
    if weight_decay < 0:
        raise UserError(f"resnet: weight_decay must be >= 0, got {weight_decay}")
    from models.layers import ZeroPadShortcut, batch_normalization

    blocks = (depth - 2) // 6
    regularizer = keras.regularizers.L2(weight_decay / 2) if weight_decay else None

    def conv(x: keras.KerasTensor, filters: int, stride: int, name: str) -> keras.KerasTensor:
        return keras.layers.Conv2D(
            filters,
            3,
            strides=stride,
            padding="same",
            use_bias=False,  # BatchNorm's beta is the bias
            kernel_initializer="he_normal",
            kernel_regularizer=regularizer,
            name=name,
        )(x)

    def batch_norm(x: keras.KerasTensor, name: str) -> keras.KerasTensor:
        # Torch's momentum and epsilon, as in the reference CIFAR ResNet implementations.
        return batch_normalization(momentum=0.9, epsilon=1e-5, name=name)(x)

    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.ReLU(name="relu")(batch_norm(conv(inputs, 16, 1, "conv"), "bn"))
    for stage, filters in enumerate(STAGE_FILTERS, start=1):
        for block in range(1, blocks + 1):
            name = f"stage{stage}_block{block}"
            stride = 2 if stage > 1 and block == 1 else 1
            y = batch_norm(conv(x, filters, stride, f"{name}_conv1"), f"{name}_bn1")
            y = keras.layers.ReLU(name=f"{name}_relu1")(y)
            y = batch_norm(conv(y, filters, 1, f"{name}_conv2"), f"{name}_bn2")
            shortcut = x
            if stride > 1 or x.shape[-1] != filters:
                shortcut = ZeroPadShortcut(filters, stride, name=f"{name}_shortcut")(x)
            x = keras.layers.Add(name=f"{name}_add")([y, shortcut])
            x = keras.layers.ReLU(name=f"{name}_relu2")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(
        num_classes, kernel_initializer="he_normal", kernel_regularizer=regularizer, name="logits"
    )(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")
