#!/usr/bin/env bash
# Full sharding against PyTorch's FSDP2 (and each against its own DDP) on the same model, data, loss, optimizer and
# threads, CPU/Gloo, 2 ranks: bench_fsdp --step-time-only --full and benchmarks/peers/torch_fsdp_peer.py under
# torchrun, alternated RUNS times (default 2), so that both see the same machine state. Each prints medians of 20
# interleaved rounds of 3 iterations; compare the medians of the runs.
# Usage: benchmarks/fsdp_vs_torch_fsdp.sh BUILD_DIR [RUNS]   (from the repository root, the .venv installed)
set -euo pipefail
build=${1:?usage: benchmarks/fsdp_vs_torch_fsdp.sh BUILD_DIR [RUNS]}
runs=${2:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
uptime
for run in $(seq "$runs"); do
  echo "== run $run: libtorch-amp"
  "$build/benchmarks/bench_fsdp" --step-time-only --full | grep -E '^\| (DDP|full sharding)'
  echo "== run $run: PyTorch"
  (cd /tmp && OMP_NUM_THREADS=1 "$root/.venv/bin/torchrun" --standalone --nproc-per-node 2 \
    "$root/benchmarks/peers/torch_fsdp_peer.py" 2>/dev/null | grep '^peer')
done
