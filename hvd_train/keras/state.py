"""Keeping per-rank model state in agreement: exact metrics, averaged BatchNorm statistics.

Metrics: averaging per-rank means is wrong whenever ranks see different numbers of samples (an
uneven validation split, a last partial batch). Keras metrics keep additive states (a total and a
count, true positives, a confusion matrix, ...), so summing each state over ranks and computing the
result from the sums gives exactly what one process would report on all the data.

BatchNorm: each rank's moving mean and variance follow its own shard; they are averaged over ranks
(the mean of the per-rank moving variances, not the variance of the union) before evaluation and
checkpointing, so every variable of the model is identical on every rank at those points.
"""

from __future__ import annotations

import types
from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_train.dist import stack


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
    if getattr(model, "_hvd_reduces_metrics", False) or hvd.size() == 1:
        return
    local_result = model.get_metrics_result

    def get_metrics_result(self: Any) -> dict[str, Any]:
        if not tf.executing_eagerly():
            return local_result()
        variables = _metric_variables(self)
        local = [stack.value(v) for v in variables]
        summed = hvd.grouped_allreduce(local, op=hvd.Sum, name="hvd_train.metric_states")
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
    if hvd.size() == 1:
        return
    floats = ("float16", "bfloat16", "float32", "float64")
    variables = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).name in floats]
    if not variables:
        return
    averaged = hvd.grouped_allreduce(
        [stack.value(v) for v in variables], op=hvd.Average, name="hvd_train.non_trainable"
    )
    for var, value in zip(variables, averaged, strict=True):
        var.assign(value)
