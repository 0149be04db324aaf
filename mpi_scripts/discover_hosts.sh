#!/usr/bin/env bash
# Host discovery for elastic training: prints the "host:slots" lines of HOSTS_FILE, a file that an
# operator, a cluster agent or a test rewrites as machines come and go. horovodrun runs it every
# second and starts or stops workers to match (blank lines and # comments are skipped).
# Usage: [HOSTS_FILE=hosts.txt] mpi_scripts/discover_hosts.sh [HOSTS_FILE]
#   horovodrun -np 2 --min-np 1 --max-np 3 \
#     --host-discovery-script "mpi_scripts/discover_hosts.sh hosts.txt" \
#     python -m hvd_train.cli train --elastic --config configs/digits.yaml
set -euo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
HOSTS_FILE=${1:-${HOSTS_FILE:-}}
if [ -z "$HOSTS_FILE" ]; then
  echo "discover_hosts.sh: give the hosts file as HOSTS_FILE or as the argument" >&2
  exit 2
fi
if [ ! -r "$HOSTS_FILE" ]; then
  echo "discover_hosts.sh: cannot read $HOSTS_FILE" >&2
  exit 1
fi
# Checked here, because horovodrun reports a bad line only as a failed discovery: host:slots.
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%%#*}
  line=${line//[[:space:]]/}
  [ -z "$line" ] && continue
  if ! [[ $line =~ ^[A-Za-z0-9._-]+:[1-9][0-9]*$ ]]; then
    echo "discover_hosts.sh: $HOSTS_FILE: expected host:slots, got '$line'" >&2
    exit 1
  fi
  echo "$line"
done <"$HOSTS_FILE"
