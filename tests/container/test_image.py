"""The image as users run it: non-root, read-only root, /tmp a tmpfs, the run directory mounted from
the host; the installer's doctor; the default job on 2 workers; no secret in any layer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from images import (
    IMAGE_RUNS,
    IMAGE_UID,
    REPO,
    STACK,
    Image,
    container_script,
    podman,
)

# Open MPI's ranks on one host exchange messages through /dev/shm (64 MB by default).
RUN = ("run", "--rm", "--shm-size", "1g")
READ_ONLY = ("--read-only", "--tmpfs", "/tmp")
LAUNCH_NP2 = ("python", "-m", "hvd_train.core.launch", "--np", "2", "--launcher", "mpirun", "--")
# The unit tests of the image's stack: on classic those tests/run.sh runs there (the rest are
# Keras 3's and fail on the classic stack outside a container too).
UNIT = (
    ("tests/unit/test_large_batch_optimizers.py", "tests/unit/test_large_batch_config.py")
    if STACK == "classic"
    else ("tests/unit",)
)
# What tests/integration/test_train_jobs.py asks of the default job.
ACCURACY = 0.97


def test_build_prints_size_and_times(image: Image) -> None:
    """The build names the image's size, its build time and a rebuild's."""
    prefix = f"container.sh: {image.tag}:"
    line = [x for x in image.build_output.splitlines() if x.startswith(prefix)]
    assert line and "size" in line[-1] and "rebuild" in line[-1], image.build_output


def test_doctor_clean(image: Image) -> None:
    """`hvd-train doctor`, the image's default command, passes read-only."""
    done = podman(*RUN, *READ_ONLY, image.tag)
    assert done.stdout.rstrip().endswith("doctor: ok"), done.stdout
    assert f"stack                {STACK}" in done.stdout, done.stdout


def test_runs_as_non_root_by_default(image: Image) -> None:
    """The default user is uid 1000; `--user 0` (the negative control) shows the check can fail."""
    assert podman(*RUN, "--entrypoint", "id", image.tag, "-u").stdout.strip() == str(IMAGE_UID)
    assert podman(*RUN, "--user", "0", "--entrypoint", "id", image.tag, "-u").stdout.strip() == "0"


def test_read_only_root(image: Image) -> None:
    """With --read-only even root cannot write outside /tmp; without it, it can (control)."""
    touch = ("--user", "0", "--entrypoint", "touch", image.tag)
    denied = podman(*RUN, *READ_ONLY, *touch, "/opt/hvd_train/x", check=False)
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied.stderr
    assert podman(*RUN, *touch, "/opt/hvd_train/x", check=False).returncode == 0
    assert podman(*RUN, *READ_ONLY, *touch, "/tmp/x", check=False).returncode == 0


def test_default_job_read_only_run_dir_on_host(image: Image, tmp_path: Path) -> None:
    """The default job on 2 workers reaches its accuracy; its files land in the host's folder."""
    runs = tmp_path / "runs"
    runs.mkdir()
    done = podman(
        *RUN,
        *READ_ONLY,
        "--volume",
        f"{runs}:{IMAGE_RUNS}:U",
        image.tag,
        "launch",
        "--np",
        "2",
        "--",
        "train",
        "--config",
        "configs/digits.yaml",
        "--overwrite",
        timeout=900,
    )
    results = [x for x in done.stdout.splitlines() if x.startswith("result ")]
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(results[-1].removeprefix("result "))
    assert result["workers"] == 2 and result["status"] == "finished", result
    assert result["final"]["accuracy"] >= ACCURACY, result
    written = {p.name for p in (runs / "digits").iterdir()}
    assert written, f"nothing in {runs / 'digits'}"
    # The files are the image user's, not root's, on the host too (no user namespace).
    assert all(p.stat().st_uid == IMAGE_UID for p in (runs / "digits").iterdir())


def test_no_secret_in_any_layer(image: Image) -> None:
    """The saved image's layers hold no private key, host key, munge key, .netrc or token."""
    done = container_script("scan", timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no private key" in done.stdout, done.stdout


def test_scan_finds_a_planted_key(image: Image, tmp_path: Path) -> None:
    """Negative control of the scan: a key pair and a .netrc put into a small image are named."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")], check=True
    )
    (tmp_path / "netrc").write_text("machine example.org login a password b\n")
    planted = "localhost/hvd_train-planted:test"
    containerfile = tmp_path / "Containerfile"
    containerfile.write_text(
        "FROM localhost/hvd_train-base:bookworm\n"
        "COPY key /home/user/.ssh/deploy\n"
        "COPY netrc /root/.netrc\n"
    )
    env = {**os.environ, "CONTAINERS_CONF": str(REPO / "mpi_scripts/container/containers.conf")}
    subprocess.run(
        [
            "timeout",
            "300",
            "buildah",
            "build",
            "-q",
            "-t",
            planted,
            "-f",
            str(containerfile),
            str(tmp_path),
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    try:
        done = container_script("scan", timeout=600, TAG=planted)
    finally:
        podman("rmi", "-f", planted)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "home/user/.ssh/deploy" in done.stdout, done.stdout
    assert "root/.netrc" in done.stdout, done.stdout


@pytest.mark.skipif(
    os.environ.get("HVD_TRAIN_CONTAINER_SUITES") != "1",
    reason="the suites inside the image: make container-test (HVD_TRAIN_CONTAINER_SUITES=1)",
)
@pytest.mark.parametrize(
    "argv",
    [
        ("python", "-m", "pytest", *UNIT, "-q", "-p", "no:cacheprovider"),
        (*LAUNCH_NP2, "python", "-m", "pytest", "tests/parallel", "-q", "-p", "no:cacheprovider"),
    ],
    ids=["unit", "parallel-np2"],
)
def test_suite_inside_image(image: Image, argv: tuple[str, ...]) -> None:
    """tests/unit, and tests/parallel at np=2, pass inside the image, read-only and non-root."""
    done = podman(*RUN, *READ_ONLY, "--entrypoint", argv[0], image.tag, *argv[1:], timeout=1500)
    assert " passed" in done.stdout, done.stdout[-3000:]
