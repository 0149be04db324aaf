"""Training across hosts agrees with one process and with one host; a run directory on rank 0's
host alone (nothing shared but the project) trains, checkpoints and resumes; a data file one host
lacks is named with that host.

The parallel suite's equivalence tests (tests/parallel/test_equivalence.py: N ranks equal one
process with the global batch, within the suite's tolerance) run under each launcher and
placement; the default job across two hosts is bit-equal to the same job on one host.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import parallel_report  # tests/integration/parallel_report.py: the verdict on a parallel launch
import pytest
from hosts import Cluster, on_host

HVD_TRAIN = [jobs.PYTHON, "-m", "hvd_train.cli"]
ON_H1 = ["bash", "mpi_scripts/cluster/cluster.sh", "exec", "h1"]
DIGITS = ["train", "--config", "configs/digits.yaml", "--set", "optimizer.warmup_epochs=0"]

# (name, launcher argv up to --np, ranks). horovodrun runs from h1
# (test_cluster.py says why).
SUITE = "tests/parallel/test_equivalence.py"
LAUNCH = [jobs.PYTHON, "-m", "hvd_train.core.launch"]
SUITE_LAUNCHES = [
    ("mpirun-2x1", [*LAUNCH, "--hosts", "h1:1,h2:1"], 2),
    ("mpirun-2x2", [*LAUNCH, "--hosts", "h1:2,h2:2"], 4),
    (
        "horovodrun-gloo-2x1",
        [*ON_H1, *LAUNCH, "--hosts", "h1:1,h2:1", "--launcher", "horovodrun"],
        2,
    ),
    ("mpirun-uneven", [*LAUNCH, "--hosts", "h1:2,h2:1"], 3),
    (
        "horovodrun-mpi-2x1",
        [*ON_H1, *LAUNCH, "--hosts", "h1:1,h2:1", "--launcher", "horovodrun-mpi"],
        2,
    ),
]
# CI's 90 minutes: the uneven placement and horovodrun's MPI controller in `make test-full`.
FULL_ONLY_LAUNCHES = {"mpirun-uneven", "horovodrun-mpi-2x1"}


@pytest.mark.parametrize(
    ("name", "launcher", "ranks"),
    [
        pytest.param(*s, id=s[0], marks=jobs.FULL_ONLY if s[0] in FULL_ONLY_LAUNCHES else ())
        for s in SUITE_LAUNCHES
    ],
)
def test_equivalence_suite_across_hosts(cluster: Cluster, name: str, launcher: list, ranks: int):
    _suite_across_hosts(cluster, name, launcher, ranks, [SUITE])


# The larger-model modes at 2 hosts x 2: the sharded optimizer state (ZeRO stage 1) and the table
# split by rows, each equal to one process (their modules' tolerances and controls).
LARGER = ["tests/parallel/test_sharded_state.py", "tests/parallel/test_sharded_embedding.py"]


@jobs.FULL_ONLY  # about 170 s: CI's 90 minutes
def test_larger_model_suites_at_2_hosts_x_2(cluster: Cluster):
    _suite_across_hosts(cluster, "larger-2x2", [*LAUNCH, "--hosts", "h1:2,h2:2"], 4, LARGER)


def _suite_across_hosts(cluster: Cluster, name: str, launcher: list, ranks: int, files: list):
    """The parallel test modules `files` under `launcher` on `ranks` ranks: every rank ran every
    test, each passed or skipped as parallel_report.EXPECTED_SKIPS says."""
    out = cluster.state / "shared" / f"suite-{name}"
    out.mkdir()
    suite = [jobs.PYTHON, "-m", "pytest", *files, "-q"]
    argv = [*launcher, "--np", str(ranks), "--", *suite, "-p", "no:cacheprovider"]
    job = jobs.run(argv, 900, env={**cluster.env(), "HVD_TRAIN_TEST_OUT": str(out)})
    reports = parallel_report.read(out)
    controller = "gloo" if "gloo" in name else "mpi"
    launch = parallel_report.Launch(ranks, controller, "modern")
    skips = {
        test: condition
        for test, condition in parallel_report.EXPECTED_SKIPS.items()
        if test.split("::")[0] in files
    }
    found = parallel_report.problems(reports, launch, skips)
    assert job.returncode == 0 and not found, "\n".join([*found, job.tail()])
    print(f"{name}: {parallel_report.summary(reports)} per rank in {job.seconds:.0f} s")


def _weights(run_dir: Path) -> dict[str, list]:
    """The final checkpoint's arrays, by name (read with numpy: no TensorFlow in the test)."""
    import numpy as np

    checkpoints = sorted(run_dir.glob("checkpoints/epoch-*/state.npz"))
    assert checkpoints, f"no checkpoint in {run_dir}: {sorted(run_dir.rglob('*'))}"
    with np.load(checkpoints[-1]) as saved:
        return {name: saved[name].tolist() for name in saved.files}


