#!/usr/bin/env bash
# The project's GPU check, in two phases that each fit one call of the GPU lease (one H200; a call runs at most
# 600 s, and the session has 900 s of device time in all, the machine's start included). docs/gpu_check.md has the
# call-by-call plan and its arithmetic.
#   build-test  configure for the GPU's architecture only; build the three test programs that hold the CUDA tests
#               (test_kernels, test_ddp, test_amp); run first the tests that have never run on a GPU (FP8 on CUDA,
#               CUDA graphs, ZeRO over NCCL, SyncBatchNorm on CUDA), then the other CUDA tests; then, in the time
#               left, build the benchmarks for the bench call. The CPU-only tests do not run there: CI runs them.
#   bench       build what the benchmarks still lack (nothing after build-test on the same warm machine), then run
#               them, headline first: bench_amp_vs_fp32 on the transformer (O2 vs FP32, TF32 and torch.amp),
#               bench_fp8_linear, then the kernel benchmarks.
#   all         both, one after the other (the dry run).
# Each phase runs under one deadline: every step gets the smaller of its own cap and the time left (less what the
# steps after it are promised), and a step with no time left is reported, not run. Each result line is printed as it
# arrives and appended to OUTDIR/<phase>-summary.txt; every log goes into OUTDIR/<phase>-logs.tar.gz, rewritten
# after each step and on SIGTERM/SIGINT/SIGHUP, so a call cut at its limit still returns what ran. OUTDIR then holds
# those two files per phase and nothing else (the device returns at most 8); the script lists them at the end and
# fails if OUTDIR breaks the device's rules. The logs themselves live in a scratch folder that is removed at exit.
# On a machine with a CUDA GPU and no network (python3 has torch, no apt, no gtest), carry what `make gpu-bundle`
# gathers into .deps.
#
#   scripts/gpu_check.sh [--phase build-test|bench|all] [--dry-run] [--deps DIR] [--build-dir DIR] OUTDIR
#     --phase      which phase (default all)
#     --dry-run    the same steps without a GPU (CI runs this): the CUDA tests skip, so it also runs the CPU twins of
#                  the never-run checks; default architectures; the benchmarks in their CPU quick modes
#     --deps DIR   third-party sources the machine lacks, as laid out by `make gpu-bundle`: DIR/googletest (GoogleTest
#                  source), DIR/include/CLI (CLI11 headers), DIR/include/nlohmann (nlohmann-json), DIR/include/gloo
#     --build-dir  build folder (default build-gpu); reusing an existing one makes a rebuild incremental
# Environment: GPU_CHECK_DEADLINE_S (each phase's deadline in seconds from its start; default build-test 300, bench
# 160 on the GPU, 1200 each in the dry run), GPU_CHECK_TEST_S (one test's timeout; 60, dry run 300),
# GPU_CHECK_TEST_JOBS (CUDA tests at a time on the one GPU; 8), GPU_CHECK_BENCH_SCALE (multiplies every benchmark's
# cap; 1), GPU_CHECK_SCRATCH (the logs' folder; default a fresh mktemp -d, removed at exit).
set -uo pipefail
script_start=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
# ccache (when the launcher is set): paths relative to the checkout, as the Makefile does.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"

phase_arg="all"
dry_run=0
deps=""
build_dir="build-gpu"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --phase)
      [ $# -ge 2 ] || { echo "gpu_check: --phase needs a value (build-test, bench or all)" >&2; exit 2; }
      phase_arg="$2"; shift ;;
    --dry-run) dry_run=1 ;;
    --deps)
      [ $# -ge 2 ] || { echo "gpu_check: --deps needs a folder" >&2; exit 2; }
      deps="$2"; shift ;;
    --build-dir)
      [ $# -ge 2 ] || { echo "gpu_check: --build-dir needs a folder" >&2; exit 2; }
      build_dir="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo pipefail$/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
case "$phase_arg" in
  build-test|bench|all) ;;
  *) echo "gpu_check: --phase must be build-test, bench or all, got '$phase_arg'" >&2; exit 2 ;;
esac
[ -n "$out" ] || { echo "gpu_check: usage: scripts/gpu_check.sh [--phase P] [--dry-run] [--deps DIR] [--build-dir DIR] OUTDIR" >&2; exit 2; }
if [ -n "$deps" ]; then
  [ -d "$deps" ] || { echo "gpu_check: --deps $deps: no such folder (make gpu-bundle creates .deps)" >&2; exit 2; }
  deps=$(cd "$deps" && pwd)
