#!/usr/bin/env bash
# The test command: set everything up (idempotent), then run the whole suite.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
# What earlier runs left (their registry repositories and images) goes first: the suite writes
# some 20 GB, and a full disk fails it. bootstrap then starts the registries it stopped.
scripts/reclaim-test-space.sh
scripts/bootstrap.sh
# The tools only the tests need (buildkitd, buildctl, kube-apiserver, etcd, kubectl, policy-controller's tester): bootstrap
# started their build in the background; this waits for it, or builds what is missing.
scripts/build-test-tools.sh
# bootstrap installed the package into this venv; its python and imagebuild come first.
export PATH="/opt/imagebuild-tools/venv/bin:/opt/imagebuild-tools/bin:$PATH"
# Lint and types first: cheap, and a failure there fails the run (set -e).
python -m ruff check imagebuild tests bench monitoring
python -m mypy  # files and strictness: [tool.mypy] in pyproject.toml
set +e
# Four workers: the two e2e groups (tests/e2e/conftest.py) each on one, in order; the unit tests
# spread over all of them. IMAGEBUILD_TEST_WORKERS=0 runs everything in this one process.
python -m pytest -n "${IMAGEBUILD_TEST_WORKERS:-4}" --dist loadgroup "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$status"
