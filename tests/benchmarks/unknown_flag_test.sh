#!/usr/bin/env bash
# Every benchmark given a flag it does not know prints one line on stderr, "<program>: unknown flag --no-such-flag
# (see --help)", nothing on stdout, and exits non-zero (examples::parse_flags, python_free_examples/common/
# command_line.h), before it does any work.
# Usage: unknown_flag_test.sh BENCHMARK...
set -uo pipefail
failed=0
for program in "$@"; do
  name=$(basename "$program")
  out=$("$program" --no-such-flag 2>/tmp/unknown_flag_err.$$)
  status=$?
  err=$(cat /tmp/unknown_flag_err.$$)
  expected="$name: unknown flag --no-such-flag (see --help)"
  if [ "$status" -eq 0 ] || [ "$err" != "$expected" ] || [ -n "$out" ]; then
    echo "FAILED: $name: exit $status, stderr [$err], stdout [$out]; expected a non-zero exit and [$expected]"
    failed=1
  else
    echo "ok: $name: $err (exit $status)"
  fi
done
rm -f /tmp/unknown_flag_err.$$
exit $failed
