#!/usr/bin/env bash
# Run one test N times in isolation and count how often it passes.
#
#   scripts/flake-check.sh BINARY[:FILTER] N [--ignored]
#
# BINARY is an integration test target (`overlap`, `cluster`, `cli`, ...) or
# `lib` for the crates' unit tests. FILTER picks the
# tests inside it, as `cargo test` does (a substring of the name); without
# it every test of the binary runs each time. --ignored runs an ignored
# (heavy) test.
#
# The binary is built once, with the README's feature set (`--workspace`),
# and then run N times, one run after another, with one test thread (the
# load of the test itself, not of its neighbours). A failed run's output is kept
# and its path printed. The exit status is 0 only when all N runs passed,
# so the script can gate a change: "passes 20 of 20".
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: scripts/flake-check.sh BINARY[:FILTER] N [--ignored]" >&2; exit 2; }
[ $# -ge 2 ] || usage
spec=$1 runs=$2 ignored=()
[ "${3:-}" = --ignored ] && ignored=(--ignored)
[ "${3:-}" = "" ] || [ "${3:-}" = --ignored ] || usage
case "$runs" in '' | *[!0-9]* | 0) echo "N must be a positive whole number, got '$runs'" >&2; exit 2 ;; esac

binary=${spec%%:*}
filter=""
[ "$binary" != "$spec" ] && filter=${spec#*:}
# `lib` names the crates' unit tests; anything else an integration test.
if [ "$binary" = lib ]; then
  select=(--workspace --lib)
else
  select=(--workspace --test "$binary")
fi
# The README's feature set (`--workspace`), so nothing is built again: a
# later run of `cargo test` finds the binary up to date and only runs it.
echo "building: cargo test ${select[*]} --no-run" >&2
cargo test "${select[@]}" --no-run
count=$(cargo test "${select[@]}" -q -- ${filter:+"$filter"} "${ignored[@]}" --list 2>/dev/null | grep -c ': test$' || true)
if [ "$count" = 0 ]; then
  echo "'$spec' selects no test${ignored:+ among the ignored ones}" >&2
  exit 2
fi
echo "$count test(s) selected, $runs run(s)" >&2

logs=$(mktemp -d)
passed=0
for i in $(seq 1 "$runs"); do
  start=$SECONDS
  if cargo test "${select[@]}" -- ${filter:+"$filter"} "${ignored[@]}" --test-threads 1 >"$logs/run-$i.log" 2>&1; then
    passed=$((passed + 1))
    rm -f "$logs/run-$i.log"
    echo "run $i/$runs: passed ($((SECONDS - start)) s)"
  else
    echo "run $i/$runs: FAILED ($((SECONDS - start)) s), output in $logs/run-$i.log"
  fi
done
echo "$spec: $passed of $runs passed"
[ "$passed" = "$runs" ]
