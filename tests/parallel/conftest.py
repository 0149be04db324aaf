"""Every rank runs this whole directory under a launcher (tests/integration starts the launches).

Rules for tests here: every rank runs every test and the same collectives in the same order;
assertions come after a test's collectives and compare gathered values, so that all ranks pass or
fail together instead of one rank leaving the others waiting in a collective. A test that cannot
mean anything on some launch (one rank, one stack) skips there, saying why, and is listed in
tests/integration/parallel_report.py's EXPECTED_SKIPS: any other skip fails the launch.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Process sets made during the run (test_collectives): read by Horovod at init.
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")

from hvd_train import comm
from hvd_train.keras import compat

comm.init()  # before any test touches TensorFlow: thread pools are fixed at its first op

_collected: list[str] = []
_outcomes: dict[str, dict] = {}


def pytest_collection_finish(session):
    _collected[:] = [item.nodeid for item in session.items]


def pytest_runtest_logreport(report):
    """A test's outcome: failed if any phase failed, skipped (with pytest's reason), or passed."""
    if hasattr(report, "wasxfail"):  # the suite has no expected failures: the checker refuses it
        _outcomes[report.nodeid] = {"outcome": "xfail", "reason": report.wasxfail}
    elif report.failed:
        _outcomes[report.nodeid] = {"outcome": "failed", "when": report.when}
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        _outcomes[report.nodeid] = {"outcome": "skipped", "reason": reason}
    elif report.when == "call":
        _outcomes[report.nodeid] = {"outcome": "passed"}


def pytest_sessionfinish(session, exitstatus):
    """Leave one report per rank for the launching test (tests/integration/parallel_report.py
    checks it): where it ran, the node IDs it collected in order, and how each one ended."""
    out = os.environ.get("HVD_TRAIN_TEST_OUT")
    if out:
        report = {
            "rank": comm.rank(),
            "size": comm.size(),
            "controller": comm.controller(),
            "stack": compat.NAME,
            "exitstatus": int(exitstatus),
            "collected": _collected,
            "outcomes": _outcomes,
        }
        Path(out, f"rank{comm.rank()}.json").write_text(json.dumps(report, indent=1))
