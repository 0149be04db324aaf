# shellcheck shell=bash
# SLURM on the cluster of cluster.sh, which sources this file (docs/cluster.md, "SLURM on the
# cluster"): a munged of the cluster's own, slurmctld on h1, one slurmd per host, all configured
# outside /etc. Uses cluster.sh's STATE, HOSTS, MGMT_NET, on_host, say, die and run.
#
# munged runs in the root namespace (its socket is a path, reachable from every host's namespaces,
# as on a site where each node's munged shares one key); its key is made here, not /etc/munge's.
# slurmctld and slurmd run inside the hosts' namespaces (h1's slurmd is h1's: NodeName is the UTS
# host name), talk over the management subnet, and every slurmd offers its host's one CPU.
# SLURM=1 needs SLURM installed; SLURM=0 leaves it out; by default it runs where it is installed.

SLURM=${SLURM:-auto}
SLURM_DIR=$STATE/slurm
SLURM_CONF_FILE=$SLURM_DIR/slurm.conf
MUNGE_DIR=$STATE/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
# Seconds: requeued jobs wait for the old job's credential to expire (AuthInfo cred_expire), so
# short here; slurmctld's answer and then idle nodes are awaited at most SLURM_WAIT.
SLURM_CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
SLURM_WAIT=${SLURM_WAIT:-30}

# Resolve SLURM=auto to 0 or 1 (SLURM=1 without SLURM installed is an error).
slurm_resolve() {
  case "$SLURM" in
    auto) if command -v slurmctld >/dev/null; then SLURM=1; else SLURM=0; fi ;;
    1) command -v slurmctld >/dev/null \
         || die "SLURM=1 but SLURM is not installed: run mpi_scripts/cluster/install.sh" ;;
    0) ;;
    *) die "SLURM must be 0, 1 or auto, got $SLURM" ;;
  esac
}

