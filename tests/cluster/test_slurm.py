"""SLURM on the cluster (mpi_scripts/cluster/slurm.sh): mpi_scripts/slurm.sbatch across h1 and h2
under `srun --mpi=pmix`, its two stop signals and the requeue that resumes mid-epoch, and mpirun
inside an allocation. Every job is bounded and ends with nothing of it left on any host.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import jobs  # tests/integration/jobs.py: bounded jobs that leave nothing behind
import pytest
from hosts import Cluster

SBATCH = "mpi_scripts/slurm.sbatch"
# Two nodes of one CPU each (the hosts' CPUs), one rank per node; h1 and h2 of the session's hosts.
NODES = ["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", "--nodelist=h1,h2"]
# No warmup: it must be shorter than a run of few epochs.
FEW_EPOCHS = ["--set", "optimizer.warmup_epochs=0"]
# Batches of 2: 359 steps per epoch on 2 ranks (1438 training samples), 1.3 to 3 s an epoch here,
# so that a stop lands inside an epoch (not on its last step) all but once in 359.
STEPS = 359
SMALL_BATCHES = ["--set", "train.per_rank_batch_size=2"]
# Rank 0's report of a stop, and of the resume.
STOPPED = re.compile(
    r"(SIG\w+ on rank \d+(?:, SIG\w+ on rank \d+)*): stopped after step (\d+) of epoch (\d+) on"
    r" every rank; checkpoint (\S+); resume with --resume$",
    re.M,
)
RESUMED = re.compile(r"resuming after step (\d+) of epoch (\d+) from (\S+)$", re.M)
RESULT = re.compile(r"^result (\{.*\})$", re.M)


@pytest.fixture(scope="module")
def slurm(cluster: Cluster) -> Cluster:
    """The session's cluster, with SLURM up (`cluster.sh up` starts it where it is installed)."""
    if not (cluster.state / "slurm" / "slurm.conf").exists():
        reason = "SLURM is not up on the cluster: run mpi_scripts/cluster/install.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return cluster


def client_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    """This environment with the cluster's (SLURM_CONF, the venv on PATH): sbatch passes it all
    on to the job."""
    return {**os.environ, **cluster.env(), **extra}


def command(cluster: Cluster, *argv: str, timeout: float = 30, **extra: str) -> str:
    """stdout of a SLURM client command run in the root namespace (as from a login node), with
    `extra` in its environment."""
    env = client_env(cluster, **extra)
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=jobs.REPO
    )
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def job_info(cluster: Cluster, job: str) -> dict[str, str]:
    """`scontrol show job` as a dict; {} once the job's record is gone (MinJobAge)."""
    done = subprocess.run(
        ["scontrol", "-o", "show", "job", job],
        env=client_env(cluster),
        capture_output=True,
        text=True,
        timeout=30,
    )
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}


def logs(cluster: Cluster, output: Path | None = None, lines: int = 40) -> str:
    """The job's output and the SLURM daemons' logs, last lines of each: for failure messages."""
    slurm_dir = cluster.state / "slurm"
    paths = [output] if output else []
    paths += [slurm_dir / "slurmctld.log", *sorted(slurm_dir.glob("h*/slurmd.log"))]
    shown = []
    for path in paths:
        text = path.read_text(errors="replace") if path.exists() else "(none)"
        shown.append(f"--- {path}\n" + "\n".join(text.splitlines()[-lines:]))
    return "\n".join(shown)


def ranks_running(cluster: Cluster) -> set[tuple[str, int]]:
    """(host, rank) of every `hvd-train train` process now running on a host of the cluster, as
    the host's network namespace holds it (srun's SLURM_PROCID, mpirun's OMPI_COMM_WORLD_RANK)."""
    found = set()
    for host in cluster.hosts:
        pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError):
                continue
            is_train = any(a.endswith((b"hvd-train", b"hvd_train.cli")) for a in argv)
            if not is_train or b"train" not in argv:
                continue
            env = dict(e.split(b"=", 1) for e in environ if b"=" in e)
            rank = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"SLURM_PROCID"))
            if rank is not None:
                found.add((host, int(rank)))
    return found


