#!/usr/bin/env bash
# The main job on the built-in example, end to end on this machine:
#   1. set everything up (scripts/bootstrap.sh: Docker, the staging registry 127.0.0.1:5000 and
#      the three "regions" 127.0.0.1:5001-5003, trivy, cosign, the signing key);
#   2. check the example matrix (validate, render --check, plan against the registry);
#   3. `imagebuild release`: build, smoke tests, scan, gate, sign and attest each variant;
#   4. build the admission webhook's own image the same way (`imagebuild admission image`: its
#      build, smoke tests, scan, gate and signature), verify it and the release's images as
#      admission would, and write the admission policies;
#   5. roll each variant out to its channel across the regions, canary (eu-west) first
#      (examples/local/release.yaml);
#   6. say where to look.
# Idempotent: a second run finds every step done, does no build, scan or signing work, moves
# no tag, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
# The e2e test of this script runs it on a machine bootstrap already set up (scripts/test.sh
# comes after bootstrap), and skips it with IMAGEBUILD_EXAMPLE_SKIP_BOOTSTRAP=1.
if [ "${IMAGEBUILD_EXAMPLE_SKIP_BOOTSTRAP:-0}" != 1 ]; then
  scripts/bootstrap.sh
fi
# bootstrap installed the package into this venv; its python and imagebuild come first.
export PATH="/opt/imagebuild-tools/venv/bin:/opt/imagebuild-tools/bin:$PATH"
matrix=examples/local/matrix.yaml
release=examples/local/release.yaml
workdir=.imagebuild/example
trivy_cache=.imagebuild/trivy-example
state_dir=$workdir/rollouts
keys=/var/lib/imagebuild/keys
# The example's signing key: made by bootstrap outside the repository; cosign reads the
# password from the environment only.
COSIGN_PASSWORD="$(cat "$keys/cosign.password")"
export COSIGN_PASSWORD

imagebuild validate --matrix "$matrix"
imagebuild render --matrix "$matrix" --check
imagebuild plan --matrix "$matrix" --registry

# Trivy's public DB cannot be downloaded here: the example scans with a small DB written by
# Trivy's own trivy-db package (tests/fixtures/trivydb) holding real advisories. Made once: its
# date is the DB's version, and a new DB means a new scan. In production, point
# `imagebuild release --db-repository` at your DB mirror instead.
if [ ! -f "$trivy_cache/db/metadata.json" ]; then
  python -c 'import sys; from pathlib import Path; from tests.e2e.trivydb import build_fixture_db; build_fixture_db(Path(sys.argv[1]))' "$trivy_cache"
fi

# The whole chain per variant; a rerun reuses every result for an unchanged digest. The release
# layers are labelled with this checkout's commit, or with IMAGEBUILD_EXAMPLE_REVISION when set (the
# e2e test of this script gives a revision of its own, so its first run releases and rolls out new
# digests even where the main job already ran at this commit).
revision_args=()
if [ -n "${IMAGEBUILD_EXAMPLE_REVISION:-}" ]; then
  revision_args=(--revision "$IMAGEBUILD_EXAMPLE_REVISION")
fi
imagebuild release --matrix "$matrix" --workdir "$workdir" --policy examples/local/policy.yaml \
  --offline --cache-dir "$trivy_cache" --key "$keys/cosign.key" "${revision_args[@]}"

# variant id, channel and image (repository@sha256:...) of every released variant.
mapfile -t released < <(python - "$workdir/build-report.json" <<'PY'
import json, sys
for variant in json.load(open(sys.argv[1]))["variants"]:
    if variant.get("image"):
        # A variant for several platforms (one index) has a channel of its own beside its device's.
        channel = "multiarch" if len(variant.get("platforms") or []) > 1 else variant["device"]
        print(variant["id"], channel, variant["image"])
PY
)
images=()
for line in "${released[@]}"; do images+=("${line##* }"); done

# The webhook's own image (the trust file's webhook.image), built from this checkout through the
# same stages; its own workdir and report. A rerun with the same source does nothing.
imagebuild admission image --trust examples/local/trust.yaml --workdir "$workdir/admission-image" \
  --policy examples/local/policy.yaml --offline --cache-dir "$trivy_cache" --key "$keys/cosign.key"
webhook_image="$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["variants"][0]["image"])' \
  "$workdir/admission-image/build-report.json")"
echo "webhook image: $webhook_image"
# cosign itself agrees (offline: no transparency log here; the local registry is plain http).
if ! cosign_out="$(cosign verify --key "$keys/cosign.pub" --insecure-ignore-tlog --allow-http-registry "$webhook_image" 2>&1)"; then
  echo "$cosign_out" >&2
  exit 1
fi
echo "cosign verify: $webhook_image is signed by $keys/cosign.pub"

# Every image, by digest, as an admission controller would check it: the webhook's own image is
# admitted by its own policy.
imagebuild verify --trust examples/local/trust.yaml --require-provenance "${images[@]}" "$webhook_image"
# The release record of the first image, verified: what went into it and what happened to it.
imagebuild inspect --trust examples/local/trust.yaml "${images[0]}"
# The policies embed this machine's public key, so they go to the workdir, not the repository. The
# webhook's Deployment names the image built above by its digest (the tag resolved now).
imagebuild policies generate --trust examples/local/trust.yaml --out "$workdir/admission"

# The canary rollout: each variant to its channel (cpu, gpu; multiarch for the two-platform index),
# eu-west first, then us-east and ap-south, each wave after its gates (a short soak, the signature
# verified in the region).
for line in "${released[@]}"; do
  read -r variant channel image <<<"$line"
  if python - "$release" "$image" "$channel" <<'PY'
import sys
from pathlib import Path
from imagebuild.oci.client import ImageRef
from imagebuild.config.release_file import load_release
from imagebuild.rollout.state import region_registry
config, digest, channel = load_release(Path(sys.argv[1])), ImageRef.parse(sys.argv[2]).digest, sys.argv[3]
for region in config.regions:
    with region_registry(region) as registry:
        if registry.head_manifest(region.repository, channel) != digest:
            sys.exit(1)
PY
  then
    echo "rollout: $variant is already behind channel '$channel' in every region; nothing to move"
  else
    imagebuild rollout start --release "$release" --image "$image" --channel "$channel" --state-dir "$state_dir"
  fi
done
imagebuild rollout status --release "$release"

cat <<EOF2

done. Where to look:
  release report (every stage per variant): $workdir/build-report.json
    the webhook's image: $webhook_image   its report: $workdir/admission-image/build-report.json
    smoke tests: $workdir/smoke/   scans and SBOMs: $workdir/scan/   gate: $workdir/gate/result.json
    signed predicates: $workdir/sign/   admission policies for this key: $workdir/admission/
  rollouts: imagebuild rollout status --release $release   (records in the state registry)
    audit trail: $state_dir/audit.jsonl
  the release record of an image: imagebuild inspect --trust examples/local/trust.yaml ${images[0]}
  tonight's rescan: imagebuild rescan --release $release --policy examples/local/policy.yaml --offline --cache-dir $trivy_cache
EOF2
