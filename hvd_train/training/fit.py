"""`train_and_evaluate(config, run_dir)`: the whole distributed job behind `hvd-train train`.

What to train (config, data, model) is decided by the caller; this module runs the outer loop:
placement, data shards, the distributed optimizer and its learning-rate rule, resume, Keras fit()
with the distributed callbacks, and rank 0's files. Every rank runs every step here, and the same
collectives in the same order; the lines that touch files are gated by `comm.is_chief()`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvd_train import comm
from hvd_train.core import checkpoint as ckpt
from hvd_train.core import config as config_lib
from hvd_train.core import faults
from hvd_train.core.config import Config
from hvd_train.core.outcome import Status
from hvd_train.errors import UserError, everywhere
from hvd_train.keras import compat
from hvd_train.training import records, setup
from hvd_train.training import start as job_start
from hvd_train.training.setup import Result

log = logging.getLogger("hvd_train")


def train_and_evaluate(
    config: Config,
    run_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    prepared: bool = False,
    stop_after_epochs: int | None = None,
    argv: list[str] | None = None,
    stop: faults.StopRequest | None = None,
) -> Result:
    """Train `config` on all ranks of this job; rank 0 writes checkpoints and metrics to run_dir.

    Args:
      config: a validated `hvd_train.core.config.Config`.
      run_dir: prepared by rank 0 (`hvd_train.core.rundir.prepare`) once every rank is known to
        run the same config and the data are there; the other ranks never write there.
      resume: continue from the newest valid checkpoint in run_dir (rank 0 reads it, then
        broadcasts: other ranks need no access to the files).
      overwrite: replace an existing hvd_train run in run_dir.
      prepared: the data were checked and run_dir prepared already (a one-worker job does that
        before TensorFlow starts).
      stop_after_epochs: train at most this many epochs in this launch (the schedule still spans
        config.train.epochs), checkpoint, and return; resume later.
      argv: the command line, saved with the run.
      stop: the stop signals' handler, where the caller installed it before TensorFlow loaded
        (`hvd-train train`); None: installed here, and removed on return.

    Returns:
      The run's history and final (global) metrics.

    Raises:
      UserError: a config, model, data, run directory or checkpoint problem (one line; the same
        on every rank).
    """
    started = time.monotonic()
    # First: a signal from now on stops the job at an agreed step instead of killing this rank.
    owned = stop is None
    stop = faults.StopRequest(config.fault.stop_signals) if stop is None else stop
    watchdog = None
    try:
        comm.init(step_ms=config.train.step_ms, model_group_size=config.parallel.model_group_size)
        setup.configure_logging(comm.rank())
        # Before any collective that only some settings run (the watchdog's, the data-cache
        # vote): ranks started differently get the error instead of a hang.
        hosts = job_start.agree_on_job(config)
        if not prepared:
            job_start.prepare_on_chief(config, run_dir, resume, overwrite)
        watchdog = _start_watchdog(config.fault, run_dir)
        return _train(
            config, run_dir, resume, stop_after_epochs, argv or [], started, stop, watchdog, hosts
        )
    finally:
        if owned:
            stop.close()
        if watchdog is not None:
            watchdog.close()


def _train(
    config: Config,
    run_dir: Path,
    resume: bool,
    stop_after_epochs: int | None,
    argv: list[str],
    started: float,
    stop: faults.StopRequest,
    watchdog: faults.Watchdog | None,
    hosts: list[str],
) -> Result:
    from hvd_train import data

    size, chief = comm.size(), comm.is_chief()
    setup.apply_numerics(config.train)
    per_rank_batch, global_batch = config_lib.resolved_batch_sizes(config, size)
    start = _resume_point(run_dir, resume)
    source = _load_data(config)

    def epochs_from(first_epoch: int) -> tuple[Any, int]:
        return data.train_dataset(
            source,
            per_rank_batch,
            comm.rank(),
            size,
            seed=config.data.seed,
            augment=config.data.augment,
            initial_epoch=first_epoch,
            # The cap shortens every epoch of the data too, so a resumed run reads what an
            # uninterrupted one would.
            max_steps=config.train.steps_per_epoch,
        )

    train_ds, steps = epochs_from(start.epoch)
    model = _build_and_compile(config, source, global_batch, steps)
    from hvd_train.keras import embedding

    # A table split by rows makes every validation batch a collective: as many on every rank.
    val_ds = data.validation_dataset(
        source, per_rank_batch, comm.rank(), size, equal_batches=embedding.has_row_shards(model)
    )
    job_start.check_model(model)  # before the first collective that depends on the model
    _restore_everywhere(model, start)

    from hvd_train.training.chief import ChiefFiles, ChiefWriters

    # Rank 0's files are written in sections every rank passes through: a failed write ends the
    # job on every rank with the file's name, instead of leaving the others in a collective.
    files = ChiefFiles(run_dir, watchdog)
    files.write(
        run_dir / "launches.jsonl",
        lambda: records.record_launch(
            run_dir, config, argv, size, hosts=records.placement(hosts), initial_epoch=start.epoch
        ),
    )
    best = (start.meta or {}).get("best")
    # Rank 0's writers (metrics.json is read to be continued); none elsewhere.
    writers: list[Any] = (
        files.write(run_dir / "metrics.json", lambda: _writers(config, run_dir, size, steps, best))
        or []
    )
    from hvd_train.callbacks import GatherRowShards, GatherShardedState, distributed_callbacks
    from hvd_train.keras import embedding, sharded

    # A sharded optimizer's state, or a table split by rows with its slots, is gathered whole on
    # every rank at each checkpoint, one variable at a time as rank 0 writes it.
    gathered: list[Any] = []
    if sharded.is_sharded(model.optimizer):
        gathered = [GatherShardedState(model.optimizer)]
        if writers:
            writers[0].optimizer_state = gathered[0].take
    elif embedding.has_row_shards(model):
        gathered = [GatherRowShards(model)]
        if writers:
            writers[0].whole_state = gathered[0].take
    write_checkpoint = _checkpoint_writer(files, writers[0] if writers else None, gathered)
    fault_callbacks, in_epoch = _fault_callbacks(config, steps, stop, watchdog, write_checkpoint)

    # Collectives on every rank first, then the fault handling, then rank 0's writers (on every
    # rank: they agree on the outcome of rank 0's writes at epoch ends).
    callbacks = [
        *distributed_callbacks(),
        *fault_callbacks,
        *in_epoch,
        *gathered,
        ChiefWriters(files, writers, settle=[gather.settle for gather in gathered]),
    ]

    last_epoch = config.train.epochs
    if stop_after_epochs is not None:
        last_epoch = min(last_epoch, start.epoch + stop_after_epochs)
    plan = segments(start.epoch, start.step, last_epoch, steps)
    history: dict[str, list[float]] = {}
    try:
        for segment in plan:
            for callback in in_epoch:
                callback.start_at(segment.first_epoch, segment.done)
            dataset = train_ds if segment.first_epoch == start.epoch else None
            if dataset is None:
                dataset, _ = epochs_from(segment.first_epoch)
            if segment.done:
                dataset = dataset.skip(segment.done).take(segment.steps)
            fit = model.fit(
                dataset,
                initial_epoch=segment.first_epoch,
                epochs=segment.end_epoch,
                steps_per_epoch=segment.steps,
                validation_data=val_ds,
                callbacks=callbacks,
                # The progress bar on rank 0 only; its epoch line shows the global metrics.
                verbose=1 if chief else 0,
                shuffle=False,  # the sharded dataset reshuffles itself every epoch
            )
            for key, values in fit.history.items():
                history.setdefault(key, []).extend(values)
    except Exception as err:
        return _ended_early(
            err, model, run_dir, steps, write_checkpoint, history, started, watchdog
        )
    return _finish(config, files, model, val_ds, plan, history, writers, start, last_epoch, started)


@dataclass(frozen=True)
class ResumePoint:
    """Where this launch starts: after `step` steps of epoch `epoch` (0-based), from `checkpoint`
    (rank 0 only; None elsewhere and on a fresh start) whose `meta` every rank has."""

    epoch: int = 0
    step: int = 0
    checkpoint: Any = None
    meta: dict[str, Any] | None = None


def _resume_point(run_dir: Path, resume: bool) -> ResumePoint:
    """Rank 0 picks the newest valid checkpoint; its meta travels to all ranks (collective)."""
    checkpoint_dir = run_dir / "checkpoints"
    restored, meta = None, None
    if resume and comm.is_chief():
        restored, problems = ckpt.newest_valid(checkpoint_dir)
        for problem in problems:
            # Set aside, not deleted: its epoch is trained again and checkpointed anew.
            log.warning("%s; set aside as %s", problem, ckpt.set_aside(problem.path).name)
        meta = restored.meta if restored else None
    meta = comm.broadcast_object(meta, name="hvd_train.resume_meta")
    if not meta:
        if resume and comm.is_chief():
            log.info("no checkpoint in %s: starting at epoch 1", checkpoint_dir)
        return ResumePoint()
    point = ResumePoint(meta["epoch"] + 1, meta.get("epoch_step", 0), restored, meta)
    if comm.is_chief():
        where = f"after epoch {point.epoch}"
        if point.step:
            where = f"after step {point.step} of epoch {point.epoch + 1}"
        log.info("resuming %s from %s", where, restored.path)
    return point


def _load_data(config: Config) -> Any:
    """The data source, in memory or as files read every epoch."""
    from hvd_train import data

    source = data.load(config.data)
    if config.data.cache:
        # Files are decoded into memory only if they fit on every rank: a rank that kept reading
        # them would shard them by another rule, and the shards would overlap.
        fits = data.fits_in_memory(source, comm.local_size())
        if all(comm.allgather_object(fits, name="hvd_train.data_fits")):
            source = data.decode_into_memory(source)
    return source


def _build_and_compile(config: Config, source: Any, global_batch: int, steps: int) -> Any:
    """The model, compiled with the distributed optimizer and the scaled, warmed-up schedule."""
    model = setup.build_model(config, source.input_shape, source.num_classes)
    passes = config.optimizer.backward_passes_per_step
    # One update sees `passes` batches on every rank.
    schedule = setup.make_schedule(config, global_batch * passes, steps / passes)
    setup.compile_distributed(model, config, schedule)
    return model


def _restore_everywhere(model: Any, start: ResumePoint) -> None:
    """Rank 0 puts the checkpoint into the model; every rank learns whether that failed (the
    values themselves reach the others with the start-of-training broadcast; a sharded
    optimizer's shards go to every rank here, each rank taking its piece)."""
    from hvd_train.keras import embedding, sharded

    checkpoint, error = start.checkpoint, None
    if checkpoint is not None:
        try:
            restore(model, checkpoint)
        except ckpt.CheckpointError as err:
            error = str(err)
    # Every rank must learn of rank 0's failure, or they would wait for it in a collective.
    error = comm.broadcast_object(error, name="hvd_train.restore_error")
    if error:
        raise everywhere(ckpt.CheckpointError(error))
    if start.meta and sharded.is_sharded(model.optimizer):
        values = checkpoint.optimizer if checkpoint is not None else None
        source = f"checkpoint {checkpoint.path}" if checkpoint is not None else ""
        sharded.restore_whole(model.optimizer, values, source)
    if start.meta and embedding.has_row_shards(model):
        # Rank 0 checked the whole shapes; each rank takes its rows at this worker count.
        for variables, values in (
            (model.variables, checkpoint.model if checkpoint is not None else None),
            (
                compat.optimizer_variables(model.optimizer),
                checkpoint.optimizer if checkpoint is not None else None,
            ),
        ):
            for i, variable in enumerate(variables):
                if embedding.is_row_sharded(variable):
                    embedding.scatter_rows(variable, None if values is None else values[i])


def restore(model: Any, checkpoint: Any) -> None:
    """Put a checkpoint's values into the model and its (built) optimizer (rank 0); a sharded
    optimizer's are only counted here (`keras.sharded.restore_whole` puts them back).

    Raises:
      CheckpointError: the checkpoint's variables do not match this model's in count or shape.
    """
    from hvd_train.keras import embedding, sharded

    optimizer = model.optimizer
    is_sharded = sharded.is_sharded(optimizer)
    if is_sharded:
        optimizer_variables = sharded.saved_variables(optimizer)
    else:
        optimizer_variables = compat.optimizer_variables(optimizer)
    values = checkpoint.model + checkpoint.optimizer
    if len(checkpoint.model) != len(model.variables) or len(checkpoint.optimizer) != len(
        optimizer_variables
    ):
        saved = checkpoint.meta.get("config", {}).get("optimizer", {}).get("shard_state", False)
        hint = f" (written with optimizer.shard_state {str(saved).lower()})"
        raise ckpt.CheckpointError(
            f"checkpoint {checkpoint.path} holds {len(checkpoint.model)} model and "
            f"{len(checkpoint.optimizer)} optimizer variables; this model has "
            f"{len(model.variables)} and {len(optimizer_variables)}"
            + (hint if saved != is_sharded else "")
        )
    targets = list(model.variables) + ([] if is_sharded else optimizer_variables)
    values = values[: len(targets)]
    for var, value in zip(targets, values, strict=True):
        if embedding.whole_shape(var) != value.shape:
            raise ckpt.CheckpointError(
                f"checkpoint {checkpoint.path}: variable {compat.variable_name(var)} has shape "
                f"{value.shape} there, {embedding.whole_shape(var)} in this model"
            )
    for var, value in zip(targets, values, strict=True):
        if not embedding.is_row_sharded(var):  # a row shard: `scatter_rows` on every rank
            var.assign(value)


def _writers(config: Config, run_dir: Path, size: int, steps: int, best: Any) -> list[Any]:
    from hvd_train.training.writers import file_writers

    return file_writers(config, run_dir, size, steps, best)


def _checkpoint_writer(
    files: Any, writer: Any, gathered: list[Any]
) -> Callable[[int, int], Path | None]:
    """`write(epoch, step)`: a checkpoint now, on every rank (collective: a sharded optimizer's
    state is `gathered` first; rank 0's `writer` writes while the watchdogs wait, then every
    rank learns whether that failed, `ChiefFiles.write`). Returns its directory on rank 0, None
    elsewhere; one already there is kept (a stop at the step of a step checkpoint)."""

    def write_on_chief(path: Path, epoch: int, step: int) -> Path:
        try:
            return path if path.exists() else writer.write(epoch, step)
        finally:
            for gather in gathered:
                gather.settle()  # what the writer did not take, or all of it (kept, or it failed)

    def write(epoch: int, step: int) -> Path | None:
        path = files.run_dir / "checkpoints" / ckpt.epoch_dir_name(epoch, step)
        for gather in gathered:
            gather.gather()
        return files.write(path, lambda: write_on_chief(path, epoch, step))

    return write


def _fault_callbacks(
    config: Config,
    steps: int,
    stop: faults.StopRequest,
    watchdog: faults.Watchdog | None,
    write_checkpoint: Callable[[int, int], Path | None],
) -> tuple[list[Any], list[Any]]:
    """Fault handling, on every rank: the watchdog's feed (local) and the weight check, then the
    callbacks that know the step inside the epoch (a checkpoint every N steps, the agreed stop),
    whose collectives run at the same steps everywhere."""
    from hvd_train import callbacks as cbs

    watched: list[Any] = []
    if watchdog is not None:
        watched.append(cbs.FeedWatchdog(watchdog))
    if config.fault.check_weights_every:
        watched.append(cbs.CheckWeights(config.fault.check_weights_every))
    in_epoch: list[Any] = []
    if config.checkpoint.every_steps:
        in_epoch.append(cbs.StepCheckpoint(config.checkpoint.every_steps, steps, write_checkpoint))
    in_epoch.append(cbs.StopAtAgreedStep(stop))
    return watched, in_epoch


@dataclass(frozen=True)
class Segment:
    """One `fit()` of the launch: epochs [first_epoch, end_epoch) of `steps` steps each, the
    first of which already had `done` steps trained before this launch."""

    first_epoch: int
    end_epoch: int
    steps: int
    done: int


def segments(initial_epoch: int, initial_step: int, last_epoch: int, steps: int) -> list[Segment]:
    """The fits of a launch that starts after `initial_step` steps of `initial_epoch` and trains
    up to `last_epoch`: a mid-epoch resume first finishes that epoch in a fit of its own."""
    if initial_epoch >= last_epoch:
        return []
    if not initial_step:
        return [Segment(initial_epoch, last_epoch, steps, 0)]
    plan = [Segment(initial_epoch, initial_epoch + 1, steps - initial_step, initial_step)]
    if initial_epoch + 1 < last_epoch:
        plan.append(Segment(initial_epoch + 1, last_epoch, steps, 0))
    return plan


def _ended_early(
    err: Exception,
    model: Any,
    run_dir: Path,
    steps: int,
    write_checkpoint: Callable[[int, int], Path | None],
    history: dict[str, list[float]],
    started: float,
    watchdog: faults.Watchdog | None,
) -> Result:
    """A fit() that raised: a preemption is reported (after its checkpoint); a divergence and a
    lost rank are recorded in status.json and raised as job failures; anything else is raised."""
    from hvd_train.callbacks import Preempted

    if isinstance(err, Preempted):
        return _preempted(err, model, run_dir, steps, write_checkpoint, history, started)
    if isinstance(err, faults.Diverged):
        _record_failure(run_dir, Status.DIVERGED, str(err))
        raise err
    if isinstance(err, faults.JobFailure | UserError):
        raise err
    # A collective failed: if ranks went silent, they died; say which.
    lost = watchdog.lost_ranks() if watchdog is not None else None
    if lost is None:
        raise err
    message = f"lost {lost}; the collective failed with: {_cause(err)}"
    _record_failure(run_dir, Status.LOST, message)
    raise faults.RankLost(message) from err


def _record_failure(run_dir: Path, status: Status, message: str) -> None:
    """Rank 0 records how the job failed, if it can (no collective: a rank may be gone, and
    every rank raises the job's own error next)."""
    if not comm.is_chief():
        return
    try:
        records.write_status(run_dir, status, message=message)
    except OSError as err:
        log.warning("status.json not written: %s", err)


def _finish(
    config: Config,
    files: Any,
    model: Any,
    val_ds: Any,
    plan: list[Segment],
    history: dict[str, list[float]],
    writers: list[Any],
    start: ResumePoint,
    last_epoch: int,
    started: float,
) -> Result:
    """The final evaluation (every rank: metrics are reduced; the watchdog is fed) and rank 0's
    plot and status, each a section every rank passes through (`ChiefFiles.write`)."""
    from hvd_train.callbacks import FeedWatchdog

    run_dir = files.run_dir

    def plot() -> None:
        from hvd_train import plots

        plots.training_curves(run_dir / "metrics.json", run_dir / "metrics.png")

    if plan:
        files.write(run_dir / "metrics.png", plot)
    if not plan:
        log.info("nothing to train: the run already finished %d epochs", config.train.epochs)
    from hvd_train.training.evaluation import evaluate

    fed = [FeedWatchdog(files.watchdog)] if files.watchdog is not None else []
    # Every rank: the metric states are summed over ranks.
    final = evaluate(model, val_ds, callbacks=fed)
    files.write(
        run_dir / "status.json",
        lambda: records.write_status(run_dir, Status.FINISHED, epochs=last_epoch),
    )
    return Result(
        epochs_done=last_epoch if start.epoch < last_epoch else config.train.epochs,
        history=records.history_records(history),
        final={k: float(v) for k, v in final.items()},
        best=writers[0].best if writers else None,
        seconds=time.monotonic() - started,
    )


def _start_watchdog(fault: config_lib.FaultConfig, run_dir: Path) -> faults.Watchdog | None:
    """Every rank's watchdog (config.fault), or None with one worker or when switched off.

    A collective: rank 0 picks its address and the job's token, and one broadcast tells all.
    """
    if not fault.watchdog or comm.size() == 1:
        return None
    sock, contact, error = None, None, None
    try:
        sock, contact = faults.open_socket(comm.rank(), spans_hosts=comm.local_size() < comm.size())
    except UserError as err:  # rank 0's choice of address: the others must learn of it
        error = str(err)
    contact, error = comm.broadcast_object((contact, error), name="hvd_train.watchdog_contact")
    if error is not None:
        if sock is not None:
            sock.close()
        raise everywhere(UserError(error))
    before_exit = None
    if comm.is_chief():

        def before_exit(message: str) -> None:
            records.write_status(run_dir, Status.STALLED, message=message)

    return faults.Watchdog(
        comm.rank(),
        comm.size(),
        sock,
        contact,
        faults.StallRule(fault.stall_floor_s, fault.stall_factor, fault.startup_s),
        fault.heartbeat_s,
        before_exit=before_exit,
    )


def _cause(err: BaseException) -> str:
    """The line of a (long, TensorFlow-wrapped) error that says what the collective hit."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for pattern in (r"shut down|[Cc]onnection|[Pp]eer|Gloo|MPI", r"Horovod"):
        telling = [x for x in lines if re.search(pattern, x) and not x.startswith("Detected at")]
        if telling:
            return telling[0][:200]
    return (lines or [type(err).__name__])[0][:200]


def _preempted(
    stopped: Any,
    model: Any,
    run_dir: Path,
    steps: int,
    write_checkpoint: Callable[[int, int], Path | None],
    history: dict[str, list[float]],
    started: float,
) -> Result:
    """Every rank left fit() after the same step: checkpoint there (rank 0) and report; the
    checkpoint and status.json are sections every rank passes through (`ChiefFiles.write`)."""
    from hvd_train.keras.state import average_non_trainable
    from hvd_train.training.chief import ChiefFiles

    epoch, step = stopped.epoch, stopped.step_in_epoch
    average_non_trainable(model)  # a collective: the same on every rank
    names = comm.allgather_object(stopped.signal_name, name="hvd_train.stop_signals")
    got = ", ".join(f"{name} on rank {r}" for r, name in enumerate(names) if name) or "stop"
    # The epoch's last step: a finished epoch (its validation did not run). A step checkpoint of
    # the same step may be there already (then kept).
    position = (epoch, 0) if step == steps else (epoch, step)
    path = write_checkpoint(*position)  # rank 0's path; None elsewhere
    ChiefFiles(run_dir).write(
        run_dir / "status.json",
        lambda: records.write_status(
            run_dir,
            Status.PREEMPTED,
            signals=got,
            epoch=epoch + 1,
            step=step,
            checkpoint=str(path),
        ),
    )
    if comm.is_chief():
        log.warning(
            "%s: stopped after step %d of epoch %d on every rank; checkpoint %s; resume with "
            "--resume",
            got,
            step,
            epoch + 1,
            path,
        )
    return Result(
        epochs_done=epoch,
        history=records.history_records(history),
        final={},
        best=None,
        seconds=time.monotonic() - started,
        status=Status.PREEMPTED,
        stopped_at={"epoch": epoch + 1, "step": step, "checkpoint": str(path) if path else None},
    )
