"""File formats: TFRecord framing and `tf.train.Example` features, and image decoding.

Counting a TFRecord file's records from their headers (every rank gets the same counts without
communicating), checking the first record's features, parsing records and decoding PNG/JPEG/BMP/GIF
bytes into uint8 images of the configured shape, and reading files in one fixed record order.
"""

from __future__ import annotations

import os
import struct
from functools import cache
from typing import TYPE_CHECKING, Any

import tensorflow as tf
from google.protobuf.message import DecodeError

from hvd_train.data.errors import DataError

if TYPE_CHECKING:
    from hvd_train.data.sources import ImageFiles, RecordFiles

_CYCLE = 8  # files read at once; a constant, so the record order is the same on every machine
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


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


def check_example(path: str) -> None:
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


def decode_image(encoded: tf.Tensor, shape: tuple[int, int, int]) -> tf.Tensor:
    """PNG/JPEG/BMP/GIF bytes to uint8 [height, width, channels] of `shape` (resized if needed)."""
    image = tf.io.decode_image(encoded, channels=shape[2], expand_animations=False)
    image = tf.image.resize(image, shape[:2])
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def example_parser(source: RecordFiles) -> Any:
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
            return decode_image(example["image"], source.shape), tf.cast(label, tf.int32)

    return parse


def image_reader(source: ImageFiles) -> Any:
    return lambda path, label: (decode_image(tf.io.read_file(path), source.shape), label)


def read_records(files: list[str] | tf.Tensor) -> tf.data.Dataset:
    """The records of `files`, `_CYCLE` files at a time, in an order fixed by the file list."""
    return tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset,
        cycle_length=_CYCLE,
        block_length=1,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
