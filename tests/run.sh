#!/usr/bin/env bash
# The project's test command (`make test`): install what is missing, then each test tier, then a
# table of how long every stage took, so that CI's 90-minute budget stays visible.
# Usage: [VENV=.venv] tests/run.sh
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
VENV=${VENV:-$REPO/.venv}
HVD_TRAIN_TIMINGS=$(mktemp)
export HVD_TRAIN_TIMINGS VENV

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

stage install bash mpi_scripts/install.sh
stage tests/unit "$VENV/bin/python" -m pytest tests/unit -q -p no:cacheprovider
stage tests/integration "$VENV/bin/python" -m pytest tests/integration -v -p no:cacheprovider \
  --durations=0
