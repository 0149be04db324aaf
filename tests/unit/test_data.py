"""Sharding in one process: every rank's shard computed here, as each rank computes its own."""

import numpy as np
import pytest
import tensorflow as tf

from hvd_train import data
from hvd_train.core.config import DataConfig


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
    with pytest.raises(data.DataError, match="10 training samples on 4 ranks: 2 per rank, not one"):
        data.steps_per_epoch(10, 4, 4)
    with pytest.raises(data.DataError, match=r"arrays differ in length: \[10, 9\]"):
        data.shard_dataset((np.zeros(10), np.zeros(9)), 2, 0, 1)
    with pytest.raises(data.DataError, match=r"rank 3 is outside 0\.\.2"):
        data.shard_indices(10, 3, 3, 0)


@pytest.mark.parametrize(
    ("n", "batch", "rank", "size", "message"),
    [
        (10, 4, 0, 4, "10 training samples on 4 ranks: 2 per rank, not one batch of 4"),
        (3, 1, 0, 4, "3 training samples are fewer than the 4 ranks"),
        (10, 0, 0, 2, "per-rank batch size 0: must be >= 1"),
        (10, 1, 2, 2, r"rank 2 is outside 0\.\.1"),
    ],
)
def test_shard_dataset_and_train_dataset_raise_the_same_errors(n, batch, rank, size, message):
    x, y = np.zeros((n, 2), np.float32), np.zeros(n, np.int32)
    with pytest.raises(data.DataError, match=f"^{message}$"):
        data.shard_dataset((x, y), batch, rank, size)
    with pytest.raises(data.DataError, match=f"^{message}$"):
        data.train_dataset(data.Arrays(x, y, x, y, num_classes=2), batch, rank, size)


def test_mismatched_arrays_are_the_same_error_in_both():
    x, y = np.zeros((10, 2), np.float32), np.zeros(9, np.int32)
    with pytest.raises(data.DataError, match=r"^arrays differ in length: \[10, 9\]$"):
        data.shard_dataset((x, y), 2, 0, 1)
    with pytest.raises(data.DataError, match=r"^arrays differ in length: \[10, 9\]$"):
        data.train_dataset(data.Arrays(x, y, x, y, num_classes=2), 2, 0, 1)


def images(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, 8, 8, 3), dtype=np.float32), np.arange(n, dtype=np.int32)


def test_augmentation_keeps_shape_and_moves_pixels_per_seed():
    x, _ = images()
    seed = data.augment_seed(3, rank=0, epoch=1, step=2)
    a = data.augment_images(tf.constant(x), seed).numpy()
    assert a.shape == x.shape and a.dtype == np.float32
    assert np.array_equal(a, data.augment_images(tf.constant(x), seed).numpy())  # reproducible
    assert not np.array_equal(a, x)
    other_rank = data.augment_images(tf.constant(x), data.augment_seed(3, 1, 1, 2)).numpy()
    other_epoch = data.augment_images(tf.constant(x), data.augment_seed(3, 0, 2, 2)).numpy()
    assert not np.array_equal(a, other_rank) and not np.array_equal(a, other_epoch)
    # Each output is a shifted (by at most 4 pixels, zeros filled in), maybe mirrored, input.
    for out, src in zip(a, x, strict=True):
        padded = np.pad(src, ((4, 4), (4, 4), (0, 0)))
        crops = [
            img[dy : dy + 8, dx : dx + 8]
            for img in (padded, padded[:, ::-1])
            for dy in range(9)
            for dx in range(9)
        ]
        assert any(np.array_equal(out, c) for c in crops)


def test_augmented_batches_keep_labels_differ_by_rank_and_repeat_by_seed():
    x, y = images(24)
    arrays = data.Arrays(x, y, x[:4], y[:4], num_classes=24)

    def first_epoch(rank, augment, seed=7):
        dataset, steps = data.train_dataset(arrays, 4, rank, 2, seed=seed, augment=augment)
        return list(dataset.take(steps).as_numpy_iterator())

    plain, augmented = first_epoch(0, False), first_epoch(0, True)
    for (xp, yp), (xa, ya) in zip(plain, augmented, strict=True):
        assert np.array_equal(yp, ya) and xa.shape == xp.shape and not np.array_equal(xa, xp)
        assert np.array_equal(xp, x[yp])  # unaugmented batches are the samples themselves
    again = first_epoch(0, True)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(augmented, again, strict=True))
    # Batch (epoch 0, step 0) of rank 0 is augmented with seed (7, rank 0, 0, 0); rank 1's seed
    # for the same batch would move the same images otherwise.
    first = tf.constant(x[plain[0][1]])
    rank0 = data.augment_images(first, data.augment_seed(7, 0, 0, 0)).numpy()
    rank1 = data.augment_images(first, data.augment_seed(7, 1, 0, 0)).numpy()
    assert np.array_equal(rank0, augmented[0][0]) and not np.array_equal(rank1, rank0)
    with pytest.raises(data.DataError, match=r"data.augment: needs images .* shape \(5,\)"):
        data.train_dataset(
            data.Arrays(x[:, 0, 0, :1].repeat(5, 1), y, x, y, 24), 4, 0, 1, augment=True
        )


