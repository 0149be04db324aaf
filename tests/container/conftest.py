"""The container tier: the project's image built with podman/buildah and run as users run it
(`mpi_scripts/container.sh`, docs/containers.md).

Needs root and the container tools (`mpi_scripts/container.sh install`). With CI=true a machine
without them is a failure; elsewhere the tier skips with one line saying why. The image is built
once per session (layers and the host's Horovod wheel cache reused), for HVD_TRAIN_CONTAINER_STACK
(modern unless set).
"""

from __future__ import annotations

import os

import pytest
from images import STACK, Image, container_script, unusable


@pytest.fixture(scope="session")
def image() -> Image:
    """The project's image for STACK, built (or rebuilt from its cached layers) once."""
    reason = unusable()
    if reason and os.environ.get("CI") == "true":
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)
    done = container_script("build")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"container.sh build: exit {done.returncode}\n{output}"
    return Image(f"localhost/hvd_train:{STACK}", done.stdout)
