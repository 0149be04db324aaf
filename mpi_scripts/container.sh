#!/usr/bin/env bash
# hvd_train's image, built and run with podman/buildah where no image registry is reachable
# (docs/containers.md). The base image is made from Debian's packages (mmdebstrap), the project's
# Dockerfile is built on it with the installer inside, and the image is tested as users run it.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: mpi_scripts/container.sh COMMAND
  install   apt-get the container tools (podman, buildah, runc, mmdebstrap); a no-op when present
  base      the local base image: Debian 12 (minbase) from mmdebstrap, reused when present; with
            GPU=1 also that base plus the CUDA toolkit from NVIDIA's Python wheels
  build     the Dockerfile on that base with BASE, STACK and GPU, tagged hvd_train:STACK (GPU=1:
            hvd_train:gpu); prints the image's size, the build's time and a rebuild's time
  test      in the image, as users run it (non-root, --read-only, --tmpfs /tmp, the run directory
            mounted): hvd-train doctor, the default job on 2 workers, no secret in any layer;
            TESTS=1 also runs tests/unit and tests/parallel at np=2
  scan      only the secret scan of the image's saved layers
  cluster   one container per cluster host: Horovod's Docker pattern (sshd in the container on
            SSH_PORT, horovodrun -p) and the HPC pattern (sbatch, srun tasks in containers)
Environment (defaults in brackets):
  STACK=modern|classic [modern]   GPU=0|1 [0]   TAG=image [localhost/hvd_train:STACK, or :gpu]
  BASE=image          the Dockerfile's base [the local Debian base; GPU=1: its CUDA variant]
  HVD_TRAIN_CACHE=d   the host's Horovod wheel cache, bound into the build [~/.cache/hvd_train]
  MIRROR=url          Debian mirror for the base [http://deb.debian.org/debian]
  TIMEOUT=s           limit of each podman/buildah call that builds or trains [1800]
  RUN_DIR=d           host folder the test job writes to [a new temporary folder, removed]
  ACCURACY=a          the default job's final validation accuracy must reach a [0.97]
  SSH_PORT=n          the containers' sshd port for `cluster` [12345]
  PATTERNS=list       what `cluster` runs: horovodrun (Horovod's Docker pattern), slurm (the
                      HPC pattern) [horovodrun slurm]
EOF
}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HERE=$REPO/mpi_scripts/container
# Podman's and buildah's settings are the project's, never /etc's.
export CONTAINERS_CONF=${CONTAINERS_CONF:-$HERE/containers.conf}
STACK=${STACK:-modern}
GPU=${GPU:-0}
case "$STACK" in modern | classic) ;; *) echo "container.sh: STACK must be modern or classic" >&2; exit 2 ;; esac
case "$GPU" in 0 | 1) ;; *) echo "container.sh: GPU must be 0 or 1" >&2; exit 2 ;; esac
BASE_IMAGE=localhost/hvd_train-base:bookworm
CUDA_IMAGE=localhost/hvd_train-base:bookworm-cuda13
if [ "$GPU" = 1 ]; then
  BASE=${BASE:-$CUDA_IMAGE}
  TAG=${TAG:-localhost/hvd_train:gpu}
else
  BASE=${BASE:-$BASE_IMAGE}
  TAG=${TAG:-localhost/hvd_train:$STACK}
fi
HVD_TRAIN_CACHE=${HVD_TRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_train}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
TIMEOUT=${TIMEOUT:-1800}
SSH_PORT=${SSH_PORT:-12345}
PATTERNS=${PATTERNS:-horovodrun slurm}
# The default job's final validation accuracy, as tests/integration/test_train_jobs.py asks.
ACCURACY=${ACCURACY:-0.97}
# The image's user (Dockerfile: USER 1000:1000) and where the default job writes (configs/*.yaml:
# run_dir runs/..., relative to the image's working directory).
IMAGE_UID=1000
IMAGE_RUNS=/opt/hvd_train/src/runs
# The toolkit of the GPU base: NVIDIA's wheels of CUDA 13.0, the toolkit this project's NCCL compile
# check is run with (make nccl-check).
CUDA_VERSION=13.0
CUDA_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-nvtx==13.0.85
  nvidia-cuda-culibos==13.0.85)
