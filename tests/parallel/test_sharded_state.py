"""Sharded optimizer state (`DistributedOptimizer(opt, shard_state=True)`, keras/sharded.py) trains
exactly like the unsharded distributed optimizer, while each rank holds 1/N of the state.

Each test runs the same k steps on the same per-rank batches twice, sharded and unsharded, and
compares the weights; a negative control shows each comparison can fail (a run that differs in
the one thing the test is about misses by far more than the tolerance).
"""

import math
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from util import DIGITS_X, DIGITS_Y, LOSS, max_abs_diff, mlp, rank_seed, spread_over_ranks, weights

import hvd_train
from hvd_train import comm
from hvd_train.core import checkpoint
from hvd_train.keras import compat, large_batch, sharded
from hvd_train.keras import stop as stop_flags

pytestmark = pytest.mark.skipif(compat.CLASSIC, reason="shard_state: the modern stack only")

PER_RANK = 8
STEPS = 3
TOL = 1e-6


def rank_batches(steps):
    """This rank's samples: in step u, rank r reads block u*N + r of PER_RANK samples."""
    n, r = comm.size(), comm.rank()
    return np.concatenate([np.arange(PER_RANK) + PER_RANK * (u * n + r) for u in range(steps)])


def train(make_optimizer, shard_state, x=None, steps=STEPS):
    """`steps` updates of the digits MLP from rank 0's initial weights; returns the model."""
    ids = rank_batches(steps)
    x = DIGITS_X[ids] if x is None else x
    model = mlp(rank_seed())
    optimizer = hvd_train.DistributedOptimizer(make_optimizer(), shard_state=shard_state)
    model.compile(optimizer=optimizer, loss=LOSS)
    data = tf.data.Dataset.from_tensor_slices((x, DIGITS_Y[ids])).batch(PER_RANK)
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=steps,
        callbacks=[hvd_train.BroadcastInitialState()],
        verbose=0,
        shuffle=False,
    )
    return model


CASES = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: large_batch.AdamW(0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_updates_equal_the_unsharded_ones(case):
    got = weights(train(CASES[case], True))
    spread = spread_over_ranks(got)
    expected = weights(train(CASES[case], False))
    # Negative control: one update fewer (what losing any shard's update would look like).
    short = weights(train(CASES[case], False, steps=STEPS - 1))

    assert spread == 0.0, f"ranks disagree by {spread}"
    assert max_abs_diff(got, expected) < TOL
    assert max_abs_diff(short, expected) > 100 * TOL


def _op_types(graph):
    """The op type of every node of a traced graph and of the functions it calls."""
    types = [op.type for op in graph.get_operations()]
    for function in graph.as_graph_def().library.function:
        types += [node.op for node in function.node_def]
    return types


def test_the_update_gathers_by_the_buckets_of_its_reduce_scatter():
    """One grouped allgather per bucket, the buckets of the reduce-scatter, and no allgather per
    variable. Closed form: the MLP's 6 variables, last first, hold 40, 1280, 128, 8192, 256 and
    16384 bytes; buckets that close at >= 1000 bytes are 3 (a layer each)."""
    if comm.size() == 1:
        pytest.skip("one rank: the sharded update sends no collective")
    counts = {}
    for bucket_mb in (1000 / 2**20, None):
        model = mlp(0)
        optimizer = hvd_train.DistributedOptimizer(
            keras.optimizers.SGD(0.1), shard_state=True, bucket_mb=bucket_mb
        )
        model.compile(optimizer=optimizer, loss=LOSS)
        optimizer.build(model.trainable_variables)
        spec = (tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None], tf.int32))
        types = _op_types(tf.function(model.train_step).get_concrete_function(spec).graph)
        ops = ("HorovodGroupedReducescatter", "HorovodGroupedAllgather", "HorovodAllgather")
        counts[bucket_mb] = [types.count(op) for op in ops]
    assert counts[1000 / 2**20] == [3, 3, 0]
    assert counts[None] == [1, 1, 0]  # one host: one bucket


@pytest.mark.parametrize("clip", ["global_clipnorm", "clipnorm"])
def test_clipping_uses_the_norm_over_all_shards(clip):
    def make():
        return keras.optimizers.SGD(0.5, momentum=0.9, **{clip: 0.05})

    got = weights(train(make, True))
    expected = weights(train(make, False))
    unclipped = weights(train(lambda: keras.optimizers.SGD(0.5, momentum=0.9), False))

    assert max_abs_diff(got, expected) < TOL
    # Negative control: the threshold bites, so a norm over one shard only would clip otherwise.
    assert max_abs_diff(unclipped, expected) > 100 * TOL


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank():
    """mixed_float16: one rank's batch holds an inf at step 2; the global finite check makes
    every rank skip that update (no rank waits in a collective the others skipped: the launch
    runs under a timeout) and halve its loss scale alike."""
    ids = rank_batches(STEPS)
    x = DIGITS_X[ids].copy()
    if comm.rank() == comm.size() - 1:
        x[PER_RANK, 0] = np.inf  # the first sample of this rank's second batch
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = train(lambda: keras.optimizers.Adam(0.01), True, x)
        scales = comm.allgather_object(compat.loss_scale(model.optimizer))
        got = weights(model)
        expected = weights(train(lambda: keras.optimizers.Adam(0.01), False, x))
        finite = weights(train(lambda: keras.optimizers.Adam(0.01), False))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    spread = spread_over_ranks(got)

    assert spread == 0.0, f"ranks disagree by {spread}"
    assert len(set(scales)) == 1 and scales[0] < 32768.0, scales  # halved once, on every rank
    assert max_abs_diff(got, expected) < TOL
    # Negative control: without the inf no step is skipped, and the weights end elsewhere.
    assert max_abs_diff(finite, expected) > 100 * TOL


