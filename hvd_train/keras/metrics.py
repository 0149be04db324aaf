"""Exact metrics over ranks, and only where every rank asks for them.

Averaging per-rank means is wrong whenever ranks see different numbers of samples (an uneven
validation split, a last partial batch). Keras metrics keep additive states (a total and a count,
true positives, a confusion matrix, ...), so summing each state over ranks and computing the result
from the sums gives exactly what one process would report on all the data.

That sum is a collective, so it runs only where every rank runs it:
  - `reduce_metrics_over_ranks`, called on every rank (`hvd_train.evaluate` calls it once, after
    its local evaluation);
  - the reports of a `fit()` that runs `AverageMetrics` (`report_over_ranks`): the trainer's
    internal report (`compat.METRICS_REPORT`, what Keras calls at each epoch's end and at the end
    of the validation inside fit) is hooked, not `model.get_metrics_result`, which stays local, so
    a rank-0-only callback may read it, and a plain `evaluate` or `predict` after fit is local.
Inside the compiled step (per-batch logs) nothing changes: no collective runs there, so ranks may
take different numbers of evaluation steps.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from hvd_train import comm
from hvd_train.keras import compat

_OWNER = "_hvd_train_metrics_owner"  # the callback whose fit() reduces the model's reports


def _metric_variables(model: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for metric in model.metrics:
        for var in metric.variables:
            seen.setdefault(id(var), var)
    return list(seen.values())


@contextmanager
def _summed_over_ranks(model: Any) -> Iterator[None]:
    """Inside: the model's metric states hold their sums over ranks (one grouped allreduce, a
    collective; none with one worker); after: this rank's own states again."""
    if comm.size() == 1:
        yield
        return
    variables = _metric_variables(model)
    local = [compat.value(v) for v in variables]
    summed = comm.grouped_allreduce(local, op=comm.Sum, name="hvd_train.metric_states")
    for var, value in zip(variables, summed, strict=True):
        var.assign(value)
    try:
        yield
    finally:
        for var, value in zip(variables, local, strict=True):
            var.assign(value)


def _python(value: Any) -> Any:
    """A metric result as Keras's evaluate returns it: a float, or an array for a vector."""
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array


def reduce_metrics_over_ranks(model: Any) -> dict[str, Any]:
    """The model's metric results over all ranks, exactly (a collective: call it on every rank).

    Each metric state (totals, counts, ...) is summed over ranks, the results are computed from
    the sums, and this rank's states are put back; so the result equals one process's on the
    union of the data every rank has accumulated since the metrics were last reset, and is the
    same on every rank. With one worker, no collective runs.

    Returns:
      {metric name: value}, as `model.evaluate(..., return_dict=True)` names them (floats, arrays
      for vector-valued metrics).
    """
    with _summed_over_ranks(model):
        results = model.get_metrics_result()
        return {name: _python(value) for name, value in sorted(results.items())}


def report_over_ranks(model: Any, owner: Any) -> None:
    """Reduce the metrics fit() reports over ranks, in the fit() whose callbacks hold `owner`.

    The hook replaces the trainer's internal report on this model only (an instance attribute),
    and sums there only when the Keras loop calling it (fit at the epoch's end, or the validation
    evaluate that fit runs with its callbacks) holds `owner` among its callbacks; any other
    caller, e.g. an `evaluate` a rank-0-only callback runs inside fit, gets the local report. The
    collective therefore runs exactly where fit runs it on every rank. With one worker nothing is
    installed. Another owner of the same model takes the hook over (the last fit's callback).
    """
    if comm.size() == 1:
        return
    object.__setattr__(model, _OWNER, owner)
    if compat.METRICS_REPORT in vars(model):
        return
    local_report = getattr(model, compat.METRICS_REPORT)

    def report(self: Any, logs: Any) -> Any:
        # The calling loop's `callbacks` (a CallbackList): fit's own, or the one fit passes to
        # its validation evaluate; an evaluate started anywhere else has a list of its own.
        loop_callbacks = sys._getframe(1).f_locals.get("callbacks")
        if getattr(self, _OWNER, None) not in getattr(loop_callbacks, "callbacks", ()):
            return local_report(logs)
        with _summed_over_ranks(self):
            return local_report(logs)

    object.__setattr__(model, compat.METRICS_REPORT, types.MethodType(report, model))


def report_locally(model: Any, owner: Any) -> None:
    """Undo `report_over_ranks` if `owner` installed the hook (at the end of its fit())."""
    if getattr(model, _OWNER, None) is not owner:
        return
    object.__delattr__(model, _OWNER)
    if compat.METRICS_REPORT in vars(model):
        object.__delattr__(model, compat.METRICS_REPORT)
