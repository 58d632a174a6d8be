#!/usr/bin/env bash
# bench_validate_transformer --fsdp (issue 42): the tiny transformer with each block a unit of full sharding, amp O2
# over it (and with FP8 layers, delayed scaling), trains like DDP + amp O2 at 2 ranks: every printed training loss and
# the held-out loss and accuracy are the same digits (both reduce the gradients in bf16 and sum two ranks' values, one
# rounding either way). And --fsdp with --zero or O3 is refused in one line with a non-zero exit.
# Usage: validate_transformer_fsdp_test.sh DDP_LAUNCH BENCH_VALIDATE_TRANSFORMER
set -uo pipefail
launch=$1 program=$2
check() { if ! eval "$1"; then echo "FAILED: $2"; exit 1; fi; }
run() { "$launch" --nproc-per-node 2 "$program" --opt-level O2 --steps 8 --warmup-steps 2 --eval-sequences 64 "$@" 2>&1; }

figures() { grep -E "^(step [0-9]+/[0-9]+: mean training loss|held-out loss)" <<<"$1"; }
for fp8 in off delayed; do
  ddp=$(run --fp8 "$fp8")
  ddp_status=$?
  fsdp=$(run --fp8 "$fp8" --fsdp)
  fsdp_status=$?
  echo "== DDP + amp O2, --fp8 $fp8"; echo "$ddp"; echo "== full sharding + amp O2, --fp8 $fp8"; echo "$fsdp"
  check '((ddp_status == 0 && fsdp_status == 0))' "--fp8 $fp8: a run failed (DDP $ddp_status, full sharding $fsdp_status)"
  check 'grep -q "| full sharding |" <<<"$fsdp"' "the --fsdp run does not say it runs full sharding"
  check '[[ $(figures "$ddp" | wc -l) -ge 2 ]]' "--fp8 $fp8: the DDP run printed no losses"
  check '[[ "$(figures "$ddp")" == "$(figures "$fsdp")" ]]' "--fp8 $fp8: full sharding's losses differ from DDP + amp's"
done
check '[[ "$fsdp" == *"Float8Linear layers run in FP8"* ]]' "--fp8 delayed: no layer runs in FP8"

for bad in "--zero 1" "--opt-level O3"; do
  # shellcheck disable=SC2086
  message=$("$program" --fsdp $bad 2>&1)
  status=$?
  check '((status != 0))' "--fsdp $bad exited 0"
  check '[[ $(wc -l <<<"$message") -eq 1 && $message == *--fsdp* ]]' "--fsdp $bad: not one line naming --fsdp: $message"
done
echo "passed"
