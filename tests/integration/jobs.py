"""Running real multi-process jobs from pytest: bounded in time, and leaving nothing behind.

Each job runs through `hvd_train.core.processes` in its own session (process group) and carries a
unique tag in its environment, which launchers pass on to every rank. On timeout the group is
killed, and any process still carrying the tag (a rank that escaped the group, e.g. under
horovodrun's own process management) is killed too; a tagged process alive after the job fails
the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from hvd_train.core import processes

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TAG_NAME = "HVD_TRAIN_TEST_TAG"
# `make test-full` (HVD_TRAIN_FULL=1): what CI's 90 minutes leave out, mostly the same check under
# further launchers, placements and faults (docs/testing.md lists them).
FULL = os.environ.get("HVD_TRAIN_FULL") == "1"
FULL_ONLY = pytest.mark.skipif(not FULL, reason="make test-full only (HVD_TRAIN_FULL=1)")


@dataclass
class Job:
    argv: list[str]
    returncode: int
    output: str
    seconds: float
    during: object = None  # what run(during=...) returned or raised

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def tagged_pids(tag: str) -> list[int]:
    """PIDs of live processes whose environment holds TAG_NAME=tag."""
    needle = f"{TAG_NAME}={tag}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def rank_pid(tag: str, rank: int) -> int | None:
    """PID of the `hvd-train train` process of `rank` in the job tagged `tag` (mpirun or
    horovodrun), or None while it has not started."""
    wanted = {f"OMPI_COMM_WORLD_RANK={rank}".encode(), f"HOROVOD_RANK={rank}".encode()}
    for pid in tagged_pids(tag):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"hvd_train.cli" in cmdline and b"train" in cmdline and environ & wanted:
            return pid
    return None


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> object:
    """Poll `condition` until it returns something true; its value.

    Raises:
      AssertionError: `what` did not happen within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run(
    argv: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    during: Callable[[subprocess.Popen, str], object] | None = None,
) -> Job:
    """Run a job to completion or `timeout` seconds.

    Args:
      during: called in a thread while the job runs, with the launcher's process and the job's
        tag (to signal ranks: `rank_pid`); what it returns or raises is in `Job.during`.

    Raises:
      AssertionError: the job timed out, or processes of it outlived it (both are killed first).
    """
    tag = uuid.uuid4().hex
    done = processes.run(
        argv,
        processes.child_env({TAG_NAME: tag, **(env or {})}),
        timeout,
        cwd=cwd,
        during=None if during is None else lambda proc: during(proc, tag),
        # A rank that escaped the group (horovodrun's own process management) goes too.
        on_timeout=lambda: _kill(tagged_pids(tag)),
    )
    job = Job(argv, done.returncode, done.output, done.seconds, done.during)
    # Ranks exit shortly after their launcher; anything tagged still alive after that is a leak.
    deadline = time.monotonic() + 15
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    _kill(left)
    assert not done.timed_out, f"job timed out after {timeout:.0f}s: {argv}\n{job.tail()}"
    assert not left, f"job left {len(left)} process(es) behind (killed): {argv}\n{job.tail()}"
    return job


def result_of(job: Job) -> dict:
    """Rank 0's `hvd-train train` result line (horovodrun prefixes it with "[0]<stdout>:")."""
    found = re.findall(r"^(?:\[0\]<stdout>:)?result (\{.*\})$", job.output, re.MULTILINE)
    assert len(found) == 1, job.tail()
    return json.loads(found[0])


def train_job(np_: int, train_args: list[str], run_dir: Path, *extra: str) -> dict:
    """`hvd-train launch --np np_ -- <train_args> --set run_dir=run_dir <extra>`, which must
    succeed within 300 s; its result line."""
    argv = [PYTHON, "-m", "hvd_train.cli", "launch", "--np", str(np_), "--", *train_args]
    job = run([*argv, "--set", f"run_dir={run_dir}", *extra], timeout=300)
    assert job.returncode == 0, job.tail()
    return result_of(job)


def saved(run_dir: Path, epoch: int):
    """The checkpoint of `epoch` in a run directory."""
    from hvd_train.core import checkpoint

    return checkpoint.load(run_dir / "checkpoints" / checkpoint.epoch_dir_name(epoch))