slurm_config() {
  local n
  cat <<CONF
# Written by mpi_scripts/cluster/slurm.sh for the cluster in $STATE.
ClusterName=hvdc
SlurmctldHost=h1($MGMT_NET.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=$SLURM_CRED_EXPIRE
StateSaveLocation=$SLURM_DIR/ctld
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmctldLogFile=$SLURM_DIR/slurmctld.log
SlurmdSpoolDir=$SLURM_DIR/%n/spool
SlurmdPidFile=$SLURM_DIR/%n/slurmd.pid
SlurmdLogFile=$SLURM_DIR/%n/slurmd.log
# pmix makes its per-job directory under TmpFS: one per node, or the hosts' steps collide.
TmpFS=$SLURM_DIR/%n/tmp
# No cgroups in a namespace "host": processes are tracked by parentage, not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
# Fast timers: the tests wait on all of these.
MinJobAge=30
KillWait=5
SlurmdTimeout=30
MessageTimeout=10
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
CONF
  for n in $(seq 1 "$HOSTS"); do
    echo "NodeName=h$n NodeAddr=$MGMT_NET.$n NodeHostname=h$n CPUs=1 State=UNKNOWN"
  done
  echo "PartitionName=cluster Nodes=h[1-$HOSTS] Default=YES MaxTime=INFINITE State=UP"
}

# The last lines of a log, on one line: `down` removes the file when a failed `up` ends.
slurm_log_tail() { echo "[$1: $(tail -n 3 "$1" 2>/dev/null | tr '\n' ' ')]"; }

slurm_up() {
  [ "$SLURM" = 1 ] || return 0
  local n tries
  mkdir -p "$SLURM_DIR/ctld"
  mkdir -p "$MUNGE_DIR"
  chmod 0755 "$MUNGE_DIR"  # munged: every client must reach its socket
  for n in $(seq 1 "$HOSTS"); do mkdir -p "$SLURM_DIR/h$n/spool" "$SLURM_DIR/h$n/tmp"; done
  slurm_config >"$SLURM_CONF_FILE"
  # slurmd initialises a cgroup plugin even where nothing uses it; the hosts' own sysfs has no
  # cgroup mounted, which autodetection refuses, so the plugin is named (SLURM reads cgroup.conf
  # from SLURM_CONF's directory).
  echo "CgroupPlugin=cgroup/v1" >"$SLURM_DIR/cgroup.conf"
  mungekey --create --keyfile="$MUNGE_DIR/munge.key"
  chmod 0400 "$MUNGE_DIR/munge.key"
  run munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed"
  run on_host 1 slurmctld -f "$SLURM_CONF_FILE"
  tries=0
  until SLURM_CONF=$SLURM_CONF_FILE scontrol ping 2>/dev/null | grep -q 'is UP'; do
    tries=$((tries + 1))
    [ "$tries" -lt $((SLURM_WAIT * 5)) ] \
      || die "slurmctld does not answer: $(slurm_log_tail "$SLURM_DIR/slurmctld.log")"
    sleep 0.2
  done
  for n in $(seq 1 "$HOSTS"); do run on_host "$n" slurmd -f "$SLURM_CONF_FILE"; done
  tries=0
  until [ "$(SLURM_CONF=$SLURM_CONF_FILE sinfo -h -N -t idle -o %N | sort -u | wc -l)" = "$HOSTS" ]; do
    tries=$((tries + 1))
    [ "$tries" -lt $((SLURM_WAIT * 5)) ] || die "SLURM nodes not idle after ${SLURM_WAIT}s:" \
      "$(SLURM_CONF=$SLURM_CONF_FILE sinfo -N 2>&1 | tr '\n' ';')" \
      "$(for n in $(seq 1 "$HOSTS"); do slurm_log_tail "$SLURM_DIR/h$n/slurmd.log"; done)"
    sleep 0.2
  done
  say "slurm: slurmctld on h1, slurmd on h1..h$HOSTS, idle; SLURM_CONF=$SLURM_CONF_FILE"
}

# Stop what slurm_up started, all at once (slurmctld and slurmd would also end with their hosts'
# namespaces, munged in the root namespace only here).
slurm_down() {
  local pidfile pids=() left
  for pidfile in "$SLURM_DIR"/h*/slurmd.pid "$SLURM_DIR/slurmctld.pid" "$MUNGE_DIR/munged.pid"; do
    [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 1 50); do
    left=$(ps -o pid= -p "$(IFS=,; echo "${pids[*]}")" || true)
    [ -n "$left" ] || return 0
    sleep 0.1
  done
  # shellcheck disable=SC2086 # one pid per word
  kill -KILL $left 2>/dev/null || true
}

# "pid P" of a daemon from its pid file, or "down" (and a non-zero status).
slurm_daemon() {
  local pid
  [ -f "$1" ] && pid=$(cat "$1") && kill -0 "$pid" 2>/dev/null && { echo "pid $pid"; return 0; }
  echo down
  return 1
}

# One line per daemon of a cluster of $1 hosts started with SLURM=$2; non-zero when SLURM should
# run there and a daemon is down.
slurm_status() {
  local count=$1 n ok=0 munged slurmctld slurmd
  [ "$2" = 1 ] || { say "slurm: not started (SLURM=0)"; return 0; }
  munged=$(slurm_daemon "$MUNGE_DIR/munged.pid") || ok=1
  slurmctld=$(slurm_daemon "$SLURM_DIR/slurmctld.pid") || ok=1
  say "slurm: munged $munged, slurmctld (h1) $slurmctld, SLURM_CONF=$SLURM_CONF_FILE"
  for n in $(seq 1 "$count"); do
    slurmd=$(slurm_daemon "$SLURM_DIR/h$n/slurmd.pid") || ok=1
    say "h$n: slurmd $slurmd"
  done
  [ "$ok" = 1 ] || SLURM_CONF=$SLURM_CONF_FILE timeout 10 sinfo -N | sed 's/^/cluster: slurm: /'
  return "$ok"
}

slurm_env() {
  [ -f "$SLURM_CONF_FILE" ] || return 0
  echo "export SLURM_CONF=$SLURM_CONF_FILE"
}