fi
mkdir -p "$out" "$build_dir" || { echo "gpu_check: cannot create $out or $build_dir" >&2; exit 2; }
out=$(cd "$out" && pwd)
build_dir=$(cd "$build_dir" && pwd)
case "$build_dir/" in
  "$out"/*) echo "gpu_check: the build folder must not be inside OUTDIR ($out): OUTDIR holds the results only" >&2; exit 2 ;;
esac
# OUTDIR holds this script's files only (they are replaced): anything else would come back from the device too.
foreign=$(find "$out" -mindepth 1 -maxdepth 1 ! -name build-test-summary.txt ! -name build-test-logs.tar.gz \
            ! -name bench-summary.txt ! -name bench-logs.tar.gz ! -name '.*-logs.tar.gz.part' -printf '%f ' | head -c 300)
rm -f "$out"/.*-logs.tar.gz.part  # a killed run's half-written archive
[ -z "$foreign" ] || { echo "gpu_check: OUTDIR $out holds files this script does not write ($foreign); use an empty folder" >&2; exit 2; }

# ---- limits ---------------------------------------------------------------------------------------------------------
# The device returns at most 8 files from $OUT, no more than 2 folders down, named in [A-Za-z0-9._-], 16 MiB each and
# 64 MiB together (/work/.library/device/README.md).
readonly out_max_files=8 out_max_folders=2 out_max_file_bytes=$((16 << 20)) out_max_total_bytes=$((64 << 20))
readonly min_step_s=5  # a step with less time than this is reported as not run
if [ "$dry_run" = 1 ]; then
  test_s=${GPU_CHECK_TEST_S:-300}
else
  test_s=${GPU_CHECK_TEST_S:-60}
fi
test_jobs=${GPU_CHECK_TEST_JOBS:-8}
bench_scale=${GPU_CHECK_BENCH_SCALE:-1}
jobs=$(nproc)
cap() {  # cap GPU_S DRY_S: a step's own cap in this mode
  if [ "$dry_run" = 1 ]; then echo "$2"; else echo "$1"; fi
}
phase_deadline_s() {  # phase_deadline_s PHASE
  if [ -n "${GPU_CHECK_DEADLINE_S:-}" ]; then echo "$GPU_CHECK_DEADLINE_S"; return; fi
  case "$1" in
    build-test) cap 300 1200 ;;
    bench) cap 160 1200 ;;
  esac
}

# ---- which tests ------------------------------------------------------------------------------------------------------
# ctest names are gtest's (gtest_discover_tests): Suite.Test, Prefix/Suite.Test/N, Suite/N.Test. Every test that needs
# a GPU says Cuda, Gpu or Nccl in its name, and so do the kernels' mixed-device checks (RejectsMixedDevices,
# FoundInfOnAnotherDeviceIsRejected: a CUDA tensor needs a GPU). A CPU test whose name mentions CUDA is excluded by
# name (cpu_only_regex); the dry run fails if a test of the GPU groups runs without skipping on the CPU.
never_run_labels=("FP8 on CUDA" "CUDA graphs" "ZeRO over NCCL" "SyncBatchNorm on CUDA" "the timeline's CUDA events"
                  "activation checkpointing on CUDA" "full sharding over NCCL")
never_run_parts=("Fp8Cuda" "CudaGraph" "Zero.*Nccl|Nccl.*Zero" "SyncBatchNormCuda" "TimelineCuda"
                 "ActivationCheckpointCuda" "FullySharded.*Nccl")
never_run_regex=$(IFS='|'; echo "${never_run_parts[*]}")
gpu_regex='Cuda|Gpu|Nccl|MixedDevices|OnAnotherDevice'
cpu_only_regex='SyncBatchNormTest\.CountsForTheCudaBackward'
# The dry run's stand-ins for the never-run checks, on the CPU: the SyncBatchNorm and ZeRO device tests' own checks
# with threads as ranks over Gloo, and our FP8 GEMM against ATen's _scaled_mm. (CUDA graphs have no CPU twin.)
cpu_twin_regex='SyncBatchNormTest\.TheDeviceTestChecksPassWithThreadsAsRanksOnTheCpu|ZeroThreadRanksTest\.|Fp8GemmCpuTest\.|FullyShardedThreadRanksTest\.|FullyShardedAmpThreadRanksTest\.'
test_targets=(test_kernels test_ddp test_amp)
bench_headline_targets=(bench_amp_vs_fp32 bench_fp8_linear)
bench_kernel_targets=(bench_unscale bench_fused_adamw bench_amp_overhead bench_fused_dense bench_l2_norm
                      bench_multi_tensor_scale)

# ---- scratch, summary, archive -------------------------------------------------------------------------------------
scratch="${GPU_CHECK_SCRATCH:-}"
if [ -z "$scratch" ]; then
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || { echo "gpu_check: mktemp failed" >&2; exit 2; }
  remove_scratch=1
else
  mkdir -p "$scratch" || exit 2
  scratch=$(cd "$scratch" && pwd)
  remove_scratch=0
fi
case "$scratch/" in
  "$out"/*) echo "gpu_check: GPU_CHECK_SCRATCH must not be inside OUTDIR ($out)" >&2; exit 2 ;;
esac

status=0
phase=""            # the phase running now
phase_logs=""       # its folder in the scratch
summary_file=""     # OUTDIR/<phase>-summary.txt
deadline_at=0       # its deadline, in seconds since the epoch
next_phase_start=$script_start  # the first phase's clock starts with the script
child_pid=""        # the step running now (a `timeout`), for the signal handler
stream_pid=""       # the ctest progress printer

note() {  # note NAME TEXT: one result line, printed and appended to the summary at once
  local line
  line=$(printf '%-30s %s' "$1" "$2")
  echo "$line"
  [ -n "$summary_file" ] && echo "$line" >>"$summary_file"
}
fail() { status=1; note "$@"; }
seconds_since() { echo $(( $(date +%s) - $1 )); }
left_s() { echo $(( deadline_at - $(date +%s) )); }

snapshot() {  # writes OUTDIR/<phase>-logs.tar.gz from the phase's logs (a rename, so a killed write leaves the old one)
  [ -n "$phase" ] || return 0
  cp -f "$summary_file" "$phase_logs/summary.txt" 2>/dev/null
  local part="$out/.$phase-logs.tar.gz.part"
  if tar -C "$scratch" -czf "$part" "$phase" 2>/dev/null; then
    mv -f "$part" "$out/$phase-logs.tar.gz"
  else
    rm -f "$part"
    echo "gpu_check: could not write $out/$phase-logs.tar.gz" >&2
  fi
}

# The three below run from traps (shellcheck cannot see that).
# shellcheck disable=SC2317
stop_children() {
  [ -n "$child_pid" ] && kill -TERM "$child_pid" 2>/dev/null
  [ -n "$stream_pid" ] && kill -TERM "$stream_pid" 2>/dev/null
  child_pid=""
  stream_pid=""
}

# shellcheck disable=SC2317
on_signal() {  # on_signal NAME NUMBER: the call is being cut: stop the step, keep what ran
  trap - TERM INT HUP
  stop_children
  if [ -n "$phase" ]; then
    fail "stopped" "by SIG$1 after $(seconds_since "$script_start") s; the archive holds the logs so far"
    snapshot
    save_source_times
  fi
  exit $((128 + $2))
}
# shellcheck disable=SC2317
on_exit() {
  stop_children
  [ "$remove_scratch" = 1 ] && rm -rf "$scratch"
}
trap 'on_signal TERM 15' TERM
trap 'on_signal INT 2' INT
trap 'on_signal HUP 1' HUP
trap on_exit EXIT

begin_phase() {  # begin_phase NAME
  phase="$1"
  phase_logs="$scratch/$phase"
  summary_file="$out/$phase-summary.txt"
  rm -rf "$phase_logs"
  mkdir -p "$phase_logs"
  : >"$summary_file"
  local start=$next_phase_start
  next_phase_start=$(date +%s)
  deadline_at=$(( start + $(phase_deadline_s "$phase") ))
  echo
  echo "== $phase: deadline in $(left_s) s; results below as they arrive, also in $summary_file"
  note "machine" "$(hostname) | GPU: $gpu | torch $torch_version | $jobs cores"
  note "mode" "$([ "$dry_run" = 1 ] && echo "dry run (no GPU)" || echo "GPU"), deadline $(phase_deadline_s "$phase") s"
  if [ "$dry_run" = 0 ]; then  # Note [source times across calls]
    note "source times" "$(restore_source_times) file(s) given back their time (same content)"
  fi
}

end_phase() {
  save_source_times
  note "elapsed" "$(seconds_since "$script_start") s since the script's start, $(left_s) s before the deadline"
  snapshot
  echo
  echo "== $phase summary ($summary_file)"
  cat "$summary_file"
  phase=""
  summary_file=""
}

budget_s() {  # budget_s CAP [RESERVE]: prints min(CAP, time left - RESERVE); fails when that is under min_step_s
  local cap_s="$1" reserve_s="${2:-0}" b
  b=$(( $(left_s) - reserve_s ))
  [ "$cap_s" -lt "$b" ] && b=$cap_s
  echo "$b"
  [ "$b" -ge "$min_step_s" ]
}

run_capped() {  # run_capped BUDGET_S LOG DIR CMD...: CMD in DIR, killed after BUDGET_S; returns its status (124: cut)
  local budget="$1" log="$2" dir="$3" rc
  shift 3
  (cd "$dir" && exec timeout -k 5 "$budget" "$@") >"$log" 2>&1 &
  child_pid=$!
  wait "$child_pid"
  rc=$?
  child_pid=""
  return $rc
}

# Note [source times across calls]: every device call sends the working tree again. If the copy gives the files new
# modification times, ninja rebuilds everything in the bench call (minutes, against its 160 s). So on the GPU each
# phase records, at its end, every source's content hash and time in the build folder, and the next phase gives a file
# whose content is unchanged its old time back. The record is removed once used: a call killed before it writes a new
# one leaves none, and the next build then goes by the times alone. Not in the dry run: a build between two runs
# (make build on a developer's tree) is not in the record, and could be hidden by it.
source_times_file() { echo "$build_dir/gpu_check_source_times.txt"; }
list_sources() {  # NUL-separated; a folder this tree lacks is no error
  find CMakeLists.txt cmake amp ddp kernels tests benchmarks python_free_examples ${deps:+"$deps"} -type f -print0 \
    2>/dev/null || true
}
save_source_times() {
  [ "$dry_run" = 0 ] || return 0
  list_sources | "$python" -c '
import hashlib, os, sys
for path in sys.stdin.buffer.read().decode().split("\0"):
    if path:
        with open(path, "rb") as f:
            print(hashlib.sha1(f.read()).hexdigest(), os.stat(path).st_mtime_ns, path)
' >"$(source_times_file).part" 2>/dev/null && mv -f "$(source_times_file).part" "$(source_times_file)"
}
restore_source_times() {  # prints how many files got their old time back
  local record
  record=$(source_times_file)
  if [ "$dry_run" != 0 ] || [ ! -f "$record" ]; then echo 0; return 0; fi
  "$python" -c '
import hashlib, os, sys
restored = 0
for line in open(sys.argv[1]):
    digest, mtime_ns, path = line.rstrip("\n").split(" ", 2)
    try:
        st = os.stat(path)
        if st.st_mtime_ns != int(mtime_ns):
            with open(path, "rb") as f:
                if hashlib.sha1(f.read()).hexdigest() == digest:
                    os.utime(path, ns=(st.st_atime_ns, int(mtime_ns)))
                    restored += 1
    except (OSError, ValueError):
        pass
print(restored)
' "$record" 2>/dev/null || echo "?"
  rm -f "$record"
}

# ---- LibTorch, the GPU, the configure arguments ---------------------------------------------------------------------
python=python3
[ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2>/dev/null && python=.venv/bin/python
torch_info=$("$python" -c 'import torch, torch.utils; print(torch.__version__); print(torch.utils.cmake_prefix_path)' \
             2>/dev/null | tail -n 2)
torch_version=$(echo "$torch_info" | head -n 1)
torch_prefix=$(echo "$torch_info" | sed -n 2p)
[ -n "$torch_prefix" ] || { echo "gpu_check: $python has no torch; cannot find LibTorch" >&2; exit 1; }

# Benchmarks on in both phases: one configuration, so the bench call's build is incremental.
args=(-DCMAKE_PREFIX_PATH="$torch_prefix" -DLIBTORCH_AMP_BENCHMARKS=ON)
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
if [ -n "$deps" ]; then
  [ -d "$deps/googletest" ] && args+=(-DGTEST_SOURCE_DIR="$deps/googletest")
  [ -d "$deps/include/CLI" ] && args+=(-DCLI11_INCLUDE_DIR="$deps/include")
  [ -d "$deps/include/nlohmann" ] && args+=(-DNLOHMANN_JSON_INCLUDE_DIR="$deps/include")
  [ -d "$deps/include/gloo" ] && args+=(-DLIBTORCH_AMP_GLOO_INCLUDE_DIR="$deps/include")
fi

# ---- steps --------------------------------------------------------------------------------------------------------------
configure() {  # configure CAP RESERVE: (re)configures unless the build folder was configured with the same arguments
  local budget start stamp="$build_dir/gpu_check_configure_args.txt" wanted
  wanted=$(printf '%q\n' "${args[@]}")
  if [ -f "$build_dir/CMakeCache.txt" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
    note "configure" "reused ($build_dir, same arguments)"
    return 0
  fi
  budget=$(budget_s "$@") || { fail "configure" "not run: the phase's deadline is reached"; return 1; }
  start=$(date +%s)
  echo "== configure ($build_dir, at most $budget s)"
  if run_capped "$budget" "$phase_logs/configure.log" . cmake -S . -B "$build_dir" "${args[@]}"; then
    echo "$wanted" >"$stamp"
    note "configure" "ok ($(seconds_since "$start") s)"
    snapshot
    return 0
  fi
  fail "configure" "FAILED or cut after $(seconds_since "$start") s (configure.log)"
  tail -n 30 "$phase_logs/configure.log"
  snapshot
  return 1
}

build() {  # build NAME CAP RESERVE [--optional] TARGET...: builds with all cores
  local name="$1" cap_s="$2" reserve_s="$3" optional=0 budget start rc log
  shift 3
  [ "${1:-}" = --optional ] && { optional=1; shift; }
  log="$phase_logs/$name.log"
  if ! budget=$(budget_s "$cap_s" "$reserve_s"); then
    if [ $optional = 1 ]; then note "$name" "not run: no time left before the deadline"
    else fail "$name" "not run: the phase's deadline is reached"; fi
    return 1
  fi
  start=$(date +%s)
  echo "== $name: $* (at most $budget s)"
  run_capped "$budget" "$log" . cmake --build "$build_dir" -j "$jobs" --target "$@"
  rc=$?
  if [ $rc = 0 ]; then
    note "$name" "ok ($(seconds_since "$start") s, $jobs jobs)"
  elif [ $rc = 124 ] && [ $optional = 1 ]; then
    note "$name" "stopped at the deadline after $budget s; the next build goes on from there ($name.log)"
  elif [ $rc = 124 ]; then
    fail "$name" "OVER BUDGET: stopped after $budget s ($name.log)"
  else
    fail "$name" "FAILED ($name.log)"
    grep -E 'error' "$log" | head -n 20
  fi
  snapshot
  return $rc
}

count_tests() {  # count_tests REGEX [EXCLUDE]: how many registered tests ctest would run
  local a=(-N -R "$1")
  [ -n "${2:-}" ] && a+=(-E "$2")
  (cd "$build_dir" && timeout 120 ctest "${a[@]}") 2>/dev/null | sed -n 's/^Total Tests: *//p'
}

