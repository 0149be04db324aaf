#!/usr/bin/env bash
# A cluster of HOSTS hosts on this machine (root, CAP_NET_ADMIN): docs/cluster.md.
#
# Host hN is a network namespace (/run/netns/hN) plus a persistent UTS namespace (host name hN) and
# a persistent mount namespace (private /tmp, /dev/shm and $STATE/scratch; everything else, the
# project and $STATE/shared included, is common), kept as bind mounts in $STATE/ns. Every process
# started on a host (its sshd, `exec`, and so all that ssh starts) is pinned to the host's CPU.
#
# Interfaces of hN: data0 198.18.1.N/24 and mgmt0 198.18.2.N/24, veth pairs to the bridges hvdc-data
# (198.18.1.254) and hvdc-mgmt (198.18.2.254) in the root namespace, so that mpirun and ssh work
# from there; docker0 198.19.255.1/24 on every host (the decoy: the same address everywhere, as
# Docker's bridge has on real machines). sshd listens on the management address only; /etc/hosts
# names h1..hN by their data addresses (lines marked, removed by `down`: the file ends up
# byte-identical to the copy kept in $STATE). SLURM (munge, slurmctld on h1, a slurmd per host):
# slurm.sh.
set -euo pipefail

usage() {
  cat <<USAGE
usage: [HOSTS=2] [RATE=unlimited] [DELAY=0] [SLURM=auto] [STATE=/run/hvd_train_cluster] $0 COMMAND
  up               bring HOSTS hosts (1..4) up; a no-op where the same cluster is up already
  down             stop every daemon and remove every namespace, interface, mount, /etc/hosts
                   line and state file of the cluster (safe to run twice)
  status           the hosts, their addresses, CPUs, sshd, link shaping and SLURM daemons;
                   exit 1 when down
  exec HOST CMD..  run CMD on HOST (its namespaces and CPU), in the current directory
  env              shell lines to export for mpirun, horovodrun and SLURM on this cluster
                   (eval "\$($0 env)")
  RATE   per-link rate of every data link, each way: unlimited, 10gbit, 1gbit, ... (tc tbf)
  DELAY  per-link one-way delay, e.g. 0.1ms (tc netem; refused where the kernel has no netem)
  SLURM  1: munged, slurmctld on h1 and a slurmd per host (needs install.sh); 0: none;
         auto: 1 where SLURM is installed
USAGE
}

HOSTS=${HOSTS:-2}
RATE=${RATE:-unlimited}
DELAY=${DELAY:-0}
STATE=${STATE:-/run/hvd_train_cluster}
DATA_NET=198.18.1
MGMT_NET=198.18.2
DECOY_ADDR=198.19.255.1/24
MARK="# hvd_train cluster"
NCPU=$(nproc --all)
# Shared by every host, as on a site with one shared filesystem, also where it lies under /tmp.
PROJECT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=mpi_scripts/cluster/slurm.sh
. "$PROJECT/mpi_scripts/cluster/slurm.sh"

say() { echo "cluster: $*"; }
die() { echo "cluster: $*" >&2; exit 1; }
run() { echo "+ $*"; "$@"; }

host_cpu() { echo $((($1 - 1) % NCPU)); }

# Run "$@" inside host $1's namespaces, on its CPU, in the current directory.
on_host() {
  local n=$1
  shift
  nsenter --net="/run/netns/h$n" --uts="$STATE/ns/h$n.uts" --mount="$STATE/ns/h$n.mnt" \
    --wd="$PWD" taskset -c "$(host_cpu "$n")" "$@"
}

hosts_block() {
  local n
  for n in $(seq 1 "$1"); do echo "$DATA_NET.$n h$n $MARK"; done
}

