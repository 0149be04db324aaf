"""ImageNet architectures from Keras Applications, randomly initialized, returning logits.

`weights=None` (nothing is downloaded), the classifier sized to the data (`classes`), and no
softmax (`classifier_activation=None`): the trainer's loss takes logits. They need images of at
least 32x32 pixels (five stride-2 stages); any channel count works, as there are no pretrained
weights to match.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hvd_train.errors import UserError
from models import register

if TYPE_CHECKING:
    import keras

MIN_SIZE = 32


@register("resnet50")
def build_resnet50(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """ResNet-50 (He et al. 2016, ImageNet bottleneck version) from Keras Applications."""
    return _application("ResNet50", "resnet50", input_shape, num_classes)


@register("mobilenetv2")
def build_mobilenetv2(
    input_shape: tuple[int, ...], num_classes: int, alpha: float = 1.0
) -> keras.Model:
    """MobileNetV2 (Sandler et al. 2018) from Keras Applications; `alpha` scales the widths."""
    return _application("MobileNetV2", "mobilenetv2", input_shape, num_classes, alpha=alpha)


@register("efficientnetb0")
def build_efficientnetb0(input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """EfficientNet-B0 (Tan and Le 2019) from Keras Applications; expects pixels in [0, 255].

    The model divides its input by 255 itself (a Rescaling layer Keras builds in).
    """
    return _application("EfficientNetB0", "efficientnetb0", input_shape, num_classes)


def _application(
    constructor: str, name: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any
) -> keras.Model:
    if len(input_shape) != 3 or min(input_shape[:2]) < MIN_SIZE:
        raise UserError(
            f"{name}: needs images of at least {MIN_SIZE}x{MIN_SIZE} pixels, input_shape "
            f"(height, width, channels), got {tuple(input_shape)}"
        )
    import keras

    from models.layers import with_fused_batchnorm

    model = getattr(keras.applications, constructor)(
        include_top=True,
        weights=None,
        input_shape=tuple(input_shape),
        classes=num_classes,
        classifier_activation=None,
        **kwargs,
    )
    return with_fused_batchnorm(model)
