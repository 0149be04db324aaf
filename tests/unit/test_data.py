"""Sharding in one process: every rank's shard computed here, as each rank computes its own."""

import numpy as np
import pytest

from hvd_train import data


@pytest.mark.parametrize(("num_samples", "size"), [(100, 1), (100, 3), (1797, 4), (10, 10)])
def test_shards_are_disjoint_and_cover(num_samples, size):
    for epoch in range(2):
        shards = [data.shard_indices(num_samples, r, size, epoch, seed=3) for r in range(size)]
        union = np.concatenate(shards)
        assert sorted(union.tolist()) == list(range(num_samples))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_reshuffled_per_epoch_and_fixed_by_seed():
    a = data.shard_indices(1000, 1, 4, epoch=0, seed=1)
    assert np.array_equal(a, data.shard_indices(1000, 1, 4, epoch=0, seed=1))
    assert not np.array_equal(a, data.shard_indices(1000, 1, 4, epoch=1, seed=1))
    assert not np.array_equal(a, data.shard_indices(1000, 1, 4, epoch=0, seed=2))
    assert np.array_equal(data.shard_indices(10, 1, 4, 0, shuffle=False), [1, 5, 9])


def test_dataset_yields_the_shard_in_equal_steps():
    n, size, batch = 103, 3, 5
    x = np.arange(n)
    steps = data.steps_per_epoch(n, size, batch)
    assert steps == (103 // 3) // 5 == 6
    for rank in range(size):
        dataset, got_steps = data.shard_dataset(
            (x, x * 2), batch, rank, size, seed=9, initial_epoch=1
        )
        batches = list(dataset.take(2 * steps).as_numpy_iterator())
        assert got_steps == steps
        assert all(len(b[0]) == batch and np.array_equal(b[1], 2 * b[0]) for b in batches)
        epoch1 = np.concatenate([b[0] for b in batches[:steps]])
        epoch2 = np.concatenate([b[0] for b in batches[steps:]])
        assert np.array_equal(epoch1, data.shard_indices(n, rank, size, 1, seed=9)[: steps * batch])
        assert np.array_equal(epoch2, data.shard_indices(n, rank, size, 2, seed=9)[: steps * batch])


def test_too_little_data_and_mismatched_arrays_are_errors():
    with pytest.raises(ValueError, match="10 samples are too few for 4 ranks x batch 4"):
        data.steps_per_epoch(10, 4, 4)
    with pytest.raises(ValueError, match="arrays differ in length"):
        data.shard_dataset((np.zeros(10), np.zeros(9)), 2, 0, 1)
    with pytest.raises(ValueError, match=r"rank 3 is outside 0\.\.2"):
        data.shard_indices(10, 3, 3, 0)
