"""models.layers.FusedBatchNormalization: Keras 3's BatchNormalization on TensorFlow's fused kernel.

It must be Keras's layer in everything but speed: outputs, the gradients of the input, gamma and
beta, the moving statistics (Keras averages the batch variance, the kernel returns the sample
variance) and inference, checked against Keras's own layer and against NumPy's closed form.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import models
from hvd_train.keras.layers import convert_sync_batchnorm
from models.layers import FUSED_KERNEL, FusedBatchNormalization, with_fused_batchnorm

pytestmark = pytest.mark.skipif(not FUSED_KERNEL, reason="Keras 2: its own layer is fused")
TOL = 1e-5
MOMENTUM = 0.9


def pair(**kwargs):
    options = {"momentum": MOMENTUM, "epsilon": 1e-5, **kwargs}
    plain, fused = keras.layers.BatchNormalization(**options), FusedBatchNormalization(**options)
    return plain, fused


def run(layer, x, training):
    x = tf.constant(x)
    weights = [
        w for w in (getattr(layer, "gamma", None), getattr(layer, "beta", None)) if w is not None
    ]
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        # A weighted sum: the gradient of a plain sum through BatchNorm is zero.
        loss = tf.reduce_sum(y * tf.range(1.0, y.shape[-1] + 1.0))
    grads = tape.gradient(loss, [x, *weights])
    return [np.array(y), *(np.array(g) for g in grads)]


def rel_diff(a, b, scale=1.0):
    """Largest |a - b| against the largest |b|, or `scale` where larger (a sum of many terms,
    whose rounding follows their size, not the sum's: gamma's gradient is 0 in exact arithmetic)."""
    return float(np.max(np.abs(a - b)) / max(scale, float(np.max(np.abs(b)))))


@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("training", [True, False])
def test_matches_keras_outputs_gradients_and_moving_statistics(center, scale, training):
    x = np.random.default_rng(0).standard_normal((4, 5, 3, 6)).astype("float32") * 3 + 1
    plain, fused = pair(center=center, scale=scale)
    for layer in (plain, fused):
        layer.build(x.shape)
        layer.moving_variance.assign(np.full(6, 2.0, "float32"))
    got, expected = run(fused, x, training), run(plain, x, training)

    assert len(got) == len(expected) == 1 + 1 + center + scale
    y, dx, *weights = zip(got, expected, strict=True)
    assert rel_diff(*y) < TOL and rel_diff(*dx) < TOL
    # Gamma's and beta's gradients sum 120 terms per channel, each up to 6 (the loss's weight)
    # times a normalized value.
    terms = x.size // x.shape[-1] * 6
    for g, e in weights:
        assert rel_diff(g, e, scale=terms) < TOL
    assert rel_diff(np.array(fused.moving_mean), np.array(plain.moving_mean)) < TOL
    assert rel_diff(np.array(fused.moving_variance), np.array(plain.moving_variance)) < TOL


def test_moving_variance_is_the_batch_variance_as_in_keras():
    x = np.random.default_rng(1).standard_normal((2, 2, 2, 3)).astype("float32")
    _, fused = pair()
    fused.build(x.shape)
    fused(tf.constant(x), training=True)
    batch = x.reshape(-1, 3).var(axis=0)  # ddof=0: over the 8 values of each channel
    expected = MOMENTUM * 1.0 + (1 - MOMENTUM) * batch
    sample = MOMENTUM * 1.0 + (1 - MOMENTUM) * x.reshape(-1, 3).var(axis=0, ddof=1)

    assert rel_diff(np.array(fused.moving_variance), expected) < TOL
    # Negative control: the kernel's own (sample) variance misses the same tolerance.
    assert rel_diff(sample, expected) > 100 * TOL


def test_mixed_float16_keeps_float32_statistics():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain, fused = pair()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    x = np.random.default_rng(2).standard_normal((4, 3, 3, 5)).astype("float16")
    y_fused, y_plain = fused(x, training=True), plain(x, training=True)

    assert y_fused.dtype == y_plain.dtype == tf.float16
    assert fused.moving_mean.dtype == "float32"
    assert rel_diff(np.array(y_fused, "float32"), np.array(y_plain, "float32")) < 2e-3


def test_other_inputs_take_keras_path():
    x = np.random.default_rng(3).standard_normal((6, 4)).astype("float32")  # 2-D: not fusable
    plain, fused = pair()
    assert not fused._fusable(tf.constant(x), None)
    assert rel_diff(run(fused, x, True)[0], run(plain, x, True)[0]) == 0.0


def test_the_zoo_uses_it_and_it_round_trips(tmp_path):
    model = models.build("resnet20", (16, 16, 3), 10)
    kinds = {type(layer) for layer in model.layers if "BatchNormalization" in type(layer).__name__}
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)

    assert kinds == {FusedBatchNormalization}
    assert {type(layer) for layer in loaded.layers} >= {FusedBatchNormalization}
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_application_models_are_converted_and_sync_batchnorm_converts_them():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3)(inputs)
    x = keras.layers.BatchNormalization()(x)
    model = with_fused_batchnorm(keras.Model(inputs, x))
    sync = convert_sync_batchnorm(model)

    assert [type(layer).__name__ for layer in model.layers][-1] == "FusedBatchNormalization"
    assert [type(layer).__name__ for layer in sync.layers][-1] == "SyncBatchNormalization"
