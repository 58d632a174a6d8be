#!/usr/bin/env bash
# The HTML report as a reader opens it (issue 24): a 2-rank amp_ddp run under ddp-launch writes --report, and
# check_report_in_browser.sh loads it in headless chromium: no JavaScript error, every figure present, a screenshot
# (OUT_DIR/report.png, next to the report). Skips (77) with the reason when no chromium is installed
# (scripts/bootstrap.sh --browser installs it).
# Usage: report_in_browser_test.sh DDP_LAUNCH AMP_DDP OUT_DIR
set -euo pipefail
launch=$1
amp_ddp=$2
out=$3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$out"
mkdir -p "$out"
"$launch" --nproc-per-node 2 --master-port 0 "$amp_ddp" --synthetic --epochs 2 --limit-train 1024 --batch-size 64 \
  --device cpu --opt-level O2 --quiet --report "$out/report.html" --metrics "$out/metrics.jsonl" \
  --timeline "$out/trace.json" >"$out/run.log" 2>&1 || { cat "$out/run.log"; exit 1; }
exec bash "$here/check_report_in_browser.sh" "$out/report.html" "$out" summary ranks fig-loss fig-accuracy \
  fig-throughput fig-scale fig-skipped fig-rank-step-time fig-timeline
