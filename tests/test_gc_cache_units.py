"""What `imagebuild gc cache` keeps in a matrix's layer cache and staging repository (retention.cache with
retention.live): pure, no registry. The registry side is tests/e2e/test_gc_cache.py."""
from __future__ import annotations

import hashlib

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.config.matrix import load_matrix
from imagebuild.core.report import BuildReport, ChildImage, LayerRecord, VariantRecord
from imagebuild.core.source import InputError
from imagebuild.oci import names
from imagebuild.retention.cache import cache_live
from imagebuild.retention.live import ManifestView, RepositoryView, collect, is_root_tag

from .test_content_keys import KEYS


def d(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def ctag(kind: str, name: str) -> str:
    return names.layer_cache_tag(kind, key(name))


def sig(digest: str, suffix: str = "sig") -> str:
    return digest.replace(":", "-") + f".{suffix}"


def view(*digests: str, tags: dict[str, str]) -> RepositoryView:
    manifests = {digest: ManifestView(digest, 400, "application/vnd.oci.image.manifest.v1+json") for digest in digests}
    return RepositoryView("127.0.0.1:5001", "team/layers", dict(tags), manifests)


def report(layers: list[LayerRecord], variants: list[VariantRecord]) -> BuildReport:
    return BuildReport("matrix.yaml", "abc", "127.0.0.1:5001", "127.0.0.1:5001/team/paddle",
                       "127.0.0.1:5001/team/layers", "2026-12-01T00:00:00Z", variants, layers)


def layer(kind: str, name: str, digest: str | None = None, base: str | None = None) -> LayerRecord:
    return LayerRecord(key(name), kind, f"{kind}/{name}", f"127.0.0.1:5001/team/layers:{ctag(kind, name)}",
                       digest=digest, base_digest=base)


def variant(chain: list[str], digest: str | None = None, children: tuple[str, ...] = ()) -> VariantRecord:
    return VariantRecord("v1", ["1.0"], [], [key(n) for n in chain], "cpu", "3.0", "3.11", None, None,
                         digest=digest, children=[ChildImage(f"linux/p{n}", c) for n, c in enumerate(children)])


def test_the_plans_tags_are_content_key_tags_and_gc_tells_them_from_a_persons(tmp_path):
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(KEYS)
    plan = build_plan(load_matrix(matrix))
    assert plan.layers and all(names.is_layer_cache_tag(layer.cache_tag) for layer in plan.layers.values())
    assert {layer.cache_tag.split("-")[0] for layer in plan.layers.values()} >= {"base", "python", "release"}
    for tag in ("latest", "base-debian12", "base-" + "a" * 31, "base-" + "A" * 32, "sha256-" + "a" * 64 + ".sig",
                "weird-" + "a" * 32):
        assert not names.is_layer_cache_tag(tag), tag


def test_the_cache_keeps_the_plans_layers_their_signatures_and_a_persons_tag_and_drops_old_keys_sig_last():
    plan_tags = {ctag("base", "now"): "plan", ctag("python", "now"): "plan"}
    repo = view(d("base-now"), d("py-now"), d("py-old"), d("py-old-sig"), d("base-now-sig"), d("pinned"),
                tags={ctag("base", "now"): d("base-now"), ctag("python", "now"): d("py-now"),
                      ctag("python", "old"): d("py-old"), sig(d("py-old")): d("py-old-sig"),
                      sig(d("base-now")): d("base-now-sig"), "keep-for-debugging": d("pinned")})
    live = cache_live(plan_tags, [])
    judged = collect(repo, live.digests, live.root_tag())
    assert set(judged.live) == {d("base-now"), d("py-now"), d("base-now-sig"), d("pinned")}
    assert judged.live[d("pinned")] == "tag keep-for-debugging"
    assert judged.dead == (d("py-old"), d("py-old-sig"))  # the image before its signature: no tag left dangling
    assert judged.dead_tags == {ctag("python", "old"): d("py-old"), sig(d("py-old")): d("py-old-sig")}


def test_a_report_keeps_its_layers_by_key_and_digest_and_its_variants_in_the_staging_repository():
    built = report([layer("base", "old", d("base-old")), layer("release", "rel", d("rel-old"), base=d("untagged"))],
                   [variant(["old", "rel"], d("index"), children=(d("amd64"), d("arm64")))])
    live = cache_live({}, [("work/build-report.json", built)])
    assert set(live.tags) == {ctag("base", "old"), ctag("release", "rel")}
    assert live.tags[ctag("base", "old")] == "layer 'base/old' in work/build-report.json"
    assert set(live.layers) == {d("base-old"), d("rel-old"), d("untagged")}
    assert set(live.releases) == {d("index"), d("amd64"), d("arm64")}
    cache = view(d("base-old"), d("rel-old"), d("untagged"), d("stale"),
                 tags={ctag("base", "old"): d("base-old"), ctag("release", "other"): d("rel-old"),
                       ctag("python", "gone"): d("stale"), sig(d("untagged")): d("stale")})
    judged = collect(cache, live.digests, live.root_tag())
    # rel-old stays by its report digest though its tag is not a live key, the untagged parent by the report
    # too, and stale as the signature of what stays (a digest goes with all its tags, or stays with them)
    assert set(judged.live) & set(cache.manifests) == set(cache.manifests) and judged.dead == ()
    staging = view(d("index"), d("orphan"), d("orphan-sig"), d("tagged"),
                   tags={"1.0": d("tagged"), sig(d("orphan")): d("orphan-sig"), sig(d("index")): d("orphan-sig")})
    judged = collect(staging, live.digests, is_root_tag)
    assert d("orphan") not in judged.live and d("index") in judged.live and d("orphan-sig") in judged.live
    assert judged.dead == (d("orphan"),)


def test_an_untagged_manifest_only_a_dead_signature_names_goes_before_the_signature():
    repo = view(d("old"), d("old-sig"), d("old-att"),
                tags={sig(d("old")): d("old-sig"), sig(d("old"), "att"): d("old-att")})
    live = cache_live({}, [])
    judged = collect(repo, live.digests, live.root_tag())
    assert judged.dead[0] == d("old") and set(judged.dead) == {d("old"), d("old-sig"), d("old-att")}


@pytest.mark.parametrize("change,field", [
    (lambda r: setattr(r.layers[0], "digest", "sha256:short"), "layers[0].digest"),
    (lambda r: setattr(r.layers[0], "base_digest", "../../x"), "layers[0].base_digest"),
    (lambda r: setattr(r.layers[0], "kind", "wheel"), "layers[0].kind"),
    (lambda r: setattr(r.layers[0], "key", "abc"), "layers[0].key"),
    (lambda r: setattr(r.variants[0], "chain", ["f" * 64]), "variants[0].chain[0]"),
    (lambda r: setattr(r.variants[0], "chain", None), "variants[0].chain"),
    (lambda r: setattr(r.variants[0], "chain", [["a"]]), "variants[0].chain[0]"),
    (lambda r: setattr(r.variants[0], "digest", "latest"), "variants[0].digest"),
    (lambda r: setattr(r.variants[0], "children", [ChildImage("linux/amd64", "x")]), "variants[0].children[0]"),
])
def test_a_report_field_of_the_wrong_shape_is_refused_naming_the_report_and_the_field(change, field):
    built = report([layer("base", "a", d("a"))], [variant(["a"], d("v"))])
    change(built)
    with pytest.raises(InputError, match=r"^work/r\.json: " + field.replace("[", r"\[").replace("]", r"\]")):
        cache_live({}, [("work/r.json", built)])
