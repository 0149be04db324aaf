"""The verdict on one launch of tests/parallel, from the report each rank leaves (rank<r>.json).

A launch passes only if every rank collected the same node IDs in the same order, none failed,
and each test passed or skipped where EXPECTED_SKIPS says it does: per rank, passed + expected
skips == collected. Strict both ways: a skip the table does not list, or lists for other launches,
fails the launch, and so does a listed test that ran where it is expected to skip (a stale entry).

Adding an entry: a test in tests/parallel that skips somewhere (with `pytest.skip` or `skipif`,
saying why) gets one line in EXPECTED_SKIPS, its node ID as pytest prints it (the failure message
names it) mapped to the condition under which it skips: ONE_RANK, CLASSIC, MODERN, or a new
`Condition`. The parallel suite (test_parallel_suite.py) and the classic stack's (test_classic.py)
both check against this one table.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Launch:
    """Where a launch of tests/parallel ran."""

    size: int
    controller: str  # "mpi" (mpirun) or "gloo" (horovodrun)
    stack: str  # "modern" (Keras 3) or "classic" (Keras 2), as hvd_train.keras.compat.NAME


@dataclass(frozen=True)
class Condition:
    """Where a test is expected to skip: the launches for which `holds` is true."""

    text: str
    holds: Callable[[Launch], bool]


ONE_RANK = Condition("np == 1", lambda launch: launch.size == 1)
CLASSIC = Condition("the classic stack", lambda launch: launch.stack == "classic")
MODERN = Condition("the modern stack", lambda launch: launch.stack == "modern")

EXPECTED_SKIPS: dict[str, Condition] = {
    # One rank: no smaller process set; Sum is Average; the gradient allreduce (and with it fp16
    # compression) returns early.
    "tests/parallel/test_collectives.py::"
    "test_a_process_set_of_the_first_ranks_reduces_among_them_only": ONE_RANK,
    "tests/parallel/test_collectives.py::"
    "test_no_collective_pins_a_socket_below_the_kernels_send_buffer": ONE_RANK,
    "tests/parallel/test_equivalence.py::test_sum_op_equals_size_times_the_learning_rate": ONE_RANK,
    **{
        f"tests/parallel/test_equivalence.py::test_compression_stays_close[{kind}]": ONE_RANK
        for kind in ("fp16", "bf16")
    },
    # One rank: no gradient allreduce, hence no bucket to trace.
    **{
        f"tests/parallel/test_overlap.py::{name}": ONE_RANK
        for name in (
            "test_bucket_layout_in_the_traced_step_equals_its_closed_form",
            "test_the_first_bucket_does_not_wait_for_the_backward_pass",
            "test_large_gradients_go_alone_in_the_traced_step",
            "test_one_bucket_waits_for_the_whole_backward_pass",
            "test_buckets_carry_the_stop_flag",
        )
    },
    # Sharded optimizer state: the modern stack only (the classic stack refuses it in one line).
    **{
        f"tests/parallel/test_sharded_state.py::{name}": CLASSIC
        for name in (
            *(
                f"test_sharded_updates_equal_the_unsharded_ones[{case}]"
                for case in ("adam", "adamw", "sgd_momentum")
            ),
            *(
                f"test_clipping_uses_the_norm_over_all_shards[{clip}]"
                for clip in ("global_clipnorm", "clipnorm")
            ),
            "test_an_overflow_on_one_rank_skips_the_step_on_every_rank",
            "test_each_rank_holds_its_share_of_the_optimizer_state",
            "test_the_stop_flag_rides_the_sharded_step",
            "test_a_checkpoint_gathers_and_writes_one_variable_at_a_time",
            *(
                f"test_what_a_shard_cannot_do_is_refused[{case}]"
                for case in ("lars", "lamb", "accumulation", "adafactor", "use_ema")
            ),
        )
    },
    # Model-parallel embeddings: the modern stack only.
    **{
        f"tests/parallel/test_sharded_embedding.py::{name}": CLASSIC
        for name in (
            *(
                f"test_a_table_split_over_the_ranks_trains_like_one_process_holding_it_whole[{case}]"
                for case in ("adam", "sgd_momentum")
            ),
            "test_each_rank_holds_its_rows_and_its_slots_only",
            "test_a_gathered_table_is_put_back_row_for_row_in_small_chunks",
            "test_an_evaluation_over_all_ranks_equals_one_process_and_unequal_batch_counts_are_refused",
            "test_model_groups_of_a_size_that_does_not_divide_the_ranks_are_refused",
        )
    },
    "tests/parallel/test_sharded_embedding.py::"
    "test_model_groups_split_the_table_inside_each_group_and_train_like_one_process": Condition(
        "the classic stack or np == 1", lambda launch: CLASSIC.holds(launch) or launch.size == 1
    ),
    **{
        "tests/parallel/test_sharded_embedding.py::"
        f"test_what_cannot_hold_a_split_table_is_refused[{setting}]": Condition(
            "the classic stack or np == 1", lambda launch: CLASSIC.holds(launch) or launch.size == 1
        )
        for setting in ("process_set", "shard_state")
    },
    # The sharded update's collectives: none with one rank.
    "tests/parallel/test_sharded_state.py::"
    "test_the_update_gathers_by_the_buckets_of_its_reduce_scatter": Condition(
        "the classic stack or np == 1", lambda launch: CLASSIC.holds(launch) or launch.size == 1
    ),
    # Stack-specific rules around loss scaling.
    "tests/parallel/test_training_rules.py::"
    "test_loss_scaling_wrapped_around_the_distributed_optimizer_is_refused": CLASSIC,
    "tests/parallel/test_training_rules.py::"
    "test_classic_refuses_accumulation_under_mixed_float16": MODERN,
}


def read(directory: Path) -> list[dict]:
    """The rank reports a launch left in `directory`, in rank order."""
    paths = sorted(directory.glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    return [json.loads(p.read_text()) for p in paths]


def problems(
    reports: Sequence[Mapping],
    launch: Launch,
    expected_skips: Mapping[str, Condition] = EXPECTED_SKIPS,
) -> list[str]:
    """Everything wrong with a launch's rank reports, one line each (empty: it passed)."""
    ranks = [report["rank"] for report in reports]
    if ranks != list(range(launch.size)):
        return [f"reports from ranks {ranks}, expected one from each of ranks 0..{launch.size - 1}"]
    found: dict[str, list[int]] = {}  # a problem -> the ranks that have it

    def add(rank: int, problem: str) -> None:
        found.setdefault(problem, []).append(rank)

    collected = reports[0]["collected"]
    if not collected:
        add(0, "collected no tests")
    for report in reports:
        rank = report["rank"]
        wanted = {"size": launch.size, "controller": launch.controller, "stack": launch.stack}
        for key, want in [*wanted.items(), ("exitstatus", 0)]:
            if report[key] != want:
                add(rank, f"{key} is {report[key]!r}, expected {want!r}")
        if report["collected"] != collected:
            ids, first = set(report["collected"]), set(collected)
            add(
                rank,
                f"collected other tests than rank 0: only here {sorted(ids - first)}, only on "
                f"rank 0 {sorted(first - ids)}" + ("" if ids != first else " (another order)"),
            )
        for test in report["collected"]:
            problem = _problem(test, report["outcomes"].get(test), launch, expected_skips)
            if problem:
                add(rank, problem)
    stale = sorted(set(expected_skips) - set(collected))
    if stale:
        add(0, f"EXPECTED_SKIPS lists tests that were not collected: {stale}")
    return [f"{problem} [rank(s) {', '.join(map(str, r))}]" for problem, r in found.items()]


