"""Dead, frozen, preempted and inconsistent workers, under real launchers.

Every job runs under `jobs.run` (a hard timeout, its own process group, leftovers fail the test).
A rank is signalled once the run has written its first checkpoint inside an epoch
(`checkpoint.every_steps`), so the fault lands mid-epoch, with work behind it to lose or keep.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from jobs import FULL_ONLY, PYTHON, REPO, rank_pid, result_of, run, wait_for

from hvd_train.core import checkpoint, launch
from hvd_train.core.outcome import EXIT_PREEMPTED, EXIT_RANK_FAILED

CONFIG = str(REPO / "configs" / "digits.yaml")
HVD_TRAIN = [PYTHON, "-m", "hvd_train.cli"]
# Small batches: 179 steps per epoch on 2 ranks (about 2 s), so a signal sent after the step-20
# checkpoint lands well inside the epoch even on a loaded machine.
TRAIN = [
    "train",
    "--config",
    CONFIG,
    "--set",
    "train.epochs=3",
    "--set",
    "train.per_rank_batch_size=4",
    "--set",
    "train.deterministic=true",
    "--set",
    "checkpoint.every_steps=20",
    "--set",
    "checkpoint.keep_last=40",
    "--set",
    "logging.tensorboard=false",
]
# Seconds from a rank's death or freeze to the job's exit that the README promises (fault.*
# below: a 4 s stall floor and 0.5 s heartbeats; MPI and horovodrun end the rest at once).
BOUND_S = 30


def first_step_checkpoint(run_dir):
    """The path of the first checkpoint inside epoch 2 (the fault then hits epoch 2)."""
    return lambda: next(iter((run_dir / "checkpoints").glob("epoch-0001-step-*")), None)


def signal_rank(run_dir, rank, signum):
    """A `during` action: wait for epoch 2's first step checkpoint, then signal one rank."""

    def act(proc, tag):
        wait_for(first_step_checkpoint(run_dir), 240, "a checkpoint inside epoch 2")
        pid = wait_for(lambda: rank_pid(tag, rank), 30, f"rank {rank}'s process")
        os.kill(pid, signum)
        return time.monotonic()

    return act


def signal_launcher(run_dir, signum):
    def act(proc, tag):
        wait_for(first_step_checkpoint(run_dir), 240, "a checkpoint inside epoch 2")
        proc.send_signal(signum)
        return time.monotonic()

    return act


def launch_train(launcher, run_dir, *extra, during=None, timeout=400):
    argv = [*HVD_TRAIN, "launch", "--np", "2", "--launcher", launcher, "--", *TRAIN]
    argv += ["--set", f"run_dir={run_dir}", *extra]
    return run(argv, timeout=timeout, during=during)


def all_verify(run_dir):
    for path in checkpoint.epochs_on_disk(run_dir / "checkpoints"):
        checkpoint.verify(path)


def same_state(a, b):
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        assert x.files == y.files
        for key in x.files:
            assert x[key].tobytes() == y[key].tobytes(), f"{key} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run the interrupted ones must equal, bit for bit."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job = launch_train("mpirun", run_dir)
    assert job.returncode == 0, job.tail()
    return run_dir


def test_sigterm_to_one_rank_stops_all_at_one_step_and_resumes_bit_exact(tmp_path, straight):
    run_dir = tmp_path / "run"
    job = launch_train("mpirun", run_dir, during=signal_rank(run_dir, 1, signal.SIGTERM))

    assert job.returncode == EXIT_PREEMPTED, job.tail()
    result = result_of(job)
    status = json.loads((run_dir / "status.json").read_text())
    stopped = result["stopped_at"]
    assert result["status"] == status["status"] == "preempted"
    assert status["signals"] == "SIGTERM on rank 1"
    steps = checkpoint.verify(run_dir / "checkpoints/epoch-0000")["steps_per_epoch"]
    assert stopped["epoch"] == 2 and 20 <= stopped["step"] < steps, (stopped, steps)
    assert stopped["checkpoint"].endswith(f"epoch-0001-step-{stopped['step']:06d}")
    all_verify(run_dir)

    resumed = launch_train("mpirun", run_dir, "--resume")
    assert resumed.returncode == 0, resumed.tail()
    assert f"resuming after step {stopped['step']} of epoch 2" in resumed.output
    assert result_of(resumed)["epochs_done"] == 3
    same_state(straight / "checkpoints/epoch-0002", run_dir / "checkpoints/epoch-0002")


