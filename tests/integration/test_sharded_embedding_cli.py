"""`hvd-train train` of a table split by rows (configs/clicks.yaml: the DLRM-style model on Zipf
click data): its checkpoints hold the table and its Adam slots whole in global row order, so a
run resumes bit for bit at the same worker count and at another one each rank takes its rows;
validation runs as many batches on every rank (the lookup is a collective). The layer itself:
tests/parallel/test_sharded_embedding.py.

The jobs: 5,000 rows, 2 epochs of 5 steps, a global batch of 96 at every worker count, so that
runs at 1, 2 and 3 workers see the same batches. 386 validation samples: at 3 workers the parts
hold 129, 129 and 128, which plain batches of 32 split into 5, 5 and 4.
"""

import shutil

import numpy as np
import pytest
from jobs import FULL_ONLY, PYTHON, REPO, result_of, run, saved, train_job
from test_bad_input import assert_one_error, hvd_train

from hvd_train.core import checkpoint
from hvd_train.keras import compat, embedding

pytestmark = pytest.mark.skipif(compat.CLASSIC, reason="ShardedEmbedding: the modern stack only")

ROWS, DIM = 5000, 16
TRAIN = [
    "train",
    "--config",
    str(REPO / "configs" / "clicks.yaml"),
    *("--set", f"data.vocab_size={ROWS}"),
    *("--set", "data.num_samples=3860"),
    *("--set", f"model.params.dim={DIM}"),
    *("--set", "optimizer.warmup_epochs=0"),
    *("--set", "train.epochs=2"),
    *("--set", "train.steps_per_epoch=5"),
    *("--set", "train.per_rank_batch_size=null"),
    *("--set", "train.global_batch_size=96"),
    *("--set", "train.deterministic=true"),
    *("--set", "logging.tensorboard=false"),
]
DENSE = ["--set", "model.params.sharded=false"]  # Keras's Embedding, data parallel
# Split against whole after the same steps: equal within float32 rounding (sums in another
# order); the controls below exceed it.
ATOL = 1e-5


def train(np_, run_dir, *extra):
    return train_job(np_, TRAIN, run_dir, *extra)