def test_each_rank_holds_its_share_of_the_optimizer_state():
    """Adam: two slots and the weight shard per variable, its elements cut as Horovod's
    reduce-scatter cuts them; the unsharded Adam holds two whole slots. The scalars (iterations,
    learning rate, counters) are the same few bytes either way."""
    model = train(CASES["adam"], True, steps=1)
    plain = train(CASES["adam"], False, steps=1)
    n, r = comm.size(), comm.rank()
    sizes = [math.prod(v.shape) for v in model.trainable_variables]
    mine = sum(3 * sharded.split_of(size, n, r)[1] for size in sizes)
    params = sum(sizes)
    scalars = sharded.state_bytes(model.optimizer) - tensor_bytes(model.optimizer.shard_variables)
    held = comm.allgather_object(tensor_bytes(model.optimizer.shard_variables))
    whole = sharded.state_bytes(plain.optimizer) - scalars

    assert held[r] == 4 * mine
    assert sum(held) == 4 * 3 * params  # the shards tile every variable exactly once
    # 1/N each, up to one element per variable and value kind.
    assert max(held) - min(held) <= 4 * 3 * len(sizes)
    assert whole == 4 * 2 * params
    # Negative control: with several ranks, a rank's share is smaller than the unsharded state.
    assert n == 1 or held[r] < whole


def tensor_bytes(variables):
    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


def test_the_stop_flag_rides_the_sharded_step():
    model = train(CASES["sgd_momentum"], True, steps=1)
    optimizer = model.optimizer
    if comm.rank() == comm.size() - 1:
        stop_flags.request_stop(optimizer)  # one rank asks: every rank must learn it in the step
    before = comm.allgather_object(stop_flags.stop_agreed(optimizer))
    ids = rank_batches(1)
    model.fit(DIGITS_X[ids], DIGITS_Y[ids], batch_size=PER_RANK, epochs=1, verbose=0)
    agreed = comm.allgather_object(stop_flags.stop_agreed(optimizer))

    assert all(agreed), agreed
    # Negative control: before the step only the asking rank knew (with several ranks).
    assert comm.size() == 1 or not all(before), before


@pytest.mark.parametrize(
    ("make", "options", "match"),
    [
        (lambda: large_batch.Lars(0.1), {}, "trust ratio"),
        (lambda: large_batch.Lamb(0.1), {}, "trust ratio"),
        (lambda: keras.optimizers.SGD(0.1), {"backward_passes_per_step": 2}, "backward_passes"),
        (lambda: keras.optimizers.Adafactor(0.1), {}, "shape"),
        (lambda: keras.optimizers.SGD(0.1, use_ema=True), {}, "use_ema"),
    ],
    ids=["lars", "lamb", "accumulation", "adafactor", "use_ema"],
)
def test_what_a_shard_cannot_do_is_refused(make, options, match):
    with pytest.raises(ValueError, match=match):
        hvd_train.DistributedOptimizer(make(), shard_state=True, **options)
    hvd_train.DistributedOptimizer(make(), **options)  # control: accepted unsharded


def peak_growth(action):
    """MiB by which this process's peak resident memory rose above its resident memory while
    `action` ran (Linux: writing 5 to /proc/self/clear_refs resets the peak)."""

    def status(key):
        line = next(
            x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key)
        )
        return int(line.split()[1]) / 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    action()
    return status("VmHWM:") - before


def test_a_checkpoint_gathers_and_writes_one_variable_at_a_time(tmp_path):
    """Adam on four 2048 x 2048 layers (16 MiB each): the whole state is 12 of them (two slots
    and the weight copy of each). Rank 0 writes each variable as it is gathered, so its peak grows
    by at most one variable's few copies (the allgather's output, its array, numpy's 16 MiB write
    buffer; 0-16 MiB measured after a first checkpoint), not by the state; the control gathers it
    all first and grows by most of it (memory the allocator kept from the first part counts as
    there before). The file holds what the control gathered."""
    layers = [keras.layers.Dense(2048, use_bias=False) for _ in range(4)]
    model = keras.Sequential([keras.Input((2048,)), *layers])
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_state=True)
    optimizer.build(model.trainable_variables)
    variable_mib = 2048 * 2048 * 4 / 2**20
    state_mib = 12 * variable_mib

    def streamed(name="streamed"):
        stream = sharded.gather_stream(optimizer)
        if comm.is_chief():
            checkpoint.write(tmp_path / name, 0, [], stream, {})
        for _ in stream:  # the other ranks' part of each gather
            pass

    # A first checkpoint, unmeasured: what the first gather allocates once for the job (Horovod's
    # fusion buffer, TensorFlow's kernels) is not a checkpoint's cost (128 MiB on rank 0 when
    # measured first, as a test run alone does).
    streamed("first")

    whole = []

    def gathered_first():
        whole.append(sharded.gather_whole(optimizer))
        if comm.is_chief():
            checkpoint.write(tmp_path / "whole", 0, [], whole[0], {})

    grew_streamed = peak_growth(streamed)
    grew_whole = peak_growth(gathered_first)
    grew = f"{grew_streamed:.0f} MiB streamed, {grew_whole:.0f} MiB gathered first"
    print(f"rank {comm.rank()}: peak grew {grew}")
    assert grew_streamed < 4 * variable_mib
    if comm.is_chief():
        # The control: the measurement sees most of a whole state (144-176 MiB measured).
        assert grew_whole > 0.5 * state_mib
        saved = checkpoint.load(tmp_path / "streamed" / "epoch-0000").optimizer
        assert [a.tobytes() for a in saved] == [a.tobytes() for a in whole[0]]
