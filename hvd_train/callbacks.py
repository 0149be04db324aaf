"""Keras callbacks that every distributed fit() needs: thin classes over `hvd_train.dist`."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np

from hvd_train import checkpoint, dist, faults

log = logging.getLogger("hvd_train")


class BroadcastInitialState(keras.callbacks.Callback):
    """Start every rank from rank 0's weights and optimizer state; checks the model is set up right.

    Put it in `callbacks` on every rank (it runs a collective: a callback added on rank 0 only hangs
    the job). Before the train function is built it turns XLA off (Horovod's ops have no XLA kernels
    in this build, and Keras turns jit_compile on by itself when a GPU is visible) and rejects
    optimizers that would not average (`dist.check_optimizer`). At train begin it broadcasts the
    state, and gives jit_compile back, so that evaluation and prediction (no collectives) still use
    XLA (Keras 2: at train end, `dist.restore_jit_compile`).

    On both stacks, also the classic one where Horovod's `BroadcastGlobalVariablesCallback` exists:
    that callback broadcasts at the end of the first batch (TensorFlow 2), after an update made
    from each rank's own initial weights, so ranks that start differently do not train like one
    process (the equivalence tests fail with it); this one broadcasts before the first step.
    """

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._jit_for_evaluation = False

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return
        dist.check_optimizer(optimizer)
        # Where the step holds no Horovod op (one worker, modern), XLA may compile all of it.
        if dist.traces_collectives(optimizer) and model.jit_compile:
            self._jit_for_evaluation = True
            model.jit_compile = False
            model.train_function = None  # may have been built with XLA: rebuild without

    def on_train_begin(self, logs: dict | None = None) -> None:
        dist.broadcast_model_state(self.model, self.root_rank)
        # The train function exists by now, built without XLA (Keras 2: only at train end).
        if self._jit_for_evaluation and dist.restore_jit_compile(self.model, fit_running=True):
            self._jit_for_evaluation = False

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._jit_for_evaluation:
            self._jit_for_evaluation = not dist.restore_jit_compile(self.model, fit_running=False)


class AverageMetrics(keras.callbacks.Callback):
    """Report metrics over all ranks, exactly: states (sums, counts) are summed, then the results
    computed (`dist.reduce_metrics_over_ranks`). Installed before fit reports anything, so the
    progress bar's epoch line, History, CSV, TensorBoard, EarlyStopping and checkpoint monitors all
    see the global values, whatever their place in the callback list."""

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        dist.reduce_metrics_over_ranks(model)


class AverageNonTrainable(keras.callbacks.Callback):
    """Average BatchNorm moving statistics (all float non-trainable variables) over ranks before
    each validation and at each epoch end, so evaluation and checkpoints see one model. Place it
    before any callback that saves the model."""

    def on_test_begin(self, logs: dict | None = None) -> None:
        dist.average_non_trainable(self.model)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        dist.average_non_trainable(self.model)


def distributed_callbacks(root_rank: int = 0) -> list[keras.callbacks.Callback]:
    """The callbacks every distributed fit() needs, in order; pass them on every rank."""
    return [BroadcastInitialState(root_rank), AverageMetrics(), AverageNonTrainable()]


class CheckpointWriter(keras.callbacks.Callback):
    """Rank 0's per-epoch checkpoint (`hvd_train.checkpoint`): all model and optimizer variables,
    the epoch, the optimizer step and the epoch's global metrics; keeps the newest `keep_last` and a
    copy of the best by `monitor`. Add it on rank 0 only, after `AverageNonTrainable`."""

    def __init__(
        self,
        directory: Path,
        keep_last: int,
        monitor: str,
        mode: str,
        meta: dict[str, Any],
        best: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.monitor = monitor
        self.mode = mode
        self.meta = meta
        self.best = best
        self._warned = False

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best["value"] if self.mode == "max" else value < self.best["value"]

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        logs = {k: float(v) for k, v in (logs or {}).items()}
        value = logs.get(self.monitor)
        improves = value is not None and self._improves(value)
        if improves:
            self.best = {"epoch": epoch, "value": value, "monitor": self.monitor}
        path = self.write(epoch, 0, logs)
        if improves:
            checkpoint.copy_as_best(self.directory, path)
        elif value is None and not self._warned:
            self._warned = True
            log.warning(
                "checkpoint monitor %r is not among the metrics %s", self.monitor, sorted(logs)
            )

    def write(self, epoch: int, step_in_epoch: int, logs: dict[str, float] | None = None) -> Path:
        """Write the model and optimizer now: after `epoch` (0-based), or after `step_in_epoch`
        steps of it; then prune. Returns the checkpoint's directory."""
        optimizer = self.model.optimizer
        path = checkpoint.write(
            self.directory,
            epoch,
            [v.numpy() for v in self.model.variables],
            [v.numpy() for v in dist.optimizer_variables(optimizer)],
            {
                **self.meta,
                "step": int(optimizer.iterations.numpy()),
                "metrics": logs or {},
                "best": self.best,
                "model_variables": [
                    [dist.variable_name(v), list(v.shape)] for v in self.model.variables
                ],
            },
            step_in_epoch=step_in_epoch,
        )
        checkpoint.prune(self.directory, self.keep_last)
        return path


