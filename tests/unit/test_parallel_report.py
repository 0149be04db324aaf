"""The launch checker of tests/parallel (tests/integration/parallel_report.py) on made-up rank
reports: a clean launch passes, and each way a launch can pass without the real thing fails."""

import copy
import json
from pathlib import Path

import pytest

from tests.integration import parallel_report
from tests.integration.parallel_report import CLASSIC, ONE_RANK, Launch, problems

REPO = Path(__file__).resolve().parents[2]
SUITE = "tests/parallel/test_x.py::"
TESTS = [f"{SUITE}test_average", f"{SUITE}test_sum", f"{SUITE}test_keras3_only"]
TABLE = {f"{SUITE}test_sum": ONE_RANK, f"{SUITE}test_keras3_only": CLASSIC}
TWO_RANKS = Launch(size=2, controller="mpi", stack="modern")


def reports(size=2, skipped=(), stack="modern"):
    """Every rank's report of a launch in which the tests in `skipped` skip and the others pass."""
    outcomes = {
        test: {"outcome": "skipped", "reason": "because"}
        if test in skipped
        else {"outcome": "passed"}
        for test in TESTS
    }
    return [
        {
            "rank": rank,
            "size": size,
            "controller": "mpi",
            "stack": stack,
            "exitstatus": 0,
            "collected": list(TESTS),
            "outcomes": copy.deepcopy(outcomes),
        }
        for rank in range(size)
    ]


def test_a_clean_launch_passes_with_its_expected_skips_only():
    one_rank = Launch(size=1, controller="mpi", stack="modern")
    classic = Launch(size=2, controller="mpi", stack="classic")

    assert problems(reports(), TWO_RANKS, TABLE) == []
    assert problems(reports(1, [f"{SUITE}test_sum"]), one_rank, TABLE) == []
    assert problems(reports(2, [f"{SUITE}test_keras3_only"], "classic"), classic, TABLE) == []
    summary = parallel_report.summary(reports(1, [f"{SUITE}test_sum"]))
    assert summary == "3 collected, 2 passed, 1 skipped"


def test_other_test_ids_on_one_rank_fail():
    launch = reports()
    launch[1]["collected"].remove(f"{SUITE}test_average")
    launch[1]["collected"].append(f"{SUITE}test_other")
    launch[1]["outcomes"][f"{SUITE}test_other"] = {"outcome": "passed"}

    (problem,) = [p for p in problems(launch, TWO_RANKS, TABLE) if "collected other" in p]
    assert f"only here ['{SUITE}test_other']" in problem
    assert f"only on rank 0 ['{SUITE}test_average']" in problem
    assert problem.endswith("[rank(s) 1]")


def test_the_same_ids_in_another_order_fail():
    launch = reports()
    launch[1]["collected"].reverse()
    assert problems(launch, TWO_RANKS, TABLE) == [
        "collected other tests than rank 0: only here [], only on rank 0 [] (another order) "
        "[rank(s) 1]"
    ]


def test_a_skip_the_table_does_not_list_fails():
    found = problems(reports(skipped=[f"{SUITE}test_average"]), TWO_RANKS, TABLE)
    assert found == [
        f"{SUITE}test_average: skipped (because), which EXPECTED_SKIPS does not list: add it "
        "with the condition it skips under if that is intended [rank(s) 0, 1]"
    ]


def test_a_skip_listed_for_other_launches_fails():
    found = problems(reports(skipped=[f"{SUITE}test_sum"]), TWO_RANKS, TABLE)
    assert found == [
        f"{SUITE}test_sum: skipped (because), but expected to skip on np == 1 only [rank(s) 0, 1]"
    ]


def test_a_listed_test_that_ran_where_it_should_skip_fails():
    one_rank = Launch(size=1, controller="mpi", stack="modern")
    found = problems(reports(1), one_rank, TABLE)
    assert found == [
        f"{SUITE}test_sum: passed, but EXPECTED_SKIPS says it skips on np == 1 [rank(s) 0]"
    ]


def test_a_test_expected_to_pass_missing_from_a_rank_fails():
    never_reported = reports()
    del never_reported[1]["outcomes"][f"{SUITE}test_average"]
    failed = reports()
    failed[0]["outcomes"][f"{SUITE}test_average"] = {"outcome": "failed", "when": "call"}
    missing_rank = reports()[:1]

    assert problems(never_reported, TWO_RANKS, TABLE) == [
        f"{SUITE}test_average: collected but never reported [rank(s) 1]"
    ]
    assert problems(failed, TWO_RANKS, TABLE) == [f"{SUITE}test_average: failed (call) [rank(s) 0]"]
    assert problems(missing_rank, TWO_RANKS, TABLE) == [
        "reports from ranks [0], expected one from each of ranks 0..1"
    ]


@pytest.mark.parametrize(
    ("key", "value"), [("size", 3), ("controller", "gloo"), ("stack", "classic"), ("exitstatus", 1)]
)
def test_a_rank_that_ran_elsewhere_or_exited_badly_fails(key, value):
    launch = reports()
    launch[1][key] = value
    (problem,) = problems(launch, TWO_RANKS, TABLE)
    assert problem.startswith(f"{key} is {value!r}, expected ") and problem.endswith("[rank(s) 1]")


def test_a_stale_table_entry_fails():
    table = {**TABLE, f"{SUITE}test_renamed": ONE_RANK}
    assert problems(reports(), TWO_RANKS, table) == [
        f"EXPECTED_SKIPS lists tests that were not collected: ['{SUITE}test_renamed'] [rank(s) 0]"
    ]


def test_reports_are_read_in_rank_order(tmp_path):
    launch = reports(size=11)
    for report in launch:
        (tmp_path / f"rank{report['rank']}.json").write_text(json.dumps(report))
    assert [r["rank"] for r in parallel_report.read(tmp_path)] == list(range(11))


def test_every_entry_of_the_table_names_a_test_of_the_parallel_suite():
    for test in parallel_report.EXPECTED_SKIPS:
        path, name = test.split("::")
        function = name.split("[")[0]
        assert path.startswith("tests/parallel/test_"), test
        assert f"def {function}(" in (REPO / path).read_text(), test
