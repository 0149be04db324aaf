"""The gate: N ranks with per-rank batch b train exactly like one process with batch N*b.

Each rank also computes the one-process reference itself (plain Keras, no Horovod, the global
batches), so the comparison needs no file and no extra launch. A negative control shows the check is
sharp: training on the rank's own batches without averaging misses the reference by far more than
the tolerance.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from util import DIGITS_X, DIGITS_Y, LOSS, max_abs_diff, mlp, rank_seed, spread_over_ranks, weights

import hvd_train
from hvd_train import comm
from hvd_train.keras import compat
from hvd_train.keras.optimizer import allreduce_count

PER_RANK = 8
STEPS = 3
LR = 0.5
TOL = 1e-6
COMPRESSED_TOL = 5e-3  # fp16 keeps 11 bits of each averaged gradient, bf16 8


def fit(model, optimizer, x, y, batch, steps, distributed):
    model.compile(optimizer=optimizer, loss=LOSS)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    callbacks = [hvd_train.BroadcastInitialState()] if distributed else []
    model.fit(data, epochs=1, steps_per_epoch=steps, callbacks=callbacks, verbose=0, shuffle=False)
    return model


def rank_blocks(steps, passes=1):
    """This rank's samples: global batch u is blocks [u*k*N, (u+1)*k*N) of PER_RANK samples; in
    micro-step j of update u rank r reads block u*k*N + j*N + r."""
    n, r = comm.size(), comm.rank()
    ids = [
        np.arange(PER_RANK) + PER_RANK * (u * passes * n + j * n + r)
        for u in range(steps)
        for j in range(passes)
    ]
    return np.concatenate(ids)


def reference(optimizer, steps, passes=1, seed=0):
    """One process, no Horovod: `steps` updates with the global batch passes * N * PER_RANK."""
    global_batch = passes * comm.size() * PER_RANK
    ids = np.arange(steps * global_batch)
    return fit(mlp(seed), optimizer, DIGITS_X[ids], DIGITS_Y[ids], global_batch, steps, False)


CASES = {
    "sgd": (lambda: keras.optimizers.SGD(LR), {}),
    "sgd_momentum": (lambda: keras.optimizers.SGD(LR, momentum=0.9), {}),
    # Clipping acts on the averaged gradient, as in one process: per-rank clipping would differ.
    "sgd_global_clipnorm": (lambda: keras.optimizers.SGD(LR, global_clipnorm=0.5), {}),
    "predivide": (lambda: keras.optimizers.SGD(LR), {"gradient_predivide_factor": 2.0}),
    # One grouped allreduce per tensor (1-byte buckets), clipping after all of them.
    "buckets": (
        lambda: keras.optimizers.SGD(LR, momentum=0.9, global_clipnorm=0.5),
        {"bucket_mb": 2**-20},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_n_ranks_equal_one_process_with_global_batch(case):
    make_optimizer, options = CASES[case]
    ids = rank_blocks(STEPS)
    model = fit(
        mlp(rank_seed()),
        hvd_train.DistributedOptimizer(make_optimizer(), **options),
        DIGITS_X[ids],
        DIGITS_Y[ids],
        PER_RANK,
        STEPS,
        True,
    )
    got = weights(model)
    spread = spread_over_ranks(got)
    expected = weights(reference(make_optimizer(), STEPS))
    initial = weights(mlp(0))
    local = weights(
        fit(mlp(0), make_optimizer(), DIGITS_X[ids], DIGITS_Y[ids], PER_RANK, STEPS, False)
    )

    assert spread == 0.0, f"ranks disagree by {spread}"
    assert max_abs_diff(expected, initial) > 1e-2, "the reference barely moved: the check is blunt"
    assert max_abs_diff(got, expected) < TOL
    if comm.size() > 1:  # negative control: no averaging misses the reference by far
        assert max_abs_diff(local, expected) > 100 * TOL


@pytest.mark.skipif(comm.size() == 1, reason="one rank: Sum and Average are the same reduction")
def test_sum_op_equals_size_times_the_learning_rate():
    ids = rank_blocks(STEPS)
    model = fit(
        mlp(rank_seed()),
        hvd_train.DistributedOptimizer(keras.optimizers.SGD(LR / 4), op=hvd_train.Sum),
        DIGITS_X[ids],
        DIGITS_Y[ids],
        PER_RANK,
        STEPS,
        True,
    )
    got = weights(model)
    expected = weights(reference(keras.optimizers.SGD(LR / 4 * comm.size()), STEPS))
    averaged = weights(reference(keras.optimizers.SGD(LR / 4), STEPS))

    assert max_abs_diff(got, expected) < TOL
    assert max_abs_diff(got, averaged) > 100 * TOL  # negative control: it did not average


@pytest.mark.skipif(
    comm.size() == 1,
    reason="one rank: the gradient allreduce returns early, so compression never runs",
)
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_compression_stays_close(kind):
    compression = getattr(hvd_train.Compression, kind)
    ids = rank_blocks(STEPS)
    model = fit(
        mlp(rank_seed()),
        hvd_train.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compression),
        DIGITS_X[ids],
        DIGITS_Y[ids],
        PER_RANK,
        STEPS,
        True,
    )
    got = weights(model)
    spread = spread_over_ranks(got)
    # Negative control: the same compression with the average missing (the sum, N times it).
    summed = fit(
        mlp(rank_seed()),
        hvd_train.DistributedOptimizer(
            keras.optimizers.SGD(LR), op=hvd_train.Sum, compression=compression
        ),
        DIGITS_X[ids],
        DIGITS_Y[ids],
        PER_RANK,
        STEPS,
        True,
    )
    expected = weights(reference(keras.optimizers.SGD(LR), STEPS))

    assert spread == 0.0
    assert max_abs_diff(got, expected) < COMPRESSED_TOL
    # The rounding shows (an uncompressed allreduce stays within TOL): the compression ran.
    assert max_abs_diff(got, expected) > TOL
    assert max_abs_diff(weights(summed), expected) > COMPRESSED_TOL


@pytest.mark.parametrize("passes,bucket_mb", [(2, None), (3, None), (2, 2**-20)])
def test_backward_passes_accumulate_locally(passes, bucket_mb):
    updates = 2
    ids = rank_blocks(updates, passes)
    optimizer = hvd_train.DistributedOptimizer(
        keras.optimizers.SGD(LR), backward_passes_per_step=passes, bucket_mb=bucket_mb
    )
    model = fit(
        mlp(rank_seed()), optimizer, DIGITS_X[ids], DIGITS_Y[ids], PER_RANK, updates * passes, True
    )
    got = weights(model)
    spread = spread_over_ranks(got)
    expected = weights(reference(keras.optimizers.SGD(LR), updates, passes))

    assert spread == 0.0
    assert max_abs_diff(got, expected) < TOL
    # Horovod's own optimizer (classic stack) counts batches in `iterations`, Keras 3's updates;
    # the learning-rate schedule counts updates on both (dist/classic.py).
    assert int(optimizer.iterations.numpy()) == updates * (passes if compat.CLASSIC else 1)
    # One allreduce per update, not per batch: the k passes were summed locally.
    assert allreduce_count(optimizer) == (updates if comm.size() > 1 else 0)