class JsonMetrics(keras.callbacks.Callback):
    """Rank 0's metrics.json: one record per epoch (global metrics, learning rate, seconds),
    rewritten atomically each epoch and continued on resume."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = Path(path)
        self.records: list[dict[str, float]] = []
        if self.path.is_file():
            self.records = json.loads(self.path.read_text())
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = time.monotonic()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        record = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
        record["learning_rate"] = dist.learning_rate(self.model.optimizer)
        record["seconds"] = round(time.monotonic() - self._start, 3)
        self.records = [r for r in self.records if r["epoch"] < epoch + 1] + [record]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.records, indent=1))
        tmp.replace(self.path)


# --- faults: stop at an agreed step, checkpoints inside epochs, watchdog, divergence ------------


class Preempted(Exception):
    """Raised out of fit() on every rank after the same step, once a stop signal was agreed."""

    def __init__(self, epoch: int, step_in_epoch: int, signal_name: str | None) -> None:
        super().__init__(f"stopped at epoch {epoch + 1}, step {step_in_epoch}")
        self.epoch, self.step_in_epoch, self.signal_name = epoch, step_in_epoch, signal_name


class _InEpoch(keras.callbacks.Callback):
    """Knows the epoch and the step inside it, also in a fit() that resumes mid-epoch (`offset`:
    the steps of the first epoch done before this fit)."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch, self.offset = 0, 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch != self.epoch:
            self.offset = 0  # only the fit's first epoch is partial
        self.epoch = epoch

    def start_at(self, epoch: int, step_in_epoch: int) -> None:
        self.epoch, self.offset = epoch, step_in_epoch

    def step_in_epoch(self, batch: int) -> int:
        return self.offset + batch + 1


class StopAtAgreedStep(_InEpoch):
    """Stops training on every rank after the same step once any rank got a stop signal.

    On every rank. The request goes out with the rank's next gradient allreduce and comes back
    summed (`dist.request_stop`, `dist.stop_agreed`); then `Preempted` is raised out of fit()
    everywhere, before validation (a preempted job has seconds, not an epoch).
    """

    def __init__(self, stop: Any) -> None:
        super().__init__()
        self.stop = stop
        self._sent = False

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.stop.requested and not self._sent:
            dist.request_stop(self.model.optimizer)
            self._sent = True

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # With one worker only this rank can ask; with more, any rank may have.
        if (self._sent or dist.size() > 1) and dist.stop_agreed(self.model.optimizer):
            raise Preempted(self.epoch, self.step_in_epoch(batch), self.stop.signal_name)


class StepCheckpoint(_InEpoch):
    """A checkpoint every `every` steps inside epochs (bounds the work a dead rank loses).

    On every rank: BatchNorm statistics are averaged first (a collective); `write(epoch, step)`
    is rank 0's writer (None elsewhere).
    """

    def __init__(self, every: int, steps_per_epoch: int, write: Any) -> None:
        super().__init__()
        self.every, self.steps_per_epoch, self.write = every, steps_per_epoch, write

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        step = self.step_in_epoch(batch)
        if step % self.every or step == self.steps_per_epoch:  # the epoch's end has its own
            return
        dist.average_non_trainable(self.model)
        if self.write is not None:
            self.write(self.epoch, step)


class FeedWatchdog(keras.callbacks.Callback):
    """Tells the watchdog (`hvd_train.faults.Watchdog`) of every finished batch and phase."""

    def __init__(self, watchdog: Any) -> None:
        super().__init__()
        self.watchdog = watchdog

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.watchdog.phase("train")

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.watchdog.step_done()

    def on_test_begin(self, logs: dict | None = None) -> None:
        self.watchdog.phase("test")

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.watchdog.step_done()

    def on_test_end(self, logs: dict | None = None) -> None:
        self.watchdog.phase("train")


def weights_digest(model: Any) -> str:
    """sha256 of the trainable variables' bytes, in order: equal on ranks that train alike
    (BatchNorm statistics differ between their averagings, so they are left out)."""
    digest = hashlib.sha256()
    for variable in model.trainable_variables:
        digest.update(np.ascontiguousarray(variable.numpy()).tobytes())
    return digest.hexdigest()


class CheckWeights(keras.callbacks.Callback):
    """Every `every` steps, compare the weights' digest over ranks; raise `faults.Diverged` naming
    the ranks that differ from rank 0. On every rank (it runs a collective)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
        self._steps = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._steps += 1
        if self._steps % self.every:
            return
        digests = dist.allgather_object(weights_digest(self.model), name="hvd_train.weights")
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            names = ", ".join(map(str, differ))
            raise faults.Diverged(
                f"weights diverged after {self._steps} steps of this launch: rank(s) {names} "
                f"differ from rank 0 (sha256 {digests[differ[0]][:12]} vs {digests[0][:12]})"
            )
