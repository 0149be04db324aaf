#!/usr/bin/env bash
# Install what mpi_scripts/cluster/cluster.sh needs (as root, idempotent: nothing to do once done):
# openssh-server for the per-host sshd, iproute2 (ip, tc), util-linux (unshare, nsenter, taskset).
#
# The package's own sshd is not wanted: the cluster starts one sshd per host, inside that host's
# namespaces. Where installing the package started a system sshd (no policy-rc.d refusing it), it is
# stopped and disabled again, so the machine keeps no listener on port 22 it did not have before.
set -euo pipefail

usage() {
  cat <<USAGE
usage: [APT_GET=apt-get] $0
  Installs openssh-server, iproute2 and util-linux with apt-get (DEBIAN_FRONTEND=noninteractive)
  if any is missing; a system sshd that the installation started is stopped and disabled.
USAGE
}
case "${1:-}" in -h | --help) usage; exit 0 ;; "") ;; *) usage >&2; exit 2 ;; esac

APT_GET=${APT_GET:-apt-get}
PACKAGES=(openssh-server iproute2 util-linux)

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

sshd_before=$(pgrep -x sshd || true)
echo "+ $APT_GET install -y -qq ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"$APT_GET" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || { "$APT_GET" update -qq && "$APT_GET" install -y -qq --no-install-recommends "${missing[@]}"; }

# A system sshd the package started: stop it, and keep it from starting at boot.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now ssh.service ssh.socket 2>/dev/null || true
fi
for pid in $(pgrep -x sshd || true); do
  case " $sshd_before " in *" $pid "*) ;; *) echo "cluster install: stopping system sshd $pid"; kill "$pid" ;; esac
done
echo "cluster install: installed ${missing[*]}"
