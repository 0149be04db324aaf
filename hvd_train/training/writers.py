"""Rank 0's file writers, as Keras callbacks: the checkpoint of every epoch (and the best one),
metrics.json, and where the config asks for them metrics.csv and TensorBoard.

They write and run no collective; `hvd_train.training.chief.ChiefWriters` runs them on rank 0 and
lets every rank learn whether they failed. Each calls `core.inject.fail_point` where it writes, and
names what it writes in `destination`."""

from __future__ import annotations

import csv
import json
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import keras

from hvd_train.core import checkpoint, inject
from hvd_train.core import config as config_lib
from hvd_train.keras import compat, embedding

log = logging.getLogger("hvd_train")


class CheckpointWriter(keras.callbacks.Callback):
    """Rank 0's per-epoch checkpoint (`hvd_train.core.checkpoint`): all model and optimizer
    variables, the epoch, the optimizer step and the epoch's global metrics; keeps the newest
    `keep_last` and a copy of the best by `monitor`. Rank 0's, after `AverageNonTrainable`."""

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
        self.destination = self.directory
        self.keep_last = keep_last
        self.monitor = monitor
        self.mode = mode
        self.meta = meta
        self.best = best
        self._warned = False
        # The optimizer's arrays for a checkpoint: its variables here, unless the job gathers
        # them (a sharded optimizer's whole state, one at a time: `GatherShardedState.take`).
        self.optimizer_state: Callable[[], Iterable[Any]] | None = None
        # The model's and the optimizer's arrays together, where a table split by rows is
        # gathered whole (`GatherRowShards.take`).
        self.whole_state: Callable[[], tuple[Iterable[Any], Iterable[Any]]] | None = None

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
            inject.fail_point("best_checkpoint", self.directory / "best")
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
        inject.fail_point(
            "step_checkpoint" if step_in_epoch else "checkpoint",
            self.directory / checkpoint.epoch_dir_name(epoch, step_in_epoch),
        )
        # Read one at a time as they are written: no copy of the whole model at once.
        if self.whole_state is not None:
            model_values, optimizer_values = self.whole_state()
        else:
            model_values = (v.numpy() for v in self.model.variables)
            optimizer_values = (
                self.optimizer_state()
                if self.optimizer_state is not None
                else (v.numpy() for v in compat.optimizer_variables(optimizer))
            )
        path = checkpoint.write(
            self.directory,
            epoch,
            model_values,
            optimizer_values,
            {
                **self.meta,
                "step": int(optimizer.iterations.numpy()),
                "metrics": logs or {},
                "best": self.best,
                "model_variables": [
                    [compat.variable_name(v), list(embedding.whole_shape(v))]
                    for v in self.model.variables
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
        self.path = self.destination = Path(path)
        self.records: list[dict[str, float]] = []
        if self.path.is_file():
            self.records = json.loads(self.path.read_text())
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = time.monotonic()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        record = {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()}}
        record["learning_rate"] = compat.learning_rate(self.model.optimizer)
        record["seconds"] = round(time.monotonic() - self._start, 3)
        self.records = [r for r in self.records if r["epoch"] < epoch + 1] + [record]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        inject.fail_point("metrics.json", self.path)
        tmp.write_text(json.dumps(self.records, indent=1))
        tmp.replace(self.path)


class CsvMetrics(keras.callbacks.CSVLogger):
    """Keras's CSVLogger, appending to `path` (one row per epoch). Appended rows keep the columns
    of the file's header ("NA" where an epoch has no value), and a new file's header names each
    validation metric's training twin too: an epoch whose record is validation only (one ended
    at an elastic reset) neither shifts nor drops columns."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), append=True)
        self.destination = Path(path)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        inject.fail_point("metrics.csv", self.destination)
        if self.keys is None:
            self.keys = _csv_columns(self.destination, logs or {})
        super().on_epoch_end(epoch, logs)


def _csv_columns(path: Path, logs: dict[str, Any]) -> list[str] | None:
    """The metric columns of `path`'s header; for a new file, those of `logs` with the training
    twin of each validation metric, or None (Keras's own rule) where `logs` has no validation."""
    if path.is_file():
        with path.open(newline="") as f:
            header = next(csv.reader(f), None)
        if header:
            return [name for name in header if name != "epoch"]
    if not any(name.startswith("val_") for name in logs):
        return None
    return sorted(set(logs) | {name.removeprefix("val_") for name in logs})


class TensorBoardLogs(keras.callbacks.TensorBoard):
    """Keras's TensorBoard callback, writing under `log_dir`: the train graph at the first step
    of each fit(), the summaries at each epoch's end."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(str(log_dir))
        self.destination = Path(log_dir)
        self._first_step = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._first_step = True
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._first_step:
            self._first_step = False
            inject.fail_point("tensorboard", self.destination / "train")
        super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        inject.fail_point("tensorboard", self.destination)
        super().on_epoch_end(epoch, logs)


def file_writers(config: Any, run_dir: Path, size: int, steps: int, best: Any) -> list[Any]:
    """Rank 0's writers: the CheckpointWriter first, then metrics.json, and metrics.csv and
    TensorBoard where the config asks for them. `best`: the monitored best so far (resume)."""
    writers = [
        CheckpointWriter(
            run_dir / "checkpoints",
            keep_last=config.checkpoint.keep_last,
            monitor=config.checkpoint.monitor,
            mode=config.checkpoint.mode,
            meta={
                "config": config_lib.to_dict(config),
                "size": size,
                "data_seed": config.data.seed,
                "steps_per_epoch": steps,
            },
            best=best,
        ),
        JsonMetrics(run_dir / "metrics.json"),
    ]
    if config.logging.csv:
        writers.append(CsvMetrics(run_dir / "metrics.csv"))
    if config.logging.tensorboard:
        writers.append(TensorBoardLogs(run_dir / "tensorboard"))
    return writers
