#!/usr/bin/env bash
# Installs everything hvd_train needs on a fresh Debian/Ubuntu machine, and nothing that is already there:
#   1. system packages (Open MPI, cmake, a C++ compiler) through apt-get when root;
#   2. a virtual environment with the pinned Python packages (requirements/STACK-{cpu,gpu}.txt);
#      STACK=modern (TensorFlow 2.21 + Keras 3) or classic (TensorFlow 2.15 + Keras 2), each in its
#      own environment (.venv, .venv-classic), so both can sit side by side in one clone;
#   3. Horovod built from source against that environment's TensorFlow, cached as a wheel OUTSIDE the
#      clone under a key naming Horovod, TensorFlow, Python and the compiled ops, so a second run (or
#      a fresh clone on the same machine) installs it in seconds and a changed TensorFlow rebuilds it;
#   4. hvd_train itself (editable) and a final `hvd-train doctor`.
# pip's own wheel cache is deliberately not used for Horovod: it is keyed by the sdist alone and will
# hand a wheel built against another TensorFlow to a new environment (HorovodVersionMismatchError).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: mpi_scripts/install.sh
Environment (defaults in brackets):
  STACK=name         modern (TensorFlow 2.21 + Keras 3) or classic (TensorFlow 2.15 + Keras 2,
                     Horovod's own Keras integration) [the stack VENV already holds, else modern]
  VENV=path          virtual environment to create or reuse [<repo>/.venv; classic: <repo>/.venv-classic]
  PYTHON=python3     interpreter the environment is made from [python3]
  GPU=auto|0|1       build Horovod's NCCL ops; auto = an NVIDIA GPU is present (not merely nvcc) [auto]
  HVD_TRAIN_CACHE=d  where built Horovod wheels are kept [${XDG_CACHE_HOME:-~/.cache}/hvd_train]
  JOBS=n             parallel compile jobs for the Horovod build [nproc]
EOF
}
case "${1:-}" in -h | --help) usage; exit 0 ;; "") ;; *) usage >&2; exit 2 ;; esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# HOROVOD_VERSION, HOROVOD_BUILD_ENV and the helpers horovod_*, shared with check_nccl_build.sh
# (shellcheck lints that file on its own: not followed here, so that this one lints alone).
# shellcheck source=/dev/null
source "$REPO/mpi_scripts/horovod_build.sh"
STACK=${STACK:-}
PYTHON=${PYTHON:-python3}
GPU=${GPU:-auto}
HVD_TRAIN_CACHE=${HVD_TRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_train}
JOBS=${JOBS:-$(nproc)}
# Bump when the way Horovod is patched or configured changes: old cached wheels are then not reused.
BUILD_RECIPE=r6
# The GPU build's own, bumped alone by a patch that changes only code the CPU build leaves out (r4:
# the GPU stream handle, patches/horovod-0.28.1-gpu-stream-handle.patch; r5, r6 and r7: the CPU
# build's r4, r5 and r6 changes).
GPU_BUILD_RECIPE=r7

# Progress: numbered steps; with HVD_TRAIN_TIMINGS=file each step's seconds are appended to it
# ("install/STACK/NAME SECONDS RESULT") for the stage table of tests/run.sh.
step_no=0 step_name="" step_start=$SECONDS step_result=ok
record() {
  if [ -n "$step_name" ] && [ -n "${HVD_TRAIN_TIMINGS:-}" ]; then
    echo "install/$STACK/$step_name $((SECONDS - step_start)) $step_result" >>"$HVD_TRAIN_TIMINGS"
  fi
}
step() {
  record
  step_no=$((step_no + 1)) step_name=$1 step_start=$SECONDS step_result=ok
  printf '[install %d/4] %s\n' "$step_no" "$2"
}
die() { printf 'install.sh: %s\n' "$*" >&2; exit 1; }

# An environment holds one stack (its stamp says which): VENV=.venv-classic alone means classic, and
# a stack is never installed over another one's environment.
if [ -z "$STACK" ] && [ -n "${VENV:-}" ]; then
  STACK=$(cat "$VENV/.hvd_train-stack" 2>/dev/null || true)
fi
STACK=${STACK:-modern}
case "$STACK" in
  modern) VENV=${VENV:-$REPO/.venv} ;;
  classic) VENV=${VENV:-$REPO/.venv-classic} ;;
  *) die "unknown STACK=$STACK (known: modern, classic)" ;;
esac
venv_stack=$(cat "$VENV/.hvd_train-stack" 2>/dev/null || true)
if [ -n "$venv_stack" ] && [ "$venv_stack" != "$STACK" ]; then
  die "$VENV holds the $venv_stack stack, not $STACK: choose another VENV (or remove that one)"
fi

case "$GPU" in
  auto) if [ -e /dev/nvidia0 ] || nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then GPU=1; else GPU=0; fi ;;
  0 | 1) ;;
  *) die "GPU must be auto, 0 or 1, not '$GPU'" ;;
esac
VARIANT=cpu; [ "$GPU" = 1 ] && VARIANT=gpu

# --- 1. system packages ------------------------------------------------------------------------
step system "system packages (Open MPI, cmake, g++)"
missing=()
command -v mpirun >/dev/null || missing+=(openmpi-bin)
command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v patch >/dev/null || missing+=(patch)
"$PYTHON" -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
# Horovod and mpi4py compile against Python's headers (slim and CUDA base images may lack them).
"$PYTHON" -c 'import os, sys, sysconfig
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null ||
  missing+=(python3-dev)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    die "missing system packages: ${missing[*]}; install them as root: apt-get install -y ${missing[*]}"
  fi
  echo "  apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "  all present"
