"""The set-up both training loops share (`fit` and `elastic`): logging, the process's numerical
settings, the model, the learning-rate schedule, the distributed compile, and what a run reports.

Every rank runs each of these with the same config; none runs a collective.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from hvd_train import comm
from hvd_train.core import config as config_lib
from hvd_train.core.config import Config
from hvd_train.core.outcome import Status

log = logging.getLogger("hvd_train")


@dataclass
class Result:
    """What a finished (or stopped) run reports."""

    epochs_done: int
    history: list[dict[str, float]]
    final: dict[str, float]
    best: dict[str, Any] | None
    seconds: float
    status: Status = Status.FINISHED  # or PREEMPTED: stopped on a signal, checkpoint written
    stopped_at: dict[str, Any] | None = None  # epoch (1-based) and step of a preempted run


def configure_logging(rank: int) -> None:
    """Log lines carry their rank, so interleaved output of many ranks stays readable."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def apply_numerics(train: config_lib.TrainConfig) -> None:
    """Precision policy, seeds and op determinism: before the model and the optimizer exist (both
    read the policy when they are made)."""
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy(train.precision)
    keras.utils.set_random_seed(train.seed)
    if train.deterministic:
        tf.config.experimental.enable_op_determinism()


def make_optimizer(opt_cfg: config_lib.OptimizerConfig, schedule: Any) -> Any:
    """The configured Keras optimizer (not yet distributed).

    Raises:
      ConfigError: Adam or AdamW with gradient accumulation on the classic stack.
    """
    import keras

    from hvd_train.keras import compat, large_batch

    passes = opt_cfg.backward_passes_per_step
    if compat.CLASSIC and opt_cfg.name in ("adam", "adamw") and passes > 1:
        # Horovod's Keras 2 accumulation advances `iterations` on every batch, which Keras 2's
        # Adam takes for its bias correction: it would correct for k times the updates made.
        raise config_lib.ConfigError(
            f"optimizer.backward_passes_per_step: {opt_cfg.name} with accumulation "
            f"({passes}) is not supported on the classic stack "
            "(Keras 2: its bias correction would count batches, not updates); use lamb, or the "
            "modern stack"
        )

    decay = opt_cfg.weight_decay
    if opt_cfg.name == "sgd":
        return keras.optimizers.SGD(schedule, momentum=opt_cfg.momentum)
    if opt_cfg.name == "lars":
        return large_batch.Lars(
            schedule,
            momentum=opt_cfg.momentum,
            trust_coefficient=opt_cfg.trust_coefficient,
            weight_decay=decay,
        )
    if opt_cfg.name == "lamb":
        return large_batch.Lamb(schedule, weight_decay=decay)
    if opt_cfg.name == "adamw":
        return large_batch.AdamW(schedule, weight_decay=decay)
    if opt_cfg.name == "lion":
        return large_batch.Lion(schedule, weight_decay=decay)
    return keras.optimizers.Adam(schedule)


