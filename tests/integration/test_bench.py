"""The benchmarks' instruments are right: the reference ring sums exactly, an injected straggler
shows up as the others' wait, the synthetic benchmark prints Horovod's summary lines. Timing
figures are printed by the benchmarks, never asserted here beyond what a straggler makes certain."""

import json
import re

import pytest
from jobs import FULL_ONLY, PYTHON, run

from hvd_train.core import launch


# np=3 (the ring's uneven chunks) in CI; 2 and 4 in `make test-full` (CI's 90 minutes).
@pytest.mark.parametrize("np", [3, *(pytest.param(n, marks=FULL_ONLY) for n in (2, 4))])
def test_reference_ring_equals_the_mpi_library_sum(np, tmp_path):
    out = tmp_path / "ar.json"
    command = [
        PYTHON,
        "-m",
        "hvd_train.bench.allreduce",
        "--out",
        str(out),
        "--mib",
        "1",
        "--warmup",
        "1",
        "--iters",
        "2",
    ]
    job = run(launch.build("mpirun", np, command), timeout=300)
    assert job.returncode == 0, job.tail()
    methods = {row["method"] for row in json.loads(out.read_text())["rows"]}
    assert methods == {"horovod_mpi", "mpi4py_Allreduce", "ring_mpi4py_numpy", "memcpy"}


def test_a_straggler_is_measured_as_the_others_wait(tmp_path):
    out, delay = tmp_path / "b.json", 300.0
    command = [
        PYTHON,
        "-m",
        "hvd_train.bench.breakdown",
        "--model",
        "mlp",
        "--shape",
        "64",
        "--steps",
        "6",
        "--straggler-rank",
        "1",
        "--delay-ms",
        str(delay),
        "--out",
        str(out),
    ]
    job = run(launch.build("mpirun", 2, command), timeout=300)
    assert job.returncode == 0, job.tail()
    fast, slow = json.loads(out.read_text())["median_ms_per_rank"]
    assert slow["straggle"] >= delay
    assert fast["wait"] > 0.5 * delay, fast
    assert slow["wait"] < 0.5 * delay, slow


def test_synthetic_prints_horovods_summary_lines():
    command = [
        PYTHON,
        "-m",
        "hvd_train.bench.synthetic",
        "--model",
        "mlp",
        "--shape",
        "64",
        "--num-iters",
        "3",
        "--num-batches-per-iter",
        "3",
        "--num-warmup-batches",
        "2",
    ]
    job = run(launch.build("mpirun", 2, command), timeout=300)
    assert job.returncode == 0, job.tail()
    assert re.search(r"^Img/sec per CPU: \d+\.\d \+-\d+\.\d$", job.output, re.MULTILINE)
    assert re.search(r"^Total img/sec on 2 CPU\(s\): \d+\.\d \+-\d+\.\d$", job.output, re.MULTILINE)