fi

# --- 2. virtual environment and pinned packages --------------------------------------------------
step python "Python environment $VENV ($STACK, $VARIANT)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "$STACK" >"$VENV/.hvd_train-stack"
PY=$VENV/bin/python
REQ=$REPO/requirements/$STACK-$VARIANT.txt
# The stamp holds the hash of the requirement files: an unchanged set skips pip entirely.
req_hash=$(cat "$REQ" "$REPO/requirements/$STACK-common.txt" | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.hvd_train-requirements" 2>/dev/null)" != "$req_hash" ]; then
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$REQ"
  echo "$req_hash" >"$VENV/.hvd_train-requirements"
else
  echo "  requirements unchanged"
fi

# --- 3. Horovod, built against this TensorFlow and cached by key ----------------------------------
tf_version=$("$PY" -c 'import importlib.metadata as m, sys
for d in ("tensorflow-cpu", "tensorflow"):
    try:
        print(m.version(d)); sys.exit()
    except m.PackageNotFoundError:
        pass
sys.exit("TensorFlow is not installed in the environment")')
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
# The build fix below is needed from TensorFlow 2.16 on; 2.15 (classic) builds unchanged.
xla_fix=$("$PY" -c 'import sys; v = tuple(int(p) for p in sys.argv[1].split(".")[:2])
print(int(v >= (2, 16)))' "$tf_version")
# The key's ops name what the library contains: "xla" only where the fix did not leave it out.
ops=mpi-gloo recipe=$BUILD_RECIPE
[ "$GPU" = 1 ] && ops=$ops-nccl recipe=$GPU_BUILD_RECIPE
[ "$xla_fix" = 0 ] && ops=$ops-xla
key=horovod-$HOROVOD_VERSION-tf$tf_version-$py_tag-$ops-$recipe
wheel_dir=$HVD_TRAIN_CACHE/wheels/$key
step horovod "Horovod $HOROVOD_VERSION ($key)"
if [ "$(cat "$VENV/.hvd_train-horovod" 2>/dev/null)" = "$key" ]; then
  echo "  already installed"
  step_result=reused
else
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    step_result=built
    echo "  building from source (several minutes; log: $HVD_TRAIN_CACHE/build-$key.log)"
    mkdir -p "$HVD_TRAIN_CACHE"
    work=$(mktemp -d "$HVD_TRAIN_CACHE/build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    sdist=$(horovod_sdist "$PY" "$HVD_TRAIN_CACHE") || die "could not download Horovod's source"
    tar -xzf "$sdist" -C "$work"
    src=$work/horovod-$HOROVOD_VERSION
    horovod_patch "$src" || die "could not apply hvd_train's patches to Horovod's source"
    # Build fix for TensorFlow >= 2.16: xla_mpi_ops.cc includes headers TensorFlow's wheel no longer
    # ships (e.g. highwayhash/arch_specific.h), so the build fails on that one file. Its XLA ops are
    # optional (used only with HOROVOD_ENABLE_XLA_OPS=1, which hvd_train never sets; it turns
    # jit_compile off where Horovod's ops are traced), so the file is left out of the library.
    if [ "$xla_fix" = 1 ]; then
      cmake_tf=$src/horovod/tensorflow/CMakeLists.txt
      grep -q 'xla_mpi_ops.cc' "$cmake_tf" || die "build fix: xla_mpi_ops.cc not found in $cmake_tf"
      sed -i '/xla_mpi_ops\.cc/d' "$cmake_tf"
    fi
    build_env=("${HOROVOD_BUILD_ENV[@]}" MAKEFLAGS="-j$JOBS")
    if [ "$GPU" = 1 ]; then
      # NCCL comes from the nvidia-nccl wheel that tensorflow[and-cuda] installs. Found through
      # horovod_build.sh, which `make nccl-check` (check_nccl_build.sh) compiles with on a machine
      # without a GPU: its lookup works for the nvidia-nccl-cu13 wheel too (a namespace package,
      # whose __file__ is None), and the toolkit is the one nvcc belongs to, not only /usr/local/cuda.
      nccl=$(horovod_nccl_dir "$PY") || die "GPU=1 but the nvidia-nccl wheel is not in $VENV"
      cuda=$(horovod_cuda_home) || die "GPU=1 but no nvcc (CUDA_HOME, PATH, /usr/local/cuda*)"
      horovod_gpu_env "$nccl" "$cuda"
      build_env+=("${HOROVOD_GPU_ENV[@]}")
    fi
    env "${build_env[@]}" "$PY" -m pip wheel --no-deps --no-build-isolation --no-cache-dir \
      -w "$work/out" "$src" >"$HVD_TRAIN_CACHE/build-$key.log" 2>&1 ||
      die "Horovod build failed; see $HVD_TRAIN_CACHE/build-$key.log"
    # Publish atomically so that an interrupted build never leaves a half wheel under the key.
    mkdir -p "$HVD_TRAIN_CACHE/wheels"
    rm -rf "$wheel_dir"
    mv "$work/out" "$work/$key"
    mv -T "$work/$key" "$wheel_dir"
  else
    step_result=cached-wheel
    echo "  cached wheel $wheel_dir"
  fi
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall \
    "$wheel_dir"/horovod-*.whl
  echo "$key" >"$VENV/.hvd_train-horovod"
fi

# --- 4. hvd_train itself, and a check of the whole stack -------------------------------------------
step hvd_train "hvd_train (editable) and doctor"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$REPO"
"$VENV/bin/hvd-train" doctor
record
