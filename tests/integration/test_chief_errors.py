"""A write of rank 0's files that fails ends the job on every rank, naming the file.

Each job injects one failure with `HVD_TRAIN_FAIL_IN=SECTION[:N]` (`hvd_train.core.inject`): an
OSError at the real write point of that section, on rank 0. The job must end on every rank with
exit 74 within BOUND_S of the failure (the injection logs its unix time), print one line naming
the file, record `write_failed` in status.json, and keep every checkpoint written before.

The run: 2 epochs of 3 steps of the MLP on the digits, a step checkpoint after step 2 of each
epoch, metrics.csv and TensorBoard on; rank 0 writes, in order: the run record, TensorBoard's
graph (first step), epoch-0000-step-000002, at epoch 1's end epoch-0000, best, metrics.json,
metrics.csv, TensorBoard's summaries; the same in epoch 2; then metrics.png and status.json.

A slow write (`HVD_TRAIN_SLOW_IN=SECTION:SECONDS`) must instead be waited for: rank 0 is busy for
the watchdog inside each section, so a slow disk is not a stall.
"""

import errno
import json
import re
import time
from types import SimpleNamespace

import pytest
from jobs import FULL_ONLY, PYTHON, REPO, run

from hvd_train.core import checkpoint, faults, inject, launch
from hvd_train.core.outcome import EXIT_WRITE_FAILED
from hvd_train.errors import ConfigError

CONFIG = str(REPO / "configs" / "digits.yaml")
HVD_TRAIN = [PYTHON, "-m", "hvd_train.cli"]
TRAIN = [
    "train",
    "--config",
    CONFIG,
    "--set",
    "model.name=mlp",
    "--set",
    "train.epochs=2",
    "--set",
    "optimizer.warmup_epochs=1",
    "--set",
    "train.steps_per_epoch=3",
    "--set",
    "checkpoint.every_steps=2",
]
# Seconds from the failure to the end of the job on every rank (measured: 3-5 s, most of it the
# ranks' exit; the launcher's teardown of a rank left in a collective would not be needed).
BOUND_S = 30
NO_STEP_CHECKPOINTS = ["--set", "checkpoint.every_steps=0"]

E0S, E0, E1S, E1 = "epoch-0000-step-000002", "epoch-0000", "epoch-0001-step-000002", "epoch-0001"
# HVD_TRAIN_FAIL_IN, the file the error names (in run_dir), the checkpoints left, extra options.
CASES = {
    "run_record": ("launches.jsonl", set(), []),
    "tensorboard": ("tensorboard/train", {E0S}, []),  # a batch hook's error, reported at epoch end
    "step_checkpoint:2": (f"checkpoints/{E1S}", {E0S, E0, "best"}, []),
    "checkpoint:2": (f"checkpoints/{E1}", {E0, "best"}, NO_STEP_CHECKPOINTS),
    "best_checkpoint": ("checkpoints/best", {E0S, E0}, []),
    "metrics.json": ("metrics.json", {E0S, E0, "best"}, []),
    "metrics.csv": ("metrics.csv", {E0S, E0, "best"}, []),
    "metrics.png": ("metrics.png", {E0, E1S, E1, "best"}, []),  # keep_last 3 pruned E0S
    "status.json": ("status.json", {E0, E1S, E1, "best"}, []),
}


def failing_job(run_dir, fail_in, argv, env=None, timeout=120):
    """Run argv with the failure injected; the job and the seconds from the failure to its end."""
    job = run(argv, timeout=timeout, env={inject.ENV: fail_in, **(env or {})})
    ended = time.time()
    injected = re.search(r"failing the write of .* \(unix time ([0-9.]+)\)", job.output)
    assert injected, job.tail()
    return job, ended - float(injected.group(1))


def launch_train(launcher, run_dir, *extra):
    argv = [*HVD_TRAIN, "launch", "--np", "2", "--launcher", launcher, "--", *TRAIN]
    return [*argv, "--set", f"run_dir={run_dir}", *extra]


def checkpoints_left(run_dir):
    """The checkpoints on disk (each verifies against its manifest), by name."""
    found = checkpoint.epochs_on_disk(run_dir / "checkpoints")
    best = run_dir / "checkpoints" / "best"
    for path in [*found, *([best] if best.is_dir() else [])]:
        checkpoint.verify(path)
    return {p.name for p in found} | ({"best"} if best.is_dir() else set())


