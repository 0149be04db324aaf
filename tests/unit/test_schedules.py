"""The batch and learning-rate rule: pure Python, and its Keras schedule evaluated step by step."""

import math

import numpy as np
import pytest

from hvd_train.core import scaling


@pytest.mark.parametrize(
    ("size", "per_rank", "global_", "expected"),
    [
        (1, 32, None, (32, 32)),
        (4, 32, None, (32, 128)),
        (4, None, 128, (32, 128)),
        (3, None, 3, (1, 3)),
    ],
)
def test_resolve_batch_sizes(size, per_rank, global_, expected):
    assert scaling.resolve_batch_sizes(size, per_rank, global_) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, None, None), "exactly one"),
        ((2, 32, 64), "exactly one"),
        ((2, 0, None), "per_rank_batch_size must be >= 1, got 0"),
        ((2, None, -4), "global_batch_size must be >= 1, got -4"),
        ((3, None, 128), "global_batch_size=128 is not divisible by the 3 workers"),
        ((0, 32, None), "size must be >= 1, got 0"),
    ],
)
def test_resolve_batch_sizes_errors_name_the_value(args, message):
    with pytest.raises(ValueError, match=message):
        scaling.resolve_batch_sizes(*args)


def test_scaled_learning_rate_linear_and_sqrt():
    assert scaling.scaled_learning_rate(0.1, 256, 32) == pytest.approx(0.8)
    assert scaling.scaled_learning_rate(0.1, 128, 32, "sqrt") == pytest.approx(0.2)
    with pytest.raises(ValueError, match="lr rule"):
        scaling.scaled_learning_rate(0.1, 128, 32, "cubic")


def test_learning_rate_closed_forms():
    # Goyal et al.: from base to k * base linearly over the warmup, then constant.
    lr = [scaling.learning_rate(s, 0.1, 0.8, 10) for s in range(0, 15)]
    assert lr[0] == pytest.approx(0.1) and lr[5] == pytest.approx(0.45) and lr[10:] == [0.8] * 5
    step = [scaling.learning_rate(s, 0.1, 1.0, 0, None, "step", 0.1, [5, 8]) for s in (4, 5, 8)]
    assert step == pytest.approx([1.0, 0.1, 0.01])
    cos = [scaling.learning_rate(s, 0.1, 1.0, 2, 12, "cosine") for s in (2, 7, 12, 20)]
    assert cos == pytest.approx([1.0, 0.5, 0.0, 0.0], abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
        ({"decay": "linear"}, "decay must be one of"),
        ({"decay": "cosine", "total_steps": 3}, "total_steps > warmup_steps"),
        ({"decay": "step"}, "decay_boundaries"),
        ({"base_lr": 0.0}, "must be positive"),
    ],
)
def test_schedule_validation(kwargs, message):
    args = {
        "base_lr": 0.1,
        "peak_lr": 0.4,
        "warmup_steps": 5,
        "total_steps": None,
        "decay": "none",
        "decay_rate": 0.1,
        "decay_boundaries": (),
    }
    with pytest.raises(ValueError, match=message):
        scaling.validate_schedule(**{**args, **kwargs})


@pytest.mark.parametrize("decay", ["none", "step", "cosine"])
def test_keras_schedule_matches_the_python_formula(decay):
    from hvd_train.keras.schedules import WarmupSchedule, scaled_warmup_schedule

    schedule = scaled_warmup_schedule(
        base_lr=0.05,
        base_batch_size=32,
        global_batch_size=96,
        updates_per_epoch=10,
        warmup_epochs=2,
        epochs=8,
        decay=decay,
        decay_rate=0.5,
        decay_epochs=[4, 6],
    )
    assert isinstance(schedule, WarmupSchedule)
    kwargs = schedule.get_config()
    got = [float(np.array(schedule(s))) for s in range(0, 90)]
    want = [scaling.learning_rate(s, **kwargs) for s in range(0, 90)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert got[20] == pytest.approx(0.15 if decay != "cosine" else 0.15 * 0.5 * (1 + math.cos(0)))
    assert WarmupSchedule.from_config(kwargs).get_config() == kwargs
