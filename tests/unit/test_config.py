"""The experiment config: precedence, types, one-line errors naming key and value, no TensorFlow."""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hvd_train.core import config, environment
from hvd_train.core.config import Config, ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(call, *args) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_are_the_documented_ones():
    cfg = config.load(None)
    assert cfg == Config()
    assert cfg.data.shape == [8, 8, 1]
    assert (cfg.train.per_rank_batch_size, cfg.train.global_batch_size) == (32, None)
    assert (cfg.optimizer.base_lr, cfg.optimizer.warmup_epochs, cfg.optimizer.decay) == (
        0.05,
        2.0,
        "cosine",
    )


def test_mutable_defaults_are_not_shared():
    a, b = Config(), Config()
    a.data.shape.append(5)
    a.model.params["width"] = 3
    assert b.data.shape == [8, 8, 1]
    assert b.model.params == {}


def test_precedence_defaults_then_yaml_then_overrides(tmp_path):
    path = write(
        tmp_path,
        """
        train: {epochs: 5, seed: 7}
        optimizer: {base_lr: 0.1}
        """,
    )
    cfg = config.load(path, ["train.epochs=9", "model.params.width=64"])
    assert cfg.train.epochs == 9  # --set beats YAML
    assert cfg.train.seed == 7  # YAML beats default
    assert cfg.optimizer.base_lr == 0.1
    assert cfg.optimizer.momentum == 0.9  # default kept
    assert cfg.model.params == {"width": 64}


def test_later_override_wins_and_whole_values_replace(tmp_path):
    path = write(tmp_path, "model: {params: {width: 8, depth: 2}}\n")
    cfg = config.load(path, ["train.epochs=3", "train.epochs=4", "model.params.width=16"])
    assert cfg.train.epochs == 4
    assert cfg.model.params == {"width": 16, "depth": 2}
    cfg = config.load(path, ["model.params={dropout: 0.5}"])
    assert cfg.model.params == {"dropout": 0.5}


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("train.epochs=3", ("train", "epochs"), 3),
        ("optimizer.base_lr=0.1", ("optimizer", "base_lr"), 0.1),
        ("logging.csv=false", ("logging", "csv"), False),
        ("train.steps_per_epoch=null", ("train", "steps_per_epoch"), None),
        ("train.steps_per_epoch=5", ("train", "steps_per_epoch"), 5),
        ("data.shape=[4, 4, 2]", ("data", "shape"), [4, 4, 2]),
        ("model.params={a: 1}", ("model", "params"), {"a": 1}),
        ("model.name=mlp", ("model", "name"), "mlp"),
        ("run_dir=runs/a=b", ("run_dir",), "runs/a=b"),
        ("data.path=/tmp/x.npz", ("data", "path"), "/tmp/x.npz"),
    ],
)
def test_override_values_are_parsed_as_yaml(override, key, expected):
    cfg = config.load(None, [override])
    value = getattr(cfg, key[0]) if len(key) == 1 else getattr(getattr(cfg, key[0]), key[1])
    assert value == expected
    assert type(value) is type(expected)


def test_an_int_is_accepted_for_a_float_and_converted(tmp_path):
    path = write(tmp_path, "optimizer: {warmup_epochs: 3, decay: step, decay_epochs: [6, 9]}\n")
    cfg = config.load(path, ["optimizer.base_lr=1"])
    assert cfg.optimizer.base_lr == 1.0 and type(cfg.optimizer.base_lr) is float
    assert type(cfg.optimizer.warmup_epochs) is float
    assert [type(e) for e in cfg.optimizer.decay_epochs] == [float, float]


@pytest.mark.parametrize("text", ["", "\n  \n", "# nothing yet\n\n# still nothing\n", "null\n"])
def test_an_empty_file_is_an_error_naming_it(tmp_path, text):
    path = write(tmp_path, text)
    assert error_of(config.load, path).startswith(f"config {path} is empty: give at least one")


def test_a_null_section_keeps_its_defaults_and_says_so_once(tmp_path, caplog):
    path = write(tmp_path, "logging:\ntrain:\noptimizer:\n")
    with caplog.at_level("WARNING", logger="hvd_train.core.config"):
        assert config.load(path, ["optimizer.name=adam"]) == Config(
            optimizer=config.OptimizerConfig(name="adam")
        )
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"config {path}: section 'logging' is empty (null): using its defaults"),
        ("WARNING", f"config {path}: section 'train' is empty (null): using its defaults"),
    ]  # not 'optimizer': an override filled it


