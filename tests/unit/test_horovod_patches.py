"""The installer's Horovod carries hvd_train's patches (mpi_scripts/patches), and they still apply.

`horovod_wakes_on_enqueue` and `horovod_gloo_keeps_send_buffer` are the patched library's
markers (C functions the toolkit finds with ctypes); the Gloo cycle rule trusts the first, so a
build without the patch must not report it. What the second patch fixes is checked in the
parallel suite (tests/parallel/test_collectives.py: no socket below the kernel's send buffer), as
is the third's bfloat16 reduction (its marker: bfloat16 among the allreduce op's types).
"""

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hvd_train import comm

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "mpi_scripts" / "patches").glob("horovod-*.patch"))
SDIST = Path.home() / ".cache" / "hvd_train" / "downloads" / "horovod-0.28.1.tar.gz"


@pytest.mark.parametrize("marker", ["wakes_on_enqueue", "gloo_keeps_send_buffer", "bfloat16"])
def test_the_installed_horovod_carries_the_patch(marker):
    assert comm.build_info()[marker], (
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
    gloo = (src / "horovod/common/ops/gloo_operations.cc").read_text()
    assert "horovod_gloo_keeps_send_buffer" in gloo
    assert "HOROVOD_BFLOAT16" in (src / "horovod/common/message.h").read_text()
    assert "-DGLOO_USE_AVX=1" in (src / "CMakeLists.txt").read_text()
    assert "/math.cc" in (src / "third_party/gloo/gloo/CMakeLists.txt").read_text()


def test_the_pending_cycle_is_read_from_the_environment():
    """HOROVOD_PENDING_CYCLE_TIME sets the loop's cycle while a tensor waits (0 included); a value
    that is not a number of ms >= 0 falls back to the 1 ms default. The library reads it once, so
    each value runs in a process of its own (in parallel)."""
    probe = "from hvd_train import comm; print(comm.pending_cycle_time_ms())"
    cases = {None: 1.0, "2.5": 2.5, "0": 0.0, "soon": 1.0}
    runs = {}
    for value in cases:
        env = {k: v for k, v in os.environ.items() if k != "HOROVOD_PENDING_CYCLE_TIME"}
        if value is not None:
            env["HOROVOD_PENDING_CYCLE_TIME"] = value
        runs[value] = subprocess.Popen(
            [sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE, text=True
        )
    outputs = {value: run.communicate(timeout=120)[0] for value, run in runs.items()}
    read = {value: float(out.split()[-1]) for value, out in outputs.items()}
    assert read == cases
