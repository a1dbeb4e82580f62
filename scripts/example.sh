#!/usr/bin/env bash
# The main job on the built-in example: set everything up (idempotent), then run the
# pipeline on examples/local/matrix.yaml against the local staging registry:
# validate, render check, plan, build, smoke tests, scan (+ SBOMs), vulnerability gate, then sign
# and attest with the key bootstrap made, verify, and write the admission policies.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# bootstrap installed the package into this venv; its python and imagebuild come first.
export PATH="/opt/imagebuild-tools/venv/bin:/opt/imagebuild-tools/bin:$PATH"
matrix=examples/local/matrix.yaml
workdir=.imagebuild/example
trivy_cache=.imagebuild/trivy-example

imagebuild validate --matrix "$matrix"
imagebuild render --matrix "$matrix" --check
imagebuild plan --matrix "$matrix" --registry
imagebuild build --matrix "$matrix" --workdir "$workdir"
imagebuild test --workdir "$workdir"

# Trivy's public DB cannot be downloaded here: the example scans with a small DB written by
# Trivy's own trivy-db package (tests/fixtures/trivydb) holding real advisories. In
# production, point `imagebuild scan --db-repository` at your DB mirror instead.
python -c 'import sys; from pathlib import Path; from tests.e2e.trivydb import build_fixture_db; build_fixture_db(Path(sys.argv[1]))' "$trivy_cache"
imagebuild scan --workdir "$workdir" --offline --cache-dir "$trivy_cache"
imagebuild gate --workdir "$workdir" --policy examples/local/policy.yaml

# The example's signing key: made by bootstrap outside the repository; cosign reads the
# password from the environment only.
keys=/var/lib/imagebuild/keys
COSIGN_PASSWORD="$(cat "$keys/cosign.password")" imagebuild sign --workdir "$workdir" --key "$keys/cosign.key"
# Every image of the report, by digest, as an admission controller would check it.
mapfile -t images < <(python - "$workdir/build-report.json" <<'PY'
import json, sys
for variant in json.load(open(sys.argv[1]))["variants"]:
    if variant.get("image"):
        print(variant["image"])  # repository@sha256:...
PY
)
imagebuild verify --config examples/local/trust.yaml --require-provenance "${images[@]}"
# The release record of the first image, verified: what went into it and what happened to it.
imagebuild inspect --config examples/local/trust.yaml "${images[0]}"
# The policies embed this machine's public key, so they go to the workdir, not the repository.
imagebuild policies generate --config examples/local/trust.yaml --out "$workdir/admission"
echo "done: build report with smoke, scan, gate and sign results in $workdir/build-report.json;"
echo "      admission policies for this machine's key in $workdir/admission/"
