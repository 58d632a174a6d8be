#!/usr/bin/env bash
# Question (issue 23): how fast does a ddp-launch job get over a fault, and what does watching for hangs cost?
#   1. kill -9 of a rank: seconds from the kill until the restarted job has trained a step again (it resumed from
#      its newest --checkpoint-dir save and wrote the next one), and the steps it lost;
#   2. SIGSTOP of a rank: seconds from the stop until the launcher names it as hung, beyond --hang-timeout-s;
#   3. the cost of progress reporting: amp_ddp's samples/s with hang detection off and on, runs alternating, and
#      bench_progress_overhead's ns per event;
#   4. a lost node of an elastic job (--nnodes 1:2, one worker per node, --global-batch-size): seconds from kill -9
#      of node 1's launcher (its worker goes with it) until node 0, alone, has trained a step again.
# The job: amp_ddp O2 (bf16), 2 ranks on the CPU, synthetic data. Run it on an idle machine (it prints uptime).
# Usage: benchmarks/fault_recovery.sh [BUILD_DIR] [REPEATS] [PARTS]   (PARTS: which of 1-4 to run, default 1234)
set -euo pipefail
build=${1:-build}
repeats=${2:-5}
parts=${3:-1234}
part() { [[ $parts == *$1* ]]; }
launch=$build/ddp/ddp-launch
amp_ddp=$build/python_free_examples/amp_ddp
for program in "$launch" "$amp_ddp" "$build/benchmarks/bench_progress_overhead"; do
  [[ -x $program ]] || { echo "fault_recovery.sh: $program is missing: build it first (make build)" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--synthetic --batch-size 32 --device cpu --seed 0 --opt-level O2 --epochs 1)
job=("${common[@]}" --limit-train 4096)
echo "fault_recovery.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores: $(uptime)"

now() { date +%s.%N; }
# The launcher's worker with RANK=$2 (the launcher's pid is $1).
worker_pid() {
  local child
  for child in $(cat "/proc/$1/task/$1/children"); do
    if tr '\0' '\n' <"/proc/$child/environ" | grep -qx "RANK=$2"; then echo "$child"; return; fi
  done
}
# Waits (polling every 5 ms) until the file $1 exists; gives up after 120 s.
wait_for_file() {
  local deadline=$(($(date +%s) + 120))
  until [[ -e $1 ]]; do
    (($(date +%s) < deadline)) || { echo "fault_recovery.sh: $1 never appeared" >&2; exit 1; }
    sleep 0.005
  done
}
step_file() { printf '%s/step-%012d.pt' "$1" "$2"; }
stats() { sort -g | awk '{v[NR]=$1} END {printf "median %.2f [min %.2f, max %.2f] over %d", v[int((NR+1)/2)], v[1], v[NR], NR}'; }

if part 1; then
echo
echo "1. kill -9 of rank 1 just after the save of step 10 (--save-every 1), --max-restarts 1:"
recovery=()
for ((i = 0; i < repeats; i++)); do
  dir=$work/kill$i
  "$launch" --nproc-per-node 2 --master-port 0 --max-restarts 1 "$amp_ddp" "${job[@]}" --checkpoint-dir "$dir" \
    --save-every 1 --keep-last 100 >"$work/kill$i.out" 2>"$work/kill$i.err" &
  launcher=$!
  wait_for_file "$(step_file "$dir" 10)"
  kill -9 "$(worker_pid $launcher 1)"
  killed=$(now)
  newest=$(ls "$dir" | grep -c '^step-')  # saves done when it died (steps 1..newest)
  wait_for_file "$(step_file "$dir" $((newest + 1)))"
  recovered=$(now)
  wait $launcher
  resumed=$(grep -o 'continuing from [^ ]*step-[0-9]*' "$work/kill$i.out" | grep -o '[0-9]*$' | sed 's/^0*//')
  seconds=$(awk -v a="$recovered" -v b="$killed" 'BEGIN {printf "%.2f", a - b}')
  recovery+=("$seconds")
  echo "   run $i: killed after step $newest was saved; resumed from step $resumed; the next step saved ${seconds} s after the kill"
done
echo "   kill -> a step trained again: $(printf '%s\n' "${recovery[@]}" | stats) runs (s)"
fi

