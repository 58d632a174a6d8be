#!/usr/bin/env bash
# A one-node Slurm on this machine for the tests (issue 41): munged, slurmctld and slurmd with a generated slurm.conf
# (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none: what works as root in a container), everything under DIR.
#   slurm_cluster.sh start DIR   prints the SLURM_CONF to export; fails (exit 1) with the daemons' logs if it cannot
#   slurm_cluster.sh stop DIR    stops the daemons started there
# Needs root and Debian's slurm-wlm and munge (scripts/bootstrap.sh installs them).
set -u
action=$1 dir=$2
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
stop() {
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null
  done
  for _ in $(seq 50); do
    alive=0
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
      [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && alive=1
    done
    [ $alive = 0 ] && return 0
    sleep 0.1
  done
  for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null
  done
  return 0
}
case "$action" in
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
rm -rf "$dir" && mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log"
chmod 711 "$dir" "$dir/munge"
head -c 1024 /dev/urandom >"$dir/munge/munge.key" && chmod 400 "$dir/munge/munge.key"
munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/seed" ||
  { echo "munged did not start:" >&2; cat "$dir/munge/munged.log" >&2; exit 1; }
host=$(hostname)
cat >"$dir/slurm.conf" <<CONF
ClusterName=lta
SlurmctldHost=$host
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
cat "$(dirname "$0")/slurm_plugins.conf" >>"$dir/slurm.conf"
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF" && slurmd -f "$SLURM_CONF" ||
  { echo "slurmctld / slurmd did not start:" >&2; cat "$dir"/log/*.log >&2; stop; exit 1; }
for _ in $(seq 100); do  # the node comes up idle within a few seconds
  if sinfo -h -o %t 2>/dev/null | grep -q idle; then echo "$SLURM_CONF"; exit 0; fi
  sleep 0.2
done
echo "the Slurm node did not come up idle within 20 s:" >&2
sinfo >&2; cat "$dir"/log/*.log >&2
stop
exit 1
