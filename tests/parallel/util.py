"""Shared pieces of the parallel tests: the digits data, models and cross-rank comparisons."""

import keras
import numpy as np
from sklearn.datasets import load_digits

import models
from hvd_train import comm

_x, _y = load_digits(return_X_y=True)
DIGITS_X = (_x / 16.0).astype("float32")
DIGITS_Y = _y.astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp(seed: int) -> keras.Model:
    """The equivalence MLP (no BatchNorm, no dropout), initialised from `seed`."""
    keras.utils.set_random_seed(seed)
    return models.build("mlp", (64,), 10)


def rank_seed() -> int:
    """Rank 0 initialises like the reference (seed 0), other ranks differently: the broadcast of
    initial weights must make them agree."""
    return 0 if comm.rank() == 0 else 1000 + comm.rank()


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def spread_over_ranks(values: list[np.ndarray]) -> float:
    """Largest difference between any rank's arrays and rank 0's (0.0 when all agree)."""
    flat = np.concatenate([v.ravel() for v in values]).astype("float64")
    gathered = comm.allgather_object(flat)
    return max(float(np.max(np.abs(g - gathered[0]))) for g in gathered)