def assert_nothing_left(cluster: Cluster) -> None:
    """Within 15 s of a job's end, each host runs its daemons alone (no rank, no slurmstepd)."""
    deadline = time.monotonic() + 15
    while True:
        left = {}
        for host in cluster.hosts:
            extra = cluster.pids(host) - cluster.daemons[host]
            if extra:
                left[host] = sorted(extra)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    described = {
        host: [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80] for pid in pids]
        for host, pids in left.items()
    }
    assert not left, f"left running after the job: {described}"


@contextmanager
def submitted(
    cluster: Cluster, name: str, options: list[str], args: list[str], **extra: str
) -> Iterator[dict]:
    """sbatch mpi_scripts/slurm.sbatch with `options` (before the script), `args` (to `hvd-train
    train`) and `extra` in its environment, run_dir and output in the shared run area; the job
    is cancelled at the end if it is still there, and must leave nothing behind."""
    area = cluster.state / "shared" / name
    area.mkdir(parents=True)
    output = area / "job.out"
    job = command(
        cluster,
        "sbatch",
        "--parsable",
        f"--job-name={name}",
        f"--output={output}",
        *options,
        SBATCH,  # CONFIG: configs/digits.yaml, the default job
        *args,
        "--set",
        f"run_dir={area}/run",
        **extra,
    ).strip()
    passed = False
    try:
        yield {"job": job, "output": output, "run_dir": area / "run", "submitted": time.monotonic()}
        passed = True
    finally:
        subprocess.run(["scancel", job], env=client_env(cluster), capture_output=True, timeout=30)
        jobs.wait_for(
            lambda: job_info(cluster, job).get("JobState") not in ("RUNNING", "COMPLETING"),
            60,
            f"job {job} to end after scancel",
        )
        if passed:  # else the test's own failure says more
            assert_nothing_left(cluster)


def wait_job(
    cluster: Cluster,
    run: dict,
    done: Callable[[dict[str, str]], bool],
    timeout: float,
    what: str,
    seen: set | None = None,
) -> dict[str, str]:
    """Poll the job until `done(info)`; the ranks seen running meanwhile are added to `seen`.

    Raises:
      AssertionError: not within `timeout` seconds, with the job's output and SLURM's logs.
    """
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(cluster, run["job"])
        if done(info):
            return info
        if seen is not None:
            seen |= ranks_running(cluster)
        time.sleep(0.2)
    raise AssertionError(
        f"job {run['job']}: timed out after {timeout:.0f}s waiting for {what}; last "
        f"{ {k: info.get(k) for k in ('JobState', 'Reason', 'Restarts', 'ExitCode')} }\n"
        + logs(cluster, run["output"])
    )


def finished(info: dict[str, str]) -> bool:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    return not info or info.get("JobState") in ended


def requeued(info: dict[str, str]) -> bool:
    """Requeued and started again, or waiting to; or ended (the caller's checks say how)."""
    restarted = int(info.get("Restarts", "0")) >= 1
    return finished(info) or (restarted and info.get("JobState") in ("PENDING", "RUNNING"))


def job_output(run: dict) -> str:
    """The job's output file. A task that srun ends while it writes (--kill-on-bad-exit) can leave
    a multi-byte character of Keras's progress bar torn: read it as text all the same."""
    return run["output"].read_text(errors="replace")


def results(run: dict) -> list[dict]:
    return [json.loads(line) for line in RESULT.findall(job_output(run))]


def test_sbatch_trains_the_default_job_across_both_nodes(slurm: Cluster):
    seen: set[tuple[str, int]] = set()
    args = ["--set", "train.epochs=2", *FEW_EPOCHS]
    with submitted(slurm, "sbatch-2x1", NODES, args) as run:
        info = wait_job(slurm, run, finished, 240, "the job to end", seen)
        seconds = time.monotonic() - run["submitted"]
        out = job_output(run)
        failure = logs(slurm, run["output"])
        assert info.get("JobState") == "COMPLETED" and info["ExitCode"] == "0:0", failure
        assert info["NodeList"] == "h[1-2]" and info["BatchHost"] == "h1", info
        assert "--mpi=pmix" in out  # the srun command, as the launcher printed it
        (result,) = results(run)
        assert result["workers"] == 2 and result["status"] == "finished", failure
        record = json.loads((run["run_dir"] / "run.json").read_text())
        assert record["size"] == 2
        # srun gave the ranks no link rate: one rank fills each one-CPU node, so they measured it.
        probed = re.fullmatch(
            r"measured at start: the slowest of 2 link\(s\): h[12] -> h[12]",
            record["link_gbit_from"],
        )
        assert probed and record["link_gbit"] > 0, record
        # One rank per node: rank 0 on h1 (the batch host), rank 1 on h2.
        assert seen == {("h1", 0), ("h2", 1)}, (seen, failure)
    print(f"sbatch -N 2: {seconds:.1f} s submitted to done, training {result['seconds']} s")


