"""Helpers of the container tier: podman and `mpi_scripts/container.sh` from Python."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "mpi_scripts" / "container.sh"
CONTAINERS_CONF = REPO / "mpi_scripts" / "container" / "containers.conf"
STACK = os.environ.get("HVD_TRAIN_CONTAINER_STACK", "modern")
# The image's user (Dockerfile: USER 1000:1000) and where the default job writes its runs.
IMAGE_UID = 1000
IMAGE_RUNS = "/opt/hvd_train/src/runs"


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run podman with the project's containers.conf; raise with its output when it fails."""
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    done = subprocess.run(
        ["timeout", "--kill-after=10", str(timeout), "podman", *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done


def container_script(
    command: str, timeout: float = 1800, **settings: str
) -> subprocess.CompletedProcess:
    """Run `container.sh COMMAND` for this session's stack (or `settings`), output captured."""
    env = {**os.environ, "STACK": STACK, **settings}
    return subprocess.run(
        ["timeout", "--kill-after=10", str(timeout), "bash", str(SCRIPT), command],
        env=env,
        capture_output=True,
        text=True,
    )


def unusable() -> str | None:
    """Why no image can be built and run here, or None."""
    if os.geteuid() != 0:
        return "the container tier needs root (podman and buildah as root)"
    tools = ("podman", "buildah", "runc", "mmdebstrap")
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        return f"missing {', '.join(missing)}: run mpi_scripts/container.sh install"
    return None


@dataclass
class Image:
    """The session's image: its tag and what its build printed."""

    tag: str
    build_output: str
