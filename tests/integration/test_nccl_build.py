"""Horovod's NCCL build path compiles with this machine's CUDA toolkit: check_nccl_build.sh
configures Horovod as install.sh does with GPU=1, compiles its GPU translation units against the
nvidia-nccl-cu<CUDA major> wheel and links them against its libnccl. Needs nvcc, not a GPU. The
first run downloads the NCCL wheel (about 200 MB) into the hvd_train cache; the check takes about
two minutes on two cores either way (only the downloads are reused from one run to the next)."""

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import FULL_ONLY, REPO, run

SCRIPT = REPO / "mpi_scripts" / "check_nccl_build.sh"
SUMMARY = re.compile(
    r"NCCL build path compiles: (\d+) translation units, nvcc ([\d.]+), NCCL ([\d.]+)"
)
# Units whose object code must hold their GPU path, and what one of the symbols they call contains
# when it is there (CUstream_st: a GPUContext method taking a cudaStream_t).
GPU_CALLS = {
    "horovod/common/ops/nccl_operations.cc": "ncclAllReduce",
    "horovod/common/ops/cuda_operations.cc": "cudaEventRecord",
    "horovod/common/ops/gpu_operations.cc": "GPUContext11RecordEventERP11CUstream_st",
}


def find_nvcc() -> str | None:
    """nvcc where check_nccl_build.sh looks, in its order: CUDA_HOME, PATH, /usr/local/cuda*/bin."""
    cuda_home = os.environ.get("CUDA_HOME")
    candidates = [os.path.join(cuda_home, "bin", "nvcc")] if cuda_home else []
    candidates += [shutil.which("nvcc") or ""]
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


# About 125 s on two cores: in `make test-full` only (CI's 90 minutes); `make nccl-check` runs it.
pytestmark = FULL_ONLY


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """The check, run once: (its output, its build folder, the nvcc it should have used)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (PATH, CUDA_HOME, /usr/local/cuda*/bin): nothing to compile with")
    build = tmp_path_factory.mktemp("nccl-check")
    env = {"VENV": sys.prefix, "NCCL_CHECK_DIR": str(build), "TIMEOUT": "1200"}
    job = run(["bash", str(SCRIPT)], timeout=1500, env=env)
    assert job.returncode == 0, job.tail()
    return job.output, build, nvcc


def objects(build: Path) -> dict[str, Path]:
    rows = (line.split("\t") for line in (build / "objects.tsv").read_text().splitlines())
    return {unit: Path(obj) for unit, obj in rows}


def symbols(path: Path, *flags: str) -> set[str]:
    out = subprocess.run(["nm", *flags, str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}


def test_the_check_ends_with_its_summary(check):
    output, build, nvcc = check
    summary = SUMMARY.fullmatch(output.rstrip().splitlines()[-1])
    assert summary, output[-2000:]
    units, nvcc_version, nccl_version = summary.groups()
    assert int(units) == len(objects(build)) >= 9
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    assert f", V{nvcc_version}" in version.stdout
    assert re.fullmatch(r"2\.\d+\.\d+", nccl_version)


def test_every_unit_is_an_object_file_with_its_gpu_code(check):
    _, build, _ = check
    built = objects(build)
    assert {
        *GPU_CALLS,
        "horovod/common/ops/cuda/cuda_kernels.cu",
        "horovod/tensorflow/mpi_ops.cc",
    } <= set(built)
    for unit, obj in built.items():
        header = obj.read_bytes()[:18]
        # ELF, type ET_REL (1, little-endian at byte 16): a relocatable object, not a stub.
        assert header[:4] == b"\x7fELF" and header[16:18] == b"\x01\x00", unit
    for unit, call in GPU_CALLS.items():
        called = symbols(built[unit], "--undefined-only")
        assert any(call in symbol for symbol in called), f"{unit} calls no {call}"
    sections = subprocess.run(
        ["readelf", "-SW", str(built["horovod/common/ops/cuda/cuda_kernels.cu"])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert ".nv_fatbin" in sections  # device code for the GPU architectures, not only host code


def test_horovods_objects_and_a_program_link_against_the_wheels_nccl(check):
    _, build, _ = check
    library = build / "libhorovod_nccl_check.so"
    nccl_calls = {s for s in symbols(library, "-D", "--undefined-only") if s.startswith("nccl")}
    assert {"ncclAllReduce", "ncclCommInitRank", "ncclGroupStart"} <= nccl_calls
    program = subprocess.run(
        ["readelf", "-dW", str(build / "nccl_link_test")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "libnccl.so.2" in program
    assert "ncclAllReduce" in symbols(build / "nccl_link_test", "-D", "--undefined-only")


# What Horovod 0.28.1's GPU ops called for an op's CUDA stream; TensorFlow 2.21 does not export it.
AS_GPU_STREAM_VALUE = "_ZN15stream_executor3gpu16AsGpuStreamValueEPNS_6StreamE"
TENSORFLOW_NAMES = re.compile(r"(^|[ (<,])(tensorflow|stream_executor|tsl|xla)::")


def test_horovods_gpu_ops_call_only_what_tensorflow_exports(check):
    _, build, _ = check
    called = symbols(build / "libhorovod_nccl_check.so", "-D", "--undefined-only")
    exported = set((build / "tensorflow.defined").read_text().split())
    demangled = subprocess.run(
        ["c++filt"], input="\n".join(sorted(called)), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    pairs = zip(sorted(called), demangled, strict=True)
    of_tensorflow = {s for s, name in pairs if TENSORFLOW_NAMES.search(name)}
    assert of_tensorflow, "the GPU ops call nothing of TensorFlow: the check would prove nothing"
    assert of_tensorflow <= exported, sorted(of_tensorflow - exported)
    # The call the stream-handle patch replaces: gone from mpi_ops, and where TensorFlow does not
    # export it (2.21), the check above would have failed on it (mpi_lib did not load).
    assert AS_GPU_STREAM_VALUE not in symbols(objects(build)["horovod/tensorflow/mpi_ops.cc"])
    if tensorflow_version().startswith("2.21"):
        assert AS_GPU_STREAM_VALUE not in exported


def tensorflow_version() -> str:
    """This environment's TensorFlow (the one check_nccl_build.sh was given), CPU or GPU build."""
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return ""
