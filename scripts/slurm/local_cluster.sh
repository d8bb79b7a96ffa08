#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the tests (and for trying the job script by hand):
#   bash scripts/slurm/local_cluster.sh start    # installs slurm-wlm and munge (Debian, as root) if missing, starts munged, slurmctld, slurmd
#   bash scripts/slurm/local_cluster.sh stop     # stops them by pid
# No systemd: the daemons are started directly. proctrack/linuxproc, task/none and
# jobacct_gather/none need no cgroups. cred_expire=10 and sched_interval=2 bring a requeued job
# back in about 11 s instead of 205 s. State and logs: /var/spool/slurm-local/.
set -euo pipefail
STATE=/var/spool/slurm-local
CONF=/etc/slurm/slurm.conf

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  if [ "$(id -u)" != 0 ]; then echo "local_cluster.sh: start needs root (it installs packages and starts daemons)" >&2; exit 2; fi
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "[slurm] installing slurm-wlm and munge" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
  mkdir -p "$STATE"/ctld "$STATE"/d /etc/slurm /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  pid_alive /run/munge/munged.pid || runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  local host node
  host="$(hostname)"
  node="$(slurmd -C | head -1) State=UNKNOWN"
  cat > "$CONF" <<CONFEOF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
KillWait=30
MinJobAge=300
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
MpiDefault=none
$node
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFEOF
  pid_alive "$STATE/slurmctld.pid" || slurmctld -c
  pid_alive "$STATE/slurmd.pid" || slurmd
  for _ in $(seq 100); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then echo "[slurm] up: $(sinfo -h -o '%P %D %T %C')" >&2; return 0; fi
    sleep 0.2
  done
  echo "[slurm] the node did not come up; see $STATE/slurmctld.log and $STATE/slurmd.log" >&2
  exit 1
}

stop() {
  local f
  for f in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" /run/munge/munged.pid; do
    if pid_alive "$f"; then kill "$(cat "$f")" || true; fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: bash scripts/slurm/local_cluster.sh start|stop" >&2; exit 2 ;;
esac
