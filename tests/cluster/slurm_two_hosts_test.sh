#!/usr/bin/env bash
# Slurm across two hosts (issue 41): two Linux network namespaces joined by a veth pair (as ddp's two-host test), a
# slurmd in each (nodes h0 and h1, each with its own address; each sees an /etc/hosts of the two names, bind-mounted
# in a mount namespace of its own, as a cluster's DNS would give), slurmctld beside h0, one munged. Then:
#   srun -N2 -n2 amp_ddp     one rank per host; the ranks find rank 0's host from Slurm's node list (h0) and end
#                            with the same parameters, bit for bit, as ddp-launch --nproc-per-node 2 on one host
#   sbatch -N2 docs/clusters/amp_ddp_preemptible.sbatch, scancel --signal=USR1 mid-epoch: both hosts' ranks stop
#                            after the same step and save it, rank 0 requeues, and the requeued job ends with the
#                            unbroken run's final checkpoint, byte for byte
# The namespaces are entered with nsenter --net (ip netns exec remounts /sys, and slurmd then finds no cgroup
# filesystem). Skips (77) without root, iproute2, util-linux's unshare/nsenter, or slurm-wlm and munge. Every
# namespace and daemon it makes is removed on exit.
# Usage: slurm_two_hosts_test.sh <source dir> <ddp-launch> <amp_ddp> <scratch dir>
set -u
source_dir=$1 launch=$2 program=$3 scratch=$4
[ "$(id -u)" = 0 ] || { echo "skipped: needs root for network namespaces and the Slurm daemons"; exit 77; }
for tool in ip unshare nsenter munged slurmctld slurmd srun sbatch scancel scontrol; do
  command -v $tool >/dev/null || { echo "skipped: $tool not found (apt-get install iproute2 util-linux slurm-wlm munge)"; exit 77; }