if part 2; then
echo
echo "2. SIGSTOP of rank 1 just after the save of step 10, --hang-timeout-s 5 --max-restarts 1:"
overshoot=()
for ((i = 0; i < repeats; i++)); do
  dir=$work/stop$i
  "$launch" --nproc-per-node 2 --master-port 0 --max-restarts 1 --hang-timeout-s 5 "$amp_ddp" "${job[@]}" \
    --checkpoint-dir "$dir" --save-every 1 --keep-last 100 >"$work/stop$i.out" 2>"$work/stop$i.err" &
  launcher=$!
  wait_for_file "$(step_file "$dir" 10)"
  kill -STOP "$(worker_pid $launcher 1)"
  stopped=$(now)
  until grep -q 'made no progress' "$work/stop$i.err"; do sleep 0.005; done
  detected=$(now)
  wait $launcher
  seconds=$(awk -v a="$detected" -v b="$stopped" 'BEGIN {printf "%.2f", a - b - 5}')
  overshoot+=("$seconds")
  echo "   run $i: named ${seconds} s after the 5 s timeout: $(grep -o 'made no progress.*' "$work/stop$i.err" | head -1 | cut -c1-150)"
done
echo "   detection beyond the timeout: $(printf '%s\n' "${overshoot[@]}" | stats) runs (s)"
fi

if part 3; then
echo
echo "3. progress reporting: amp_ddp samples/s with --hang-timeout-s 0 (off) and 600 (on), alternating:"
ratios=()
for ((i = 0; i < repeats; i++)); do
  for mode in 0 600; do
    # 16384 samples: 256 steps per rank, long enough for a steady rate (4096 gave 0.7-1.5x between equal runs).
    "$launch" --nproc-per-node 2 --master-port 0 --hang-timeout-s $mode "$amp_ddp" "${common[@]}" --limit-train 16384 \
      >"$work/cost$mode.out" 2>&1
  done
  off=$(grep -o '[0-9.]* samples/s' "$work/cost0.out" | tail -1 | cut -d' ' -f1)
  on=$(grep -o '[0-9.]* samples/s' "$work/cost600.out" | tail -1 | cut -d' ' -f1)
  ratio=$(awk -v a="$on" -v b="$off" 'BEGIN {printf "%.4f", a / b}')
  ratios+=("$ratio")
  echo "   pair $i: off $off, on $on samples/s (on/off $ratio)"
done
echo "   on/off: $(printf '%s\n' "${ratios[@]}" | stats) pairs"
"$build/benchmarks/bench_progress_overhead"
fi

if part 4; then
echo
echo "4. kill -9 of node 1's launcher just after the save of step 10, --nnodes 1:2 --rejoin-wait-s 1 --max-restarts 1:"
lost=()
for ((i = 0; i < repeats; i++)); do
  dir=$work/lost$i
  port=$((29600 + i))
  elastic=(--nnodes 1:2 --nproc-per-node 1 --master-port $port --max-restarts 1 --rejoin-wait-s 1)
  global=(--synthetic --global-batch-size 64 --device cpu --seed 0 --opt-level O2 --epochs 1)  # 2 x 32, as above
  for node in 0 1; do
    "$launch" "${elastic[@]}" --node-rank $node "$amp_ddp" "${global[@]}" --limit-train 4096 --checkpoint-dir "$dir" \
      --save-every 1 --keep-last 100 >"$work/lost$i-$node.out" 2>"$work/lost$i-$node.err" &
    eval "node$node=\$!"
  done
  wait_for_file "$(step_file "$dir" 10)"
  kill -9 "$node1"
  killed=$(now)
  newest=$(ls "$dir" | grep -c '^step-')
  wait_for_file "$(step_file "$dir" $((newest + 1)))"
  recovered=$(now)
  wait "$node0"
  wait "$node1" 2>/dev/null || true
  seconds=$(awk -v a="$recovered" -v b="$killed" 'BEGIN {printf "%.2f", a - b}')
  lost+=("$seconds")
  echo "   run $i: node 1 killed after step $newest was saved; node 0 alone saved the next step ${seconds} s after the kill"
done
echo "   lost node -> a step trained again without it: $(printf '%s\n' "${lost[@]}" | stats) runs (s)"
fi
