#!/usr/bin/env bash
# Question (issue 26): does mixed precision or data parallelism cost accuracy? The example CNN (amp_ddp, the program
# a user runs) is trained on the full Fashion-MNIST (60,000 training images, 10,000 test) under every precision and
# parallel mode the project offers, several seeds each, with one fixed recipe; the table gives each configuration's
# test accuracy (mean, spread), its difference from FP32 and whether it lies within FP32's own seed spread.
#
# Every configuration runs `ddp-launch --nproc-per-node P amp_ddp <recipe> <its flags> --seed S`; the recipe is the
# same for all (a global batch, so 1, 2 and 4 processes take the same samples per step). Seeds run in the outer loop
# (a first full table comes early) and each run is recorded as it finishes, in <out>/runs/<config>-seed<S>.txt,
# written atomically: run the script again and it goes on where it stopped. A benchmark: run it by hand on an idle
# machine (it prints uptime), never in CI, where --quick (a few steps per configuration, one seed) checks that it
# runs and writes its outputs.
#
# Outputs in <out>: validation.md (the recipe, the table), validation.csv, validation.png (gnuplot, when installed).
#
# --task transformer does the same for benchmarks/common's tiny transformer (bench_validate_transformer, synthetic
# bigram tokens): its held-out next-token loss instead of test accuracy, the same configurations but SyncBatchNorm
# (the transformer has no BatchNorm), into benchmarks/results/validation-transformer. One run of its recipe (200
# steps of 32 sequences, 4096 held-out sequences) took 14-17 s in FP32 and bf16, 40 s with FP8, 16-26 s on 2 and 4
# processes, but ~250 s in fp16 (emulated); the whole table (3 seeds) 36 min on the same idle machine (2026-12-04).
#
# Time on the 2-core AMD EPYC VM (2026-12-03, idle, RESULTS.md), one run of one epoch of 60,000 images at global
# batch 128, start and test included: FP32 ~35 s, bf16 O1-O3 23-26 s, O2 + FP8 26 s, ZeRO 27-29 s, DDP 2 ranks 38 s,
# 4 ranks 44 s, SyncBatchNorm 2 ranks 39 s, but fp16 ~210 s (this CPU has no fp16 arithmetic: LibTorch emulates it).
# The default recipe (1 epoch, 3 seeds) took 17 min without the two fp16 configurations and 24 min more for them,
# within the hour the table may take on this machine; --epochs 2 doubles it.
# It can run in sittings (--configs): the table always sums up every configuration's records so far.
set -euo pipefail
me=validate_accuracy.sh
usage="Usage: benchmarks/$me [--task cnn|transformer] [--quick] [--seeds N] [--epochs E | --steps S] [--configs NAME,...] [--out DIR] [--build DIR] [--data DIR] [--device D] [--list]"
fail() { echo "$me: $*" >&2; exit 2; }
positive() { [[ $2 =~ ^[1-9][0-9]*$ ]] || fail "$1 must be a positive integer, got '$2'"; }

# name | processes | flags | what it is (the table's rows, in this order; fp32 is the reference)
cnn_configs="
fp32|1|--opt-level O0|FP32, 1 process
o1-bf16|1|--opt-level O1 --dtype bf16|O1 (autocast) bf16
o2-bf16|1|--opt-level O2 --dtype bf16|O2 (bf16 model, FP32 masters)
o3-bf16|1|--opt-level O3 --dtype bf16|O3 (bf16 everything)
o1-fp16|1|--opt-level O1 --dtype fp16|O1 fp16, dynamic loss scaling
o2-fp16|1|--opt-level O2 --dtype fp16|O2 fp16, dynamic loss scaling
o2-bf16-fp8|1|--opt-level O2 --dtype bf16 --fp8 delayed|O2 bf16 + FP8 fc1 (delayed scaling)
ddp2-fp32|2|--opt-level O0|DDP, 2 processes, FP32
ddp4-fp32|4|--opt-level O0|DDP, 4 processes, FP32
zero1-o2|2|--opt-level O2 --dtype bf16 --zero 1|ZeRO-1, 2 processes, O2 bf16
zero2-o2|2|--opt-level O2 --dtype bf16 --zero 2|ZeRO-2, 2 processes, O2 bf16
syncbn2-fp32|2|--opt-level O0 --sync-bn|SyncBatchNorm, 2 processes, FP32
"
# The transformer's: the same but SyncBatchNorm; FP8 covers every linear layer of its blocks and its head.
transformer_configs=$(grep -v '^syncbn' <<<"$cnn_configs" | sed 's/|O2 bf16 + FP8 fc1 (delayed scaling)$/|O2 bf16 + FP8 linear layers (delayed scaling)/')

