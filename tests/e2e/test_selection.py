"""`--only` across the pipeline, on the real registry, Trivy and engine: for each selector, plan,
build --dry-run, scan, gate and test name the same variants.

The report comes from `build --dry-run` (the registry is asked, nothing is built), so scan and
test have nothing to run: scan records each selected variant as skipped, test as not built. That
is enough to see which variants each command selected, in seconds.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import EXAMPLE, REPO, imagebuild, trivy_cache_with_db

SELECTORS = [("cudnn=8.6",), ("cuda=cpu",), ("os=debian12",), ("python=3.11,3.12", "device=gpu")]


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    """pytest for the containers, installed once (test never starts a container here)."""
    from imagebuild.checks.smoke_run import ensure_harness
    from imagebuild.core.runner import ToolMissing

    try:
        return ensure_harness(tmp_path_factory.mktemp("harness"))
    except ToolMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def whole_report(staging_registry, tmp_path_factory) -> Path:
    """`build --dry-run` of every variant: the report scan, gate and test select from."""
    workdir = tmp_path_factory.mktemp("dry-run")
    run = imagebuild("build", "--matrix", str(EXAMPLE), "--workdir", str(workdir), "--dry-run")
    assert run.returncode == 0, run.stderr
    return workdir / "build-report.json"


def ids(run, key: str, field: str = "id") -> list[str]:
    assert run.stdout, run.stderr
    return [row[field] for row in json.loads(run.stdout)[key]]


@pytest.mark.parametrize("only", SELECTORS)
def test_every_command_selects_the_same_variants(only, whole_report, engine, trivy, trivy_db, harness, tmp_path):
    options = [arg for selector in only for arg in ("--only", selector)]
    planned = imagebuild("plan", "--matrix", str(EXAMPLE), "--format", "json", *options)
    assert planned.returncode == 0, planned.stderr
    expected = ids(planned, "variants")
    assert expected

    dry = imagebuild("build", "--matrix", str(EXAMPLE), "--workdir", str(tmp_path / "dry"), "--dry-run",
                     "--format", "json", *options)
    assert dry.returncode == 0, dry.stderr
    assert ids(dry, "variants") == expected

    workdir = tmp_path / "w"  # scan, gate and test record into the report: a copy of its own
    workdir.mkdir()
    shutil.copy(whole_report, workdir / "build-report.json")
    scanned = imagebuild("scan", "--workdir", str(workdir), "--offline", "--format", "json",
                         "--cache-dir", str(trivy_cache_with_db(trivy_db, tmp_path / "cache")),
                         "--dockerfiles", str(EXAMPLE.parent / "dockerfiles"), *options)
    assert ids(scanned, "variants") == expected, scanned.stderr
    assert {row["status"] for row in json.loads(scanned.stdout)["variants"]} == {"skipped"}  # none was built

    gated = imagebuild("gate", "--workdir", str(workdir), "--policy", str(REPO / "policies" / "vulnerabilities.yaml"),
                       "--format", "json", *options)
    assert gated.returncode == 1, gated.stderr  # nothing was scanned: every selected image is blocked
    assert ids(gated, "images", "variant") == expected

    tested = imagebuild("test", "--workdir", str(workdir), "--harness", str(harness), "--format", "json", *options)
    assert tested.returncode == 1, tested.stderr  # nothing was built
    assert ids(tested, "results", "variant") == expected
    report = json.loads((workdir / "build-report.json").read_text())
    recorded = [v["id"] for v in report["variants"] if {"scan", "gate", "smoke"} <= set(v["stages"])]
    assert recorded == expected  # and only those got results
