#!/usr/bin/env bash
# Question (issue 41): how long from a stop signal to the checkpoint written and every rank exited, and how many
# steps does a preempted job lose? amp_ddp under ddp-launch at 2 and 4 ranks, the examples' job (O2 bf16) and its
# ZeRO-2 run, each --runs times: SIGTERM to the launcher (as Kubernetes sends it) after a step drawn from 5-24,
# the time until ddp-launch exited 75, the step the ranks stopped after and the step the checkpoint holds (steps lost:
# the steps trained past the checkpoint; 0 when it saved the step they stopped at), and the checkpoint's size.
#   benchmarks/preemption_stop_time.sh build [runs]
set -u
build=${1:-build} runs=${2:-3}
launch=$build/ddp/ddp-launch program=$build/python_free_examples/amp_ddp
scratch=$(mktemp -d) && trap 'rm -rf "$scratch"' EXIT
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
printf "%-8s %-6s %-4s %10s %10s %10s %12s\n" job ranks run "stop s" "stopped" "saved" "size MiB"
for job in O2 ZeRO-2; do
  extra="--opt-level O2"
  [ $job = ZeRO-2 ] && extra="--opt-level O2 --zero 2"
  for ranks in 2 4; do
    for run in $(seq "$runs"); do
      dir=$scratch/$job-$ranks-$run
      after=$((5 + RANDOM % 20))
      "$launch" --nproc-per-node $ranks --master-port 0 "$program" --synthetic --epochs 3 --batch-size 32 --device cpu \
        $extra --checkpoint-dir "$dir" --quiet --metrics "$dir.jsonl" --metrics-every 1 >"$dir.out" 2>&1 &
      pid=$!
      lines() { if [ -f "$dir.jsonl" ]; then wc -l <"$dir.jsonl"; else echo 0; fi; }
      while [ "$(lines)" -lt $after ]; do sleep 0.01; done
      start=$(date +%s.%N)
      kill -TERM $pid
      wait $pid
      code=$?
      end=$(date +%s.%N)
      stopped=$(sed -n 's/.*every rank stopped after step \([0-9]*\).*/\1/p' "$dir.out")
      file=$(ls "$dir"/step-*.pt 2>/dev/null | tail -1)
      saved=$(basename "$file" .pt | sed 's/step-0*//')
      [ $code -eq 75 ] || { echo "exit code $code"; cat "$dir.out"; exit 1; }
      printf "%-8s %-6s %-4s %10.2f %10s %10s %12.1f\n" $job $ranks $run "$(echo "$end - $start" | bc)" "$stopped" \
        "$saved" "$(echo "$(stat -c %s "$file") / 1048576" | bc -l)"
    done
  done
done
