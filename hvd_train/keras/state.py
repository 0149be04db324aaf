"""Keeping per-rank model state in agreement: the start-of-training broadcast, exact metrics,
averaged BatchNorm statistics.

Metrics: averaging per-rank means is wrong whenever ranks see different numbers of samples (an
uneven validation split, a last partial batch). Keras metrics keep additive states (a total and a
count, true positives, a confusion matrix, ...), so summing each state over ranks and computing the
result from the sums gives exactly what one process would report on all the data.

BatchNorm: each rank's moving mean and variance follow its own shard; they are averaged over ranks
(the mean of the per-rank moving variances, not the variance of the union) before evaluation and
checkpointing, so every variable of the model is identical on every rank at those points.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf

from hvd_train import comm
from hvd_train.keras import compat


def _metric_variables(model: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for metric in model.metrics:
        for var in metric.variables:
            seen.setdefault(id(var), var)
    return list(seen.values())


def reduce_metrics_over_ranks(model: Any) -> None:
    """Make `model.get_metrics_result()` (what fit/evaluate report at epoch end) global and exact.

    Called eagerly (the epoch-end logs, every `evaluate` result, History, CSV, TensorBoard,
    EarlyStopping and checkpoint monitors all read it), the metric states are summed over ranks,
    the results computed from the sums, and the local states put back. Inside the compiled step
    (per-batch logs) nothing changes: no collective runs there, so ranks may take different
    numbers of evaluation steps. Idempotent.
    """
    if getattr(model, "_hvd_reduces_metrics", False) or comm.size() == 1:
        return
    local_result = model.get_metrics_result

    def get_metrics_result(self: Any) -> dict[str, Any]:
        if not tf.executing_eagerly():
            return local_result()
        variables = _metric_variables(self)
        local = [compat.value(v) for v in variables]
        summed = comm.grouped_allreduce(local, op=comm.Sum, name="hvd_train.metric_states")
        for var, value in zip(variables, summed, strict=True):
            var.assign(value)
        try:
            return local_result()
        finally:
            for var, value in zip(variables, local, strict=True):
                var.assign(value)

    # An instance attribute: only this model's reporting changes, not the class.
    object.__setattr__(model, "get_metrics_result", types.MethodType(get_metrics_result, model))
    object.__setattr__(model, "_hvd_reduces_metrics", True)


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
    """Make every rank start from root's weights and optimizer state (collective).

    Builds the optimizer first if needed, so that its slots (momentum, ...) exist and are sent too;
    after a resume, the restored state travels the same way.

    Raises:
      ValueError: the model has no variables yet (build it, e.g. with keras.Input, first).
    """
    if not model.variables:
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
    comm.broadcast_variables(variables, root_rank)


def weights_digest(variables: Iterable[Any]) -> str:
    """sha256 (hex) of the variables' bytes, in order: equal on ranks that hold equal values."""
    digest = hashlib.sha256()
    for variable in variables:
        digest.update(np.ascontiguousarray(variable.numpy()).tobytes())
    return digest.hexdigest()
