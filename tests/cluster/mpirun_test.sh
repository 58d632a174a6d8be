#!/usr/bin/env bash
# Open MPI's mpirun starts amp_ddp as it is (issue 41): the ranks come from OMPI_COMM_WORLD_*, rank 0's header says
# so, and the job ends with the same parameters, bit for bit, as the same job under ddp-launch. Without MASTER_ADDR
# every rank stops with one line naming it. Skips (77) without mpirun (scripts/bootstrap.sh installs openmpi-bin).
# Usage: mpirun_test.sh <ddp-launch> <amp_ddp> <scratch dir>
set -u
launch=$1 program=$2 scratch=$3
command -v mpirun >/dev/null || { echo "skipped: mpirun not found (apt-get install openmpi-bin)"; exit 77; }
rm -rf "$scratch" && mkdir -p "$scratch"
args=(--synthetic --limit-train 1024 --epochs 1 --batch-size 64 --device cpu --opt-level O2 --check-replicas)
# --allow-run-as-root: CI and this container run as root (the test only); --oversubscribe: 2 ranks on any core count.
mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none)
digest() { sed -n 's/.*bit-identical parameters (FNV-1a \(0x[0-9a-f]*\)).*/\1/p' "$1"; }

"$launch" --nproc-per-node 2 --master-port 0 "$program" "${args[@]}" >"$scratch/launch.txt" 2>&1 ||
  { echo "FAILED: ddp-launch run:"; cat "$scratch/launch.txt"; exit 1; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${mpi[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" "$program" "${args[@]}" >"$scratch/mpirun.txt" 2>&1 ||
  { echo "FAILED: mpirun run:"; cat "$scratch/mpirun.txt"; exit 1; }
grep -q "launched by Open MPI (mpirun): 2 processes, 2 per node (1 node)" "$scratch/mpirun.txt" ||
  { echo "FAILED: rank 0's header does not say Open MPI started the ranks:"; cat "$scratch/mpirun.txt"; exit 1; }
a=$(digest "$scratch/launch.txt") b=$(digest "$scratch/mpirun.txt")
[ -n "$a" ] && [ "$a" = "$b" ] ||
  { echo "FAILED: parameters under ddp-launch ($a) and mpirun ($b) differ"; exit 1; }
echo "mpirun and ddp-launch end with the same parameters (FNV-1a $a)"

# No MASTER_ADDR: one line from each rank naming it, a non-zero exit, no backtrace.
if "${mpi[@]}" "$program" "${args[@]}" >"$scratch/no_addr.txt" 2>&1; then
  echo "FAILED: mpirun without MASTER_ADDR exited 0"; cat "$scratch/no_addr.txt"; exit 1
fi
grep -q "MASTER_ADDR is not set: MPI does not say which host rank 0 is on" "$scratch/no_addr.txt" &&
  ! grep -q "frame #" "$scratch/no_addr.txt" ||
  { echo "FAILED: without MASTER_ADDR:"; cat "$scratch/no_addr.txt"; exit 1; }
echo "without MASTER_ADDR: $(grep -m1 "MASTER_ADDR is not set" "$scratch/no_addr.txt")"

# Preemption: mpirun forwards SIGUSR1 to its ranks (it ends them on SIGTERM itself); with --stop-signal USR1 they
# stop after the same step, save it, and mpirun exits 75; the same command continues and ends with the final
# checkpoint of an unbroken ddp-launch run, byte for byte.
stop_args=(--synthetic --limit-train 2048 --epochs 2 --batch-size 16 --device cpu --opt-level O2 --quiet)
"$launch" --nproc-per-node 2 --master-port 0 "$program" "${stop_args[@]}" --checkpoint-dir "$scratch/unbroken" \
  >"$scratch/unbroken.txt" 2>&1 || { echo "FAILED: the unbroken ddp-launch run:"; cat "$scratch/unbroken.txt"; exit 1; }
preempted=("${mpi[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" "$program" "${stop_args[@]}"
  --checkpoint-dir "$scratch/preempted" --stop-signal USR1 --metrics "$scratch/metrics.jsonl" --metrics-every 1)
"${preempted[@]}" >"$scratch/stopped.txt" 2>&1 &
job=$!
for _ in $(seq 600); do
  [ -f "$scratch/metrics.jsonl" ] && [ "$(wc -l <"$scratch/metrics.jsonl")" -ge 4 ] && break
  sleep 0.1
done
kill -USR1 $job
wait $job
code=$?
[ $code -eq 75 ] && grep -q "every rank stopped after step [0-9]* and saved it" "$scratch/stopped.txt" ||
  { echo "FAILED: mpirun after SIGUSR1 exited $code:"; cat "$scratch/stopped.txt"; exit 1; }
"${preempted[@]}" >"$scratch/resumed.txt" 2>&1 || { echo "FAILED: the resumed run:"; cat "$scratch/resumed.txt"; exit 1; }
cmp -s "$scratch/unbroken/step-000000000128.pt" "$scratch/preempted/step-000000000128.pt" ||
  { echo "FAILED: the resumed mpirun job's final checkpoint differs from the unbroken run's"; exit 1; }
echo "SIGUSR1 to mpirun: $(grep -m1 "^stopped by" "$scratch/stopped.txt" | cut -d';' -f1); the resumed job ends byte-identical"
