#!/usr/bin/env bash
# The project's GPU check, in phases that each fit one call of the GPU lease (at most 10 minutes a call, 15 in all):
#   build-test  configure for the GPU's architecture only, build with all cores, run the CUDA tests first, then the
#               rest of the suite (each test with a timeout); about 6 minutes at most.
#   bench       the GPU benchmarks and the main job at sizes that end in under 5 minutes, headline rows first, each
#               with its own time budget; builds the benchmarks first (incremental after build-test).
#   all         both, one after the other (CI's dry run; a GPU call only if the lease has room for it).
# Each phase writes logs and OUTDIR/<phase>-summary.txt and prints the summary last. On a machine with a CUDA GPU and
# no network (python3 has torch 2.11.0+cu130, no apt, no gtest), carry what `make gpu-bundle` gathers into .deps.
#
#   scripts/gpu_check.sh [--phase build-test|bench|all] [--dry-run] [--deps DIR] [--build-dir DIR] OUTDIR
#     --phase      which phase (default all)
#     --dry-run    the same steps without a GPU (CI runs this): default architectures, CPU benchmarks in quick modes
#     --deps DIR   third-party sources the machine lacks, as laid out by `make gpu-bundle`: DIR/googletest (GoogleTest
#                  source), DIR/include/CLI (CLI11 headers), DIR/include/gloo, DIR/fashion-mnist (the data set)
#     --build-dir  build folder (default build-gpu); reusing an existing one makes a rebuild incremental
# Time budgets (seconds) can be changed through the environment: GPU_CHECK_BUILD_S (360), GPU_CHECK_CUDA_TESTS_S
# (120), GPU_CHECK_OTHER_TESTS_S (150), GPU_CHECK_TEST_S (per test, 90), GPU_CHECK_BENCH_SCALE (1: multiplies every
# benchmark's budget); the dry run's defaults are larger (2 CPU cores).
set -uo pipefail
cd "$(dirname "$0")/.."
# ccache (when the launcher is set): paths relative to the checkout, as the Makefile does.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"

phase="all"
dry_run=0
deps=""
build_dir="build-gpu"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --phase)
      [ $# -ge 2 ] || { echo "gpu_check: --phase needs a value (build-test, bench or all)" >&2; exit 2; }
      phase="$2"; shift ;;
    --dry-run) dry_run=1 ;;
    --deps)
      [ $# -ge 2 ] || { echo "gpu_check: --deps needs a folder" >&2; exit 2; }
      deps="$2"; shift ;;
    --build-dir)
      [ $# -ge 2 ] || { echo "gpu_check: --build-dir needs a folder" >&2; exit 2; }
      build_dir="$2"; shift ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
case "$phase" in
  build-test|bench|all) ;;
  *) echo "gpu_check: --phase must be build-test, bench or all, got '$phase'" >&2; exit 2 ;;
esac
[ -n "$out" ] || { echo "gpu_check: usage: scripts/gpu_check.sh [--phase P] [--dry-run] [--deps DIR] [--build-dir DIR] OUTDIR" >&2; exit 2; }
if [ -n "$deps" ]; then
  [ -d "$deps" ] || { echo "gpu_check: --deps $deps: no such folder (make gpu-bundle creates .deps)" >&2; exit 2; }
  deps=$(cd "$deps" && pwd)
fi
mkdir -p "$out" || { echo "gpu_check: cannot create $out" >&2; exit 2; }
out=$(cd "$out" && pwd)

# The dry run (2 CPU cores, CI) gets roomier defaults: it checks the steps, not the lease.
if [ "$dry_run" = 1 ]; then
  build_s=${GPU_CHECK_BUILD_S:-3000}
  cuda_tests_s=${GPU_CHECK_CUDA_TESTS_S:-600}
  other_tests_s=${GPU_CHECK_OTHER_TESTS_S:-1200}
  test_s=${GPU_CHECK_TEST_S:-600}
else
  build_s=${GPU_CHECK_BUILD_S:-360}
  cuda_tests_s=${GPU_CHECK_CUDA_TESTS_S:-120}
  other_tests_s=${GPU_CHECK_OTHER_TESTS_S:-150}
  test_s=${GPU_CHECK_TEST_S:-90}
fi
bench_scale=${GPU_CHECK_BENCH_SCALE:-1}
jobs=$(nproc)
# The CUDA tests, by name (tests/: every test that needs a GPU says Cuda, Gpu or Nccl in its name).
cuda_regex='Cuda|Gpu|Nccl'

summary=()
status=0
note() { summary+=("$(printf '%-30s %s' "$1" "$2")"); }
seconds_since() { echo $(( $(date +%s) - $1 )); }
finish() {  # finish NAME: prints and writes the phase's summary
  echo
  echo "== $1 summary (also in $out/$1-summary.txt)"
  printf '%s\n' "${summary[@]}" | tee "$out/$1-summary.txt"
  summary=()
}

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
  # Only the GPU's own architecture: every extra one is another full nvcc pass over each .cu file.
  args+=(-DCMAKE_CUDA_ARCHITECTURES="${arch:-native}")