# Open MPI's ranks on one host exchange messages through /dev/shm (64 MB by default).
SHM_SIZE=${SHM_SIZE:-1g}

say() { echo "container.sh: $*"; }
die() { echo "container.sh: $*" >&2; exit 1; }
podman_() { timeout --kill-after=10 "$TIMEOUT" podman "$@"; }
buildah_() { timeout --kill-after=10 "$TIMEOUT" buildah "$@"; }

# Every container started here has a name in STARTED and is removed on exit, however it ends.
STARTED=()
TMP=$(mktemp -d /tmp/hvd_train-container.XXXXXX)
# shellcheck disable=SC2317  # run by the EXIT traps
cleanup() {
  local name
  for name in "${STARTED[@]}"; do timeout 60 podman rm -f -t 5 "$name" >/dev/null 2>&1 || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

# run_container NAME ARGS...: podman run --rm under the name NAME (removed by cleanup).
run_container() {
  local name=$1
  shift
  STARTED+=("$name")
  podman_ run --rm --name "$name" --shm-size "$SHM_SIZE" "$@"
}

need_tools() {
  local tool
  for tool in podman buildah runc; do
    command -v "$tool" >/dev/null || die "$tool is missing: run $0 install"
  done
}

cmd_install() {
  local pkg missing=()
  # uidmap: podman's user-namespace helpers; mmdebstrap: the base without a registry.
  for pkg in podman buildah runc mmdebstrap uidmap; do
    dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  if [ ${#missing[@]} = 0 ]; then
    say "container tools present: $(podman --version), $(buildah --version | cut -d' ' -f1-3)"
    return
  fi
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: install them as root: apt-get install -y ${missing[*]}"
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The host's CA bundle for pip during the build (a proxy that re-signs TLS needs it), if it has one.
host_ca() {
  local ca
  for ca in "${PIP_CERT:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
    [ -n "$ca" ] && [ -s "$ca" ] && { echo "$ca"; return; }
  done
  return 1
}

# build_args: the options every buildah build here shares: host network, layer cache, the CA for
# pip (bound read-only at /mnt, an existing empty folder, for the build only).
build_args() {
  local ca
  BUILD=(build --layers --network host)
  if ca=$(host_ca); then
    BUILD+=(--volume "$(dirname "$ca"):/mnt:ro" --build-arg "PIP_CERT=/mnt/$(basename "$ca")")
  fi
}

cmd_base() {
  need_tools
  if podman_ image exists "$BASE_IMAGE"; then
    say "base $BASE_IMAGE: present, reused"
  else
    command -v mmdebstrap >/dev/null || die "mmdebstrap is missing: run $0 install"
    local start=$SECONDS
    say "base $BASE_IMAGE: mmdebstrap --variant=minbase bookworm ($MIRROR)"
    timeout 900 mmdebstrap --quiet --variant=minbase bookworm "$TMP/rootfs.tar" "$MIRROR"
    podman_ import --change 'CMD ["bash"]' "$TMP/rootfs.tar" "$BASE_IMAGE" >/dev/null
    rm -f "$TMP/rootfs.tar"
    say "base $BASE_IMAGE: made in $((SECONDS - start)) s, $(image_size "$BASE_IMAGE")"
  fi
  [ "$GPU" = 1 ] || return 0
  if podman_ image exists "$CUDA_IMAGE"; then
    say "base $CUDA_IMAGE: present, reused"
    return
  fi
  local start=$SECONDS
  say "base $CUDA_IMAGE: $BASE_IMAGE plus CUDA $CUDA_VERSION from NVIDIA's wheels"
  cuda_context "$TMP/cuda-context"
  build_args
  buildah_ "${BUILD[@]}" --build-arg "BASE=$BASE_IMAGE" --build-arg "CUDA_VERSION=$CUDA_VERSION" \
    -t "$CUDA_IMAGE" -f "$HERE/cuda.Containerfile" "$TMP/cuda-context"
  say "base $CUDA_IMAGE: made in $((SECONDS - start)) s, $(image_size "$CUDA_IMAGE")"
}

# cuda_context DIR: DIR/cuda, the CUDA toolkit laid out as /usr/local/cuda-X.Y, from NVIDIA's
# wheels (downloaded once into HVD_TRAIN_CACHE/downloads, as check_nccl_build.sh keeps its NCCL).
cuda_context() {
  local dir=$1 downloads=$HVD_TRAIN_CACHE/downloads/cuda-$CUDA_VERSION whl
  mkdir -p "$dir/cuda"
  if ! ls "$downloads"/*.whl >/dev/null 2>&1; then
    rm -rf "$downloads.part"
    say "downloading ${CUDA_WHEELS[*]}"
    timeout 900 python3 -m pip download --quiet --no-deps --only-binary :all: --no-cache-dir \
      -d "$downloads.part" \
      "${CUDA_WHEELS[@]}"
    mv -T "$downloads.part" "$downloads"
  fi
  for whl in "$downloads"/*.whl; do
    python3 -m zipfile -e "$whl" "$dir/unpacked"
  done
  # Each wheel holds nvidia/cuXY/{bin,include,lib,...}: merged, they are the toolkit's tree.
  cp -a "$dir"/unpacked/nvidia/cu*/. "$dir/cuda/"
  [ -e "$dir/cuda/lib64" ] || ln -s lib "$dir/cuda/lib64"
  [ -e "$dir/cuda/lib/libcudart.so" ] || ln -s libcudart.so.13 "$dir/cuda/lib/libcudart.so"
  chmod -R a+rX "$dir/cuda"
  chmod a+x "$dir"/cuda/bin/* "$dir"/cuda/nvvm/bin/* 2>/dev/null || true
  rm -rf "$dir/unpacked"
  [ -x "$dir/cuda/bin/nvcc" ] || die "the CUDA wheels hold no bin/nvcc"
}

image_size() { podman_ image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

# build_once: the Dockerfile's build; the host's Horovod wheel cache is bound where the installer
# looks for it (the build's own cache mount of /root/.cache holds pip's downloads).
build_once() {
  build_args
  mkdir -p "$HVD_TRAIN_CACHE"
  buildah_ "${BUILD[@]}" --build-arg "BASE=$BASE" --build-arg "STACK=$STACK" --build-arg "GPU=$GPU" \
    --volume "$HVD_TRAIN_CACHE:/root/.cache/hvd_train" -t "$TAG" -f "$REPO/Dockerfile" "$REPO"
}

cmd_build() {
  cmd_base
  local start=$SECONDS build_s rebuild_s
  say "build $TAG (BASE=$BASE STACK=$STACK GPU=$GPU)"
  build_once
  build_s=$((SECONDS - start))
  start=$SECONDS
  build_once >"$TMP/rebuild.log" 2>&1 || { cat "$TMP/rebuild.log"; die "the rebuild failed"; }
  rebuild_s=$((SECONDS - start))
  say "$TAG: size $(image_size "$TAG"), build ${build_s} s, rebuild ${rebuild_s} s" \
    "($(grep -c '^--> Using cache' "$TMP/rebuild.log" || true) of $(grep -c '^STEP' "$TMP/rebuild.log")" \
    "steps from the layer cache)"
}

# scan: every layer of the saved image, unpacked, for private keys and secrets by name and content.
SECRET_NAMES='(^|/)(id_(rsa|dsa|ecdsa|ed25519)|ssh_host_[a-z0-9]+_key|munge\.key|\.netrc|\.pypirc|\.git-credentials|\.docker/config\.json|[^/]*\.(key|p12|pfx))$'
# Certificates (*.pem, *.crt) are public; keys are found by content. CMake's Windows packaging
# template is a throw-away key that CMake ships to everyone.
SECRET_NAMES_ALLOWED='^usr/share/cmake-[0-9.]+/Templates/Windows/Windows_TemporaryKey\.pfx$'
# A PEM private key is its header, a base64 body and its footer (a header alone is a string in
# many libraries, e.g. GnuTLS); tokens stand alone as words, in text files only.
SECRET_KEY_RE='-----BEGIN ([A-Z0-9]+ )?PRIVATE KEY-----\r?\n[A-Za-z0-9+/=:,\s-]{64,}?-----END \1?PRIVATE KEY-----'
SECRET_TOKEN_RE='\b(?:ghp_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{40,}|AKIA[0-9A-Z]{16}|pypi-AgE[A-Za-z0-9_-]{50,})\b'
cmd_scan() {
  need_tools
  local dir=$TMP/saved layer tree found=0 n=0 hits
  mkdir -p "$dir"
  podman_ save --quiet --format docker-dir -o "$dir" "$TAG"
  # Files exactly as a Debian package ships them (dpkg's checksums) are Debian's, the same on every
  # Debian machine (GnuTLS's self-test keys): listed, not failed. Keys made by a package's scripts
  # at install time (ssh host keys) are in no checksum list.
  run_container "hvd_train-scan-$$" --entrypoint sh "$TAG" -c 'cat /var/lib/dpkg/info/*.md5sums' \
    >"$TMP/dpkg.md5"
  for layer in "$dir"/*; do
    # The layers are tars named by digest; the image's config and manifest are not tars.
    tar -tf "$layer" >/dev/null 2>&1 || continue
    n=$((n + 1))
    tree=$TMP/layer
    rm -rf "$tree"
    mkdir -p "$tree"
    tar -xf "$layer" -C "$tree" --no-same-owner
    hits=$( (cd "$tree" && find . -type f -printf '%P\n' | grep -E "$SECRET_NAMES" |
      grep -v -E "$SECRET_NAMES_ALLOWED") || true)
    hits+=$'\n'$( (cd "$tree" && grep -r -l -a -z -P -e "$SECRET_KEY_RE" . | sed 's|^\./||') || true)
    hits+=$'\n'$( (cd "$tree" && grep -r -l -I -P -e "$SECRET_TOKEN_RE" . | sed 's|^\./||') || true)
    while read -r name; do
      [ -n "$name" ] || continue
      if grep -qxF "$(md5sum <"$tree/$name" | cut -c1-32)  $name" "$TMP/dpkg.md5"; then
        echo "  layer ${layer##*/}: $name (Debian's file, unchanged: not a secret of this image)"
      else
        echo "  layer ${layer##*/}: $name"
        found=1
      fi
    done <<<"$hits"
    rm -rf "$tree"
  done
  [ "$n" -gt 0 ] || die "scan: no layer found in the saved image"
  [ "$found" = 0 ] || die "scan: $TAG holds secrets (above)"
  say "scan: $n layers of $TAG: no private key, host key, munge key, .netrc or token"
}

# check_accuracy LOG: the job's last line is result {json}; its final accuracy must reach ACCURACY.
check_accuracy() {
  sed -n 's/^\(\[[^]]*\]<stdout>:\)\{0,1\}result //p' "$1" | tail -n 1 | python3 -c 'import json, sys
final = json.load(sys.stdin)["final"]["accuracy"]
print(f"container.sh: final validation accuracy {final:.4f} (at least {sys.argv[1]})")
sys.exit(final < float(sys.argv[1]))' "$ACCURACY" || die "the default job did not reach its accuracy"
}

cmd_test() {
  need_tools
  podman_ image exists "$TAG" || die "no image $TAG: run $0 build"
  local run_dir=${RUN_DIR:-$TMP/runs} name=hvd_train-test-$$ log=$TMP/train.log
  mkdir -p "$run_dir"
  # Users' way: non-root (the image's default), read-only root, /tmp a tmpfs, runs on the host.
  local common=(--read-only --tmpfs /tmp --volume "$run_dir:$IMAGE_RUNS:U")
  say "test $TAG: hvd-train doctor"
  run_container "$name-doctor" "${common[@]}" "$TAG" doctor
  [ "$(run_container "$name-id" --entrypoint id "${common[@]}" "$TAG" -u)" = "$IMAGE_UID" ] ||
    die "the image does not run as uid $IMAGE_UID by default"
  say "test $TAG: the default job on 2 workers (read-only, run directory $run_dir)"
  run_container "$name-train" "${common[@]}" "$TAG" launch --np 2 -- \
    train --config configs/digits.yaml --overwrite 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || die "the default job failed"
  check_accuracy "$log"
  ls "$run_dir/digits" >/dev/null 2>&1 || die "the job wrote nothing to the host's $run_dir/digits"
  say "test $TAG: the job's files on the host: $(find "$run_dir/digits" -type f | wc -l) in $run_dir/digits"
  if [ "${TESTS:-0}" = 1 ]; then
    # The classic stack runs the unit tests tests/run.sh runs on it (the rest are Keras 3's).
    local unit=(tests/unit)
    [ "$STACK" = classic ] &&
      unit=(tests/unit/test_large_batch_optimizers.py tests/unit/test_large_batch_config.py)
    say "test $TAG: ${unit[*]}"
    run_container "$name-unit" "${common[@]}" --entrypoint python "$TAG" -m pytest "${unit[@]}" -q \
      -p no:cacheprovider
    say "test $TAG: tests/parallel at np=2"
    run_container "$name-parallel" "${common[@]}" --entrypoint python "$TAG" -m hvd_train.core.launch \
      --np 2 --launcher mpirun -- python -m pytest tests/parallel -q -p no:cacheprovider
  fi
  cmd_scan
}

# The cluster's hosts (mpi_scripts/cluster/cluster.sh): its own STATE, brought down on exit.
CLUSTER=$REPO/mpi_scripts/cluster/cluster.sh
CLUSTER_LOCK=/run/hvd_train_cluster.lock
CLUSTER_STATE=${CLUSTER_STATE:-/run/hvd_train_cluster_container}
cluster_() { STATE=$CLUSTER_STATE HOSTS=2 timeout 300 bash "$CLUSTER" "$@"; }

# cluster: under the machine's cluster lock (one cluster per machine), a 2-host cluster up, the
# patterns run in containers, and the cluster down however that ends.
cmd_cluster() {
  need_tools
  podman_ image exists "$TAG" || die "no image $TAG: run $0 build"
  exec 9>"$CLUSTER_LOCK"
  say "cluster: waiting for $CLUSTER_LOCK"
  timeout 1200 flock 9 || die "cluster: $CLUSTER_LOCK stayed held for 20 minutes"
  trap 'cleanup; cluster_ down >/dev/null 2>&1 || true' EXIT
  cluster_ down >/dev/null
  SLURM=1 cluster_ up >/dev/null
  local pattern
  for pattern in $PATTERNS; do
    case "$pattern" in
      horovodrun) cluster_horovodrun ;;
      slurm) cluster_slurm ;;
      *) die "PATTERNS: unknown pattern $pattern (known: horovodrun slurm)" ;;
    esac
  done
}

# The HPC pattern: an sbatch job whose srun tasks (one per host, --mpi=pmix) each run a container
# that shares its host's network, host name, PIDs and IPC (podman run under srun), so that Open MPI
# in the container reaches slurmd's PMIx server through the task's PMIX_* environment and the
# step's directory under TmpFS. The container runs as the job's user (root's jobs here: PMIx
# accepts only the job's uid), read-only; the run directory is the cluster's shared area.
cluster_slurm() {
  local shared=$CLUSTER_STATE/shared slurm_dir=$CLUSTER_STATE/slurm start=$SECONDS n
  local job=$shared/container-job.sh out=$shared/container-job.out
  mkdir -p "$shared/runs"
  for n in 0 1; do STARTED+=("hvd_train-slurm-$$-$n"); done
  # The job's script: files under /tmp would be each host's own, so it lives in the shared area.
  cat >"$job" <<JOB
#!/usr/bin/env bash
set -euo pipefail
# HVD_TRAIN_IFACE: the gradients on the data network (docs/cluster.md, "SLURM on the cluster").
# podman runs in the mount namespace of this script (the machine's, where /sys/fs/cgroup is
# mounted: a cluster host's own sysfs has none, and runc needs cgroups), in the task's network
# and UTS namespaces: what a real node gives podman under srun.
exec srun --mpi=pmix --ntasks-per-node=1 --cpus-per-task=1 bash -c 'exec nsenter --mount=/proc/$$/ns/mnt \\
  timeout $TIMEOUT podman run --rm --name hvd_train-slurm-$$-\$SLURM_PROCID --user 0 --network host \\
  --uts host --ipc host --read-only --tmpfs /tmp --volume $slurm_dir:$slurm_dir \\
  --volume $shared/runs:$IMAGE_RUNS \\
  --env "PMIX_*" --env "SLURM_*" --env "OMPI_*" --env HVD_TRAIN_IFACE=198.18.1.0/24 \\
  $TAG train --config configs/digits.yaml --overwrite'
JOB
  say "cluster: sbatch -N 2: srun --mpi=pmix, each task podman run $TAG (the HPC pattern)"
  (eval "$(cluster_ env)" && cd "$shared" &&
    timeout "$TIMEOUT" sbatch --wait -N 2 --ntasks-per-node=1 --cpus-per-task=1 --output="$out" \
      "$job" >/dev/null) || { tail -n 40 "$out" 2>/dev/null; die "cluster: the sbatch job failed"; }
  grep -v -E 'oneDNN|absl|cpu_feature|AVX' "$out" | tail -n 5
  check_accuracy "$out"
  say "cluster: the default job under SLURM across h1 and h2, 1 container each, in $((SECONDS - start)) s"
}

# Horovod's Docker pattern: one container per host, in the host's network namespace, its sshd on
# SSH_PORT as the image's user; horovodrun -p SSH_PORT in h1's container starts the default job on
# h1 and h2. Every key is made here, for this run, and mounted: none is in the image.
cluster_horovodrun() {
  local ssh_tag=${TAG}-ssh keys=$TMP/ssh n name start
  say "cluster: $ssh_tag (Horovod's Docker pattern: $TAG plus OpenSSH)"
  buildah_ build --layers --network host --build-arg "IMAGE=$TAG" -t "$ssh_tag" \
    -f "$HERE/ssh.Containerfile" "$HERE" >"$TMP/ssh-build.log" 2>&1 ||
    { tail -n 20 "$TMP/ssh-build.log"; die "cluster: building $ssh_tag failed"; }
  # openssh-server's own host keys must not have stayed in a layer.
  TAG=$ssh_tag cmd_scan
  mkdir -p "$keys" "$TMP/runs"
  ssh-keygen -q -t ed25519 -N "" -C hvd_train-container -f "$keys/id_ed25519"
  ssh-keygen -q -t ed25519 -N "" -C hvd_train-container-host -f "$keys/host_ed25519"
  cp "$keys/id_ed25519.pub" "$keys/authorized_keys"
  : >"$keys/known_hosts"
  for n in 1 2; do
    echo "[h$n]:$SSH_PORT $(cut -d' ' -f1,2 "$keys/host_ed25519.pub")" >>"$keys/known_hosts"
  done
  printf 'Host *\n  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n' >"$keys/config"
  chmod 0600 "$keys"/*
  for n in 1 2; do
    name=hvd_train-h$n-$$
    STARTED+=("$name")
    podman_ run -d --rm --name "$name" --hostname "h$n" --network "ns:/run/netns/h$n" \
      --shm-size "$SHM_SIZE" --read-only --tmpfs /tmp --volume "$keys:/home/hvd/.ssh:U" \
      --volume "$TMP/runs:$IMAGE_RUNS:U" "$ssh_tag" "$SSH_PORT" >/dev/null
  done
  start=$SECONDS
  say "cluster: horovodrun -p $SSH_PORT -H h1:1,h2:1 in h1's container: the default job"
  # data0: the hosts' data network (docker0, the decoy, has the same address on every host).
  # --disable-cache: horovodrun would cache its host checks in ~/.horovod, read-only here.
  podman_ exec hvd_train-h1-$$ horovodrun -np 2 -p "$SSH_PORT" -H h1:1,h2:1 --gloo --disable-cache \
    --network-interfaces data0 python -m hvd_train.cli train --config configs/digits.yaml \
    --overwrite 2>&1 | tee "$TMP/cluster-train.log"
  [ "${PIPESTATUS[0]}" = 0 ] || die "cluster: the default job across 2 hosts failed"
  check_accuracy "$TMP/cluster-train.log"
  say "cluster: the default job across h1 and h2, 1 container each, in $((SECONDS - start)) s"
}

main() {
  case "${1:-}" in
    install) cmd_install ;;
    base) cmd_base ;;
    build) cmd_build ;;
    test) cmd_test ;;
    scan) cmd_scan ;;
    cluster) cmd_cluster ;;
    -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

# One line, read whole before it runs, and left by exit: an edit to this file while it runs
# changes nothing of the run.
main "$@"; exit
