"""`hvd-train train --elastic`: training that goes on while workers leave and join.

Run it under horovodrun's elastic mode (Horovod Elastic, Gloo controller; the command is built by
`hvd_train.core.launch.horovodrun_elastic_argv`):

    horovodrun -np 2 --min-np 1 --max-np 3 \\
        --host-discovery-script "mpi_scripts/discover_hosts.sh hosts.txt" \\
        python -m hvd_train.cli train --elastic --config configs/digits.yaml

Horovod's own elastic Keras state does not work on Keras 3 (it calls `optimizer.variables()` and
Keras 2 backend functions), and `horovod.tensorflow.elastic.run` takes only an UnknownError naming
HorovodAllreduce, HorovodAllgather or HorovodBroadcast for a failed collective (it swallows any
other UnknownError), where the toolkit's step runs HorovodGroupedAllreduce. So the toolkit keeps
its own state and run loop on `horovod.common.elastic`'s machinery:

- State (`TrainingState`): every model and optimizer variable (weights, slots, the update counter)
  and the progress (`Progress`): the epoch, and the data position, the samples of that epoch's
  permutation trained on. A data position survives a change of the worker count, where a step
  count would not: global step s of N ranks with batch b covers positions [s*b*N, (s+1)*b*N).
- Commit: every `elastic.commit_every_steps` optimizer updates and at every epoch end, the state is
  copied to host memory, then every rank learns (one broadcast) whether horovodrun found hosts
  added or removed; if so, all ranks leave `fit` at that same step.
- Failure: a worker dies, a collective fails on the survivors, they put back the last commit. No
  process restarts; Horovod is shut down and started again with the workers left (new rank and
  size), and rank 0's state is broadcast to all (`sync`), which is also how a joining worker gets
  the current state. A frozen worker is made a dead one: a child process on its host kills it
  when it has not run for `fault.stall_floor_s` (`faults.FreezeGuard`), since horovodrun
  resets only once every worker has reported.
- After every (re)start, `_train` rebuilds what depends on the worker count: the data shards (the
  positions of the epoch not yet trained on are spread over the new size,
  `data.train_dataset(start_position=...)`), the learning rate (the batch rule for the new global
  batch, at the same point of the schedule in epochs: `schedule_offset`), the train function
  (Keras traced the old size and schedule into it) and rank 0's writers (rank 0 may be another
  process now).
- An epoch interrupted by a reset is finished by a `fit` of its remaining steps, then the later
  epochs by another `fit`; that epoch's training metrics cover its steps after the reset only. When
  less than one global batch of the epoch is left at the new size, the epoch ends at the reset
  (`_end_epoch`): its validation, commit, record and checkpoint come as at any epoch's end, its
  record without training metrics (no step of it followed the reset).

Files: rank 0 of the moment writes checkpoints and metrics as `hvd_train.training.fit` does, and
`elastic.jsonl`: a "start" line after every (re)start (size, progress, batch, steps per epoch,
learning rate, and every worker's rank, pid, host and weight digest after the sync) and a "commit"
line per commit.
Checkpoints are written at epoch ends; a new rank 0 continues the "best" copy from the newest
checkpoint on disk, so the run directory should be on storage every host can reach.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvd_train import comm, data
from hvd_train.callbacks import distributed_callbacks
from hvd_train.comm.elastic import State, collective_failures, run
from hvd_train.core import checkpoint as ckpt
from hvd_train.core import config as config_lib
from hvd_train.core import faults
from hvd_train.core.config import Config
from hvd_train.keras import compat
from hvd_train.keras.state import agreed_variables, broadcast_model_state, weights_digest
from hvd_train.training import records, setup
from hvd_train.training.chief import ChiefFiles, ChiefWriters
from hvd_train.training.setup import Result
from hvd_train.training.writers import file_writers

log = logging.getLogger("hvd_train")

EVENTS = "elastic.jsonl"


@dataclasses.dataclass
class Progress:
    """Where training stands, in terms that survive a change of the worker count.

    Attributes:
      epoch: the epoch in progress (0-based).
      position: samples of that epoch's permutation trained on (by any worker counts).
    """

    epoch: int = 0
    position: int = 0


def schedule_offset(
    epoch: int, position: int, steps_per_epoch: int, global_batch_size: int, updates: int
) -> float:
    """What to add to the optimizer's update counter so that a schedule built for this worker
    count (`steps_per_epoch` updates of `global_batch_size` per epoch) stands where training does.

    The schedule is defined in epochs (warmup and decay epochs), the optimizer counts updates, and
    an update is a different part of an epoch at every worker count; 0 while the count never
    changed.
    """
    return epoch * steps_per_epoch + position / global_batch_size - updates


@keras.saving.register_keras_serializable(package="hvd_train")
class ShiftedSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule(step + offset)`: a schedule evaluated at a shifted update counter."""

    def __init__(self, schedule: Any, offset: float) -> None:
        self.schedule = schedule
        self.offset = float(offset)

    def __call__(self, step: Any) -> Any:
        return self.schedule(tf.cast(step, tf.float32) + self.offset)

    def get_config(self) -> dict[str, Any]:
        return {
            "schedule": keras.saving.serialize_keras_object(self.schedule),
            "offset": self.offset,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ShiftedSchedule:
        schedule = keras.saving.deserialize_keras_object(config["schedule"])
        return cls(schedule, config["offset"])


class TrainingState(State):
    """The model's and optimizer's variables and the `Progress`, committed to host memory.

    Args:
      model: a compiled model whose optimizer is built.
      on_commit: called after every commit's copy (before the check for host updates).
    """

    def __init__(self, model: Any, on_commit: Any = None) -> None:
        self.model = model
        self.progress = Progress()
        self.on_commit = on_commit
        self._variables = list(model.variables) + compat.optimizer_variables(model.optimizer)
        self._saved: tuple[list[np.ndarray], Progress] | None = None
        super().__init__(bcast_object=comm.broadcast_object, get_rank=comm.rank)
        self.save()

    def save(self) -> None:
        """Copy the variables and the progress to host memory."""
        self._saved = ([np.array(v.numpy()) for v in self._variables], self.progress)
        self.progress = dataclasses.replace(self.progress)

    def restore(self) -> None:
        """Put the last commit back (the steps after it are trained again)."""
        values, progress = self._saved
        for var, value in zip(self._variables, values, strict=True):
            var.assign(value)
        self.progress = dataclasses.replace(progress)

    def sync(self) -> None:
        """Rank 0's state on every rank (collective), then committed there."""
        with collective_failures():
            broadcast_model_state(self.model)
            progress = comm.broadcast_object(self.progress, name="hvd_train.elastic.progress")
        self.progress = progress
        self.save()

    def commit(self, check_hosts: bool = True) -> None:
        """Save and report it; then (collective) raise HostsUpdatedInterrupt on every rank if
        horovodrun found hosts added or removed, unless `check_hosts` is False."""
        self.save()
        if self.on_commit is not None:
            self.on_commit(self)
        if check_hosts:
            self.check_host_updates()


class _Commit(keras.callbacks.Callback):
    """Counts the data position after each step and commits every `every` updates and at the end
    of each epoch. Place it after the distributed callbacks (the epoch's averaged statistics are
    committed) and before rank 0's writers (an epoch end is then never trained twice, so its
    checkpoint is never written twice)."""

    def __init__(self, state: TrainingState, global_batch_size: int, every: int) -> None:
        super().__init__()
        self.state = state
        self.global_batch_size = global_batch_size
        self.every = every

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.progress.position += self.global_batch_size
        # The update counter is the same on every rank, so all commit (a collective) together.
        if int(self.model.optimizer.iterations.numpy()) % self.every == 0:
            self.state.commit()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.progress = Progress(epoch + 1, 0)
        # Host updates are checked by `_CheckHosts`, after the writers have run.
        self.state.commit(check_hosts=False)


class _CheckHosts(keras.callbacks.Callback):
    """The epoch end's check for added or removed hosts; last in the callback list."""

    def __init__(self, state: TrainingState) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.check_host_updates()


@dataclasses.dataclass
class _Job:
    """What stays fixed while workers come and go: the config, the data and the model."""

    config: Any
    run_dir: Path
    source: Any
    model: Any
    history: list[dict[str, float]]
    started: float


def _schedule(
    config: Config, global_batch: int, steps: int, progress: Progress, updates: int
) -> Any:
    schedule = setup.make_schedule(config, global_batch, steps)
    offset = schedule_offset(progress.epoch, progress.position, steps, global_batch, updates)
    return ShiftedSchedule(schedule, offset)


def _steps_per_epoch(source: Any, config: Any, per_rank_batch: int, rank: int, size: int) -> int:
    """The steps of a whole epoch at this worker count (the data's own rule)."""
    _, steps = data.train_dataset(
        source, per_rank_batch, rank, size, max_steps=config.train.steps_per_epoch
    )
    return steps


def _append_event(run_dir: Path, event: dict[str, Any]) -> None:
    with (run_dir / EVENTS).open("a") as f:
        f.write(json.dumps({"time": round(time.time(), 3), **event}) + "\n")


def _best_on_disk(checkpoint_dir: Path) -> dict[str, Any] | None:
    """The "best" record of the newest checkpoint (a new rank 0 continues it)."""
    newest = ckpt.epochs_on_disk(checkpoint_dir)
    if not newest:
        return None
    try:
        return ckpt.verify(newest[-1]).get("best")
    except ckpt.CheckpointError:
        return None


def _writers(job: _Job, size: int, steps: int) -> list[keras.callbacks.Callback]:
    """Rank 0's files, continued from what the previous rank 0 wrote."""
    best = _best_on_disk(job.run_dir / "checkpoints")
    return file_writers(job.config, job.run_dir, size, steps, best)


def _end_epoch(model: Any, callbacks: list[Any], val_ds: Any, epoch: int) -> dict[str, Any]:
    """The end of `epoch` (0-based) after a reset that left none of its steps: the validation
    (every rank; the collective `evaluate`), then the epoch-end hooks of `callbacks` as a fit()
    would run them (the commit, rank 0's writers, the host check). Returns the epoch's record:
    validation metrics only."""
    from hvd_train.training.evaluation import evaluate

    logs = {f"val_{name}": value for name, value in evaluate(model, val_ds).items()}
    hooks = keras.callbacks.CallbackList(callbacks, model=model, epochs=epoch + 1, steps=0)
    hooks.on_train_begin()
    hooks.on_epoch_begin(epoch)
    hooks.on_epoch_end(epoch, logs)
    hooks.on_train_end()
    return {name: float(value) for name, value in logs.items()}


def _train(state: TrainingState, job: _Job) -> Result:
    """One stretch of training at a fixed worker count: from the synced state to the end, or to
    the next reset (an exception)."""
    rank, size = comm.rank(), comm.size()
    chief = rank == 0
    setup.configure_logging(rank)
    config, model = job.config, job.model
    train_cfg = config.train
    per_rank_batch, global_batch = config_lib.resolved_batch_sizes(config, size)
    progress = state.progress
    updates = int(model.optimizer.iterations.numpy())
    steps = _steps_per_epoch(job.source, config, per_rank_batch, rank, size)

    # The batch rule for this size, at the schedule's point in epochs; the train function is traced
    # again (the old one holds the old size's collectives and schedule).
    model.optimizer.learning_rate = _schedule(config, global_batch, steps, progress, updates)
    model.train_function = None

    worker = {
        "rank": rank,
        "pid": os.getpid(),
        "host": os.environ.get("HOROVOD_HOSTNAME", socket.gethostname()),
        "weights": weights_digest(agreed_variables(model))[:16],
    }
    workers = comm.allgather_object(worker, name="hvd_train.elastic.workers")
    rate = compat.learning_rate(model.optimizer)
    log.info(
        "elastic: %d worker(s), epoch %d from position %d, update %d, learning rate %.4g",
        size,
        progress.epoch + 1,
        progress.position,
        updates,
        rate,
    )

    # Rank 0's files, in sections every rank passes through (`training.chief`): a failed write
    # ends every worker with the file's name.
    files = ChiefFiles(job.run_dir)
    events = job.run_dir / EVENTS

    def record_commit(committed: TrainingState) -> None:
        def append() -> None:
            done = dataclasses.asdict(committed.progress)
            updates_now = int(model.optimizer.iterations.numpy())
            _append_event(
                job.run_dir, {"event": "commit", "size": size, **done, "updates": updates_now}
            )

        files.write(events, append)  # every rank commits at the same step

    state.on_commit = record_commit
    start = {"event": "start", "size": size, **dataclasses.asdict(progress), "updates": updates}
    batches = {"global_batch_size": global_batch, "steps_per_epoch": steps}
    start |= {**batches, "learning_rate": rate, "workers": workers}
    files.write(events, lambda: _append_event(job.run_dir, start))

    commit = _Commit(state, global_batch, config.elastic.commit_every_steps)
    writers = files.write(job.run_dir / "metrics.json", lambda: _writers(job, size, steps)) or []
    callbacks = [*distributed_callbacks(), commit, ChiefWriters(files, writers)]
    callbacks.append(_CheckHosts(state))
    val_ds = data.validation_dataset(job.source, per_rank_batch, rank, size)
    while state.progress.epoch < train_cfg.epochs:
        epoch, position = state.progress.epoch, state.progress.position
        # A partial epoch first (its own fit), then the whole epochs.
        left = data.remaining_steps(steps, per_rank_batch, size, position)
        if left == 0:
            log.info("elastic: epoch %d ends at the reset (< 1 global batch left)", epoch + 1)
            job.history.append(_end_epoch(model, callbacks, val_ds, epoch))
            continue
        dataset, _ = data.train_dataset(
            job.source,
            per_rank_batch,
            rank,
            size,
            seed=config.data.seed,
            augment=config.data.augment,
            initial_epoch=epoch,
            max_steps=train_cfg.steps_per_epoch,
            start_position=position,
        )
        fit = model.fit(
            dataset,
            initial_epoch=epoch,
            epochs=epoch + 1 if position else train_cfg.epochs,
            steps_per_epoch=left,
            validation_data=val_ds,
            callbacks=callbacks,
            verbose=2 if chief else 0,  # one line per epoch, on rank 0
            shuffle=False,  # the sharded dataset reshuffles itself every epoch
        )
        job.history += records.history_records(fit.history)
    from hvd_train.training.evaluation import evaluate

    final = evaluate(model, val_ds)  # every rank: the metric states are summed over ranks
    return Result(
        epochs_done=train_cfg.epochs,
        history=job.history,
        final={k: float(v) for k, v in final.items()},
        best=_best_on_disk(job.run_dir / "checkpoints") if chief else None,
        seconds=time.monotonic() - job.started,
    )


def train_elastic(config: Config, run_dir: Path, *, argv: list[str] | None = None) -> Result:
    """Train `config` on a changing set of workers (horovodrun's elastic mode); see the module doc.

    Every worker builds the data and the model by itself, without any collective (a joining
    worker's first collective must be the state sync), then trains under `run`.

    Args:
      config: a validated `hvd_train.core.config.Config` that passes `config.check_elastic`.
      run_dir: prepared by `hvd_train.core.rundir.prepare` on the first rank 0.
      argv: the command line, saved with the run.

    Returns:
      The run's history (of this process) and final (global) metrics.

    Raises:
      UserError: a model or data problem, e.g. TFRecord files that do not fit in memory (the
        data position needs the samples in one permutation).
    """
    started = time.monotonic()
    if compat.CLASSIC:
        # Its state, schedules and retracing are written (and tested) against Keras 3 only.
        raise config_lib.ConfigError("--elastic needs the modern stack (TensorFlow >= 2.16)")
    guard = None
    if config.fault.watchdog:
        # A frozen worker is evicted (killed by a child on its host), not waited for: horovodrun
        # then blacklists its host and the others reset and go on.
        guard = faults.FreezeGuard(config.fault.stall_floor_s, config.fault.heartbeat_s)
    try:
        return _train_elastic(config, run_dir, argv, started)
    finally:
        if guard is not None:
            guard.close()


def _train_elastic(config: Config, run_dir: Path, argv: list[str] | None, started: float) -> Result:
    """`train_elastic` under its freeze guard."""
    comm.init(step_ms=config.train.step_ms)
    rank = comm.rank()
    setup.configure_logging(rank)
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        log.warning("--elastic outside horovodrun's elastic mode: workers cannot leave or join")

    setup.apply_numerics(config.train)

    source = data.load(config.data)
    # Decided by each worker alone (no collective before the first sync); a worker whose copy
    # does not fit stops with the error below, since file shards have no data position.
    if config.data.cache and data.fits_in_memory(source, comm.local_size()):
        source = data.decode_into_memory(source)
    if isinstance(source, data.RecordFiles):
        raise data.DataError(
            f"--elastic: {source.pattern!r} must be decoded into memory (data.cache: true, and "
            "enough memory): TFRecord files read every epoch have no data position"
        )

    model = setup.build_model(config, source.input_shape, source.num_classes)
    from hvd_train.keras import embedding

    if embedding.splits_rows(model):  # the same on every worker: it depends on the config alone
        raise config_lib.ConfigError(
            f"--elastic: model {config.model.name!r} splits a table by rows (ShardedEmbedding), "
            "and the rows would not follow a change of workers; train it without --elastic"
        )
    # `_train` sets the schedule for the worker count of the moment; this one only makes the rate
    # a schedule from the start (a rate variable would be dropped from the optimizer's variables
    # when the schedule replaces it, and a joining worker would broadcast one variable more).
    per_rank_batch, global_batch = config_lib.resolved_batch_sizes(config, comm.size())
    steps = _steps_per_epoch(source, config, per_rank_batch, rank, comm.size())
    setup.compile_distributed(model, config, _schedule(config, global_batch, steps, Progress(), 0))

    # Written by the first rank 0 (a joining worker is never rank 0: horovodrun keeps the
    # oldest hosts first).
    if comm.is_chief():
        records.record_launch(run_dir, config, argv or [], comm.size(), elastic=True)

    job = _Job(config, run_dir, source, model, history=[], started=started)
    return run(_train)(TrainingState(model), job)
