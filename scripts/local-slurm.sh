#!/usr/bin/env bash
# A real Slurm cluster (munge + slurmctld + slurmd) on this machine for hpctrial's `slurm` test
# tier, on ports away from Slurm's defaults so that it never meets a site's cluster or another
# test cluster. Needs root (slurmd runs jobs as their users). The default partition `debug` is
# this machine's node; the partition `elastic` adds a second node, `hpctrial-b`, served by a
# second slurmd on this machine (NodeHostname is this host, so `srun` and Open MPI's Slurm
# launcher reach it), for the tests of jobs that ask for a range of nodes; the partition `spare`
# adds a third, `hpctrial-c`, for the tests of jobs with a spare node.
#
#   scripts/local-slurm.sh start [DIR]   start, wait until the node is idle, print SLURM_CONF=...
#   scripts/local-slurm.sh stop [DIR]    stop the daemons started from DIR
#   scripts/local-slurm.sh status [DIR]  exit 0 when the cluster answers
#   scripts/local-slurm.sh test-setup [DIR]  start when root; otherwise say why not and exit 0
#                                        (the slurm tests then skip with that reason)
#   scripts/local-slurm.sh munge         start munged when root and it is not answering
#
# munged outlives the cluster on purpose: Open MPI's PMIx tries munge for every mpirun, and a
# socket left by a munged that was killed costs each mpirun 2.3 s of retries (connect refused,
# then sleeps of 0.2 s growing by 0.05 s) before PMIx falls back to its native security.
#
# DIR (default /tmp/hpctrial-slurm) holds slurm.conf, state, spool, logs and pid files.
# HPCTRIAL_SLURM_PORT (default 16817) is slurmctld's port; slurmd takes the next one.
# HPCTRIAL_TEST_USER (default pbsuser, the pbs tier's) is made when missing: an ordinary user.
# Client commands find the cluster with `export SLURM_CONF=DIR/slurm.conf`.
set -euo pipefail

action=${1:-}
dir=$(realpath -m "${2:-${HPCTRIAL_SLURM_DIR:-/tmp/hpctrial-slurm}}")  # the daemons run from /
port=${HPCTRIAL_SLURM_PORT:-16817}
conf=$dir/slurm.conf
second=hpctrial-b
third=hpctrial-c
user=${HPCTRIAL_TEST_USER:-pbsuser}  # the same ordinary user as the pbs tier's

die() { echo "local-slurm: $*" >&2; exit 1; }

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [[ -r /etc/munge/munge.key ]] || die "no /etc/munge/munge.key; install munge (scripts/install-deps.sh)"
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start; see /var/log/munge/munged.log"
}

write_conf() {
  local host cpus memory
  host=$(hostname -s)
  cpus=$(( $(nproc) > 4 ? $(nproc) : 4 ))  # declare at least 4 CPUs so 4-rank jobs fit
  memory=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  install -d -m 0700 "$dir/state" "$dir/spool-$host" "$dir/spool-$second" "$dir/spool-$third"
  # Ordinary users' commands (the container tests run as one) read slurm.conf by its path.
  chmod 0711 "$dir"
  cat >"$conf" <<CONF
# Written by hpctrial's scripts/local-slurm.sh: a single-node test cluster.
ClusterName=hpctrial-test
SlurmctldHost=$host
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after cred_expire + 1 s (default 120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
# The scheduler looks at the queue every second, backfill too, and starts a batch job at once
# (defaults 60 s, 30 s and 3 s): a requeued job starts again as soon as cred_expire allows.
SchedulerParameters=sched_interval=1,bf_interval=1,batch_sched_delay=0
ReturnToService=2
KillWait=10
JobRequeue=1
MpiDefault=none
MailProg=/bin/true
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
NodeName=$second NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=$cpus RealMemory=$memory State=UNKNOWN
NodeName=$third NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 3)) CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=elastic Nodes=$host,$second Default=NO MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=spare Nodes=$host,$second,$third Default=NO MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

running() { SLURM_CONF=$conf timeout 5 scontrol ping 2>/dev/null | grep -q "is UP"; }

# Every daemon started from $dir gets SIGTERM at once; those still there after 10 s, SIGKILL.
stop_all() {
  local pidfile pid pids=()
  for pidfile in "$dir"/slurmd*.pid "$dir/slurmctld.pid"; do
    [[ -f $pidfile ]] || continue
    pid=$(cat "$pidfile")
    [[ -n $pid ]] && kill "$pid" 2>/dev/null && pids+=("$pid")
    rm -f "$pidfile"
  done
  local alive
  for _ in $(seq 100); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

case $action in
  start)
    [[ $(id -u) -eq 0 ]] || die "needs root (slurmd runs jobs as their owners)"
    command -v slurmctld >/dev/null || die "Slurm is not installed; run scripts/install-deps.sh"
    start_munge
    # An ordinary user for the tests of what Slurm lets a user (not root, its administrator) do.
    id "$user" >/dev/null 2>&1 || useradd -m -s /bin/bash "$user" || id "$user" >/dev/null
    if [[ -f $conf ]] && running; then
      echo "SLURM_CONF=$conf"
      exit 0
    fi
    stop_all
    write_conf
    slurmctld -f "$conf" -i || die "slurmctld did not start; see $dir/slurmctld.log"
    host=$(hostname -s)
    slurmd -f "$conf" -N "$host" || die "slurmd did not start; see $dir/slurmd-$host.log"
    slurmd -f "$conf" -N "$second" || die "the second slurmd did not start; see $dir/slurmd-$second.log"
    slurmd -f "$conf" -N "$third" || die "the third slurmd did not start; see $dir/slurmd-$third.log"
    for _ in $(seq 150); do
      states=$(SLURM_CONF=$conf sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ' || true)
      if [[ $states == "idle " ]]; then
        echo "SLURM_CONF=$conf"
        exit 0
      fi
      sleep 0.2
    done
    die "the nodes did not become idle (states '${states:-none}'); see $dir/slurmctld.log and $dir/slurmd-*.log"
    ;;
  test-setup)
    if [[ $(id -u) -ne 0 ]]; then
      echo "local-slurm: not root, so no local Slurm cluster; the slurm tests will skip"
      exit 0
    fi
    exec "$0" start "$dir"
    ;;
  stop)
    stop_all
    ;;
  munge)
    if [[ $(id -u) -eq 0 && -r /etc/munge/munge.key ]]; then start_munge; fi
    ;;
  status)
    [[ -f $conf ]] && running
    ;;
  *)
    echo "usage: $0 start|stop|status|test-setup [DIR] | munge" >&2
    exit 2
    ;;
esac
