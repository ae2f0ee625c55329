#!/usr/bin/env bash
# Fault run of the docker-compose testnet (testnet/docker-compose.yml):
# start four nodes, wait until they agree on the roster and train, SIGKILL
# node3 (a shard owner) mid-run, and require node0..node2 to finish every step
# on their own, exit 0 and reach SHOAL_MIN_ACCURACY (93.0) test accuracy.
#
#   testnet/docker/smoke.sh
#
# Environment (all optional):
#   SHOAL_REPORT_DIR       copy each node's log and a summary there
#   SHOAL_BIN              use this binary for the image instead of building
#   SHOAL_STEPS            steps per node (1500: a release build trains 300 in about 2 s,
#                          which let node3 finish before the kill landed)
#   SHOAL_KILL_AFTER       seconds of training before node3 is killed (2)
#   SHOAL_START_TIMEOUT    seconds to wait for the roster (120)
#   SHOAL_FINISH_TIMEOUT   seconds to wait for the survivors to exit (600)
#   SHOAL_MIN_ACCURACY     percent (93.0)
#   SHOAL_SKIP_BUILD=1     use the existing shoal:testnet image as is
# Without a reachable Docker engine it prints `skipped: no docker engine` and
# exits 0. The compose project is always torn down (`down -v`) on exit.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"

say() { printf '[smoke] %s\n' "$*"; }
fail() { printf '[smoke] FAILED: %s\n' "$*" >&2; exit 1; }

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
    echo "skipped: no docker engine"
    exit 0
fi

if docker compose version >/dev/null 2>&1; then
    compose_bin=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose_bin=(docker-compose)
else
    fail "neither 'docker compose' nor 'docker-compose' is installed"
fi

export SHOAL_STEPS="${SHOAL_STEPS:-1500}"
export SHOAL_IMAGE="${SHOAL_IMAGE:-shoal:testnet}"
kill_after="${SHOAL_KILL_AFTER:-2}"
start_timeout="${SHOAL_START_TIMEOUT:-120}"
finish_timeout="${SHOAL_FINISH_TIMEOUT:-600}"
min_acc="${SHOAL_MIN_ACCURACY:-93.0}"
project="shoal-smoke-$$-$(date +%s)"
compose_file="$root/testnet/docker-compose.yml"
compose() { "${compose_bin[@]}" -f "$compose_file" -p "$project" "$@"; }
nocolor() { sed 's/\x1b\[[0-9;]*m//g'; }
now() { date +%s; }
logs_of() { docker logs "$1" 2>&1 | nocolor; }
# grep -q in a pipeline would SIGPIPE `docker logs` and, with pipefail, turn a
# match into a failure: read the whole log first.
log_has() { local out; out="$(logs_of "$1")"; grep -Eq -- "$2" <<<"$out"; }

