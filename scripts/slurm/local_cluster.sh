#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the tests (and for trying the job script by hand):
#   bash scripts/slurm/local_cluster.sh start    # installs slurm-wlm and munge (Debian, as root) if missing, starts its own munged, slurmctld, slurmd
#   export SLURM_CONF=/var/spool/slurm-local/slurm.conf   # what sbatch, scontrol and the tests then read
#   bash scripts/slurm/local_cluster.sh stop     # stops the daemons it started (by its own pid files)
# Everything lives in /var/spool/slurm-local/: its slurm.conf (Slurm reads SLURM_CONF), its munge key,
# socket and pid file, state and logs. An existing /etc/slurm, /etc/munge or a system munged is never
# touched, and its ports (16817, 16818) are not Slurm's defaults, so that it can run beside a real
# cluster's daemons. No systemd: the daemons are started directly. proctrack/linuxproc, task/none and
# jobacct_gather/none need no cgroups. cred_expire=10 and sched_interval=2 bring a requeued job back
# in about 11 s instead of 205 s.
set -euo pipefail
STATE=/var/spool/slurm-local
CONF=$STATE/slurm.conf
MUNGE=$STATE/munge

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  if [ "$(id -u)" != 0 ]; then echo "local_cluster.sh: start needs root (it installs packages and starts daemons)" >&2; exit 2; fi
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "[slurm] installing slurm-wlm and munge" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
  fi
  mkdir -p "$STATE"/ctld "$STATE"/d "$MUNGE"
  chmod 755 "$STATE"
  chown munge:munge "$MUNGE" && chmod 700 "$MUNGE"
  if [ ! -s "$MUNGE/munge.key" ]; then
    dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none
  fi
  chown munge:munge "$MUNGE/munge.key" && chmod 400 "$MUNGE/munge.key"
  # The socket's folder must be reachable by every user that submits jobs; the key's must not.
  mkdir -p "$STATE/munge-run" && chown munge:munge "$STATE/munge-run" && chmod 755 "$STATE/munge-run"
  pid_alive "$MUNGE/munged.pid" || runuser -u munge -- /usr/sbin/munged --key-file="$MUNGE/munge.key" \
    --socket="$STATE/munge-run/munge.socket" --pid-file="$MUNGE/munged.pid" --log-file="$MUNGE/munged.log" \
    --seed-file="$MUNGE/munged.seed"
  local host node
  host="$(hostname)"
  node="$(slurmd -C | head -1) State=UNKNOWN"
  cat > "$CONF.tmp" <<CONFEOF
ClusterName=local
SlurmctldHost=$host
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10,socket=$STATE/munge-run/munge.socket
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
  mv "$CONF.tmp" "$CONF"
  export SLURM_CONF="$CONF"
  pid_alive "$STATE/slurmctld.pid" || slurmctld -c -f "$CONF"
  pid_alive "$STATE/slurmd.pid" || slurmd -f "$CONF"
  for _ in $(seq 100); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "[slurm] up: $(sinfo -h -o '%P %D %T %C'); export SLURM_CONF=$CONF to use it" >&2
      return 0
    fi
    sleep 0.2
  done
  echo "[slurm] the node did not come up; see $STATE/slurmctld.log, $STATE/slurmd.log and $MUNGE/munged.log" >&2
  exit 1
}

stop() {
  local f
  for f in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" "$MUNGE/munged.pid"; do
    if pid_alive "$f"; then kill "$(cat "$f")" || true; fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  conf) echo "$CONF" ;;
  *) echo "usage: bash scripts/slurm/local_cluster.sh start|stop|conf" >&2; exit 2 ;;
esac