fi
data_dir=""
if [ -n "$deps" ]; then
  [ -d "$deps/googletest" ] && args+=(-DGTEST_SOURCE_DIR="$deps/googletest")
  [ -d "$deps/include/CLI" ] && args+=(-DCLI11_INCLUDE_DIR="$deps/include")
  [ -d "$deps/include/gloo" ] && args+=(-DLIBTORCH_AMP_GLOO_INCLUDE_DIR="$deps/include")
  [ -d "$deps/fashion-mnist" ] && data_dir="$deps/fashion-mnist"
fi
[ -z "$data_dir" ] && [ -d /usr/share/datasets/fashion-mnist ] && data_dir=/usr/share/datasets/fashion-mnist

configure() {  # configure PHASE [EXTRA_ARGS...]: (re)configures the build folder; a second call is incremental
  local phase_name="$1" start
  shift
  start=$(date +%s)
  echo "== configure ($build_dir)"
  if cmake -S . -B "$build_dir" "${args[@]}" "$@" >"$out/$phase_name-configure.log" 2>&1; then
    note "configure" "ok ($(seconds_since "$start") s)"
    return 0
  fi
  note "configure" "FAILED ($phase_name-configure.log)"; tail -n 30 "$out/$phase_name-configure.log"
  return 1
}

build() {  # build PHASE TARGET...: builds with all cores within the build budget
  local phase_name="$1" start rc
  shift
  start=$(date +%s)
  echo "== build ($*)"
  timeout "$build_s" cmake --build "$build_dir" -j "$jobs" --target "$@" >"$out/$phase_name-build.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    note "build" "ok ($(seconds_since "$start") s, $jobs jobs)"
    return 0
  fi
  if [ $rc = 124 ]; then
    note "build" "OVER BUDGET: stopped after $build_s s ($phase_name-build.log)"
  else
    note "build" "FAILED ($phase_name-build.log)"; grep -E 'error' "$out/$phase_name-build.log" | head -n 20
  fi
  return 1
}

ctest_part() {  # ctest_part NAME BUDGET_S CTEST_ARGS...: one part of the suite, its counts into the summary
  local name="$1" budget="$2" start rc log
  shift 2
  log="$out/ctest-$name.log"
  start=$(date +%s)
  echo "== ctest ($name)"
  (cd "$build_dir" && timeout "$budget" ctest --output-on-failure --timeout "$test_s" "$@") >"$log" 2>&1
  rc=$?
  [ $rc = 0 ] || status=1
  local counts
  counts=$(grep -E 'tests passed|tests failed' "$log" | tail -n 1)
  [ $rc = 124 ] && counts="OVER BUDGET: stopped after $budget s; ${counts:-no count}"
  note "ctest $name" "${counts:-no tests ran (ctest-$name.log)} ($(seconds_since "$start") s)"
  note "ctest $name skipped" "$(grep -c '(Skipped)' "$log") test(s)"
  grep -A100 'The following tests FAILED' "$log" | sed -n '2,30p' | tee -a "$out/failed-tests.txt"
  return 0
}

phase_build_test() {
  local start
  start=$(date +%s)
  note "machine" "$(hostname) | GPU: $gpu | torch $torch_version | $jobs cores"
  : >"$out/failed-tests.txt"
  # Benchmarks are not built here: the bench phase builds them (incrementally) within its own call.
  configure build-test -DLIBTORCH_AMP_BENCHMARKS=OFF || { finish build-test; return 1; }
  build build-test all || { finish build-test; return 1; }
  # The CUDA tests first (they are what this phase is for), a few at a time on the one GPU; then the rest,
  # except the build's own tests (fresh consumer projects: CPU only, slow, run by CI).
  ctest_part cuda "$cuda_tests_s" -R "$cuda_regex" -j 4
  ctest_part other "$other_tests_s" -E "$cuda_regex|^build\\." -j "$jobs"
  note "elapsed" "$(seconds_since "$start") s"
  finish build-test
}

bench_budget() { awk -v s="$1" -v k="$bench_scale" 'BEGIN { printf "%d", s * k }'; }

run_bench() {  # run_bench NAME BUDGET_S ARGS...: logs to OUTDIR/NAME.txt, puts its last line in the summary
  local name="$1" budget exe rc start
  budget=$(bench_budget "$2")
  shift 2
  exe="$build_dir/benchmarks/$name"
  if [ ! -x "$exe" ]; then note "$name" "not built"; status=1; return; fi
  start=$(date +%s)
  timeout "$budget" "$exe" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    note "$name" "$(grep -v '^$' "$out/$name.txt" | tail -n 1) ($(seconds_since "$start") s)"
  elif [ $rc = 124 ]; then
    status=1; note "$name" "OVER BUDGET: stopped after $budget s ($name.txt)"
  else
    status=1; note "$name" "FAILED ($name.txt)"
  fi
}

