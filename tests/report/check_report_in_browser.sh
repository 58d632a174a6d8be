#!/usr/bin/env bash
# Opens an HTML report in a real headless browser (chromium, new headless mode) and checks what a reader would see:
#   - no JavaScript error: no console.error, no uncaught exception, no unhandled promise rejection, and no resource
#     (img, script, stylesheet, ...) that failed to load. The network is cut (every host name resolves to nothing),
#     so a report that is not self-contained fails here too;
#   - the report's inline script ran to its end: it sets data-report-ready="1" on <body> as its last statement;
#   - an element with each given id exists in the DOM after the scripts ran;
#   - a screenshot OUT_DIR/report.png (1280x2400) was written.
# Chromium logs every console message at INFO with no level ("CONSOLE:7] "x", source: ..."), console.error exactly as
# console.log, and a failed resource load not at all. So the check loads a copy of the report with a small hook
# script put first into <head> (plus a <base> to the report's folder, so relative paths resolve as before): the hook
# records each error as it happens in an attribute of <html>, which --dump-dom then carries out. "Uncaught" lines of
# chromium's own log are a fallback for errors the hook cannot see. The rest of chromium's stderr (D-Bus, GPU) is
# noise and ignored.
# Exits 0 when all holds, 1 with one line per problem, 77 (ctest: skipped) when no browser is installed, 2 on bad
# usage. OUT_DIR also keeps the page as loaded (report-checked.html), the DOM after scripts ran (report.dom.html)
# and chromium's log (chromium.log); the browser profile made there is removed on exit.
#
# Usage: check_report_in_browser.sh REPORT.html OUT_DIR ID [ID ...]
# Environment: CHROMIUM (the browser to run; default the first of chromium, chromium-browser, google-chrome on
# PATH), REPORT_CHECK_TIMEOUT_S (limit for the browser run; default 60).
set -euo pipefail