def test_uint8_pixels_reach_the_model_in_0_1_and_max_steps_shortens_each_epoch():
    x = np.arange(40, dtype=np.uint8).reshape(40, 1, 1, 1) * 6
    arrays = data.Arrays(x, np.arange(40, dtype=np.int32), x[:3], np.arange(3), num_classes=40)
    dataset, steps = data.train_dataset(arrays, 4, 1, 2, seed=2, max_steps=2)
    assert steps == 2
    batches = list(dataset.take(2 * steps).as_numpy_iterator())
    for xb, yb in batches:
        assert xb.dtype == np.float32 and np.allclose(xb.ravel(), yb * 6 / 255)
    for epoch in range(2):  # each epoch of the dataset is the first 2 batches of that epoch's shard
        ids = np.concatenate([yb for _, yb in batches[epoch * steps : (epoch + 1) * steps]])
        assert np.array_equal(ids, data.shard_indices(40, 1, 2, epoch, seed=2)[:8])
    with pytest.raises(
        data.DataError, match="40 training samples on 2 ranks: 20 per rank, not one"
    ):
        data.train_dataset(arrays, 32, 0, 2)


def test_synthetic_tokens_follow_the_majority_residue_rule():
    cfg = DataConfig(source="synthetic", kind="tokens", shape=[16], vocab_size=50, num_classes=4)
    arrays = data.load(cfg)
    assert arrays.input_shape == (16,) and arrays.x_train.dtype == np.int32
    assert (len(arrays.x_train), len(arrays.x_val)) == (1638, 410)
    x = np.concatenate([arrays.x_train, arrays.x_val])
    y = np.concatenate([arrays.y_train, arrays.y_val])
    assert x.min() >= 0 and x.max() < 50
    counts = np.stack([(x % 4 == c).sum(axis=1) for c in range(4)], axis=1)
    assert np.array_equal(y, counts.argmax(axis=1))
    assert np.bincount(y, minlength=4).min() > 0.15 * len(y)  # roughly balanced
    assert np.array_equal(data.load(cfg).x_train, arrays.x_train)  # seeded


def test_synthetic_clicks_hold_zipf_ids_per_field_then_dense_features_and_balanced_labels():
    cfg = DataConfig(
        source="synthetic",
        kind="clicks",
        shape=[3, 2],
        vocab_size=300,
        num_classes=2,
        num_samples=20000,
        zipf_exponent=1.0,
    )
    arrays = data.load(cfg)
    assert arrays.input_shape == (5,) and arrays.x_train.dtype == np.float32
    x = np.concatenate([arrays.x_train, arrays.x_val])
    y = np.concatenate([arrays.y_train, arrays.y_val])
    ids = x[:, :3]
    assert np.array_equal(ids, np.round(ids))  # integers, exact in float32
    for field in range(3):  # field f's ids are the f-th block of 100
        own = ids[:, field] - 100 * field
        assert own.min() >= 0 and own.max() < 100
        # The hottest id's share against the closed form, 1 / H(100) = 0.193 (sd 0.003).
        assert np.mean(own == 0) == pytest.approx(1 / np.sum(1 / np.arange(1, 101)), abs=0.015)
    # The control: a uniform draw gives the first id 1 / 100.
    uniform = data.load(DataConfig(**{**cfg.__dict__, "zipf_exponent": 0.0}))
    assert np.mean(uniform.x_train[:, 0] == 0) == pytest.approx(0.01, abs=0.005)
    assert abs(y.mean() - 0.5) < 0.01  # split at the score's median
    assert np.array_equal(data.load(cfg).x_train, arrays.x_train)  # seeded


@pytest.mark.parametrize(("n", "size", "batch"), [(386, 3, 32), (33, 2, 16), (7, 2, 1), (7, 3, 2)])
def test_equal_batches_give_every_rank_as_many_batches_and_each_sample_once(n, size, batch):
    x, y = np.arange(n, dtype="float32")[:, None], np.arange(n)

    def counts(equal):
        shards = [data.validation_shard((x, y), batch, r, size, equal) for r in range(size)]
        return [len(list(shard)) for shard in shards], shards

    plain, _ = counts(False)
    assert len(set(plain)) == 2  # the cases where plain batches differ
    equal, shards = counts(True)
    assert len(set(equal)) == 1 and equal[0] == min(plain)
    seen = sorted(int(v) for shard in shards for _, labels in shard for v in labels.numpy())
    assert seen == list(range(n))
    assert all(int(sh.cardinality()) == equal[0] for sh in shards)  # known to Keras in advance
