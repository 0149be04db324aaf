"""`hvd-train doctor`: what this machine's stack is, and what is wrong with it, with the fix."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
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


@dataclass(frozen=True)
class NcclLibrary:
    """The NCCL library a GPU job of this host would load: its version and where it is."""

    version: str
    where: str


def nccl_library() -> NcclLibrary | None:
    """NCCL as this host has it, without a GPU; None where it is absent.

    Looked for as the installer and mpi_scripts/check_nccl_build.sh find it: the nvidia-nccl-cu*
    wheel this interpreter imports (`nvidia.nccl`: include/nccl.h tells its version), then a
    libnccl the dynamic linker finds (its `ncclGetVersion`, which needs no GPU).
    """
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    folders = (spec.submodule_search_locations or []) if spec else []
    for folder in map(Path, folders):
        library = folder / "lib" / "libnccl.so.2"
        if library.exists():
            version = nccl_header_version(folder / "include" / "nccl.h") or package_version(
                "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11"
            )
            return NcclLibrary(version or "unknown", str(library))
    name = ctypes.util.find_library("nccl")
    if name is None:
        return None
    try:
        code = ctypes.c_int()
        if ctypes.CDLL(name).ncclGetVersion(ctypes.byref(code)) != 0:
            return NcclLibrary("unknown", name)
    except (OSError, AttributeError):
        return None
    return NcclLibrary(nccl_version(code.value), name)


def nccl_header_version(header: Path) -> str | None:
    """ "major.minor.patch" from nccl.h's NCCL_MAJOR, NCCL_MINOR and NCCL_PATCH, or None."""
    try:
        text = header.read_text()
    except OSError:
        return None
    parts = [
        re.search(rf"^#define NCCL_{p}\s+(\d+)", text, re.M) for p in ("MAJOR", "MINOR", "PATCH")
    ]
    return ".".join(m.group(1) for m in parts) if all(parts) else None  # type: ignore[union-attr]


def nccl_version(code: int) -> str:
    """ncclGetVersion's integer as "major.minor.patch": major*10000 + minor*100 + patch since
    NCCL 2.9, major*1000 + minor*100 + patch before."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


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
        ("nccl", f"{nccl.version} ({nccl.where})" if (nccl := nccl_library()) else "absent"),
    ]
    if tf_version is None or keras_version is None:
        problems.append(f"TensorFlow or Keras is not installed: {REINSTALL}")
    if shutil.which("mpirun") is None:
        problems.append("mpirun not found: apt-get install openmpi-bin libopenmpi-dev")
    try:
        from hvd_train import comm
        from hvd_train.comm import runtime
        from hvd_train.core import placement
        from hvd_train.keras import compat

        built = comm.build_info()
        rows.append(("stack", f"{compat.NAME} (Keras {compat.KERAS_MAJOR})"))
        onednn = {True: "oneDNN", False: "Eigen", None: "unknown"}[runtime.onednn_enabled()]
        setting = os.environ.get(placement.ONEDNN_ENV, "unset")
        rows.append(("cpu kernels", f"{onednn} ({placement.ONEDNN_ENV}={setting})"))
        rows.append(("horovod controllers", ", ".join(k for k in ("mpi", "gloo") if built[k])))
        rows.append(("horovod gpu ops", "nccl" if built["nccl"] else "none (CPU build)"))
        patches = {
            "wakes_on_enqueue": "wake on enqueue",
            "gloo_keeps_send_buffer": "gloo send buffer",
            "bfloat16": "bfloat16",
        }
        pending = runtime.pending_cycle_time_ms()
        if pending is not None:
            patches["wakes_on_enqueue"] += f" (pending cycle {pending:g} ms)"
        patched = ", ".join(text for key, text in patches.items() if built.get(key))
        patched = patched or "none (not the installer's)"
        rows.append(("horovod patches", patched))
        if built["nccl"] and nccl is None:
            problems.append(
                "Horovod was built with NCCL, but no NCCL library is found: pip install "
                "nvidia-nccl-cu<CUDA major>, or put libnccl.so.2 on the library path"
            )
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
