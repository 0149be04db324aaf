"""The classic stack (TensorFlow 2.15 + Keras 2, Horovod's own Keras optimizer), through its venv.

Every job here runs with the classic environment's Python (<repo>/.venv-classic, or
HVD_TRAIN_CLASSIC_VENV): the parallel suite (equivalence, accumulation, mixed precision, metrics
and state) under mpirun at np=2 and np=3 (checked against parallel_report.EXPECTED_SKIPS, as the
modern launches are), the default job on 2 workers, and the parity of per-step losses with the
modern stack, this test's own Python, from the same initial weights and data order.
All are skipped where that environment is absent: `STACK=classic make install` creates it.
"""

import importlib.metadata
import json
import os

import numpy as np
import parallel_report
import pytest
from jobs import FULL_ONLY, PYTHON, REPO, result_of, run

from hvd_train.core import launch

CLASSIC_VENV = os.environ.get("HVD_TRAIN_CLASSIC_VENV", str(REPO / ".venv-classic"))
CLASSIC_PYTHON = os.path.join(CLASSIC_VENV, "bin", "python")
# The classic environment's commands (horovodrun, hvd-train) first, for the launcher and its ranks.
CLASSIC_ENV = {"PATH": os.pathsep.join([os.path.join(CLASSIC_VENV, "bin"), os.environ["PATH"]])}

pytestmark = pytest.mark.skipif(
    not os.path.exists(CLASSIC_PYTHON),
    reason=f"no classic environment at {CLASSIC_VENV}: create it with `STACK=classic make install`",
)


# np=3 (about 135 s) in `make test-full` only: CI's 90 minutes.
@pytest.mark.parametrize(
    "np_",
    [pytest.param(2, id="mpirun-np2"), pytest.param(3, id="mpirun-np3", marks=FULL_ONLY)],
)
def test_parallel_suite_on_classic(np_, tmp_path):
    command = [CLASSIC_PYTHON, "-m", "pytest", "tests/parallel", "-q", "-p", "no:cacheprovider"]
    job = run(
        launch.build("mpirun", np_, command),
        timeout=900,
        env={**CLASSIC_ENV, "HVD_TRAIN_TEST_OUT": str(tmp_path)},
    )
    reports = parallel_report.read(tmp_path)
    # Skips as parallel_report.EXPECTED_SKIPS says, e.g. the Keras-3-only LossScaleOptimizer order.
    found = parallel_report.problems(reports, parallel_report.Launch(np_, "mpi", "classic"))

    assert job.returncode == 0 and not found, "\n".join([*found, job.tail()])
    print(f"classic np={np_}: {parallel_report.summary(reports)} per rank in {job.seconds:.0f}s")


def test_default_job_on_two_workers(tmp_path):
    run_dir = tmp_path / "run"
    config = str(REPO / "configs" / "digits.yaml")
    argv = [CLASSIC_PYTHON, "-m", "hvd_train.cli", "launch", "--np", "2", "--"]
    argv += ["train", "--config", config, "--set", f"run_dir={run_dir}"]
    job = run(argv, timeout=600, env=CLASSIC_ENV)
    assert job.returncode == 0, job.tail()
    result = result_of(job)
    versions = json.loads((run_dir / "run.json").read_text())["versions"]
    records = json.loads((run_dir / "metrics.json").read_text())

    assert versions["keras"].startswith("2.") and versions["tensorflow"].startswith("2.15.")
    assert result["workers"] == 2 and result["epochs_done"] == 12
    assert [r["epoch"] for r in records] == list(range(1, 13))
    assert result["final"]["accuracy"] >= 0.97, result
    print(f"classic default job: val_accuracy {result['final']['accuracy']:.4f}")


@pytest.mark.skipif(
    int(importlib.metadata.version("keras").split(".")[0]) < 3,
    reason="compares this test's Python (the modern stack) with the classic one",
)
def test_per_step_losses_match_the_modern_stack(tmp_path):
    weights, losses = tmp_path / "initial.npz", {}
    # The modern run writes the initial weights, the classic run reads them.
    for stack, python, env in [("modern", PYTHON, None), ("classic", CLASSIC_PYTHON, CLASSIC_ENV)]:
        out = tmp_path / f"{stack}.json"
        command = [python, "tests/integration/parity_steps.py", "--weights", str(weights)]
        job = run(launch.build("mpirun", 2, [*command, "--out", str(out)]), timeout=600, env=env)
        assert job.returncode == 0, job.tail()
        record = json.loads(out.read_text())
        assert record["stack"] == stack, record
        losses[stack] = np.array(record["losses"])
    modern, classic = losses["modern"], losses["classic"]
    gap = float(np.max(np.abs(modern - classic)))

    assert modern.shape == classic.shape == (2, 20)  # 2 ranks, 20 steps each
    assert gap < 1e-5, f"per-step losses differ by {gap}:\n{modern}\n{classic}"
    assert modern[:, -5:].mean() < modern[:, :5].mean() - 0.1  # and it trains
    print(f"parity: 2 ranks x 20 steps, largest per-step loss difference {gap:.2g}")
