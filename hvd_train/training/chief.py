"""Rank 0's work between collectives, as sections that every rank passes through.

Rank 0 alone writes the run's files (the run record, checkpoints, the best copy, metrics.json,
metrics.csv, TensorBoard, metrics.png, status.json). If rank 0 raised there on its own, the
others would wait for it in their next collective until the launcher tore them down, and the
job's error would be whatever the launcher printed. So each such write is a section: rank 0 does
the work inside try/except, then every rank learns the outcome from one small broadcast (None, or
the error line) and all raise the same `ChiefWriteError`, which names the file: every rank ends
with exit code 74 (`core.outcome.EXIT_WRITE_FAILED`), the job shows the line once
(`errors.everywhere`), and rank 0 records `write_failed` in status.json where it still can.

`ChiefFiles.write` is one section. `ChiefWriters` puts rank 0's Keras writers into the callback
list of every rank: on rank 0 it calls them, and all ranks agree at on_train_begin, each
on_epoch_end and on_train_end (one broadcast of None per epoch; none per batch: a failure in a
batch hook, e.g. TensorBoard's first step, is kept and reported at the next agreement).
Checkpoints are written to a temporary name and renamed (`core.checkpoint`), so a failed write
leaves the earlier checkpoints valid for `--resume`. Given the job's watchdog, rank 0's work in a
section (not in a batch hook) counts as busy: a slow disk or file server is waited for, not
declared a stall.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import keras

from hvd_train import comm
from hvd_train.core import faults, inject
from hvd_train.core.outcome import EXIT_WRITE_FAILED, Status
from hvd_train.errors import everywhere
from hvd_train.training import records

log = logging.getLogger("hvd_train")

T = TypeVar("T")


class ChiefWriteError(faults.JobFailure):
    """Rank 0 could not write one of the run's files (named); raised on every rank alike."""

    exit_code = EXIT_WRITE_FAILED


def describe(err: Exception, target: Path) -> str:
    """One line: `writing PATH: reason`, the path from the error where it names one."""
    if isinstance(err, OSError) and err.strerror:
        return f"writing {err.filename or target}: {err.strerror}"
    return f"writing {target}: {type(err).__name__}: {err}"


def _caught(err: Exception, target: Path) -> str:
    """Rank 0's error line for a failed write; an error that is not I/O keeps its traceback in
    rank 0's log (it may be a bug)."""
    if not isinstance(err, OSError):
        log.error("rank 0 failed writing %s", target, exc_info=err)
    return describe(err, target)


class ChiefFiles:
    """The sections of rank 0's files in `run_dir`; make one on every rank.

    Args:
      run_dir: the run directory.
      watchdog: the job's watchdog (None: none); rank 0 is busy for it inside a section.

    Raises:
      ConfigError: `HVD_TRAIN_FAIL_IN` or `HVD_TRAIN_SLOW_IN` names no section (`core.inject`),
        on every rank alike.
    """

    def __init__(self, run_dir: Path, watchdog: faults.Watchdog | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.watchdog = watchdog
        inject.plan(), inject.slow()

    def busy(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0's long work outside steps: the watchdogs wait (`Watchdog.busy`)."""
        return self.watchdog.busy() if self.watchdog is not None else contextlib.nullcontext()

    def write(self, target: Path, work: Callable[[], T]) -> T | None:
        """Collective (every rank): rank 0 runs `work` (which writes `target`), then every rank
        learns whether it failed (`agree`).

        Returns:
          What `work` returned, on rank 0; None elsewhere.

        Raises:
          ChiefWriteError: on every rank, if `work` raised on rank 0.
        """
        result, error = None, None
        if comm.is_chief():
            try:
                with self.busy():
                    result = work()
            except Exception as err:  # any: raising here alone would hang the other ranks
                error = _caught(err, target)
        self.agree(error)
        return result

    def agree(self, error: str | None) -> None:
        """Collective (every rank): rank 0's `error` (None: none) reaches every rank, and all
        raise it alike; rank 0 first records it in status.json if it can.

        Raises:
          ChiefWriteError: `error`, on every rank.
        """
        error = comm.broadcast_object(error, name="hvd_train.chief_error")
        if error is None:
            return
        if comm.is_chief():
            try:
                records.write_status(self.run_dir, Status.WRITE_FAILED, message=error)
            except OSError as err:
                log.warning("status.json not written either: %s", describe(err, self.run_dir))
        raise everywhere(ChiefWriteError(error))


class ChiefWriters(keras.callbacks.Callback):
    """Rank 0's Keras writers (`training.writers`) in a callback that every rank has.

    On rank 0 it passes each hook on to `writers`, stopping at the first that raises; every rank
    agrees on the outcome at on_train_begin, each on_epoch_end and on_train_end (`ChiefFiles.agree`:
    one broadcast each). An error of an earlier hook (setting up, a batch, validation) waits for the
    next of those. Put it last, after every callback that changes the model at an epoch's end.

    Args:
      files: the run's `ChiefFiles`.
      writers: rank 0's writers, each naming what it writes in `destination`; none elsewhere.
      settle: called on rank 0 after the writers at each epoch's end, before the agreement (the
        collectives a writer may have left undone: `callbacks.GatherShardedState.settle`).
    """

    def __init__(
        self, files: ChiefFiles, writers: list[Any], settle: list[Callable[[], None]] | None = None
    ) -> None:
        super().__init__()
        self.files = files
        self.writers = writers
        self.settle = settle or []
        self._error: str | None = None

    def _call(self, hook: str, *args: Any) -> None:
        """A hook other than a batch's: rank 0 is busy for the watchdog while its writers run."""
        if not self.writers:
            return
        with self.files.busy():
            self._call_batch(hook, *args)

    def _call_batch(self, hook: str, *args: Any) -> None:
        """Every hook's writers; a batch hook's directly (short but for the first, which the
        startup bound covers)."""
        for writer in self.writers:
            if self._error is not None:
                return
            try:
                getattr(writer, hook)(*args)
            except Exception as err:  # any: raising here on rank 0 alone would hang the others
                self._error = _caught(err, writer.destination)

    def _agree(self) -> None:
        error, self._error = self._error, None
        self.files.agree(error)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._call("set_model", model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        self._call("set_params", params)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._call("on_train_begin", logs)
        self._agree()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._call("on_epoch_begin", epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._call_batch("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._call_batch("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs: dict | None = None) -> None:
        self._call("on_test_begin", logs)

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._call_batch("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._call_batch("on_test_batch_end", batch, logs)

    def on_test_end(self, logs: dict | None = None) -> None:
        self._call("on_test_end", logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._call("on_epoch_end", epoch, logs)
        if self.writers:
            for settle in self.settle:
                settle()
        self._agree()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._call("on_train_end", logs)
        self._agree()
