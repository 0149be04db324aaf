"""Every rank runs this whole directory under a launcher (tests/integration starts the launches).

Rules for tests here: every rank runs every test and the same collectives in the same order;
assertions come after a test's collectives and compare gathered values, so that all ranks pass or
fail together instead of one rank leaving the others waiting in a collective.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Process sets made during the run (test_collectives): read by Horovod at init.
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")

from hvd_train import comm

comm.init()  # before any test touches TensorFlow: thread pools are fixed at its first op

_outcomes = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if report.failed:
        _outcomes["failed"] += 1
    elif report.skipped:
        _outcomes["skipped"] += 1
    elif report.when == "call":
        _outcomes["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    """Leave one report per rank for the launching test: what ran, on which rank, how it ended."""
    out = os.environ.get("HVD_TRAIN_TEST_OUT")
    if out:
        report = {
            "rank": comm.rank(),
            "size": comm.size(),
            "controller": comm.controller(),
            "exitstatus": int(exitstatus),
            **_outcomes,
        }
        Path(out, f"rank{comm.rank()}.json").write_text(json.dumps(report))
