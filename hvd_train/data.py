"""Data for distributed training: sources on local disk, and each rank's shard of them.

The rule every source follows: each epoch, the ranks split the training data into disjoint shards
by a rule that is a stateless function of (seed, epoch), so every rank computes every shard alike
without communicating; every rank runs the same number of steps (a rank with more steps than the
others would wait forever in its last allreduce); validation is split 1/size per rank, sizes may
differ by a little (no collective runs during evaluation).

Sources (`load`):
  - in memory (`Arrays`): digits, synthetic (images or tokens), npz, mnist and cifar10 (Keras's
    cached files, read with numpy and pickle: nothing is downloaded). Sharding: one permutation of
    the sample ids per epoch (`index_shuffle` of (seed, epoch)); rank r takes its positions r,
    r+size, ...; steps = (samples // size) // batch (`shard_dataset`, `shard_indices`).
  - files (`RecordFiles`: TFRecord files of `tf.train.Example`s; `ImageFiles`: one folder per
    class), decoded in the pipeline. TFRecord files are sharded by file when there are at least as
    many files as ranks: rank r reads files r, r+size, ... of that epoch's permutation of the file
    list; steps = the records of the floor(files / size) smallest files, // batch: what the rank
    with the fewest records could get in any epoch. With fewer files than ranks, every rank reads
    all files in one fixed interleaved order and keeps record g when index_shuffle(g) % size == r,
    a per-epoch split into shards of floor or ceil(records / size); steps = (records // size) //
    batch. Within its shard, a rank shuffles each window of 1024 records by a permutation seeded
    by (seed, rank, epoch, window). Image files are sharded one file per sample, like arrays.
  - files that fit in memory on every rank are decoded once (`decode_into_memory`) and then served
    like arrays.

Pixels stored as uint8 reach the model as float32 in [0, 1]. With augmentation, every batch of
images is padded by 4 pixels, randomly cropped back and randomly flipped left-right, by stateless
random ops seeded by (seed, rank, epoch, step): ranks augment differently, reruns identically.
"""

from __future__ import annotations

import codecs
import glob
import io
import math
import os
import pickle
import struct
import tarfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError

from hvd_train.errors import UserError

_FOREVER = np.iinfo(np.int64).max
_PAD = 4  # augmentation: pixels of zero padding before the random crop
_SHUFFLE_WINDOW = 1024  # records shuffled together within a rank's shard of TFRecord files
_CYCLE = 8  # files read at once; a constant, so the record order is the same on every machine
_CACHE_SHARE = 4  # decoded data is cached when all ranks of a host need <= 1/4 of free memory
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


class DataError(UserError):
    """Input data that cannot be used (one line, names the file or the array)."""


# --- sharding ------------------------------------------------------------------------------------


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
    return tf.random.experimental.index_shuffle(
        positions, seed=_seed_pair(seed, epoch), max_index=num_samples - 1
    )


def _seed_pair(seed: int, epoch: tf.Tensor) -> tf.Tensor:
    return tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])


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


def _tagged(epoch: tf.Tensor, batch: int, elements: tf.data.Dataset) -> tf.data.Dataset:
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
    positions = tf.range(start + rank, start + rank + steps * batch * size, size, dtype=tf.int64)

    def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
        ids = _epoch_ids(positions, num_samples, seed, epoch) if shuffle else positions
        return _tagged(epoch, batch, tf.data.Dataset.from_tensor_slices(ids))

    return one_epoch


def _epochs(initial_epoch: int, one_epoch: Any, first_epoch: Any = None) -> tf.data.Dataset:
    """Epochs from `initial_epoch` on; `first_epoch` (a function of the epoch) makes the first."""
    if first_epoch is None:
        return tf.data.Dataset.range(initial_epoch, _FOREVER).flat_map(one_epoch)
    rest = tf.data.Dataset.range(initial_epoch + 1, _FOREVER).flat_map(one_epoch)
    return first_epoch(tf.constant(initial_epoch, tf.int64)).concatenate(rest)


