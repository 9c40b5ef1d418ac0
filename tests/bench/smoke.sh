#!/usr/bin/env bash
# Runs one benchmark in its quick mode and checks what it printed, never how fast it was:
#   smoke.sh PATTERN [PATTERN ...] -- COMMAND [ARG ...]
# Exit 77 (skipped) when COMMAND exits 77: it cannot run on this machine. Otherwise passes when
# COMMAND exits 0, every PATTERN (an extended regular expression) matches a line of
# its standard output, and no figure it printed is inf or nan.
set -uo pipefail
patterns=()
while [[ $# -gt 0 && $1 != -- ]]; do
  patterns+=("$1")
  shift
done
if [[ $# -lt 2 ]]; then
  echo "usage: $0 PATTERN [PATTERN ...] -- COMMAND [ARG ...]" >&2
  exit 2
fi
shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" >"$out"
rc=$?
cat "$out"
if [[ $rc -eq 77 ]]; then  # the benchmark cannot run here, and said why on its standard error
  echo "bench-smoke: $1 skipped (exit 77)" >&2
  exit 77
fi
failed=0
if [[ $rc -ne 0 ]]; then
  echo "bench-smoke: $1 exited $rc" >&2
  failed=1
fi
for pattern in "${patterns[@]}"; do
  if ! grep -Eq -- "$pattern" "$out"; then
    echo "bench-smoke: $1 printed no line matching: $pattern" >&2
    failed=1
  fi
done
if grep -Eiqw -- 'inf|nan|-nan' "$out"; then
  echo "bench-smoke: $1 printed a figure that is not a number:" >&2
  grep -Eiw -- 'inf|nan|-nan' "$out" >&2
  failed=1
fi
exit $failed
