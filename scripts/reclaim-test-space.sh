#!/usr/bin/env bash
# Frees what earlier test runs left on this machine, before the next run adds its own.
#
# Every e2e test pushes to repositories of its own (unique names) in the four local registries
# and leaves images in dockerd; no later run reads them, and a day of runs filled the disk (a
# run that cannot write its tmp dirs fails). Kept: the base image and the example's own
# repositories (what `scripts/example.sh` made and the tests read), which the example's
# release-aware `imagebuild gc` thins out instead. Then each registry is stopped for
# `imagebuild gc sweep` (Distribution's garbage-collect) and scripts/bootstrap.sh starts it again.
#
# It stops the registries for a minute: not while scripts/example.sh or a rollout runs.
#
# Usage: scripts/reclaim-test-space.sh      (scripts/test.sh runs it first; a fresh machine has
#                                            nothing to free and it returns at once)
#        IMAGEBUILD_RECLAIM=0 scripts/test.sh   keeps everything
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$SCRIPT_DIR")"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$SCRIPT_DIR/versions.env"

log() { printf '[reclaim] %s\n' "$*"; }

if [ "${IMAGEBUILD_RECLAIM:-1}" = 0 ]; then
    log "IMAGEBUILD_RECLAIM=0: skipped"
    exit 0
fi
python=$TOOLS_DIR/venv/bin/python
if [ ! -x "$python" ] || [ ! -d "$STATE_DIR/registries" ]; then
    log "nothing from an earlier run here"
    exit 0
fi
# This checkout's imagebuild, whichever checkout the venv was last installed from (bootstrap, which
# runs next, installs this one).
imagebuild() { PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$python" -m imagebuild "$@"; }
free_before=$(df --output=avail -B1 "$STATE_DIR" | tail -1)

# The repositories that outlive a test run: bootstrap's base image and the example's images,
# layer cache, rollout state and admission webhook image.
declare -A KEEP=()
for repository in "$BASE_REPO" imagebuild/admission imagebuild/admission-layers \
    imagebuild-example/paddle imagebuild-example/layers imagebuild-example/rollouts; do
    KEEP[$repository]=1
done

# The example's regions keep its last two releases per channel (each test run of the example
# adds one); a rollout that holds a channel makes gc refuse, and then nothing goes.
if curl -fsS -o /dev/null "http://127.0.0.1:5000/v2/" 2>/dev/null; then
    archive=$(mktemp -d)
    if imagebuild gc --release "$REPO_ROOT/examples/local/release.yaml" --keep-releases 2 \
        --state-dir "$archive" --apply --format json >/dev/null 2>&1; then
        log "example regions: releases beyond the last two deleted"
    else
        log "example regions: gc refused or failed (left as they are)"
    fi
    rm -rf "$archive"
fi

for config in "$STATE_DIR"/registries/*/config.yml; do
    dir=$(dirname "$config")
    name=$(basename "$dir")
    repositories=$dir/storage/docker/registry/v2/repositories
    [ -d "$repositories" ] || continue
    "$SCRIPT_DIR/stop-services.sh" "registry-$name" >/dev/null
    removed=0
    while IFS= read -r manifests; do
        repo_dir=$(dirname "$manifests")
        repository=${repo_dir#"$repositories"/}
        [ -n "${KEEP[$repository]:-}" ] && continue
        # The repository's own entries only: a kept repository may be nested below it.
        rm -rf "$repo_dir/_manifests" "$repo_dir/_layers" "$repo_dir/_uploads"
        removed=$((removed + 1))
    done < <(find "$repositories" -type d -name _manifests -prune)
    find "$repositories" -mindepth 1 -type d -empty -delete
    if ! imagebuild gc sweep --config "$config" | sed "s/^/[reclaim] $name: $removed test repositories removed; /"; then
        log "$name: the sweep failed; its storage keeps the removed repositories' blobs until the next run"
    fi
done

if docker info >/dev/null 2>&1; then
    # Images no container uses (the tests' builds and pulls); BuildKit's cache keeps the most
    # recently used layers, so the next build of the same Dockerfiles stays a cache hit.
    docker image prune --all --force >/dev/null
    docker builder prune --force --keep-storage "${IMAGEBUILD_KEEP_BUILD_CACHE:-10GB}" >/dev/null 2>&1
fi

free_after=$(df --output=avail -B1 "$STATE_DIR" | tail -1)
log "freed $(( (free_after - free_before) / 1000000 )) MB; $(( free_after / 1000000000 )) GB free"
