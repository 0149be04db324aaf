"""Each rank's tf.data pipelines: training batches epoch after epoch, and its validation part.

`shard_dataset` (arrays, the public API) and `train_dataset` (every source, the trainer's) take
their shard sizes, steps and checks from `sharding.py` and their sample order from `order.py`, so
both follow one rule and raise the same `DataError`s. Pixels stored as uint8 reach the model as
float32 in [0, 1]; augmentation (`augment.py`) is applied per batch, after batching.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_train.data.augment import augment_images, augment_seed
from hvd_train.data.errors import DataError
from hvd_train.data.formats import example_parser, image_reader, read_records
from hvd_train.data.order import epochs, positioned_epochs, record_shard, shuffled, tagged
from hvd_train.data.sharding import (
    check_ranks,
    check_start_position,
    record_steps,
    sample_count,
    shard_positions,
    steps_per_epoch,
    validation_by_file,
    validation_positions,
)
from hvd_train.data.sources import Arrays, ImageFiles, RecordFiles, Source


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
        positioned_epochs(
            len(arrays[0]), steps, batch, rank, size, seed, shuffle, initial_epoch, start_position
        )
        .batch(batch, drop_remainder=True)
        .map(
            lambda epoch, step, ids: (epoch[0], step[0], *(tf.gather(t, ids) for t in tensors)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    )


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

    Raises:
      DataError (a ValueError): arrays of different lengths, a rank outside 0..size - 1, fewer
        samples than ranks, or fewer than one batch per rank (`sharding.steps_per_epoch`).
    """
    check_ranks(rank, size)
    num_samples = sample_count([len(a) for a in arrays])
    steps = steps_per_epoch(num_samples, size, per_rank_batch_size)
    dataset = _gathered(
        arrays, per_rank_batch_size, rank, size, seed, shuffle, initial_epoch, steps
    ).map(lambda epoch, step, *batch: batch)
    return dataset.prefetch(tf.data.AUTOTUNE), steps