def failed_cleanly(launcher, run_dir, fail_in):
    """Run the job with the failure injected and check how it ended; its launch argv."""
    file, left, extra = CASES[fail_in]
    argv = launch_train(launcher, run_dir, *extra)
    job, took = failing_job(run_dir, fail_in, argv)

    # horovodrun exits 1 whatever its ranks return; hvd-train launch maps status.json's status.
    assert job.returncode == EXIT_WRITE_FAILED, job.tail()
    assert took < BOUND_S, f"{took:.1f}s from the failure to the job's end"
    line = f"hvd-train: error: writing {run_dir / file}: Input/output error (injected: "
    assert line in job.output, job.tail()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "write_failed" and str(run_dir / file) in status["message"]
    assert checkpoints_left(run_dir) == left
    print(f"{launcher} {fail_in}: exit {job.returncode} {took:.1f}s after the failure")
    return argv


@pytest.mark.parametrize(
    ("launcher", "fail_in"),
    # mpirun's checkpoint:2 is the resume test's; horovodrun (Gloo) in `make test-full`: CI's 90
    # minutes.
    [("mpirun", section) for section in CASES if section != "checkpoint:2"]
    + [pytest.param("horovodrun", s, marks=FULL_ONLY) for s in ("checkpoint:2", "tensorboard")],
)
def test_a_failed_write_ends_the_job_on_every_rank_naming_the_file(tmp_path, launcher, fail_in):
    failed_cleanly(launcher, tmp_path / "run", fail_in)


def each_rank_reports(argv):
    """argv under sh on every rank, which prints the rank's own exit code when it ends."""
    script = '"$@"; echo "rank ${OMPI_COMM_WORLD_RANK} exited with $?"'
    return ["sh", "-c", script, "sh", *argv]


# One of each kind of section: before fit(), a batch hook's error kept for the epoch's end, and
# a section inside an epoch (the epoch-end sections agree as the first's error does).
@pytest.mark.parametrize("fail_in", ["run_record", "tensorboard", "step_checkpoint:2"])
def test_every_rank_ends_by_itself(tmp_path, fail_in):
    """With mpirun told not to end the job when a rank fails, each rank must end by itself: a
    rank left waiting in a collective would hang the job."""
    run_dir = tmp_path / "run"
    file, _, extra = CASES[fail_in]
    train = [*HVD_TRAIN, *TRAIN, "--set", f"run_dir={run_dir}", *extra]
    argv = launch.build("mpirun", 2, each_rank_reports(train))
    keep_going = {"OMPI_MCA_orte_abort_on_non_zero_status": "0"}
    job, took = failing_job(run_dir, fail_in, argv, env=keep_going, timeout=90)

    for rank in range(2):
        assert f"rank {rank} exited with {EXIT_WRITE_FAILED}" in job.output, job.tail()
    assert took < BOUND_S, f"{took:.1f}s from the failure to the end of every rank"
    assert f"hvd-train: error: writing {run_dir / file}: " in job.output, job.tail()
    print(f"{fail_in}: every rank exited {EXIT_WRITE_FAILED}, {took:.1f}s after the failure")


def test_resume_after_a_failed_epoch_checkpoint_continues_from_the_one_before(tmp_path):
    run_dir = tmp_path / "run"
    argv = failed_cleanly("mpirun", run_dir, "checkpoint:2")

    resumed = run([*argv, "--resume"], timeout=120)
    assert resumed.returncode == 0, resumed.tail()
    assert "resuming after epoch 1 from" in resumed.output, resumed.tail()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    assert {E0, E1} <= checkpoints_left(run_dir)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("checkpoint", inject.Plan("checkpoint", 1)),
        ("metrics.csv:3", inject.Plan("metrics.csv", 3)),
    ],
)
def test_the_injection_variable_is_parsed(value, expected):
    assert inject.parse(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [("chekpoint", "unknown section 'chekpoint'"), ("checkpoint:0", "positive integer")],
)
def test_a_bad_injection_variable_names_the_problem(value, message):
    with pytest.raises(ConfigError, match=message):
        inject.parse(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("metrics.png:2.5", ("metrics.png", 2.5)),
        ("checkpoint:0", ("checkpoint", 0.0)),
    ],
)
def test_the_delay_variable_is_parsed(value, expected):
    assert inject.parse_slow(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("chekpoint:1", "unknown section 'chekpoint'"),
        ("checkpoint", "SECONDS in 'checkpoint' must be a number >= 0"),
        ("checkpoint:-1", "must be a number >= 0"),
        ("checkpoint:nan", "must be a number >= 0"),
    ],
)
def test_a_bad_delay_variable_names_the_problem(value, message):
    with pytest.raises(ConfigError, match=message):
        inject.parse_slow(value)