def stop_and_resume(run: dict, stopped_by: str) -> tuple[int, int]:
    """Checks of a job stopped once (by `stopped_by`, e.g. SIGUSR1) and requeued: both starts'
    output, the stop at one step on every rank with its checkpoint (exit 75), the rerun resuming
    at that step and finishing; (epoch, step) of the stop.

    srun's --kill-on-bad-exit=1 (hvd_train.core.launch) takes the first rank's exit 75 for a
    failure and ends the others as they exit too: one rank's 75 is certain, the step's code (75 or
    143) and rank 0's result line of the stopped run are not.
    """
    out = job_output(run)
    job = run["job"]
    assert f"slurm.sbatch: job {job} start 1 on h[1-2]" in out
    assert f"slurm.sbatch: job {job} start 2 on h[1-2]" in out  # SLURM_RESTART_COUNT=1
    assert "slurm.sbatch: USR1: asking the ranks to stop" in out
    assert re.search(rf"the ranks exited (75|143)\b.*: requeueing job {job}$", out, re.M)
    assert re.search(r"^srun: error: h[12]: task [01]: Exited with exit code 75$", out, re.M)
    ((signals, step, epoch, checkpoint),) = STOPPED.findall(out)
    assert signals == f"{stopped_by} on rank 0, {stopped_by} on rank 1"  # srun told every rank
    assert Path(checkpoint).name == f"epoch-{int(epoch) - 1:04d}-step-{int(step):06d}"
    ((resumed_step, resumed_epoch, resumed_from),) = RESUMED.findall(out)
    assert (resumed_step, resumed_epoch, resumed_from) == (step, epoch, checkpoint)
    *stopped, last = results(run)
    assert all(r["status"] == "preempted" and r["stopped_at"]["step"] == int(step) for r in stopped)
    assert last["status"] == "finished" and last["workers"] == 2
    launches = (run["run_dir"] / "launches.jsonl").read_text().splitlines()
    assert [json.loads(line)["initial_epoch"] for line in launches] == [0, int(epoch) - 1]
    assert json.loads((run["run_dir"] / "run.json").read_text())["size"] == 2
    return int(epoch), int(step)


# The time-limit job's epochs: still training when USR1 comes, at slurmctld's first time-limit check
# after the start (every 30 s), at 1.3 s an epoch (41 s with the start); fewer for the rerun.
EPOCHS = 25


def rerun_bound(run: dict, first: float, epochs: int) -> float:
    """Seconds the rerun may take: twice the rate of the first start (its `first` seconds, startup
    included, over the epochs it finished) for the epochs left, and a minute to start; at most
    10 minutes, where a stop in the first epoch makes that rate a guess. A fixed bound of 240 s
    failed CI, whose epochs took 4 s against 1.3 to 3 here."""
    found = STOPPED.findall(job_output(run))
    assert found, f"no stop reported before the requeue\n{job_output(run)[-3000:]}"
    _, step, epoch, _ = found[0]
    done = int(epoch) - 1 + int(step) / STEPS
    return min(600, 60 + 2 * first / max(done, 1) * (epochs - done))