shape() {
  # $1: device, $2: where ("" root namespace, else a host number)
  local dev=$1 n=$2 qdisc=()
  if [ "$DELAY" != 0 ]; then
    qdisc=(netem delay "$DELAY")
    [ "$RATE" = unlimited ] || qdisc+=(rate "$RATE")
  elif [ "$RATE" != unlimited ]; then
    qdisc=(tbf rate "$RATE" burst 256kb latency 50ms)
  else
    return 0
  fi
  if [ -n "$n" ]; then
    on_host "$n" tc qdisc replace dev "$dev" root "${qdisc[@]}"
  else
    tc qdisc replace dev "$dev" root "${qdisc[@]}"
  fi || die "tc qdisc ${qdisc[*]} on $dev failed (DELAY needs the kernel's sch_netem)"
}

up() {
  [[ $HOSTS =~ ^[1-4]$ ]] || die "HOSTS must be 1..4, got $HOSTS"
  [ "$(id -u)" = 0 ] || die "needs root (and CAP_NET_ADMIN)"
  command -v /usr/sbin/sshd >/dev/null || die "no /usr/sbin/sshd: run mpi_scripts/cluster/install.sh"
  slurm_resolve
  local wanted="HOSTS=$HOSTS RATE=$RATE DELAY=$DELAY SLURM=$SLURM"
  if [ -f "$STATE/config" ]; then
    [ "$(cat "$STATE/config")" = "$wanted" ] \
      || die "a cluster with $(cat "$STATE/config") is up: run down first"
    status >/dev/null && { say "up already ($wanted)"; return 0; }
    say "a cluster was left half up: taking it down first"
    down
  fi
  if ip link show hvdc-data >/dev/null 2>&1 || [ -e /run/netns/h1 ]; then
    die "another cluster (another STATE) is up: take it down with its STATE first"
  fi
  say "up: $wanted, state in $STATE"
  mkdir -p "$STATE"/{ns,keys,shared,scratch,bin}
  # A failed `up` leaves nothing half made.
  trap 'say "up failed: taking it down"; down' EXIT
  echo "$wanted" >"$STATE/config"
  # The namespace files must live on a private mount to be bind-mounted onto.
  run mount --bind "$STATE/ns" "$STATE/ns"
  run mount --make-private "$STATE/ns"

  run ip link add hvdc-data type bridge
  run ip link add hvdc-mgmt type bridge
  run ip addr add "$DATA_NET.254/24" dev hvdc-data
  run ip addr add "$MGMT_NET.254/24" dev hvdc-mgmt
  run ip link set hvdc-data up
  run ip link set hvdc-mgmt up

  ssh-keygen -q -t ed25519 -N "" -C hvd_train-cluster -f "$STATE/keys/id_ed25519"
  cp "$STATE/keys/id_ed25519.pub" "$STATE/keys/authorized_keys"
  : >"$STATE/known_hosts"
  {
    for n in $(seq 1 "$HOSTS"); do printf 'Host h%s\n  HostName %s.%s\n' "$n" "$MGMT_NET" "$n"; done
    cat <<CONFIG
Host *
  User root
  IdentityFile $STATE/keys/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $STATE/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 10
  LogLevel ERROR
CONFIG
  } >"$STATE/ssh_config"
  # horovodrun runs `ssh -o StrictHostKeyChecking=no` from PATH: this ssh uses the cluster's config
  # and keeps host-key checking on (ssh takes the first value given for an option, and a command
  # line -o comes before the config file).
  cat >"$STATE/bin/ssh" <<WRAPPER
#!/bin/sh
exec /usr/bin/ssh -F "$STATE/ssh_config" -o StrictHostKeyChecking=yes "\$@"
WRAPPER
  chmod +x "$STATE/bin/ssh"
  # sshd's privilege separation directory (the system sshd's service would make it).
  if [ ! -d /run/sshd ]; then
    mkdir -m 0755 /run/sshd
    touch "$STATE/made_run_sshd"
  fi

  local n cpu
  for n in $(seq 1 "$HOSTS"); do
    cpu=$(host_cpu "$n")
    run ip netns add "h$n"
    touch "$STATE/ns/h$n.uts" "$STATE/ns/h$n.mnt"
    mkdir -p "$STATE/h$n"
    # The UTS and mount namespaces are made from inside the network namespace, so that the host's
    # own sysfs (mounted below) shows its own interfaces in /sys/class/net.
    # A project under /tmp or /dev/shm is held on a bind mount while those become private, then
    # put back at its own path.
    mkdir -p "$STATE/hold"
    nsenter --net="/run/netns/h$n" unshare --uts="$STATE/ns/h$n.uts" \
      --mount="$STATE/ns/h$n.mnt" --propagation private sh -euc "
        hostname h$n
        mount --bind '$PROJECT' '$STATE/hold'
        mount -t tmpfs -o mode=1777 tmpfs /tmp
        mount -t tmpfs -o mode=1777 tmpfs /dev/shm
        mount -t tmpfs -o mode=0755 tmpfs '$STATE/scratch'
        mkdir -p '$PROJECT'
        mount --bind '$STATE/hold' '$PROJECT'
        umount '$STATE/hold'
        mount -t sysfs sysfs /sys"
    run ip link add "hvdc-h${n}d" type veth peer name data0 netns "h$n"
    run ip link add "hvdc-h${n}m" type veth peer name mgmt0 netns "h$n"
    run ip link set "hvdc-h${n}d" master hvdc-data up
    run ip link set "hvdc-h${n}m" master hvdc-mgmt up
    on_host "$n" sh -euc "
      ip link set lo up
      ip addr add $DATA_NET.$n/24 dev data0
      ip addr add $MGMT_NET.$n/24 dev mgmt0
      ip link set data0 up
      ip link set mgmt0 up
      ip link add docker0 type bridge
      ip addr add $DECOY_ADDR dev docker0
      ip link set docker0 up"
    shape data0 "$n"
    shape "hvdc-h${n}d" ""

    ssh-keygen -q -t ed25519 -N "" -C "h$n" -f "$STATE/keys/h${n}_host_ed25519"
    echo "h$n,$MGMT_NET.$n $(cut -d' ' -f1,2 "$STATE/keys/h${n}_host_ed25519.pub")" >>"$STATE/known_hosts"
    cat >"$STATE/h$n/sshd_config" <<SSHD
ListenAddress $MGMT_NET.$n
Port 22
HostKey $STATE/keys/h${n}_host_ed25519
PidFile $STATE/h$n/sshd.pid
AuthorizedKeysFile $STATE/keys/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
LogLevel ERROR
SSHD
    say "h$n: data $DATA_NET.$n, mgmt $MGMT_NET.$n, decoy ${DECOY_ADDR%/*}, cpu $cpu"
    on_host "$n" /usr/sbin/sshd -f "$STATE/h$n/sshd_config" -E "$STATE/h$n/sshd.log"
  done

  cp /etc/hosts "$STATE/hosts.orig"
  # Written in place (not replaced): /etc/hosts may itself be a bind mount.
  local last
  last=$(tail -c1 "$STATE/hosts.orig")
  { [ -z "$last" ] || echo; hosts_block "$HOSTS"; } >>/etc/hosts
  cp /etc/hosts "$STATE/hosts.up"

  for n in $(seq 1 "$HOSTS"); do
    local tries=0
    until /usr/bin/ssh -F "$STATE/ssh_config" "h$n" true 2>/dev/null; do
      tries=$((tries + 1))
      [ "$tries" -lt 50 ] || die "ssh h$n does not answer (log: $STATE/h$n/sshd.log)"
      sleep 0.1
    done
  done
  slurm_up
  trap - EXIT
  say "up: ${HOSTS} hosts answer ssh"
}

