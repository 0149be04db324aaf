#!/usr/bin/env bash
# Compile-only check of Horovod's NCCL build path, for a machine with nvcc but no GPU: configures
# Horovod's own sources with CMake exactly as install.sh does with GPU=1 (same settings, through
# horovod_build.sh), against the NCCL headers and library of the nvidia-nccl-cu<CUDA major> wheel,
# compiles the translation units with GPU code to object files, links them with the installer's link
# line (what they call of NCCL and of the venv's TensorFlow must be exported there), and links a
# small program calling ncclAllReduce. Runs nothing on a GPU.
# Usage: [VENV=.venv] [NCCL_WHEEL=nvidia-nccl-cu<CUDA major>] [NCCL_VERSION=2.28.9] \
#        [NCCL_CHECK_DIR=dir] [JOBS=n] [TIMEOUT=1200] mpi_scripts/check_nccl_build.sh
# Downloads (Horovod's sdist, the NCCL wheel: about 200 MB) are kept in HVD_TRAIN_CACHE/downloads;
# the build goes to NCCL_CHECK_DIR [HVD_TRAIN_CACHE/nccl-check], emptied first. Exits 0 with
# "NCCL build path compiles: ..." or "skipped: no nvcc"; otherwise 1, the last line naming the step.
set -euo pipefail
if [ $# -gt 0 ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  [ "$1" = -h ] || [ "$1" = --help ] || exit 2
  exit 0
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# HOROVOD_VERSION, HOROVOD_BUILD_ENV and the helpers horovod_*, shared with install.sh.
# shellcheck source=/dev/null
source "$REPO/mpi_scripts/horovod_build.sh"
VENV=${VENV:-$REPO/.venv}
# Absolute: CMake runs in the build folder and is given this interpreter.
case "$VENV" in /*) ;; *) VENV=$PWD/$VENV ;; esac
NCCL_VERSION=${NCCL_VERSION:-2.28.9}
HVD_TRAIN_CACHE=${HVD_TRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_train}
NCCL_CHECK_DIR=${NCCL_CHECK_DIR:-$HVD_TRAIN_CACHE/nccl-check}
JOBS=${JOBS:-$(nproc)}
TIMEOUT=${TIMEOUT:-1200}
PY=$VENV/bin/python
deadline=$((SECONDS + TIMEOUT))
step_no=0 step_name=""

step() {
  step_no=$((step_no + 1)) step_name=$1
  printf '[nccl-check %d/5] %s\n' "$step_no" "$2"
}
fail() {
  local late=""
  [ "$SECONDS" -lt "$deadline" ] || late=" (timed out: TIMEOUT=${TIMEOUT}s ran out)"
  printf 'check_nccl_build.sh: FAILED at %s: %s%s\n' "$step_name" "$*" "$late" >&2
  exit 1
}
# within CMD...: runs CMD with what is left of TIMEOUT (status 124 when it runs out).
within() {
  local left=$((deadline - SECONDS))
  [ "$left" -gt 0 ] || return 124
  timeout --kill-after=10 "$left" "$@"
}
# show_log FILE: the end of a failed command's log, above the line that names the failure.
show_log() { tail -n 40 "$1" >&2; }

# --- 1. toolchain ------------------------------------------------------------------------------
step toolchain "toolchain"
if ! cuda=$(horovod_cuda_home); then
  echo "check_nccl_build.sh: skipped: no nvcc (looked in CUDA_HOME, PATH and /usr/local/cuda*/bin)"
  exit 0
fi
nvcc_version=$("$cuda/bin/nvcc" --version | sed -n 's/.*release [0-9.]*, V\([0-9.]*\).*/\1/p')
[ -n "$nvcc_version" ] || fail "cannot read the version of $cuda/bin/nvcc"
cuda_major=${nvcc_version%%.*}
for tool in cmake make c++ mpicxx nm; do
  command -v "$tool" >/dev/null || fail "$tool is missing (mpi_scripts/install.sh installs it)"
done
[ -x "$PY" ] || fail "no Python environment at $VENV (run make install, or set VENV)"
echo "  nvcc $nvcc_version ($cuda), $(cmake --version | head -n 1), jobs $JOBS, timeout ${TIMEOUT}s"