match_tests() {  # the registered tests each group would run, before any of them runs (a regex gone stale shows here)
  local i n
  for i in "${!never_run_parts[@]}"; do
    n=$(count_tests "${never_run_parts[$i]}" "$cpu_only_regex")
    note "tests: ${never_run_labels[$i]}" "${n:-?} registered (ctest -R '${never_run_parts[$i]}')"
  done
  n=$(count_tests "$never_run_regex" "$cpu_only_regex")
  [ "${n:-0}" -gt 0 ] || fail "tests: never run on a GPU" "none registered: the names no longer match (ctest -N)"
  n=$(count_tests "$gpu_regex" "$never_run_regex|$cpu_only_regex")
  [ "${n:-0}" -gt 0 ] || fail "tests: other CUDA" "none registered: the names no longer match (ctest -N)"
  (cd "$build_dir" && timeout 120 ctest -N -R "$gpu_regex|$cpu_twin_regex") >"$phase_logs/tests-registered.txt" 2>&1
}

ctest_group() {  # ctest_group NAME CAP RESERVE JOBS REGEX EXCLUDE gpu|cpu: one group, each test's line as it ends
  local name="$1" cap_s="$2" reserve_s="$3" group_jobs="$4" regex="$5" exclude="$6" kind="$7" budget start rc log
  local -a a
  log="$phase_logs/ctest-$name.log"
  budget=$(budget_s "$cap_s" "$reserve_s") || { fail "ctest $name" "not run: the phase's deadline is reached"; return; }
  a=(--output-on-failure --no-tests=error -j "$group_jobs" --timeout "$(( test_s < budget ? test_s : budget ))"
     -R "$regex")
  [ -n "$exclude" ] && a+=(-E "$exclude")
  start=$(date +%s)
  echo "== ctest $name (at most $budget s): -R '$regex'${exclude:+" -E '$exclude'"}"
  (cd "$build_dir" && exec timeout -k 5 "$budget" ctest "${a[@]}") >"$log" 2>&1 &
  child_pid=$!
  tail -n +1 -s 0.5 -F --pid="$child_pid" "$log" 2>/dev/null | grep --line-buffered -E 'Test +#[0-9]+:' &
  stream_pid=$!
  wait "$child_pid"
  rc=$?
  child_pid=""
  wait "$stream_pid" 2>/dev/null
  stream_pid=""
  local counts ran skipped
  counts=$(grep -E 'tests passed' "$log" | tail -n 1)
  ran=$(grep -cE 'Test +#[0-9]+:.* sec' "$log")
  skipped=$(grep -cE 'Test +#[0-9]+:.*Skipped' "$log")
  if [ $rc = 124 ]; then
    fail "ctest $name" "OVER BUDGET: stopped after $budget s, $ran test(s) had ended (ctest-$name.log)"
  elif [ $rc != 0 ]; then
    fail "ctest $name" "${counts:-FAILED: no count (ctest-$name.log)} ($(seconds_since "$start") s)"
  else
    note "ctest $name" "$counts ($(seconds_since "$start") s)"
  fi
  note "ctest $name skipped" "$skipped of $ran"
  # Every failure by name; on the GPU every skip too (a CUDA test that skips there is news, not noise).
  local line
  while IFS= read -r line; do
    fail "  FAILED" "$line"
  done < <(sed -n '/The following tests FAILED/,$p' "$log" | sed -n 's/^[[:space:]]*[0-9]* - //p')
  if [ "$dry_run" = 0 ]; then
    while IFS= read -r line; do
      note "  skipped" "$line"
    done < <(grep -E 'Test +#[0-9]+:.*Skipped' "$log" | sed 's/.*Test *#[0-9]*: *\([^ ]*\).*/\1/')
  elif [ "$kind" = gpu ]; then
    # Without a GPU every test of a GPU group must skip (STYLE.md); one that passes is a CPU test the GPU check would
    # spend lease time on: rename it, or add it to cpu_only_regex.
    while IFS= read -r line; do
      fail "  ran without a GPU" "$line: a CPU test in a GPU group (rename it or add it to cpu_only_regex)"
    done < <(grep -E 'Test +#[0-9]+:.* Passed' "$log" | sed 's/.*Test *#[0-9]*: *\([^ ]*\).*/\1/')
  fi
  snapshot
}

