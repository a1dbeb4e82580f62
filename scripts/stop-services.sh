#!/usr/bin/env bash
# Stops the daemons that scripts/bootstrap.sh started, found by their pid files under
# RUN_DIR (/run/imagebuild). A daemon bootstrap did not start (no pid file) is left alone.
#
# Usage: scripts/stop-services.sh            registries first, then dockerd
#        scripts/stop-services.sh NAME...    only these: dockerd, registry-staging, ...
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$SCRIPT_DIR/versions.env"

log() { printf '[stop-services] %s\n' "$*"; }

# The binary a pid file must point at; a pid file whose process runs something else is
# stale (the number was reused after a reboot or a killed session) and is only removed.
daemon_exe() {
    case "$1" in
        dockerd)    echo /usr/sbin/dockerd ;;
        registry-*) echo /usr/bin/docker-registry ;;
        *)          echo "unknown service '$1'" >&2; return 1 ;;
    esac
}

# stop NAME GRACE_SECONDS: SIGTERM, wait, SIGKILL as a last resort.
stop() {
    local name="$1" grace="$2" pidfile="$RUN_DIR/$1.pid" pid exe
    exe="$(daemon_exe "$name")"
    if [ ! -s "$pidfile" ]; then
        log "$name: no pid file, not started by bootstrap; skipped"
        return
    fi
    pid="$(cat "$pidfile")"
    if [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" != "$exe" ]; then
        log "$name: not running (stale pid file removed)"
        rm -f "$pidfile"
        return
    fi
    kill -TERM "$pid"
    for _ in $(seq 1 $((grace * 10))); do
        [ -d "/proc/$pid" ] || break
        sleep 0.1
    done
    if [ -d "/proc/$pid" ]; then
        log "$name: still running after ${grace}s, sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    log "$name: stopped (pid $pid)"
}

main() {
    local names=("$@") entry name
    if [ "${#names[@]}" -eq 0 ]; then
        for entry in $REGISTRIES; do names+=("registry-${entry%%:*}"); done
        names+=(dockerd)
    fi
    for name in "${names[@]}"; do
        # dockerd stops its containers first (15 s each by default), so give it longer.
        if [ "$name" = dockerd ]; then stop "$name" 40; else stop "$name" 10; fi
    done
}

main "$@"
