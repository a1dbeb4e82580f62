"""Platforms: the matrix names them, the support table bounds them, the plan keys a chain per platform,
`--only platform=` selects by them, and a multi-platform variant is tagged only as a whole index.

Pure: a real plan from a small matrix; the scheduler with the recording layer builder of
test_scheduler (no docker). The index's bytes are checked here; pushing it, in tests/e2e/test_platforms.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from imagebuild.build.plan import Plan, build_plan, github_matrix, plan_record
from imagebuild.build.render import write_tree
from imagebuild.build.scheduler import Builder, BuildOptions, LayerResult, TagVariant, planned_report, root_platforms
from imagebuild.config.matrix import load_matrix
from imagebuild.config.selection import Selection
from imagebuild.core.report import BuildReport, ChildImage, VariantStatus
from imagebuild.core.source import InputError
from imagebuild.oci.client import OCI_INDEX
from imagebuild.oci.platforms import Child, Platform, index_document

from .test_scheduler import RecordingLayers, digest_of

DEBIAN = "sha256:" + "12" * 32
MATRIX = """\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle
os:
  debian12: {image: registry.example.com/base/debian:12, family: debian}
platforms:
  cpu: [linux/amd64, linux/arm64]
matrix:
  os: [debian12]
  cuda: [cpu]
  python: ["3.11"]
  paddle: ["3.2.2", "3.3.1"]
  include:
    - {paddle: "3.3.1", platforms: [linux/amd64]}   # no aarch64 wheels of 3.3.x on PyPI
tags:
  gpu: ["{paddle}-gpu"]
  cpu: ["{paddle}"]
