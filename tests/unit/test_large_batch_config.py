"""The large-batch settings: optimizer names and fields, the polynomial decay, mnist_5k; one-line
errors naming the key; what `make_optimizer` builds from them."""

import math

import numpy as np
import pytest

from hvd_train.core import config, scaling
from hvd_train.core.config import ConfigError


def error_of(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        config.load(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", ["adamw", "lamb", "lion", "lars"])
def test_the_large_batch_optimizers_load(name):
    cfg = config.load(
        None,
        [
            f"optimizer.name={name}",
            "optimizer.weight_decay=0.0001",
            "optimizer.decay=polynomial",
            "optimizer.decay_power=1.5",
        ],
    )
    assert (cfg.optimizer.name, cfg.optimizer.weight_decay) == (name, 0.0001)
    assert (cfg.optimizer.decay, cfg.optimizer.decay_power) == ("polynomial", 1.5)


def test_defaults_add_no_weight_decay():
    opt = config.load(None).optimizer
    assert (opt.weight_decay, opt.trust_coefficient, opt.decay_power) == (0.0, 0.001, 2.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["optimizer.name=lbfgs"],
            "optimizer.name: must be one of (sgd, adam, adamw, lamb, lion, lars), got 'lbfgs'",
        ),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay: must be >= 0, got -0.1"),
        (
            ["optimizer.weight_decay=0.01"],
            "optimizer.weight_decay: is read only by optimizer.name (adamw, lamb, lion, lars), "
            "not 'sgd', got 0.01",
        ),
        (
            ["optimizer.name=adam", "optimizer.weight_decay=0.01"],
            "optimizer.weight_decay: is read only by optimizer.name (adamw, lamb, lion, lars), "
            "not 'adam', got 0.01",
        ),
        (["optimizer.trust_coefficient=0"], "optimizer.trust_coefficient: must be > 0, got 0.0"),
        (["optimizer.decay_power=0"], "optimizer.decay_power: must be > 0, got 0.0"),
        (
            ["optimizer.decay=polynomial", "optimizer.warmup_epochs=12"],
            "optimizer.warmup_epochs: must be < train.epochs (12) for decay 'polynomial', got 12.0",
        ),
        (["optimizer.weight_decay=lots"], "optimizer.weight_decay: expected a number, got 'lots'"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    assert error_of(overrides) == message


def test_polynomial_decay_closed_form():
    # Warmup over 2 updates to 1.0, then (1 - progress) ** 2 to 0 over the remaining 10.
    lr = [scaling.learning_rate(s, 0.1, 1.0, 2, 12, "polynomial", decay_power=2) for s in range(14)]
    assert lr[1] == pytest.approx(0.55)
    assert lr[2] == pytest.approx(1.0)
    assert lr[7] == pytest.approx(0.25)
    assert lr[12:] == [0.0, 0.0]
    with pytest.raises(ValueError, match="decay='polynomial' needs total_steps > warmup_steps"):
        scaling.validate_schedule(0.1, 1.0, 5, 5, "polynomial", 0.1, ())


def test_keras_polynomial_schedule_matches_the_python_formula():
    from hvd_train.keras.schedules import WarmupSchedule, scaled_warmup_schedule

    schedule = scaled_warmup_schedule(
        base_lr=0.05,
        base_batch_size=32,
        global_batch_size=256,
        updates_per_epoch=10,
        warmup_epochs=1,
        epochs=5,
        decay="polynomial",
        decay_power=3.0,
    )
    kwargs = schedule.get_config()
    got = [float(np.array(schedule(s))) for s in range(60)]
    want = [scaling.learning_rate(s, **kwargs) for s in range(60)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert got[30] == pytest.approx(0.4 * 0.5**3)
    assert WarmupSchedule.from_config(kwargs).get_config() == kwargs
    # Negative control: a power of 2 is another curve.
    assert not math.isclose(got[30], 0.4 * 0.5**2)


@pytest.mark.parametrize(
    ("name", "cls", "checks"),
    [
        ("lars", "Lars", {"momentum": 0.8, "trust_coefficient": 0.02, "weight_decay": 1e-4}),
        ("lamb", "Lamb", {"weight_decay": 1e-4}),
        ("adamw", "AdamW", {"weight_decay": 1e-4}),
        ("lion", "Lion", {"weight_decay": 1e-4}),
    ],
)
def test_make_optimizer_builds_the_configured_one(name, cls, checks):
    from hvd_train.keras import large_batch
    from hvd_train.training.setup import make_optimizer

    opt_cfg = config.load(
        None,
        [
            f"optimizer.name={name}",
            "optimizer.weight_decay=0.0001",
            "optimizer.momentum=0.8",
            "optimizer.trust_coefficient=0.02",
        ],
    ).optimizer
    optimizer = make_optimizer(opt_cfg, 0.1)
    assert type(optimizer) is getattr(large_batch, cls)
    got = optimizer.get_config()
    assert {key: got[key] for key in checks} == pytest.approx(checks)


def test_mnist_5k_loads_with_the_validation_split():
    cfg = config.load(None, ["data.source=mnist_5k", "data.validation_fraction=0.2"])
    from hvd_train.data import sources

    data = sources.load(cfg.data)
    assert data.input_shape == (28, 28, 1) and data.num_classes == 10
    assert (len(data.x_train), len(data.x_val)) == (4000, 1000)
    assert data.x_train.dtype == np.uint8 and data.x_train.max() == 255
    assert sorted(np.unique(data.y_val)) == list(range(10))
    # The split is seeded: the same seed, the same validation samples; another seed, others.
    again = sources.load(cfg.data)
    other = sources.load(config.load(None, ["data.source=mnist_5k", "data.seed=1"]).data)
    assert np.array_equal(again.x_val, data.x_val)
    assert not np.array_equal(other.x_val, data.x_val)


def test_mnist_5k_shards_are_disjoint_and_cover_the_epoch():
    from hvd_train.data import pipeline, sources

    data = sources.load(config.load(None, ["data.source=mnist_5k"]).data)
    seen = []
    for rank in range(2):
        dataset, steps = pipeline.train_dataset(data, 100, rank, 2)
        batches = [x.numpy().reshape(len(x), -1) for x, _ in dataset.take(steps)]
        seen.append({row.tobytes() for batch in batches for row in batch})
    # 4,000 training images: 20 steps of 2 x 100 cover every one once, split between the ranks.
    assert steps == 20 and len(seen[0]) == len(seen[1]) == 2000
    assert not seen[0] & seen[1]


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_with_accumulation_is_refused_on_the_classic_stack_only(name):
    from hvd_train.keras import compat
    from hvd_train.training.setup import make_optimizer

    overrides = [f"optimizer.name={name}", "optimizer.backward_passes_per_step=2"]
    opt_cfg = config.load(None, overrides).optimizer
    if compat.CLASSIC:
        with pytest.raises(ConfigError, match="not supported on the classic stack"):
            make_optimizer(opt_cfg, 0.1)
    else:  # Keras 3 counts updates in `iterations`: nothing to refuse
        assert make_optimizer(opt_cfg, 0.1).name
    # One pass per update is fine on both.
    assert make_optimizer(config.load(None, [f"optimizer.name={name}"]).optimizer, 0.1).name
