"""Bad input to the CLI: one clear line, exit code 2, nothing on disk lost.

The checks that need no TensorFlow run in a Python where importing TensorFlow fails, which proves
they run before it is loaded (and before any worker starts, for `launch`).
"""

import subprocess
import sys

import numpy as np
import pytest
from jobs import REPO

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
