"""Elastic training's pure pieces, in one process: data positions across a change of the worker
count, the learning rate's place in the schedule, and the state's commit and restore."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from hvd_train import comm, data
from hvd_train.core import checkpoint as ckpt
from hvd_train.core import config as config_lib
from hvd_train.core import scaling
from hvd_train.keras import compat
from hvd_train.keras.schedules import scaled_warmup_schedule
from hvd_train.keras.state import weights_digest
from hvd_train.training import elastic, setup, writers


def _ids_of_steps(source, batch, size, epoch, steps, start_position=0):
    """Sample ids every rank trains on in the first `steps` steps of `epoch`, per global step."""
    per_rank = []
    for rank in range(size):
        dataset, _ = data.train_dataset(
            source, batch, rank, size, seed=5, initial_epoch=epoch, start_position=start_position
        )
        per_rank.append([x[:, 0].astype(int) for x, _ in dataset.take(steps).as_numpy_iterator()])
    return [np.concatenate([ranks[s] for ranks in per_rank]) for s in range(steps)]


@pytest.fixture
def ids_source():
    n = 103
    ids = np.arange(n, dtype="float32")[:, None]  # a sample's feature is its id
    labels = np.zeros(n, "int32")
    return data.Arrays(ids, labels, ids[:3], labels[:3], num_classes=2)


def test_remaining_steps_counts_the_positions_left_in_samples():
    # 3 ranks x batch 4: an epoch of 8 steps ends at position 96.
    assert data.remaining_steps(8, 4, 3, 0) == 8
    assert data.remaining_steps(8, 4, 3, 36) == 5
    # Position 40 after 5 steps of 2 ranks: 56 positions left, 4 global batches of 12, 8 dropped.
    assert data.remaining_steps(8, 4, 3, 40) == 4
    assert data.remaining_steps(8, 4, 3, 96) == 0
    assert data.remaining_steps(8, 4, 3, 100) == 0
    with pytest.raises(ValueError, match="position >= 0"):
        data.remaining_steps(8, 4, 3, -1)


def test_an_epoch_continued_at_another_size_trains_each_sample_at_most_once(ids_source):
    batch, epoch = 4, 2
    before = _ids_of_steps(ids_source, batch, size=2, epoch=epoch, steps=5)  # positions [0, 40)
    steps_at_3 = (103 // 3) // batch
    left = data.remaining_steps(steps_at_3, batch, 3, 40)
    after = _ids_of_steps(ids_source, batch, 3, epoch, left, start_position=40)
    trained = np.concatenate(before + after)
    assert len(trained) == 40 + left * batch * 3 == 88
    assert len(set(trained.tolist())) == len(trained)  # no sample twice in the epoch
    # Exactly the permutation's positions [0, 88): what one rank would visit in that order.
    whole = data.shard_indices(103, 0, 1, epoch, seed=5)[:88]
    assert sorted(trained.tolist()) == sorted(whole.tolist())
    assert [len(s) for s in after] == [batch * 3] * left
    # The epoch after the partial one is a whole epoch again.
    dataset, steps = data.train_dataset(
        ids_source, batch, 0, 3, seed=5, initial_epoch=epoch, start_position=40
    )
    batches = list(dataset.take(left + steps).as_numpy_iterator())
    next_epoch = _ids_of_steps(ids_source, batch, 3, epoch + 1, steps)
    assert np.array_equal(batches[left][0][:, 0], next_epoch[0][:batch])


def test_a_position_with_no_global_batch_left_starts_with_the_next_epoch(ids_source):
    # 3 ranks x batch 4: 8 steps end at position 96, and 100 leaves less than one global batch.
    for position in (96, 100):
        assert data.remaining_steps(8, 4, 3, position) == 0
        dataset, steps = data.train_dataset(
            ids_source, 4, 1, 3, seed=5, initial_epoch=2, start_position=position
        )
        next_epoch = _ids_of_steps(ids_source, 4, 3, 3, 2)
        got = [x[:, 0] for x, _ in dataset.take(2).as_numpy_iterator()]
        assert steps == 8
        assert [g.tolist() for g in got] == [s[4:8].tolist() for s in next_epoch]


def test_start_position_zero_is_the_plain_dataset(ids_source):
    plain, steps = data.train_dataset(ids_source, 4, 1, 2, seed=5, initial_epoch=1)
    same, same_steps = data.train_dataset(
        ids_source, 4, 1, 2, seed=5, initial_epoch=1, start_position=0
    )
    assert steps == same_steps
    for (a, _), (b, _) in zip(plain.take(15), same.take(15), strict=True):
        assert np.array_equal(a, b)
    with pytest.raises(data.DataError, match="must be >= 0"):
        data.train_dataset(ids_source, 4, 1, 2, start_position=-4)


def test_learning_rate_after_a_reset_follows_the_epochs_and_the_new_global_batch():
    def rule(size, steps):  # base 0.05 at batch 32, 2 warmup epochs, cosine over 10
        return scaled_warmup_schedule(0.05, 32, 32 * size, steps, 2.0, 10, decay="cosine")

    # 2 ranks (22 steps per epoch) trained 1 epoch and 320 samples: 27 updates. Now 4 ranks, 11
    # steps per epoch: 1 + 320/1408 epochs in are 13.5 of their updates; warmup to 0.05 x 4.
    offset = elastic.schedule_offset(1, 320, 11, 128, 27)
    assert offset == 11 + 2.5 - 27
    rate = float(elastic.ShiftedSchedule(rule(4, 11), offset)(27))
    expected = scaling.learning_rate(13.5, 0.05, 0.2, 22, 110, "cosine")
    assert expected == pytest.approx(0.05 + 0.15 * 13.5 / 22)
    assert rate == pytest.approx(expected, rel=1e-6)
    assert elastic.schedule_offset(3, 640, 22, 64, 3 * 22 + 10) == 0  # no change of size
    restored = keras.optimizers.schedules.deserialize(
        keras.optimizers.schedules.serialize(elastic.ShiftedSchedule(rule(2, 22), 4.5))
    )
    assert restored.offset == 4.5 and restored.schedule.peak_lr == pytest.approx(0.1)


def test_state_restores_the_last_commit():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.optimizer.build(model.trainable_variables)
    state = elastic.TrainingState(model)
    state.progress = elastic.Progress(epoch=2, position=96)
    state.save()
    committed = [v.numpy().copy() for v in model.variables]
    model.fit(np.ones((8, 3)), np.ones((8, 2)), epochs=1, verbose=0)
    state.progress.position += 64
    assert model.optimizer.iterations.numpy() == 1
    state.restore()
    assert state.progress == elastic.Progress(epoch=2, position=96)
    assert model.optimizer.iterations.numpy() == 0
    for var, value in zip(model.variables, committed, strict=True):
        assert np.array_equal(var.numpy(), value)
    assert len(state._saved[0]) == len(model.variables) + len(
        compat.optimizer_variables(model.optimizer)
    )
    assert weights_digest(model.variables) == weights_digest(model.variables)


def test_an_epoch_whose_steps_all_came_before_a_reset_still_ends(tmp_path):
    """A reset after the epoch's last commit, at a size that leaves less than one global batch of
    it (more workers: shorter epochs in positions), still gives the epoch its end: validation,
    commit, metrics record, CSV row and checkpoint (the cluster's grow test once lost an epoch).

    In a fresh process: Horovod starts before TensorFlow's first op, which this one has run."""
    code = f"import test_elastic_state as t; t.end_of_an_epoch_left_empty({str(tmp_path)!r})"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "TF_CPP_MIN_LOG_LEVEL": "2"}
    job = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-4000:]


