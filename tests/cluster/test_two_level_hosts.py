"""Two-level reduction across real hosts (2 hosts x 2 slots, h1: ranks 0, 1; h2: 2, 3): the bytes
each reduction moves through h2's job interface against the closed form, and results equal to
flat's, under mpirun and horovodrun (Gloo).

Closed forms, per allreduce of S bytes, what h2 sends and receives each way:
- a flat ring of 4 crosses between the hosts on two of its edges, each carrying
  2 (n - 1) / n x S: 1.5 x S (Gloo's allreduce; Open MPI's ring, algorithm 4, forced);
- two-level reduces within each host first, then each of h2's two ranks exchanges its half of S
  with its peer on h1 (a ring of 2: S / 2 each way): S;
- Open MPI 4.1's own choice at 4 ranks and 64 MiB (recursive halving with distance doubling,
  whose first step pairs ranks 2r and 2r + 1, on one host under mpirun's block placement):
  S / 2 then S / 4 per rank across hosts only in its middle steps: S.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import parallel_report  # tests/integration/parallel_report.py: the verdict on a parallel launch
import pytest
from hosts import Cluster, counters

MIB = 64
S = MIB * 2**20
CALLS = 3  # one warmup, two timed
# TCP/IP and Ethernet headers, ACKs, and what a launch moves besides (Horovod's negotiation,
# Open MPI's wire-up), on top of the payload.
OVERHEAD = 0.10
ON_H1 = ["bash", "mpi_scripts/cluster/cluster.sh", "exec", "h1"]  # horovodrun's driver: on h1
RING = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
}
# (name, launcher, reduction, extra environment, closed form: h2's bytes each way over S)
CASES = [
    ("mpirun-two-level", "mpirun", "two_level", {}, 1.0),
    ("mpirun-flat", "mpirun", "flat", {}, 1.0),
    ("mpirun-flat-ring", "mpirun", "flat", RING, 1.5),
    ("gloo-two-level", "horovodrun", "two_level", {}, 1.0),
    ("gloo-flat", "horovodrun", "flat", {}, 1.5),
]
_results: dict[str, dict] = {}


def bench(cluster: Cluster, launcher: str, reduction: str, env: dict[str, str]):
    """The benchmark of one reduction on h1:2,h2:2, and what crossed h2's interfaces meanwhile."""
    argv = [
        *(ON_H1 if launcher == "horovodrun" else []),
        jobs.PYTHON,
        "-m",
        "hvd_train.core.launch",
    ]
    argv += ["--np", "4", "--hosts", "h1:2,h2:2", "--launcher", launcher, "--", jobs.PYTHON]
    argv += ["-m", "hvd_train.bench.two_level", "--mib", str(MIB), "--warmup", "1"]
    argv += ["--iters", str(CALLS - 1), "--reductions", reduction]
    start = counters("h2")
    job = jobs.run(argv, 600, env={**cluster.env(), **env})
    end = counters("h2")
    found = re.findall(r"^(?:\[(?:1,)?0\]<stdout>:)?two_level (\{.*\})$", job.output, re.M)
    assert job.returncode == 0 and len(found) == 1, job.tail()
    return json.loads(found[0]), {key: end[key] - start[key] for key in start}, job


@pytest.mark.parametrize(
    ("name", "launcher", "reduction", "env", "closed_form"), CASES, ids=[c[0] for c in CASES]
)
def test_cross_host_bytes_per_allreduce_equal_the_closed_form(
    cluster: Cluster, name, launcher, reduction, env, closed_form
):
    result, grown, job = bench(cluster, launcher, reduction, env)
    (run,) = result["runs"]
    tx, rx = grown["data0.tx"] / (CALLS * S), grown["data0.rx"] / (CALLS * S)
    print(f"{name}: {job.seconds:.1f} s, median {run['median_s']:.3f} s, h2 / S {tx:.3f}, {rx:.3f}")
    _results[name] = run
    assert (result["size"], result["local_size"], result["cross_size"]) == (4, 2, 2)
    assert result["auto"] == "flat", result  # the rule's default (comm.reduction)
    assert run["exact"], run  # the closed form of the Average, on every element
    # The bands of S and 1.5 x S do not overlap: a two-level run that moved a ring's bytes (or a
    # ring that moved S) fails here.
    hi = closed_form * (1 + OVERHEAD)
    assert closed_form <= tx <= hi and closed_form <= rx <= hi, (tx, rx)


def test_every_reduction_gave_the_same_bytes_of_result():
    # After the cases above (same module, in order): flat and two-level results are bit-equal.
    assert len(_results) == len(CASES), sorted(_results)
    assert len({run["sha256"] for run in _results.values()}) == 1, _results


@pytest.mark.parametrize("stack", ["modern", "classic"])
def test_the_optimizers_train_like_one_process_with_two_level_reduction(cluster: Cluster, stack):
    """The equivalence suite (N ranks equal one process with the global batch) at 2 x 2 with
    every DistributedOptimizer reducing two-level (HVD_TRAIN_REDUCTION overrides `auto`), on the
    toolkit's Keras 3 optimizer and on Keras 2's Horovod optimizer routed through it."""
    suite = "tests/parallel/test_equivalence.py"
    skips = {t: c for t, c in parallel_report.EXPECTED_SKIPS.items() if t.startswith(suite)}
    venv = os.environ.get("HVD_TRAIN_CLASSIC_VENV", str(jobs.REPO / ".venv-classic"))
    python = jobs.PYTHON if stack == "modern" else str(Path(venv) / "bin" / "python")
    out = cluster.state / "shared" / f"two-level-{stack}"
    out.mkdir()
    argv = [python, "-m", "hvd_train.core.launch", "--np", "4", "--hosts", "h1:2,h2:2", "--"]
    argv += [python, "-m", "pytest", suite, "-q", "-p", "no:cacheprovider"]
    env = {**cluster.env(), "HVD_TRAIN_TEST_OUT": str(out), "HVD_TRAIN_REDUCTION": "two_level"}
    env["PATH"] = f"{Path(python).parent}:{env['PATH']}"
    job = jobs.run(argv, 900, env=env)
    reports = parallel_report.read(out)
    found = parallel_report.problems(reports, parallel_report.Launch(4, "mpi", stack), skips)
    assert job.returncode == 0 and not found, "\n".join([*found, job.tail()])
    print(f"two-level {stack}: {parallel_report.summary(reports)} per rank in {job.seconds:.0f} s")
