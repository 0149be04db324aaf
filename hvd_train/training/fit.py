"""`train_and_evaluate(config, run_dir)`: the whole distributed job behind `hvd-train train`.

What to train (config, data, model) is decided by the caller; this module runs the outer loop:
placement, data shards, the distributed optimizer and its learning-rate rule, resume, Keras fit()
with the distributed callbacks, and rank 0's files. Every rank runs every line here; the lines that
touch files are gated by `dist.is_chief()`, never the collectives.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvd_train import checkpoint as ckpt
from hvd_train import config as config_lib
from hvd_train import dist, faults, guards
from hvd_train.errors import UserError

log = logging.getLogger("hvd_train")

# Exit code when a launch stops early on purpose (--stop-after-epochs) with a checkpoint to resume.
EXIT_STOPPED = 0


@dataclass
class Result:
    """What a finished (or stopped) run reports."""

    epochs_done: int
    history: list[dict[str, float]]
    final: dict[str, float]
    best: dict[str, Any] | None
    seconds: float
    status: str = "finished"  # or "preempted": stopped on a signal, checkpoint written
    stopped_at: dict[str, Any] | None = None  # epoch (1-based) and step of a preempted run


def configure_logging(rank: int) -> None:
    """Log lines carry their rank, so interleaved output of many ranks stays readable."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def _git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """The software every rank must share."""
    import keras
    import tensorflow as tf

    from hvd_train import doctor

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": doctor.package_version("horovod"),
        "hvd_train": doctor.package_version("hvd_train"),
    }


def run_record(config: Any, argv: list[str], size: int) -> dict[str, Any]:
    """What is saved with every launch: config, command, versions, Horovod settings, revision."""
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": argv,
        "size": size,
        "controller": dist.controller(),
        "versions": versions(),
        "horovod_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")},
        "git_revision": _git_revision(),
        "config": config_lib.to_dict(config),
    }


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def write_status(run_dir: Path, status: str, **fields: Any) -> None:
    """Rank 0's run_dir/status.json: how the last launch ended ("finished", "preempted",
    "stalled", "lost", "diverged"); `hvd-train launch` turns it into its exit code."""
    record = {"status": status, "time": time.time(), "pid": os.getpid(), **fields}
    atomic_write(run_dir / "status.json", json.dumps(record, indent=1))


def _start_watchdog(fault: Any, run_dir: Path) -> faults.Watchdog | None:
    """Every rank's watchdog (config.fault), or None with one worker or when switched off."""
    if not fault.watchdog or dist.size() == 1:
        return None
    sock, address = faults.open_socket()
    chief_address = dist.broadcast_object(address, name="hvd_train.watchdog_address")
    before_exit = None
    if dist.is_chief():

        def before_exit(message: str) -> None:
            write_status(run_dir, "stalled", message=message)

    return faults.Watchdog(
        dist.rank(),
        dist.size(),
        sock,
        tuple(chief_address),
        faults.StallRule(fault.stall_floor_s, fault.stall_factor, fault.startup_s),
        fault.heartbeat_s,
        before_exit=before_exit,
    )


def make_optimizer(opt_cfg: Any, schedule: Any) -> Any:
    import keras

    if opt_cfg.name == "sgd":
        return keras.optimizers.SGD(schedule, momentum=opt_cfg.momentum)
    return keras.optimizers.Adam(schedule)


