"""Keras's cached mnist and cifar10, read with NumPy and a restricted unpickler: never downloaded.

Looks where Keras 2 and Keras 3 leave them ($KERAS_HOME/datasets, else ~/.keras/datasets); a
missing file is a one-line `DataError` naming the file to put there and the address to get it from.
"""

from __future__ import annotations

import codecs
import io
import os
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from hvd_train.data.errors import DataError
from hvd_train.data.sources import Arrays

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


def mnist() -> Arrays:
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


def cifar10() -> Arrays:
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
