#!/usr/bin/env bash
# A preempted Slurm job loses no work (issue 41), on a one-node Slurm the test starts (slurm_cluster.sh) and stops:
# docs/clusters/amp_ddp_preemptible.sbatch itself is submitted; once a few steps ran, `scancel --signal=USR1` (what
# `#SBATCH --signal=USR1@90` sends before the time limit) reaches both ranks; they stop after the same step, save it, rank 0
# requeues the job (scontrol requeue), and the requeued job continues from that checkpoint and ends with the final
# checkpoint an unbroken ddp-launch run writes, byte for byte. Slurm holds a requeued job for a while (Reason=
# BeginTime); the test releases it at once with `scontrol update StartTime=now`, as an operator may.
# Skips (77) without root or without slurm-wlm and munge (scripts/bootstrap.sh installs them).
# Usage: slurm_preemption_test.sh <source dir> <ddp-launch> <amp_ddp> <scratch dir>
set -u
source_dir=$1 launch=$2 program=$3 scratch=$4
slurm_tools="srun sbatch scancel scontrol"
source "$source_dir/tests/cluster/slurm_prelude.sh"
# 2048 samples, 16 per rank: 64 steps per epoch, 128 in the 2 epochs.
args="--synthetic --limit-train 2048 --epochs 2 --batch-size 16 --device cpu --opt-level O2 --quiet"
final=step-000000000128.pt

"$launch" --nproc-per-node 2 --master-port 0 "$program" $args --checkpoint-dir "$scratch/unbroken" \
  >"$scratch/unbroken.txt" 2>&1 || fail "the unbroken ddp-launch run" "$scratch/unbroken.txt"

job=$(cd "$scratch" && PROGRAM="$program" CHECKPOINT_DIR="$scratch/preempted" \
  ARGS="$args --metrics $scratch/metrics.jsonl --metrics-every 1" \
  sbatch --parsable --output="$scratch/job.txt" "$source_dir/docs/clusters/amp_ddp_preemptible.sbatch") ||
  fail "sbatch docs/clusters/amp_ddp_preemptible.sbatch"
state() { scontrol show job "$job" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
for _ in $(seq 600); do  # a few steps in: 4 metrics lines
  [ -f "$scratch/metrics.jsonl" ] && [ "$(wc -l <"$scratch/metrics.jsonl")" -ge 4 ] && break
  sleep 0.1
done
[ "$(state)" = RUNNING ] || fail "the job is not running after its first steps ($(state))" "$scratch/job.txt"
scancel --signal=USR1 "$job" || fail "scancel --signal=USR1 $job"
for _ in $(seq 600); do  # stopped, saved, requeued: held (BeginTime) until released
  grep -q "is back in the queue" "$scratch/job.txt" 2>/dev/null && [ "$(state)" = PENDING ] && break
  sleep 0.1
done
grep -q "is back in the queue" "$scratch/job.txt" || fail "the job was not requeued" "$scratch/job.txt"
scontrol update JobId="$job" StartTime=now || fail "scontrol update StartTime=now"
for _ in $(seq 1800); do
  case $(state) in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL) break ;; esac
  sleep 0.1
done
[ "$(state)" = COMPLETED ] || fail "the requeued job ended $(state)" "$scratch/job.txt"

stop_line=$(grep -m1 "^stopped by SIGUSR1" "$scratch/job.txt") || fail "no stop line" "$scratch/job.txt"
step=$(echo "$stop_line" | sed -n 's/.*every rank stopped after step \([0-9]*\) and saved it.*/\1/p')
[ -n "$step" ] && [ "$step" -lt 128 ] || fail "stopped at step '$step'" "$scratch/job.txt"
saved=$(printf "%s/preempted/step-%012d.pt" "$scratch" "$step")
grep -q -- "--checkpoint-dir: continuing from $saved" "$scratch/job.txt" ||
  fail "the requeued job did not continue from the checkpoint of step $step" "$scratch/job.txt"
grep -q "^start 2 of job $job" "$scratch/job.txt" || fail "no second start of the job script" "$scratch/job.txt"
cmp -s "$scratch/unbroken/$final" "$scratch/preempted/$final" ||
  fail "the requeued job's final checkpoint differs from the unbroken run's" "$scratch/job.txt"
echo "$stop_line"
echo "requeued, continued from step $step: the final checkpoint is byte for byte the unbroken run's"
