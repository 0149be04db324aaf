#!/usr/bin/env bash
# Reruns the benchmarks whose results (JSON + PNG) live in benchmarks/results/ and in the README.
# Run it on an otherwise idle machine: the figures are ratios measured side by side, but a busy
# machine still widens their spread.
# Usage: [VENV=.venv] [CLASSIC_VENV=.venv-classic] [NP=2] [REPEATS=5] benchmarks/run.sh
#          {allreduce|scaling|plan|models|peers|overhead|cycle|controllers|stacks|network|
#           large-batch|sharded-state|gloo-pairs|fusion-copies|embedding-memory|embedding-network|all}
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}
CLASSIC_VENV=${CLASSIC_VENV:-$REPO/.venv-classic}
NP=${NP:-2}
REPEATS=${REPEATS:-5}
OUT=${OUT:-$REPO/benchmarks/results}
export PATH=$VENV/bin:$PATH TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
cd "$REPO"

run() { echo "+ $*"; "$@"; }

allreduce() {
  # Also records Horovod's timeline at the largest size: where its time goes.
  run hvd-train bench allreduce --np "$NP" --out "$OUT"
}
scaling() {
  # The peers' setting (../shared/peers): ResNet-20, batch 64 per worker, synthetic 32x32x3.
  run hvd-train bench scaling --np "$NP" --model resnet20 --batch-size 64 --repeats "$REPEATS" \
    --straggler rank=1,delay_ms=200 --out "$OUT"
}
plan() { run hvd-train plan --out "$OUT"; }
models() { run "$VENV/bin/python" benchmarks/models.py --np "$NP" --out "$OUT"; }
# Side by side, alternated, as ratios to the no-communication ceiling (benchmarks/peers.py).
peers() {
  # Classic stack (Keras 2), where Horovod's own Keras recipe runs: the peers against the toolkit.
  run "$CLASSIC_VENV/bin/python" -m benchmarks.peers compare --np "$NP" --repeats "$REPEATS" \
    --name peers-classic --out "$OUT" \
    ceiling mwms horovod-gloo horovod-mpirun toolkit-gloo toolkit-mpirun
}
overhead() {
  # One worker with the threads the toolkit gives it (all cores): its fit path against plain
  # Keras fit(), same model, data, batch and threads.
  run "$VENV/bin/python" -m benchmarks.peers compare --np 1 --repeats "$((REPEATS + 2))" \
    --epochs 5 --threads "$(nproc)" --name overhead --out "$OUT" keras toolkit
}
cycle() {
  # Gloo: Horovod's default cycle (1 ms) against the derived one, and a fixed 50 ms.
  run "$VENV/bin/python" -m benchmarks.peers compare --np "$NP" --repeats "$REPEATS" \
    --name cycle-gloo --out "$OUT" ceiling toolkit-gloo@cycle=1 toolkit-gloo toolkit-gloo@cycle=50
}
controllers() {
  # Where Gloo's step time goes against MPI's: step breakdown and each thread group's CPU.
  run hvd-train bench controllers --np "$NP" --repeats 3 --out "$OUT"
}
stacks() {
  # One worker, one thread, plain Keras: the modern stack per worker against the classic one,
  # and TensorFlow's oneDNN CPU kernels against its Eigen ones.
  run "$VENV/bin/python" -m benchmarks.stacks --rounds "$REPEATS" --out "$OUT"
}

network() {
  # The cluster (root) at each link rate, holding the machine's cluster lock: docs/network.md.
  # [RATES="unlimited 10gbit 1gbit"] [MODELS=...] [VARIANTS=...] [LAYOUTS="2x1 2x2"] [STEPS=5]
  # [CONTROLLERS="mpi gloo": a job under each] [NAME=network: the result files' name]
  # [QUICK=1: 1 rate, ResNet-20, 2 variants, 2x1]
  local rates models variants layouts controllers args
  read -ra rates <<<"${RATES:-unlimited 10gbit 1gbit}"
  read -ra controllers <<<"${CONTROLLERS:-mpi}"
  read -ra models <<<"${MODELS:-}"
  read -ra variants <<<"${VARIANTS:-}"
  read -ra layouts <<<"${LAYOUTS:-2x1 2x2}"
  args=(--rates "${rates[@]}" --layouts "${layouts[@]}" --steps "${STEPS:-5}")
  args+=(--controllers "${controllers[@]}")
  [ -z "${NAME:-}" ] || args+=(--name "$NAME")
  [ ${#models[@]} = 0 ] || args+=(--models "${models[@]}")
  [ ${#variants[@]} = 0 ] || args+=(--variants "${variants[@]}")
  [ "${QUICK:-0}" = 0 ] || args+=(--quick)
  run flock /run/hvd_train_cluster.lock "$VENV/bin/python" -m benchmarks.network run \
    "${args[@]}" --out "$OUT"
}

large_batch() {
  # Accuracy against the global batch per learning-rate recipe: docs/large-batch.md.
  run "$VENV/bin/python" -m benchmarks.large_batch --out "$OUT"
}
sharded_state() {
  # Per-rank optimizer bytes and peak RSS, Adam sharded or not, N = 1, 2, 4: docs/knobs.md.
  run "$VENV/bin/python" -m benchmarks.sharded_state --out "$OUT"
}
embedding_network() {
  # The split table against the same model data parallel on the cluster (root, holding the
  # machine's cluster lock): docs/larger-models.md. [RATES="unlimited 1gbit"] [LAYOUTS="2x1 2x2"]
  local rates layouts
  read -ra rates <<<"${RATES:-unlimited 1gbit}"
  read -ra layouts <<<"${LAYOUTS:-2x1 2x2}"
  run flock /run/hvd_train_cluster.lock "$VENV/bin/python" -m benchmarks.embedding_network \
    --rates "${rates[@]}" --layouts "${layouts[@]}" --out "$OUT"
}
embedding_memory() {
  # Per-rank table memory and step time, the table split by rows or not, N = 1, 2, 4: docs/larger-models.md.
  run "$VENV/bin/python" -m benchmarks.embedding_memory --out "$OUT"
}
gloo_pairs() {
  # Collectives before and after a ReduceScatter, Gloo and MPI: docs/performance.md.
  run "$VENV/bin/python" -m benchmarks.gloo_pairs --np "$NP" --out "$OUT"
}
fusion_copies() {
  # The gradients' allreduce with and without large tensors alone, both controllers: docs/performance.md.
  run "$VENV/bin/python" -m benchmarks.fusion_copies --np "$NP" --out "$OUT"
}

case "${1:-}" in
  allreduce | scaling | plan | models | peers | overhead | cycle | controllers | stacks | network) "$1" ;;
  large-batch) large_batch ;;
  sharded-state) sharded_state ;;
  gloo-pairs) gloo_pairs ;;
  fusion-copies) fusion_copies ;;
  embedding-memory) embedding_memory ;;
  embedding-network) embedding_network ;;
  all) allreduce; scaling; plan; models; overhead; peers; cycle; controllers; stacks ;;
  *) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
