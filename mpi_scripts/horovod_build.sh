# shellcheck shell=bash
# Sourced, not run, by install.sh and check_nccl_build.sh: where Horovod's source comes from and how
# its build is configured, so that the NCCL compile check builds exactly what the installer builds.

HOROVOD_VERSION=0.28.1
# What every Horovod build of hvd_train enables (the GPU build adds horovod_gpu_env's settings).
# shellcheck disable=SC2034  # read by the scripts that source this file
HOROVOD_BUILD_ENV=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
  HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1)

# horovod_sdist PY CACHE: prints the path of Horovod's source archive, downloaded by PY's pip once
# into CACHE/downloads (not pip's cache), so that later builds and checks need no network.
horovod_sdist() {
  local dir=$2/downloads tmp
  local sdist=$dir/horovod-$HOROVOD_VERSION.tar.gz
  if [ ! -s "$sdist" ]; then
    mkdir -p "$dir"
    tmp=$(mktemp -d "$dir/.download.XXXXXX")
    "$1" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
      --no-cache-dir -d "$tmp" "horovod==$HOROVOD_VERSION" >&2 || { rm -rf "$tmp"; return 1; }
    mv "$tmp/horovod-$HOROVOD_VERSION.tar.gz" "$sdist"
    rm -rf "$tmp"
  fi
  echo "$sdist"
}

# horovod_patch SRC: applies hvd_train's patches (mpi_scripts/patches) to the Horovod source tree
# SRC, so that the installer and the NCCL compile check build the same code.
horovod_patch() {
  local patch
  for patch in "$(dirname "${BASH_SOURCE[0]}")"/patches/horovod-"$HOROVOD_VERSION"-*.patch; do
    patch -d "$1" -p1 --forward --quiet <"$patch" || { echo "patch $patch failed" >&2; return 1; }
  done
}

# horovod_cuda_home: prints the CUDA toolkit to build with: CUDA_HOME, else the toolkit of the nvcc
# on PATH, else the newest /usr/local/cuda*; status 1 when there is no nvcc at all.
horovod_cuda_home() {
  local nvcc here dir dirs
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    echo "$CUDA_HOME"
    return
  fi
  if nvcc=$(command -v nvcc); then
    # nvcc may be a wrapper script (e.g. /usr/local/bin/nvcc): ask it where it lives.
    here=$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p')
    if [ -n "$here" ] && [ -x "$here/nvcc" ]; then
      dirname "$here"
      return
    fi
  fi
  mapfile -t dirs < <(printf '%s\n' /usr/local/cuda* | sort -V -r)
  for dir in "${dirs[@]}"; do
    if [ -x "$dir/bin/nvcc" ]; then
      echo "$dir"
      return
    fi
  done
  return 1
}

# horovod_nccl_dir PYTHON [ARGS...]: prints the nvidia/nccl folder (include/, lib/) of the
# nvidia-nccl-cu* wheel that this interpreter imports.
horovod_nccl_dir() {
  # __path__, not __file__: nvidia-nccl-cu13 ships nvidia/nccl without an __init__.py, so it imports
  # as a namespace package whose __file__ is None; __path__ holds the folder for both kinds.
  "$@" -c 'import nvidia.nccl; print(next(iter(nvidia.nccl.__path__)))'
}

# horovod_gpu_env NCCL_DIR CUDA_HOME: sets HOROVOD_GPU_ENV, the settings that build Horovod's NCCL
# ops against that NCCL wheel folder and CUDA toolkit.
horovod_gpu_env() {
  # The wheel's library has only the versioned name, which Horovod's FindNCCL does not look for.
  [ -e "$1/lib/libnccl.so" ] || ln -s libnccl.so.2 "$1/lib/libnccl.so"
  # shellcheck disable=SC2034  # read by the scripts that source this file
  HOROVOD_GPU_ENV=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE="$1/include"
    HOROVOD_NCCL_LIB="$1/lib" HOROVOD_NCCL_LINK=SHARED HOROVOD_CUDA_HOME="$2")
}
