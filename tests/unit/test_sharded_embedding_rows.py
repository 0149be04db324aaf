"""The row split of `ShardedEmbedding` (keras/embedding.py) in one process: which rows each rank
holds, initial values that do not depend on the worker count, a plain lookup with one worker."""

import keras
import numpy as np
import pytest

from hvd_train.keras import compat, embedding

pytestmark = pytest.mark.skipif(compat.CLASSIC, reason="ShardedEmbedding: the modern stack only")


@pytest.mark.parametrize("rows, shards", [(1, 1), (7, 3), (101, 2), (16, 4), (2, 3)])
def test_the_ranks_hold_every_row_once(rows, shards):
    counts = [embedding.RowShards(rows, shards, r).count() for r in range(shards)]
    assert counts == [len(range(r, rows, shards)) for r in range(shards)]
    assert sum(counts) == rows and max(counts) - min(counts) <= 1


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_each_rank_starts_from_the_rows_one_process_draws(monkeypatch, shards):
    monkeypatch.setattr(embedding, "_INIT_BLOCK_ROWS", 4)  # several blocks, not aligned to shards
    rows, dim = 23, 3

    def drawn(shards, rank):
        init = embedding._RowInitializer(5, 0.05, embedding.RowShards(rows, shards, rank))
        return np.asarray(init((len(range(rank, rows, shards)), dim)))

    whole = drawn(1, 0)
    assert whole.shape == (rows, dim) and len(np.unique(whole)) == rows * dim
    for rank in range(shards):
        assert np.array_equal(drawn(shards, rank), whole[rank::shards])
    # Control: another seed draws another table.
    other = embedding._RowInitializer(6, 0.05, embedding.RowShards(rows, 1, 0))((rows, dim))
    assert not np.allclose(np.asarray(other), whole)


def test_with_one_worker_it_is_a_plain_lookup_of_whole_rows():
    layer = embedding.ShardedEmbedding(10, 4, seed=3)
    ids = np.array([[0, 9], [3, 3]], dtype="float32")  # a packed input's float ids
    found = np.asarray(layer(ids))
    table = np.asarray(layer.embeddings)
    assert found.shape == (2, 2, 4) and table.shape == (10, 4)
    assert np.array_equal(found, table[ids.astype(int)])
    assert not embedding.is_row_sharded(layer.embeddings)
    assert embedding.whole_shape(layer.embeddings) == (10, 4)
    restored = keras.layers.deserialize(keras.layers.serialize(layer))
    assert (restored.rows, restored.dim, restored.seed) == (10, 4, 3)


@pytest.mark.parametrize("args", [(0, 4), (10, 0)])
def test_an_empty_table_is_refused(args):
    with pytest.raises(ValueError, match="rows >= 1 and dim >= 1"):
        embedding.ShardedEmbedding(*args)


def test_a_lookup_gradient_with_a_row_twice_steps_adam_as_its_dense_sum_does():
    import tensorflow as tf

    from hvd_train.keras.optimizer import one_slice_per_row

    # Row 0 looked up twice, row 2 once: its gradient has three slices.
    grad = tf.IndexedSlices(
        tf.constant([[1.0, 2.0], [1.0, 2.0], [0.5, -1.0]]), tf.constant([0, 0, 2]), (3, 2)
    )

    def stepped(gradient):
        variable = keras.Variable(np.zeros((3, 2), "float32"))
        optimizer = keras.optimizers.Adam(0.1)
        for _ in range(3):
            optimizer.apply_gradients([(gradient, variable)])
        return np.asarray(variable)

    dense = stepped(tf.convert_to_tensor(grad))
    summed = one_slice_per_row(grad)
    assert sorted(np.asarray(summed.indices)) == [0, 2]
    np.testing.assert_allclose(stepped(summed), dense, atol=1e-7)
    # The control: the slices as they come step row 0 by another amount (Adam squares each).
    assert np.abs(stepped(grad) - dense).max() > 0.05