def test_null_section_notes_can_be_left_to_another_process(tmp_path, caplog):
    with caplog.at_level("DEBUG", logger="hvd_train.core.config"):
        assert config.load(write(tmp_path, "train:\n"), log_notes=False) == Config()
        config.load(write(tmp_path, "train: {epochs: 3}\n"))
        with pytest.raises(ConfigError):  # an invalid config: its error alone, no note before it
            config.load(write(tmp_path, "train:\nmodel: {name: ''}\n"))
    assert caplog.records == []


def test_sections_are_the_dataclass_fields():
    assert config.SECTIONS == (
        "data",
        "model",
        "optimizer",
        "train",
        "checkpoint",
        "logging",
        "fault",
        "elastic",
        "parallel",
    )


def test_batch_sizes_one_given_alone_clears_the_other(tmp_path):
    cfg = config.load(write(tmp_path, "train: {global_batch_size: 256}\n"))
    assert (cfg.train.per_rank_batch_size, cfg.train.global_batch_size) == (None, 256)
    cfg = config.load(REPO / "configs/digits.yaml", ["train.global_batch_size=128"])
    assert (cfg.train.per_rank_batch_size, cfg.train.global_batch_size) == (None, 128)
    assert config.resolved_batch_sizes(cfg, 4) == (32, 128)
    cfg = config.load(write(tmp_path, "train: {global_batch_size: 256}\n"), ["train={epochs: 3}"])
    assert (cfg.train.per_rank_batch_size, cfg.train.global_batch_size) == (32, None)


def test_round_trip_through_dump(tmp_path):
    cfg = config.load(
        None,
        [
            "data.source=npz",
            "data.path=data/x.npz",
            "model.params={filters: [16, 32], dense: 64}",
            "optimizer.name=adam",
            "optimizer.base_lr=3",
            "optimizer.decay=step",
            "optimizer.decay_epochs=[4, 8.5]",
            "train.global_batch_size=96",
            "train.steps_per_epoch=10",
            "train.deterministic=true",
            "logging.tensorboard=false",
        ],
    )
    text = config.dump(cfg)
    assert "shape: [8, 8, 1]" in text
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert config.load(path) == cfg
    assert config.to_dict(config.load(path)) == config.to_dict(cfg)
    path.write_text(config.dump(Config()))
    assert config.load(path) == Config()


def test_to_dict_is_a_deep_copy():
    cfg = Config()
    config.to_dict(cfg)["data"]["shape"].append(1)
    assert cfg.data.shape == [8, 8, 1]


@pytest.mark.parametrize(
    ("path", "per_rank", "global_", "epochs", "model"),
    [
        ("configs/digits.yaml", 32, 64, 12, "cnn"),
        ("configs/synthetic.yaml", 32, 64, 3, "cnn"),
        ("configs/clicks.yaml", 128, 256, 3, "dlrm"),
    ],
)
def test_shipped_configs_load_and_validate(path, per_rank, global_, epochs, model):
    cfg = config.load(REPO / path)
    config.validate(cfg, size=2)
    assert config.resolved_batch_sizes(cfg, 2) == (per_rank, global_)
    assert cfg.train.epochs == epochs
    assert cfg.model.name == model
    assert (REPO / path).read_text().startswith("#")


def test_data_sources_and_pipeline_options():
    cfg = Config().data
    assert (cfg.kind, cfg.vocab_size, cfg.augment, cfg.cache, cfg.val_path) == (
        "images",
        1000,
        False,
        True,
        None,
    )
    overrides = [
        "data.source=tfrecord",
        "data.path=/data/train-*.tfrecord",
        "data.val_path=/data/val-*.tfrecord",
        "data.shape=[32, 32, 3]",
        "data.augment=true",
        "data.cache=false",
    ]
    data = config.load(None, overrides).data
    assert (data.source, data.val_path, data.shape, data.augment, data.cache) == (
        "tfrecord",
        "/data/val-*.tfrecord",
        [32, 32, 3],
        True,
        False,
    )
    tokens = ["data.source=synthetic", "data.kind=tokens", "data.shape=[64]", "data.vocab_size=50"]
    assert config.load(None, tokens).data.kind == "tokens"
    for source in ("mnist", "cifar10"):  # no path: Keras's cache
        assert config.load(None, [f"data.source={source}"]).data.path is None
    image_dir = ["data.source=image_dir", "data.path=imgs", "data.shape=[24, 24, 1]"]
    assert config.load(None, image_dir).data.source == "image_dir"