def build_model(config: Config, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The configured model (zoo or `model.file`), with SyncBatchNorm where asked.

    Raises:
      ConfigError: model.params the builder does not take, or a model SyncBatchNorm cannot convert.
    """
    import models
    from hvd_train.keras.layers import convert_sync_batchnorm

    if config.model.file is not None:
        models.load_file(config.model.file)  # every rank; a no-op after check_train_args
    try:
        params = _data_params(config, models.parameters(config.model.name))
        model = models.build(config.model.name, input_shape, num_classes, **params)
    except TypeError as err:  # an unknown or misspelled builder argument
        raise config_lib.ConfigError(f"model.params: {err}") from None
    if config.train.sync_batchnorm:
        try:
            model = convert_sync_batchnorm(model)
        except ValueError as err:
            raise config_lib.ConfigError(f"train.sync_batchnorm: {err}") from None
    return model


def _data_params(config: Config, accepted: set[str]) -> dict[str, Any]:
    """model.params, and for "clicks" data the table's `rows` (data.vocab_size) and the `fields`
    (data.shape[0]) where the builder takes them and the params do not name them.

    Raises:
      ConfigError: named ones that do not fit the data (ids the table would not hold).
    """
    params = dict(config.model.params)
    if config.data.kind != "clicks":
        return params
    data = config.data
    for key, value, fits in (
        ("rows", data.vocab_size, lambda rows: rows >= data.vocab_size),
        ("fields", data.shape[0], lambda fields: fields == data.shape[0]),
    ):
        if key not in accepted:
            continue
        if key in params and not fits(params[key]):
            raise config_lib.ConfigError(
                f"model.params.{key}: {params[key]} does not fit the clicks data "
                f"(data.vocab_size {data.vocab_size}, data.shape {data.shape})"
            )
        params.setdefault(key, value)
    return params


def make_schedule(config: Config, global_batch_size: int, updates_per_epoch: float) -> Any:
    """The learning-rate schedule of the config's batch rule and warmup, for updates of
    `global_batch_size` samples, `updates_per_epoch` of them per epoch."""
    from hvd_train.keras.schedules import scaled_warmup_schedule

    opt = config.optimizer
    return scaled_warmup_schedule(
        base_lr=opt.base_lr,
        base_batch_size=opt.base_batch_size,
        global_batch_size=global_batch_size,
        updates_per_epoch=updates_per_epoch,
        warmup_epochs=opt.warmup_epochs,
        epochs=config.train.epochs,
        rule=opt.lr_rule,
        decay=opt.decay,
        decay_rate=opt.decay_rate,
        decay_epochs=opt.decay_epochs,
        decay_power=opt.decay_power,
    )


def compile_distributed(model: Any, config: Config, schedule: Any) -> Any:
    """Compile `model` with the configured optimizer inside Horovod's gradient averaging, and
    build the optimizer's variables now (a checkpoint restore or a broadcast needs them).
    Returns the distributed optimizer.

    Raises:
      ConfigError: "two_level" where this job cannot run it, optimizer.shard_state on the
        classic stack or with a table split by rows, or parallel.model_group_size for a model
        without one.
    """
    import keras

    from hvd_train.keras import compat, embedding
    from hvd_train.keras.optimizer import BF16_NEEDS, DistributedOptimizer

    opt_cfg = config.optimizer
    if opt_cfg.shard_state and compat.CLASSIC:
        raise config_lib.ConfigError(
            "optimizer.shard_state: needs the modern stack (Keras 3); the classic stack has none"
        )
    if opt_cfg.shard_state and embedding.splits_rows(model):
        raise config_lib.ConfigError(
            f"optimizer.shard_state: model {config.model.name!r} splits a table by rows "
            "(ShardedEmbedding) already; use one or the other"
        )
    group = config.parallel.model_group_size
    if group is not None and not embedding.splits_rows(model):
        raise config_lib.ConfigError(
            f"parallel.model_group_size: model {config.model.name!r} has no table to split over "
            f"a model group (a ShardedEmbedding), got {group}"
        )
    if opt_cfg.compression == "bf16" and not comm.reduces_bfloat16():
        raise config_lib.ConfigError(f"optimizer.compression: {BF16_NEEDS}")
    try:
        # Every rank alike: choosing the reduction is a collective unless it is "flat".
        optimizer = DistributedOptimizer(
            make_optimizer(opt_cfg, schedule),
            compression=getattr(comm.Compression, opt_cfg.compression),
            gradient_predivide_factor=opt_cfg.gradient_predivide_factor,
            backward_passes_per_step=opt_cfg.backward_passes_per_step,
            bucket_mb=opt_cfg.bucket_mb,
            alone_mb=opt_cfg.alone_mb,
            reduction=opt_cfg.reduction,
            shard_state=opt_cfg.shard_state,
        )
    except ValueError as err:  # "two_level" where this job cannot run it (the same on every rank)
        raise config_lib.ConfigError(f"optimizer.reduction: {err}") from None
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=config.train.jit_compile,
    )
    optimizer.build(model.trainable_variables)
    return optimizer
