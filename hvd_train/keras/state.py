"""Keeping per-rank model state in agreement: the start-of-training broadcast, averaged BatchNorm
statistics (exact metrics over ranks: `hvd_train.keras.metrics`).

BatchNorm: each rank's moving mean and variance follow its own shard; they are averaged over ranks
(the mean of the per-rank moving variances, not the variance of the union) before evaluation and
checkpointing, so every variable of the model is identical on every rank at those points.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_train import comm
from hvd_train.keras import compat, embedding, randomness


def average_non_trainable(model: Any) -> None:
    """Average the model's floating-point non-trainable variables (BatchNorm moving statistics)
    over ranks, in one grouped allreduce (collective)."""
    if comm.size() == 1:
        return
    floats = ("float16", "bfloat16", "float32", "float64")
    variables = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).name in floats]
    if not variables:
        return
    averaged = comm.grouped_allreduce(
        [compat.value(v) for v in variables], op=comm.Average, name="hvd_train.non_trainable"
    )
    for var, value in zip(variables, averaged, strict=True):
        var.assign(value)


def broadcast_model_state(model: Any, root_rank: int = 0) -> None:
    """Make every rank start from root's weights and optimizer state (collective); then each
    rank's random streams are made its own (`randomness.derive_rank_streams`).

    Builds the optimizer first if needed, so that its slots (momentum, ...) exist and are sent too;
    after a resume, the restored state travels the same way. Root's random state (seed and number
    of draws) travels too, as the base each rank derives its stream from.

    Raises:
      ValueError: the model has no variables yet (build it, e.g. with keras.Input, first).
    """
    if not model.built or not model.variables:
        raise ValueError(
            f"model {model.name!r} has no variables to broadcast: build it (keras.Input or "
            "model.build) before training"
        )
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables)
    if optimizer is not None:
        if not compat.optimizer_built(optimizer):
            optimizer.build(model.trainable_variables)
        variables += compat.optimizer_variables(optimizer)
    # A table's row shards (and their slots) are per rank: each holds other rows.
    comm.broadcast_variables([v for v in variables if not embedding.is_row_sharded(v)], root_rank)
    # Not root's masks on every rank: each rank draws its own (rank r's: seed rank_seed(seed, r)).
    randomness.derive_rank_streams(model, comm.rank())


def agreed_variables(model: Any) -> list[Any]:
    """The model's variables that are equal on every rank after the broadcast: all but the random
    state and a table's row shards (per rank by design). What digests, fingerprints and
    consistency checks look at."""
    kept = randomness.without_random_state(model, model.variables)
    return [v for v in kept if not embedding.is_row_sharded(v)]


def weights_digest(variables: Iterable[Any]) -> str:
    """sha256 (hex) of the variables' bytes, in order: equal on ranks that hold equal values
    (pass `agreed_variables(model)` or a subset, never the random state)."""
    digest = hashlib.sha256()
    for variable in variables:
        digest.update(np.ascontiguousarray(variable.numpy()).tobytes())
    return digest.hexdigest()