"""
RESOLVED = {("registry.example.com/base/debian:12", "linux/amd64"): "sha256:" + "a" * 64,
            ("registry.example.com/base/debian:12", "linux/arm64"): "sha256:" + "b" * 64}


def write(tmp_path: Path, text: str = MATRIX) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def plan(tmp_path) -> Plan:
    the_plan = build_plan(load_matrix(write(tmp_path)), resolved=RESOLVED)
    write_tree(tmp_path / "dockerfiles", the_plan.rendered_files())
    return the_plan


def variant(plan: Plan, paddle: str):
    return next(v for v in plan.variants if v.paddle == paddle)


# --- the matrix ---------------------------------------------------------------------------------------


def test_platforms_come_from_the_device_and_an_include_entry_overrides_them(tmp_path):
    combos = {c.paddle: c.platforms for c in load_matrix(write(tmp_path)).combinations}
    assert combos == {"3.2.2": ("linux/amd64", "linux/arm64"), "3.3.1": ("linux/amd64",)}


def test_without_platforms_every_variant_is_linux_amd64(tmp_path):
    text = MATRIX.replace("platforms:\n  cpu: [linux/amd64, linux/arm64]\n", "").replace(
        '    - {paddle: "3.3.1", platforms: [linux/amd64]}   # no aarch64 wheels of 3.3.x on PyPI\n', "")
    text = text.replace("  include:\n", "")
    assert {c.platforms for c in load_matrix(write(tmp_path, text)).combinations} == {("linux/amd64",)}


@pytest.mark.parametrize(("old", "new", "line", "key", "message"), [
    ("cpu: [linux/amd64, linux/arm64]", "cpu: [linux/amd64, linux/arm/v7]", 8, "platforms.cpu[1]",
     "'linux/arm/v7' is not a platform imagebuild builds"),
    ("cpu: [linux/amd64, linux/arm64]", "cpu: [linux/arm64, linux/arm64]", 8, "platforms.cpu[1]", "listed twice"),
    ("cpu: [linux/amd64, linux/arm64]", "cpu: []", 8, "platforms.cpu", "empty"),
    ("cpu: [linux/amd64, linux/arm64]", "tpu: [linux/amd64]", 8, "platforms.tpu", "tpu"),
    # 3.3.1 has no Arm64 wheel: the platform entry that asks for it is blamed.
    ("platforms: [linux/amd64]}", "platforms: [linux/amd64, linux/arm64]}", 15, "matrix.include[0].platforms[1]",
     "paddle 3.3.1 has no CPU build for linux/arm64"),
])
def test_a_bad_platform_names_the_file_the_line_and_the_key(tmp_path, old, new, line, key, message):
    path = write(tmp_path, MATRIX.replace(old, new))
    with pytest.raises(InputError, match=message) as caught:
        load_matrix(path)
    assert (caught.value.line, caught.value.key) == (line, key)


def test_an_unsupported_platform_can_be_allowed_with_a_reason(tmp_path):
    text = MATRIX.replace("platforms: [linux/amd64]}", "platforms: [linux/amd64, linux/arm64]}") + (
        "allow_unsupported:\n  - {paddle: \"3.3.1\", platform: linux/arm64, reason: \"built from our own wheel\"}\n")
    combos = {c.paddle: c.platforms for c in load_matrix(write(tmp_path, text)).combinations}
    assert combos["3.3.1"] == ("linux/amd64", "linux/arm64")


# --- the plan -----------------------------------------------------------------------------------------


def test_each_platform_has_its_own_chain_of_keys_from_the_same_dockerfiles(plan):
    multi = variant(plan, "3.2.2")
    assert multi.platforms == ("linux/amd64", "linux/arm64") and multi.multi_platform
    amd64, arm64 = multi.platform_chains
    assert not set(amd64.chain) & set(arm64.chain)
    assert [plan.layers[k].path for k in amd64.chain] == [plan.layers[k].path for k in arm64.chain]
    assert {plan.layers[k].platform for k in arm64.chain} == {"linux/arm64"}
    assert multi.chain == amd64.chain + arm64.chain
    # The shared base and python layers are the same key for both variants on amd64.
    single = variant(plan, "3.3.1")
    assert single.platforms == ("linux/amd64",) and not single.multi_platform
    assert single.chain[:2] == amd64.chain[:2]


def test_each_platform_starts_from_its_own_image_of_the_base(plan):
    amd64, arm64 = variant(plan, "3.2.2").platform_chains
    assert plan.layers[amd64.chain[0]].root.digest == "sha256:" + "a" * 64
    assert plan.layers[arm64.chain[0]].root.digest == "sha256:" + "b" * 64


def test_the_platform_is_part_of_the_key_even_for_identical_files(tmp_path):
    one = build_plan(load_matrix(write(tmp_path)), resolved={k: "sha256:" + "c" * 64 for k in RESOLVED})
    amd64, arm64 = variant(one, "3.2.2").platform_chains
    assert amd64.chain[0] != arm64.chain[0]


def test_the_plan_record_lists_platforms_and_each_layers_platform(plan):
    record = plan_record(plan)
    by_paddle = {v["paddle"]: v for v in record["variants"]}
    assert by_paddle["3.2.2"]["platforms"] == ["linux/amd64", "linux/arm64"] and by_paddle["3.2.2"]["index"]
    assert by_paddle["3.3.1"]["platforms"] == ["linux/amd64"] and not by_paddle["3.3.1"]["index"]
    assert {layer["platform"] for layer in record["layers"]} == {"linux/amd64", "linux/arm64"}
    assert {j["platforms"] for j in github_matrix(plan)["include"]} == {"linux/amd64,linux/arm64", "linux/amd64"}


def test_the_unpinned_bases_are_resolved_for_the_platforms_built_from_them(tmp_path):
    assert root_platforms(load_matrix(write(tmp_path))) == {
        "registry.example.com/base/debian:12": {"linux/amd64", "linux/arm64"}}


def test_only_platform_selects_the_variants_built_for_it(plan):
    chosen = Selection.parse(["platform=linux/arm64"]).choose(plan.variants, "m.yaml")
    assert [v.paddle for v in chosen] == ["3.2.2"]
    records = planned_report(plan, plan.variants, {}).variants
    assert [r.paddle for r in Selection.parse(["platform=linux/arm64"]).apply(records)] == ["3.2.2"]
    assert len(Selection.parse(["platform=linux/amd64"]).apply(records)) == 2


# --- the index ----------------------------------------------------------------------------------------


def test_the_index_lists_each_child_with_its_platform_in_order():
    children = [Child("linux/amd64", "sha256:" + "1" * 64, "application/vnd.oci.image.manifest.v1+json", 500),
                Child("linux/arm64", "sha256:" + "2" * 64, "application/vnd.docker.distribution.manifest.v2+json", 600)]
    raw = index_document(children)
    assert raw == index_document(children)  # the same children, the same bytes (and digest)
    document = json.loads(raw)
    assert document["mediaType"] == OCI_INDEX and document["schemaVersion"] == 2
    assert [(m["digest"], m["size"], m["platform"]) for m in document["manifests"]] == [
        ("sha256:" + "1" * 64, 500, {"architecture": "amd64", "os": "linux"}),
        ("sha256:" + "2" * 64, 600, {"architecture": "arm64", "os": "linux"})]
    assert index_document(children[::-1]) != raw


@pytest.mark.parametrize(("described", "matches"), [
    ({"os": "linux", "architecture": "arm64"}, True),
    ({"os": "linux", "architecture": "arm64", "variant": "v8"}, True),
    ({"os": "linux", "architecture": "arm64", "variant": "v9"}, False),
    ({"os": "linux", "architecture": "amd64"}, False),
    ({"os": "windows", "architecture": "arm64"}, False),
    ({}, False),
])
def test_a_platform_matches_what_an_index_entry_or_config_says(described, matches):
    assert Platform.parse("linux/arm64").matches(described) is matches


def test_a_platform_that_is_not_os_slash_architecture_is_refused():
    with pytest.raises(ValueError, match="not a platform"):
        Platform.parse("arm64")


# --- tagging a multi-platform variant ------------------------------------------------------------------


class IndexingTags:
    """The injected tagger: the digest each variant got and the children of each index it was asked for."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}
        self.indexes: list[dict[str, str]] = []

    @contextlib.contextmanager
    def session(self) -> Iterator[TagVariant]:
        yield lambda v, digest: self.given.__setitem__(v.id, digest)

    def index(self, children: Mapping[str, str]) -> str:
        self.indexes.append(dict(children))
        return "sha256:" + hashlib.sha256(json.dumps(dict(children)).encode()).hexdigest()