def remaining_steps(steps: int, per_rank_batch_size: int, size: int, position: int) -> int:
    """Steps left in an epoch on `size` ranks once `position` positions of its permutation are used.

    A data position counts samples, not steps, so it means the same at any worker count: global
    step s covers positions [s * batch * size, (s + 1) * batch * size). An epoch of `steps` steps
    ends at position steps * batch * size; the positions left are spread over the `size` ranks of
    now, and a last part smaller than one global batch is dropped (as `drop_remainder` does).

    Raises:
      ValueError: a negative position, or a batch or size < 1.
    """
    if position < 0 or per_rank_batch_size < 1 or size < 1:
        raise ValueError(
            f"need position >= 0, batch >= 1 and size >= 1, got {position}, "
            f"{per_rank_batch_size}, {size}"
        )
    global_batch = per_rank_batch_size * size
    return max(0, (steps * global_batch - position) // global_batch)


def _gathered(
    arrays: tuple[np.ndarray, ...],
    batch: int,
    rank: int,
    size: int,
    seed: int,
    shuffle: bool,
    initial_epoch: int,
    steps: int,
    start_position: int = 0,
) -> tf.data.Dataset:
    """Batches (epoch, step, *arrays) of this rank's shard: ids batched first, then one gather."""
    tensors = tuple(tf.constant(a) for a in arrays)
    return (
        _positioned_epochs(
            len(arrays[0]), steps, batch, rank, size, seed, shuffle, initial_epoch, start_position
        )
        .batch(batch, drop_remainder=True)
        .map(
            lambda epoch, step, ids: (epoch[0], step[0], *(tf.gather(t, ids) for t in tensors)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    )


def _positioned_epochs(
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
        return _epochs(initial_epoch, one_epoch)
    left = remaining_steps(steps, batch, size, start_position)
    first = _sharded_ids(num_samples, left, batch, rank, size, seed, shuffle, start_position)
    return _epochs(initial_epoch, one_epoch, first)


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
    dataset = _gathered(
        arrays, per_rank_batch_size, rank, size, seed, shuffle, initial_epoch, steps
    ).map(lambda epoch, step, *batch: batch)
    return dataset.prefetch(tf.data.AUTOTUNE), steps


# --- augmentation --------------------------------------------------------------------------------


def augment_seed(seed: int, rank: int, epoch: Any, step: Any = 0) -> tf.Tensor:
    """The stateless seed of one rank's batch: differs by rank, epoch and step; fixed by them."""
    fold = tf.random.experimental.stateless_fold_in
    pair = tf.constant([seed, rank], tf.int64)
    return fold(fold(pair, tf.cast(epoch, tf.int64)), tf.cast(step, tf.int64))


def augment_images(images: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Each image zero-padded by 4 pixels, randomly cropped back to its size, randomly flipped.

    Args:
      images: float [batch, height, width, channels].
      seed: a stateless seed, shape [2] (`augment_seed`).

    Returns:
      Images of the same shape and dtype.
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    padded = tf.pad(images, [[0, 0], [_PAD, _PAD], [_PAD, _PAD], [0, 0]])
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    offsets = tf.random.stateless_uniform(
        [batch, 2], crop_seed, minval=0, maxval=2 * _PAD + 1, dtype=tf.int32
    )
    flip = tf.random.stateless_uniform([batch], flip_seed) < 0.5
    rows = offsets[:, :1] + tf.range(height)[tf.newaxis]
    columns = tf.range(width)[tf.newaxis]
    columns = offsets[:, 1:] + tf.where(flip[:, tf.newaxis], width - 1 - columns, columns)
    cropped = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(cropped, columns, axis=2, batch_dims=1)


def _to_model(x: tf.Tensor) -> tf.Tensor:
    """uint8 pixels to float32 in [0, 1]; anything else as it is."""
    return tf.cast(x, tf.float32) / 255.0 if x.dtype == tf.uint8 else x


def _finish(batches: tf.data.Dataset, seed: int, rank: int, augment: bool) -> tf.data.Dataset:
    """(epoch, step, x, y) batches to the model's (x, y), augmented with per-rank seeds."""

    def prepare(epoch: tf.Tensor, step: tf.Tensor, x: tf.Tensor, y: tf.Tensor) -> tuple:
        x = _to_model(x)
        if augment:
            x = augment_images(x, augment_seed(seed, rank, epoch, step))
        return x, y

    return batches.map(prepare, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


# --- sources -------------------------------------------------------------------------------------


@dataclass
class Arrays:
    """A data set in memory: training and validation arrays, and what the model needs to know.

    x may hold uint8 pixels (the pipeline scales them to [0, 1]), floats or int token ids.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


@dataclass
class RecordFiles:
    """TFRecord files of `tf.train.Example`s (`image`: PNG/JPEG bytes, `label`: int64), unread.

    Attributes:
      train_files, val_files: paths, sorted.
      train_counts, val_counts: records in each file.
      shape: (height, width, channels) the images are decoded and resized to.
      num_classes: labels are in [0, num_classes).
      pattern: the glob(s) they came from, for messages.
    """

    train_files: list[str]
    train_counts: list[int]
    val_files: list[str]
    val_counts: list[int]
    shape: tuple[int, int, int]
    num_classes: int
    pattern: str

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.shape


@dataclass
class ImageFiles:
    """Image files, one sample each, with class ids from their folder (sorted folder names)."""

    train_paths: list[str]
    train_labels: np.ndarray
    val_paths: list[str]
    val_labels: np.ndarray
    shape: tuple[int, int, int]
    class_names: list[str]
    root: str

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.shape


Source = Arrays | RecordFiles | ImageFiles


def _split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    """Hold out `fraction` of the samples for validation, by a seeded permutation."""
    train, val = _split_ids(len(x), fraction, seed)
    return x[train], y[train], x[val], y[val]


def _split_ids(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_val = min(max(1, round(fraction * n)), n - 1)  # at least one of each, where n allows
    return np.sort(order[n_val:]), np.sort(order[:n_val])


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


def _synthetic_tokens(
    length: int, vocab_size: int, num_classes: int, num_samples: int, seed: int, fraction: float
) -> Arrays:
    """Token sequences whose class is the residue (id mod classes) most of their tokens share.

    Ties go to the smaller class. A third of the tokens are drawn from a random class's residue,
    the rest uniformly, so the classes are balanced and a bag-of-words model can learn the rule.
    """
    rng = np.random.default_rng(seed)
    bias = rng.integers(0, num_classes, num_samples)
    per_class = (vocab_size - 1 - np.arange(num_classes)) // num_classes + 1  # ids with residue c
    own = bias[:, None] + num_classes * (
        rng.random((num_samples, length)) * per_class[bias][:, None]
    ).astype("int64")
    uniform = rng.integers(0, vocab_size, (num_samples, length))
    x = np.where(rng.random((num_samples, length)) < 1 / 3, own, uniform).astype("int32")
    counts = np.zeros((num_samples, num_classes), "int64")
    np.add.at(counts, (np.arange(num_samples)[:, None], x % num_classes), 1)
    y = counts.argmax(axis=1).astype("int32")
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


# --- Keras's cached mnist and cifar10 (never downloaded here) ------------------------------------

MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
# Where Keras 2 and Keras 3 leave CIFAR-10 under datasets/: extracted folders, then archives.
_CIFAR10_DIRS = ("cifar-10-batches-py", "cifar-10-batches-py-target/cifar-10-batches-py")
_CIFAR10_ARCHIVES = (
    "cifar-10-batches-py.tar.gz",
    "cifar-10-python.tar.gz",
    "cifar-10-batches-py-target_archive",
)
_CIFAR10_BATCHES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch")


def keras_datasets_dir() -> Path:
    """Keras's download cache: $KERAS_HOME/datasets, else ~/.keras/datasets."""
    home = os.environ.get("KERAS_HOME") or os.path.join("~", ".keras")
    return Path(os.path.expanduser(home)) / "datasets"


def _mnist() -> Arrays:
    path = keras_datasets_dir() / "mnist.npz"
    if not path.is_file():
        raise DataError(f"mnist: {path} not found; download {MNIST_URL} there (no network here)")
    try:
        with np.load(path, allow_pickle=False) as f:
            x_train, y_train, x_val, y_val = (
                f[k] for k in ("x_train", "y_train", "x_test", "y_test")
            )
    except (OSError, ValueError, KeyError) as err:
        raise DataError(f"mnist: {path} is not Keras's mnist.npz ({err})") from None
    if x_train.ndim != 3 or x_val.shape[1:] != x_train.shape[1:]:
        raise DataError(f"mnist: {path} holds images of shape {x_train.shape}, not (n, 28, 28)")
    return Arrays(
        x_train[..., np.newaxis].astype("uint8"),
        y_train.astype("int32"),
        x_val[..., np.newaxis].astype("uint8"),
        y_val.astype("int32"),
        num_classes=10,
    )


class _NumpyUnpickler(pickle.Unpickler):
    """Unpickles the plain dicts of arrays in CIFAR's files, and refuses anything else."""

    _ALLOWED = frozenset({("numpy", "ndarray"), ("numpy", "dtype")})
    _RECONSTRUCT = frozenset({"numpy.core.multiarray", "numpy._core.multiarray"})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):  # bytes in protocol 2 written by Python 3
            return codecs.encode
        if module in self._RECONSTRUCT and name == "_reconstruct":
            return np._core.multiarray._reconstruct
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _cifar_batch(stream: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        batch = _NumpyUnpickler(stream, encoding="bytes").load()
        x = np.asarray(batch[b"data"], "uint8").reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        y = np.asarray(batch[b"labels"], "int32")
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as err:
        raise DataError(f"cifar10: {where} is not a CIFAR-10 python batch ({err})") from None
    if len(y) != len(x):
        raise DataError(f"cifar10: {where} holds {len(x)} images and {len(y)} labels")
    return x, y


def _cifar10() -> Arrays:
    root = keras_datasets_dir()
    batches: list[tuple[np.ndarray, np.ndarray]] = []
    folder = next((root / d for d in _CIFAR10_DIRS if (root / d).is_dir()), None)
    archive = next((root / a for a in _CIFAR10_ARCHIVES if (root / a).is_file()), None)
    if folder is not None:
        for name in _CIFAR10_BATCHES:
            path = folder / name
            if not path.is_file():
                raise DataError(f"cifar10: {path} not found (the folder is incomplete)")
            with path.open("rb") as f:
                batches.append(_cifar_batch(f, str(path)))
    elif archive is not None:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for name in _CIFAR10_BATCHES:
                    member = tar.extractfile(f"cifar-10-batches-py/{name}")
                    if member is None:
                        raise KeyError(name)
                    batches.append(_cifar_batch(io.BytesIO(member.read()), f"{archive}:{name}"))
        except (OSError, tarfile.TarError, KeyError) as err:
            raise DataError(
                f"cifar10: {archive} is not the CIFAR-10 python archive ({err})"
            ) from None
    else:
        raise DataError(
            f"cifar10: {root / _CIFAR10_ARCHIVES[0]} not found (nor the extracted "
            f"{root / _CIFAR10_DIRS[0]}/); download {CIFAR10_URL} there (no network here)"
        )
    x_train = np.concatenate([x for x, _ in batches[:-1]])
    y_train = np.concatenate([y for _, y in batches[:-1]])
    return Arrays(x_train, y_train, *batches[-1], num_classes=10)


# --- files: TFRecord and image folders -----------------------------------------------------------


def _glob(pattern: str, key: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(f))
    if not files:
        raise DataError(f"{key}: no files match {pattern!r}")
    return files


@cache
def _count_records(path: str, size: int, mtime_ns: int) -> int:
    n, offset = 0, 0
    with open(path, "rb") as f:
        while offset < size:
            header = f.read(12)  # uint64 payload length, uint32 masked CRC of the length
            if len(header) < 12:
                offset = size + 1
                break
            (length,) = struct.unpack("<Q", header[:8])
            offset += 12 + length + 4  # header, payload, uint32 masked CRC of the payload
            f.seek(offset)
            n += 1
    if offset != size:
        raise DataError(
            f"{path}: not an uncompressed TFRecord file, or truncated (record {n} ends past the "
            f"file's {size} bytes)"
        )
    return n


def count_records(path: str) -> int:
    """Records in an uncompressed TFRecord file, read from their 12-byte headers alone.

    Each count is kept for the process (keyed by path, size and modification time), so every rank
    counts every file once and gets the same numbers without communicating.

    Raises:
      DataError: the file is not an uncompressed TFRecord file, or is truncated.
    """
    stat = os.stat(path)
    return _count_records(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def _first_record(path: str) -> bytes:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(12)[:8])
        return f.read(length)


def _check_example(path: str) -> None:
    """The first record has the features this source reads, or a one-line error naming the file."""
    try:
        example = tf.train.Example.FromString(_first_record(path))
    except DecodeError as err:
        raise DataError(f"{path}: the first record is not a tf.train.Example ({err})") from None
    features = example.features.feature
    image, label = features.get("image"), features.get("label")
    if image is None or image.WhichOneof("kind") != "bytes_list":
        raise DataError(f"{path}: records need a feature 'image' of encoded PNG/JPEG bytes")
    if label is None or len(label.int64_list.value) != 1:
        raise DataError(f"{path}: records need a feature 'label' holding one int64 class id")


def _tfrecord(data: Any) -> RecordFiles:
    files = _glob(data.path, "data.path")
    if data.val_path:
        train, val = files, _glob(data.val_path, "data.val_path")
    elif len(files) < 2:
        raise DataError(
            f"data.path: {data.path!r} matches one file; holding out validation files needs "
            "two or more, or set data.val_path"
        )
    else:
        train_ids, val_ids = _split_ids(len(files), data.validation_fraction, data.seed)
        train, val = [files[i] for i in train_ids], [files[i] for i in val_ids]
    train_counts, val_counts = [count_records(f) for f in train], [count_records(f) for f in val]
    for key, name, counts in (
        ("data.path", "training", train_counts),
        ("data.val_path" if data.val_path else "data.path", "validation", val_counts),
    ):
        if sum(counts) == 0:
            raise DataError(f"{key}: the {name} files hold no records")
    _check_example(next(f for f, n in zip(train, train_counts, strict=True) if n))
    return RecordFiles(
        train,
        train_counts,
        val,
        val_counts,
        shape=tuple(data.shape),
        num_classes=data.num_classes,
        pattern=data.path,
    )


def _list_images(root: Path, class_names: list[str] | None, key: str) -> tuple[list, list, list]:
    """Image paths and class ids under root/<class>/ (sorted), and the class names."""
    if not root.is_dir():
        raise DataError(f"{key}: {str(root)!r} is not a directory")
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    names = class_names or folders
    unknown = sorted(set(folders) - set(names))
    if unknown:
        raise DataError(f"{key}: class folder(s) {', '.join(unknown)} are not in data.path")
    if len(names) < 2:
        raise DataError(f"{key}: {str(root)!r} needs one folder per class, two or more")
    paths, labels = [], []
    for label, name in enumerate(names):
        found = sorted(
            str(p)
            for p in (root / name).rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
        )
        paths += found
        labels += [label] * len(found)
    if not paths:
        raise DataError(f"{key}: no {'/'.join(IMAGE_SUFFIXES)} files under {str(root)!r}")
    return paths, labels, names


def _image_dir(data: Any) -> ImageFiles:
    paths, labels, names = _list_images(Path(os.path.expanduser(data.path)), None, "data.path")
    if data.val_path:
        val_paths, val_labels, _ = _list_images(
            Path(os.path.expanduser(data.val_path)), names, "data.val_path"
        )
    else:
        if len(paths) < 2:
            raise DataError(f"data.path: {data.path!r} holds a single image")
        train_ids, val_ids = _split_ids(len(paths), data.validation_fraction, data.seed)
        val_paths, val_labels = [paths[i] for i in val_ids], [labels[i] for i in val_ids]
        paths, labels = [paths[i] for i in train_ids], [labels[i] for i in train_ids]
    return ImageFiles(
        paths,
        np.asarray(labels, "int32"),
        val_paths,
        np.asarray(val_labels, "int32"),
        shape=tuple(data.shape),
        class_names=names,
        root=data.path,
    )


def load(data: Any) -> Source:
    """The data set a config's `data` section names: in memory, or files to read each epoch.

    Raises:
      DataError: a missing or malformed file, or data that do not fit together.
    """
    if data.source == "digits":
        return _digits(data.seed, data.validation_fraction)
    if data.source == "synthetic" and data.kind == "tokens":
        (length,) = data.shape
        return _synthetic_tokens(
            length,
            data.vocab_size,
            data.num_classes,
            data.num_samples,
            data.seed,
            data.validation_fraction,
        )
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
    if data.source == "mnist":
        return _mnist()
    if data.source == "cifar10":
        return _cifar10()
    if data.source == "tfrecord":
        return _tfrecord(data)
    if data.source == "image_dir":
        return _image_dir(data)
    raise DataError(f"unknown data source {data.source!r}")


# --- decoding, and files kept in memory ----------------------------------------------------------


def _decode_image(encoded: tf.Tensor, shape: tuple[int, int, int]) -> tf.Tensor:
    """PNG/JPEG/BMP/GIF bytes to uint8 [height, width, channels] of `shape` (resized if needed)."""
    image = tf.io.decode_image(encoded, channels=shape[2], expand_animations=False)
    image = tf.image.resize(image, shape[:2])
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def _example_parser(source: RecordFiles) -> Any:
    spec = {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }
    message = f"{source.pattern}: a label outside [0, {source.num_classes}) (data.num_classes)"

    def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        example = tf.io.parse_single_example(record, spec)
        label = example["label"]
        checks = [
            tf.debugging.assert_non_negative(label, message=message),
            tf.debugging.assert_less(label, tf.constant(source.num_classes, tf.int64), message),
        ]
        with tf.control_dependencies(checks):
            return _decode_image(example["image"], source.shape), tf.cast(label, tf.int32)

    return parse


def _image_reader(source: ImageFiles) -> Any:
    return lambda path, label: (_decode_image(tf.io.read_file(path), source.shape), label)


def _read_records(files: list[str] | tf.Tensor) -> tf.data.Dataset:
    """The records of `files`, `_CYCLE` files at a time, in an order fixed by the file list."""
    return tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset,
        cycle_length=_CYCLE,
        block_length=1,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def available_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup v2 memory limit."""
    available = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return 0
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.is_file() and used.is_file() and limit.read_text().strip() != "max":  # a container
        available = min(available, int(limit.read_text()) - int(used.read_text()))
    return max(available, 0)


def decoded_bytes(source: Source) -> int:
    """Memory the decoded training and validation data take (uint8 pixels, int32 labels)."""
    if isinstance(source, Arrays):
        return sum(a.nbytes for a in (source.x_train, source.y_train, source.x_val, source.y_val))
    if isinstance(source, RecordFiles):
        samples = sum(source.train_counts) + sum(source.val_counts)
    else:
        samples = len(source.train_paths) + len(source.val_paths)
    return samples * (math.prod(source.shape) + 4)


def fits_in_memory(source: Source, local_size: int = 1, available: int | None = None) -> bool:
    """Whether every rank on this host can keep its own decoded copy of `source`.

    The rule: `local_size` copies take at most 1/4 of the available memory (the copy into
    TensorFlow briefly doubles one, and training needs the rest). Sources in memory always fit.
    """
    if isinstance(source, Arrays):
        return True
    free = available_memory() if available is None else available
    return decoded_bytes(source) * local_size <= free // _CACHE_SHARE


def _decode_all(images: tf.data.Dataset, count: int, shape: tuple, where: str) -> tuple:
    x, y = np.empty((count, *shape), "uint8"), np.empty(count, "int32")
    n = 0
    try:
        for x_batch, y_batch in images.batch(256).prefetch(tf.data.AUTOTUNE).as_numpy_iterator():
            if n + len(x_batch) > count:
                raise DataError(f"{where}: more records than counted ({count}); files changed?")
            x[n : n + len(x_batch)], y[n : n + len(y_batch)] = x_batch, y_batch
            n += len(x_batch)
    except tf.errors.InvalidArgumentError as err:  # an undecodable image, a label out of range
        raise DataError(f"{where}: {err.message.splitlines()[0]}") from None
    if n != count:
        raise DataError(f"{where}: {n} records read, {count} counted; did the files change?")
    return x, y


def decode_into_memory(source: Source) -> Arrays:
    """Every training and validation sample of `source`, decoded once, as uint8 arrays.

    From then on the data are sharded like arrays: one permutation of all samples per epoch.
    """
    if isinstance(source, Arrays):
        return source
    if isinstance(source, RecordFiles):
        parse = _example_parser(source)
        train = _read_records(source.train_files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        val = _read_records(source.val_files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        train_n, val_n = sum(source.train_counts), sum(source.val_counts)
        where = source.pattern
    else:
        read = _image_reader(source)
        train, val = (
            tf.data.Dataset.from_tensor_slices((paths, labels)).map(
                read, num_parallel_calls=tf.data.AUTOTUNE
            )
            for paths, labels in (
                (source.train_paths, source.train_labels),
                (source.val_paths, source.val_labels),
            )
        )
        train_n, val_n = len(source.train_paths), len(source.val_paths)
        where = source.root
    x_train, y_train = _decode_all(train, train_n, source.shape, where)
    x_val, y_val = _decode_all(val, val_n, source.shape, where)
    return Arrays(x_train, y_train, x_val, y_val, num_classes=source.num_classes)


# --- each rank's datasets ------------------------------------------------------------------------


def _steps(per_rank: int, batch: int, what: str, max_steps: int | None) -> int:
    steps = per_rank // batch
    if steps < 1:
        raise DataError(f"{what} hold {per_rank} samples per rank: not one batch of {batch}")
    return min(steps, max_steps) if max_steps else steps


def records_per_rank(counts: list[int], size: int) -> tuple[str, int]:
    """How TFRecord files are split over `size` ranks, and the records every rank can count on.

    Returns:
      ("file", records of the floor(files / size) smallest files) when there are at least as many
      files as ranks, else ("record", records // size).
    """
    if len(counts) >= size:
        return "file", sum(sorted(counts)[: len(counts) // size])
    return "record", sum(counts) // size


def _record_shard(source: RecordFiles, rank: int, size: int, seed: int) -> Any:
    """A function of the epoch: this rank's serialized records of it, before shuffling."""
    files = tf.constant(source.train_files)
    num_files, total = len(source.train_files), sum(source.train_counts)
    if records_per_rank(source.train_counts, size)[0] == "file":
        positions = tf.range(rank, num_files, size, dtype=tf.int64)
        return lambda epoch: _read_records(
            tf.gather(files, _epoch_ids(positions, num_files, seed, epoch))
        )

    def records(epoch: tf.Tensor) -> tf.data.Dataset:
        def mine(g: tf.Tensor, record: tf.Tensor) -> tf.Tensor:
            # Record g goes to rank perm(g) % size; perm is a bijection: disjoint, even shards.
            perm = tf.random.experimental.index_shuffle(g, _seed_pair(seed, epoch), total - 1)
            return perm % size == rank

        return _read_records(files).enumerate().filter(mine).map(lambda g, record: record)

    return records


def _shuffled(records: tf.data.Dataset, seed: int, rank: int, epoch: tf.Tensor) -> Any:
    """Each window of records permuted by a stateless function of (seed, rank, epoch, window).

    Not `Dataset.shuffle`: it cannot take a seed computed in the pipeline once a global seed is set.
    """

    def permute(window_index: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
        # Negative "steps": never the seed of an augmented batch (steps count from 0).
        key_seed = augment_seed(seed, rank, epoch, -1 - window_index)
        keys = tf.random.stateless_uniform(tf.shape(window)[:1], key_seed)
        return tf.gather(window, tf.argsort(keys))

    return records.batch(_SHUFFLE_WINDOW).enumerate().map(permute).unbatch()


def train_dataset(
    source: Source,
    per_rank_batch_size: int,
    rank: int,
    size: int,
    *,
    seed: int = 0,
    augment: bool = False,
    initial_epoch: int = 0,
    max_steps: int | None = None,
    start_position: int = 0,
) -> tuple[tf.data.Dataset, int]:
    """This rank's training batches (x, y), epoch after epoch, and the steps of every epoch.

    Args:
      source: from `load` (or `decode_into_memory`).
      per_rank_batch_size: batch on this rank.
      rank, size: this rank and the worker count.
      seed: data seed, the same on every rank (shards, shuffling, augmentation).
      augment: random crop after padding, and flip, of image batches.
      initial_epoch: first epoch to produce (for a resumed run).
      max_steps: a cap on the steps per epoch; each epoch of the dataset is then that long.
      start_position: positions of `initial_epoch`'s permutation already trained on, by any worker
        count (elastic training after a reset); that first epoch then holds only the
        `remaining_steps(steps, per_rank_batch_size, size, start_position)` steps left, rank r
        taking positions start_position + r, start_position + r + size, ... . Arrays and image
        files only.

    Returns:
      (dataset, steps_per_epoch): a dataset that never ends, `steps` batches per epoch.

    Raises:
      DataError: too little data for one batch per rank, augmentation of non-images, or a
        start_position in TFRecord files (read by file, not by permutation position) or < 0.
    """
    batch = per_rank_batch_size
    if start_position < 0 or (start_position and isinstance(source, RecordFiles)):
        raise DataError(
            f"start_position {start_position}: must be >= 0, and 0 for TFRecord files that are "
            "not decoded into memory (they are sharded by file, not by permutation position)"
        )
    if augment and len(source.input_shape) != 3:
        raise DataError(
            f"data.augment: needs images (height, width, channels), got samples of shape "
            f"{source.input_shape}"
        )
    if isinstance(source, Arrays):
        n = len(source.x_train)
        steps = _steps(n // size, batch, f"{n} training samples on {size} ranks", max_steps)
        arrays = (source.x_train, source.y_train)
        batches = _gathered(
            arrays, batch, rank, size, seed, True, initial_epoch, steps, start_position
        )
        return _finish(batches, seed, rank, augment), steps
    if isinstance(source, ImageFiles):
        n = len(source.train_paths)
        steps = _steps(n // size, batch, f"{n} training images on {size} ranks", max_steps)
        paths, labels = tf.constant(source.train_paths), tf.constant(source.train_labels)
        read = _image_reader(source)
        elements = _positioned_epochs(
            n, steps, batch, rank, size, seed, True, initial_epoch, start_position
        )
        decoded = elements.map(
            lambda epoch, step, i: (epoch, step, *read(paths[i], labels[i])),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    else:
        how, per_rank = records_per_rank(source.train_counts, size)
        what = f"{source.pattern!r} ({len(source.train_files)} files) sharded by {how}"
        steps = _steps(per_rank, batch, what, max_steps)
        records = _record_shard(source, rank, size, seed)

        def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
            shuffled = _shuffled(records(epoch), seed, rank, epoch)
            return _tagged(epoch, batch, shuffled.take(steps * batch))

        parse = _example_parser(source)
        decoded = _epochs(initial_epoch, one_epoch).map(
            lambda epoch, step, record: (epoch, step, *parse(record)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    batches = decoded.batch(batch, drop_remainder=True).map(
        lambda epoch, step, x, y: (epoch[0], step[0], x, y)
    )
    return _finish(batches, seed, rank, augment), steps


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


def validation_dataset(source: Source, batch_size: int, rank: int, size: int) -> tf.data.Dataset:
    """This rank's part of the validation data, (x, y) batches; together the ranks cover it once.

    Arrays and image files: strided, rank r takes samples r, r+size, .... TFRecord files: by file
    (files r, r+size, ... of the sorted list) when every rank gets at least one record that way,
    else by record (`Dataset.shard`).

    Raises:
      DataError: fewer validation samples than ranks (a rank would have nothing to evaluate).
    """
    if isinstance(source, Arrays):
        shard = validation_shard((source.x_val, source.y_val), batch_size, rank, size)
        return shard.map(lambda x, y: (_to_model(x), y)).prefetch(tf.data.AUTOTUNE)
    if isinstance(source, ImageFiles):
        n = len(source.val_paths)
        if n < size:
            raise DataError(f"{n} validation images are fewer than the {size} ranks")
        paths = tf.data.Dataset.from_tensor_slices((source.val_paths, source.val_labels))
        images = paths.shard(size, rank).map(
            _image_reader(source), num_parallel_calls=tf.data.AUTOTUNE
        )
    else:
        files, counts = source.val_files, source.val_counts
        if sum(counts) < size:
            raise DataError(
                f"{sum(counts)} validation records are fewer than the {size} ranks "
                f"({source.pattern!r})"
            )
        if len(files) >= size and all(sum(counts[r::size]) for r in range(size)):
            records = _read_records(files[rank::size])
        else:
            records = _read_records(files).shard(size, rank)
        images = records.map(_example_parser(source), num_parallel_calls=tf.data.AUTOTUNE)
    return (
        images.batch(batch_size)
        .map(lambda x, y: (_to_model(x), y), num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )
