#!/usr/bin/env bash
# One GPU session's runs, one after the other, outliving the device call that starts them.
#
# The device machine stays while calls keep coming within its idle window, and a process in its
# own session (setsid) runs on between calls. So the first call starts every run detached and
# waits; each later call waits again and brings back what is done:
#
#   bash tools/gpu_session.sh start 540 "python3 -m nox -s gpu-tests" "python3 -m nox -s bench"
#   bash tools/gpu_session.sh wait 560          # the next calls, at once
#
# Each run's output goes to /tmp/keep/run.log after a "=== N: COMMAND at +S s" line; a run may
# write results under $KEEP (/tmp/keep/out). `wait` copies the log, $KEEP and the engine tests'
# logs (/tmp/qsa-gpu-engine/*.log) to $OUT. nox comes from the carried .gpu-payload/nox wheels.
# The script runs from a copy in /tmp/keep: each call copies the working tree again, and bash
# reads a script while it runs.
set -uo pipefail
keep=/tmp/keep
mode=${1:?"usage: gpu_session.sh start SECONDS COMMAND... | wait SECONDS"}
seconds=${2:?"give the seconds this call may wait"}
shift 2

collect() {
    timeout "$seconds" tail --pid="$(cat "$keep/pid")" -n +1 -f "$keep/run.log" | tail -c 8000
    if [ -n "${OUT:-}" ]; then
        cp -r "$keep/run.log" "$keep/out" "$OUT/" 2>/dev/null
        mkdir -p "$OUT/engine-logs" && cp /tmp/qsa-gpu-engine/*.log "$OUT/engine-logs/" 2>/dev/null
    fi
    kill -0 "$(cat "$keep/pid")" 2>/dev/null && echo "=== still running" || echo "=== all done"
}

case "$mode" in
start)
    [ "$#" -gt 0 ] || { echo "gpu_session.sh start: no command given" >&2; exit 2; }
    mkdir -p "$keep/out"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/qsa-nox \
        .gpu-payload/nox/*.whl
    printf '%s\n' "$@" > "$keep/commands"
    cat > "$keep/session.sh" <<'RUNS'
export PYTHONPATH=/tmp/qsa-nox KEEP=/tmp/keep/out
t0=$(date +%s); n=0
while IFS= read -r command; do
    n=$((n + 1)); echo "=== $n: $command at +$(( $(date +%s) - t0 )) s"
    bash -c "$command"; echo "=== $n: exit $? at +$(( $(date +%s) - t0 )) s"
done < /tmp/keep/commands
RUNS
    setsid nohup bash "$keep/session.sh" > "$keep/run.log" 2>&1 < /dev/null &
    echo $! > "$keep/pid"
    collect
    ;;
wait) collect ;;
*) echo "gpu_session.sh: mode ${mode@Q} is not allowed; allowed: start, wait" >&2; exit 2 ;;
esac
