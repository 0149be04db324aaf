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

Modules:
  errors       `DataError`.
  sharding     the sharding arithmetic in plain integers (no TensorFlow): steps, positions, checks.
  sources      the source types and `load`; keras_cache: Keras's cached mnist and cifar10.
  formats      TFRecord framing and `tf.train.Example`s, image decoding, reading records.
  memory       whether decoded files fit in memory, and decoding them once.
  order        the per-epoch permutation and each rank's (epoch, step, id) streams, in TensorFlow.
  augment      per-batch stateless image augmentation.
  pipeline     `shard_dataset`, `train_dataset`, `validation_dataset`: the tf.data pipelines.

Only `errors` and `sharding` load when this package is imported; every other name resolves on
first use, so `import hvd_train.data.sharding` does not import TensorFlow. Each name lives in its
module: patch it there (`hvd_train.data.memory.available_memory`), where the code reads it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hvd_train.data.errors import DataError
from hvd_train.data.sharding import records_per_rank, remaining_steps, steps_per_epoch

if TYPE_CHECKING:
    from hvd_train.data.augment import augment_images, augment_seed
    from hvd_train.data.formats import IMAGE_SUFFIXES, count_records
    from hvd_train.data.keras_cache import CIFAR10_URL, MNIST_URL, keras_datasets_dir
    from hvd_train.data.memory import (
        available_memory,
        decode_into_memory,
        decoded_bytes,
        fits_in_memory,
    )
    from hvd_train.data.order import shard_indices
    from hvd_train.data.pipeline import (
        shard_dataset,
        train_dataset,
        validation_dataset,
        validation_shard,
    )
    from hvd_train.data.sources import Arrays, ImageFiles, RecordFiles, Source, load

# Names that import TensorFlow (or build on modules that do), by the module that defines them.
_LAZY = {
    "augment_images": "augment",
    "augment_seed": "augment",
    "IMAGE_SUFFIXES": "formats",
    "count_records": "formats",
    "CIFAR10_URL": "keras_cache",
    "MNIST_URL": "keras_cache",
    "keras_datasets_dir": "keras_cache",
    "available_memory": "memory",
    "decode_into_memory": "memory",
    "decoded_bytes": "memory",
    "fits_in_memory": "memory",
    "shard_indices": "order",
    "shard_dataset": "pipeline",
    "train_dataset": "pipeline",
    "validation_dataset": "pipeline",
    "validation_shard": "pipeline",
    "Arrays": "sources",
    "ImageFiles": "sources",
    "RecordFiles": "sources",
    "Source": "sources",
    "load": "sources",
}
_SUBMODULES = frozenset(
    {"augment", "formats", "keras_cache", "memory", "order", "pipeline", "sources"}
)

__all__ = [
    "CIFAR10_URL",
    "IMAGE_SUFFIXES",
    "MNIST_URL",
    "Arrays",
    "DataError",
    "ImageFiles",
    "RecordFiles",
    "Source",
    "augment_images",
    "augment_seed",
    "available_memory",
    "count_records",
    "decode_into_memory",
    "decoded_bytes",
    "fits_in_memory",
    "keras_datasets_dir",
    "load",
    "records_per_rank",
    "remaining_steps",
    "shard_dataset",
    "shard_indices",
    "steps_per_epoch",
    "train_dataset",
    "validation_dataset",
    "validation_shard",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # resolved once; later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})
