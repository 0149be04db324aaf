#!/usr/bin/env bash
# Reruns the benchmarks whose results (JSON + PNG) live in benchmarks/results/ and in the README.
# Run it on an otherwise idle machine: the figures are ratios measured side by side, but a busy
# machine still widens their spread.
# Usage: [VENV=.venv] [NP=2] [REPEATS=5] benchmarks/run.sh {allreduce|scaling|plan|models|all}
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}
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

case "${1:-}" in
  allreduce | scaling | plan | models) "$1" ;;
  all) allreduce; scaling; plan; models ;;
  *) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
