"""Each rank's per-epoch order of sample ids and TFRecord records, as TensorFlow ops.

The permutation of an epoch is `index_shuffle` of (seed, epoch), computed inside tf.data: every
rank computes every shard alike without communicating, and resumed runs (bit-exact deterministic
resume among them) depend on this exact order, so these ops stay as they are. Which positions of
the permutation a rank takes, and how many, is plain arithmetic from `sharding.py`.

The streams here are (epoch, step, id) elements, epoch after epoch; `pipeline.py` batches and
decodes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from hvd_train.data.augment import augment_seed
from hvd_train.data.formats import read_records
from hvd_train.data.sharding import (
    rank_of,
    rank_positions,
    remaining_steps,
    shard_positions,
)

if TYPE_CHECKING:
    from hvd_train.data.sources import RecordFiles

_FOREVER = np.iinfo(np.int64).max
_SHUFFLE_WINDOW = 1024  # records shuffled together within a rank's shard of TFRecord files


def _tf_range(positions: range) -> tf.Tensor:
    return tf.range(positions.start, positions.stop, positions.step, dtype=tf.int64)


def epoch_ids(positions: tf.Tensor, num_samples: int, seed: int, epoch: tf.Tensor) -> tf.Tensor:
    """The sample ids at `positions` of the epoch's permutation of range(num_samples)."""
    if positions.shape.num_elements() == 0:
        return positions  # index_shuffle rejects an empty vector (a resume with no step left)
    return tf.random.experimental.index_shuffle(
        positions, seed=seed_pair(seed, epoch), max_index=num_samples - 1
    )


def seed_pair(seed: int, epoch: tf.Tensor) -> tf.Tensor:
    """The permutation's stateless seed: (seed, epoch) as int64."""
    return tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])


def shard_indices(
    num_samples: int, rank: int, size: int, epoch: int, seed: int = 0, shuffle: bool = True
) -> np.ndarray:
    """Sample ids of one rank's whole shard in one epoch, in the order they are visited.

    Raises:
      DataError (a ValueError): a rank outside 0..size - 1.
    """
    positions = _tf_range(shard_positions(num_samples, rank, size))
    if not shuffle:
        return positions.numpy()
    return epoch_ids(positions, num_samples, seed, tf.constant(epoch)).numpy()


def tagged(epoch: tf.Tensor, batch: int, elements: tf.data.Dataset) -> tf.data.Dataset:
    """(epoch, step, element): where each element of one epoch lands, for per-batch seeds."""
    return elements.enumerate().map(lambda i, x: (epoch, i // batch, x))


def _sharded_ids(
    num_samples: int,
    steps: int,
    batch: int,
    rank: int,
    size: int,
    seed: int,
    shuffle: bool,
    start: int = 0,
) -> Any:
    """A function of the epoch: this rank's `steps * batch` sample ids of it, tagged; from
    permutation position `start` on (the positions before it were consumed already)."""
    positions = _tf_range(rank_positions(rank, size, steps, batch, start))

    def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
        ids = epoch_ids(positions, num_samples, seed, epoch) if shuffle else positions
        return tagged(epoch, batch, tf.data.Dataset.from_tensor_slices(ids))

    return one_epoch


def epochs(initial_epoch: int, one_epoch: Any, first_epoch: Any = None) -> tf.data.Dataset:
    """Epochs from `initial_epoch` on; `first_epoch` (a function of the epoch) makes the first."""
    if first_epoch is None:
        return tf.data.Dataset.range(initial_epoch, _FOREVER).flat_map(one_epoch)
    rest = tf.data.Dataset.range(initial_epoch + 1, _FOREVER).flat_map(one_epoch)
    return first_epoch(tf.constant(initial_epoch, tf.int64)).concatenate(rest)


def positioned_epochs(
    num_samples: int,
    steps: int,
    batch: int,
    rank: int,
    size: int,
    seed: int,
    shuffle: bool,
    initial_epoch: int,
    start_position: int,
) -> tf.data.Dataset:
    """(epoch, step, id) of this rank, the first epoch from `start_position` on."""
    one_epoch = _sharded_ids(num_samples, steps, batch, rank, size, seed, shuffle)
    if not start_position:
        return epochs(initial_epoch, one_epoch)
    left = remaining_steps(steps, batch, size, start_position)
    first = _sharded_ids(num_samples, left, batch, rank, size, seed, shuffle, start_position)
    return epochs(initial_epoch, one_epoch, first)


def record_shard(source: RecordFiles, rank: int, size: int, seed: int, how: str) -> Any:
    """A function of the epoch: this rank's serialized records of it, before shuffling.

    Args:
      how: "file" or "record", from `sharding.record_steps`.
    """
    files = tf.constant(source.train_files)
    num_files, total = len(source.train_files), sum(source.train_counts)
    if how == "file":
        positions = _tf_range(shard_positions(num_files, rank, size))
        return lambda epoch: read_records(
            tf.gather(files, epoch_ids(positions, num_files, seed, epoch))
        )

    def records(epoch: tf.Tensor) -> tf.data.Dataset:
        def mine(g: tf.Tensor, record: tf.Tensor) -> tf.Tensor:
            # Record g goes to rank perm(g) % size; perm is a bijection: disjoint, even shards.
            perm = tf.random.experimental.index_shuffle(g, seed_pair(seed, epoch), total - 1)
            return rank_of(perm, size) == rank

        return read_records(files).enumerate().filter(mine).map(lambda g, record: record)

    return records


def shuffled(records: tf.data.Dataset, seed: int, rank: int, epoch: tf.Tensor) -> Any:
    """Each window of records permuted by a stateless function of (seed, rank, epoch, window).

    Not `Dataset.shuffle`: it cannot take a seed computed in the pipeline once a global seed is set.
    """

    def permute(window_index: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
        # Negative "steps": never the seed of an augmented batch (steps count from 0).
        key_seed = augment_seed(seed, rank, epoch, -1 - window_index)
        keys = tf.random.stateless_uniform(tf.shape(window)[:1], key_seed)
        return tf.gather(window, tf.argsort(keys))

    return records.batch(_SHUFFLE_WINDOW).enumerate().map(permute).unbatch()
