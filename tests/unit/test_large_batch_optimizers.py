"""The large-batch optimizers (hvd_train.keras.large_batch) against NumPy closed forms, one process.

Stack-neutral: runs under either venv (`.venv-classic/bin/python -m pytest` this file for Keras 2).
Each closed-form check has a negative control: the closed form without the part under test (the
trust ratio, the exclusion of biases and normalization parameters) misses the result by far more
than the tolerance.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hvd_train.keras import large_batch

TOL = 1e-6


def model_and_grads(seed=0):
    """A Dense kernel (rank 2) and bias, and BatchNorm's gamma and beta, with fixed gradients."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization()]
    )
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    grads = [
        [rng.standard_normal(v.shape).astype("float32") for v in model.trainable_variables]
        for _ in range(2)
    ]
    return model, grads


def run(optimizer, model, grads):
    variables = model.trainable_variables
    for step in grads:
        optimizer.apply_gradients(zip([tf.constant(g) for g in step], variables, strict=True))
    return [v.numpy() for v in variables]


def numpy_lars(weights, grads, lr, momentum, eta, wd, adapt=True):
    out = []
    for i, w in enumerate(weights):
        w, v = w.astype("float64"), np.zeros_like(w, "float64")
        for step in grads:
            g = step[i].astype("float64")
            if adapt and w.ndim > 1:
                w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
                ratio = eta * w_norm / (g_norm + wd * w_norm)
                v = momentum * v + lr * ratio * (g + wd * w)
            else:
                v = momentum * v + lr * g
            w = w - v
        out.append(w)
    return out


def numpy_lamb(weights, grads, lr, b1, b2, eps, wd, exclude=True):
    out = []
    for i, w in enumerate(weights):
        w, m, v = w.astype("float64"), np.zeros_like(w, "float64"), np.zeros_like(w, "float64")
        for t, step in enumerate(grads, start=1):
            g = step[i].astype("float64")
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
            if w.ndim > 1 or not exclude:
                r = r + wd * w
                r = r * np.linalg.norm(w) / np.linalg.norm(r)
            w = w - lr * r
        out.append(w)
    return out


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def test_lars_two_steps_match_the_closed_form():
    model, grads = model_and_grads()
    initial = [v.numpy() for v in model.trainable_variables]
    args = {"lr": 0.5, "momentum": 0.9, "eta": 0.02, "wd": 0.01}
    got = run(
        large_batch.Lars(0.5, momentum=0.9, trust_coefficient=0.02, weight_decay=0.01),
        model,
        grads,
    )
    expected = numpy_lars(initial, grads, **args)
    # Negative control: without the trust ratio (plain momentum SGD everywhere) it is far off.
    plain = numpy_lars(initial, grads, **args, adapt=False)

    assert max_diff(got, expected) < TOL
    assert max_diff(got, plain) > 1e3 * TOL
    # Biases and BatchNorm's gamma and beta moved as momentum SGD: neither adapted nor decayed.
    assert max_diff(got[1:], plain[1:]) < TOL
    assert max_diff(got[:1], plain[:1]) > 1e3 * TOL


def test_lamb_two_steps_match_the_closed_form():
    model, grads = model_and_grads(1)
    initial = [v.numpy() for v in model.trainable_variables]
    got = run(large_batch.Lamb(0.01, weight_decay=0.1), model, grads)
    expected = numpy_lamb(initial, grads, 0.01, 0.9, 0.999, 1e-6, 0.1)
    # Negative control: the trust ratio and weight decay on every tensor, biases included.
    everywhere = numpy_lamb(initial, grads, 0.01, 0.9, 0.999, 1e-6, 0.1, exclude=False)

    assert max_diff(got, expected) < TOL
    assert max_diff(got[:1], everywhere[:1]) < TOL
    assert max_diff(got[1:], everywhere[1:]) > 1e3 * TOL


@pytest.mark.parametrize("name", ["AdamW", "Lion"])
def test_weight_decay_skips_biases_and_normalization(name):
    model, _ = model_and_grads(2)
    initial = [v.numpy() for v in model.trainable_variables]
    zeros = [[np.zeros_like(w) for w in initial]]  # no gradient step: only the decay moves weights
    lr, wd = 0.1, 0.5
    got = run(getattr(large_batch, name)(lr, weight_decay=wd), model, zeros)
    # Negative control: Keras's own optimizer decays every tensor, biases and BatchNorm's included.
    model, _ = model_and_grads(2)
    keras_own = run(getattr(keras.optimizers, name)(lr, weight_decay=wd), model, zeros)

    assert max_diff(got[:1], [initial[0] * (1 - lr * wd)]) < TOL
    assert max_diff(got[1:], initial[1:]) == 0.0
    assert max_diff(keras_own[1:], [w * (1 - lr * wd) for w in initial[1:]]) < TOL


def test_zero_weights_take_the_plain_step():
    kernel = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, use_bias=False)])
    kernel.trainable_variables[0].assign(np.zeros((2, 2), "float32"))
    grad = np.full((2, 2), 0.5, "float32")
    got = run(large_batch.Lars(0.1, momentum=0.0, trust_coefficient=0.01), kernel, [[grad]])
    # ||w|| = 0: the trust ratio falls back to 1 (as in the MLPerf reference): the step is lr * g.
    np.testing.assert_allclose(got[0], -0.1 * grad, atol=TOL)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (large_batch.Lars, {"momentum": 0.8, "trust_coefficient": 0.01, "weight_decay": 1e-4}),
        (large_batch.Lamb, {"beta_1": 0.8, "weight_decay": 0.01}),
        (large_batch.AdamW, {"weight_decay": 0.01}),
        (large_batch.Lion, {"weight_decay": 0.01}),
    ],
)
def test_serialisation_round_trips(cls, kwargs):
    optimizer = cls(0.3, **kwargs)
    serialised = keras.optimizers.serialize(optimizer)
    restored = keras.optimizers.deserialize(serialised)

    assert type(restored) is cls
    assert restored.get_config() == optimizer.get_config()
    assert float(restored.get_config()["learning_rate"]) == pytest.approx(0.3)  # not the default
    for key, value in kwargs.items():
        assert restored.get_config()[key] == pytest.approx(value)