def test_synthetic_config_is_32x32x3_in_10_classes():
    cfg = config.load(REPO / "configs/synthetic.yaml")
    assert (cfg.data.source, cfg.data.shape, cfg.data.num_classes) == ("synthetic", [32, 32, 3], 10)


def test_digits_config_header_gives_the_launch_line():
    text = (REPO / "configs/digits.yaml").read_text()
    assert "hvd-train launch --np 2 -- train --config configs/digits.yaml" in text
    cfg = config.load(REPO / "configs/digits.yaml")
    assert dataclasses.replace(cfg, run_dir="runs/digits") == Config()


# Bad input in a YAML file: (file text, the one-line message it must contain).
BAD_YAML = [
    (
        "optimiser: {name: sgd}\n",
        "optimiser: unknown key (known: checkpoint, data, elastic, fault, logging,",
    ),
    (
        "optimizer: {lr_rul: sqrt}\n",
        "optimizer.lr_rul: unknown key (known: alone_mb, backward_passes_per_step",
    ),
    ("[1, 2]\n", "the top level must be a mapping of sections, got [1, 2]"),
    ("just text\n", "the top level must be a mapping of sections, got 'just text'"),
    ("optimizer: 0.1\n", "optimizer: expected a mapping, got 0.1"),
    ("train: [1, 2]\n", "train: expected a mapping, got [1, 2]"),
    ("train: {epochs: ten}\n", "train.epochs: expected an integer, got 'ten'"),
    ("train: {epochs: true}\n", "train.epochs: expected an integer, got True"),
    ("train: {epochs: 3.5}\n", "train.epochs: expected an integer, got 3.5"),
    ("train: {steps_per_epoch: many}\n", "train.steps_per_epoch: expected an integer or null, got"),
    ("optimizer: {base_lr: fast}\n", "optimizer.base_lr: expected a number, got 'fast'"),
    ("optimizer: {momentum: false}\n", "optimizer.momentum: expected a number, got False"),
    ("optimizer: {base_lr: .inf}\n", "optimizer.base_lr: expected a finite number, got inf"),
    ("logging: {csv: 1}\n", "logging.csv: expected a boolean, got 1"),
    ("model: {name: 3}\n", "model.name: expected a string, got 3"),
    ("data: {shape: 8}\n", "data.shape: expected a list of integers, got 8"),
    ("data: {shape: [8, 8.5, 1]}\n", "data.shape[1]: expected an integer, got 8.5"),
    (
        "optimizer: {decay_epochs: [1, x]}\n",
        "optimizer.decay_epochs[1]: expected a number, got 'x'",
    ),
    ("model: {params: [1]}\n", "model.params: expected a mapping with string keys, got [1]"),
    ("model: {params: {1: 2}}\n", "model.params: expected a mapping with string keys, got {1: 2}"),
    ("train: {epochs: 0}\n", "train.epochs: must be >= 1, got 0"),
    (
        "data: {source: imagenet}\n",
        "data.source: must be one of (digits, mnist_5k, synthetic, npz, mnist, cifar10, "
        "tfrecord, image_dir), got 'imagenet'",
    ),
    ("data: {source: npz}\n", "data.path: is required when data.source is 'npz', got null"),
    (
        "data: {source: tfrecord}\n",
        "data.path: is required when data.source is 'tfrecord', got null",
    ),
    (
        "data: {source: image_dir, path: ''}\n",
        "data.path: is required when data.source is 'image_dir', got ''",
    ),
    (
        "data: {source: npz, path: x.npz, val_path: y.npz}\n",
        "data.val_path: is read only by data.source 'tfrecord' or 'image_dir', got 'y.npz'",
    ),
    ("data: {kind: text}\n", "data.kind: must be one of (images, tokens, clicks), got 'text'"),
    (
        "data: {source: digits, kind: clicks, shape: [8, 4], num_classes: 2}\n",
        "data.source: must be 'synthetic' for data.kind 'clicks', got 'digits'",
    ),
    (
        "data: {source: synthetic, kind: clicks, shape: [12], num_classes: 2}\n",
        "data.shape: must be [fields, dense_features] for data.kind 'clicks', got [12]",
    ),
    (
        "data: {source: synthetic, kind: clicks, shape: [8, 4]}\n",
        "data.num_classes: must be 2 for data.kind 'clicks' (click or not), got 10",
    ),
    (
        "data: {source: synthetic, kind: clicks, shape: [8, 4], num_classes: 2, "
        "vocab_size: 16777217}\n",
        "data.vocab_size: must be <= 16777216 for data.kind 'clicks' (ids travel as float32)",
    ),
    (
        "data: {source: synthetic, kind: clicks, shape: [8, 4], num_classes: 2, vocab_size: 7}\n",
        "data.vocab_size: must be >= the 8 fields of data.shape for data.kind 'clicks', got 7",
    ),
    (
        "data: {source: synthetic, kind: clicks, shape: [8, 4], num_classes: 2, "
        "zipf_exponent: -1}\n",
        "data.zipf_exponent: must be >= 0, got -1",
    ),
    (
        "data: {source: mnist, kind: tokens, shape: [16]}\n",
        "data.source: must be 'synthetic' for data.kind 'tokens', got 'mnist'",
    ),
    (
        "data: {source: synthetic, kind: tokens}\n",
        "data.shape: must be [sequence_length] for data.kind 'tokens', got [8, 8, 1]",
    ),
    (
        "data: {source: synthetic, kind: tokens, shape: [8], vocab_size: 5}\n",
        "data.vocab_size: must be >= data.num_classes (10) for data.kind 'tokens', got 5",
    ),
    (
        "data: {source: synthetic, kind: tokens, shape: [8], augment: true}\n",
        "data.augment: must be false for data.kind 'tokens' (it augments images), got True",
    ),
    ("data: {vocab_size: 1}\n", "data.vocab_size: must be >= 2, got 1"),
    (
        "data: {source: image_dir, path: imgs, shape: [32, 32, 4]}\n",
        "data.shape: must be [height, width, channels] with 1 or 3 channels for image files, got",
    ),
    (
        "data: {source: tfrecord, path: '*.tfrecord', shape: [32, 32]}\n",
        "data.shape: must be [height, width, channels] with 1 or 3 channels for image files, got",
    ),
    ("data: {augment: 1}\n", "data.augment: expected a boolean, got 1"),
    ("data: {cache: yes please}\n", "data.cache: expected a boolean, got 'yes please'"),
    ("data: {validation_fraction: 1}\n", "data.validation_fraction: must be in (0, 1), got 1.0"),
    (
        "data: {shape: [8, 0, 1]}\n",
        "data.shape: must be a non-empty list of positive sizes, got [8, 0",
    ),
    ("data: {shape: []}\n", "data.shape: must be a non-empty list of positive sizes, got []"),
    ("data: {num_classes: 1}\n", "data.num_classes: must be >= 2, got 1"),
    ("data: {num_samples: 0}\n", "data.num_samples: must be >= 1, got 0"),
    ("data: {seed: -1}\n", "data.seed: must be >= 0, got -1"),
    ("model: {name: ''}\n", "model.name: must be a non-empty string, got ''"),
    (
        "optimizer: {name: rmsprop}\n",
        "optimizer.name: must be one of (sgd, adam, adamw, lamb, lion, lars), got 'rmsprop'",
    ),
    ("optimizer: {base_lr: 0}\n", "optimizer.base_lr: must be > 0, got 0.0"),
    ("optimizer: {base_batch_size: 0}\n", "optimizer.base_batch_size: must be >= 1, got 0"),
    (
        "optimizer: {lr_rule: cubic}\n",
        "optimizer.lr_rule: must be one of (linear, sqrt), got 'cubic'",
    ),
    ("optimizer: {momentum: 1}\n", "optimizer.momentum: must be in [0, 1), got 1.0"),
    ("optimizer: {warmup_epochs: -1}\n", "optimizer.warmup_epochs: must be >= 0, got -1.0"),
    (
        "optimizer: {decay: linear}\n",
        "optimizer.decay: must be one of (none, step, cosine, polynomial), got",
    ),
    (
        "optimizer: {decay: step}\n",
        "optimizer.decay_epochs: must list at least one epoch for decay 'step', got []",
    ),
    (
        "optimizer: {decay: step, decay_epochs: [5], decay_rate: 2}\n",
        "optimizer.decay_rate: must be in (0, 1), got 2.0",
    ),
    (
        "optimizer: {decay_epochs: [6, 3]}\n",
        "optimizer.decay_epochs: must be increasing epochs > 0, got [6.0, 3.0]",
    ),
    (
        "optimizer: {warmup_epochs: 12}\n",
        "optimizer.warmup_epochs: must be < train.epochs (12) for decay 'cosine', got 12.0",
    ),
    (
        "optimizer: {compression: int8}\n",
        "optimizer.compression: must be one of (none, fp16, bf16), got",
    ),
    (
        "optimizer: {reduction: ring}\n",
        "optimizer.reduction: must be one of (auto, flat, two_level), got",
    ),
    (
        "optimizer: {backward_passes_per_step: 0}\n",
        "optimizer.backward_passes_per_step: must be >= 1, got 0",
    ),
    (
        "optimizer: {gradient_predivide_factor: 0}\n",
        "optimizer.gradient_predivide_factor: must be > 0, got 0.0",
    ),
    (
        "optimizer: {shard_state: true, name: lamb}\n",
        "optimizer.shard_state: is not supported with optimizer.name 'lamb' (its trust ratio",
    ),
    (
        "optimizer: {shard_state: true, backward_passes_per_step: 2}\n",
        "optimizer.shard_state: is not supported with optimizer.backward_passes_per_step > 1",
    ),
    (
        "optimizer: {shard_state: true, reduction: two_level}\n",
        "optimizer.shard_state: is not supported with optimizer.reduction 'two_level'",
    ),
    (
        "train: {per_rank_batch_size: 32, global_batch_size: 64}\n",
        "train: set exactly one of per_rank_batch_size and global_batch_size (the other null), "
        "got per_rank_batch_size=32, global_batch_size=64",
    ),
    (
        "train: {per_rank_batch_size: null}\n",
        "got per_rank_batch_size=null, global_batch_size=null",
    ),
    ("train: {per_rank_batch_size: 0}\n", "train.per_rank_batch_size: must be >= 1, got 0"),
    ("train: {global_batch_size: -8}\n", "train.global_batch_size: must be >= 1, got -8"),
    ("train: {seed: -2}\n", "train.seed: must be >= 0, got -2"),
    ("train: {steps_per_epoch: 0}\n", "train.steps_per_epoch: must be >= 1, got 0"),
    ("checkpoint: {keep_last: 0}\n", "checkpoint.keep_last: must be >= 1, got 0"),
    ("checkpoint: {monitor: ''}\n", "checkpoint.monitor: must be a non-empty metric name, got ''"),
    ("checkpoint: {mode: best}\n", "checkpoint.mode: must be one of (max, min), got 'best'"),
    ("run_dir: ''\n", "run_dir: must be a non-empty path, got ''"),
]


