"""Launch tests/parallel under real launchers: every rank runs every test and reports back.

Covers np=1..3 (np=3 oversubscribes a 2-core machine), the MPI controller under mpirun and the Gloo
controller under horovodrun. Startup costs 10-20 s per launch, so the whole parallel suite shares
each launch.
"""

import json

import pytest
from jobs import PYTHON, run

from hvd_train.core import launch

LAUNCHES = [("mpirun", 1), ("mpirun", 2), ("mpirun", 3), ("horovodrun", 2), ("horovodrun", 3)]


@pytest.mark.parametrize(
    ("launcher", "np"), LAUNCHES, ids=[f"{name}-np{n}" for name, n in LAUNCHES]
)
def test_parallel_suite(launcher, np, tmp_path):
    command = [PYTHON, "-m", "pytest", "tests/parallel", "-q", "-p", "no:cacheprovider"]
    argv = launch.build(launcher, np, command)
    job = run(argv, timeout=900, env={"HVD_TRAIN_TEST_OUT": str(tmp_path)})
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]

    assert job.returncode == 0, job.tail()
    assert [r["rank"] for r in reports] == list(range(np)), job.tail()
    controller = "mpi" if launcher == "mpirun" else "gloo"
    for report in reports:
        assert report["size"] == np and report["controller"] == controller
        assert report["failed"] == 0 and report["exitstatus"] == 0, job.tail()
        assert report["passed"] >= 20, report
    print(f"{launcher} np={np}: {reports[0]['passed']} passed per rank in {job.seconds:.0f}s")
