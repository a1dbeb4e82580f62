#!/usr/bin/env bash
# CI (.github/workflows/rollout.yml): approve wave $WAVE of the rollout of $IMAGE, then resume it.
# Env: IMAGE (REPOSITORY@sha256:...), WAVE, IMAGEBUILD_RELEASE (default release.yaml).
# The rollout's ID is read from `imagebuild rollout status` (the latest rollout of the release's
# channels, which must be this image's): the start job that made it is still running, so its
# outputs are not available yet. Waits up to 10 minutes for the start job to record it.
set -euo pipefail
release="${IMAGEBUILD_RELEASE:-release.yaml}"
: "${IMAGE:?IMAGE is not set}" "${WAVE:?WAVE is not set}"

id=""
for _ in $(seq 60); do
  id="$(imagebuild rollout status --release "$release" --format json 2>/dev/null | python3 -c '
import json, os, sys
record = json.load(sys.stdin)
print(record["id"] if record.get("source") == os.environ["IMAGE"] else "")' || true)"
  [ -n "$id" ] && break
  sleep 10
done
if [ -z "$id" ]; then
  echo "no rollout of this image is the latest of the release's channels: did the start job begin?" >&2
  exit 1
fi

imagebuild rollout approve "$id" --wave "$WAVE" --release "$release"
set +e
imagebuild rollout resume "$id" --release "$release"
status=$?
set -e
if [ "$status" -eq 4 ]; then
  echo "rollout $id: the start job holds its lease and goes on with the approval; nothing to resume"
  exit 0
fi
exit "$status"
