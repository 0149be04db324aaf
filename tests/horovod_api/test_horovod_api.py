"""Horovod's Keras API at np=2 under mpirun and horovodrun: on the modern stack this toolkit's
module (`hvd_train.horovod.tensorflow.keras`), on the classic stack Horovod's own, running the same
script (api_check.py asserts the closed forms on every rank and writes what it measured).

What the two modules do differently by design is checked per module: this one broadcasts rank 0's
weights before the first step and reduces metrics exactly; Horovod's broadcasts after the first
batch (an update from each rank's own weights comes first) and averages per-rank means.
"""

import json
import os

import pytest
from stacks import STACKS, run, stack_env

from hvd_train.core import launch

SCRIPT = "tests/horovod_api/api_check.py"
TOLERANCE = 1e-5  # float32 weights after 8 SGD steps, reduced in another order than one process


def launches():
    for stack in ("modern", "classic"):
        for launcher in ("mpirun", "horovodrun"):
            present = os.path.exists(STACKS[stack][0])
            marks = [] if present else [pytest.mark.skip(reason=f"no {stack} environment")]
            yield pytest.param(stack, launcher, id=f"{stack}-{launcher}", marks=marks)


@pytest.mark.parametrize(("stack", "launcher"), list(launches()))
def test_api_script(stack, launcher, tmp_path):
    out = tmp_path / "facts.json"
    command = [STACKS[stack][0], SCRIPT, "--out", str(out)]
    job = run(launch.build(launcher, 2, command), timeout=300, env=stack_env(stack))
    assert job.returncode == 0, job.tail()
    facts = json.loads(out.read_text())
    accuracy = facts["val_accuracy"]

    assert facts["size"] == 2
    assert facts["controller"] == ("mpi" if launcher == "mpirun" else "gloo")
    assert facts["mpi_threads"] in ((True, False) if launcher == "mpirun" else ("ValueError",))
    assert facts["loaded_iterations"] == 12  # 8 saved, 4 after loading
    # The controls: starting from rank 1's weights, or averaging per-rank means, differs.
    assert facts["gap_from_rank1_start"] > 100 * TOLERANCE
    assert abs(accuracy["exact"] - accuracy["mean_of_rank_means"]) > 100 * TOLERANCE
    if facts["api"] == "hvd_train":
        assert facts["gap_from_rank0_start"] < TOLERANCE, facts  # one process from rank 0's start
        assert abs(accuracy["logged"] - accuracy["exact"]) < 1e-7, accuracy
        assert "Adasum is not supported" in facts["adasum"]
        assert facts["best_saved"]
    else:  # Horovod's own, with its known defects
        assert facts["gap_from_rank0_start"] > 100 * TOLERANCE, facts
        assert abs(accuracy["logged"] - accuracy["mean_of_rank_means"]) < 1e-7, accuracy
    print(f"{stack} {launcher}: {facts['api']} module in {job.seconds:.0f}s")


@pytest.mark.skipif(not os.path.exists(STACKS["classic"][0]), reason="no classic environment")
def test_keras_2_gets_one_clear_import_error():
    command = [STACKS["classic"][0], "-c", "import hvd_train.horovod.tensorflow.keras"]
    job = run(command, timeout=60, env=stack_env("classic"))
    last = job.output.strip().splitlines()[-1]

    assert job.returncode == 1
    assert last.startswith("ImportError: hvd_train.horovod is Horovod's Keras API for Keras 3")
    assert "import horovod.tensorflow.keras as hvd" in last