# horovodrun (Gloo) in `make test-full`: CI's 90 minutes.
@pytest.mark.parametrize("launcher", ["mpirun", pytest.param("horovodrun", marks=FULL_ONLY)])
def test_sigterm_to_the_launcher_checkpoints_and_exits_75(tmp_path, launcher):
    run_dir = tmp_path / "run"
    job = launch_train(launcher, run_dir, during=signal_launcher(run_dir, signal.SIGTERM))

    assert job.returncode == EXIT_PREEMPTED, job.tail()
    status = json.loads((run_dir / "status.json").read_text())
    # hvd-train launch passes TERM to mpirun as USR1, which mpirun forwards at once (launch.py).
    got = {"mpirun": "SIGUSR1", "horovodrun": "SIGTERM"}[launcher]
    assert status["status"] == "preempted" and f"{got} on rank 0" in status["signals"]
    assert (run_dir / "checkpoints").joinpath(status["checkpoint"]).is_dir()
    all_verify(run_dir)
    print(f"{launcher}: stopped at epoch {status['epoch']} step {status['step']}")


def catches(pid, signum) -> bool:
    """Whether process `pid` has a handler of its own for `signum` (SigCgt in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)[1], 16)
    return bool(caught >> (signum - 1) & 1)


def test_a_stop_signal_while_tensorflow_loads_stops_after_the_first_step(tmp_path):
    """SLURM may send its warning up to a minute early, so also while the ranks start. Once
    TensorFlow's library is mapped into rank 1 (its import has begun, seconds before it ends),
    rank 1 already takes USR1 as a stop request, so the job stops after its first step with a
    checkpoint (the negative control: before the CLI installed the handler ahead of TensorFlow,
    it came seconds later, and USR1 in between ended the rank)."""
    run_dir = tmp_path / "run"

    def early(proc, tag):
        pid = wait_for(lambda: rank_pid(tag, 1), 60, "rank 1's process")
        mapped = lambda: "libtensorflow" in Path(f"/proc/{pid}/maps").read_text()  # noqa: E731
        wait_for(mapped, 60, "TensorFlow's library in rank 1")
        caught = catches(pid, signal.SIGUSR1)
        if caught:
            os.kill(pid, signal.SIGUSR1)
        return caught

    job = launch_train("mpirun", run_dir, during=early)

    assert job.during is True, "rank 1 had no USR1 handler while TensorFlow loaded"
    assert job.returncode == EXIT_PREEMPTED, job.tail()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "preempted" and status["signals"] == "SIGUSR1 on rank 1", status
    assert (status["epoch"], status["step"]) == (1, 1), status
    all_verify(run_dir)


def test_sigkill_of_one_rank_ends_the_job_and_resume_is_bit_exact(tmp_path, straight):
    run_dir = tmp_path / "run"
    job = launch_train("mpirun", run_dir, during=signal_rank(run_dir, 1, signal.SIGKILL))

    assert job.returncode != 0, job.tail()
    took = time.monotonic() - job.during
    assert took < BOUND_S, f"{took:.1f}s from the kill to the job's end"
    assert re.search(r"rank 1 .*exited on signal 9", job.output), job.tail()
    all_verify(run_dir)

    resumed = launch_train("mpirun", run_dir, "--resume")
    assert resumed.returncode == 0, resumed.tail()
    same_state(straight / "checkpoints/epoch-0002", run_dir / "checkpoints/epoch-0002")
    print(f"SIGKILL: job ended {took:.1f}s after the kill")


def test_sigkill_under_gloo_names_the_lost_rank(tmp_path):
    run_dir = tmp_path / "run"
    job = launch_train(
        "horovodrun", run_dir, "--set", "fault.heartbeat_s=0.5",
        during=signal_rank(run_dir, 1, signal.SIGKILL),
    )  # fmt: skip

    assert job.returncode == EXIT_RANK_FAILED, job.tail()  # horovodrun's 1, mapped by status.json
    took = time.monotonic() - job.during
    assert took < BOUND_S, f"{took:.1f}s from the kill to the job's end"
    line = next(x for x in job.output.splitlines() if "hvd-train: error: lost" in x)
    assert "lost rank 1 (no heartbeat for" in line, line
    assert json.loads((run_dir / "status.json").read_text())["status"] == "lost"
    all_verify(run_dir)
    print(f"SIGKILL under Gloo: job ended {took:.1f}s after the kill: {line}")


# horovodrun (Gloo) in `make test-full`: CI's 90 minutes.
@pytest.mark.parametrize("launcher", ["mpirun", pytest.param("horovodrun", marks=FULL_ONLY)])
def test_frozen_rank_is_named_and_the_job_aborts(tmp_path, launcher):
    run_dir = tmp_path / "run"
    fast = ["--set", "fault.stall_floor_s=4", "--set", "fault.heartbeat_s=0.5"]
    job = launch_train(launcher, run_dir, *fast, during=signal_rank(run_dir, 1, signal.SIGSTOP))

    assert job.returncode == EXIT_RANK_FAILED, job.tail()
    took = time.monotonic() - job.during
    assert took < BOUND_S, f"{took:.1f}s from the freeze to the job's end"
    line = next(x for x in job.output.splitlines() if "watchdog on rank 0" in x)
    assert "did not arrive: rank 1 (no heartbeat for" in line, line
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stalled"
    all_verify(run_dir)
    print(f"{launcher}: frozen rank 1 -> exit {job.returncode} after {took:.1f}s: {line}")


def test_a_rank_crashing_in_native_code_prints_its_python_stack_and_ends_the_job():
    program = (
        "import ctypes\n"
        "import tensorflow as tf\n"
        "from hvd_train import comm\n"
        "comm.init()\n"
        "def crash_in_native_code():\n"
        "    ctypes.string_at(0)  # reads address 0: SIGSEGV inside a C function\n"
        "if comm.rank() == 1:\n"
        "    crash_in_native_code()\n"
        "comm.allreduce(tf.constant(1.0), op=comm.Sum)  # rank 0 waits for the dead rank\n"
    )
    # No PYTHONFAULTHANDLER: the stack must come from comm.init() enabling faulthandler.
    argv = launch.build("mpirun", 2, [PYTHON, "-c", program])
    job = run(argv, timeout=120, env={"PYTHONFAULTHANDLER": ""})

    assert job.returncode != 0, job.tail()
    assert "Fatal Python error: Segmentation fault" in job.output, job.tail()
    assert 'File "<string>", line 6 in crash_in_native_code' in job.output, job.tail()
    print(f"a rank's SIGSEGV: job ended with exit {job.returncode} after {job.seconds:.1f}s")


# A builder whose model depends on the rank: the same config everywhere, another model on rank 1.
RANK_MODEL = """
import os
import models


