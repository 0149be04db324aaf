"""Keras callbacks that every distributed fit() needs: thin classes over `hvd_train.keras` and
`hvd_train.comm`."""

from __future__ import annotations

import logging
from typing import Any

import keras

from hvd_train import comm
from hvd_train.core import faults
from hvd_train.errors import everywhere
from hvd_train.keras import compat, embedding
from hvd_train.keras.metrics import report_locally, report_over_ranks
from hvd_train.keras.optimizer import check_optimizer, traces_collectives
from hvd_train.keras.state import (
    average_non_trainable,
    broadcast_model_state,
    weights_digest,
)
from hvd_train.keras.stop import request_stop, stop_agreed

log = logging.getLogger("hvd_train")


class BroadcastInitialState(keras.callbacks.Callback):
    """Start every rank from rank 0's weights and optimizer state; checks the model is set up right.

    Put it in `callbacks` on every rank (it runs a collective: a callback added on rank 0 only hangs
    the job). Before the train function is built it turns XLA off (Horovod's ops have no XLA kernels
    in this build, and Keras turns jit_compile on by itself when a GPU is visible) and rejects
    optimizers that would not average (`check_optimizer`). At train begin it broadcasts the
    state, and gives jit_compile back, so that evaluation and prediction (no collectives) still use
    XLA (Keras 2: at train end, `compat.restore_jit_compile`).

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
        check_optimizer(optimizer)
        # Where the step holds no Horovod op (one worker, modern), XLA may compile all of it.
        # A table split by rows puts the lookup's alltoalls in every forward pass: evaluation and
        # prediction stay without XLA too.
        row_shards = embedding.has_row_shards(model)
        if (row_shards or traces_collectives(optimizer)) and model.jit_compile:
            self._jit_for_evaluation = not row_shards
            model.jit_compile = False
            model.train_function = None  # may have been built with XLA: rebuild without

    def on_train_begin(self, logs: dict | None = None) -> None:
        broadcast_model_state(self.model, self.root_rank)
        # The train function exists by now, built without XLA (Keras 2: only at train end).
        if self._jit_for_evaluation and compat.restore_jit_compile(self.model, fit_running=True):
            self._jit_for_evaluation = False

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._jit_for_evaluation:
            self._jit_for_evaluation = not compat.restore_jit_compile(self.model, fit_running=False)


class AverageMetrics(keras.callbacks.Callback):
    """Make the metrics this fit() reports global and exact: at each epoch's end and at the end of
    its validation, the metric states (sums, counts) are summed over ranks and the results computed
    from the sums (`hvd_train.keras.metrics.report_over_ranks`), so the progress bar's epoch line,
    History, CSV, TensorBoard, EarlyStopping and checkpoint monitors all see the global values,
    whatever their place in the callback list.

    On every rank (the sum is a collective that fit runs on every rank). Only fit's own reports
    change, from its start to its end: `model.get_metrics_result()` stays local (a callback on
    rank 0 alone may call it), and so do the `evaluate` and `predict` a user calls, after fit (a
    rank-0-only test evaluation) or from a callback; `hvd_train.evaluate` is the collective one.
    """

    def on_train_begin(self, logs: dict | None = None) -> None:
        report_over_ranks(self.model, owner=self)

    def on_train_end(self, logs: dict | None = None) -> None:
        report_locally(self.model, owner=self)


class AverageNonTrainable(keras.callbacks.Callback):
    """Average BatchNorm moving statistics (all float non-trainable variables) over ranks before
    each validation and at each epoch end, so evaluation and checkpoints see one model. Place it
    before any callback that saves the model."""

    def on_test_begin(self, logs: dict | None = None) -> None:
        average_non_trainable(self.model)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        average_non_trainable(self.model)


def distributed_callbacks(root_rank: int = 0) -> list[keras.callbacks.Callback]:
    """The callbacks every distributed fit() needs, in order; pass them on every rank."""
    return [BroadcastInitialState(root_rank), AverageMetrics(), AverageNonTrainable()]


class _GatherForCheckpoint(keras.callbacks.Callback):
    """Whole arrays for rank 0's next checkpoint, gathered as its writer reads them: `gather()` on
    every rank before each checkpoint and at each epoch's end (put it before the checkpoint's
    writer). The other ranks run every gather there; rank 0 prepares the streams, its writer
    takes them and writes each array as it is gathered, and `settle()` after the writer runs what
    it did not take (it failed, or was skipped), so every rank runs the same gathers in the same
    order."""

    what = ""

    def __init__(self) -> None:
        super().__init__()
        self._streams: tuple[Any, ...] | None = None

    def _prepare(self) -> tuple[Any, ...]:
        """The streams (iterators of arrays, a collective per step), in the writer's order."""
        raise NotImplementedError

    def gather(self) -> None:
        if self._streams is not None:  # its gathers would pair with the others' next ones
            raise RuntimeError(f"the last gather of {self.what} was not settled")
        streams = self._prepare()
        if comm.is_chief():
            self._streams = streams
        else:
            for stream in streams:
                for _ in stream:
                    pass

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.gather()

    def _taken(self) -> tuple[Any, ...]:
        if self._streams is None:
            raise RuntimeError(f"{self.what} was not gathered for this checkpoint")
        return self._streams

    def settle(self) -> None:
        """Rank 0: run the gathers its writer did not take, in order."""
        streams, self._streams = self._streams, None
        for stream in streams or ():
            for _ in stream:
                pass


