"""Image augmentation by stateless random ops: per-batch seeds of (seed, rank, epoch, step), so
ranks augment differently and reruns identically.

Every batch of images is zero-padded by 4 pixels, randomly cropped back and randomly flipped
left-right. `augment_seed` also seeds the window shuffle of TFRecord shards (`order.py`), with
negative steps.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

_PAD = 4  # augmentation: pixels of zero padding before the random crop


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
