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
# The binaries are built once, with the README's feature set (`--workspace`),
# and then run N times, one run after another, with one test thread (the
# load of the test itself, not of its neighbours). Each run starts the
# built test binary itself, from its crate's folder as `cargo test` does,
# so an edit to the sources meanwhile neither rebuilds nor changes what is
# checked. A failed run's output is kept and its path printed. The exit
# status is 0 only when all N runs passed, so the script can gate a
# change: "passes 20 of 20".
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
# The README's feature set (`--workspace`), so nothing is built again by a
# later `cargo test`. Each test executable, with its crate's folder.
echo "building: cargo test ${select[*]} --no-run" >&2
targets=$(cargo test "${select[@]}" --no-run --message-format=json | python3 -c '
import json, os, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(os.path.dirname(m["manifest_path"]) + "\t" + m["executable"])
')
[ -n "$targets" ] || { echo "'$spec' built no test binary" >&2; exit 2; }

# Run every selected binary once, from its crate's folder, with `args`.
run_all() {
  local dir exe
  while IFS=$'\t' read -r dir exe; do
    (cd "$dir" && CARGO_MANIFEST_DIR=$dir "$exe" ${filter:+"$filter"} "${ignored[@]}" "$@") || return 1
  done <<<"$targets"
}
count=$(run_all --list 2>/dev/null | grep -c ': test$' || true)
if [ "$count" = 0 ]; then
  echo "'$spec' selects no test${ignored:+ among the ignored ones}" >&2
  exit 2
fi
echo "$count test(s) selected, $runs run(s)" >&2

logs=$(mktemp -d)
passed=0
for i in $(seq 1 "$runs"); do
  start=$SECONDS
  if run_all --test-threads 1 >"$logs/run-$i.log" 2>&1; then
    passed=$((passed + 1))
    rm -f "$logs/run-$i.log"
    echo "run $i/$runs: passed ($((SECONDS - start)) s)"
  else
    echo "run $i/$runs: FAILED ($((SECONDS - start)) s), output in $logs/run-$i.log"
  fi
done
echo "$spec: $passed of $runs passed"
[ "$passed" = "$runs" ]
