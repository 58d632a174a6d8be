#!/usr/bin/env bash
# Slurm starts the examples as they are (issue 41), on a one-node Slurm the test starts (slurm_cluster.sh) and stops:
#   srun -n 2 amp_ddp                        ends with the same parameters, bit for bit, as under ddp-launch
#   sbatch docs/clusters/amp_ddp.sbatch      the documented job script itself, likewise
#   srun -N1 -n1 ddp-launch --nproc-per-node 2 amp_ddp   ddp-launch takes the node values from Slurm, likewise
#   a node list that does not parse          one line naming the variable, a non-zero exit
# Skips (77) without root or without slurm-wlm and munge (scripts/bootstrap.sh installs them).
# Usage: slurm_test.sh <source dir> <ddp-launch> <amp_ddp> <scratch dir>
set -u
source_dir=$1 launch=$2 program=$3 scratch=$4
slurm_tools="srun sbatch"
source "$source_dir/tests/cluster/slurm_prelude.sh"
args="--synthetic --limit-train 1024 --epochs 1 --batch-size 64 --device cpu --opt-level O2 --check-replicas"
digest() { sed -n 's/.*bit-identical parameters (FNV-1a \(0x[0-9a-f]*\)).*/\1/p' "$1"; }

"$launch" --nproc-per-node 2 --master-port 0 "$program" $args >"$scratch/launch.txt" 2>&1 ||
  fail "the ddp-launch run" "$scratch/launch.txt"
want=$(digest "$scratch/launch.txt")
[ -n "$want" ] || fail "no digest from ddp-launch" "$scratch/launch.txt"

timeout 300 srun -n 2 "$program" $args >"$scratch/srun.txt" 2>&1 || fail "srun -n 2" "$scratch/srun.txt"
grep -q "launched by slurm: job [0-9]*, step 0, 1 node x 2 tasks" "$scratch/srun.txt" ||
  fail "rank 0's header does not say Slurm started the ranks" "$scratch/srun.txt"
[ "$(digest "$scratch/srun.txt")" = "$want" ] || fail "srun -n 2 ended with other parameters than ddp-launch" "$scratch/srun.txt"
echo "srun -n 2: the same parameters as ddp-launch ($want)"

(cd "$scratch" && PROGRAM="$program" ARGS="$args" timeout 300 sbatch --wait --output="$scratch/sbatch.txt" \
  "$source_dir/docs/clusters/amp_ddp.sbatch" >"$scratch/sbatch_submit.txt" 2>&1) ||
  fail "sbatch docs/clusters/amp_ddp.sbatch" "$scratch/sbatch.txt"
[ "$(digest "$scratch/sbatch.txt")" = "$want" ] || fail "the sbatch job ended with other parameters" "$scratch/sbatch.txt"
echo "sbatch docs/clusters/amp_ddp.sbatch: the same parameters ($want)"

timeout 300 srun -N1 -n1 "$launch" --nproc-per-node 2 --master-port 0 "$program" $args >"$scratch/srun_launch.txt" 2>&1 ||
  fail "srun -N1 -n1 ddp-launch" "$scratch/srun_launch.txt"
[ "$(digest "$scratch/srun_launch.txt")" = "$want" ] || fail "srun + ddp-launch ended with other parameters" "$scratch/srun_launch.txt"
echo "srun -N1 -n1 ddp-launch --nproc-per-node 2: the same parameters ($want)"

if timeout 120 srun -n 2 env SLURM_STEP_NODELIST='node[01-' "$program" $args >"$scratch/bad.txt" 2>&1; then
  fail "a node list that does not parse was accepted" "$scratch/bad.txt"
fi
grep -q "SLURM_STEP_NODELIST='node\[01-' does not parse as a Slurm hostlist" "$scratch/bad.txt" &&
  ! grep -q "frame #" "$scratch/bad.txt" || fail "a bad node list" "$scratch/bad.txt"
echo "a bad node list: $(grep -m1 "does not parse" "$scratch/bad.txt")"
