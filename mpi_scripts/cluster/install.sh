#!/usr/bin/env bash
# Install what mpi_scripts/cluster/cluster.sh needs (as root, idempotent: nothing to do once done):
# openssh-server for the per-host sshd, iproute2 (ip, tc), util-linux (unshare, nsenter, taskset),
# and SLURM with munge (slurm-wlm: slurmctld, slurmd, slurm-client) for the cluster's scheduler.
#
# The packages' own daemons are not wanted: the cluster starts one sshd and one slurmd per host
# inside that host's namespaces, and its own munged and slurmctld. Where installing a package
# started a system daemon (no policy-rc.d refusing it), it is stopped and disabled again, so the
# machine keeps no daemon or listener it did not have before.
set -euo pipefail

usage() {
  cat <<USAGE
usage: [APT_GET=apt-get] $0
  Installs ${PACKAGES[*]}
  with apt-get (DEBIAN_FRONTEND=noninteractive) if any is missing; a system sshd, munged,
  slurmctld or slurmd that the installation started is stopped and disabled.
USAGE
}

APT_GET=${APT_GET:-apt-get}
PACKAGES=(openssh-server iproute2 util-linux munge slurm-wlm slurmctld slurmd slurm-client)
DAEMONS=(sshd munged slurmctld slurmd)
# The packages' services, as systemd and sysv-rc name them.
SERVICES=(ssh munge slurmctld slurmd)
case "${1:-}" in -h | --help) usage; exit 0 ;; "") ;; *) usage >&2; exit 2 ;; esac

missing=()
for package in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' \
    || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "cluster install: ${PACKAGES[*]} already installed"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "cluster install: needs root to install ${missing[*]}" >&2; exit 1; }

daemons() { for daemon in "${DAEMONS[@]}"; do pgrep -x "$daemon" || true; done; }
before=$(daemons)
echo "+ $APT_GET install -y -qq ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"$APT_GET" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || { "$APT_GET" update -qq && "$APT_GET" install -y -qq --no-install-recommends "${missing[@]}"; }

# A system daemon a package started: stop it, and keep it from starting at boot.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now ssh.socket "${SERVICES[@]/%/.service}" 2>/dev/null || true
elif command -v update-rc.d >/dev/null; then
  for service in "${SERVICES[@]}"; do
    [ ! -e "/etc/init.d/$service" ] || update-rc.d "$service" disable >/dev/null 2>&1 || true
  done
fi
for pid in $(daemons); do
  case " $(echo "$before" | tr '\n' ' ') " in
    *" $pid "*) ;;
    *) echo "cluster install: stopping system $(cat "/proc/$pid/comm" 2>/dev/null) $pid"; kill "$pid" || true ;;
  esac
done
echo "cluster install: installed ${missing[*]}"
