"""What `imagebuild gc` keeps and in which order it deletes the rest (retention.live, retention.state): pure, no registry.

The registry side (real Distribution registries, real cosign signatures, a gc stopped at every deletion)
is tests/e2e/test_gc.py.
"""
from __future__ import annotations

import hashlib
import json
import re

import pytest

from imagebuild.retention.gc import parse_manifest, read_distribution_config
from imagebuild.retention.live import (
    Blob,
    ManifestView,
    RepositoryView,
    collect,
    cosign_tag_subject,
    order,
    reclaimable,
)
from imagebuild.retention.state import RecordFacts, RecordUnreadable, Retention, judge_state, record_facts


def d(name: str) -> str:
    return "sha256:" + hashlib.sha256(name.encode()).hexdigest()


def sig(digest: str, suffix: str = "sig") -> str:
    return digest.replace(":", "-") + f".{suffix}"


def image(name: str, *layers: tuple[str, int]) -> ManifestView:
    return ManifestView(d(name), 500, "application/vnd.oci.image.manifest.v1+json",
                        blobs=(Blob(d(name + "-config"), 100), *(Blob(d(layer), size) for layer, size in layers)))


def index(name: str, *children: str) -> ManifestView:
    return ManifestView(d(name), 300, "application/vnd.oci.image.index.v1+json", children=children)


def view(*manifests: ManifestView, tags: dict[str, str] | None = None) -> RepositoryView:
    return RepositoryView("127.0.0.1:5001", "team/paddle", dict(tags or {}), {m.digest: m for m in manifests})


# --- the live set ------------------------------------------------------------------------------------


def test_a_channel_tag_keeps_its_image_and_the_signature_and_attestations_hanging_off_it():
    repo = view(image("new", ("base", 1000), ("new-layer", 50)), image("new-sig"), image("new-att"),
                tags={"stable": d("new"), sig(d("new")): d("new-sig"), sig(d("new"), "att"): d("new-att")})
    judged = collect(repo, {})
    assert set(judged.live) == {d("new"), d("new-sig"), d("new-att")}
    assert judged.live[d("new")] == "tag stable"
    assert judged.dead == ()


def test_an_untagged_old_image_goes_signature_after_the_image_and_frees_only_its_own_layers():
    repo = view(image("new", ("base", 1000), ("new-layer", 50)), image("new-sig"),
                image("old", ("base", 1000), ("old-layer", 70)), image("old-sig"),
                tags={"stable": d("new"), sig(d("new")): d("new-sig"), sig(d("old")): d("old-sig")})
    judged = collect(repo, {})
    assert judged.dead == (d("old"), d("old-sig"))  # the image first: a stop in between leaves the signature findable
    assert judged.dead_tags == {sig(d("old")): d("old-sig")}
    freed = reclaimable([judged])
    # old's manifest and config, its own layer, and its signature's manifest and config; never the shared base
    assert (freed.manifests, freed.blobs, freed.bytes) == (2, 5, 500 + 100 + 70 + 500 + 100)


def test_rollout_roots_keep_an_untagged_rollback_target_and_a_quarantined_digest():
    repo = view(image("new"), image("previous"), image("quarantined"), image("older"), tags={"stable": d("new")})
    judged = collect(repo, {d("previous"): "rollback target", d("quarantined"): "quarantined: CVE"})
    assert set(judged.live) == {d("new"), d("previous"), d("quarantined")}
    assert judged.dead == (d("older"),)


def test_an_index_keeps_its_children_and_their_signatures_and_a_dead_index_goes_before_its_children():
    children = (image("amd64"), image("arm64"))
    live_index = index("multi", d("amd64"), d("arm64"))
    dead_children = (image("old-amd64"), image("old-arm64"), image("old-amd64-sig"))
    dead_index = index("old-multi", d("old-amd64"), d("old-arm64"))
    repo = view(*children, live_index, image("arm64-sig"), *dead_children, dead_index,
                tags={"multiarch": d("multi"), sig(d("arm64")): d("arm64-sig"), sig(d("old-amd64")): d("old-amd64-sig")})
    judged = collect(repo, {})
    assert {d("amd64"), d("arm64"), d("arm64-sig")} <= set(judged.live)
    dead = list(judged.dead)
    assert set(dead) == {d("old-multi"), d("old-amd64"), d("old-arm64"), d("old-amd64-sig")}
    assert dead.index(d("old-multi")) < dead.index(d("old-amd64")) < dead.index(d("old-amd64-sig"))
    assert dead.index(d("old-multi")) < dead.index(d("old-arm64"))


