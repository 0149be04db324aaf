#!/usr/bin/env bash
# The project's test command (`make test`): install both stacks where missing, then each test tier,
# then a table of how long every stage took, so that CI's 90-minute budget stays visible. The modern
# stack (VENV) runs every tier; the classic stack (CLASSIC_VENV: TensorFlow 2.15 + Keras 2 with
# Horovod's own Keras optimizer) runs tests/integration/test_classic.py: the parallel suite at np=2
# and 3, the default job, and per-step parity with the modern stack. Last, tests/cluster: hosts made
# of this machine (mpi_scripts/cluster, root) and the product across them: jobs under each launcher,
# SLURM, faults, elastic training, selftest.
# Usage: [VENV=.venv] [CLASSIC_VENV=.venv-classic] tests/run.sh
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VENV=${VENV:-$REPO/.venv}
CLASSIC_VENV=${CLASSIC_VENV:-$REPO/.venv-classic}
HVD_TRAIN_TIMINGS=$(mktemp)
# test_classic.py finds the classic environment here.
HVD_TRAIN_CLASSIC_VENV=$CLASSIC_VENV
export HVD_TRAIN_TIMINGS VENV HVD_TRAIN_CLASSIC_VENV

table() {
  local rc=$?
  printf '\n%-28s %8s  %s\n' stage seconds result
  while read -r name seconds result; do
    printf '%-28s %8s  %s\n' "$name" "$seconds" "$result"
  done <"$HVD_TRAIN_TIMINGS"
  rm -f "$HVD_TRAIN_TIMINGS"
  exit "$rc"
}
trap table EXIT

stage() {
  local name=$1 start=$SECONDS rc=0
  shift
  echo "== $name: $*"
  "$@" || rc=$?
  echo "$name $((SECONDS - start)) $([ "$rc" = 0 ] && echo ok || echo "FAILED($rc)")" >>"$HVD_TRAIN_TIMINGS"
  return "$rc"
}

stage install env STACK=modern bash mpi_scripts/install.sh
stage install-classic env STACK=classic VENV="$CLASSIC_VENV" bash mpi_scripts/install.sh
stage tests/unit "$VENV/bin/python" -m pytest tests/unit -q -p no:cacheprovider
stage tests/integration "$VENV/bin/python" -m pytest tests/integration -v -p no:cacheprovider \
  --durations=0 --ignore=tests/integration/test_classic.py \
  --ignore=tests/integration/test_network_bench.py
stage tests/classic "$VENV/bin/python" -m pytest tests/integration/test_classic.py -v \
  -p no:cacheprovider --durations=0
# The toolkit's own optimizers (LARS, LAMB) against their closed forms on Keras 2 as well.
stage tests/classic-unit "$CLASSIC_VENV/bin/python" -m pytest tests/unit/test_large_batch_optimizers.py \
  tests/unit/test_large_batch_config.py -q -p no:cacheprovider
# Horovod's Keras API on Keras 3 (hvd_train.horovod) in scripts of Horovod's style, under mpirun and
# horovodrun; the classic stack runs the same scripts against Horovod's own module.
stage tests/horovod-api "$VENV/bin/python" -m pytest tests/horovod_api -v -p no:cacheprovider \
  --durations=0
# The cluster tier: hosts as network namespaces with their own sshd (root, CAP_NET_ADMIN).
stage install-cluster bash mpi_scripts/cluster/install.sh
# One stage per part, each with its own cluster (up and down take seconds), so that the table shows
# what each part costs.
cluster_stage() {
  local name=$1
  shift
  stage "$name" timeout 1500 "$VENV/bin/python" -m pytest "$@" -v -p no:cacheprovider --durations=0
}
cluster_stage tests/cluster tests/cluster/test_cluster.py tests/cluster/test_selftest.py
cluster_stage tests/cluster-jobs tests/cluster/test_jobs_across_hosts.py
cluster_stage tests/cluster-slurm tests/cluster/test_slurm.py
cluster_stage tests/cluster-faults tests/cluster/test_faults_hosts.py
# Elastic training and two-level reduction across hosts (about 7 min each on 2 cores) and the
# network benchmark's quick mode (its own 2-host cluster, so it needs the sshd above): in
# `make test-full` only (CI's 90 minutes).
if [ "${HVD_TRAIN_FULL:-}" = 1 ]; then
  cluster_stage tests/cluster-elastic tests/cluster/test_elastic_hosts.py
  cluster_stage tests/cluster-reduction tests/cluster/test_two_level_hosts.py \
    tests/cluster/test_model_groups_hosts.py
  cluster_stage tests/network-bench tests/integration/test_network_bench.py
fi
# The image built and run (podman, buildah, runc; a base image from Debian's packages where no
# registry is reachable): the modern stack with the cached Horovod wheel, non-root, read-only,
# the default job inside, no secret in any layer. `make container-test` does both stacks and more.
stage install-container bash mpi_scripts/container.sh install
stage tests/container env CI=true timeout 720 "$VENV/bin/python" -m pytest tests/container -v \
  -p no:cacheprovider --durations=0