class GatherShardedState(_GatherForCheckpoint):
    """A sharded optimizer's whole state, one variable at a time (`keras.sharded.gather_stream`, a
    collective per variable)."""

    what = "the sharded optimizer state"

    def __init__(self, optimizer: Any) -> None:
        super().__init__()
        self.optimizer = optimizer

    def _prepare(self) -> tuple[Any, ...]:
        from hvd_train.keras.sharded import gather_stream

        return (gather_stream(self.optimizer),)

    def take(self) -> Any:
        """Rank 0: the prepared stream (an iterator of arrays), once."""
        return self._taken()[0]


class GatherRowShards(_GatherForCheckpoint):
    """A model with a table split by rows (`ShardedEmbedding`): its variables and the optimizer's,
    whole and in global row order; each row shard gathered as rank 0 writes it
    (`keras.embedding.gather_rows`, collectives per 16 MiB of rows), the other variables rank
    0's own."""

    what = "the table's rows"

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.source = model

    def _prepare(self) -> tuple[Any, ...]:
        return (
            _whole(self.source.variables),
            _whole(compat.optimizer_variables(self.source.optimizer)),
        )

    def take(self) -> tuple[Any, ...]:
        """Rank 0: the prepared (model, optimizer) streams of arrays, once."""
        return self._taken()


def _whole(variables: list[Any]) -> Any:
    """The variables' whole values one at a time (a collective for each row shard; None on the
    ranks but 0)."""
    for variable in variables:
        yield embedding.gather_rows(variable)


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
    summed (`request_stop`, `stop_agreed`); then `Preempted` is raised out of fit()
    everywhere, before validation (a preempted job has seconds, not an epoch).
    """

    def __init__(self, stop: Any) -> None:
        super().__init__()
        self.stop = stop
        self._sent = False

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.stop.requested and not self._sent:
            request_stop(self.model.optimizer)
            self._sent = True

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # With one worker only this rank can ask; with more, any rank may have.
        if (self._sent or comm.size() > 1) and stop_agreed(self.model.optimizer):
            raise Preempted(self.epoch, self.step_in_epoch(batch), self.stop.signal_name)


class StepCheckpoint(_InEpoch):
    """A checkpoint every `every` steps inside epochs (bounds the work a dead rank loses).

    On every rank: BatchNorm statistics are averaged first (a collective), then `write(epoch,
    step)` is called on every rank (the trainer's writes on rank 0 and tells every rank whether
    that failed, a collective); None: no file is written.
    """

    def __init__(self, every: int, steps_per_epoch: int, write: Any) -> None:
        super().__init__()
        self.every, self.steps_per_epoch, self.write = every, steps_per_epoch, write

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        step = self.step_in_epoch(batch)
        if step % self.every or step == self.steps_per_epoch:  # the epoch's end has its own
            return
        average_non_trainable(self.model)
        if self.write is not None:
            self.write(self.epoch, step)


class FeedWatchdog(keras.callbacks.Callback):
    """Tells the watchdog (`hvd_train.core.faults.Watchdog`) of every finished batch and phase."""

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
        # The trainable variables only: BatchNorm statistics differ between their averagings,
        # and random state and a table's row shards differ by design.
        digest = weights_digest(
            [v for v in self.model.trainable_variables if not embedding.is_row_sharded(v)]
        )
        digests = comm.allgather_object(digest, name="hvd_train.weights")
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            names = ", ".join(map(str, differ))
            raise everywhere(
                faults.Diverged(
                    f"weights diverged after {self._steps} steps of this launch: rank(s) {names} "
                    f"differ from rank 0 (sha256 {digests[differ[0]][:12]} vs {digests[0][:12]})"
                )
            )
