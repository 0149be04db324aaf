"""The rules around the allreduce: initial state, learning rate, mixed precision, XLA, sharding."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from util import (
    DIGITS_X,
    DIGITS_Y,
    LOSS,
    max_abs_diff,
    mlp,
    rank_seed,
    spread_over_ranks,
    weights,
)

import hvd_train
from hvd_train import comm, data
from hvd_train.keras import compat
from hvd_train.keras.state import broadcast_model_state

PER_RANK = 8


def fit(model, data_set, steps, callbacks=(), epochs=1):
    model.fit(
        data_set,
        epochs=epochs,
        steps_per_epoch=steps,
        callbacks=[hvd_train.BroadcastInitialState(), *callbacks],
        verbose=0,
        shuffle=False,
    )


def test_initial_weights_and_optimizer_state_come_from_rank_0():
    model = mlp(rank_seed())
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=optimizer, loss=LOSS)
    optimizer.build(model.trainable_variables)
    for slot in compat.optimizer_variables(optimizer):  # rank-specific state, e.g. momentum
        if slot.dtype == "float32":
            slot.assign(tf.fill(slot.shape, float(comm.rank() + 1)))
    before = spread_over_ranks(weights(model))
    broadcast_model_state(model)
    state = weights(model) + [v.numpy() for v in compat.optimizer_variables(optimizer)]
    spread = spread_over_ranks(state)
    slots = [v.numpy() for v in compat.optimizer_variables(optimizer) if v.dtype == "float32"]

    if comm.size() > 1:
        assert before > 0.0, "ranks started equal: the test would not see a missing broadcast"
    assert spread == 0.0
    assert all(np.all(s == 1.0) for s in slots)  # rank 0's values


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_learning_rate_follows_the_formula_at_every_step(rule):
    n, steps, epochs, warmup_epochs, base_lr = comm.size(), 4, 3, 2, 0.01
    schedule = hvd_train.scaled_warmup_schedule(
        base_lr=base_lr,
        base_batch_size=PER_RANK,
        global_batch_size=PER_RANK * n,
        updates_per_epoch=steps,
        warmup_epochs=warmup_epochs,
        rule=rule,
    )
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(compat.learning_rate(self.model.optimizer))

    model = mlp(rank_seed())
    model.compile(
        optimizer=hvd_train.DistributedOptimizer(keras.optimizers.SGD(schedule)), loss=LOSS
    )
    train, per_epoch = data.shard_dataset(
        (DIGITS_X[: steps * PER_RANK * n], DIGITS_Y[: steps * PER_RANK * n]),
        PER_RANK,
        comm.rank(),
        n,
    )
    fit(model, train, per_epoch, [Record()], epochs=epochs)

    peak = base_lr * (n if rule == "linear" else np.sqrt(n))
    warmup = warmup_epochs * steps
    expected = [base_lr + (peak - base_lr) * min(s, warmup) / warmup for s in range(steps * epochs)]
    assert per_epoch == steps
    assert np.allclose(seen, expected, rtol=1e-6, atol=0)


def test_mixed_float16_inf_on_one_rank_skips_the_update_on_all():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp(rank_seed())
        # Made after the policy is set: the optimizer wraps the loss scaling, allreduce outside.
        optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=optimizer, loss=LOSS)
        x = DIGITS_X[: 2 * PER_RANK].copy()
        if comm.rank() == comm.size() - 1:
            x[0] = np.inf  # the last rank's gradients are non-finite, the others' are fine
        data_set = tf.data.Dataset.from_tensor_slices((x, DIGITS_Y[: 2 * PER_RANK])).batch(PER_RANK)
        broadcast_model_state(model)
        initial = weights(model)
        scale_before = compat.loss_scale(optimizer)
        fit(model, data_set.take(1), 1)
        after_overflow = weights(model)
        scale_after = compat.loss_scale(optimizer)
        spread = spread_over_ranks([*after_overflow, np.array(scale_after)])
        # The next, finite step on every rank updates all ranks alike.
        clean = tf.data.Dataset.from_tensor_slices(
            (DIGITS_X[: 2 * PER_RANK], DIGITS_Y[: 2 * PER_RANK])
        ).batch(PER_RANK)
        fit(model, clean.take(1), 1)
        after_clean = weights(model)
        spread_clean = spread_over_ranks(after_clean)
    finally:
        keras.mixed_precision.set_global_policy("float32")

    assert isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)
    assert spread == 0.0 and spread_clean == 0.0
    if comm.size() > 1:
        assert all(np.array_equal(a, b) for a, b in zip(initial, after_overflow, strict=True))
        assert scale_after == scale_before / 2
    assert any(not np.array_equal(a, b) for a, b in zip(after_overflow, after_clean, strict=True))


@pytest.mark.skipif(
    compat.CLASSIC,
    reason="Keras 2's LossScaleOptimizer computes gradients through the inner optimizer, where "
    "Horovod allreduces, before its finite check: wrapping it around is the right order there",
)
def test_loss_scaling_wrapped_around_the_distributed_optimizer_is_refused():
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp(rank_seed())
        model.compile(optimizer=optimizer, loss=LOSS)  # Keras wraps it: the allreduce is inside
    finally:
        keras.mixed_precision.set_global_policy("float32")
    data_set = tf.data.Dataset.from_tensor_slices((DIGITS_X[:8], DIGITS_Y[:8])).batch(8)
    with pytest.raises(ValueError, match="LossScaleOptimizer wraps the distributed optimizer"):
        fit(model, data_set, 1)


@pytest.mark.skipif(
    not compat.CLASSIC,
    reason="a classic-only limit: the modern optimizer accumulates before its loss-scale check",
)
def test_classic_refuses_accumulation_under_mixed_float16():
    # Keras 2's loss-scale check would see each rank's un-averaged accumulation between allreduces.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="backward_passes_per_step > 1 with mixed_float16"):
            hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_an_optimizer_that_is_not_distributed_is_refused():
    model = mlp(rank_seed())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    data_set = tf.data.Dataset.from_tensor_slices((DIGITS_X[:8], DIGITS_Y[:8])).batch(8)
    if comm.size() == 1:  # nothing to average with one worker: it trains
        initial = weights(model)
        fit(model, data_set, 1)
        assert int(model.optimizer.iterations.numpy()) == 1
        assert max_abs_diff(weights(model), initial) > 1e-3
    else:
        with pytest.raises(ValueError, match="is not distributed"):
            fit(model, data_set, 1)


def test_jit_compile_is_kept_off_the_distributed_train_step_and_on_evaluation():
    model = mlp(rank_seed())
    model.compile(
        optimizer=hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1)),
        loss=LOSS,
        jit_compile=True,
    )
    data_set = tf.data.Dataset.from_tensor_slices((DIGITS_X[:16], DIGITS_Y[:16])).batch(8)
    fit(model, data_set, 2)  # with XLA on, tracing Horovod's op would fail: it has no XLA kernel
    got = weights(model)
    spread = spread_over_ranks(got)
    model.evaluate(data_set, verbose=0)  # compiled with XLA: no collective in it
    # Every rank trained on the same 16 samples: the average of equal gradients is each one.
    reference = mlp(0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    reference.fit(data_set, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)

    assert model.jit_compile is True
    assert spread == 0.0
    assert max_abs_diff(got, weights(reference)) < 1e-6
    assert max_abs_diff(got, weights(mlp(0))) > 1e-3


@pytest.mark.parametrize("num_samples", [1797, 96])
def test_shards_are_disjoint_cover_the_data_and_give_equal_steps(num_samples):
    n, r = comm.size(), comm.rank()
    per_epoch = []
    for epoch in range(3):
        ids = data.shard_indices(num_samples, r, n, epoch, seed=7)
        per_epoch.append(comm.allgather_object(ids.tolist()))
    _, steps = data.shard_dataset((np.arange(num_samples),), 4, r, n, seed=7)
    all_steps = comm.allgather_object(steps)

    for shards in per_epoch:
        union = np.concatenate(shards)
        assert len(union) == num_samples and len(np.unique(union)) == num_samples
    assert per_epoch[0] != per_epoch[1]  # reshuffled every epoch
    assert len(set(all_steps)) == 1 and all_steps[0] == (num_samples // n) // 4