if [ $# -lt 3 ]; then
  echo "usage: $0 REPORT.html OUT_DIR ID [ID ...]" >&2
  exit 2
fi
REPORT=$1
OUT_DIR=$2
shift 2
IDS=("$@")
TIMEOUT_S=${REPORT_CHECK_TIMEOUT_S:-60}
VIRTUAL_TIME_BUDGET_MS=5000 # virtual time: timers up to 5 s fire at once, the run does not wait 5 s
WINDOW_SIZE=1280,2400

browser=${CHROMIUM:-}
if [ -z "$browser" ]; then
  for candidate in chromium chromium-browser google-chrome; do
    if command -v "$candidate" >/dev/null 2>&1; then
      browser=$candidate
      break
    fi
  done
fi
if [ -z "$browser" ]; then
  echo "SKIP: no headless browser (chromium): install it with 'sudo apt-get install -y chromium' or 'scripts/bootstrap.sh --browser'"
  exit 77
fi

problems=()
fail_now() {
  echo "FAILED: $REPORT: $*"
  exit 1
}

[ -f "$REPORT" ] || fail_now "no such file"
command -v "$browser" >/dev/null 2>&1 || fail_now "browser '$browser' (from CHROMIUM) not found"
mkdir -p "$OUT_DIR"
report_abs=$(realpath "$REPORT")
out_abs=$(realpath "$OUT_DIR")
hook="$out_abs/report-check-hook.js"
page="$out_abs/report-checked.html"
dom="$out_abs/report.dom.html"
log="$out_abs/chromium.log"
screenshot="$out_abs/report.png"
profile="$out_abs/chromium-profile"
rm -rf "$profile" "$dom" "$log" "$screenshot"
trap 'rm -rf "$profile"' EXIT

# A path as a file: URL, with the characters that would end or break it escaped.
file_url() {
  local p=$1
  p=${p//%/%25}
  p=${p// /%20}
  p=${p//#/%23}
  p=${p//\?/%3F}
  p=${p//\"/%22}
  printf 'file://%s' "$p"
}

cat >"$hook" <<'EOF'
(function () {
  var root = document.documentElement, errors = [];
  root.setAttribute("data-report-check-hook", "1");
  function note(kind, text) {
    errors.push(kind + ": " + String(text).replace(/\s+/g, " ").slice(0, 300));
    root.setAttribute("data-report-check-errors", errors.join("\n"));
  }
  var consoleError = console.error;
  console.error = function () {
    note("JavaScript console.error", Array.prototype.map.call(arguments, String).join(" "));
    return consoleError.apply(console, arguments);
  };
  // Capture phase: a resource's load error does not bubble, it only reaches window while capturing.
  window.addEventListener("error", function (e) {
    var t = e.target;
    if (t && t !== window && t.nodeType === 1) {
      var url = t.getAttribute("src") || t.getAttribute("href") || t.getAttribute("data") || "";
      note("failed to load", "<" + t.tagName.toLowerCase() + "> " + url);
    } else {
      note("JavaScript error", e.message + " (" + e.filename + ":" + e.lineno + ")");
    }
  }, true);
  window.addEventListener("unhandledrejection", function (e) {
    note("unhandled promise rejection", e.reason);
  });
})();
EOF
report_dir_url="$(file_url "$(dirname "$report_abs")")/"
INJECT="<base href=\"$report_dir_url\"><script src=\"$(file_url "$hook")\"></script>" \
  perl -0777 -pe 's/(<head\b[^>]*>)/$1$ENV{INJECT}/i or s/^(\s*<!doctype[^>]*>)/$1$ENV{INJECT}/i or s/^/$ENV{INJECT}/' \
  "$report_abs" >"$page"

# XDG_*: chromium writes nothing outside OUT_DIR. --host-resolver-rules: no host name resolves, no network.
rc=0
XDG_CONFIG_HOME="$profile/config" XDG_CACHE_HOME="$profile/cache" \
  timeout --kill-after=10 "$TIMEOUT_S" "$browser" --headless=new --no-sandbox --disable-gpu --user-data-dir="$profile/data" \
  --no-first-run --no-default-browser-check --disable-extensions --disable-sync --disable-background-networking \
  --disable-component-update --host-resolver-rules="MAP * ~NOTFOUND" --hide-scrollbars \
  --enable-logging=stderr --v=0 --virtual-time-budget="$VIRTUAL_TIME_BUDGET_MS" \
  --window-size="$WINDOW_SIZE" --screenshot="$screenshot" --dump-dom "$(file_url "$page")" \
  >"$dom" 2>"$log" || rc=$?
if [ "$rc" = 124 ]; then
  fail_now "$browser did not finish within ${TIMEOUT_S} s (log: $log)"
elif [ "$rc" != 0 ]; then
  fail_now "$browser exited with status $rc (log: $log)"
fi
[ -s "$dom" ] || fail_now "$browser dumped no DOM (log: $log)"

# The serialized DOM escapes & " < > in attribute values; undo that for the messages.
html_attr() {
  ATTR=$1 perl -0777 -ne 'if (/<html\b[^>]*?\s\Q$ENV{ATTR}\E="([^"]*)"/) {
    $_ = $1; s/&quot;/"/g; s/&lt;/</g; s/&gt;/>/g; s/&nbsp;/ /g; s/&amp;/&/g; print "$_\n" }' "$dom"
}
if [ "$(html_attr data-report-check-hook)" != 1 ]; then
  problems+=("the check's hook script did not run, so JavaScript errors are not known (page: $page)")
fi
hook_errors=$(html_attr data-report-check-errors)
if [ -n "$hook_errors" ]; then
  while IFS= read -r line; do
    problems+=("${line//"$(file_url "$page")"/$REPORT}")
  done <<<"$hook_errors"
else
  while IFS= read -r line; do
    line=${line#*\] }
    problems+=("JavaScript error (from chromium's log): ${line//"$(file_url "$page")"/$REPORT}")
  done < <(grep -E 'CONSOLE[(:][0-9]+\)?\] "Uncaught' "$log" || true)
fi

if ! perl -0777 -ne 'exit(/<body\b[^>]*\sdata-report-ready="1"/ ? 0 : 1)' "$dom"; then
  problems+=("<body> has no data-report-ready=\"1\": the report's script did not run to its end")
fi

# Ids: only in tags, not in the text of <script> or <style> (a script may hold markup as a string).
for id in "${IDS[@]}"; do
  if ! ID=$id perl -0777 -ne 's/<(script|style)\b.*?<\/\1>//gis;
                            exit(/<[A-Za-z][^<>]*\sid="\Q$ENV{ID}\E"[\s>\/]/ ? 0 : 1)' "$dom"; then
    problems+=("no element with id=\"$id\"")
  fi
done

if [ ! -s "$screenshot" ]; then
  problems+=("no screenshot written to $screenshot")
elif [ "$(head -c 4 "$screenshot" | tail -c 3)" != PNG ]; then
  problems+=("$screenshot is not a PNG")
fi

if [ ${#problems[@]} -gt 0 ]; then
  for p in "${problems[@]}"; do
    echo "FAILED: $REPORT: $p"
  done
  exit 1
fi
echo "report OK: $REPORT (${#IDS[@]} figures), screenshot $screenshot"