def end_of_an_epoch_left_empty(run_dir: str) -> None:
    """The test above, in its own process: one rank, one elastic stretch from the reset."""
    comm.init()
    tmp_path = Path(run_dir)
    config = config_lib.load(
        "configs/digits.yaml", ["train.epochs=3", f"run_dir={tmp_path}"], log_notes=False
    )
    source = data.load(config.data)
    model = setup.build_model(config, source.input_shape, source.num_classes)
    batch, global_batch = config_lib.resolved_batch_sizes(config, 1)
    steps = elastic._steps_per_epoch(source, config, batch, 0, 1)
    schedule = elastic._schedule(config, global_batch, steps, elastic.Progress(), 0)
    setup.compile_distributed(model, config, schedule)
    state = elastic.TrainingState(model)
    # Epoch 2's steps were all trained and committed before the reset; its end was not reached.
    state.progress = elastic.Progress(epoch=1, position=steps * global_batch)
    job = elastic._Job(config, tmp_path, source, model, history=[], started=time.monotonic())

    result = elastic._train(state, job)

    records = json.loads((tmp_path / "metrics.json").read_text())
    assert [r["epoch"] for r in records] == [2, 3]
    assert {"val_loss", "val_accuracy"} <= set(records[0]) and "loss" not in records[0]
    assert {"loss", "val_loss"} <= set(records[1])
    assert [sorted(r) for r in result.history] == [
        ["val_accuracy", "val_loss"],
        ["accuracy", "loss", "val_accuracy", "val_loss"],
    ]
    with (tmp_path / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2"]  # Keras's 0-based epochs
    assert rows[0]["loss"] == "NA" and float(rows[0]["val_loss"]) == pytest.approx(
        records[0]["val_loss"]
    )
    assert float(rows[1]["loss"]) == pytest.approx(records[1]["loss"])
    on_disk = [p.name for p in ckpt.epochs_on_disk(tmp_path / "checkpoints")]
    assert on_disk == ["epoch-0001", "epoch-0002"]  # 0-based, as every checkpoint
    events = [json.loads(line) for line in (tmp_path / elastic.EVENTS).read_text().splitlines()]
    ends = [(e["epoch"], e["position"]) for e in events if e["event"] == "commit"]
    assert ends[0] == (2, 0)  # committed at the epoch's end, before any step of epoch 3
    assert int(model.optimizer.iterations.numpy()) == steps  # epoch 3 alone was trained


def test_csv_rows_follow_the_header_of_the_file_they_append_to(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,accuracy,loss,val_accuracy,val_loss\n0,0.5,1.0,0.4,1.1\n")
    writer = writers.CsvMetrics(path)
    writer.on_train_begin()
    writer.on_epoch_end(1, {"val_loss": 0.9, "val_accuracy": 0.6})
    writer.on_train_end()
    rows = list(csv.DictReader(path.open(newline="")))
    assert rows[1] == {
        "epoch": "1",
        "accuracy": "NA",
        "loss": "NA",
        "val_accuracy": "0.6",
        "val_loss": "0.9",
    }
    # Keras's own rule would name the columns of the first row it writes: shifted against the
    # header above. A new file's header has each validation metric's training twin.
    new = tmp_path / "new.csv"
    writer = writers.CsvMetrics(new)
    writer.on_train_begin()
    writer.on_epoch_end(0, {"val_loss": 0.9})
    writer.on_train_end()
    assert new.read_text().splitlines()[0] == "epoch,loss,val_loss"
