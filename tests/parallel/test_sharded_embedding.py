"""Model-parallel embeddings (`hvd_train.ShardedEmbedding`, keras/embedding.py): N ranks, each
holding 1/N of the table's rows, train like one process holding the whole table on the global
batch; the table is gathered whole and put back at any worker count.

The reference runs on every rank: a one-process model (`shards=1`, no collective) on the batch of
all ranks together, its table's gradient dense. A negative control shows the comparison can fail:
the same reference with the table's gradient N times larger, what the distributed step would give
without its division by N.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from util import max_abs_diff, rank_seed

import hvd_train
from hvd_train import comm
from hvd_train.keras import compat, embedding
from hvd_train.keras import optimizer as optimizer_lib
from hvd_train.keras.state import weights_digest

pytestmark = pytest.mark.skipif(compat.CLASSIC, reason="ShardedEmbedding: the modern stack only")

ROWS = 101  # not a multiple of 2 or 3: the shards differ in length
DIM = 6
FIELDS = 3
DENSE = 4
PER_RANK = 8
STEPS = 4
TOL = 1e-5


def clicks(samples, seed=0):
    """Packed samples (DENSE floats, then FIELDS ids drawn Zipf-skewed over ROWS) and labels."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.3, size=(samples, FIELDS)) - 1) % ROWS
    dense = rng.normal(size=(samples, DENSE))
    labels = ((ids[:, 0] % 3 == 0) ^ (dense[:, 0] > 0)).astype("float32")
    return np.concatenate([dense, ids], axis=1).astype("float32"), labels


class _GradientTimes(keras.layers.Layer):
    """The identity forward; its input's gradient `times` as large (the negative control)."""

    def __init__(self, times, **kwargs):
        super().__init__(**kwargs)
        self.times = times

    def call(self, x):
        return x * self.times - tf.stop_gradient(x) * (self.times - 1)


def click_model(dense_seed, shards=None, table_gradient_times=1, group_size=None):
    packed = keras.Input((DENSE + FIELDS,))
    table = embedding.ShardedEmbedding(
        ROWS, DIM, seed=7, shards=shards, group_size=group_size, name="table"
    )
    found = table(packed[:, DENSE:])
    if table_gradient_times != 1:
        found = _GradientTimes(table_gradient_times)(found)
    features = keras.layers.Concatenate()([packed[:, :DENSE], keras.layers.Flatten()(found)])
    hidden = keras.layers.Dense(
        16, "relu", kernel_initializer=keras.initializers.GlorotUniform(dense_seed)
    )(features)
    out = keras.layers.Dense(
        1, kernel_initializer=keras.initializers.GlorotUniform(dense_seed + 1)
    )(hidden)
    return keras.Model(packed, out)


def fit(model, optimizer, x, y, batch, callbacks=()):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)],
    )
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    model.fit(
        data,
        epochs=1,
        steps_per_epoch=STEPS,
        callbacks=list(callbacks),
        verbose=0,
        shuffle=False,
    )
    return model


def distributed_and_reference(make_optimizer, table_gradient_times=1, group_size=None):
    """The distributed model (rank r reads block u*N + r in step u; its table split over model
    groups of `group_size` ranks, None: all) and the one-process model on the global batch of
    each step (the blocks of step u in rank order)."""
    n, r = comm.size(), comm.rank()
    x, y = clicks(PER_RANK * n * STEPS)
    mine = np.concatenate([np.arange(PER_RANK) + PER_RANK * (u * n + r) for u in range(STEPS)])
    # Rank 0's dense seed is the reference's; the others' differ until the broadcast.
    dense_seed = 11 if r == 0 else 11 + 100 * rank_seed()
    model = click_model(dense_seed, group_size=group_size)
    fit(
        model,
        hvd_train.DistributedOptimizer(make_optimizer()),
        x[mine],
        y[mine],
        PER_RANK,
        [hvd_train.BroadcastInitialState()],
    )
    reference = click_model(11, shards=1, table_gradient_times=table_gradient_times)
    fit(reference, densified(make_optimizer()), x, y, PER_RANK * n)
    return model, reference


def densified(optimizer):
    """The optimizer given the table's gradient dense: each row's gradient the sum over its
    lookups, the step of the textbook (Keras 3 would apply Adam's square to each lookup's part)."""
    apply = optimizer.apply

    def dense_apply(grads, variables=None):
        return apply([tf.convert_to_tensor(g) if g is not None else g for g in grads], variables)

    optimizer.apply = dense_apply
    return optimizer


def compared(model, reference):
    """Max |difference| of the dense weights and of the whole table (gathered: collective)."""
    table = embedding.gather_rows(model.get_layer("table").embeddings)
    dense = max_abs_diff(
        [np.asarray(v) for v in model.trainable_variables[1:]],
        [np.asarray(v) for v in reference.trainable_variables[1:]],
    )
    table_diff = None
    if comm.is_chief():
        table_diff = float(
            np.max(np.abs(table - np.asarray(reference.get_layer("table").embeddings)))
        )
    return dense, comm.broadcast_object(table_diff)


CASES = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.05),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_table_split_over_the_ranks_trains_like_one_process_holding_it_whole(case):
    model, reference = distributed_and_reference(CASES[case])
    dense, table = compared(model, reference)
    assert dense < TOL and table < TOL, (dense, table)
    if comm.size() > 1:
        # Control: the table's gradient not divided by N misses by far more than the tolerance.
        _, control = distributed_and_reference(CASES[case], table_gradient_times=comm.size())
        assert compared(model, control)[1] > 20 * TOL


