"""The model registry; parameter counts pinned, and one training step runs."""

import numpy as np
import pytest

import models


def test_registry_lists_and_rejects_unknown_names():
    assert {"mlp", "cnn"} <= set(models.names())
    with pytest.raises(KeyError, match="unknown model 'resnet9000'; known: "):
        models.build("resnet9000", (8, 8, 1), 10)
    with pytest.raises(ValueError, match="already registered"):
        models.register("mlp")(lambda *a: None)


@pytest.mark.parametrize(
    ("name", "input_shape", "params"),
    [
        # 64*64+64 + 64*32+32 + 32*10+10
        ("mlp", (64,), 6570),
        # conv 1->32: 320; conv 32->64: 18496; dense 4*4*64->128: 131200; logits: 1290
        ("cnn", (8, 8, 1), 151306),
    ],
)
def test_parameter_count_and_one_step(name, input_shape, params):
    import keras

    model = models.build(name, input_shape, 10)
    assert model.count_params() == params
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    x = np.random.default_rng(0).random((4, *input_shape), dtype=np.float32)
    loss = model.train_on_batch(x, np.arange(4) % 10)
    assert np.isfinite(loss)
