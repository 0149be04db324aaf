"""Smoke test of the large-batch benchmark (benchmarks/large_batch.py, docs/large-batch.md): one
small point end to end (JSON and PNG), and the same kind of run as a real 2-worker job (LARS,
polynomial decay, mnist_5k, local accumulation) through `hvd-train launch`. Accuracy is checked
only against chance (0.1): these are a few updates, not the benchmark's figures."""

import json

from jobs import PYTHON, REPO, result_of, run

from hvd_train.core import config


def test_one_point_writes_the_json_and_the_figure(tmp_path):
    argv = [PYTHON, "-m", "benchmarks.large_batch", "--tasks", "mnist_5k", "--recipes", "lars"]
    argv += [
        "--batches",
        "256",
        "--seeds",
        "1",
        "--epochs",
        "2",
        "--jobs",
        "1",
        "--out",
        str(tmp_path),
    ]
    job = run(argv, timeout=300)
    assert job.returncode == 0, job.tail()
    result = json.loads((tmp_path / "large-batch.json").read_text())
    (row,) = result["rows"]
    (summary,) = result["summary"]

    assert (row["task"], row["recipe"], row["global_batch"]) == ("mnist_5k", "lars", 256)
    # 4,500 training images: 17 updates of 256 per epoch; 2 workers x 128 stand for it.
    assert (row["updates"], row["per_rank_batch_size"], row["backward_passes_per_step"]) == (
        34,
        128,
        1,
    )
    assert row["val_accuracy"] > 0.3, row
    assert summary["mean"] == round(row["val_accuracy"], 4) and summary["seeds"] == 1
    assert (tmp_path / "large-batch.png").stat().st_size > 10_000


def test_lars_trains_on_two_workers_with_accumulation(tmp_path):
    run_dir = tmp_path / "run"
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", "2", "--", "train"]
    for setting in [
        f"run_dir={run_dir}",
        "data.source=mnist_5k",
        "optimizer.name=lars",
        "optimizer.base_lr=0.1",
        "optimizer.lr_rule=sqrt",
        "optimizer.trust_coefficient=0.02",
        "optimizer.weight_decay=0.0001",
        "optimizer.decay=polynomial",
        "optimizer.warmup_epochs=0.5",
        "optimizer.backward_passes_per_step=2",
        "train.epochs=1",
        "train.global_batch_size=256",
        "logging.tensorboard=false",
    ]:
        argv += ["--set", setting]
    job = run(argv, timeout=300, cwd=REPO)
    assert job.returncode == 0, job.tail()
    result = result_of(job)
    saved = config.load(run_dir / "config.yaml").optimizer

    assert result["workers"] == 2 and result["epochs_done"] == 1
    assert result["final"]["accuracy"] > 0.3, result
    assert (saved.name, saved.decay, saved.backward_passes_per_step) == ("lars", "polynomial", 2)
