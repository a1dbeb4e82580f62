"""`--only` wired through the pipeline, on the real registry, Trivy and engine: build --dry-run, scan,
gate and test, one run each with the same two selectors, name the same variants, and only those get
results in the report.

Which variants a selector picks, in every command, is tests/test_selection.py's (in this process,
for many selectors). Here the example gets a third variant (its CPU one on Python 3.12 too), so
that the two selectors together pick two of the three: a command that ignored --only, or kept
only one of them, would name another set.

The report comes from `build --dry-run` (the registry is asked, nothing is built), so scan and
test have nothing to run: scan records each selected variant as skipped, test as not built.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.config.matrix import load_matrix
from imagebuild.config.selection import Selection

from .conftest import REPO, copy_matrix, imagebuild, trivy_cache_with_db

ONLY = ("python=3.12", "device=gpu")
OPTIONS = [arg for selector in ONLY for arg in ("--only", selector)]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Path:
    """The example with its CPU variant on Python 3.11 and 3.12, its Dockerfiles rendered beside it."""
    def add_python_312_to_the_cpu_variant(data):
        data["matrix"]["python"] = ["3.11", "3.12"]
        data["matrix"]["exclude"].append({"cuda": "11.8", "python": "3.12"})
        data["matrix"]["exclude"].append({"paddle": "3.2.2", "python": "3.12"})  # the two-platform one stays 3.11

    return copy_matrix(tmp_path_factory.mktemp("matrix"), add_python_312_to_the_cpu_variant)


@pytest.fixture(scope="module")
def whole_report(matrix, staging_registry, tmp_path_factory) -> Path:
    """`build --dry-run` of every variant: the report scan, gate and test select from."""
    workdir = tmp_path_factory.mktemp("dry-run")
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir), "--dry-run")
    assert run.returncode == 0, run.stderr
    return workdir / "build-report.json"


@pytest.fixture
def harness(tmp_path) -> Path:
    """What `test --harness` takes: nothing was built, so no container starts and pytest is never mounted."""
    (tmp_path / "harness" / "first" / "pytest").mkdir(parents=True)
    (tmp_path / "harness" / "last").mkdir()
    return tmp_path / "harness"


def ids(run, key: str, field: str = "id") -> list[str]:
    assert run.stdout, run.stderr
    return [row[field] for row in json.loads(run.stdout)[key]]


def test_build_scan_gate_and_test_select_the_same_variants(matrix, whole_report, engine, trivy, trivy_db, harness,
                                                          tmp_path):
    variants = build_plan(load_matrix(matrix)).variants
    expected = [v.id for v in Selection.parse(ONLY).apply(variants)]
    assert len(variants) == 4 and len(expected) == 2
    assert all(len(Selection.parse([selector]).apply(variants)) == 1 for selector in ONLY)

    dry = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "dry"), "--dry-run",
                     "--format", "json", *OPTIONS)
    assert dry.returncode == 0, dry.stderr
    assert ids(dry, "variants") == expected

    workdir = tmp_path / "w"  # scan, gate and test record into the report: a copy of its own
    workdir.mkdir()
    shutil.copy(whole_report, workdir / "build-report.json")
    scanned = imagebuild("scan", "--workdir", str(workdir), "--offline", "--format", "json",
                         "--cache-dir", str(trivy_cache_with_db(trivy_db, tmp_path / "cache")),
                         "--dockerfiles", str(matrix.parent / "dockerfiles"), *OPTIONS)
    assert ids(scanned, "variants") == expected, scanned.stderr
    assert {row["status"] for row in json.loads(scanned.stdout)["variants"]} == {"skipped"}  # none was built

    gated = imagebuild("gate", "--workdir", str(workdir), "--policy", str(REPO / "policies" / "vulnerabilities.yaml"),
                       "--format", "json", *OPTIONS)
    assert gated.returncode == 1, gated.stderr  # nothing was scanned: every selected image is blocked
    assert ids(gated, "images", "variant") == expected

    tested = imagebuild("test", "--workdir", str(workdir), "--harness", str(harness), "--format", "json", *OPTIONS)
    assert tested.returncode == 1, tested.stderr  # nothing was built
    assert ids(tested, "results", "variant") == expected
    report = json.loads((workdir / "build-report.json").read_text())
    recorded = [v["id"] for v in report["variants"] if {"scan", "gate", "smoke"} <= set(v["stages"])]
    assert recorded == expected  # and only those got results