bench_cap() { awk -v s="$1" -v k="$bench_scale" 'BEGIN { printf "%d", s * k }'; }

bench_rows() {  # bench_rows LOG: a benchmark's result rows (lines with a ratio such as 1.23x), the line above first
  awk 'NF == 0 { next }
       /[0-9]x([ ,;)]|$)/ { if (!seen && prev != "") print prev; seen = 1; print; next }
       { prev = $0 }' "$1" | tr -s ' ' | head -n 16
}

run_bench() {  # run_bench NAME CAP ARGS...: its last line into the summary
  local name="$1" budget exe rc start log
  exe="$build_dir/benchmarks/$name"
  log="$phase_logs/$name.txt"
  budget=$(budget_s "$(bench_cap "$2")") || { fail "$name" "not run: the phase's deadline is reached"; return; }
  shift 2
  if [ ! -x "$exe" ]; then fail "$name" "not built"; return; fi
  start=$(date +%s)
  echo "== $name $* (at most $budget s)"
  run_capped "$budget" "$log" . "$exe" "$@"
  rc=$?
  if [ $rc = 0 ]; then
    note "$name" "ok ($(seconds_since "$start") s)"
    local row
    while IFS= read -r row; do note "" "  $row"; done < <(bench_rows "$log")
  elif [ $rc = 124 ]; then
    fail "$name" "OVER BUDGET: stopped after $budget s ($name.txt)"
  else
    fail "$name" "FAILED, exit $rc ($name.txt)"
    tail -n 10 "$log"
  fi
  snapshot
}