def build(plan: Plan, tmp_path: Path, layers: RecordingLayers, tags: IndexingTags) -> BuildReport:
    options = BuildOptions(jobs=2, dockerfiles=tmp_path / "dockerfiles", workdir=tmp_path / "work")
    return Builder(plan, planned_report(plan, plan.variants, {}), options, lambda event, rec: None,
                   layer_builder=layers, tagger=tags).run()


def test_a_multi_platform_variant_is_tagged_with_the_index_of_its_release_layers(plan, tmp_path):
    tags = IndexingTags()
    report = build(plan, tmp_path, RecordingLayers(), tags)
    multi = variant(plan, "3.2.2")
    children = {c.platform: digest_of(c.release) for c in multi.platform_chains}
    assert tags.indexes == [children]
    record = next(r for r in report.variants if r.id == multi.id)
    assert record.status == VariantStatus.BUILT and record.digest == tags.given[multi.id]
    assert record.digest not in children.values()
    assert record.children == [ChildImage(p, d) for p, d in children.items()]
    single = next(r for r in report.variants if r.id == variant(plan, "3.3.1").id)
    assert single.digest == digest_of(variant(plan, "3.3.1").chain[-1]) and single.children == []


def test_a_failed_platform_fails_the_whole_variant_and_nothing_of_it_is_tagged(plan, tmp_path):
    arm64_paddle = next(plan.layers[k] for k in variant(plan, "3.2.2").platform_chains[1].chain
                        if plan.layers[k].kind == "paddle")
    layers = RecordingLayers()
    original = layers.build

    def fail_arm64_paddle(layer, rec, log):
        if layer.key == arm64_paddle.key:
            return LayerResult.failed("pip: no matching distribution")
        return original(layer, rec, log)

    layers.build = fail_arm64_paddle
    tags = IndexingTags()
    report = build(plan, tmp_path, layers, tags)
    multi = next(r for r in report.variants if r.paddle == "3.2.2")
    assert multi.status == VariantStatus.FAILED and multi.digest is None and multi.id not in tags.given
    assert multi.error is not None and multi.error.startswith("linux/arm64:")
    assert tags.indexes == []  # no index of a partial set of children
    # The amd64 chain of the same variant was built, and the other variant is tagged.
    assert variant(plan, "3.3.1").id in tags.given


def test_the_report_keeps_platforms_and_children_through_a_write(plan, tmp_path):
    build(plan, tmp_path, RecordingLayers(), IndexingTags())
    again = BuildReport.read(tmp_path / "work" / "build-report.json")
    multi = next(r for r in again.variants if r.paddle == "3.2.2")
    assert multi.platforms == ["linux/amd64", "linux/arm64"] and multi.multi_platform
    assert [c.platform for c in multi.children] == ["linux/amd64", "linux/arm64"]
    assert {rec.platform for rec in again.layers} == {"linux/amd64", "linux/arm64"}