def test_each_rank_holds_its_rows_and_its_slots_only():
    n, r = comm.size(), comm.rank()
    model, _ = distributed_and_reference(CASES["adam"])
    table = model.get_layer("table").embeddings
    assert tuple(table.shape) == (len(range(r, ROWS, n)), DIM)
    counts = comm.allgather_object(int(table.shape[0]))
    assert sum(counts) == ROWS and max(counts) - min(counts) <= 1
    slots = [v for v in model.optimizer.variables if embedding.row_shards(v) is not None]
    assert len(slots) == 2 and all(tuple(v.shape) == tuple(table.shape) for v in slots)
    # The dense weights agree over ranks; the shards differ (other rows), and are not broadcast.
    digests = comm.allgather_object(weights_digest(model.trainable_variables[1:]))
    assert len(set(digests)) == 1
    if n > 1:
        assert len(set(comm.allgather_object(weights_digest([table])))) == n


def test_a_gathered_table_is_put_back_row_for_row_in_small_chunks(monkeypatch):
    monkeypatch.setattr(embedding, "_CHUNK_BYTES", 3 * DIM * 4)  # a few rows per collective
    model, reference = distributed_and_reference(CASES["sgd_momentum"])
    table = model.get_layer("table").embeddings
    before = np.asarray(table)
    whole = embedding.gather_rows(table)
    if comm.is_chief():
        assert whole.shape == (ROWS, DIM)
        expected = np.asarray(reference.get_layer("table").embeddings)
        assert float(np.max(np.abs(whole - expected))) < TOL
    table.assign(np.zeros_like(before))
    embedding.scatter_rows(table, whole)
    assert np.array_equal(np.asarray(table), before)


@pytest.mark.skipif(comm.size() == 1, reason="one worker holds the whole table: nothing to refuse")
@pytest.mark.parametrize("setting", ["shard_state", "process_set"])
def test_what_cannot_hold_a_split_table_is_refused(setting):
    options = {
        "shard_state": {"shard_state": True},
        "process_set": {"process_set": comm.global_process_set},
    }[setting]
    model = click_model(11)
    optimizer = hvd_train.DistributedOptimizer(keras.optimizers.SGD(0.1), **options)
    with pytest.raises(ValueError, match="ShardedEmbedding"):
        optimizer.build(model.trainable_variables)


def test_an_evaluation_over_all_ranks_equals_one_process_and_unequal_batch_counts_are_refused():
    n = comm.size()
    model, reference = distributed_and_reference(CASES["sgd_momentum"])
    x, y = clicks(20 * n, seed=1)  # 20 samples per rank: 3 batches of at most 8 on every rank
    got = hvd_train.evaluate(model, x, y, batch_size=8)
    want = reference.evaluate(x, y, batch_size=64, return_dict=True, verbose=0)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < TOL for k in want), (got, want)
    if n > 1:
        # Control: one rank's part alone (its lookups still pair with the others') differs.
        r = comm.rank()
        part = model.evaluate(x[r::n], y[r::n], batch_size=8, return_dict=True, verbose=0)
        assert abs(part["loss"] - want["loss"]) > 100 * TOL
        # Rank 0 would evaluate 2 batches of its 17 samples, the others 1 of 16: the lookups
        # would pair badly and hang; refused on every rank instead.
        x, y = clicks(16 * n + 1, seed=2)
        with pytest.raises(ValueError, match="same number of batches"):
            hvd_train.evaluate(model, x, y, batch_size=16)


def test_model_groups_split_the_table_inside_each_group_and_train_like_one_process(monkeypatch):
    """Every group size G that divides N (1 <= G < N): the table split over the G ranks of each
    group, each group holding it once, equals one process; the rows' replicas in the other
    groups agree. Control: without the sum over the replicas each group's rows learn from its
    own batches only, and miss."""
    n, r = comm.size(), comm.rank()
    sizes = [g for g in range(1, n) if n % g == 0]
    if not sizes:
        pytest.skip("one rank: no smaller model group")
    for g in sizes:
        model, reference = distributed_and_reference(CASES["adam"], group_size=g)
        dense, table = compared(model, reference)
        assert dense < TOL and table < TOL, (g, dense, table)
        rows = model.get_layer("table").embeddings
        assert tuple(rows.shape) == (len(range(r % g, ROWS, g)), DIM), g
        assert embedding.is_row_sharded(rows) == (g > 1)
        # The same rows in every group, the same values; other rows inside a group.
        places = comm.allgather_object((r % g, weights_digest([rows])))
        assert all(d == places[r % g][1] for p, d in places if p == r % g), g
        assert len({d for _, d in places}) == g, g
        if g > 1:
            with monkeypatch.context() as patch:
                patch.setattr(optimizer_lib, "summed_over", lambda grad, _: grad)
                alone, _ = distributed_and_reference(CASES["adam"], group_size=g)
            assert compared(alone, reference)[1] > 20 * TOL, g
            # Gathered whole (inside each group) and put back (from rank 0 to all) unchanged.
            before = np.asarray(rows)
            whole = embedding.gather_rows(rows)
            rows.assign(np.zeros_like(before))
            embedding.scatter_rows(rows, whole)
            assert np.array_equal(np.asarray(rows), before), g


def test_model_groups_of_a_size_that_does_not_divide_the_ranks_are_refused():
    n = comm.size()
    with pytest.raises(ValueError, match=f"model_group_size {n + 1} does not divide"):
        comm.model_groups(n + 1)