def _problem(test: str, outcome: dict | None, launch: Launch, expected: Mapping) -> str | None:
    condition = expected.get(test)
    skips_here = condition is not None and condition.holds(launch)
    if outcome is None:
        return f"{test}: collected but never reported"
    if outcome["outcome"] == "passed":
        if skips_here:
            return f"{test}: passed, but EXPECTED_SKIPS says it skips on {condition.text}"
        return None
    if outcome["outcome"] != "skipped":
        return f"{test}: {outcome['outcome']} ({outcome.get('when') or outcome.get('reason')})"
    if condition is None:
        return (
            f"{test}: skipped ({outcome['reason']}), which EXPECTED_SKIPS does not list: add it "
            "with the condition it skips under if that is intended"
        )
    if not skips_here:
        return (
            f"{test}: skipped ({outcome['reason']}), but expected to skip on {condition.text} only"
        )
    return None


def summary(reports: Sequence[Mapping]) -> str:
    """Rank 0's counts, e.g. "35 collected, 32 passed, 3 skipped" (equal on every rank once
    `problems` found none)."""
    outcomes = [o["outcome"] for o in reports[0]["outcomes"].values()]
    collected = len(reports[0]["collected"])
    passed, skipped = outcomes.count("passed"), outcomes.count("skipped")
    return f"{collected} collected, {passed} passed, {skipped} skipped"