def _slice(positions: range) -> slice:
    """The same elements of an array or list as a strided range of positions."""
    return slice(positions.start, positions.stop, positions.step)


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
      DataError: a rank outside 0..size - 1, fewer samples than ranks or than one batch per rank
        (`sharding.steps_per_epoch`, `sharding.record_steps`), augmentation of non-images, or a
        start_position in TFRecord files (read by file, not by permutation position) or < 0.
    """
    batch = per_rank_batch_size
    check_start_position(start_position, by_file=isinstance(source, RecordFiles))
    if augment and len(source.input_shape) != 3:
        raise DataError(
            f"data.augment: needs images (height, width, channels), got samples of shape "
            f"{source.input_shape}"
        )
    check_ranks(rank, size)
    if isinstance(source, Arrays):
        n = sample_count([len(source.x_train), len(source.y_train)])
        steps = steps_per_epoch(n, size, batch, max_steps, "training samples")
        arrays = (source.x_train, source.y_train)
        batches = _gathered(
            arrays, batch, rank, size, seed, True, initial_epoch, steps, start_position
        )
        return _finish(batches, seed, rank, augment), steps
    if isinstance(source, ImageFiles):
        n = sample_count([len(source.train_paths), len(source.train_labels)])
        steps = steps_per_epoch(n, size, batch, max_steps, "training images")
        paths, labels = tf.constant(source.train_paths), tf.constant(source.train_labels)
        read = image_reader(source)
        elements = positioned_epochs(
            n, steps, batch, rank, size, seed, True, initial_epoch, start_position
        )
        decoded = elements.map(
            lambda epoch, step, i: (epoch, step, *read(paths[i], labels[i])),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    else:
        how, steps = record_steps(source.train_counts, size, batch, repr(source.pattern), max_steps)
        records = record_shard(source, rank, size, seed, how)

        def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
            mixed = shuffled(records(epoch), seed, rank, epoch)
            return tagged(epoch, batch, mixed.take(steps * batch))

        parse = example_parser(source)
        decoded = epochs(initial_epoch, one_epoch).map(
            lambda epoch, step, record: (epoch, step, *parse(record)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    batches = decoded.batch(batch, drop_remainder=True).map(
        lambda epoch, step, x, y: (epoch[0], step[0], x, y)
    )
    return _finish(batches, seed, rank, augment), steps


def validation_shard(
    arrays: tuple[np.ndarray, ...],
    batch_size: int,
    rank: int,
    size: int,
    equal_batches: bool = False,
) -> tf.data.Dataset:
    """This rank's 1/size of the validation data (strided; sizes may differ by one sample).

    No collective runs during evaluation, so ranks may take different numbers of steps; the
    metric states are summed over ranks afterwards (`keras.metrics.reduce_metrics_over_ranks`),
    which makes the result exactly that of one process on all the data. `equal_batches`: every
    rank runs as many batches (one of them may be a sample longer), for a model whose forward
    pass is a collective (a table split by rows).

    Raises:
      DataError: arrays of different lengths, a rank outside 0..size - 1, or fewer validation
        samples than ranks (a rank would have nothing to evaluate).
    """
    n = sample_count([len(a) for a in arrays])
    mine = validation_positions(n, rank, size)
    shard = tuple(a[_slice(mine)] for a in arrays)
    samples = tf.data.Dataset.from_tensor_slices(shard)
    return _batched(samples, len(mine), n, batch_size, size, equal_batches)


def _batched(
    samples: tf.data.Dataset, mine: int, n: int, batch_size: int, size: int, equal: bool
) -> tf.data.Dataset:
    """This rank's `mine` of `n` validation samples (a strided part) in batches; `equal`: as many
    batches as every other rank's part.

    Parts differ by at most one sample, so their batch counts differ only where the longer parts
    hold k * batch_size + 1 samples: those end in one batch of batch_size + 1 instead."""
    longest = -(-n // size)
    if equal and mine == longest and n % size and (longest - 1) % batch_size == 0:
        first = longest - 1 - batch_size
        return (
            samples.take(first)
            .batch(batch_size)
            .concatenate(samples.skip(first).batch(batch_size + 1))
        )
    return samples.batch(batch_size)


def validation_dataset(
    source: Source, batch_size: int, rank: int, size: int, equal_batches: bool = False
) -> tf.data.Dataset:
    """This rank's part of the validation data, (x, y) batches; together the ranks cover it once.

    Arrays and image files: strided, rank r takes samples r, r+size, .... TFRecord files: by file
    (files r, r+size, ... of the sorted list) when every rank gets at least one record that way,
    else by record (`Dataset.shard`). `equal_batches`: as many batches on every rank
    (`validation_shard`), for arrays and image files.

    Raises:
      DataError: fewer validation samples than ranks (a rank would have nothing to evaluate);
        equal_batches for TFRecord files read every epoch.
    """
    if isinstance(source, Arrays):
        arrays = (source.x_val, source.y_val)
        shard = validation_shard(arrays, batch_size, rank, size, equal_batches)
        return shard.map(lambda x, y: (_to_model(x), y)).prefetch(tf.data.AUTOTUNE)
    if isinstance(source, ImageFiles):
        n = sample_count([len(source.val_paths), len(source.val_labels)])
        positions = validation_positions(n, rank, size, "validation images")
        mine = _slice(positions)
        paths = tf.data.Dataset.from_tensor_slices(
            (source.val_paths[mine], source.val_labels[mine])
        )
        images = paths.map(image_reader(source), num_parallel_calls=tf.data.AUTOTUNE)
        batches = _batched(images, len(positions), n, batch_size, size, equal_batches)
    elif equal_batches:
        raise DataError(
            f"{source.pattern!r}: a model whose forward pass is a collective (a table split by "
            "rows) needs as many validation batches on every rank, which TFRecord files read "
            "every epoch cannot promise: decode them into memory (data.cache: true)"
        )
    else:
        files, counts = source.val_files, source.val_counts
        validation_positions(sum(counts), rank, size, "validation records", repr(source.pattern))
        if validation_by_file(counts, size):
            records = read_records([files[i] for i in shard_positions(len(files), rank, size)])
        else:  # record g to rank g % size, as `sharding.rank_of` has it
            records = read_records(files).shard(size, rank)
        images = records.map(example_parser(source), num_parallel_calls=tf.data.AUTOTUNE)
        batches = images.batch(batch_size)
    return batches.map(
        lambda x, y: (_to_model(x), y), num_parallel_calls=tf.data.AUTOTUNE
    ).prefetch(tf.data.AUTOTUNE)
