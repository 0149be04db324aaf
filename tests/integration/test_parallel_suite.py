"""Launch tests/parallel under real launchers: every rank runs every test and reports back.

Covers np=1..3 (np=3 oversubscribes a 2-core machine), the MPI controller under mpirun and the Gloo
controller under horovodrun; CI runs np=2 under mpirun, the rest runs under `make test-full`
(HVD_TRAIN_FULL=1), to keep CI's budget: the cluster tier runs the equivalence tests under Gloo
across hosts. Startup costs 10-20 s per launch, so the
whole parallel suite shares each launch. Every rank must have run the same tests, each passed or
skipped as parallel_report.EXPECTED_SKIPS says (parallel_report.py).
"""

import parallel_report
import pytest
from jobs import FULL_ONLY, PYTHON, run

from hvd_train.core import launch

# CI's 90 minutes: the Gloo controller's suite runs across hosts in tests/cluster-jobs; here
# np=1, np=3 and horovodrun (about 470 s together on 2 cores) in `make test-full`.
LAUNCHES = [("mpirun", 2), ("horovodrun", 2), ("mpirun", 1), ("mpirun", 3), ("horovodrun", 3)]


@pytest.mark.parametrize(
    ("launcher", "np"),
    [
        pytest.param(name, n, id=f"{name}-np{n}", marks=() if i == 0 else FULL_ONLY)
        for i, (name, n) in enumerate(LAUNCHES)
    ],
)
def test_parallel_suite(launcher, np, tmp_path):
    command = [PYTHON, "-m", "pytest", "tests/parallel", "-q", "-p", "no:cacheprovider"]
    argv = launch.build(launcher, np, command)
    job = run(argv, timeout=900, env={"HVD_TRAIN_TEST_OUT": str(tmp_path)})
    reports = parallel_report.read(tmp_path)
    controller = "mpi" if launcher == "mpirun" else "gloo"
    found = parallel_report.problems(reports, parallel_report.Launch(np, controller, "modern"))

    assert job.returncode == 0 and not found, "\n".join([*found, job.tail()])
    print(f"{launcher} np={np}: {parallel_report.summary(reports)} per rank in {job.seconds:.0f}s")