amp_vs_fp32() {  # amp_vs_fp32 NAME CAP ARGS...: the main job, with its headline rows in the summary
  local name="$1" budget rc start exe="$build_dir/benchmarks/bench_amp_vs_fp32" log dir
  log="$phase_logs/$name.txt"
  dir="$phase_logs/$name"
  budget=$(budget_s "$(bench_cap "$2")") || { fail "$name" "not run: the phase's deadline is reached"; return; }
  shift 2
  if [ ! -x "$exe" ]; then fail "$name" "not built"; return; fi
  start=$(date +%s)
  echo "== $name: bench_amp_vs_fp32 $* (at most $budget s)"
  run_capped "$budget" "$log" . "$exe" "$@" --out "$dir"
  rc=$?
  if [ $rc != 0 ] || [ ! -f "$dir/amp_vs_fp32.csv" ]; then
    if [ $rc = 124 ]; then fail "$name" "OVER BUDGET: stopped after $budget s ($name.txt)"
    else fail "$name" "FAILED, exit $rc ($name.txt)"; tail -n 20 "$log"; fi
    snapshot
    return
  fi
  # Headline (the issue's H200 targets): O2 on the transformer vs FP32 and TF32 throughput, peak memory vs FP32 and
  # throughput vs torch.amp. Columns by name.
  local line
  while IFS= read -r line; do note "$name" "$line"; done < <(awk -F, '
    function v(x) { return x == "" ? "-" : x }
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    { status = $col["status"]; config = $col["config"]; model = $col["model"] }
    status != "ok" { skipped++ }
    config ~ /^O2 / && status != "ok" { print model " " config ": skipped" }
    model == "transformer" && config ~ /^O2 / && status == "ok" {
      print "transformer " config ": " v($col["x_fp32"]) "x FP32, " v($col["x_tf32"]) "x TF32, mem " \
            v($col["peak_x_fp32"]) "x FP32, " v($col["x_torch_amp"]) "x torch.amp" }
    END { if (skipped) print skipped " run(s) skipped" }' "$dir/amp_vs_fp32.csv")
  note "$name time" "$(seconds_since "$start") s"
  grep -q 'skipped: ' "$log" && status=1
  snapshot
}

# ---- phases -------------------------------------------------------------------------------------------------------------
# Caps in seconds, GPU / dry run. The GPU caps of each phase's required steps add up to its deadline (docs/gpu_check.md);
# a build never eats into the time promised to the steps after it (its RESERVE).
phase_build_test() {
  begin_phase build-test
  if configure "$(cap 60 600)" 0 && build build "$(cap 240 1800)" "$(cap 70 0)" "${test_targets[@]}"; then
    match_tests
    # The tests never run on a GPU first; then the other CUDA tests. Not the CPU-only tests: CI runs those.
    ctest_group never-run-on-gpu "$(cap 60 300)" "$(cap 30 0)" "$test_jobs" "$never_run_regex" "$cpu_only_regex" gpu
    ctest_group other-cuda "$(cap 40 600)" 0 "$test_jobs" "$gpu_regex" "$never_run_regex|$cpu_only_regex" gpu
    # Without a GPU the CUDA tests skip: run their CPU twins, so the dry run proves something.
    [ "$dry_run" = 1 ] && ctest_group cpu-twins 600 0 "$jobs" "$cpu_twin_regex" "" cpu
    # The time left builds the bench call's programs (on a warm machine that call then only runs them).
    build build-benchmarks "$(cap 120 1800)" 0 --optional "${bench_headline_targets[@]}" "${bench_kernel_targets[@]}"
  fi
  end_phase
}

phase_bench() {
  begin_phase bench
  if configure "$(cap 60 600)" 0; then
    # Headline first: its programs are built and run before the kernel benchmarks are built.
    if build build-headline "$(cap 150 1800)" "$(cap 60 0)" "${bench_headline_targets[@]}"; then
      if [ "$dry_run" = 0 ]; then
        amp_vs_fp32 amp_vs_fp32_transformer 50 --full --models transformer --steps 35 --warmup 5 --rounds 3
        run_bench bench_fp8_linear 25 --full --rounds 3
      else
        amp_vs_fp32 amp_vs_fp32_transformer 300 --models transformer --steps 3 --warmup 1 --rounds 1 --threads 1
        run_bench bench_fp8_linear 120 --rounds 1
      fi
    fi
    if build build-kernel-benchmarks "$(cap 60 1800)" 0 "${bench_kernel_targets[@]}"; then
      if [ "$dry_run" = 0 ]; then
        run_bench bench_unscale 10 --full --rounds 5
        run_bench bench_fused_adamw 10 --full --rounds 5
        run_bench bench_amp_overhead 10 --rounds 10
        run_bench bench_fused_dense 12 --rounds 3
        run_bench bench_l2_norm 10 --full --rounds 5
        run_bench bench_multi_tensor_scale 10 --full --rounds 5
      else
        run_bench bench_unscale 120 --rounds 2
        run_bench bench_fused_adamw 120 --rounds 2
        run_bench bench_amp_overhead 120 --rounds 2
        run_bench bench_fused_dense 120 --rounds 1
        run_bench bench_l2_norm 120 --rounds 2
        run_bench bench_multi_tensor_scale 120 --rounds 2
      fi
    fi
  fi
  end_phase
}

# ---- OUTDIR against the device's limits -----------------------------------------------------------------------------
check_outdir() {  # lists what OUTDIR holds; fails when the device would not return all of it
  local root="$out" out_root f rel n=0 total=0 size bad=0 folders
  # On the device machine, check the whole of $OUT when OUTDIR is inside it.
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    out_root=$(cd "$OUT" && pwd)
    case "$out/" in "$out_root"/*) root=$out_root ;; esac
  fi
  echo
  echo "== what the device would return from $root (at most $out_max_files files, $out_max_folders folders down):"
  while IFS= read -r -d '' f; do
    rel=${f#"$root"/}
    if [ -L "$f" ]; then echo "  $rel: a link (links do not come back)"; bad=1; continue; fi
    if ! [[ "$rel" =~ ^[A-Za-z0-9._/-]+$ ]]; then echo "  $rel: a name outside [A-Za-z0-9._-]"; bad=1; fi
    if [ -d "$f" ]; then
      case "$f/" in "$out"/?*) echo "  $rel/: a folder inside OUTDIR (the script writes files only)"; bad=1 ;; esac
      continue
    fi
    if [ ! -f "$f" ]; then echo "  $rel: not a plain file"; bad=1; continue; fi
    folders=$(printf '%s' "$rel" | tr -cd '/' | wc -c)
    size=$(stat -c %s "$f")
    total=$((total + size))
    n=$((n + 1))
    echo "  $rel ($size bytes)"
    [ "$folders" -le "$out_max_folders" ] || { echo "  $rel: more than $out_max_folders folders down"; bad=1; }
    [ "$size" -le "$out_max_file_bytes" ] || { echo "  $rel: over 16 MiB"; bad=1; }
  done < <(find "$root" -mindepth 1 -print0 | sort -z)
  echo "  $n file(s), $total bytes"
  [ "$n" -le "$out_max_files" ] || { echo "  more than $out_max_files files: the device would not return them all"; bad=1; }
  [ "$total" -le "$out_max_total_bytes" ] || { echo "  over 64 MiB in all"; bad=1; }
  if [ $bad = 1 ]; then
    echo "gpu_check: OUTDIR breaks the device's limits on what comes back (above)" >&2
    status=1
  fi
}

case "$phase_arg" in
  build-test) phase_build_test ;;
  bench) phase_bench ;;
  all)
    phase_build_test
    phase_bench
    ;;
esac
check_outdir
exit $status