@pytest.mark.parametrize(("text", "message"), BAD_YAML, ids=[m for _, m in BAD_YAML])
def test_bad_yaml_is_a_one_line_error_naming_key_and_value(tmp_path, text, message):
    assert message in error_of(config.load, write(tmp_path, text))


# Bad overrides: (--set strings, the one-line message they must produce).
BAD_OVERRIDES = [
    (
        ["optimizer.lr_rul=sqrt"],
        "optimizer.lr_rul: unknown key (known: alone_mb, backward_passes_per_step",
    ),
    (
        ["trian.epochs=3"],
        "trian: unknown key (known: checkpoint, data, elastic, fault, logging, model,",
    ),
    (["train.epochs"], "--set 'train.epochs': expected dotted.key=value"),
    (["=3"], "--set '=3': empty key"),
    (["train..epochs=3"], "--set 'train..epochs=3': empty part in the key 'train..epochs'"),
    (["train.epochs=true"], "train.epochs: expected an integer, got True"),
    (["train.epochs=0"], "train.epochs: must be >= 1, got 0"),
    (["train.epochs=[3]"], "train.epochs: expected an integer, got [3]"),
    (["optimizer=0.1"], "optimizer: expected a mapping, got 0.1"),
    (["model.params={a: 1"], "model.params: invalid YAML value '{a: 1' in --set:"),
    (
        ["train.epochs=3", "train.epochs.x=1"],
        "train.epochs.x: cannot set a key inside train.epochs, which is 3, not a mapping",
    ),
    (
        ["train.global_batch_size=64", "train.per_rank_batch_size=8"],
        "got per_rank_batch_size=8, global_batch_size=64",
    ),
    (["data.source=npz"], "data.path: is required when data.source is 'npz', got null"),
    (["data.shape=[8, x]"], "data.shape[1]: expected an integer, got 'x'"),
    (["optimizer.decay=step"], "optimizer.decay_epochs: must list at least one epoch for decay"),
    (["train.epochs=2"], "optimizer.warmup_epochs: must be < train.epochs (2) for decay 'cosine'"),
    (["logging.csv=maybe"], "logging.csv: expected a boolean, got 'maybe'"),
    (["train.step_ms=0"], "train.step_ms: must be > 0 or null, got 0.0"),
    (["optimizer.bucket_mb=-1"], "optimizer.bucket_mb: must be >= 0 or null, got -1.0"),
    (["optimizer.bucket_mb=big"], "optimizer.bucket_mb: expected a number or null, got 'big'"),
    (["optimizer.alone_mb=-0.5"], "optimizer.alone_mb: must be >= 0 or null, got -0.5"),
    (["optimizer.alone_mb=all"], "optimizer.alone_mb: expected a number or null, got 'all'"),
    (["checkpoint.every_steps=-1"], "checkpoint.every_steps: must be >= 0, got -1"),
    (["fault.stall_floor_s=0"], "fault.stall_floor_s: must be > 0, got 0.0"),
    (["fault.stall_factor=0.5"], "fault.stall_factor: must be >= 1, got 0.5"),
    (["fault.startup_s=-1"], "fault.startup_s: must be > 0, got -1.0"),
    (
        ["fault.heartbeat_s=30"],
        "fault.heartbeat_s: must be > 0 and at most fault.stall_floor_s / 5",
    ),
    (["fault.stop_signals=[KILL]"], "fault.stop_signals: must be one of (TERM, INT, USR1, USR2,"),
    (["fault.check_weights_every=-2"], "fault.check_weights_every: must be >= 0, got -2"),
    (["fault.watchdog=sometimes"], "fault.watchdog: expected a boolean, got 'sometimes'"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_OVERRIDES, ids=[m for _, m in BAD_OVERRIDES])
def test_bad_override_is_a_one_line_error_naming_key_and_value(overrides, message):
    assert message in error_of(config.load, None, overrides)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    assert f"{path}: cannot read the config file (No such file or directory)" in error_of(
        config.load, path
    )


def test_directory_names_the_path(tmp_path):
    assert f"{tmp_path}: cannot read the config file" in error_of(config.load, tmp_path)


def test_yaml_syntax_error_names_path_and_line(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 3\n  seed: [1, 2\n")
    message = error_of(config.load, path)
    assert message.startswith(f"{path}:4:")
    assert "invalid YAML" in message
    path = write(tmp_path, "train:\n  epochs: 3\n seed: 1\n")
    assert error_of(config.load, path).startswith(f"{path}:3:")


def test_validate_checks_types_of_a_config_built_in_python():
    cfg = Config(train=config.TrainConfig(epochs="3"))
    assert "train.epochs: expected an integer, got '3'" in error_of(config.validate, cfg)


@pytest.mark.parametrize(
    ("size", "message"),
    [
        (3, "train.global_batch_size: 100 is not divisible by the 3 workers"),
        (8, "train.global_batch_size: 100 is not divisible by the 8 workers"),
    ],
)
def test_validate_global_batch_must_divide_by_the_workers(size, message):
    cfg = config.load(None, ["train.global_batch_size=100"])
    config.validate(cfg)  # size unknown: fine
    config.validate(cfg, size=4)
    assert message in error_of(config.validate, cfg, size)
    assert message in error_of(config.resolved_batch_sizes, cfg, size)


def test_resolved_batch_sizes():
    assert config.resolved_batch_sizes(Config(), 3) == (32, 96)
    cfg = config.load(None, ["train.global_batch_size=96"])
    assert config.resolved_batch_sizes(cfg, 3) == (32, 96)
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        config.resolved_batch_sizes(cfg, 0)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"HOROVOD_SIZE": "3"}, 3),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_UNIVERSE_SIZE": "8"}, 2),
        ({"PMI_SIZE": "4"}, 4),
        ({"HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "6"}, 2),
        ({"SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"}, 8),
        ({"SLURM_NTASKS": "8"}, None),  # an allocation, not a task started by srun
        ({"OMPI_COMM_WORLD_SIZE": " 5 "}, 5),
    ],
)
def test_launcher_size(environ, expected):
    assert environment.launcher_size(environ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"HOROVOD_SIZE": "two"}, "HOROVOD_SIZE: expected a positive worker count, got 'two'"),
        ({"OMPI_COMM_WORLD_SIZE": "2.0"}, "OMPI_COMM_WORLD_SIZE: expected a positive worker count"),
        ({"PMI_SIZE": "0"}, "PMI_SIZE: expected a positive worker count, got '0'"),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": ""}, "SLURM_NTASKS: expected a positive worker"),
    ],
)
def test_launcher_size_rejects_a_bad_value_naming_the_variable(environ, message):
    with pytest.raises(environment.LauncherEnvironmentError) as info:
        environment.launcher_size(environ)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_config_does_not_import_tensorflow_or_keras():
    code = textwrap.dedent(
        """
        import sys
        from hvd_train.core import config, environment
        cfg = config.load("configs/digits.yaml", ["train.epochs=3"])
        config.validate(cfg, size=environment.launcher_size({"HOROVOD_SIZE": "2"}))
        config.dump(cfg)
        loaded = sorted(m for m in ("tensorflow", "keras", "numpy", "horovod") if m in sys.modules)
        print(loaded)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_model_file_must_exist(tmp_path):
    assert Config().model.file is None
    user_models = tmp_path / "my_models.py"
    user_models.write_text("")
    assert config.load(None, [f"model.file={user_models}"]).model.file == str(user_models)
    missing = tmp_path / "nope.py"
    for path, problem in ((missing, "does not exist"), (tmp_path, "is not a file")):
        message = error_of(config.load, None, [f"model.file={path}"])
        assert message == f"model.file: {str(path)!r} {problem}"
    assert "model.file: expected a string or null, got 3" in error_of(
        config.load, write(tmp_path, "model: {file: 3}\n")
    )


def test_elastic_section_and_what_elastic_training_needs():
    assert Config().elastic.commit_every_steps == 20
    assert config.load(None, ["elastic.commit_every_steps=5"]).elastic.commit_every_steps == 5
    assert error_of(config.load, None, ["elastic.commit_every_steps=0"]) == (
        "elastic.commit_every_steps: must be >= 1, got 0"
    )
    config.check_elastic(config.load(REPO / "configs" / "digits.yaml"))
    fixed_global = config.load(None, ["train.global_batch_size=64"])
    assert error_of(config.check_elastic, fixed_global).startswith(
        "train.global_batch_size: must be null with --elastic"
    )
    accumulating = config.load(None, ["optimizer.backward_passes_per_step=2"])
    assert error_of(config.check_elastic, accumulating).startswith(
        "optimizer.backward_passes_per_step: must be 1 with --elastic"
    )
    sharded = config.load(None, ["optimizer.shard_state=true"])
    assert error_of(config.check_elastic, sharded).startswith(
        "optimizer.shard_state: must be false with --elastic"
    )
    grouped = config.load(None, ["parallel.model_group_size=2"])
    assert error_of(config.check_elastic, grouped).startswith(
        "parallel.model_group_size: must be null with --elastic"
    )


def test_model_group_size_is_null_or_a_divisor_of_the_workers():
    assert Config().parallel.model_group_size is None
    grouped = config.load(None, ["parallel.model_group_size=2"])
    config.validate(grouped)  # size unknown: fine
    config.validate(grouped, size=4)
    assert error_of(config.validate, grouped, 3) == (
        "parallel.model_group_size: must divide the worker count (3: groups hold as many "
        "ranks), got 2"
    )
    assert error_of(config.load, None, ["parallel.model_group_size=0"]) == (
        "parallel.model_group_size: must be >= 1, got 0"
    )
    assert "parallel.model_group_size" in error_of(
        config.load, None, ["parallel.model_group_size=two"]
    )