@models.register("rank_dependent")
def build(input_shape, num_classes):
    \"\"\"One more hidden unit on rank 1.\"\"\"
    import keras

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    inputs = keras.Input(input_shape)
    hidden = keras.layers.Dense(8 + (rank == 1))(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(hidden))
"""

# What rank 1 gets that rank 0 does not: keys whose collectives (the watchdog's address, the
# data-cache vote) would otherwise run on one rank only, and a model of other shapes.
RANK1_DIFFERS = {
    "seed": (["--set", "train.seed=2"], "config"),
    "watchdog": (["--set", "fault.watchdog=false"], "config"),
    "data-cache": (["--set", "data.cache=false"], "config"),
    "model": ([], "model variable shapes"),
}


@pytest.mark.parametrize("what", RANK1_DIFFERS)
def test_ranks_started_with_different_configs_fail_naming_the_rank(tmp_path, what):
    run_dir = tmp_path / "run"
    model_file = tmp_path / "rank_models.py"
    model_file.write_text(RANK_MODEL)
    base = [*HVD_TRAIN, *TRAIN, "--set", f"run_dir={run_dir}"]
    if what == "model":
        base += ["--set", f"model.file={model_file}", "--set", "model.name=rank_dependent"]
    extra, item = RANK1_DIFFERS[what]
    # MPMD: two programs in one job, rank 1 started with another config.
    argv = launch.build("mpirun", 2, base)
    argv[argv.index("-np") + 1] = "1"
    argv += [":", "-np", "1", *base, *extra]
    job = run(argv, timeout=120)  # a hang in mismatched collectives fails here

    assert job.returncode == 2, job.tail()
    errors = [line for line in job.output.splitlines() if "hvd-train: error:" in line]
    assert len(errors) == 1, job.tail()  # rank 0's: every rank raised it, one shows it
    assert errors[0].startswith(f"hvd-train: error: rank(s) 1 differ from rank 0 in their {item} (")
    assert not (run_dir / "checkpoints").exists()
    print(f"rank 1 with another {what}: exit 2 after {job.seconds:.1f}s")