amp_vs_fp32() {  # amp_vs_fp32 NAME BUDGET_S ARGS...: the main job, with its headline rows in the summary
  local name="$1" budget rc start
  budget=$(bench_budget "$2")
  shift 2
  local dir="$out/$name"
  start=$(date +%s)
  timeout "$budget" "$build_dir/benchmarks/bench_amp_vs_fp32" "$@" --out "$dir" >"$out/$name.txt" 2>&1
  rc=$?
  if [ $rc != 0 ] || [ ! -f "$dir/amp_vs_fp32.csv" ]; then
    status=1
    if [ $rc = 124 ]; then note "$name" "OVER BUDGET: stopped after $budget s ($name.txt)"
    else note "$name" "FAILED ($name.txt)"; tail -n 20 "$out/$name.txt"; fi
    return
  fi
  # Headline (the issue's H200 targets): O2 on the transformer vs FP32 and TF32 throughput, peak memory vs FP32
  # and throughput vs torch.amp; O2 on the CNN: test accuracy vs FP32 after the same epochs. Columns by name.
  while IFS= read -r line; do note "$name" "$line"; done < <(awk -F, '
    function v(x) { return x == "" ? "-" : x }
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    { status = $col["status"]; config = $col["config"]; model = $col["model"] }
    status != "ok" { skipped++ }
    config ~ /^O2 / && status != "ok" { print model " " config ": skipped" }
    model == "transformer" && config ~ /^O2 / && status == "ok" {
      print "transformer " config ": " v($col["x_fp32"]) "x FP32, " v($col["x_tf32"]) "x TF32, mem " \
            v($col["peak_x_fp32"]) "x FP32, " v($col["x_torch_amp"]) "x torch.amp" }
    model == "cnn" && config ~ /^O2 / && status == "ok" {
      print "cnn " config ": accuracy " v($col["accuracy_delta_points"]) " points vs FP32, " v($col["x_fp32"]) \
            "x FP32, " v($col["x_torch_amp"]) "x torch.amp" }
    END { if (skipped) print skipped " run(s) skipped" }' "$dir/amp_vs_fp32.csv")
  note "$name time" "$(seconds_since "$start") s"
  grep -q 'skipped: ' "$out/$name.txt" && status=1
}

phase_bench() {
  local start
  start=$(date +%s)
  note "machine" "$(hostname) | GPU: $gpu | torch $torch_version | $jobs cores"
  configure bench -DLIBTORCH_AMP_BENCHMARKS=ON || { finish bench; return 1; }
  build bench bench_amp_vs_fp32 bench_unscale bench_fused_adamw bench_multi_tensor_scale bench_amp_overhead \
    bench_fused_dense bench_l2_norm bench_allreduce_busbw bench_fp8_linear || { finish bench; return 1; }
  local data_args=(--synthetic)
  [ -n "$data_dir" ] && data_args=(--data "$data_dir")
  if [ "$dry_run" = 0 ]; then
    # On the GPU: the headline first (transformer O2 vs FP32/TF32/torch.amp), then the kernel targets at the issue's
    # sizes, then the CNN's accuracy row. Budgets sum to 310 s (+ the build) so the phase ends in under 6 minutes.
    amp_vs_fp32 amp_vs_fp32_transformer 80 --full --models transformer --steps 60 --rounds 3
    run_bench bench_unscale 25 --full --rounds 10
    run_bench bench_fused_adamw 25 --full --rounds 10
    run_bench bench_multi_tensor_scale 20 --full --rounds 10
    run_bench bench_amp_overhead 20 --rounds 10
    run_bench bench_fused_dense 35 --rounds 5
    run_bench bench_l2_norm 15 --full --rounds 10
    run_bench bench_allreduce_busbw 15 --rounds 5
    run_bench bench_fp8_linear 40 --full --rounds 5
    amp_vs_fp32 amp_vs_fp32_cnn 35 --full --models cnn "${data_args[@]}"
  else
    # The dry run: the same programs in their CPU quick modes (a check that each runs and prints its table).
    amp_vs_fp32 amp_vs_fp32 300 --steps 3 --rounds 1 --synthetic
    run_bench bench_unscale 120 --rounds 3
    run_bench bench_fused_adamw 120 --rounds 3
    run_bench bench_multi_tensor_scale 120 --rounds 3
    run_bench bench_amp_overhead 120 --rounds 3
    run_bench bench_fused_dense 120 --rounds 2
    run_bench bench_l2_norm 120 --rounds 3
    run_bench bench_allreduce_busbw 120 --rounds 2
    run_bench bench_fp8_linear 120 --rounds 2
  fi
  note "elapsed" "$(seconds_since "$start") s"
  finish bench
}

case "$phase" in
  build-test) phase_build_test || status=1 ;;
  bench) phase_bench || status=1 ;;
  all)
    phase_build_test || status=1
    phase_bench || status=1
    ;;
esac
exit $status