# --- 2. sources: Horovod's sdist and the NCCL wheel, downloaded once -----------------------------
# The wheel for this toolkit; NCCL_WHEEL=nvidia-nccl-cu12 checks the pairing tensorflow[and-cuda] brings.
wheel=${NCCL_WHEEL:-nvidia-nccl-cu$cuda_major}
step sources "Horovod $HOROVOD_VERSION source and $wheel==$NCCL_VERSION (cached in $HVD_TRAIN_CACHE)"
sdist=$(horovod_sdist "$PY" "$HVD_TRAIN_CACHE") || fail "could not download Horovod's sdist"
downloads=$HVD_TRAIN_CACHE/downloads
# cached_wheel DIST VERSION SIZE: prints the path of DIST==VERSION's wheel in $downloads, which it
# downloads the first time (saying SIZE); status 1 when that fails.
cached_wheel() {
  local found=("$downloads/${1//-/_}-$2-"*.whl)
  if [ ! -s "${found[0]}" ]; then
    echo "  downloading $1==$2 ($3)" >&2
    within "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
      --no-cache-dir -d "$downloads" "$1==$2" >&2 || return 1
    found=("$downloads/${1//-/_}-$2-"*.whl)
  fi
  echo "${found[0]}"
}
whl=$(cached_wheel "$wheel" "$NCCL_VERSION" "about 200 MB") ||
  fail "could not download $wheel==$NCCL_VERSION"
# The wheel unpacked as a site folder (nvidia/nccl/{include,lib}), once, published atomically.
site=$HVD_TRAIN_CACHE/nccl/$wheel-$NCCL_VERSION
if [ ! -d "$site/nvidia/nccl" ]; then
  mkdir -p "$HVD_TRAIN_CACHE/nccl"
  tmp=$(mktemp -d "$HVD_TRAIN_CACHE/nccl/.unpack.XXXXXX")
  "$PY" -m zipfile -e "$whl" "$tmp" || fail "could not unpack $whl"
  rm -rf "$site"
  mv -T "$tmp" "$site"
fi
# Found as the installer finds the wheel in its environment (-S: this folder only, not site-packages).
nccl=$(PYTHONPATH=$site horovod_nccl_dir "$PY" -S) || fail "the installer's lookup does not find $site"
[ "$nccl" = "$site/nvidia/nccl" ] || fail "the installer's lookup found $nccl, not $site/nvidia/nccl"
nccl_header=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$nccl/include/nccl.h" |
  paste -sd.)
echo "  $sdist"
echo "  $nccl (nccl.h $nccl_header)"

