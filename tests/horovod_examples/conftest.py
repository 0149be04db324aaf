"""Horovod's own Keras examples against `hvd_train.horovod` (docs/horovod.md).

The examples are Horovod's code, so the project keeps only the diffs (`diffs/`), applied here to
the files of a Horovod source tree at `HOROVOD_COMMIT`, which `HVD_TRAIN_HOROVOD_SRC` names (a
work tree or a bare git directory: `make test-full HOROVOD_SRC=...`). Without it the tier skips
with one line: CI reaches package registries, not GitHub, and Horovod's sdist has no examples.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))


@pytest.fixture(scope="session")
def horovod_src() -> Path:
    """The Horovod source tree the examples are taken from."""
    src = os.environ.get("HVD_TRAIN_HOROVOD_SRC")
    if not src:
        pytest.skip("HVD_TRAIN_HOROVOD_SRC is not set: Horovod's examples are not in the project")
    if not Path(src).is_dir():
        pytest.fail(f"HVD_TRAIN_HOROVOD_SRC={src} is not a directory")
    return Path(src)
