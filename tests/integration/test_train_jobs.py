"""`hvd-train` jobs under real launchers: the default job, rank-0 files, resume, bit-exactness."""

import json
import re

import numpy as np
from jobs import PYTHON, REPO, result_of, run

from hvd_train.core import launch

CONFIG = str(REPO / "configs" / "digits.yaml")
HVD_TRAIN = [PYTHON, "-m", "hvd_train.cli"]


def test_default_job_reaches_097_on_two_workers(tmp_path):
    run_dir = tmp_path / "run"
    job = run(
        [
            *HVD_TRAIN,
            "launch",
            "--np",
            "2",
            "--",
            "train",
            "--config",
            CONFIG,
            "--set",
            f"run_dir={run_dir}",
        ],
        timeout=600,
    )
    assert job.returncode == 0, job.tail()
    result = result_of(job)
    records = json.loads((run_dir / "metrics.json").read_text())
    record = json.loads((run_dir / "run.json").read_text())
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    seconds = sum(r["seconds"] for r in records)

    assert result["workers"] == 2 and result["epochs_done"] == 12
    assert result["final"]["accuracy"] >= 0.97, result
    # The epoch line of the progress bar shows the global (reduced) metrics, as History does.
    assert f"val_accuracy: {records[-1]['val_accuracy']:.4f}" in job.output
    assert [r["epoch"] for r in records] == list(range(1, 13))
    assert checkpoints == ["best", "epoch-0009", "epoch-0010", "epoch-0011"]  # keep_last: 3
    assert record["size"] == 2 and record["controller"] == "mpi"
    assert record["config"]["train"]["per_rank_batch_size"] == 32
    assert set(record["versions"]) >= {"tensorflow", "keras", "horovod", "python"}
    assert (run_dir / "metrics.csv").read_text().count("\n") == 13
    assert any((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(
        f"default job: val_accuracy {result['final']['accuracy']:.4f}, {seconds:.1f}s of training"
    )


def per_rank_cwd(argv):
    """Run argv in <cwd>/rank<R>: every rank gets its own working directory (no shared files)."""
    return ["sh", "-c", 'cd "rank${HOROVOD_RANK:-$OMPI_COMM_WORLD_RANK}" && exec "$@"', "sh", *argv]


def test_only_rank_0_writes_and_resume_needs_no_shared_filesystem(tmp_path):
    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    train = [
        *HVD_TRAIN,
        "train",
        "--config",
        CONFIG,
        "--set",
        "run_dir=run",
        "--set",
        "train.epochs=3",
        "--set",
        "optimizer.warmup_epochs=1",
    ]
    argv = launch.build("horovodrun", 2, per_rank_cwd([*train, "--stop-after-epochs", "2"]))
    first = run(argv, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.tail()
    assert not any((tmp_path / "rank1").iterdir()), "rank 1 wrote files"
    epochs = sorted(p.name for p in (tmp_path / "rank0/run/checkpoints").glob("epoch-*"))
    assert epochs == ["epoch-0000", "epoch-0001"]

    argv = launch.build("horovodrun", 2, per_rank_cwd([*train, "--resume"]))
    second = run(argv, timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.tail()
    assert "resuming after epoch 2" in second.output
    assert result_of(second)["epochs_done"] == 3
    assert not any((tmp_path / "rank1").iterdir()), "rank 1 wrote files"
    launches = (tmp_path / "rank0/run/launches.jsonl").read_text().splitlines()
    assert [json.loads(line)["initial_epoch"] for line in launches] == [0, 2]
    records = json.loads((tmp_path / "rank0/run/metrics.json").read_text())
    assert [r["epoch"] for r in records] == [1, 2, 3]


def test_deterministic_resume_is_bit_exact_and_skips_a_corrupt_checkpoint(tmp_path):
    common = [
        "--config",
        CONFIG,
        "--set",
        "train.epochs=4",
        "--set",
        "train.deterministic=true",
        "--set",
        "checkpoint.keep_last=10",
        "--set",
        "logging.tensorboard=false",
    ]

    def train(run_dir, *extra):
        argv = launch.build(
            "mpirun", 2, [*HVD_TRAIN, "train", *common, "--set", f"run_dir={run_dir}", *extra]
        )
        job = run(argv, timeout=600)
        assert job.returncode == 0, job.tail()
        return job

    train(tmp_path / "straight")
    train(tmp_path / "resumed", "--stop-after-epochs", "2")
    newest = tmp_path / "resumed/checkpoints/epoch-0001/state.npz"
    newest.write_bytes(newest.read_bytes()[:1000])  # a crash mid-copy, say
    job = train(tmp_path / "resumed", "--resume")

    assert re.search(r"epoch-0001: state.npz is truncated \(1000 of \d+ bytes\)", job.output)
    assert "resuming after epoch 1" in job.output
    assert (tmp_path / "resumed/checkpoints/epoch-0001.corrupt-0").is_dir()
    with (
        np.load(tmp_path / "straight/checkpoints/epoch-0003/state.npz") as a,
        np.load(tmp_path / "resumed/checkpoints/epoch-0003/state.npz") as b,
    ):
        assert a.files == b.files
        for key in a.files:
            assert a[key].tobytes() == b[key].tobytes(), f"{key} differs"