def test_a_child_shared_by_a_live_and_a_dead_index_stays():
    repo = view(image("shared"), image("gone"), index("live", d("shared")), index("dead", d("shared"), d("gone")),
                tags={"cpu": d("live")})
    judged = collect(repo, {})
    assert judged.dead == (d("dead"), d("gone"))


def test_a_referrer_by_subject_and_the_referrers_fallback_tag_hang_off_their_image():
    referrer = ManifestView(d("sbom"), 400, "application/vnd.oci.image.manifest.v1+json", subject=d("new"))
    fallback = index("fallback", d("other-referrer"))
    repo = view(image("new"), referrer, fallback, image("other-referrer"),
                tags={"stable": d("new"), d("new").replace(":", "-"): d("fallback")})
    assert set(collect(repo, {}).live) == {d("new"), d("sbom"), d("fallback"), d("other-referrer")}


def test_a_tag_a_person_made_is_kept_whatever_it_names():
    repo = view(image("debug"), tags={"debug-build": d("debug")})
    assert collect(repo, {}).live == {d("debug"): "tag debug-build"}


def test_a_forged_signature_tag_naming_its_own_subject_is_still_deleted_once():
    repo = view(image("loop"), tags={sig(d("loop")): d("loop")})
    assert order(repo, [d("loop")]) == [d("loop")]


@pytest.mark.parametrize("tag,subject", [
    (sig(d("x")), d("x")), (sig(d("x"), "att"), d("x")), (sig(d("x"), "sbom"), d("x")),
    (d("x").replace(":", "-"), d("x")), ("stable", None), ("sha256-abc.sig", None), (sig(d("x"), "exe"), None)])
def test_cosign_tag_subject(tag, subject):
    assert cosign_tag_subject(tag) == subject


def test_a_layer_shared_between_regions_of_one_registry_is_not_promised():
    a = view(image("old", ("shared", 900)), tags={})
    b = RepositoryView("127.0.0.1:5001", "other/paddle", {"stable": d("keep")}, {d("keep"): image("keep", ("shared", 900))})
    freed = reclaimable([collect(a, {}), collect(b, {})])
    assert freed.bytes == 500 + 100  # old's manifest and config; the shared layer stays for `keep`


# --- manifests as read -------------------------------------------------------------------------------


def test_a_manifest_is_read_field_by_field_and_junk_descriptors_are_not_counted():
    raw = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                      "config": {"digest": d("c"), "size": 10},
                      "layers": [{"digest": d("l"), "size": 20}, {"digest": "sha256:zz", "size": 1},
                                 {"digest": d("neg"), "size": -5}, {"digest": d("bool"), "size": True}, "junk"],
                      "subject": {"digest": d("s"), "size": 3}}).encode()
    parsed = parse_manifest(d("m"), raw, "application/vnd.oci.image.manifest.v1+json")
    assert parsed.blobs == (Blob(d("c"), 10), Blob(d("l"), 20))
    assert parsed.subject == d("s") and parsed.size == len(raw)
    assert parse_manifest(d("m"), b"not json", "x").blobs == ()
    listed = parse_manifest(d("i"), json.dumps({"manifests": [{"digest": d("a"), "size": 1}, {"digest": 3}]}).encode(),
                            "application/vnd.oci.image.index.v1+json")
    assert listed.children == (d("a"),)


# --- the rollout state ---------------------------------------------------------------------------------

DAY = 86400.0
NOW = 1_000 * DAY


def record(rollout_id: str, digest: str, status: str = "completed", age_days: float = 1, channels=("stable",),
           previous: tuple[str, ...] = ()) -> RecordFacts:
    return RecordFacts(rollout_id, tuple(channels), digest, status, NOW - age_days * DAY, previous)


