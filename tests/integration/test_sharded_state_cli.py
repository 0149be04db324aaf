"""`optimizer.shard_state` from the command line: what is refused, in one line with exit code 2, and
`hvd-train train`'s checkpoints of the sharded state (the sharded optimizer itself:
tests/parallel/test_sharded_state.py).

A checkpoint holds the sharded optimizer's state whole (each shard gathered in rank order), so it
resumes at the same worker count bit for bit and at another one with each rank taking its piece
there. The jobs: the MLP on the digits with Adam (two slots per variable), 2 epochs of 5 steps.
"""

import shutil

import numpy as np
import pytest
from jobs import PYTHON, REPO, run, saved, train_job
from test_bad_input import assert_one_error, hvd_train

from hvd_train.core import checkpoint

CONFIG = str(REPO / "configs" / "digits.yaml")
TRAIN = [
    "train",
    "--config",
    CONFIG,
    *("--set", "model.name=mlp"),
    *("--set", "optimizer.name=adam"),
    *("--set", "optimizer.warmup_epochs=0"),
    *("--set", "train.epochs=2"),
    *("--set", "train.steps_per_epoch=5"),
    *("--set", "train.deterministic=true"),
    *("--set", "logging.tensorboard=false"),
]
SHARDED = ["--set", "optimizer.shard_state=true"]
# Sharded against unsharded after the same steps: equal within float32 rounding (the
# reduce-scatter sums in another order than the allreduce); the control below exceeds it.
ATOL = 1e-5


def test_elastic_with_shard_state_is_refused_before_tensorflow(tmp_path):
    args = ["train", "--elastic", "--set", "optimizer.shard_state=true"]
    result = hvd_train([*args, "--set", f"run_dir={tmp_path / 'run'}"])
    assert_one_error(result, "optimizer.shard_state: must be false with --elastic")


def train(np_, run_dir, *extra):
    return train_job(np_, TRAIN, run_dir, *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """At 2 workers: the sharded job straight through, the sharded job stopped after epoch 1,
    and the unsharded job stopped after epoch 1 (each run directory)."""
    root = tmp_path_factory.mktemp("sharded")
    train(2, root / "straight", *SHARDED)
    train(2, root / "stopped", *SHARDED, "--stop-after-epochs", "1")
    train(2, root / "plain", "--stop-after-epochs", "1")
    return root


def test_the_checkpoint_holds_every_shard_whole(runs):
    """Adam's two slots of each variable, and the copy of each weight's shard the update writes,
    as many elements each as the variable: what the unsharded optimizer holds, plus the copy."""
    sharded, plain = saved(runs / "stopped", 0), saved(runs / "plain", 0)
    slots = sorted(a.size for a in plain.optimizer if a.ndim)
    one_each = slots[::2]  # momentum and velocity: each size twice
    assert slots == sorted(one_each * 2)
    assert sorted(a.size for a in sharded.optimizer if a.ndim) == sorted(one_each * 3)
    for a, b in zip(sharded.model, plain.model, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_a_sharded_run_resumes_bit_exact_at_the_same_worker_count(runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "stopped", resumed)
    train(2, resumed, *SHARDED, "--resume")

    ours, straight = saved(resumed, 1), saved(runs / "straight", 1)
    for a, b in zip(ours.model + ours.optimizer, straight.model + straight.optimizer, strict=True):
        assert a.tobytes() == b.tobytes()


def resume_at_3(run_dir, source, *extra):
    shutil.copytree(source, run_dir)
    train(3, run_dir, "--resume", *extra)
    return saved(run_dir, 1).model


def test_a_sharded_checkpoint_resumes_at_another_worker_count(runs, tmp_path):
    """2 -> 3 workers: each rank takes its piece of the whole state (3 does not divide the
    variables' sizes evenly); the result equals the unsharded job resumed at 3 likewise."""
    ours = resume_at_3(tmp_path / "sharded", runs / "stopped", *SHARDED)
    reference = resume_at_3(tmp_path / "plain", runs / "plain")
    for a, b in zip(ours, reference, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    apart = max(float(np.abs(a - b).max()) for a, b in zip(ours, reference, strict=True))

    # The control: the same resume with the optimizer's state zeroed (what a checkpoint of rank
    # 0's shard alone, or of the scalars alone, would give) is far outside the tolerance.
    forgot = tmp_path / "forgot"
    shutil.copytree(runs / "stopped", forgot)
    shutil.rmtree(forgot / "checkpoints")
    state = saved(runs / "stopped", 0)
    zeroed = [np.zeros_like(a) if a.ndim else a for a in state.optimizer]
    checkpoint.write(forgot / "checkpoints", 0, state.model, zeroed, state.meta)
    train(3, forgot, "--resume", *SHARDED)
    pairs = zip(saved(forgot, 1).model, reference, strict=True)
    worst = max(float(np.abs(a - b).max()) for a, b in pairs)
    assert worst > 100 * ATOL, worst
    print(f"resumed at 3 from 2: sharded vs unsharded {apart:.2e}; state zeroed {worst:.2e}")


def test_an_unsharded_checkpoint_is_refused_by_a_sharded_resume(runs, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs / "plain", run_dir)
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", "2", "--", *TRAIN, *SHARDED]
    job = run([*argv, "--set", f"run_dir={run_dir}", "--resume"], timeout=300)

    assert job.returncode == 2, job.tail()
    assert "(written with optimizer.shard_state false)" in job.output, job.tail()