declare -A cid=()
summary=""
teardown() {
    local rc=$?
    set +e
    if [[ -n "${SHOAL_REPORT_DIR:-}" && ${#cid[@]} -gt 0 ]]; then
        local dir="$SHOAL_REPORT_DIR/docker-testnet"
        mkdir -p "$dir"
        for n in "${!cid[@]}"; do logs_of "${cid[$n]}" > "$dir/$n.log"; done
        { printf '%s' "$summary"; echo "exit status $rc"; } > "$dir/summary.txt"
        say "logs saved in $dir"
    fi
    say "tearing down: ${compose_bin[*]} -p $project down -v"
    compose down -v --remove-orphans -t 5 >/dev/null 2>&1 || say "warning: compose down failed"
    exit "$rc"
}
trap teardown EXIT

if [[ "${SHOAL_SKIP_BUILD:-0}" == 1 ]]; then
    docker image inspect "$SHOAL_IMAGE" >/dev/null 2>&1 || fail "SHOAL_SKIP_BUILD=1 but there is no image $SHOAL_IMAGE"
    say "using the existing image $SHOAL_IMAGE"
else
    say "building the image: testnet/docker/build-image.sh"
    SHOAL_IMAGE="$SHOAL_IMAGE" "$here/build-image.sh"
fi

t0=$(now)
say "starting the testnet: ${compose_bin[*]} -f testnet/docker-compose.yml -p $project up -d (steps $SHOAL_STEPS)"
compose up -d
for n in node0 node1 node2 node3; do
    id="$(compose ps -q "$n")"
    [[ -n "$id" ]] || fail "no container for $n"
    cid[$n]="$id"
done

running() { [[ "$(docker inspect -f '{{.State.Running}}' "$1" 2>/dev/null)" == true ]]; }

# 1. The roster: node3's log says training starts.
say "waiting up to ${start_timeout}s for node3 to log 'roster agreed'"
deadline=$(( $(now) + start_timeout ))
until log_has "${cid[node3]}" 'roster agreed'; do
    running "${cid[node3]}" || { logs_of "${cid[node3]}" | tail -20 >&2; fail "node3 exited before the roster formed"; }
    (( $(now) < deadline )) || { logs_of "${cid[node3]}" | tail -20 >&2; fail "no roster on node3 within ${start_timeout}s"; }
    sleep 0.5
done
t_roster=$(now)
say "roster agreed after $(( t_roster - t0 ))s"

# 2. Let node3 train for a while, then kill it while it still owns shards.
say "letting node3 train for ${kill_after}s"
sleep "$kill_after"
running "${cid[node3]}" || fail "node3 is no longer running before the kill (exit code $(docker inspect -f '{{.State.ExitCode}}' "${cid[node3]}"))"
if log_has "${cid[node3]}" 'training finished'; then
    fail "node3 finished its steps before it was killed; raise SHOAL_STEPS or lower SHOAL_KILL_AFTER"
fi
say "docker kill node3 (SIGKILL)"
docker kill "${cid[node3]}" >/dev/null
t_kill=$(now)
if log_has "${cid[node3]}" 'training finished'; then
    fail "node3 finished its steps before the kill landed; raise SHOAL_STEPS or lower SHOAL_KILL_AFTER"
fi

# 3. The survivors must finish on their own.
say "waiting up to ${finish_timeout}s for node0..node2 to exit"
deadline=$(( $(now) + finish_timeout ))
for n in node0 node1 node2; do
    while running "${cid[$n]}"; do
        (( $(now) < deadline )) || { logs_of "${cid[$n]}" | tail -30 >&2; fail "$n still running ${finish_timeout}s after the kill"; }
        sleep 1
    done
done
t_done=$(now)

# 4. Exit codes, the final line and the accuracy of each survivor.
failures=()
summary="docker testnet: 4 nodes, ${SHOAL_STEPS} steps, node3 killed $(( t_kill - t_roster ))s after the roster formed
"
for n in node0 node1 node2; do
    code="$(docker inspect -f '{{.State.ExitCode}}' "${cid[$n]}")"
    log="$(logs_of "${cid[$n]}")"
    line="$(grep -E "$n: finished [0-9]+ steps, test accuracy [0-9.]+%" <<<"$log" | tail -1 || true)"
    acc="$(sed -n 's/.*test accuracy \([0-9.]*\)%.*/\1/p' <<<"$line")"
    steps="$(sed -n 's/.*: finished \([0-9]*\) steps.*/\1/p' <<<"$line")"
    shards="$(sed -n 's/.*owned shards \(.*\)$/\1/p' <<<"$line")"
    detected=no
    log_has "${cid[$n]}" 'peers failed' && detected=yes
    summary+="  $n: exit $code, steps ${steps:-?}, accuracy ${acc:-?}%, owned shards ${shards:-?}, saw node3 fail: $detected
"
    [[ "$code" == 0 ]] || { failures+=("$n exited with $code"); logs_of "${cid[$n]}" | grep -E '^error|ERROR|WARN' | tail -5 >&2 || true; }
    if [[ -z "$line" ]]; then
        failures+=("$n printed no '$n: finished N steps, test accuracy X%' line")
        continue
    fi
    [[ "$steps" == "$SHOAL_STEPS" ]] || failures+=("$n finished $steps steps, expected $SHOAL_STEPS")
    awk -v a="$acc" -v m="$min_acc" 'BEGIN { exit !(a + 0 >= m + 0) }' || failures+=("$n accuracy $acc% is below $min_acc%")
done
summary+="  node3: killed (exit $(docker inspect -f '{{.State.ExitCode}}' "${cid[node3]}"))
  times: roster $(( t_roster - t0 ))s after up, survivors done $(( t_done - t_kill ))s after the kill, $(( t_done - t0 ))s in all
"
printf '%s' "$summary"
if (( ${#failures[@]} > 0 )); then
    for f in "${failures[@]}"; do printf '[smoke] FAILED: %s\n' "$f" >&2; done
    exit 1
fi
say "PASSED: node0..node2 finished after node3 was killed, accuracy >= $min_acc%"
