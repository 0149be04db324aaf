"""Equivalence beyond the plain MLP: synchronised BatchNorm, mixed precision, sparse gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_equivalence import PER_RANK, STEPS, rank_blocks
from util import DIGITS_X, DIGITS_Y, LOSS, max_abs_diff, mlp, rank_seed, spread_over_ranks, weights

import hvd_train
from hvd_train import comm
from hvd_train.keras.layers import convert_sync_batchnorm


def fit(model, optimizer, x, y, batch, steps, distributed):
    model.compile(optimizer=optimizer, loss=LOSS)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    callbacks = hvd_train.distributed_callbacks()[:1] if distributed else []
    model.fit(data, epochs=1, steps_per_epoch=steps, callbacks=callbacks, verbose=0, shuffle=False)
    return model


def distributed(model, x, y, lr):
    """STEPS updates on this rank's blocks of (x, y), gradients averaged over ranks."""
    ids = rank_blocks(STEPS)
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(lr))
    return fit(model, optimizer, x[ids], y[ids], PER_RANK, STEPS, True)


def one_process(model, x, y, lr):
    """The reference: STEPS updates of one process with the global batch, no Horovod."""
    ids = np.arange(STEPS * comm.size() * PER_RANK)
    return fit(
        model, keras.optimizers.SGD(lr), x[ids], y[ids], comm.size() * PER_RANK, STEPS, False
    )


def bn_mlp(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    x = keras.layers.Dense(32)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.5)(x)
    x = keras.layers.Activation("tanh")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def test_sync_batchnorm_trains_like_one_process_with_the_global_batch():
    n = comm.size()
    initial = bn_mlp(0).get_weights()
    sync = convert_sync_batchnorm(bn_mlp(rank_seed()))
    sync.set_weights(initial)
    sync = distributed(sync, DIGITS_X, DIGITS_Y, 0.5)
    plain = distributed(bn_mlp(0), DIGITS_X, DIGITS_Y, 0.5)
    reference = one_process(bn_mlp(0), DIGITS_X, DIGITS_Y, 0.5)
    got, expected = weights(sync), weights(reference)  # includes the moving statistics
    spread = spread_over_ranks(got)

    assert any(type(layer).__name__ == "SyncBatchNormalization" for layer in sync.layers)
    assert spread == 0.0
    assert max_abs_diff(got, expected) < 1e-5
    if n > 1:  # per-rank BatchNorm normalises by each slice's moments: visibly different
        assert max_abs_diff(weights(plain), expected) > 1e-3


def local_only(model, x, y, lr):
    """A negative control: STEPS updates on this rank's blocks of (x, y), nothing averaged."""
    ids = rank_blocks(STEPS)
    return fit(model, keras.optimizers.SGD(lr), x[ids], y[ids], PER_RANK, STEPS, False)


@pytest.mark.parametrize(("policy", "tolerance"), [("mixed_float16", 2e-3)])
def test_mixed_precision_trains_like_one_process_with_the_global_batch(policy, tolerance):
    keras.mixed_precision.set_global_policy(policy)
    try:
        model = distributed(mlp(rank_seed()), DIGITS_X, DIGITS_Y, 0.5)
        reference = one_process(mlp(0), DIGITS_X, DIGITS_Y, 0.5)
        local = local_only(mlp(0), DIGITS_X, DIGITS_Y, 0.5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    got, expected = weights(model), weights(reference)
    spread = spread_over_ranks(got)

    assert spread == 0.0
    assert {layer.compute_dtype for layer in model.layers[1:]} == {"float16"}
    # float16 activations and gradients keep ~3 significant digits; the weights stay float32.
    assert max_abs_diff(got, expected) < tolerance
    assert max_abs_diff(got, weights(mlp(0))) > 10 * tolerance  # and they did move
    if comm.size() > 1:  # the rank's own gradients, not averaged, fail the same tolerance
        assert max_abs_diff(weights(local), expected) > tolerance


def embedding_model(seed):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(40, 8)(inputs)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def test_sparse_embedding_gradients_are_averaged():
    tokens = (DIGITS_X[:, :6] * 16).astype("int32") + DIGITS_Y[:, None]  # ids in [0, 26)
    # The gradient fit's train step takes of this model: the embedding's is sparse.
    probe = embedding_model(0)
    with tf.GradientTape() as tape:
        loss = LOSS(DIGITS_Y[:PER_RANK], probe(tokens[:PER_RANK]))
    gradients = tape.gradient(loss, probe.trainable_variables)
    model = distributed(embedding_model(rank_seed()), tokens, DIGITS_Y, 1.0)
    got = weights(model)
    spread = spread_over_ranks(got)
    expected = weights(one_process(embedding_model(0), tokens, DIGITS_Y, 1.0))
    local = weights(local_only(embedding_model(0), tokens, DIGITS_Y, 1.0))

    # Embedding table, then the dense kernel and bias.
    assert [isinstance(g, tf.IndexedSlices) for g in gradients] == [True, False, False]
    assert spread == 0.0
    assert max_abs_diff(got, expected) < 1e-6
    assert max_abs_diff(expected, weights(embedding_model(0))) > 1e-2
    if comm.size() > 1:  # negative control: the rank's own sparse gradients, not averaged
        assert max_abs_diff(local, expected) > 1e-2