def test_default_job_across_hosts_is_bit_equal_to_one_host(cluster: Cluster):
    """2 hosts x 1 slot and 1 host x 2 slots reduce the same two gradients: the same sum to the
    bit, so every loss and every weight is equal."""
    runs = {}
    for name, hosts in (("two-hosts", "h1:1,h2:1"), ("one-host", "h1:2")):
        run_dir = cluster.state / "shared" / f"bits-{name}"
        argv = [*HVD_TRAIN, "launch", "--np", "2", "--hosts", hosts, "--", *DIGITS]
        argv += ["--set", "train.epochs=2", "--set", f"run_dir={run_dir}"]
        job = jobs.run(argv, 600, env=cluster.env())
        assert job.returncode == 0, job.tail()
        run = json.loads((run_dir / "run.json").read_text())
        runs[name] = (run, json.loads((run_dir / "metrics.json").read_text()), run_dir)
        print(f"{name}: {job.seconds:.1f} s, hosts {run['hosts']}")
    (two, two_metrics, two_dir), (one, one_metrics, one_dir) = runs["two-hosts"], runs["one-host"]
    assert (two["cross_size"], one["cross_size"]) == (2, 1)
    # Losses, accuracies and learning rates, exactly; only the seconds differ.
    untimed = [
        [{k: v for k, v in e.items() if k != "seconds"} for e in m]
        for m in (two_metrics, one_metrics)
    ]
    assert untimed[0] == untimed[1] and len(untimed[0]) == 2
    assert _weights(two_dir) == _weights(one_dir)


def test_classic_stack_default_job_across_hosts(cluster: Cluster):
    venv = os.environ.get("HVD_TRAIN_CLASSIC_VENV", str(jobs.REPO / ".venv-classic"))
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        pytest.fail(f"the classic stack is not installed ({python}): make test installs it")
    run_dir = cluster.state / "shared" / "classic"
    argv = [str(python), "-m", "hvd_train.cli", "launch", "--np", "2", "--hosts", "h1:1,h2:1"]
    argv += ["--", *DIGITS, "--set", "train.epochs=2", "--set", f"run_dir={run_dir}"]
    env = cluster.env()
    env["PATH"] = f"{python.parent}:{env['PATH']}"
    job = jobs.run(argv, 600, env=env)
    assert job.returncode == 0, job.tail()
    result = json.loads(re.findall(r"^result (\{.*\})$", job.output, re.M)[-1])
    run = json.loads((run_dir / "run.json").read_text())
    assert run["versions"]["keras"].startswith("2.") and run["hosts"] == {"h1": [0], "h2": [1]}
    # The default job's two epochs learn (one process reaches about 0.9 in two epochs).
    assert result["final"]["accuracy"] > 0.7, result
    print(f"classic across hosts: {job.seconds:.1f} s, accuracy {result['final']['accuracy']:.3f}")


