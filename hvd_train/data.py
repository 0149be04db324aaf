"""Sharding users' in-memory data over ranks: disjoint shards, equal steps, a seeded reshuffle.

Each epoch draws one permutation of the sample ids, the same on every rank (a stateless function of
(seed, epoch)); rank r takes the permutation's positions r, r+size, r+2*size, ... So the per-rank
shards of an epoch are disjoint and together cover the data. Every rank runs the same number of
steps, the smallest shard's: (num_samples // size) // per_rank_batch_size; a rank with more steps
than the others would wait forever in its last allreduce. The few samples past the last full step
differ from epoch to epoch, so none is left out for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_train.errors import UserError


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


class DataError(UserError):
    """Input data that cannot be used (one line, names the file or the array)."""


@dataclass
class Arrays:
    """A data set in memory: training and validation arrays, and what the model needs to know."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def _split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    """Hold out `fraction` of the samples for validation, by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = max(1, round(fraction * len(x)))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def _digits(seed: int, fraction: float) -> Arrays:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 8, 8, 1).astype("float32")
    return Arrays(*_split(x, y.astype("int32"), fraction, seed), num_classes=10)


def _synthetic(
    shape: tuple[int, ...], num_classes: int, num_samples: int, seed: int, fraction: float
) -> Arrays:
    """Learnable synthetic images: a fixed random template per class plus noise."""
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((num_classes, *shape)).astype("float32")
    y = rng.integers(0, num_classes, num_samples).astype("int32")
    x = templates[y] + 2.0 * rng.standard_normal((num_samples, *shape)).astype("float32")
    return Arrays(*_split(x, y, fraction, seed), num_classes=num_classes)


def _check_pair(name: str, x: np.ndarray, y: np.ndarray, path: str) -> None:
    if x.ndim < 2 or len(x) == 0:
        raise DataError(f"{path}: x_{name} must have a sample axis and features, got {x.shape}")
    if y.shape != (len(x),):
        raise DataError(f"{path}: y_{name} must have shape ({len(x)},), got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: y_{name} must hold integer class ids, got {y.dtype}")
    if not np.issubdtype(x.dtype, np.number) or not np.all(np.isfinite(x)):
        raise DataError(f"{path}: x_{name} must be finite numbers")
    if y.min() < 0:
        raise DataError(f"{path}: y_{name} has a negative class id {y.min()}")


def _npz(path: str, seed: int, fraction: float) -> Arrays:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except (OSError, ValueError) as err:
        raise DataError(f"data file {path} is not a readable .npz archive ({err})") from None
    missing = [k for k in ("x_train", "y_train") if k not in arrays]
    if missing:
        raise DataError(f"{path}: missing array(s) {', '.join(missing)} (has {sorted(arrays)})")
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise DataError(f"{path}: x_val and y_val come together")
    _check_pair("train", arrays["x_train"], arrays["y_train"], path)
    x, y = arrays["x_train"].astype("float32"), arrays["y_train"].astype("int32")
    if "x_val" in arrays:
        _check_pair("val", arrays["x_val"], arrays["y_val"], path)
        if arrays["x_val"].shape[1:] != arrays["x_train"].shape[1:]:
            raise DataError(
                f"{path}: x_val samples {arrays['x_val'].shape[1:]} differ from x_train's "
                f"{arrays['x_train'].shape[1:]}"
            )
        split = (x, y, arrays["x_val"].astype("float32"), arrays["y_val"].astype("int32"))
    else:
        split = _split(x, y, fraction, seed)
    num_classes = int(max(split[1].max(), split[3].max())) + 1
    if num_classes < 2:
        raise DataError(f"{path}: labels hold a single class")
    return Arrays(*split, num_classes=num_classes)


def load_arrays(data: Any) -> Arrays:
    """The data set a config's `data` section names (digits, synthetic or an .npz file).

    Raises:
      DataError: a missing or malformed file, or arrays that do not fit together.
    """
    if data.source == "digits":
        return _digits(data.seed, data.validation_fraction)
    if data.source == "synthetic":
        return _synthetic(
            tuple(data.shape),
            data.num_classes,
            data.num_samples,
            data.seed,
            data.validation_fraction,
        )
    if data.source == "npz":
        return _npz(str(data.path), data.seed, data.validation_fraction)
    raise DataError(f"unknown data source {data.source!r}")


def validation_shard(
    arrays: tuple[np.ndarray, ...], batch_size: int, rank: int, size: int
) -> tf.data.Dataset:
    """This rank's 1/size of the validation data (strided; sizes may differ by one sample).

    No collective runs during evaluation, so ranks may take different numbers of steps; the
    metric states are summed over ranks afterwards (`dist.reduce_metrics_over_ranks`), which makes
    the result exactly that of one process on all the data.

    Raises:
      DataError: fewer validation samples than ranks (a rank would have nothing to evaluate).
    """
    if len(arrays[0]) < size:
        raise DataError(f"{len(arrays[0])} validation samples are fewer than the {size} ranks")
    shard = tuple(a[rank::size] for a in arrays)
    return tf.data.Dataset.from_tensor_slices(shard).batch(batch_size)