task=cnn quick=0 seeds=3 epochs="" steps="" configs="" out="" build=${BUILD_DIR:-build} data="" device=cpu list=0
while (($#)); do
  case $1 in
    --task) [[ $# -ge 2 ]] || fail "--task needs a value"; task=$2; shift ;;
    --steps) [[ $# -ge 2 ]] || fail "--steps needs a value"; positive --steps "$2"; steps=$2; shift ;;
    --quick) quick=1 ;;
    --seeds) [[ $# -ge 2 ]] || fail "--seeds needs a value"; positive --seeds "$2"; seeds=$2; shift ;;
    --epochs) [[ $# -ge 2 ]] || fail "--epochs needs a value"; positive --epochs "$2"; epochs=$2; shift ;;
    --configs) [[ $# -ge 2 ]] || fail "--configs needs a value"; configs=$2; shift ;;
    --out) [[ $# -ge 2 ]] || fail "--out needs a value"; out=$2; shift ;;
    --build) [[ $# -ge 2 ]] || fail "--build needs a value"; build=$2; shift ;;
    --data) [[ $# -ge 2 ]] || fail "--data needs a value"; data=$2; shift ;;
    --device) [[ $# -ge 2 ]] || fail "--device needs a value"; device=$2; shift ;;
    --list) list=1 ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *) fail "unknown argument '$1' ($usage)" ;;
  esac
  shift
done
case $task in
  cnn) configs_table=$cnn_configs; [[ -z $steps ]] || fail "--steps is for --task transformer (the CNN takes --epochs)" ;;
  transformer) configs_table=$transformer_configs; [[ -z $epochs ]] || fail "--epochs is for --task cnn (the transformer takes --steps)" ;;
  *) fail "--task must be cnn or transformer, got '$task'" ;;
esac
if ((list)); then
  awk -F'|' 'NF {printf "%-14s %d process(es)  %-40s %s\n", $1, $2, $3, $4}' <<<"$configs_table"
  exit 0
fi
all_names=$(awk -F'|' 'NF {print $1}' <<<"$configs_table" | paste -sd, -)
IFS=, read -r -a all <<<"$all_names"
# The table's line of configuration $1 (exact name), empty when there is none.
config_line() { awk -F'|' -v name="$1" '$1 == name' <<<"$configs_table"; }
[[ -n $configs ]] || configs=$all_names
IFS=, read -r -a chosen <<<"$configs"
((${#chosen[@]})) || fail "--configs: no configuration named (one or more of: $all_names)"
for name in "${chosen[@]}"; do
  [[ -n $(config_line "$name") ]] || fail "--configs: no configuration '$name' (one of: $all_names)"
done
# (--quick keeps its outputs apart from the real table's.)
if [[ -z $out ]]; then
  out=benchmarks/results/validation
  [[ $task == cnn ]] || out+=-$task
  ((quick == 0)) || out+=-quick
fi

# What each task runs, its recipe (one global batch for every process count) and what its table reports: the
# metric a run's last line gives ("<metric> (mean)" in the table) and a second figure beside it.
if [[ $task == cnn ]]; then
  # The example's SGD (momentum 0.9), the data's own order, 1 epoch unless --epochs.
  program=$build/python_free_examples/amp_ddp
  recipe=(--device "$device" --global-batch-size 128 --lr 0.05 --epochs "${epochs:-1}" --quiet)
  ((quick == 0)) || recipe=(--device "$device" --global-batch-size 64 --lr 0.05 --epochs 1 --limit-train 512 --quiet)
  [[ -n $data ]] && recipe+=(--data "$data")
  metric="test accuracy %" second="last-epoch loss" metric_format=%.2f second_format=%.4f
  title="amp_ddp on Fashion-MNIST"
else
  [[ -z $data ]] || fail "--data is for --task cnn (the transformer's tokens are generated from --seed)"
  # AdamW (weight decay 0.01), peak lr 1e-3 after a warmup of a tenth of the steps, cosine decay to 0; 4096
  # held-out sequences (RESULTS.md).
  steps=${steps:-200}
  ((steps >= 3)) || fail "--steps must be at least 3 for the transformer (warmup, then decay), got $steps"
  program=$build/benchmarks/bench_validate_transformer
  recipe=(--device "$device" --global-batch-size 32 --lr 1e-3 --warmup-steps $((steps / 10)) --steps "$steps" --eval-sequences 4096)
  ((quick == 0)) || recipe=(--device "$device" --global-batch-size 8 --lr 1e-3 --warmup-steps 2 --steps 8 --eval-sequences 16)
  metric="held-out loss" second="next-token accuracy %" metric_format=%.4f second_format=%.2f
  title="the tiny transformer (bench_validate_transformer) on synthetic bigram tokens"
fi
((quick == 0)) || seeds=1
# "<label> <value>", or "<label> <value>%" for a label that ends in " %" ("test accuracy %").
show() { if [[ $1 == *" %" ]]; then echo "${1% %} $2%"; else echo "$1 $2"; fi; }

launch=$build/ddp/ddp-launch
for exe in "$launch" "$program"; do
  [[ -x $exe ]] || fail "$exe is missing: build it first (make build, or --build DIR)"
done
mkdir -p "$out/runs" 2>/dev/null || fail "--out $out: cannot make the folder"
[[ -w $out/runs ]] || fail "--out $out: not writable"
logs=$out/logs
mkdir -p "$logs"

# One record per finished run: "<config> <seed> <metric> <second figure> <wall s>".
# The recipe is part of each record's folder key so that a changed recipe never mixes with old runs.
key=$(printf '%s ' "${recipe[@]}" | cksum | cut -d' ' -f1)
runs=$out/runs/$key
mkdir -p "$runs"
printf '%s\n' "${recipe[*]}" >"$runs/recipe.txt"

echo "$me, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'): $(uptime)"
echo "recipe: $(basename "$program") ${recipe[*]}; seeds 1-$seeds; records in $runs"
failed=0
for ((seed = 1; seed <= seeds; seed++)); do
  for name in "${chosen[@]}"; do
    IFS='|' read -r _ procs flags what < <(config_line "$name")
    record=$runs/$name-seed$seed.txt
    if [[ -s $record ]]; then
      echo "  $name seed $seed: recorded before ($(show "$metric" "$(cut -d' ' -f3 "$record")"))"
      continue
    fi
    log=$logs/$name-seed$seed.log
    start=$(date +%s.%N)
    # shellcheck disable=SC2086  # $flags is a list of flags
    if ! "$launch" --nproc-per-node "$procs" --master-port 0 "$program" "${recipe[@]}" $flags --seed "$seed" \
      >"$log" 2>&1; then
      echo "  $name seed $seed: FAILED: $(grep -v '^\s*$' "$log" | tail -1) (log: $log)"
      failed=$((failed + 1))
      continue
    fi
    wall=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}')
    if [[ $task == cnn ]]; then
      last=$(grep -E '^epoch [0-9]+/[0-9]+: mean loss [^ ]+ \| test accuracy [0-9.]+%' "$log" | tail -1 || true)
      value=$(sed -E 's/.*test accuracy ([0-9.]+)%.*/\1/' <<<"$last")
      other=$(sed -E 's/.*mean loss ([^ ]+) .*/\1/' <<<"$last")
    else
      last=$(grep -E '^held-out loss [0-9.]+ \| next-token accuracy [0-9.]+%' "$log" | tail -1 || true)
      value=$(sed -E 's/^held-out loss ([0-9.]+) .*/\1/' <<<"$last")
      other=$(sed -E 's/.*next-token accuracy ([0-9.]+)%.*/\1/' <<<"$last")
    fi
    if [[ ! $value =~ ^[0-9.]+$ ]]; then
      echo "  $name seed $seed: FAILED: no '$metric' line in its output (log: $log)"
      failed=$((failed + 1))
      continue
    fi
    echo "$name $seed $value $other $wall" >"$record.tmp" && mv "$record.tmp" "$record"
    echo "  $name seed $seed: $(show "$metric" "$value"), $(show "$second" "$other"), $wall s ($what)"
  done
done

# The table: every configuration (this sitting's or not), over its recorded seeds.
summary() {
  local name procs flags what files
  for name in "${all[@]}"; do
    IFS='|' read -r _ procs flags what < <(config_line "$name")
    files=("$runs/$name"-seed*.txt)
    [[ -e ${files[0]} ]] || files=()
    cat "${files[@]}" /dev/null | awk -v name="$name" -v what="$what" -v flags="$flags" -v p="$procs" '
      { n++; acc[n] = $3; s += $3; ss += $3 * $3; loss += $4; wall += $5
        if (n == 1 || $3 < lo) lo = $3; if (n == 1 || $3 > hi) hi = $3 }
      END { if (n == 0) { printf "%s|%s|%s|%s|0\n", name, what, p, flags; exit }
            m = s / n; sd = n > 1 ? sqrt((ss - n * m * m) / (n - 1)) : 0; if (sd != sd) sd = 0
            printf "%s|%s|%s|%s|%d|%.6f|%.6f|%.6f|%.6f|%.6f|%.1f\n", name, what, p, flags, n, m, sd, lo, hi, loss / n, wall / n }'
  done
  return 0
}
rows=$(summary)
table() {
  awk -F'|' -v metric="$metric" -v second="$second" -v mf="$metric_format" -v sf="$second_format" '
    NR == 1 { ref_n = $5; ref_m = $6; ref_lo = $8; ref_hi = $9 }
    { rows[NR] = $0 }
    END {
      printf "| configuration | processes | flags | seeds | %s (mean) | sd | min-max | vs FP32 | within FP32 seed spread | %s | wall s per run |\n", metric, second
      print "|---|---|---|---|---|---|---|---|---|---|---|"
      for (i = 1; i <= NR; i++) {
        split(rows[i], f, "|")
        if (f[5] == 0) { printf "| %s | %s | `%s` | 0 | not run | | | | | | |\n", f[2], f[3], f[4]; continue }
        diff = ref_n == 0 ? "n/a: no FP32 run" : sprintf("%+" substr(mf, 2), f[6] - ref_m)
        if (i == 1) within = "(reference)"
        else if (ref_n == 0) within = "n/a: no FP32 run"
        else if (ref_n < 2) within = "n/a: FP32 has one seed"
        else within = (f[6] >= ref_lo && f[6] <= ref_hi) ? "yes" : "**no**"
        printf "| %s | %s | `%s` | %d | " mf " | " mf " | " mf "-" mf " | %s | %s | " sf " | %.1f |\n", f[2], f[3],
               f[4], f[5], f[6], f[7], f[8], f[9], i == 1 ? "0" : diff, within, f[10], f[11]
      }
    }' <<<"$1"
}
md=$out/validation.md
{
  echo "Accuracy validation: $title, $(date -u +%Y-%m-%d), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'))."
  echo
  echo "Recipe: \`ddp-launch --nproc-per-node P $(basename "$program") ${recipe[*]} <flags> --seed S\`, seeds 1, 2, ... (the seeds column)."
  echo "Within FP32's seed spread: the configuration's mean lies between FP32's lowest and highest seed."
  echo
  table "$rows"
} >"$md.tmp" && mv "$md.tmp" "$md"
{
  if [[ $task == cnn ]]; then
    echo "config,processes,flags,seeds,accuracy_mean,accuracy_sd,accuracy_min,accuracy_max,last_epoch_loss,wall_s"
  else
    echo "config,processes,flags,seeds,held_out_loss_mean,held_out_loss_sd,held_out_loss_min,held_out_loss_max,next_token_accuracy,wall_s"
  fi
  awk -F'|' '$5 > 0 {printf "%s,%s,\"%s\",%s,%s,%s,%s,%s,%s,%s\n", $1, $3, $4, $5, $6, $7, $8, $9, $10, $11}' <<<"$rows"
} >"$out/validation.csv.tmp" && mv "$out/validation.csv.tmp" "$out/validation.csv"
table "$rows"

plot_note="no PNG: gnuplot is not installed (apt-get install gnuplot-nox)"
awk -F'|' '$5 > 0 {printf "%d \"%s\" %s %s %s\n", x++, $1, $6, $8, $9}' <<<"$rows" >"$out/validation.dat"
if [[ ! -s $out/validation.dat ]]; then
  plot_note="no PNG: no run is recorded yet"
elif command -v gnuplot >/dev/null 2>&1; then
  ref=$(awk -F'|' 'NR == 1 && $5 > 0 {print $8, $9}' <<<"$rows")
  {
    echo "set terminal pngcairo size 1100,500 font ',10'"
    echo "set output '$out/validation.png.tmp'"
    echo "set title '${metric^} per configuration (mean, min-max over seeds); band: FP32 seed spread'"
    echo "set ylabel '$metric'; set xtics rotate by -30; set grid ytics; set key off"
    echo "set xrange [-0.5:$(($(wc -l <"$out/validation.dat") - 1)).5]"
    if [[ -n $ref ]]; then
      read -r lo hi <<<"$ref"
      echo "set object 1 rect from graph 0, first $lo to graph 1, first $hi fc rgb '#cce5ff' fs solid 0.5 behind"
    fi
    echo "plot '$out/validation.dat' using 1:3:4:5:xtic(2) with yerrorbars pt 7 ps 1.2 lc rgb '#1f4e79'"
  } >"$out/validation.gnuplot"
  # pngcairo draws better; plain png (libgd) is the fallback where gnuplot was built without cairo.
  if gnuplot "$out/validation.gnuplot" 2>"$out/validation.gnuplot.log" ||
    { sed -i "s/^set terminal pngcairo/set terminal png/" "$out/validation.gnuplot" &&
      gnuplot "$out/validation.gnuplot" 2>"$out/validation.gnuplot.log"; }; then
    mv "$out/validation.png.tmp" "$out/validation.png"
    plot_note="plot: $out/validation.png"
  else
    rm -f "$out/validation.png.tmp"
    plot_note="no PNG: gnuplot failed (see $out/validation.gnuplot.log)"
  fi
fi
echo "table: $md; $out/validation.csv; $plot_note"
if ((failed)); then
  echo "$me: $failed run(s) failed (their logs are named above); run again to retry them" >&2
  exit 1
fi
