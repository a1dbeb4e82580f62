"""The CI fan-out against the real staging registry: `build --layers` and `plan --registry --format github-fanout`.

Dry runs only: the registry is asked what it holds, nothing is built.
"""
from __future__ import annotations

import json

import pytest

from .conftest import EXAMPLE, copy_matrix, imagebuild, unique


def example_plan() -> dict:
    run = imagebuild("plan", "--matrix", str(EXAMPLE), "--format", "json")
    assert run.returncode == 0, run.stderr
    return run.json()


def test_build_layers_plans_that_layer_and_its_parents_and_no_variant(staging_registry, tmp_path):
    layers = {layer["key"]: layer for layer in example_plan()["layers"]}
    python = next(layer for layer in layers.values() if layer["kind"] == "python" and layer["parent"])
    ancestry = [python["key"]]
    while layers[ancestry[0]]["parent"]:
        ancestry.insert(0, layers[ancestry[0]]["parent"])
    run = imagebuild("build", "--matrix", str(EXAMPLE), "--layers", python["path"], "--dry-run",
                     "--workdir", str(tmp_path), "--format", "json")
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "build-report.json").read_text())
    assert report["variants"] == []
    # Paths, not keys: build resolves the unpinned base to its digest, which `plan` cannot.
    assert [rec["path"] for rec in report["layers"]] == [layers[k]["path"] for k in ancestry]


def test_build_layers_naming_no_layer_is_bad_input_and_writes_nothing(staging_registry, tmp_path):
    workdir = tmp_path / "work"
    run = imagebuild("build", "--matrix", str(EXAMPLE), "--layers", "base/debian13", "--dry-run",
                     "--workdir", str(workdir))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "error: --layers: base/debian13: names no layer of the plan (a content key, a prefix of 8+ of its "
        "digits, or a path) (did you mean 'base/debian12'?)"]
    assert not workdir.exists()


def new_repository(data: dict) -> None:
    data["repository"] = unique("fanout")  # no tags yet: every variant is new


def new_repository_and_base(data: dict) -> None:
    new_repository(data)
    data.setdefault("layers", {})["base"] = {"env": {"IMAGEBUILD_FANOUT_TEST": unique("base")}}


@pytest.mark.parametrize(("edit", "shared_jobs"), [(new_repository, 0), (new_repository_and_base, 2)])
def test_the_registry_fanout_builds_no_cached_layer_and_releases_the_changed_variants(
        staging_registry, tmp_path, edit, shared_jobs):
    matrix = copy_matrix(tmp_path, edit)
    run = imagebuild("plan", "--matrix", str(matrix), "--registry", "--format", "json")
    assert run.returncode == 0, run.stderr
    plan = run.json()
    status = {layer["key"]: layer["status"] for layer in plan["layers"]}
    run = imagebuild("plan", "--matrix", str(matrix), "--registry", "--format", "github-fanout")
    assert run.returncode == 0, run.stderr
    fanout = run.json()
    built = [k for level in fanout["levels"][:-1] for shard in level["shards"]
             for entry in shard["include"] for k in entry["layers"].split(",")]
    assert len(built) == shared_jobs, "the base layer (one per platform), when the cache lacks it; nothing else is shared"
    assert all(status[k] == "to-build" for k in built), "a layer job rebuilds a cached layer"
    released = [v for shard in fanout["levels"][-1]["shards"] for entry in shard["include"]
                for v in entry["variants"].split(",")]
    assert fanout["variants"] == [v["id"] for v in plan["variants"]], "no tag yet: every variant changed"
    assert sorted(released) == sorted(fanout["variants"])


def test_the_registry_fanout_leaves_out_variants_whose_tags_and_layers_are_there(built_example):
    """After the example's build only the release layers (their revision label) may differ: nothing to do."""
    run = imagebuild("plan", "--matrix", str(EXAMPLE), "--registry", "--format", "github-fanout")
    assert run.returncode == 0, run.stderr
    assert run.json()["variants"] == []
    assert [level["jobs"] for level in run.json()["levels"]] == [0, 0, 0, 0]


def test_a_layer_job_builds_its_layer_once_and_the_next_plan_finds_it(engine, staging_registry, tmp_path):
    """What a first-level CI job does: build one shared layer into the cache; then nobody builds it again."""
    def edit(data: dict) -> None:
        new_repository_and_base(data)
        data["cache_repository"] = unique("fanout-layers")  # a cache of its own: the base is new there

    matrix = copy_matrix(tmp_path, edit)
    fanout = imagebuild("plan", "--matrix", str(matrix), "--registry", "--format", "github-fanout").json()
    [[entry]] = [shard["include"] for shard in fanout["levels"][0]["shards"]]
    run = imagebuild("build", "--matrix", str(matrix), "--layers", entry["layers"], "--workdir",
                     str(tmp_path / "work"), timeout=1800)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    report = json.loads((tmp_path / "work" / "build-report.json").read_text())
    assert [(rec["key"], rec["status"]) for rec in report["layers"]] == [(entry["layers"], "built")]
    assert report["variants"] == []

    after = imagebuild("plan", "--matrix", str(matrix), "--registry", "--format", "github-fanout").json()
    # The base is in the cache now; the Python layer the two amd64 CPU variants share is not, and is
    # the first level's one job. The arm64 chain is one variant's only: built in that variant's job.
    assert [level["jobs"] for level in after["levels"]] == [1, 0, 0, 3], "the base is in the cache now"
    [[python]] = [shard["include"] for shard in after["levels"][0]["shards"] if shard["include"]]
    assert python["name"] == "python/debian12-py3.11"
    again = imagebuild("build", "--matrix", str(matrix), "--layers", entry["layers"], "--workdir",
                       str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    assert "nothing to build: all 1 layers reused" in again.stdout
