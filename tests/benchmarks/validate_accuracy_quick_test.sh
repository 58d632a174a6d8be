#!/usr/bin/env bash
# benchmarks/validate_accuracy.sh --quick as CI's smoke test of the program (issue 26): every configuration trains
# its few steps and is recorded, the table, CSV and plot are written, and a second run resumes (it runs nothing and
# says each run was recorded before). It asserts only that the program runs and writes its outputs: the accuracy of
# a few steps says nothing. Then the same for --task transformer (its held-out loss; no data set needed). Skipped (77)
# where Fashion-MNIST is not installed.
# Usage: validate_accuracy_quick_test.sh SOURCE_DIR BUILD_DIR OUT_DIR
set -uo pipefail
src=$1 build=$2 out=$3
data=/usr/share/datasets/fashion-mnist
if ! ls "$data"/train-images-idx3-ubyte* >/dev/null 2>&1; then
  echo "skipped: Fashion-MNIST is not installed in $data (apt-get install dataset-fashion-mnist)"
  exit 77
fi
rm -rf "$out"
script=$src/benchmarks/validate_accuracy.sh
check() { if ! eval "$1"; then echo "FAILED: $2"; exit 1; fi; }

first=$(bash "$script" --quick --build "$build" --out "$out" 2>&1)
status=$?
echo "$first"
check '((status == 0))' "the first run ended with status $status"
configs=$(bash "$script" --list | wc -l)
check '[[ $(grep -c "seed 1: test accuracy" <<<"$first") -eq $configs ]]' "not every one of the $configs configurations ran"
check '[[ -s $out/validation.md && -s $out/validation.csv ]]' "no table or CSV in $out"
check '[[ $(($(wc -l <"$out/validation.csv") - 1)) -eq $configs ]]' "the CSV does not have a row per configuration"
check 'grep -q "| FP32, 1 process | 1 |" "$out/validation.md"' "the table has no FP32 row"
if command -v gnuplot >/dev/null 2>&1; then
  check '[[ -s $out/validation.png ]]' "gnuplot is installed but no plot was written"
fi
check '[[ -z $(find "$out" -name "*.tmp") ]]' "a temporary file was left behind"

second=$(bash "$script" --quick --build "$build" --out "$out" 2>&1)
status=$?
check '((status == 0))' "the second run ended with status $status: $second"
check '[[ $(grep -c "recorded before" <<<"$second") -eq $configs ]]' "the second run did not resume: $second"
check '! grep -q "test accuracy .*%, last-epoch loss" <<<"$second"' "the second run trained again: $second"

# The transformer: every configuration (SyncBatchNorm excepted) gives a held-out loss; its outputs go elsewhere.
tout=$out-transformer
rm -rf "$tout"
first=$(bash "$script" --task transformer --quick --build "$build" --out "$tout" 2>&1)
status=$?
echo "$first"
check '((status == 0))' "the transformer's first run ended with status $status"
tconfigs=$(bash "$script" --task transformer --list | wc -l)
check '((tconfigs == configs - 1)) && ! bash "$script" --task transformer --list | grep -q syncbn' \
  "the transformer's configurations are not the CNN's without SyncBatchNorm"
check '[[ $(grep -cE "seed 1: held-out loss [0-9.]+, next-token accuracy [0-9.]+%" <<<"$first") -eq $tconfigs ]]' \
  "not every one of the transformer's $tconfigs configurations ran"
check '[[ $(($(wc -l <"$tout/validation.csv") - 1)) -eq $tconfigs ]] && grep -q "held-out loss (mean)" "$tout/validation.md"' \
  "no transformer table and CSV with a row per configuration in $tout"
second=$(bash "$script" --task transformer --quick --build "$build" --out "$tout" 2>&1)
check '[[ $(grep -c "recorded before (held-out loss" <<<"$second") -eq $tconfigs ]]' "the transformer's second run did not resume: $second"

bad=$(bash "$script" --seeds 0 2>&1)
status=$?
check '((status == 2)) && [[ $bad == "validate_accuracy.sh: --seeds must be a positive integer, got '"'"'0'"'"'" ]]' \
  "a bad --seeds is not one line with status 2: $status $bad"
bad=$(bash "$script" --configs fp32,nope --build "$build" 2>&1)
check '[[ $bad == *"--configs: no configuration '"'"'nope'"'"'"* ]]' "an unknown configuration is not named: $bad"
bad=$(bash "$script" --build /nonexistent 2>&1)  # (the default --out on the way)
status=$?
check '((status == 2)) && [[ $bad == *"/nonexistent/ddp/ddp-launch is missing"* ]]' \
  "a missing build is not one line with status 2: $status $bad"
bad=$(bash "$script" --task transformer --epochs 2 2>&1)
status=$?
check '((status == 2)) && [[ $bad == *"--epochs is for --task cnn (the transformer takes --steps)" ]]' \
  "--epochs with the transformer is not one line with status 2: $status $bad"
echo "validate_accuracy.sh --quick: all $configs CNN and $tconfigs transformer configurations ran, the outputs were" \
  "written, the second runs resumed"