down() {
  local n
  # Only what this state directory made: another STATE's cluster is left alone.
  [ -d "$STATE" ] || { say "down (nothing in $STATE)"; return 0; }
  if [ -f "$STATE/hosts.orig" ]; then
    if cmp -s /etc/hosts "$STATE/hosts.up"; then
      cat "$STATE/hosts.orig" >/etc/hosts
    else
      # Someone else edited /etc/hosts meanwhile: remove only this cluster's lines.
      say "/etc/hosts changed while up: removing only the lines marked '$MARK'"
      grep -vF "$MARK" /etc/hosts >"$STATE/hosts.new" || true
      cat "$STATE/hosts.new" >/etc/hosts
    fi
  fi
  slurm_down
  for n in 1 2 3 4; do
    [ -e "/run/netns/h$n" ] || [ -e "$STATE/ns/h$n.mnt" ] || continue
    if [ -e "/run/netns/h$n" ]; then
      # Every process of the host: its sshd and whatever was started through it or `exec`.
      local pids
      pids=$(ip netns pids "h$n" || true)
      if [ -n "$pids" ]; then
        # shellcheck disable=SC2086 # one pid per word
        kill -TERM $pids 2>/dev/null || true
        for _ in $(seq 1 30); do [ -z "$(ip netns pids "h$n")" ] && break; sleep 0.1; done
        pids=$(ip netns pids "h$n" || true)
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
      fi
    fi
    umount "$STATE/ns/h$n.mnt" 2>/dev/null || true
    umount "$STATE/ns/h$n.uts" 2>/dev/null || true
    if [ -e "/run/netns/h$n" ]; then run ip netns del "h$n"; fi
    ip link del "hvdc-h${n}d" 2>/dev/null || true
    ip link del "hvdc-h${n}m" 2>/dev/null || true
  done
  for bridge in hvdc-data hvdc-mgmt; do
    if ip link show "$bridge" >/dev/null 2>&1; then run ip link del "$bridge"; fi
  done
  umount "$STATE/scratch" 2>/dev/null || true
  while mountpoint -q "$STATE/ns"; do umount "$STATE/ns"; done
  if [ -f "$STATE/made_run_sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
  rm -rf "$STATE"
  say "down"
}

status() {
  [ -f "$STATE/config" ] || { say "down"; return 1; }
  local n hosts ok=0
  hosts=$(sed -n 's/^HOSTS=\([0-9]*\).*/\1/p' "$STATE/config")
  say "$(cat "$STATE/config"), state in $STATE"
  for n in $(seq 1 "$hosts"); do
    local sshd=down
    if [ -f "$STATE/h$n/sshd.pid" ] && kill -0 "$(cat "$STATE/h$n/sshd.pid")" 2>/dev/null; then
      sshd="pid $(cat "$STATE/h$n/sshd.pid")"
    else
      ok=1
    fi
    [ -e "/run/netns/h$n" ] || { say "h$n: no network namespace"; ok=1; continue; }
    say "h$n: data $DATA_NET.$n, mgmt $MGMT_NET.$n, cpu $(host_cpu "$n"), sshd $sshd," \
      "qdisc $(on_host "$n" tc qdisc show dev data0 | cut -d' ' -f2 | head -1)"
  done
  slurm_status "$hosts" "$(sed -n 's/.*SLURM=\([01]\).*/\1/p' "$STATE/config")" || ok=1
  return "$ok"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  exec)
    [ $# -ge 3 ] || { usage >&2; exit 2; }
    [[ $2 =~ ^h([1-4])$ ]] || die "no host $2 (h1..h4)"
    [ -e "/run/netns/$2" ] || die "host $2 is not up"
    shift
    n=${1#h}
    shift
    on_host "$n" "$@"
    ;;
  env)
    [ -f "$STATE/config" ] || die "the cluster is down"
    cat <<ENV
export PATH=$STATE/bin:\$PATH
export OMPI_MCA_plm_rsh_agent="/usr/bin/ssh -F $STATE/ssh_config"
ENV
    slurm_env
    ;;
  -h | --help) usage ;;
  *) usage >&2; exit 2 ;;
esac
