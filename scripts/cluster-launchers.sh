#!/usr/bin/env bash
# The cluster launchers the multi-process tests run under (tests/test_cluster_launchers.py): Debian's Open MPI
# (mpirun) and a single-node Slurm (srun) of this host, munged, slurmctld and slurmd started as root.
#   scripts/cluster-launchers.sh install   apt-get the packages (openmpi-bin, slurm-wlm, munge) when missing
#   scripts/cluster-launchers.sh start     write /etc/slurm/slurm.conf for this host, start the daemons, wait for
#                                          the node to be idle
#   scripts/cluster-launchers.sh stop      stop the daemons this script started
# Where a step cannot be done (no root, no package), it says why on stderr and exits 0: the tests then skip with
# that reason (they look for mpirun and a responding Slurm themselves).
set -uo pipefail
STATE=/run/cfp-slurm
CONF=/etc/slurm/slurm.conf

say() { echo "cluster-launchers: $*" >&2; }

install() {
  if command -v mpirun >/dev/null && command -v srun >/dev/null && command -v munged >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then say "not root: cannot install openmpi-bin slurm-wlm munge"; return 0; fi
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin slurm-wlm munge; } \
    >/tmp/cfp-launchers-apt.log 2>&1 || say "apt-get install failed (see /tmp/cfp-launchers-apt.log)"
}

write_conf() {
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  mkdir -p /etc/slurm "$STATE" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  cat >"$CONF" <<EOF
# written by cfp's scripts/cluster-launchers.sh: one node, this host, daemons as root
ClusterName=cfp
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# a killed task ends its step at once (srun --kill-on-bad-exit does the same per run)
KillOnBadExit=1
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=cfp Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

start() {
  if [ "$(id -u)" != 0 ]; then say "not root: cannot start munged, slurmctld, slurmd"; return 0; fi
  for tool in munged slurmctld slurmd sinfo; do
    command -v $tool >/dev/null || { say "no $tool (run: $0 install)"; return 0; }
  done
  if sinfo -h -o %T 2>/dev/null | grep -q idle; then return 0; fi   # already up
  write_conf
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null
  pgrep -x munged >/dev/null || runuser -u munge -- munged || munged --force || say "munged did not start"
  slurmctld -i || say "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
  slurmd || say "slurmd did not start (see /var/log/slurm/slurmd.log)"
  for _ in $(seq 1 60); do
    if sinfo -h -o %T 2>/dev/null | grep -q idle; then say "Slurm up: $(sinfo -h -o '%P %D %T %N')"; return 0; fi
    sleep 0.5
  done
  say "the Slurm node did not become idle in 30 s: $(sinfo -h 2>&1 | head -1)"
}

stop() {
  for pid in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null
  done
  return 0
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