def build_model(config: Any, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The configured model (zoo or `model.file`), with SyncBatchNorm where asked.

    Raises:
      ConfigError: model.params the builder does not take, or a model SyncBatchNorm cannot convert.
    """
    import models

    if config.model.file is not None:
        models.load_file(config.model.file)  # every rank; a no-op after check_train_args
    try:
        model = models.build(config.model.name, input_shape, num_classes, **config.model.params)
    except TypeError as err:  # an unknown or misspelled builder argument
        raise config_lib.ConfigError(f"model.params: {err}") from None
    if config.train.sync_batchnorm:
        try:
            model = dist.convert_sync_batchnorm(model)
        except ValueError as err:
            raise config_lib.ConfigError(f"train.sync_batchnorm: {err}") from None
    return model


def compile_distributed(model: Any, config: Any, schedule: Any) -> Any:
    """Compile `model` with the configured optimizer inside Horovod's gradient averaging, and
    build the optimizer's variables now (a checkpoint restore or a broadcast needs them).
    Returns the distributed optimizer."""
    import keras

    opt_cfg = config.optimizer
    optimizer = dist.DistributedOptimizer(
        make_optimizer(opt_cfg, schedule),
        compression=getattr(dist.Compression, opt_cfg.compression),
        gradient_predivide_factor=opt_cfg.gradient_predivide_factor,
        backward_passes_per_step=opt_cfg.backward_passes_per_step,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=config.train.jit_compile,
    )
    optimizer.build(model.trainable_variables)
    return optimizer


def file_writers(config: Any, run_dir: Path, size: int, steps: int, best: Any) -> list[Any]:
    """Rank 0's writers: the CheckpointWriter first, then metrics.json, and metrics.csv and
    TensorBoard where the config asks for them. `best`: the monitored best so far (resume)."""
    import keras

    from hvd_train.callbacks import CheckpointWriter, JsonMetrics

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
        writers.append(keras.callbacks.CSVLogger(str(run_dir / "metrics.csv"), append=True))
    if config.logging.tensorboard:
        writers.append(keras.callbacks.TensorBoard(str(run_dir / "tensorboard")))
    return writers


def _restore(model: Any, checkpoint: Any) -> None:
    """Put a checkpoint's values into the model and its (built) optimizer (rank 0)."""
    optimizer_variables = dist.optimizer_variables(model.optimizer)
    targets = list(model.variables) + optimizer_variables
    values = checkpoint.model + checkpoint.optimizer
    if len(checkpoint.model) != len(model.variables) or len(values) != len(targets):
        raise ckpt.CheckpointError(
            f"checkpoint {checkpoint.path} holds {len(checkpoint.model)} model and "
            f"{len(checkpoint.optimizer)} optimizer variables; this model has "
            f"{len(model.variables)} and {len(optimizer_variables)}"
        )
    for var, value in zip(targets, values, strict=True):
        if tuple(var.shape) != value.shape:
            raise ckpt.CheckpointError(
                f"checkpoint {checkpoint.path}: variable {dist.variable_name(var)} has shape "
                f"{value.shape} there, {tuple(var.shape)} in this model"
            )
    for var, value in zip(targets, values, strict=True):
        var.assign(value)


def train_and_evaluate(
    config: Any,
    run_dir: Path,
    *,
    resume: bool = False,
    stop_after_epochs: int | None = None,
    argv: list[str] | None = None,
) -> Result:
    """Train `config` on all ranks of this job; rank 0 writes checkpoints and metrics to run_dir.

    Args:
      config: a validated `hvd_train.config.Config`.
      run_dir: prepared by `hvd_train.rundir.prepare` on rank 0 (others never write there).
      resume: continue from the newest valid checkpoint in run_dir (rank 0 reads it, then
        broadcasts: other ranks need no access to the files).
      stop_after_epochs: train at most this many epochs in this launch (the schedule still spans
        config.train.epochs), checkpoint, and return; resume later.
      argv: the command line, saved with the run.

    Returns:
      The run's history and final (global) metrics.

    Raises:
      UserError: a model, data or checkpoint problem (one line; the same on every rank).
    """
    started = time.monotonic()
    # First: a signal from now on stops the job at an agreed step instead of killing this rank.
    stop = faults.StopRequest(config.fault.stop_signals)
    dist.init(step_ms=config.train.step_ms)
    configure_logging(dist.rank())
    watchdog = _start_watchdog(config.fault, run_dir)
    try:
        return _train(config, run_dir, resume, stop_after_epochs, argv, started, stop, watchdog)
    finally:
        stop.close()
        if watchdog is not None:
            watchdog.close()


def _train(
    config: Any,
    run_dir: Path,
    resume: bool,
    stop_after_epochs: int | None,
    argv: list[str] | None,
    started: float,
    stop: faults.StopRequest,
    watchdog: faults.Watchdog | None,
) -> Result:
    rank, size, chief = dist.rank(), dist.size(), dist.is_chief()

    import keras
    import tensorflow as tf

    from hvd_train import callbacks as cbs
    from hvd_train import data
    from hvd_train.callbacks import distributed_callbacks
    from hvd_train.lr_schedule import scaled_warmup_schedule

    train_cfg, opt_cfg = config.train, config.optimizer
    # Before the model and the optimizer exist: both read the policy when they are made.
    keras.mixed_precision.set_global_policy(train_cfg.precision)
    keras.utils.set_random_seed(train_cfg.seed)
    if train_cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    per_rank_batch, global_batch = config_lib.resolved_batch_sizes(config, size)

    # --- resume: rank 0 picks the checkpoint; its epoch travels to all ranks -----------------
    checkpoint_dir = run_dir / "checkpoints"
    restored, meta = None, None
    if resume and chief:
        restored, problems = ckpt.newest_valid(checkpoint_dir)
        for problem in problems:
            # Set aside, not deleted: its epoch is trained again and checkpointed anew.
            log.warning("%s; set aside as %s", problem, ckpt.set_aside(problem.path).name)
        meta = restored.meta if restored else None
    meta = dist.broadcast_object(meta, name="hvd_train.resume_meta")
    initial_epoch = meta["epoch"] + 1 if meta else 0
    initial_step = meta.get("epoch_step", 0) if meta else 0  # steps of initial_epoch done
    if resume and chief and meta:
        where = f"after epoch {initial_epoch}"
        if initial_step:
            where = f"after step {initial_step} of epoch {initial_epoch + 1}"
        log.info("resuming %s from %s", where, restored.path)
    elif resume and chief:
        log.info("no checkpoint in %s: starting at epoch 1", checkpoint_dir)

    # --- data: each rank its shard, equal steps ----------------------------------------------
    arrays = data.load(config.data)  # in memory, or image/TFRecord files read every epoch
    if config.data.cache:
        # Files are decoded into memory only if they fit on every rank: a rank that kept reading
        # them would shard them by another rule, and the shards would overlap.
        fits = data.fits_in_memory(arrays, dist.local_size())
        if all(dist.allgather_object(fits, name="hvd_train.data_fits")):
            arrays = data.decode_into_memory(arrays)

    def epochs_from(first_epoch: int) -> tuple[Any, int]:
        return data.train_dataset(
            arrays,
            per_rank_batch,
            rank,
            size,
            seed=config.data.seed,
            augment=config.data.augment,
            initial_epoch=first_epoch,
            # The cap shortens every epoch of the data too, so a resumed run reads what an
            # uninterrupted one would.
            max_steps=train_cfg.steps_per_epoch,
        )

    train_ds, steps = epochs_from(initial_epoch)
    val_ds = data.validation_dataset(arrays, per_rank_batch, rank, size)

    # --- model and the distributed optimizer -------------------------------------------------
    model = build_model(config, arrays.input_shape, arrays.num_classes)
    passes = opt_cfg.backward_passes_per_step
    schedule = scaled_warmup_schedule(
        base_lr=opt_cfg.base_lr,
        base_batch_size=opt_cfg.base_batch_size,
        # One update sees `passes` batches on every rank.
        global_batch_size=global_batch * passes,
        updates_per_epoch=steps / passes,
        warmup_epochs=opt_cfg.warmup_epochs,
        epochs=train_cfg.epochs,
        rule=opt_cfg.lr_rule,
        decay=opt_cfg.decay,
        decay_rate=opt_cfg.decay_rate,
        decay_epochs=opt_cfg.decay_epochs,
    )
    compile_distributed(model, config, schedule)
    # Ranks started with another config, software or model fail here, by name, on every rank.
    shapes = [list(v.shape) for v in model.variables]
    fingerprint = guards.fingerprint(config_lib.to_dict(config), versions(), shapes)
    guards.compare(dist.allgather_object(fingerprint, name="hvd_train.fingerprint"))
    error = None
    if restored is not None:
        try:
            _restore(model, restored)
        except ckpt.CheckpointError as err:
            error = str(err)
    # Every rank must learn of rank 0's failure, or they would wait for it in a collective.
    error = dist.broadcast_object(error, name="hvd_train.restore_error")
    if error:
        raise ckpt.CheckpointError(error)

    # --- callbacks: collectives on every rank first, then rank 0's writers --------------------
    writers: list[Any] = []
    writer = None
    if chief:
        if not (run_dir / "run.json").exists():
            record = run_record(config, argv or [], size)
            atomic_write(run_dir / "run.json", json.dumps(record, indent=1))
        with (run_dir / "launches.jsonl").open("a") as f:
            launch = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": argv or []}
            f.write(json.dumps({**launch, "size": size, "initial_epoch": initial_epoch}) + "\n")
        (run_dir / "config.yaml").write_text(config_lib.dump(config))
        writers += file_writers(config, run_dir, size, steps, best=(meta or {}).get("best"))
        writer = writers[0]

    def write_checkpoint(epoch: int, step: int) -> Path:
        # Rank 0 only; the watchdogs wait while it writes.
        with watchdog.busy() if watchdog is not None else contextlib.nullcontext():
            return writer.write(epoch, step)

    # Fault handling, on every rank: the feed is local, the rest run collectives at the same
    # steps everywhere; a checkpoint inside the epoch, or the stop, before rank 0's writers.
    faulty: list[Any] = []
    if watchdog is not None:
        faulty.append(cbs.FeedWatchdog(watchdog))
    if config.fault.check_weights_every:
        faulty.append(cbs.CheckWeights(config.fault.check_weights_every))
    in_epoch: list[Any] = []
    if config.checkpoint.every_steps:
        every = config.checkpoint.every_steps
        in_epoch.append(cbs.StepCheckpoint(every, steps, write_checkpoint if chief else None))
    in_epoch.append(cbs.StopAtAgreedStep(stop))
    callbacks = [*distributed_callbacks(), *faulty, *in_epoch, *writers]

    last_epoch = train_cfg.epochs
    if stop_after_epochs is not None:
        last_epoch = min(last_epoch, initial_epoch + stop_after_epochs)
    # (dataset, first epoch, end epoch, steps per epoch, steps of the first epoch already done)
    segments = []
    if initial_epoch < last_epoch and initial_step:
        # Resume mid-epoch: the rest of that epoch as a fit of its own, then the full epochs.
        rest = train_ds.skip(initial_step).take(steps - initial_step)
        segments.append(
            (rest, initial_epoch, initial_epoch + 1, steps - initial_step, initial_step)
        )
        if initial_epoch + 1 < last_epoch:
            train_ds, _ = epochs_from(initial_epoch + 1)
            segments.append((train_ds, initial_epoch + 1, last_epoch, steps, 0))
    elif initial_epoch < last_epoch:
        segments.append((train_ds, initial_epoch, last_epoch, steps, 0))
    history: dict[str, list[float]] = {}
    try:
        for dataset, first, end, steps_now, done in segments:
            for callback in in_epoch:
                callback.start_at(first, done)
            fit = model.fit(
                dataset,
                initial_epoch=first,
                epochs=end,
                steps_per_epoch=steps_now,
                validation_data=val_ds,
                callbacks=callbacks,
                # The progress bar on rank 0 only; its epoch line shows the global metrics.
                verbose=1 if chief else 0,
                shuffle=False,  # the sharded dataset reshuffles itself every epoch
            )
            for key, values in fit.history.items():
                history.setdefault(key, []).extend(values)
    except cbs.Preempted as stopped:
        return _preempted(stopped, model, run_dir, steps, write_checkpoint, history, started)
    except faults.Diverged as err:
        if chief:
            write_status(run_dir, "diverged", message=str(err))
        raise
    except (faults.JobFailure, UserError):
        raise
    except Exception as err:
        # A collective failed: if ranks went silent, they died; say which.
        lost = watchdog.lost_ranks() if watchdog is not None else None
        if lost is None:
            raise
        message = f"lost {lost}; the collective failed with: {_cause(err)}"
        if chief:
            write_status(run_dir, "lost", message=message)
        raise faults.RankLost(message) from err
    if chief and segments:
        from hvd_train import plots

        plots.training_curves(run_dir / "metrics.json", run_dir / "metrics.png")
    if not segments:
        log.info("nothing to train: the run already finished %d epochs", train_cfg.epochs)
    final = model.evaluate(val_ds, return_dict=True, verbose=0)
    epochs_logged = [
        dict(zip(history, values, strict=True)) for values in zip(*history.values(), strict=True)
    ]
    if chief:
        write_status(run_dir, "finished", epochs=last_epoch)
    return Result(
        epochs_done=last_epoch if initial_epoch < last_epoch else train_cfg.epochs,
        history=epochs_logged,
        final={k: float(v) for k, v in final.items()},
        best=writer.best if writer is not None else None,
        seconds=time.monotonic() - started,
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
    write_checkpoint: Any,
    history: dict[str, list[float]],
    started: float,
) -> Result:
    """Every rank left fit() after the same step: checkpoint there (rank 0) and report."""
    epoch, step = stopped.epoch, stopped.step_in_epoch
    dist.average_non_trainable(model)  # a collective: the same on every rank
    names = dist.allgather_object(stopped.signal_name, name="hvd_train.stop_signals")
    got = ", ".join(f"{name} on rank {r}" for r, name in enumerate(names) if name) or "stop"
    path = None
    if dist.is_chief():
        # The epoch's last step: a finished epoch (its validation did not run).
        position = (epoch, 0) if step == steps else (epoch, step)
        path = run_dir / "checkpoints" / ckpt.epoch_dir_name(*position)
        if not path.exists():  # a step checkpoint of the same step may be there already
            path = write_checkpoint(*position)
        write_status(
            run_dir,
            "preempted",
            signals=got,
            epoch=epoch + 1,
            step=step,
            checkpoint=str(path),
        )
        log.warning(
            "%s: stopped after step %d of epoch %d on every rank; checkpoint %s; resume with "
            "--resume",
            got,
            step,
            epoch + 1,
            path,
        )
    epochs_logged = [
        dict(zip(history, values, strict=True)) for values in zip(*history.values(), strict=True)
    ]
    return Result(
        epochs_done=epoch,
        history=epochs_logged,
        final={},
        best=None,
        seconds=time.monotonic() - started,
        status="preempted",
        stopped_at={"epoch": epoch + 1, "step": step, "checkpoint": str(path) if path else None},
    )
