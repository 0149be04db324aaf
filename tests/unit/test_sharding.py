"""The sharding arithmetic without TensorFlow: closed forms of every rank's shard, and the errors.

Every rank computes its own shard from (num_samples, rank, size) alone, so these tests compute all
ranks' shards here and check them against each other.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hvd_train.data import sharding
from hvd_train.data.errors import DataError

SIZES = range(1, 6)
REPO = Path(__file__).resolve().parents[2]


def test_importing_sharding_loads_no_tensorflow():
    code = "import hvd_train.data.sharding, sys; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("num_samples", [5, 12, 17, 103])
def test_whole_shards_are_disjoint_cover_and_differ_by_at_most_one(size, num_samples):
    shards = [list(sharding.shard_positions(num_samples, r, size)) for r in range(size)]
    assert sorted(p for shard in shards for p in shard) == list(range(num_samples))
    assert {len(s) for s in shards} <= {num_samples // size, -(-num_samples // size)}
    for r, shard in enumerate(shards):
        assert all(sharding.rank_of(p, size) == r for p in shard)
        assert shard == list(range(r, num_samples, size))  # rank r: positions r, r + size, ...
    assert np.array_equal(
        sharding.rank_of(np.arange(num_samples), size) == 0,
        [p in shards[0] for p in range(num_samples)],
    )


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("num_samples", "batch"), [(5, 1), (17, 2), (103, 5), (100, 4)])
def test_every_rank_runs_the_same_steps_over_disjoint_positions(size, num_samples, batch):
    steps = sharding.steps_per_epoch(num_samples, size, batch)
    assert steps == (num_samples // size) // batch
    shards = [sharding.rank_positions(r, size, steps, batch) for r in range(size)]
    assert {len(s) for s in shards} == {steps * batch}  # equal steps on every rank
    used = sorted(p for s in shards for p in s)
    assert used == list(range(steps * batch * size))  # disjoint; the first global batches
    assert used[-1] < num_samples
    # Each rank's positions are inside its whole shard: the same rule, cut to full batches.
    for r, s in enumerate(shards):
        assert set(s) <= set(sharding.shard_positions(num_samples, r, size))


def test_uneven_sizes_drop_only_what_the_smallest_shard_lacks():
    # 103 samples on 4 ranks: shards of 26, 26, 26, 25; batch 5 -> 5 steps, 25 positions each.
    assert [len(sharding.shard_positions(103, r, 4)) for r in range(4)] == [26, 26, 26, 25]
    assert sharding.steps_per_epoch(103, 4, 5) == 5
    assert sharding.steps_per_epoch(103, 4, 5, max_steps=3) == 3
    assert sharding.steps_per_epoch(103, 4, 5, max_steps=9) == 5
    assert sharding.steps_per_epoch(103, 4, 5, max_steps=0) == 5  # 0: no cap
    assert sharding.steps_per_epoch(4, 4, 1) == 1


def test_a_resumed_epoch_starts_at_its_position():
    steps, batch, size = 8, 4, 3
    left = sharding.remaining_steps(steps, batch, size, 40)
    assert left == (8 * 12 - 40) // 12 == 4
    shards = [sharding.rank_positions(r, size, left, batch, start=40) for r in range(size)]
    assert sorted(p for s in shards for p in s) == list(range(40, 40 + left * batch * size))
    assert list(shards[1])[:3] == [41, 44, 47]
    assert sharding.remaining_steps(8, 4, 3, 0) == 8
    assert sharding.remaining_steps(8, 4, 3, 96) == sharding.remaining_steps(8, 4, 3, 200) == 0
    sharding.check_start_position(40, by_file=False)
    sharding.check_start_position(0, by_file=True)


def test_tfrecord_files_by_file_or_by_record():
    counts = [1, 2, 3, 4, 5]
    assert sharding.records_per_rank(counts, 2) == ("file", 1 + 2)
    assert sharding.records_per_rank(counts, 5) == ("file", 1)
    assert sharding.records_per_rank(counts, 6) == ("record", 15 // 6)
    assert sharding.record_steps(counts, 2, 1, "'p'") == ("file", 3)
    assert sharding.record_steps(counts, 2, 2, "'p'", max_steps=1) == ("file", 1)
    assert sharding.record_steps([6, 6], 3, 2, "'p'") == ("record", 2)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("num_samples", [5, 8, 13])
def test_validation_is_split_once_over_the_ranks(size, num_samples):
    parts = [sharding.validation_positions(num_samples, r, size) for r in range(size)]
    assert sorted(p for part in parts for p in part) == list(range(num_samples))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1 and min(map(len, parts)) >= 1


def test_validation_files_by_file_only_when_every_rank_gets_records():
    assert sharding.validation_by_file([2, 3, 1, 2], 2)
    assert sharding.validation_by_file([2, 3, 1, 2], 4)
    assert not sharding.validation_by_file([2, 3, 1, 2], 5)  # fewer files than ranks
    assert not sharding.validation_by_file([2, 0, 1, 0], 2)  # rank 1 would read no record


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sharding.check_ranks(3, 3), r"rank 3 is outside 0\.\.2"),
        (lambda: sharding.check_ranks(-1, 2), r"rank -1 is outside 0\.\.1"),
        (lambda: sharding.check_ranks(0, 0), "size 0: need at least one rank"),
        (lambda: sharding.shard_positions(10, 4, 4), r"rank 4 is outside 0\.\.3"),
        (lambda: sharding.sample_count([10, 9]), r"arrays differ in length: \[10, 9\]"),
        (lambda: sharding.sample_count([]), "no arrays to shard"),
        (
            lambda: sharding.steps_per_epoch(10, 4, 4),
            "10 training samples on 4 ranks: 2 per rank, not one batch of 4",
        ),
        (
            lambda: sharding.steps_per_epoch(3, 4, 1, what="training images"),
            "3 training images are fewer than the 4 ranks",
        ),
        (lambda: sharding.steps_per_epoch(10, 2, 0), "per-rank batch size 0: must be >= 1"),
        (lambda: sharding.steps_per_epoch(10, 0, 1), "size 0: need at least one rank"),
        (
            lambda: sharding.record_steps([1, 2, 3, 4, 5], 2, 4, "'t-*'"),
            "'t-\\*': 15 training records in 5 files on 2 ranks by file: 3 per rank, "
            "not one batch of 4",
        ),
        (
            lambda: sharding.record_steps([1, 1], 3, 1, "'t-*'"),
            "'t-\\*': 2 training records are fewer than the 3 ranks",
        ),
        (
            lambda: sharding.remaining_steps(8, 4, 3, -1),
            "need position >= 0, batch >= 1 and size >= 1, got -1, 4, 3",
        ),
        (
            lambda: sharding.remaining_steps(8, 0, 3, 0),
            "need position >= 0, batch >= 1 and size >= 1, got 0, 0, 3",
        ),
        (
            lambda: sharding.check_start_position(-4, by_file=False),
            r"start_position -4: must be >= 0, and 0 for TFRecord files .* not by permutation "
            r"position\)",
        ),
        (
            lambda: sharding.check_start_position(8, by_file=True),
            "start_position 8: must be >= 0, and 0 for TFRecord files",
        ),
        (
            lambda: sharding.validation_positions(2, 0, 3),
            "2 validation samples are fewer than the 3 ranks",
        ),
        (
            lambda: sharding.validation_positions(8, 0, 9, "validation records", "'v-*'"),
            "'v-\\*': 8 validation records are fewer than the 9 ranks",
        ),
        (lambda: sharding.validation_positions(8, 2, 2), r"rank 2 is outside 0\.\.1"),
    ],
)
def test_errors_name_the_problem_and_the_numbers(call, message):
    with pytest.raises(DataError, match=f"^{message}") as info:
        call()
    assert isinstance(info.value, ValueError)  # DataError is a UserError, a ValueError
    assert "\n" not in str(info.value)  # one line