# The watchdog's floor, and a delay of rank 0's write well above it (the rule: no step for
# max(floor, 20 x the slowest recent step); the MLP's steps take milliseconds).
FAST_WATCHDOG = ["--set", "fault.stall_floor_s=2", "--set", "fault.heartbeat_s=0.2"]
DELAY_S = 6


# The checkpoint in CI; the other sections in `make test-full` (CI's 90 minutes).
@pytest.mark.parametrize(
    "section",
    [
        "checkpoint",
        *(pytest.param(s, marks=FULL_ONLY) for s in ["run_record", "metrics.json", "metrics.png"]),
    ],
)
def test_a_slow_write_of_rank_0_is_waited_for_not_a_stall(tmp_path, section):
    """A slow file server: each write of `section` takes DELAY_S longer on rank 0 while the other
    rank waits in its next collective. The job finishes; the unwatched control below shows the
    same wait is a stall where rank 0 is not marked busy."""
    run_dir = tmp_path / "run"
    argv = launch_train("mpirun", run_dir, *NO_STEP_CHECKPOINTS, *FAST_WATCHDOG)
    job = run(argv, timeout=180, env={inject.SLOW_ENV: f"{section}:{DELAY_S}"})

    assert job.returncode == 0, job.tail()
    assert f"{inject.SLOW_ENV}={section}:{DELAY_S}: delaying the write of" in job.output
    assert "watchdog on rank" not in job.output, job.tail()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("watched", [True, False])
def test_rank_0_is_busy_for_the_watchdog_inside_a_section(tmp_path, monkeypatch, watched):
    """Two real watchdogs in this process (one per rank, over UDP), rank 0's section 3 x the
    stall bound long: quiet when ChiefFiles has the watchdog; the control without it fires."""
    from hvd_train.training import chief

    alone = SimpleNamespace(is_chief=lambda: True, broadcast_object=lambda obj, name: obj)
    monkeypatch.setattr(chief, "comm", alone)
    rule = faults.StallRule(floor_s=0.5, factor=5, startup_s=30)
    sock0, contact = faults.open_socket(0, spans_hosts=False)
    sock1, _ = faults.open_socket(1, spans_hosts=False)
    stalls = []
    dogs = [faults.Watchdog(r, 2, s, contact, rule, 0.05, on_stall=stalls.append)
            for r, s in ((0, sock0), (1, sock1))]  # fmt: skip
    try:
        for dog in dogs:
            dog.phase("train"), dog.step_done(), dog.step_done()
        files = chief.ChiefFiles(tmp_path, dogs[0] if watched else None)
        files.write(tmp_path / "slow", lambda: time.sleep(1.5))
    finally:
        for dog in dogs:
            dog.close()
    if watched:
        assert stalls == []
    else:
        assert stalls and "no step finished for" in stalls[0], stalls


def test_a_batch_hooks_error_waits_for_the_epochs_end_and_stops_the_writers(tmp_path, monkeypatch):
    """ChiefWriters on a rank 0 alone (its broadcasts return what they send): no rank raises
    before the agreement, and no writer runs after the first error."""
    import keras

    from hvd_train.training import chief

    class Writer(keras.callbacks.Callback):
        def __init__(self, fail):
            super().__init__()
            self.fail, self.destination, self.calls = fail, tmp_path / "tensorboard", []

        def on_train_batch_end(self, batch, logs=None):
            self.calls.append(("batch", batch))
            if self.fail:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.destination))

        def on_epoch_end(self, epoch, logs=None):
            self.calls.append(("epoch", epoch))

    alone = SimpleNamespace(is_chief=lambda: True, broadcast_object=lambda obj, name: obj)
    monkeypatch.setattr(chief, "comm", alone)
    failing, later = Writer(fail=True), Writer(fail=False)
    writers = chief.ChiefWriters(chief.ChiefFiles(tmp_path), [failing, later])
    writers.on_train_begin()
    writers.on_train_batch_end(0)
    writers.on_train_batch_end(1)
    with pytest.raises(chief.ChiefWriteError) as raised:
        writers.on_epoch_end(0)

    assert str(raised.value) == f"writing {tmp_path / 'tensorboard'}: No space left on device"
    assert failing.calls == [("batch", 0)] and later.calls == []
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "write_failed" and status["message"] == str(raised.value)
