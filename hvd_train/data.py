"""Sharding users' in-memory data over ranks: disjoint shards, equal steps, a seeded reshuffle.

Each epoch draws one permutation of the sample ids, the same on every rank (a stateless function of
(seed, epoch)); rank r takes the permutation's positions r, r+size, r+2*size, ... So the per-rank
shards of an epoch are disjoint and together cover the data. Every rank runs the same number of
steps, the smallest shard's: (num_samples // size) // per_rank_batch_size; a rank with more steps
than the others would wait forever in its last allreduce. The few samples past the last full step
differ from epoch to epoch, so none is left out for good.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def steps_per_epoch(num_samples: int, size: int, per_rank_batch_size: int) -> int:
    """Steps every rank runs per epoch (the smallest shard's full batches).

    Raises:
      ValueError: fewer samples than one batch on every rank.
    """
    steps = (num_samples // size) // per_rank_batch_size
    if steps < 1:
        raise ValueError(
            f"{num_samples} samples are too few for {size} ranks x batch {per_rank_batch_size}: "
            "not one full step per rank"
        )
    return steps


def _epoch_ids(positions: tf.Tensor, num_samples: int, seed: int, epoch: tf.Tensor) -> tf.Tensor:
    seed_pair = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])
    return tf.random.experimental.index_shuffle(
        positions, seed=seed_pair, max_index=num_samples - 1
    )


def shard_indices(
    num_samples: int, rank: int, size: int, epoch: int, seed: int = 0, shuffle: bool = True
) -> np.ndarray:
    """Sample ids of one rank's whole shard in one epoch, in the order they are visited."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside 0..{size - 1}")
    positions = tf.range(rank, num_samples, size, dtype=tf.int64)
    if not shuffle:
        return positions.numpy()
    return _epoch_ids(positions, num_samples, seed, tf.constant(epoch)).numpy()


def shard_dataset(
    arrays: tuple[np.ndarray, ...],
    per_rank_batch_size: int,
    rank: int,
    size: int,
    seed: int = 0,
    shuffle: bool = True,
    initial_epoch: int = 0,
) -> tuple[tf.data.Dataset, int]:
    """A repeating tf.data pipeline of this rank's batches, epoch after epoch.

    Pass the returned steps to `fit(steps_per_epoch=...)`: the dataset never ends, and each epoch
    of it is exactly that many batches of this rank's shard of that epoch's permutation.

    Args:
      arrays: (x, y, ...) with the same first dimension.
      per_rank_batch_size: batch on this rank.
      rank, size: this rank and the worker count.
      seed: permutation seed, the same on every rank.
      shuffle: reshuffle every epoch (False: fixed strided shards).
      initial_epoch: first epoch to produce (for a resumed run).

    Returns:
      (dataset, steps_per_epoch).
    """
    num_samples = len(arrays[0])
    if any(len(a) != num_samples for a in arrays):
        raise ValueError(f"arrays differ in length: {[len(a) for a in arrays]}")
    steps = steps_per_epoch(num_samples, size, per_rank_batch_size)
    used = steps * per_rank_batch_size
    positions = tf.range(rank, rank + used * size, size, dtype=tf.int64)
    tensors = tuple(tf.constant(a) for a in arrays)

    def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
        ids = _epoch_ids(positions, num_samples, seed, epoch) if shuffle else positions
        return tf.data.Dataset.from_tensor_slices(ids)

    dataset = (
        tf.data.Dataset.range(initial_epoch, np.iinfo(np.int64).max)
        .flat_map(one_epoch)
        .batch(per_rank_batch_size, drop_remainder=True)
        .map(
            lambda ids: tuple(tf.gather(t, ids) for t in tensors),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        .prefetch(tf.data.AUTOTUNE)
    )
    return dataset, steps
