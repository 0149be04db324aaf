"""Memory: whether decoded files fit on every rank of a host, and decoding them once to arrays.

`fits_in_memory` reads `available_memory` of this module at call time, so a test patches
`hvd_train.data.memory.available_memory` (or passes `available=`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import tensorflow as tf

from hvd_train.data.errors import DataError
from hvd_train.data.formats import example_parser, image_reader, read_records
from hvd_train.data.sources import Arrays, RecordFiles, Source

_CACHE_SHARE = 4  # decoded data is cached when all ranks of a host need <= 1/4 of free memory


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
        parse = example_parser(source)
        train = read_records(source.train_files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        val = read_records(source.val_files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        train_n, val_n = sum(source.train_counts), sum(source.val_counts)
        where = source.pattern
    else:
        read = image_reader(source)
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
