"""The installer's Horovod carries hvd_train's patches (mpi_scripts/patches), and they still apply.

`horovod_wakes_on_enqueue` is the patched library's marker (a C function the toolkit finds with
ctypes); the Gloo cycle rule trusts it, so a build without the patch must not report it.
"""

import subprocess
import tarfile
from pathlib import Path

import pytest

from hvd_train import comm

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "mpi_scripts" / "patches").glob("horovod-*.patch"))
SDIST = Path.home() / ".cache" / "hvd_train" / "downloads" / "horovod-0.28.1.tar.gz"


def test_the_installed_horovod_wakes_on_enqueue():
    assert comm.build_info()["wakes_on_enqueue"], (
        "this Horovod lacks mpi_scripts/patches: reinstall with mpi_scripts/install.sh"
    )


@pytest.mark.skipif(not SDIST.is_file(), reason="Horovod's sdist is not in the installer's cache")
def test_every_patch_applies_to_horovods_source_and_only_once(tmp_path):
    with tarfile.open(SDIST) as archive:
        archive.extractall(tmp_path, filter="data")
    src = tmp_path / "horovod-0.28.1"
    for patch in PATCHES:
        first = subprocess.run(["patch", "-d", src, "-p1", "--forward", "-i", patch], check=False)
        again = subprocess.run(
            ["patch", "-d", src, "-p1", "--forward", "--dry-run", "-i", patch],
            capture_output=True,
            text=True,
            check=False,
        )
        assert first.returncode == 0, patch.name
        assert again.returncode != 0 and "previously applied" in again.stdout, patch.name
    assert "horovod_wakes_on_enqueue" in (src / "horovod/common/operations.cc").read_text()
