"""`hvd-train doctor`: what this machine's stack is, and what is wrong with it, with the fix."""

from __future__ import annotations

import importlib.metadata
import platform
import shutil
import subprocess
from typing import TextIO

REINSTALL = "run mpi_scripts/install.sh (it rebuilds Horovod against the installed TensorFlow)"


def package_version(*dist_names: str) -> str | None:
    """Installed version of the first of these distributions that is installed, or None."""
    for name in dist_names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _mpi_version() -> str | None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return None
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def run(out: TextIO) -> int:
    """Print the report; returns 0 when nothing is wrong, 1 otherwise."""
    problems: list[str] = []
    tf_version = package_version("tensorflow-cpu", "tensorflow")
    keras_version = package_version("keras")
    rows = [
        ("python", platform.python_version()),
        ("tensorflow", tf_version or "missing"),
        ("keras", keras_version or "missing"),
        ("horovod", package_version("horovod") or "missing"),
        ("mpi", _mpi_version() or "missing"),
    ]
    if tf_version is None or keras_version is None:
        problems.append(f"TensorFlow or Keras is not installed: {REINSTALL}")
    if shutil.which("mpirun") is None:
        problems.append("mpirun not found: apt-get install openmpi-bin libopenmpi-dev")
    try:
        from hvd_train import comm
        from hvd_train.keras import compat

        built = comm.build_info()
        rows.append(("stack", f"{compat.NAME} (Keras {compat.KERAS_MAJOR})"))
        rows.append(("horovod controllers", ", ".join(k for k in ("mpi", "gloo") if built[k])))
        rows.append(("horovod gpu ops", "nccl" if built["nccl"] else "none (CPU build)"))
        if not (built["mpi"] or built["gloo"]):
            problems.append(f"Horovod was built without MPI and Gloo: {REINSTALL}")
    except Exception as err:  # any import failure is the finding: report it, don't crash
        problems.append(f"Horovod's TensorFlow library does not load ({err}): {REINSTALL}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        out.write(f"{name:<{width}}  {value}\n")
    for problem in problems:
        out.write(f"PROBLEM: {problem}\n")
    out.write("doctor: ok\n" if not problems else f"doctor: {len(problems)} problem(s)\n")
    return 1 if problems else 0