# --- 3. configure: Horovod's CMake, with the installer's settings for GPU=1 -----------------------
step configure "CMake configure with HOROVOD_GPU_OPERATIONS=NCCL in $NCCL_CHECK_DIR"
# Emptied only when it is a previous check's folder (it holds the marker) or empty; never in the clone.
case "$(realpath -m "$NCCL_CHECK_DIR")/" in "$REPO"/*) fail "NCCL_CHECK_DIR is inside the clone" ;; esac
if [ -e "$NCCL_CHECK_DIR/.nccl-check" ]; then
  rm -rf "$NCCL_CHECK_DIR"
elif [ -n "$(ls -A "$NCCL_CHECK_DIR" 2>/dev/null)" ]; then
  fail "$NCCL_CHECK_DIR is not empty and not a previous check's folder"
fi
mkdir -p "$NCCL_CHECK_DIR/build" "$NCCL_CHECK_DIR/logs"
touch "$NCCL_CHECK_DIR/.nccl-check"
tar -xzf "$sdist" -C "$NCCL_CHECK_DIR"
src=$NCCL_CHECK_DIR/horovod-$HOROVOD_VERSION
horovod_patch "$src" || fail "could not apply hvd_train's patches to Horovod's source"
build=$NCCL_CHECK_DIR/build
horovod_gpu_env "$nccl" "$cuda"
printf '  %s\n' "${HOROVOD_BUILD_ENV[*]} ${HOROVOD_GPU_ENV[*]}"
# The arguments setup.py passes to CMake, so the flags are those of `pip wheel` in install.sh.
(cd "$build" && within env "${HOROVOD_BUILD_ENV[@]}" "${HOROVOD_GPU_ENV[@]}" cmake "$src" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_LIBRARY_OUTPUT_DIRECTORY_RELWITHDEBINFO="$build/lib" \
  -DPYTHON_EXECUTABLE:FILEPATH="$PY") >"$NCCL_CHECK_DIR/logs/configure.log" 2>&1 ||
  { show_log "$NCCL_CHECK_DIR/logs/configure.log"; fail "cmake (log: $NCCL_CHECK_DIR/logs/configure.log)"; }
grep -E 'CUDA compiler identification|Found NCCL \(|HVD_NVCC_COMPILE_FLAGS' \
  "$NCCL_CHECK_DIR/logs/configure.log" | sed 's/^/  /'

# --- 4. compile: the units with GPU code, by CMake's own rules ------------------------------------
# Horovod's TensorFlow library (mpi_lib) and the CUDA kernel library it links. Every unit sees the
# CUDA headers through common.h; these are the ones with CUDA, NCCL or NVTX code of their own.
units=(horovod/common/ops/cuda/cuda_kernels.cu horovod/common/ops/cuda_operations.cc
  horovod/common/ops/gpu_operations.cc horovod/common/ops/nccl_operations.cc
  horovod/common/ops/mpi_gpu_operations.cc horovod/common/ops/adasum_gpu_operations.cc
  horovod/common/nvtx_op_range.cc horovod/common/operations.cc horovod/common/controller.cc
  horovod/tensorflow/mpi_ops.cc)
link_txt=$build/horovod/tensorflow/CMakeFiles/tensorflow.dir/link.txt
# Which kernel library mpi_lib links depends on TensorFlow's C++ ABI (compatible_ = the old ABI).
kernels=$(grep -o '[a-z_]*horovod_cuda_kernels\.a' "$link_txt" | head -n 1) ||
  fail "mpi_lib links no CUDA kernel library: CMake did not take the CUDA path"
kernels=${kernels#lib}
kernels=${kernels%.a}
targets=() objects=() makefiles=()
for unit in "${units[@]}"; do
  if [ "$unit" = horovod/common/ops/cuda/cuda_kernels.cu ]; then
    dir=horovod/common/ops/cuda/CMakeFiles/$kernels.dir
    targets+=("horovod/common/ops/cuda/lib$kernels.a") objects+=("$dir/cuda_kernels.cu.o")
    makefiles+=("$dir/build.make")
    continue
  fi
  rel=${unit#horovod/}
  case "$rel" in tensorflow/*) rel=${rel#tensorflow/} ;; *) rel=__/$rel ;; esac
  object=CMakeFiles/tensorflow.dir/$rel.o
  # HAVE_NVTX is optional in Horovod (no nvtx3 headers: no nvtx_op_range.cc); the others are not.
  if ! grep -qF " $object " "$link_txt"; then
    [ "$unit" = horovod/common/nvtx_op_range.cc ] && continue
    fail "$unit is not part of Horovod's configured build"
  fi
  targets+=("horovod/tensorflow/$object") objects+=("horovod/tensorflow/$object")
  makefiles+=(horovod/tensorflow/CMakeFiles/tensorflow.dir/build.make)
done
step compile "compile ${#targets[@]} translation units (${JOBS} at a time)"
# compile_one MAKEFILE TARGET: CMake's rule for one unit; its log and status go to logs/.
compile_one() {
  local log rc=0
  log=$NCCL_CHECK_DIR/logs/$(basename "${2%.o}").log
  within make -C "$build" -f "$1" "$2" >"$log" 2>&1 || rc=$?
  echo "$rc" >"$log.rc"
}
for i in "${!targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  compile_one "${makefiles[$i]}" "${targets[$i]}" &
done
wait
failed=()
for i in "${!targets[@]}"; do
  log=$NCCL_CHECK_DIR/logs/$(basename "${targets[$i]%.o}").log
  if [ "$(cat "$log.rc")" = 0 ] && [ -s "$build/${objects[$i]}" ]; then
    printf '  ok  %-46s %6s KiB\n' "${units[$i]}" "$(($(stat -c %s "$build/${objects[$i]}") / 1024))"
    printf '%s\t%s\n' "${units[$i]}" "$build/${objects[$i]}" >>"$NCCL_CHECK_DIR/objects.tsv"
  else
    [ "$(cat "$log.rc")" = 124 ] && echo "  timed out: ${units[$i]}"
    show_log "$log"
    failed+=("${units[$i]}")
  fi
done
[ ${#failed[@]} = 0 ] || fail "${failed[*]} (logs: $NCCL_CHECK_DIR/logs)"

# --- 5. link: the installer's link line with these objects; a program calling NCCL ---------------
step link "link against $nccl/lib/libnccl.so.2, the CUDA runtime and TensorFlow (nothing is run on a GPU)"
# mpi_lib's link command from CMake, with only the objects built here (the other units and Gloo are
# left out), as a shared library: their NCCL and CUDA references must all resolve.
read -ra words <"$link_txt"
argv=() placed=0 out=""
for word in "${words[@]}"; do
  if [ "$out" = next ]; then
    out=$NCCL_CHECK_DIR/libhorovod_nccl_check.so
    argv+=("$out")
  elif [[ $word == CMakeFiles/tensorflow.dir/*.o || $word == *gloo*.a ]]; then
    if [ "$placed" = 0 ]; then
      for object in "${objects[@]}"; do
        [[ $object == horovod/tensorflow/* ]] && argv+=("$build/$object")
      done
      placed=1
    fi
  else
    [ "$word" = -o ] && out=next
    argv+=("$word")
  fi
done
# (The kernel library the command names was built with the units.)
(cd "$build/horovod/tensorflow" && within "${argv[@]}") >"$NCCL_CHECK_DIR/logs/link.log" 2>&1 ||
  { show_log "$NCCL_CHECK_DIR/logs/link.log"; fail "linking Horovod's objects (log: $NCCL_CHECK_DIR/logs/link.log)"; }
nm -D --defined-only "$nccl/lib/libnccl.so.2" | awk '{print $3}' | sort -u >"$NCCL_CHECK_DIR/nccl.defined"
nm -D --undefined-only "$out" | awk '{print $2}' | sed 's/@.*//' | sort -u >"$NCCL_CHECK_DIR/undefined"
wanted=$(grep -c '^nccl' "$NCCL_CHECK_DIR/undefined" || true)
missing=$(grep '^nccl' "$NCCL_CHECK_DIR/undefined" | comm -23 - "$NCCL_CHECK_DIR/nccl.defined" |
  paste -sd' ' || true)
