"""Bad input to the CLI: one clear line, exit code 2, nothing on disk lost.

The checks that need no TensorFlow run in a Python where importing TensorFlow fails, which proves
they run before it is loaded (and before any worker starts, for `launch`).
"""

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from jobs import FULL_ONLY, PYTHON, REPO, result_of, run

from hvd_train.core import config as config_lib

NO_TF = (
    "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None; "
    "from hvd_train.cli import main; sys.exit(main(sys.argv[1:]))"
)


def hvd_train(args, tf_allowed=False, cwd=REPO):
    prefix = ["-m", "hvd_train.cli"] if tf_allowed else ["-c", NO_TF]
    out = subprocess.run(
        [sys.executable, *prefix, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("hvd-train: error: ")]
    return out.returncode, errors, out.stderr


def assert_one_error(result, expected):
    code, errors, stderr = result
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], stderr[-2000:]


@pytest.fixture
def occupied(tmp_path):
    """A directory holding someone's file, which no failed command may touch."""
    path = tmp_path / "occupied"
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    return path


PRE_TF_CASES = [
    (["train", "--config", "/nonexistent/x.yaml"], "/nonexistent/x.yaml"),
    (["train", "--set", "train.epochs=0"], "train.epochs: must be >= 1, got 0"),
    (["train", "--set", "train.epoch=3"], "train.epoch: unknown key"),
    (["train", "--set", "train.epochs"], "train.epochs"),
    (["train", "--set", "train.epochs=three"], "train.epochs"),
    (["train", "--set", "data.source=imagenet"], "data.source"),
    (["train", "--set", "model.name=resnet9000"], "model.name: unknown model 'resnet9000'"),
    (["train", "--stop-after-epochs", "0"], "--stop-after-epochs must be >= 1, got 0"),
    (["train", "--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
    (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["launch", "--np", "0", "--", "train"], "--np must be >= 1, got 0"),
    (["launch", "--np", "2"], "no command given after --"),
    (["launch", "--launcher", "pbs", "--", "train"], "invalid choice: 'pbs'"),
    (
        [
            "launch",
            "--np",
            "3",
            "--dry-run",
            "--",
            "train",
            "--set",
            "train.global_batch_size=64",
        ],
        "train.global_batch_size: 64 is not divisible by the 3 workers",
    ),
    (["launch", "--np", "2", "--", "train", "--set", "optimizer.base_lr=-1"], "optimizer.base_lr"),
]


@pytest.mark.parametrize(
    ("args", "expected"), PRE_TF_CASES, ids=[" ".join(a) for a, _ in PRE_TF_CASES]
)
def test_rejected_before_tensorflow(args, expected):
    assert_one_error(hvd_train(args), expected)


def test_non_empty_run_dir_needs_resume_or_overwrite(occupied):
    result = hvd_train(["train", "--set", f"run_dir={occupied}"])
    assert_one_error(result, f"run_dir {occupied} is not empty: pass --resume")
    assert (occupied / "notes.txt").read_text() == "keep me"


def test_overwrite_refuses_a_directory_it_did_not_make(occupied):
    result = hvd_train(["train", "--overwrite", "--set", f"run_dir={occupied}"])
    assert_one_error(result, "is not an hvd_train run directory (no run.json)")
    assert (occupied / "notes.txt").read_text() == "keep me"


def test_run_dir_that_is_a_file(occupied):
    target = occupied / "notes.txt"
    assert_one_error(
        hvd_train(["train", "--set", f"run_dir={target}"]), "exists and is not a directory"
    )
    assert target.read_text() == "keep me"


def test_run_dir_that_cannot_be_created():
    assert_one_error(
        hvd_train(["train", "--set", "run_dir=/proc/hvd_train_run"]), "cannot be created"
    )


def test_missing_data_file(tmp_path):
    args = ["train", "--set", f"run_dir={tmp_path / 'run'}", "--set", "data.source=npz"]
    result = hvd_train([*args, "--set", "data.path=/nonexistent.npz"], tf_allowed=True)
    assert_one_error(result, "data file /nonexistent.npz does not exist")


@pytest.mark.parametrize(
    ("arrays", "expected"),
    [
        ({"x": np.zeros((4, 2))}, "missing array(s) x_train, y_train"),
        (
            {"x_train": np.zeros((4, 2)), "y_train": np.zeros(3, int)},
            "y_train must have shape (4,)",
        ),
        ({"x_train": np.zeros((4, 2)), "y_train": np.zeros(4)}, "integer class ids"),
        (
            {"x_train": np.full((4, 2), np.nan), "y_train": np.arange(4)},
            "x_train must be finite numbers",
        ),
    ],
    ids=["missing-arrays", "label-count", "float-labels", "nan"],
)
def test_malformed_npz(tmp_path, arrays, expected):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    args = ["train", "--set", f"run_dir={tmp_path / 'run'}", "--set", "data.source=npz"]
    result = hvd_train([*args, "--set", f"data.path={path}"], tf_allowed=True)
    assert_one_error(result, expected)


def test_unknown_model_argument(tmp_path):
    args = ["train", "--set", f"run_dir={tmp_path / 'run'}", "--set", "model.params={width: 3}"]
    assert_one_error(hvd_train(args, tf_allowed=True), "model.params: ")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    run = tmp_path / "run"
    quick = ["--set", f"run_dir={run}", "--set", "train.epochs=2"]
    quick += ["--set", "optimizer.warmup_epochs=0"]
    code, _, stderr = hvd_train(
        ["train", *quick, "--set", "train.steps_per_epoch=2", "--stop-after-epochs", "1"],
        tf_allowed=True,
    )
    assert code == 0, stderr[-2000:]
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    result = hvd_train(
        ["train", "--resume", *quick, "--set", "model.params={dense: 16}"], tf_allowed=True
    )
    assert_one_error(result, "checkpoint ")
    assert "has shape" in result[1][0] or "holds" in result[1][0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# Through `hvd-train launch`: what the user sees when a bad input is found before, or after, the
# workers start. The launch host's own checks run without TensorFlow (NO_TF); the workers are
# real. jobs.run bounds every job in time and leaves no rank behind.

# horovodrun prefixes each rank's lines with "[rank]<stream>:".
ERROR_LINE = re.compile(r"^(?:\[\d+\]<stderr>:)?hvd-train: error: (.*)$")
TF_START_UP = (
    "All log messages before absl::InitializeLog()",
    "oneDNN custom operations are on",
    "cpu_feature_guard",
    "To enable the following instructions",
)


def launch(launch_args, train_args, timeout=60, env=None):
    """`hvd-train launch LAUNCH_ARGS -- train TRAIN_ARGS`; the Job, and its error lines."""
    argv = [PYTHON, "-c", NO_TF, "launch", *launch_args, "--", "train", *train_args]
    job = run(argv, timeout=timeout, env=env)
    errors = [m.group(1) for m in map(ERROR_LINE.match, job.output.splitlines()) if m]
    return job, errors


@pytest.mark.parametrize("text", ["", "# to be written\n\n   \n"], ids=["0-bytes", "comments"])
def test_launch_refuses_an_empty_config_before_any_worker(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    job, errors = launch(["--np", "2"], ["--config", str(path)])
    assert job.returncode == 2, job.tail()
    assert errors == [
        f"config {path} is empty: give at least one section (e.g. train: {{epochs: 3}}), or no "
        "config file for the defaults"
    ]
    assert job.output.splitlines() == [f"hvd-train: error: {errors[0]}"]  # no launcher started
    assert job.seconds < 30


def test_launch_trains_a_null_section_with_its_defaults_and_says_so_once(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"run_dir: {tmp_path / 'run'}\noptimizer:\ntrain: {{epochs: 3}}\n")
    quick = ["--set", "train.steps_per_epoch=1", "--stop-after-epochs", "1"]
    job, errors = launch(["--np", "2"], ["--config", str(path), *quick], timeout=300)
    assert job.returncode == 0 and errors == [], job.tail()
    assert result_of(job)["epochs_done"] == 1
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["config"]["optimizer"] == dataclasses.asdict(config_lib.OptimizerConfig())
    note = f"config {path}: section 'optimizer' is empty (null): using its defaults"
    assert [line for line in job.output.splitlines() if note in line] != [], job.tail()
    assert job.output.count(note) == 1, job.output  # once per launch, not once per process


@pytest.fixture
def run_dir_problem(request, tmp_path, occupied):
    """(run_dir, the error's text) for each way a run directory cannot be used."""
    return {
        "not-empty": (occupied, f"run_dir {occupied} is not empty: pass --resume"),
        "a-file": (occupied / "notes.txt", "exists and is not a directory"),
        "cannot-be-created": ("/proc/hvd_train_run", "cannot be created"),
    }[request.param]


# Every problem under mpirun, one under horovodrun; the rest in `make test-full` (CI's 90 minutes).
PROBLEMS = ("not-empty", "a-file", "cannot-be-created")


@pytest.mark.parametrize(
    ("launcher", "run_dir_problem"),
    [pytest.param("mpirun", p, id=f"{p}-mpirun") for p in PROBLEMS]
    + [
        pytest.param("horovodrun", p, id=f"{p}-horovodrun", marks=() if i == 0 else FULL_ONLY)
        for i, p in enumerate(PROBLEMS)
    ],
    indirect=["run_dir_problem"],
)
def test_launch_shows_a_run_dir_problem_in_one_line(launcher, run_dir_problem, occupied):
    # Neither TensorFlow's start-up lines nor the launcher's report of the failed rank (mpirun's
    # boxes; horovodrun's "Process N exit ..." lines and traceback) show: the error says it all.
    run_dir, expected = run_dir_problem
    job, errors = launch(["--np", "2", "--launcher", launcher], ["--set", f"run_dir={run_dir}"])
    assert job.returncode == 2, job.output  # horovodrun's own 1 too
    assert len(errors) == 1 and expected in errors[0], job.output
    assert (occupied / "notes.txt").read_text() == "keep me"
    command, *rest = job.output.splitlines()
    assert command.startswith(f"{launcher} -np 2 "), job.output  # the command launch shows
    assert [ERROR_LINE.match(line) is not None for line in rest] == [True], job.output


# A rank that ends without an error line: the launcher's report is all the user has, and shows.
CRASH_RANK_1 = """import os, signal
if os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK")) == "1":
    if os.environ["CRASH"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)
"""
LAUNCHER_REPORTS = {  # (launcher, how rank 1 ends): the exit code, lines of the report
    ("mpirun", "exit"): (
        3,
        [
            "Primary job  terminated normally, but 1 process returned",
            "mpirun detected that one or more processes exited with non-zero status, thus causing",
            "  Exit code:    3",
        ],
    ),
    ("mpirun", "kill"): (137, ["mpirun noticed that process rank 1 with PID 0 on node "]),
    ("horovodrun", "exit"): (
        1,
        [
            "Process 1 exit with status code 3.",
            "Terminating remaining workers after failure of Process 1.",
            "Traceback (most recent call last):",
            "RuntimeError: Horovod detected that one or more processes exited with non-zero",
            "Exit code: 3",
        ],
    ),
}


@pytest.mark.parametrize(
    ("launcher", "crash"), list(LAUNCHER_REPORTS), ids=["-".join(k) for k in LAUNCHER_REPORTS]
)
def test_launch_shows_the_launchers_report_of_a_rank_that_gave_no_error(tmp_path, launcher, crash):
    # rank 1 ends itself at start-up (a sitecustomize on PYTHONPATH, which both launchers pass on)
    (tmp_path / "sitecustomize.py").write_text(CRASH_RANK_1)
    env = {"PYTHONPATH": str(tmp_path), "CRASH": crash}
    job, errors = launch(
        ["--np", "2", "--launcher", launcher], ["--set", f"run_dir={tmp_path / 'run'}"], env=env
    )
    code, report = LAUNCHER_REPORTS[launcher, crash]
    assert job.returncode == code and errors == [], job.output
    lines = job.output.splitlines()
    for expected in report:
        # In a line, not at its start: horovodrun's threads print into each other's lines
        # ("Exception in thread Traceback (most recent call last):").
        assert [line for line in lines if expected in line], (expected, job.output)
    assert not [line for line in lines if any(t in line for t in TF_START_UP)], job.output


def test_launch_shows_a_missing_data_file_once_and_leaves_no_run_dir(tmp_path):
    missing = tmp_path / "missing.npz"
    train = ["--set", f"run_dir={tmp_path / 'run'}", "--set", "data.source=npz"]
    job, errors = launch(["--np", "2"], [*train, "--set", f"data.path={missing}"])
    assert job.returncode == 2, job.output
    assert errors == [f"data.path: data file {missing} does not exist"], job.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory left


def test_workers_the_launcher_started_but_horovod_did_not_join_exit_2(tmp_path):
    """srun without PMIx starts N one-rank jobs: each would train alone on 1/N of its data."""
    from concurrent.futures import ThreadPoolExecutor

    def singleton(rank):
        env = {"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank)}
        # Open MPI's singleton start, as root here.
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        argv = [PYTHON, "-m", "hvd_train.cli", "train", "--set", f"run_dir={tmp_path}/run{rank}"]
        return run(argv, timeout=180, env=env)

    with ThreadPoolExecutor(2) as pool:
        jobs = list(pool.map(singleton, range(2)))

    for job in jobs:
        errors = [line for line in job.output.splitlines() if line.startswith("hvd-train: error:")]
        assert job.returncode == 2, job.tail()
        assert errors == [
            "hvd-train: error: the launcher started 2 workers but Horovod joined 1 of them into "
            "this job: start them with a launcher Horovod's build joins (mpirun, horovodrun, or "
            "srun --mpi=pmix for Open MPI; `hvd-train doctor` shows the build)"
        ], job.tail()
    assert not list(tmp_path.iterdir())  # no run directory left
