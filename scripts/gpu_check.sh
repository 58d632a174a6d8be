#!/usr/bin/env bash
# The project's one GPU check: on a machine with a CUDA GPU and no network (python3 has torch 2.11.0+cu130, no
# apt), find LibTorch from python3's torch, configure for the GPU's architecture, build with all cores, run the
# whole ctest suite (CUDA tests included), the benchmarks in quick mode and the main job (bench_amp_vs_fp32
# --full), and write logs plus a summary table into OUTDIR, printing the table last.
#
#   scripts/gpu_check.sh [--dry-run] [--deps DIR] [--build-dir DIR] OUTDIR
#     --dry-run    the same steps without a GPU (CI runs this): default architectures, CPU benchmarks (amp_vs_fp32
#                  in a 3-step mode)
#     --deps DIR   third-party sources the machine lacks, as laid out by `make gpu-bundle`:
#                  DIR/googletest (GoogleTest source), DIR/include/CLI (CLI11 headers), DIR/include/gloo
#     --build-dir  build folder (default build-gpu); reusing an existing one makes a rebuild incremental
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
deps=""
build_dir="build-gpu"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --deps) deps="$2"; shift ;;
    --build-dir) build_dir="$2"; shift ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
[ -n "$out" ] || { echo "gpu_check: usage: scripts/gpu_check.sh [--dry-run] [--deps DIR] [--build-dir DIR] OUTDIR" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
summary=()
status=0
note() { summary+=("$(printf '%-28s %s' "$1" "$2")"); }

# LibTorch: the project's .venv if it has one, else python3's torch.
python=python3
[ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2>/dev/null && python=.venv/bin/python
torch_prefix=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null | tail -n 1)
[ -n "$torch_prefix" ] || { echo "gpu_check: $python has no torch; cannot find LibTorch" >&2; exit 1; }
torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null | tail -n 1)

args=(-DCMAKE_PREFIX_PATH="$torch_prefix")
if command -v ninja >/dev/null 2>&1; then args+=(-G Ninja); fi
if command -v ccache >/dev/null 2>&1; then
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
gpu="none"
if [ "$dry_run" = 0 ]; then
  command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu_check: no nvidia-smi: is there a GPU? (use --dry-run)" >&2; exit 1; }
  gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | head -n 1)
  arch=$(echo "$gpu" | sed -n 's/.*, *\([0-9]*\)\.\([0-9]*\).*/\1\2/p')
  args+=(-DCMAKE_CUDA_ARCHITECTURES="${arch:-native}")
fi
if [ -n "$deps" ]; then
  deps=$(cd "$deps" && pwd)
  [ -d "$deps/googletest" ] && args+=(-DGTEST_SOURCE_DIR="$deps/googletest")
  [ -d "$deps/include/CLI" ] && args+=(-DCLI11_INCLUDE_DIR="$deps/include")
  [ -d "$deps/include/gloo" ] && args+=(-DLIBTORCH_AMP_GLOO_INCLUDE_DIR="$deps/include")
fi
note "machine" "$(hostname) | GPU: $gpu | torch $torch_version"

echo "== configure ($build_dir)"
if cmake -S . -B "$build_dir" "${args[@]}" >"$out/configure.log" 2>&1; then
  note "configure" "ok"
else
  note "configure" "FAILED (configure.log)"; tail -n 30 "$out/configure.log"
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"; exit 1
fi
echo "== build"
if cmake --build "$build_dir" -j "$(nproc)" >"$out/build.log" 2>&1; then
  note "build" "ok"
else
  note "build" "FAILED (build.log)"; grep -E 'error' "$out/build.log" | head -n 20
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"; exit 1
fi
echo "== ctest"
(cd "$build_dir" && ctest -j "$(nproc)" --output-on-failure --timeout 600) >"$out/ctest.log" 2>&1 || status=1
note "ctest" "$(grep -E 'tests passed|tests failed' "$out/ctest.log" | tail -n 1)"
note "ctest skipped" "$(grep -c '(Skipped)' "$out/ctest.log") test(s)"
grep -A200 'The following tests FAILED' "$out/ctest.log" | head -n 40

echo "== benchmarks"
# On the GPU the kernel benchmarks run at the issue's sizes (--full); the dry run keeps CPU-sized quick modes.
size_flag=""
[ "$dry_run" = 0 ] && size_flag="--full"
run_bench() {  # run_bench NAME ARGS...: logs to OUTDIR/NAME.txt, puts its last line in the summary
  local name="$1"; shift
  local exe="$build_dir/benchmarks/$name"
  if [ ! -x "$exe" ]; then note "$name" "not built"; return; fi
  if timeout 300 "$exe" "$@" >"$out/$name.txt" 2>&1; then
    note "$name" "$(grep -v '^$' "$out/$name.txt" | tail -n 1)"
  else
    status=1; note "$name" "FAILED ($name.txt)"
  fi
}
run_bench bench_multi_tensor_scale $size_flag --rounds 10
run_bench bench_unscale $size_flag --rounds 10
run_bench bench_l2_norm $size_flag --rounds 10
run_bench bench_fused_adamw $size_flag --rounds 10
run_bench bench_amp_overhead --rounds 10
run_bench bench_allreduce_busbw --rounds 5
# Fused dense layers: quick mode is bounded on the GPU too (tokens 2K/8K x hidden 1K/4K, bf16 + fp16); the issue's
# full grid is `bench_fused_dense --full` (not yet timed on a GPU).
run_bench bench_fused_dense --rounds 5
echo "== amp_vs_fp32 (the main job, full mode)"
amp_args=(--full)
[ "$dry_run" = 1 ] && amp_args=(--steps 3 --rounds 1 --synthetic)
if "$build_dir/benchmarks/bench_amp_vs_fp32" "${amp_args[@]}" --out "$out/amp_vs_fp32" >"$out/amp_vs_fp32.txt" 2>&1; then
  # Headline (the issue's H200 targets): O2 on the transformer vs FP32 and TF32 throughput, peak memory vs FP32
  # and throughput vs torch.amp; O2 on the CNN: test accuracy vs FP32 after the same epochs.
  while IFS= read -r line; do note "amp_vs_fp32" "$line"; done < <(awk -F, '
    function v(x) { return x == "" ? "-" : x }
    NR > 1 && $5 != "ok" { skipped++ }
    NR > 1 && $2 ~ /^O2 / && $5 != "ok" { print $1 " " $2 ": skipped (amp_vs_fp32.txt)" }
    NR > 1 && $1 == "transformer" && $2 ~ /^O2 / && $5 == "ok" {
      print "transformer " $2 ": " v($7) "x FP32, " v($8) "x TF32, mem " v($11) "x FP32, " v($18) "x torch.amp" }
    NR > 1 && $1 == "cnn" && $2 ~ /^O2 / && $5 == "ok" {
      print "cnn " $2 ": accuracy " v($14) " points vs FP32, " v($7) "x FP32, " v($18) "x torch.amp" }
    END { if (skipped) print skipped " run(s) skipped (amp_vs_fp32.txt)" }' "$out/amp_vs_fp32/amp_vs_fp32.csv")
  grep -q 'skipped: ' "$out/amp_vs_fp32.txt" && status=1
else
  status=1; note "amp_vs_fp32" "FAILED (amp_vs_fp32.txt)"; tail -n 20 "$out/amp_vs_fp32.txt"
fi
note "elapsed" "$(( $(date +%s) - start )) s"
echo
echo "== summary (also in $out/summary.txt)"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
