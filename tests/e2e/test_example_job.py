"""The README's first command, scripts/example.sh, run twice on this machine: the second run finds
everything done (no build, scan or signing work, no tag moved) and says so.

bootstrap.sh itself is left out (IMAGEBUILD_EXAMPLE_SKIP_BOOTSTRAP=1): the tests run after it,
and bench/bench_bootstrap.py measures it from nothing. The example's layers are in the registry
(the session's `built_example`), so a run costs at most this revision's release layers, their
smoke tests, scans, signatures and rollouts.
"""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from ..conftest import REPO_ROOT
from .conftest import REGIONS, require_registry, unique


def run_example(revision: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "example.sh")], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=3600, env={**os.environ, "IMAGEBUILD_EXAMPLE_SKIP_BOOTSTRAP": "1",
                                                        "IMAGEBUILD_EXAMPLE_REVISION": revision})
    return proc, time.monotonic() - started


@pytest.fixture(scope="module")
def two_runs(built_example):
    for host in REGIONS.values():
        require_registry(host, "region registry")
    # A revision of its own: the README's first command may already have released this commit on this
    # machine, and the first run here must find new release layers to build, test, sign and roll out.
    revision = unique("e2e-example")
    first, first_s = run_example(revision)
    assert first.returncode == 0, f"example.sh failed:\n{first.stdout[-4000:]}\n{first.stderr[-4000:]}"
    second, second_s = run_example(revision)
    assert second.returncode == 0, f"example.sh (again) failed:\n{second.stdout[-4000:]}\n{second.stderr[-4000:]}"
    return first, second, first_s, second_s


def test_the_example_releases_every_variant_rolls_it_out_and_says_where_to_look(two_runs):
    first = two_runs[0]
    out = first.stdout + first.stderr
    assert "3 of 3 variant(s) released" in out
    assert "-> multiarch" in out, "the two-platform index has a channel of its own"
    assert "Where to look" in first.stdout and "audit trail" in first.stdout
    assert "rollout status" in first.stdout
    # The webhook's own image: built, checked and signed, then verified by cosign and by its own policy.
    webhook = re.search(r"^webhook image: (127\.0\.0\.1:5000/imagebuild/admission@sha256:[0-9a-f]{64})$", first.stdout,
                        re.MULTILINE)
    assert webhook, first.stdout[-3000:]
    assert f"cosign verify: {webhook[1]} is signed by" in first.stdout
    assert f"{webhook[1]}: verified:" in out


def test_the_second_run_does_no_work_moves_no_tag_and_says_so(two_runs):
    _, second, first_s, second_s = two_runs
    out = second.stdout + second.stderr
    assert "nothing new: every variant was already built, tested, scanned, gated and signed" in out
    assert "nothing to build" in out
    assert out.count("nothing to move") == 3, "each variant is already behind its channel in every region"
    assert not re.search(r"-> (cpu|gpu|multiarch)\b", out), "no rollout started"
    rows = second.stderr.splitlines()
    assert not [row for row in rows if re.match(r"\d\d:\d\d:\d\d (building|built) ", row)], "no layer built"
    assert not [row for row in rows if row.startswith(("scan: ", "gate: "))], "no scan, no gate verdict"
    assert len(re.findall(r"already signed", second.stdout)) == 4, "every variant's and the webhook image's reused"
    assert second_s < max(first_s, 60)