def test_time_limit_signal_stops_checkpoints_requeues_and_resumes(slurm: Cluster):
    """--time=1 with --signal=B:USR1@45: SLURM may send the signal up to a minute early
    (sbatch(1)), so USR1 comes at slurmctld's first time-limit check, 0 to 30 s into the job,
    while it trains (25 epochs: 41 s or more), or while TensorFlow still loads (a CI run's came
    4 s in: the ranks stop after their first step); the rerun gets a longer limit (it would be
    signalled again, and go on in a third start)."""
    options = [*NODES, "--time=1", "--signal=B:USR1@45"]
    args = ["--set", f"train.epochs={EPOCHS}", *FEW_EPOCHS, *SMALL_BATCHES]
    # GRACE: below the signal's lead of 45 s.
    with submitted(slurm, "time-limit", options, args, GRACE="20") as run:
        info = wait_job(slurm, run, requeued, 120, "the time-limit stop and requeue")
        stopped = time.monotonic()
        command(slurm, "scontrol", "update", f"jobid={run['job']}", "TimeLimit=10")
        info = wait_job(slurm, run, lambda i: i.get("JobState") != "PENDING", 60, "the rerun")
        rerun = time.monotonic()
        bound = rerun_bound(run, stopped - run["submitted"], EPOCHS)
        info = wait_job(slurm, run, finished, bound, "the rerun to end")
        failure = logs(slurm, run["output"])
        assert info.get("JobState") == "COMPLETED" and info["ExitCode"] == "0:0", failure
        assert info["Restarts"] == "1", failure
        epoch, step = stop_and_resume(run, "SIGUSR1")
        total = time.monotonic() - run["submitted"]
    print(
        f"time limit: stopped after step {step} of epoch {epoch} and requeued "
        f"{stopped - run['submitted']:.1f} s after submission, started again {rerun - stopped:.1f}"
        f" s later, done at {total:.1f} s"
    )


# The same stop, checkpoint and requeue as the time limit's, by hand: `make test-full` (CI's 90
# minutes).
@jobs.FULL_ONLY
def test_scancel_usr1_to_the_batch_shell_stops_checkpoints_requeues_and_resumes(slurm: Cluster):
    args = ["--set", "train.epochs=3", *FEW_EPOCHS, *SMALL_BATCHES]
    with submitted(slurm, "scancel-usr1", NODES, args) as run:
        checkpoints = run["run_dir"] / "checkpoints"
        wait_job(
            slurm,
            run,
            lambda i: finished(i) or (checkpoints.is_dir() and any(checkpoints.glob("epoch-*"))),
            180,
            "the first epoch's checkpoint",
        )
        signalled = time.monotonic()
        # --batch: to the batch shell only, whose trap passes USR1 on to srun and so to the ranks.
        command(slurm, "scancel", "--signal=USR1", "--batch", run["job"])
        wait_job(slurm, run, requeued, 60, "the stop and requeue")
        stopped = time.monotonic()
        info = wait_job(slurm, run, finished, 180, "the rerun to end")
        failure = logs(slurm, run["output"])
        assert info.get("JobState") == "COMPLETED" and info["ExitCode"] == "0:0", failure
        assert info["Restarts"] == "1", failure
        epoch, step = stop_and_resume(run, "SIGUSR1")
        assert epoch == 2 and 0 < step < STEPS, (epoch, step)  # mid-epoch
        total = time.monotonic() - run["submitted"]
    print(
        f"scancel -b USR1: stopped after step {step} of epoch {epoch}, requeued "
        f"{stopped - signalled:.1f} s after the signal, done at {total:.1f} s"
    )


def test_mpirun_inside_an_allocation(slurm: Cluster):
    """salloc -N 2, then `hvd-train launch` (mpirun) on the allocation's hosts: mpirun starts its
    daemons through srun, not ssh."""
    run_dir = slurm.state / "shared" / "salloc-mpirun"
    seen: set[tuple[str, int]] = set()

    def watch(proc: subprocess.Popen, tag: str) -> None:
        while proc.poll() is None:
            seen.update(ranks_running(slurm))
            time.sleep(0.2)

    argv = ["salloc", *NODES, "--time=5", jobs.PYTHON, "-m", "hvd_train.cli", "launch"]
    argv += ["--np", "2", "--hosts", "h1:1,h2:1", "--", "train", "--config", "configs/digits.yaml"]
    argv += ["--set", "train.epochs=1", *FEW_EPOCHS, "--set", f"run_dir={run_dir}"]
    job = jobs.run(argv, 300, env=slurm.env(), during=watch)
    assert job.returncode == 0, job.tail() + "\n" + logs(slurm)
    assert jobs.result_of(job)["workers"] == 2
    assert re.search(r"^salloc: Granted job allocation \d+$", job.output, re.M), job.tail()
    assert seen == {("h1", 0), ("h2", 1)}, seen
    assert_nothing_left(slurm)
    print(f"salloc + mpirun: {job.seconds:.1f} s")