def test_run_directory_on_rank_0s_host_alone(cluster: Cluster):
    """A run directory in h1's private /tmp: rank 1 on h2 never sees it; the run trains, stops
    after an epoch with its checkpoint, and resumes from it on both ranks."""
    run_dir = "/tmp/local-run"
    launch = [*ON_H1, *HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1", "--", *DIGITS]
    launch += ["--set", "train.epochs=2", "--set", f"run_dir={run_dir}"]
    first = jobs.run([*launch, "--stop-after-epochs", "1"], 600, env=cluster.env())
    assert first.returncode == 0, first.tail()
    second = jobs.run([*launch, "--resume"], 600, env=cluster.env())
    assert second.returncode == 0, second.tail()
    result = json.loads(re.findall(r"^result (\{.*\})$", second.output, re.M)[-1])
    assert result["epochs_done"] == 2, result
    listed = on_host("h1", "ls", run_dir).split()
    assert {"run.json", "metrics.json", "launches.jsonl"} <= set(listed), listed
    lines = on_host("h1", "cat", f"{run_dir}/launches.jsonl").splitlines()
    launches = [json.loads(line) for line in lines]
    assert [x["initial_epoch"] for x in launches] == [0, 1]
    # Only on h1: not on h2, not in the root namespace.
    seen = on_host("h2", "sh", "-c", f"test -e {run_dir} && echo there || echo absent")
    assert seen.strip() == "absent"
    assert not Path(run_dir).exists()


def test_a_data_file_one_host_lacks_is_named_with_the_host(cluster: Cluster):
    """The npz exists in h1's /tmp only: every rank checks its data before the run starts, and
    the job ends with one line naming h2, exit 2, no run directory made."""
    path = "/tmp/digits.npz"
    make = (
        "import numpy as np; from sklearn.datasets import load_digits; d = load_digits(); "
        f"np.savez('{path}', x_train=d.images[..., None], y_train=d.target)"
    )
    on_host("h1", jobs.PYTHON, "-c", make)
    run_dir = cluster.state / "shared" / "data-on-h1"
    argv = [*HVD_TRAIN, "launch", "--np", "2", "--hosts", "h1:1,h2:1", "--", *DIGITS]
    argv += ["--set", "data.source=npz", "--set", f"data.path={path}"]
    job = jobs.run([*argv, "--set", f"run_dir={run_dir}"], 300, env=cluster.env())
    assert job.returncode == 2, job.tail()
    errors = [line for line in job.output.splitlines() if "hvd-train: error:" in line]
    assert len(errors) == 1, job.output
    assert "rank 1 on host h2: data.path" in errors[0] and path in errors[0], errors
    assert not run_dir.exists()


def test_gpu_readiness_across_hosts(cluster: Cluster):
    """2 hosts x 2 slots: each host's ranks have local ranks 0 and 1 (the GPU each pins,
    `core.placement.gpu_for_local_rank`), and every rank's NCCL would use its data interface,
    exactly (the rule sets NCCL_SOCKET_IFNAME; NCCL matches bare names as prefixes)."""
    report = cluster.state / "shared" / "selftest-2x2.json"
    argv = [*HVD_TRAIN, "launch", "--np", "4", "--hosts", "h1:2,h2:2", "--", "selftest"]
    job = jobs.run([*argv, "--json", str(report), "--max-skew", "10"], 300, env=cluster.env())
    assert job.returncode == 0, job.tail()
    ranks = json.loads(report.read_text())["ranks"]
    assert [(r["host"], r["local_rank"]) for r in ranks] == [
        ("h1", 0),
        ("h1", 1),
        ("h2", 0),
        ("h2", 1),
    ]
    assert {r["nccl_socket_ifname"] for r in ranks} == {"=data0"}
    assert {r["interface"] for r in ranks} == {"data0"}


def test_a_hostfile_places_the_ranks(cluster: Cluster):
    hostfile = cluster.state / "shared" / "hostfile"
    hostfile.write_text("# Open MPI's format\nh2 slots=1\nh1 slots=2\n")
    run_dir = cluster.state / "shared" / "hostfile-run"
    argv = [*HVD_TRAIN, "launch", "--np", "3", "--hostfile", str(hostfile), "--", *DIGITS]
    job = jobs.run(
        [*argv, "--set", "train.epochs=1", "--set", f"run_dir={run_dir}"], 300, env=cluster.env()
    )
    assert job.returncode == 0, job.tail()
    assert job.output.startswith("mpirun -np 3 -H h2:1,h1:2 "), job.output[:300]
    assert json.loads((run_dir / "run.json").read_text())["hosts"] == {"h2": [0], "h1": [1, 2]}
