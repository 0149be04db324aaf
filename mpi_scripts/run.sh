#!/usr/bin/env bash
# Runs a Python program on NP ranks of this machine (or HOSTS) under mpirun or horovodrun, with the
# project's environment; the launch command is built by hvd_train.core.launch and printed before it runs.
# Usage: [NP=2] [LAUNCHER=mpirun|horovodrun|horovodrun-mpi] [HOSTS=a:2,b:2] [VENV=.venv] \
#        [TIMEOUT=0] mpi_scripts/run.sh program.py [args ...]
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NP=${NP:-2}
LAUNCHER=${LAUNCHER:-mpirun}
VENV=${VENV:-$REPO/.venv}
TIMEOUT=${TIMEOUT:-0}
export PATH=$VENV/bin:$PATH
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
hosts=()
[ -n "${HOSTS:-}" ] && hosts=(--hosts "$HOSTS")
# TIMEOUT>0 bounds the whole job: a hung rank ends it instead of holding the allocation.
wrap=()
[ "$TIMEOUT" -gt 0 ] && wrap=(timeout --kill-after=10 "$TIMEOUT")
exec "${wrap[@]}" "$VENV/bin/python" -m hvd_train.core.launch --np "$NP" --launcher "$LAUNCHER" \
  "${hosts[@]}" -- "$VENV/bin/python" "$@"