done
rm -rf "$scratch" && mkdir -p "$scratch"/{munge,state,log,spool.h0,spool.h1}
chmod 711 "$scratch" "$scratch/munge"
tag=lts$$ ns0=lts$$h0 ns1=lts$$h1 addr0=10.233.0.1 addr1=10.233.0.2
cleanup() {
  for pid in "$scratch"/slurmd.h0.pid "$scratch"/slurmd.h1.pid "$scratch"/slurmctld.pid "$scratch"/munge/munged.pid; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null
  done
  sleep 0.5
  for ns in "$ns0" "$ns1"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
}
trap cleanup EXIT
fail() {
  echo "FAILED: $1"
  [ -n "${2:-}" ] && cat "$2"
  for log in "$scratch"/log/*.log; do echo "---- $log"; tail -n 15 "$log"; done
  exit 1
}
ip netns add "$ns0" 2>"$scratch/netns.err" || { echo "skipped: cannot create a network namespace: $(cat "$scratch/netns.err")"; exit 77; }
ip netns add "$ns1" || fail "the second namespace"
# The same interface name on both hosts, so that one GLOO_SOCKET_IFNAME serves the job (names are per namespace).
ip link add lta0 netns "$ns0" type veth peer name lta0 netns "$ns1" || fail "a veth pair"
ip -n "$ns0" addr add $addr0/24 dev lta0 && ip -n "$ns1" addr add $addr1/24 dev lta0 || fail "the addresses"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up && ip -n "$ns" link set lta0 up || fail "links up in $ns"; done
printf "127.0.0.1 localhost\n%s h0\n%s h1\n" $addr0 $addr1 >"$scratch/hosts"
head -c 1024 /dev/urandom >"$scratch/munge/munge.key" && chmod 400 "$scratch/munge/munge.key"
munged --force --socket="$scratch/munge/munge.socket" --key-file="$scratch/munge/munge.key" \
  --pid-file="$scratch/munge/munged.pid" --log-file="$scratch/log/munged.log" --seed-file="$scratch/munge/seed" ||
  fail "munged did not start"
cat >"$scratch/slurm.conf" <<CONF
ClusterName=lta2
SlurmctldHost=$(hostname)($addr0)
AuthType=auth/munge
AuthInfo=socket=$scratch/munge/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$scratch/state
SlurmdSpoolDir=$scratch/spool.%n
SlurmctldPidFile=$scratch/slurmctld.pid
SlurmdPidFile=$scratch/slurmd.%n.pid
SlurmctldLogFile=$scratch/log/slurmctld.log
SlurmdLogFile=$scratch/log/slurmd.%n.log
NodeName=h0 NodeAddr=$addr0 CPUs=$(nproc)
NodeName=h1 NodeAddr=$addr1 CPUs=$(nproc)
PartitionName=debug Nodes=h0,h1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
cat "$source_dir/tests/cluster/slurm_plugins.conf" >>"$scratch/slurm.conf"
export SLURM_CONF="$scratch/slurm.conf"
on0() { nsenter --net=/var/run/netns/"$ns0" "$@"; }
on0 slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
for k in 0 1; do
  ns=$ns0 && [ $k = 1 ] && ns=$ns1
  unshare --mount --propagation private bash -c \
    "mount --bind '$scratch/hosts' /etc/hosts && exec nsenter --net=/var/run/netns/$ns slurmd -N h$k -f '$SLURM_CONF'" ||
    fail "slurmd h$k did not start"
done
for _ in $(seq 100); do
  [ "$(on0 sinfo -h -o %t 2>/dev/null | tr -d '\n')" = idle ] && [ "$(on0 sinfo -h -N -o %N | wc -l)" = 2 ] && break
  sleep 0.2
done
[ "$(on0 sinfo -h -o %t)" = idle ] || fail "the two nodes did not come up idle: $(on0 sinfo)"

args="--synthetic --limit-train 1024 --epochs 1 --batch-size 64 --device cpu --opt-level O2 --check-replicas"
digest() { sed -n 's/.*bit-identical parameters (FNV-1a \(0x[0-9a-f]*\)).*/\1/p' "$1"; }
"$launch" --nproc-per-node 2 --master-port 0 "$program" $args >"$scratch/launch.txt" 2>&1 ||
  fail "the ddp-launch run" "$scratch/launch.txt"
want=$(digest "$scratch/launch.txt")
# OMP_NUM_THREADS=1: as ddp-launch's 2 workers on one host have (a rank alone on its host would use every core, and
# other thread counts sum in other orders).
(cd "$scratch" && on0 timeout 300 srun -N2 -n2 --export=ALL,GLOO_SOCKET_IFNAME=lta0,OMP_NUM_THREADS=1 "$program" $args) \
  >"$scratch/srun.txt" 2>&1 || fail "srun -N2 -n2" "$scratch/srun.txt"
grep -q "launched by slurm: job [0-9]*, step 0, 2 nodes x 1 task" "$scratch/srun.txt" ||
  fail "rank 0's header does not say 2 nodes" "$scratch/srun.txt"
[ -n "$want" ] && [ "$(digest "$scratch/srun.txt")" = "$want" ] ||
  fail "srun -N2 -n2 ended with other parameters than ddp-launch ($want)" "$scratch/srun.txt"
echo "srun -N2 -n2 across two hosts: the same parameters as ddp-launch on one ($want)"

# Preemption across the two hosts.
stop_args="--synthetic --limit-train 2048 --epochs 2 --batch-size 16 --device cpu --opt-level O2 --quiet"
final=step-000000000128.pt
"$launch" --nproc-per-node 2 --master-port 0 "$program" $stop_args --checkpoint-dir "$scratch/unbroken" \
  >"$scratch/unbroken.txt" 2>&1 || fail "the unbroken ddp-launch run" "$scratch/unbroken.txt"
job=$(cd "$scratch" && PROGRAM="$program" CHECKPOINT_DIR="$scratch/preempted" GLOO_SOCKET_IFNAME=lta0 OMP_NUM_THREADS=1 \
  ARGS="$stop_args --metrics $scratch/metrics.jsonl --metrics-every 1" \
  on0 sbatch --parsable -N2 --ntasks-per-node=1 --output="$scratch/job.txt" \
  "$source_dir/docs/clusters/amp_ddp_preemptible.sbatch") || fail "sbatch -N2 amp_ddp_preemptible.sbatch"
state() { on0 scontrol show job "$job" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
for _ in $(seq 600); do
  [ -f "$scratch/metrics.jsonl" ] && [ "$(wc -l <"$scratch/metrics.jsonl")" -ge 4 ] && break
  sleep 0.1
done
[ "$(state)" = RUNNING ] || fail "the job is not running after its first steps ($(state))" "$scratch/job.txt"
on0 scancel --signal=USR1 "$job" || fail "scancel --signal=USR1"
for _ in $(seq 600); do
  grep -q "is back in the queue" "$scratch/job.txt" 2>/dev/null && [ "$(state)" = PENDING ] && break
  sleep 0.1
done
grep -q "is back in the queue" "$scratch/job.txt" || fail "the job was not requeued" "$scratch/job.txt"
on0 scontrol update JobId="$job" StartTime=now || fail "scontrol update StartTime=now"
for _ in $(seq 1800); do
  case $(state) in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
  sleep 0.1
done
[ "$(state)" = COMPLETED ] || fail "the requeued job ended $(state)" "$scratch/job.txt"
grep -q "launched by slurm: job $job, step 0, 2 nodes x 1 task" "$scratch/job.txt" ||
  fail "the job did not run on both hosts" "$scratch/job.txt"
stop_line=$(grep -m1 "^stopped by SIGUSR1" "$scratch/job.txt") || fail "no stop line" "$scratch/job.txt"
cmp -s "$scratch/unbroken/$final" "$scratch/preempted/$final" ||
  fail "the requeued two-host job's final checkpoint differs from the unbroken run's" "$scratch/job.txt"
echo "sbatch -N2, scancel --signal=USR1: $stop_line"
echo "requeued across two hosts: the final checkpoint is byte for byte the unbroken run's"