[ -z "$missing" ] || fail "libnccl.so.2 lacks what Horovod calls: $missing"
[ "$wanted" -gt 0 ] || fail "Horovod's objects call no NCCL function: HAVE_NCCL was not compiled in"
echo "  $(basename "$out"): all $wanted NCCL functions Horovod calls are in libnccl.so.2"
# What the GPU ops call of TensorFlow must be exported by the GPU build of this TensorFlow (the
# `tensorflow` wheel that install.sh's GPU=1 installs; tensorflow-cpu lacks its GPU kernels), in the
# libraries loaded before mpi_lib: TensorFlow 2.21 no longer exports
# stream_executor::gpu::AsGpuStreamValue, and an unpatched GPU build's mpi_lib failed to load on it.
tf_version=$("$PY" -c 'import importlib.metadata as m
for d in ("tensorflow", "tensorflow-cpu"):
    try:
        print(m.version(d), d)
        break
    except m.PackageNotFoundError:
        pass')
[ -n "$tf_version" ] || fail "no TensorFlow in $VENV"
read -r tf_version tf_dist <<<"$tf_version"
if [ "$tf_dist" = tensorflow ]; then
  tf_dir=$("$PY" -c 'import importlib.util as u; print(u.find_spec("tensorflow").submodule_search_locations[0])')
else
  # The GPU build's wheel (about 570 MB), downloaded once; its three libraries kept unpacked.
  tf_dir=$HVD_TRAIN_CACHE/tensorflow-gpu/$tf_version/tensorflow
  if [ ! -d "$tf_dir" ]; then
    tf_whl=$(cached_wheel tensorflow "$tf_version" "the GPU build, about 570 MB") ||
      fail "could not download tensorflow==$tf_version"
    tmp=$(mktemp -d "$HVD_TRAIN_CACHE/.tensorflow-gpu.XXXXXX")
    within "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], sys.argv[3:])' \
      "$tf_whl" "$tmp" tensorflow/libtensorflow_framework.so.2 tensorflow/libtensorflow_cc.so.2 \
      tensorflow/python/_pywrap_tensorflow_internal.so ||
      fail "could not unpack TensorFlow's libraries from $tf_whl"
    mkdir -p "$(dirname "$tf_dir")"
    mv -T "$tmp/tensorflow" "$tf_dir"
    rm -rf "$tmp"
  fi
fi
tf_libs=("$tf_dir"/libtensorflow_framework.so.2 "$tf_dir"/libtensorflow_cc.so.2
  "$tf_dir"/python/_pywrap_tensorflow_internal.so)
nm -D --defined-only "${tf_libs[@]}" 2>/dev/null | awk 'NF >= 3 {print $3}' | sed 's/@.*//' |
  sort -u >"$NCCL_CHECK_DIR/tensorflow.defined"
[ -s "$NCCL_CHECK_DIR/tensorflow.defined" ] || fail "no symbols read from ${tf_libs[*]}"
of_tensorflow='(^|[ (<,])(tensorflow|stream_executor|tsl|xla)::'
tf_called=$(c++filt <"$NCCL_CHECK_DIR/undefined" | grep -cE "$of_tensorflow" || true)
tf_missing=$(comm -23 "$NCCL_CHECK_DIR/undefined" "$NCCL_CHECK_DIR/tensorflow.defined" | c++filt |
  grep -E "$of_tensorflow" | paste -sd';' || true)
[ -z "$tf_missing" ] ||
  fail "TensorFlow $tf_version's GPU build does not export what Horovod's ops call: $tf_missing"
echo "  $(basename "$out"): all $tf_called TensorFlow functions it calls are exported by TensorFlow $tf_version's GPU build"
# The CUDA runtime: linked statically (cudart_static), unless TensorFlow's GPU build, which mpi_lib
# links first, exports it (2.21 does: the calls then bind to TensorFlow's own CUDA runtime).
grep -E '^_*cuda' "$NCCL_CHECK_DIR/undefined" >"$NCCL_CHECK_DIR/cudart.called" || true
cudart_bound=$(comm -12 "$NCCL_CHECK_DIR/cudart.called" "$NCCL_CHECK_DIR/tensorflow.defined" | wc -l)
cudart=$(comm -23 "$NCCL_CHECK_DIR/cudart.called" "$NCCL_CHECK_DIR/tensorflow.defined" | paste -sd' ')
[ -z "$cudart" ] || fail "CUDA runtime symbols left unresolved: $cudart"
if [ "$cudart_bound" -gt 0 ]; then
  echo "  the CUDA runtime: $cudart_bound functions bound to TensorFlow's own (its GPU build exports it)"
else
  echo "  the CUDA runtime: linked statically"
fi
cat >"$NCCL_CHECK_DIR/nccl_link_test.cc" <<'EOF'
// Linked against the wheel's NCCL; run only without arguments, which calls ncclGetVersion alone
// (no GPU needed). "--allreduce" is the path that needs one: it is linked, never run here.
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
#include <nccl.h>

int main(int argc, char** argv) {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return 1;
  std::printf("%d\n", version);
  if (argc > 1 && std::strcmp(argv[1], "--allreduce") == 0) {
    ncclUniqueId id;
    ncclComm_t comm;
    cudaStream_t stream;
    float* buffer;
    if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess ||
        cudaStreamCreate(&stream) != cudaSuccess || cudaMalloc(&buffer, 4 * sizeof(float)) != cudaSuccess)
      return 2;
    if (ncclAllReduce(buffer, buffer, 4, ncclFloat, ncclSum, comm, stream) != ncclSuccess) return 3;
    cudaStreamSynchronize(stream);
    ncclCommDestroy(comm);
  }
  return 0;
}
EOF
within c++ -std=c++17 -I"$cuda/include" -I"$nccl/include" "$NCCL_CHECK_DIR/nccl_link_test.cc" \
  -o "$NCCL_CHECK_DIR/nccl_link_test" -L"$nccl/lib" -lnccl -Wl,-rpath,"$nccl/lib" \
  -L"$cuda/lib64" -lcudart_static -ldl -lrt -pthread >>"$NCCL_CHECK_DIR/logs/link.log" 2>&1 ||
  { show_log "$NCCL_CHECK_DIR/logs/link.log"; fail "linking nccl_link_test (log: $NCCL_CHECK_DIR/logs/link.log)"; }
code=$(within "$NCCL_CHECK_DIR/nccl_link_test") || fail "ncclGetVersion failed in nccl_link_test"
nccl_library=$((code / 10000)).$((code / 100 % 100)).$((code % 100))
[ "$nccl_library" = "$nccl_header" ] ||
  fail "libnccl.so.2 says NCCL $nccl_library, its nccl.h says $nccl_header"
echo "  nccl_link_test: ncclGetVersion = $code; ncclAllReduce linked, not run"
echo "NCCL build path compiles: ${#targets[@]} translation units, nvcc $nvcc_version, NCCL $nccl_library"