def table_of(state):
    [table] = [a for a in state.model if a.shape == (ROWS, DIM)]
    return table


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The split job at 2 workers straight through and stopped after epoch 1, and at 1 worker
    stopped after epoch 1 (each run directory)."""
    root = tmp_path_factory.mktemp("split")
    train(2, root / "straight")
    train(2, root / "stopped", "--stop-after-epochs", "1")
    train(1, root / "one", "--stop-after-epochs", "1")
    return root


def test_the_checkpoint_holds_the_table_and_its_slots_whole_as_one_process_does(runs):
    split, one = saved(runs / "stopped", 0), saved(runs / "one", 0)
    assert [a.shape for a in split.model] == [a.shape for a in one.model]
    assert sum(a.shape == (ROWS, DIM) for a in split.optimizer) == 2  # Adam's two slots
    assert split.meta["model_variables"] == one.meta["model_variables"]
    # The optimizer's scalars aside: its count of allreduces is 0 at one worker.
    for a, b in zip(split.model + split.optimizer, one.model + one.optimizer, strict=True):
        if a.ndim:
            np.testing.assert_allclose(a, b, atol=ATOL)
    # The control: 5 steps moved the table far beyond the tolerance from where it started.
    assert split.meta["step"] == 5
    whole = embedding.RowShards(ROWS, 1, 0)
    start = np.asarray(embedding._RowInitializer(0, 0.05, whole)((ROWS, DIM)))
    moved = float(np.abs(table_of(split) - start).max())
    assert moved > 100 * ATOL, moved


def test_a_split_run_resumes_bit_exact_at_the_same_worker_count(runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "stopped", resumed)
    train(2, resumed, "--resume")

    ours, straight = saved(resumed, 1), saved(runs / "straight", 1)
    for a, b in zip(ours.model + ours.optimizer, straight.model + straight.optimizer, strict=True):
        assert a.tobytes() == b.tobytes()


def resume_at_3(run_dir, source, *extra):
    shutil.copytree(source, run_dir)
    result = train(3, run_dir, "--resume", *extra)
    return saved(run_dir, 1), result


@FULL_ONLY  # CI's 90 minutes: test_sharded_state_cli resumes at another worker count
def test_a_split_checkpoint_resumes_at_another_worker_count(runs, tmp_path):
    """2 -> 3 workers, each taking its rows (3 does not divide 5,000); the result equals the
    data-parallel model (Keras's Embedding, whole on every rank) resumed at 3 from the same
    checkpoint, the validation ran (5 batches on every rank) and was reduced exactly."""
    ours, result = resume_at_3(tmp_path / "split", runs / "stopped")
    reference, dense_result = resume_at_3(tmp_path / "dense", runs / "stopped", *DENSE)
    pairs = list(
        zip(ours.model + ours.optimizer, reference.model + reference.optimizer, strict=True)
    )
    for a, b in pairs:
        np.testing.assert_allclose(a, b, atol=ATOL)
    apart = max(float(np.abs(a - b).max()) for a, b in pairs)
    assert result["final"]["accuracy"] == pytest.approx(dense_result["final"]["accuracy"], abs=1e-6)

    # The control: the table put back in rank order (rank 0's rows, then rank 1's: the shards
    # concatenated, not interleaved) is far outside the tolerance.
    shuffled = tmp_path / "shuffled"
    shutil.copytree(runs / "stopped", shuffled)
    shutil.rmtree(shuffled / "checkpoints")
    state = saved(runs / "stopped", 0)

    def rank_order(a):
        return np.concatenate([a[0::2], a[1::2]]) if a.shape == (ROWS, DIM) else a

    checkpoint.write(
        shuffled / "checkpoints",
        0,
        [rank_order(a) for a in state.model],
        [rank_order(a) for a in state.optimizer],
        state.meta,
    )
    train(3, shuffled, "--resume")
    worst = float(np.abs(table_of(saved(shuffled, 1)) - table_of(reference)).max())
    assert worst > 100 * ATOL, worst
    print(
        f"resumed at 3 from 2: split vs data parallel {apart:.2e}; rows in rank order {worst:.2e}"
    )


def test_the_shipped_click_job_learns_on_two_workers(tmp_path):
    """configs/clicks.yaml for 2 epochs: 200,000 rows split over 2 workers (chance is 0.5;
    measured 0.80)."""
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", "2", "--", "train", "--config"]
    argv += [str(REPO / "configs" / "clicks.yaml"), "--set", "train.epochs=2"]
    job = run([*argv, "--set", f"run_dir={tmp_path / 'run'}"], timeout=300)
    assert job.returncode == 0, job.tail()
    assert result_of(job)["final"]["accuracy"] > 0.75


def test_elastic_with_a_split_table_is_refused(tmp_path):
    per_rank = ["--set", "train.global_batch_size=null", "--set", "train.per_rank_batch_size=32"]
    args = [*TRAIN, *per_rank, "--elastic", "--set", f"run_dir={tmp_path / 'run'}"]
    assert_one_error(hvd_train(args, tf_allowed=True), "--elastic: model 'dlrm' splits a table")


def test_a_table_smaller_than_the_data_ids_is_refused(tmp_path):
    args = [*TRAIN, "--set", f"model.params.rows={ROWS - 1}", "--set", f"run_dir={tmp_path}/r"]
    expected = f"model.params.rows: {ROWS - 1} does not fit the clicks data"
    assert_one_error(hvd_train(args, tf_allowed=True), expected)


def test_shard_state_with_a_split_table_is_refused(tmp_path):
    args = [*TRAIN, "--set", "optimizer.shard_state=true", "--set", f"run_dir={tmp_path}/r"]
    expected = "optimizer.shard_state: model 'dlrm' splits a table by rows (ShardedEmbedding)"
    assert_one_error(hvd_train(args, tf_allowed=True), expected)


@FULL_ONLY  # CI's 90 minutes: tests/parallel checks model groups (at np=2: groups of one)
def test_model_groups_of_two_at_four_workers_equal_the_table_split_over_two(runs, tmp_path):
    """parallel.model_group_size=2 at 4 workers: two groups, each holding the table split over
    its 2 ranks, data parallel across the groups; after the same 10 steps on the same global
    batches the checkpoint (the table gathered in group 0, its Adam slots) equals the 2-worker
    run's, whose one group is both ranks."""
    train(4, tmp_path / "groups", "--set", "parallel.model_group_size=2")
    ours, theirs = saved(tmp_path / "groups", 1), saved(runs / "straight", 1)
    pairs = list(zip(ours.model + ours.optimizer, theirs.model + theirs.optimizer, strict=True))
    for a, b in pairs:
        if a.ndim:
            np.testing.assert_allclose(a, b, atol=ATOL)
    assert ours.meta["config"]["parallel"]["model_group_size"] == 2
    # The control: 10 steps moved the table far beyond the tolerance from where it started.
    start = embedding._RowInitializer(0, 0.05, embedding.RowShards(ROWS, 1, 0))((ROWS, DIM))
    assert float(np.abs(table_of(ours) - np.asarray(start)).max()) > 100 * ATOL


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            ["--set", "parallel.model_group_size=3"],
            "parallel.model_group_size: must divide the worker count (1: groups hold as many "
            "ranks), got 3",
        ),
        (
            [
                *("--config", str(REPO / "configs" / "digits.yaml")),
                *("--set", "train.epochs=3", "--set", "parallel.model_group_size=1"),
            ],
            "parallel.model_group_size: model 'cnn' has no table to split over a model group",
        ),
    ],
    ids=["not-a-divisor", "no-table"],
)
def test_model_groups_that_cannot_be_made_are_refused(tmp_path, extra, expected):
    args = [*(TRAIN if "--config" not in extra else ["train"]), *extra]
    args += ["--set", f"run_dir={tmp_path}/r"]
    assert_one_error(hvd_train(args, tf_allowed=True), expected)
