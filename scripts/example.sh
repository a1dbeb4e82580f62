#!/usr/bin/env bash
# The main job on the built-in example: set everything up (idempotent), then run the
# pipeline on examples/local/matrix.yaml against the local staging registry.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# bootstrap installed the package into this venv; its python and imagebuild come first.
export PATH="/opt/imagebuild-tools/venv/bin:/opt/imagebuild-tools/bin:$PATH"
matrix=examples/local/matrix.yaml
workdir=.imagebuild/example
imagebuild validate --matrix "$matrix"
imagebuild render --matrix "$matrix" --check
imagebuild plan --matrix "$matrix" --registry
imagebuild build --matrix "$matrix" --workdir "$workdir"
echo "build report: $workdir/build-report.json"