def test_state_keeps_the_latest_rollout_with_its_rollback_targets_and_the_last_n_releases():
    records = [record("r1", d("v1"), age_days=300), record("r2", d("v2"), age_days=200, previous=(d("v1"),)),
               record("r3", d("v3"), age_days=100, previous=(d("v2"),)),
               record("r4", d("v4"), age_days=95, previous=(d("v3"),))]
    judged = judge_state(records, {"stable": "r4"}, {}, Retention(keep_releases=2, record_retention_s=90 * DAY), NOW)
    assert set(judged.roots) == {d("v4"), d("v3")}  # latest, its rollback target; v3 is also release 2 of 2
    assert judged.roots[d("v4")].startswith("latest rollout of stable")
    assert set(judged.kept_records) == {"r4", "r3"}
    assert judged.compacted_records == ("r2", "r1")
    assert judged.candidates == {d("v1"), d("v2"), d("v3"), d("v4")}  # looked for in the regions, to delete


def test_a_running_rollout_keeps_its_image_and_everything_it_would_restore_and_a_halted_one_is_not_a_release():
    records = [record("done", d("v1"), age_days=200),
               record("halted", d("bad"), status="halted", age_days=150, previous=(d("v1"),)),
               record("running", d("v2"), status="running", age_days=120, previous=(d("v1"),), channels=("beta",))]
    judged = judge_state(records, {"stable": "halted", "beta": "running"}, {d("q"): "CVE-1"},
                         Retention(keep_releases=1, record_retention_s=0), NOW)
    assert set(judged.roots) == {d("v1"), d("v2"), d("bad"), d("q")}
    assert judged.roots[d("q")] == "quarantined: CVE-1"
    assert judged.compacted_records == ()  # done is stable's last completed release


def test_young_records_stay_in_the_state_without_keeping_their_images():
    records = [record("new", d("v2"), age_days=1, previous=(d("v1"),)), record("old", d("v1"), age_days=2)]
    judged = judge_state(records, {"stable": "new"}, {}, Retention(keep_releases=1, record_retention_s=30 * DAY), NOW)
    assert judged.kept_records["old"] == "younger than the record retention"
    assert set(judged.roots) == {d("v2"), d("v1")}  # v1 only as new's rollback target


GOOD = {"id": "r1", "channels": ["stable"], "digest": d("a"), "status": "completed",
        "updated_at": "2026-11-01T00:00:00+00:00", "previous": {"eu-west/stable": d("b"), "us-east/stable": None}}


def test_record_facts_reads_what_gc_relies_on():
    facts = record_facts("r1", GOOD)
    assert facts.previous == (d("b"),) and facts.finished and facts.channels == ("stable",)


@pytest.mark.parametrize("change,message", [
    ({"id": "r2"}, "its id"), ({"channels": []}, "channels"), ({"channels": ["bad tag"]}, "channels"),
    ({"digest": "sha256:short"}, "digest"), ({"status": 3}, "status"), ({"previous": []}, "previous"),
    ({"previous": {"eu-west/stable": "latest"}}, "previous['eu-west/stable']"), ({"updated_at": "yesterday"}, "updated_at"),
    ({"updated_at": "2026-11-01T00:00:00"}, "time zone")])
def test_a_record_gc_cannot_read_is_refused_naming_the_field(change, message):
    with pytest.raises(RecordUnreadable, match=re.escape(message)):
        record_facts("r1", {**GOOD, **change})


def test_a_distribution_config_needs_an_absolute_filesystem_root_and_an_address(tmp_path):
    good = tmp_path / "config.yml"
    good.write_text("version: 0.1\nstorage:\n  filesystem: {rootdirectory: /var/lib/registry}\nhttp: {addr: ':5000'}\n")
    config = read_distribution_config(good)
    assert (str(config.root), config.addr) == ("/var/lib/registry", "127.0.0.1:5000")
    bad = tmp_path / "bad.yml"
    bad.write_text("version: 0.1\nstorage:\n  s3: {bucket: x}\nhttp: {addr: ':5000'}\n")
    from imagebuild.core.source import InputError

    with pytest.raises(InputError, match=r"bad\.yml:2: storage\.filesystem") as caught:
        read_distribution_config(bad)
    assert "mapping" in str(caught.value)
