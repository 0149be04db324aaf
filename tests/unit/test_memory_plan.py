"""`hvd-train plan --memory`: the bytes per rank against hand-computed closed forms."""

import subprocess
import sys

import keras
import pytest

from hvd_train.bench import memory

# Dense(3 -> 4) then Dense(4 -> 2): kernels 3x4 and 4x2, biases 4 and 2; 2 frozen weights.
SHAPE = memory.Shape(trainable=(12, 4, 8, 2), non_trainable=2, activations_per_sample=6)


def test_replicated_terms_are_the_closed_form():
    got = memory.per_rank(SHAPE, workers=4, batch=8, optimizer="adam")
    assert got == {
        "parameters": 4 * (26 + 2),
        "gradients": 4 * 26,
        "optimizer": 4 * 2 * 26,
        "accumulator": 0,
        "activations": 8 * 6 * 4,
        "total": 4 * 28 + 4 * 26 + 4 * 52 + 8 * 6 * 4,
    }


def test_sharded_state_holds_the_fullest_ranks_piece_of_each_slot_and_weight():
    # N=3: pieces ceil(12/3)=4, ceil(4/3)=2, ceil(8/3)=3, ceil(2/3)=1 -> 10 elements, for Adam's
    # 2 slots and the weight piece's copy.
    got = memory.per_rank(SHAPE, workers=3, batch=8, optimizer="adam", mode="shard_state")
    assert got["optimizer"] == 4 * 3 * 10
    # One worker: every row, so more than unsharded (the copy of the weights).
    one = memory.per_rank(SHAPE, workers=1, batch=8, optimizer="adam", mode="shard_state")
    assert (
        one["optimizer"]
        == 4 * 3 * 26
        > memory.per_rank(SHAPE, workers=1, batch=8, optimizer="adam")["optimizer"]
    )


@pytest.mark.parametrize(
    ("optimizer", "momentum", "slots"),
    [("sgd", 0.0, 0), ("sgd", 0.9, 1), ("lion", 0.9, 1), ("adamw", 0.9, 2)],
)
def test_slots_per_optimizer(optimizer, momentum, slots):
    assert memory.slots(optimizer, momentum) == slots


def test_mixed_precision_halves_the_activations_and_accumulation_adds_a_copy():
    plain = memory.per_rank(SHAPE, workers=1, batch=8, optimizer="sgd")
    mixed = memory.per_rank(
        SHAPE, workers=1, batch=8, optimizer="sgd", mixed_precision=True, backward_passes_per_step=2
    )
    assert mixed["activations"] == plain["activations"] / 2
    assert mixed["accumulator"] == 4 * 26 and plain["accumulator"] == 0


def test_the_shape_of_a_keras_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    assert memory.shape_of(model) == memory.Shape((12, 4, 8, 2), 0, 6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "nope"], "unknown model 'nope'"),
        (["--memory", "cnn", "--optimizer", "rms"], "unknown optimizer 'rms'"),
        (["--memory", "cnn", "--input-shape", "8,x"], "expected positive integers"),
        (["--memory", "cnn", "--workers", "0"], "--workers must be >= 1"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "hvd_train.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
