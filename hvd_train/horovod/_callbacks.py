"""Horovod's Keras callbacks (`horovod.tensorflow.keras.callbacks`) on the toolkit's.

Put every one of them in `callbacks` on every rank (those that communicate say so). Horovod's
known defects are not kept: `BroadcastGlobalVariablesCallback` broadcasts before the first step
(Horovod's, after the first batch: an update from each rank's own initial weights), and never the
random state (each rank keeps its own dropout stream, `hvd_train.keras.randomness`);
`MetricAverageCallback` reduces the metric states exactly (Horovod's averages per-rank means).
"""

from __future__ import annotations

import logging
from typing import Any

import keras

from hvd_train import callbacks as toolkit
from hvd_train import comm
from hvd_train.keras import compat

_log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(toolkit.BroadcastInitialState):
    """Start every rank from root's model and optimizer variables (collective), before the first
    step; also turns XLA off for the train step (Horovod's ops have no XLA kernels) and refuses an
    optimizer that would not average (`hvd_train.callbacks.BroadcastInitialState`).

    Args:
      root_rank: the rank whose variables every rank takes.
      device: accepted, unused (Horovod's placement of the broadcast).
    """

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__(root_rank)
        self._local_vars: list[Any] = []
        self._after_first_batch = False

    def register_local_var(self, var: Any) -> None:
        """Keep this variable's own value on every rank (it is not broadcast)."""
        self._local_vars.append(var)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.model.built:
            # A model without keras.Input (Horovod's examples build Sequential so) gets its
            # variables only when Keras 3 traces the first step: nothing to send before it.
            _log.warning(
                "BroadcastGlobalVariablesCallback: model %r is built only by its first step "
                "(give it a keras.Input to start every rank alike); broadcasting after the first "
                "batch, as Horovod does",
                self.model.name,
            )
            self._after_first_batch = True
            return
        self._broadcast(logs)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._after_first_batch:
            self._after_first_batch = False
            self._broadcast(logs)

    def _broadcast(self, logs: dict | None) -> None:
        kept = [(var, compat.value(var)) for var in self._local_vars]
        super().on_train_begin(logs)
        for var, value in kept:
            var.assign(value)


class MetricAverageCallback(toolkit.AverageMetrics):
    """The metrics fit() reports at each epoch's end (training and validation) over all ranks,
    exactly: the metric states (totals, counts) are summed over ranks and the results computed
    from the sums, whatever this callback's place in the list (collective).

    Args:
      device: accepted, unused.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to `initial_lr * multiplier(epoch)` from `start_epoch` to `end_epoch`
    (Horovod's schedule): at each epoch's first batch (`staircase`), or at every batch with a
    fractional epoch.

    Momentum correction (Goyal et al. 2017): when the rate changes from old to new, the momentum
    velocity is scaled by new/old. Horovod does it by setting SGD's momentum to momentum*new/old
    for that batch; Keras 3 compiles momentum into the step as a constant, so here the velocity
    slots themselves are scaled, which gives the same update for SGD with momentum (Nesterov:
    nearly the same). Optimizers without momentum slots are not corrected.

    Args:
      initial_lr: the rate the multiplier scales (None: the optimizer's at train begin).
      multiplier: a constant (exponential decay: multiplier ** (epoch - start_epoch)) or a
        function of the epoch (a float with staircase=False).
      start_epoch, end_epoch: the epochs [start, end) in which the rate is set (end None: all).
      staircase: set once per epoch; otherwise at every batch.
      momentum_correction: scale the momentum velocity when the rate changes.
      steps_per_epoch: batches per epoch (None: from fit's params).

    Raises:
      ValueError: no steps per epoch where staircase=False needs them, or a rate that is a
        schedule (set by the optimizer itself).
    """

    def __init__(
        self,
        initial_lr: float | None,
        multiplier: Any,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _optimizer(self) -> Any:
        optimizer = self.model.optimizer
        return getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's

    def on_train_begin(self, logs: dict | None = None) -> None:
        rate = self._optimizer()._learning_rate
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(
                f"{type(self).__name__}: the optimizer's learning rate is a schedule; give it a "
                "float rate for this callback to set"
            )
        if self.initial_lr is None:
            self.initial_lr = compat.learning_rate(self.model.optimizer)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    f"{type(self).__name__}: cannot tell the steps per epoch; pass steps_per_epoch"
                )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self._optimizer()
        old = compat.learning_rate(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        velocities = getattr(optimizer, "momentums", None)
        if self.momentum_correction and velocities and old > 0 and new != old:
            for velocity in velocities:
                velocity.assign(velocity * (new / old))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = compat.learning_rate(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warmup (Goyal et al. 2017): over `warmup_epochs`, the rate rises at every
    batch from `initial_lr / size` to `initial_lr` (initial_lr: the rate scaled for `size`
    workers), as `initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1)`.

    Args:
      initial_lr: the rate reached at the end of the warmup.
      warmup_epochs: its length in epochs.
      momentum_correction: as LearningRateScheduleCallback.
      steps_per_epoch: batches per epoch (None: from fit's params).
      verbose: 1: rank 0 prints when the warmup ends.
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            # Horovod's: the epoch's end lands on a round number.
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / comm.size() * (epoch * (comm.size() - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and comm.rank() == 0:
            rate = compat.learning_rate(self.model.optimizer)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model (rank 0 only: one writer) whenever the monitored value improves: Keras's
    ModelCheckpoint with save_best_only. Keras 3 needs the path at construction (Horovod's Spark
    estimator set it later): `filepath`, ending in `.keras` (or `.weights.h5` with
    save_weights_only).

    Raises:
      ValueError: no filepath.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: Any = "epoch",
        filepath: str | None = None,
    ) -> None:
        if filepath is None:
            raise ValueError("BestModelCheckpoint: Keras 3 needs filepath= (a .keras file)")
        super().__init__(
            filepath=filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )

    def _save_model(self, epoch: int, batch: Any, logs: dict | None) -> None:
        if comm.rank() == 0:  # the other ranks hold the same model; one writes it
            super()._save_model(epoch, batch, logs)
