"""Trust for multi-platform images: an OCI index is verified whole, each child as itself.

A node runs one child of an index, whichever its platform picks, so the index is admitted only when
every child is an image of the platform its entry names, signed, with the required attestations
about its own digest; the index itself carries its signature and its release record. Everything a
registry serves is untrusted: the index is bounded (children, nesting) before anything it names is
read. An in-memory registry here, real signatures made with `cryptography` (tests/e2e/
test_platform_trust.py does the same with cosign and the local registries).
"""
from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.admission.quarantine import with_quarantine
from imagebuild.config.trust import Mode, PublicKey, Requirements, TrustConfig
from imagebuild.oci.client import DOCKER_MANIFEST_LIST, OCI_INDEX, OCI_MANIFEST, RegistryError
from imagebuild.oci.platforms import MAX_CHILDREN, BadIndex, Child, index_children, index_document
from imagebuild.trust.verify import (
    ATTESTATION_TYPES,
    DSSE_MEDIA_TYPE,
    SIGNATURE_ANNOTATION,
    ImageVerdict,
    Verifier,
    pae,
    signature_tag,
    split_requirements,
)

HOST, REPO = "registry.test", "imagebuild/paddle"
STRICT = Requirements(attestations=("sbom", "vuln", "smoke", "gate"), smoke_passed=True, gate_passed=True,
                      block_severity="CRITICAL")


def sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


@dataclass
class MemoryRegistry:
    """Manifests by digest and tag, blobs by digest; counts what is read."""

    registry: str = HOST
    manifests: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)

    def put(self, raw: bytes, media_type: str, tag: str | None = None) -> str:
        digest = sha(raw)
        self.manifests[digest] = (raw, media_type)
        if tag:
            self.manifests[tag] = (raw, media_type)
        return digest

    def blob(self, raw: bytes) -> dict:
        self.blobs[sha(raw)] = raw
        return {"digest": sha(raw), "size": len(raw)}

    def find_manifest(self, repository: str, reference: str, max_bytes: int = 4 << 20):
        self.reads.append(reference)
        found = self.manifests.get(reference)
        return None if found is None else (found[0], found[1], sha(found[0]))

    def get_manifest(self, repository: str, reference: str, max_bytes: int = 4 << 20):
        found = self.find_manifest(repository, reference, max_bytes)
        if found is None:
            raise RegistryError(f"{reference}: no such manifest", registry=HOST, repository=repository,
                                operation="GET manifest", status=404)
        return found

    def head_manifest(self, repository: str, reference: str) -> str | None:
        found = self.manifests.get(reference)
        return None if found is None else sha(found[0])

    def get_blob_limited(self, repository: str, digest: str, max_bytes: int) -> bytes:
        self.reads.append(digest)
        if digest not in self.blobs:
            raise RegistryError(f"{digest}: no such blob", registry=HOST, repository=repository,
                                operation="GET blob", status=404)
        return self.blobs[digest]

    def blob_size(self, repository: str, digest: str) -> int | None:
        return len(self.blobs[digest]) if digest in self.blobs else None


@pytest.fixture(scope="module")
def private_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def trust(private_key: ec.EllipticCurvePrivateKey, require: Requirements = STRICT) -> TrustConfig:
    pem = private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return TrustConfig(path=Path("trust.yaml"), mode=Mode.ENFORCE, keys=(PublicKey("release", pem, "test"),),
                       images=(f"{HOST}/**",), require=require, cache_ttl_seconds=60)


@dataclass
class Publisher:
    """What `imagebuild sign` leaves in a repository, made by hand: images, indexes, .sig and .att tags."""

    registry: MemoryRegistry
    key: ec.EllipticCurvePrivateKey

    def image(self, platform: str, config_platform: str | None = None) -> str:
        os_name, architecture = (config_platform or platform).split("/")[:2]
        config = self.registry.blob(json.dumps({"os": os_name, "architecture": architecture,
                                                "rootfs": {"type": "layers", "diff_ids": []}}).encode())
        layer = self.registry.blob(f"layer of {platform} {len(self.registry.blobs)}".encode())
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"mediaType": "x", **config},
                    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", **layer}]}
        return self.registry.put(json.dumps(manifest).encode(), OCI_MANIFEST)

    def index(self, children: dict[str, str], tag: str | None = "3.2.2") -> str:
        listed = [Child(platform, digest, OCI_MANIFEST, len(self.registry.manifests[digest][0]))
                  for platform, digest in children.items()]
        return self.registry.put(index_document(listed), OCI_INDEX, tag)

    def sign(self, digest: str) -> None:
        payload = json.dumps({"critical": {"identity": {"docker-reference": f"{HOST}/{REPO}"},
                                           "image": {"docker-manifest-digest": digest},
                                           "type": "cosign container image signature"}}).encode()
        signature = base64.b64encode(self.key.sign(payload, ec.ECDSA(hashes.SHA256()))).decode()
        layer = {"mediaType": "application/vnd.dev.cosign.simplesigning.v1+json", **self.registry.blob(payload),
                 "annotations": {SIGNATURE_ANNOTATION: signature}}
        self._tag(signature_tag(digest, ".sig"), [layer])

    def attest(self, digest: str, *kinds: str, about: str | None = None, **predicates: dict) -> None:
        """Attestations of `kinds` about `about` (this digest), passing unless `predicates` says otherwise."""
        layers = []
        for kind in kinds:
            subject = about or digest
            predicate = predicates.get(kind) or {
                "smoke": {"digest": subject, "status": "passed"},
                "gate": {"digest": subject, "decision": "passed", "exceptions_applied": []},
                "vuln": {"scanner": {"result": {"Results": []}}},
                "sbom": {"bomFormat": "CycloneDX"},
                "release": {"digest": subject, "variant": "cpu", "issued_at": "2026-12-01T00:00:00Z"},
            }[kind]
            statement = json.dumps({"_type": "https://in-toto.io/Statement/v1", "predicateType": ATTESTATION_TYPES[kind],
                                    "subject": [{"name": REPO, "digest": {"sha256": subject.split(":")[1]}}],
                                    "predicate": predicate}).encode()
            signature = self.key.sign(pae("application/vnd.in-toto+json", statement), ec.ECDSA(hashes.SHA256()))
            envelope = json.dumps({"payloadType": "application/vnd.in-toto+json",
                                   "payload": base64.b64encode(statement).decode(),
                                   "signatures": [{"sig": base64.b64encode(signature).decode()}]}).encode()
            layers.append({"mediaType": DSSE_MEDIA_TYPE, **self.registry.blob(envelope)})
        self._tag(signature_tag(digest, ".att"), layers)

    def release(self, digest: str, *kinds: str) -> None:
        """Signed, with every kind attested about this digest (all four by default)."""
        self.sign(digest)
        self.attest(digest, *(kinds or ("sbom", "vuln", "smoke", "gate")))

    def _tag(self, tag: str, layers: list[dict]) -> None:
        config = self.registry.blob(b"{}")
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"mediaType": "x", **config},
                    "layers": layers}
        self.registry.put(json.dumps(manifest).encode(), OCI_MANIFEST, tag)


@dataclass
class Release:
    index: str
    amd64: str
    arm64: str


@pytest.fixture
def registry() -> MemoryRegistry:
    return MemoryRegistry()


@pytest.fixture
def publisher(registry: MemoryRegistry, private_key: ec.EllipticCurvePrivateKey) -> Publisher:
    return Publisher(registry, private_key)


def two_platforms(publisher: Publisher, *, sign_arm64: bool = True, arm64_config: str | None = None) -> Release:
    """A two-platform release: each child signed with its attestations, the index signed with its record."""
    amd64, arm64 = publisher.image("linux/amd64"), publisher.image("linux/arm64", arm64_config)
    publisher.release(amd64)
    if sign_arm64:
        publisher.release(arm64)
    index = publisher.index({"linux/amd64": amd64, "linux/arm64": arm64})
    publisher.sign(index)
    publisher.attest(index, "release")
    return Release(index, amd64, arm64)


def verifier(config: TrustConfig, registry: MemoryRegistry) -> Verifier:
    made = Verifier(config)
    made._registry = lambda host: registry
    return made


def verify(config: TrustConfig, registry: MemoryRegistry, digest: str) -> ImageVerdict:
    with verifier(config, registry) as v:
        return v.verify(f"{HOST}/{REPO}@{digest}")


# --- what an index must be ---------------------------------------------------------------------


def entry(digest: str = "sha256:" + "a" * 64, media_type: str = OCI_MANIFEST, **platform: str) -> dict:
    return {"mediaType": media_type, "digest": digest, "size": 10,
            "platform": platform or {"os": "linux", "architecture": "amd64"}}


def index_of(*entries: dict) -> bytes:
    return json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list(entries)}).encode()


def test_an_index_lists_its_children_with_the_platforms_its_entries_name():
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    children = index_children(index_of(entry(a), entry(b, os="linux", architecture="arm64", variant="v8")))
    assert [(c.platform, c.digest) for c in children] == [("linux/amd64", a), ("linux/arm64/v8", b)]


def test_one_digest_listed_twice_is_one_child():
    assert len(index_children(index_of(entry(), entry()))) == 1


@pytest.mark.parametrize("raw, reason", [
    (index_of(*(entry("sha256:" + f"{n:064x}") for n in range(MAX_CHILDREN + 1))), f"over {MAX_CHILDREN}"),
    (index_of(entry(media_type=OCI_INDEX)), "an index in an index"),
    (index_of(entry(media_type=DOCKER_MANIFEST_LIST)), "an index in an index"),
    (index_of(entry(media_type="application/vnd.in-toto+json")), "not an image manifest"),
    (index_of(entry(digest="sha256:../../x")), "not a sha256 digest"),
    (index_of(entry(os="linux")), "names no platform"),
    (index_of(entry(os="linux/amd64", architecture="")), "names no platform"),
    (index_of({**entry(), "size": "10"}), "has no size"),
    (index_of(), "lists no manifests"),
    (b"[]", "lists no manifests"),
    (b"{", "not JSON"),
], ids=["too-many", "nested-oci", "nested-docker", "artifact", "bad-digest", "no-arch", "slash-in-os", "no-size",
        "empty", "not-an-object", "not-json"])
def test_an_index_that_cannot_be_a_release_is_refused_from_its_bytes_alone(raw, reason):
    with pytest.raises(BadIndex, match=reason):
        index_children(raw)


def test_the_index_carries_the_release_record_and_each_child_everything_about_what_runs():
    require = replace(STRICT, attestations=("sbom", "vuln", "smoke", "gate", "provenance", "release"))
    own, each_child = split_requirements(require)
    assert own == Requirements(attestations=("release",))
    assert each_child == replace(require, attestations=("sbom", "vuln", "smoke", "gate", "provenance"))


# --- verifying an index whole ------------------------------------------------------------------


def test_a_fully_signed_index_verifies_with_every_platform_named(private_key, registry, publisher):
    release = two_platforms(publisher)
    verdict = verify(trust(private_key), registry, release.index)
    assert verdict.allowed, verdict.reason
    assert "index of 2 platforms, each verified (linux/amd64, linux/arm64)" in verdict.reason
    assert [(c.platform, c.digest, c.allowed) for c in verdict.children] == [
        ("linux/amd64", release.amd64, True), ("linux/arm64", release.arm64, True)]
    assert verdict.digests == (release.index, release.amd64, release.arm64)


def test_a_tag_naming_the_index_is_judged_as_the_whole_index(private_key, registry, publisher):
    release = two_platforms(publisher, sign_arm64=False)
    with verifier(trust(private_key), registry) as v:
        verdict = v.verify(f"{HOST}/{REPO}:3.2.2")
    assert not verdict.allowed and verdict.digest == release.index


def test_an_index_with_one_unsigned_child_is_refused_naming_its_platform(private_key, registry, publisher):
    release = two_platforms(publisher, sign_arm64=False)
    verdict = verify(trust(private_key), registry, release.index)
    assert not verdict.allowed
    assert verdict.reason.startswith("1 of 2 platforms refused: linux/arm64 " + release.arm64 + ": refused: not signed")
    assert [c.allowed for c in verdict.children] == [True, False]


def test_a_child_whose_config_contradicts_its_entry_is_refused(private_key, registry, publisher):
    release = two_platforms(publisher, arm64_config="linux/amd64")
    verdict = verify(trust(private_key), registry, release.index)
    assert not verdict.allowed
    assert f"linux/arm64 {release.arm64}: refused: " in verdict.reason
    assert "is a linux/amd64 image, not linux/arm64" in verdict.reason


def test_a_child_without_a_required_attestation_about_itself_refuses_the_index(private_key, registry, publisher):
    amd64, arm64 = publisher.image("linux/amd64"), publisher.image("linux/arm64")
    publisher.release(amd64)
    publisher.sign(arm64)
    publisher.attest(arm64, "sbom", "vuln", "gate")  # no smoke
    index = publisher.index({"linux/amd64": amd64, "linux/arm64": arm64})
    publisher.sign(index)
    verdict = verify(trust(private_key), registry, index)
    assert not verdict.allowed
    assert f"linux/arm64 {arm64}: refused: attestations missing: smoke" in verdict.reason


def test_a_child_carrying_another_childs_results_is_refused(private_key, registry, publisher):
    """The smoke and gate results of amd64, re-signed onto arm64, are not arm64's."""
    amd64, arm64 = publisher.image("linux/amd64"), publisher.image("linux/arm64")
    publisher.release(amd64)
    publisher.sign(arm64)
    publisher.attest(arm64, "sbom", "vuln", "smoke", "gate",
                     smoke={"digest": amd64, "status": "passed"},
                     gate={"digest": amd64, "decision": "passed", "exceptions_applied": []})
    index = publisher.index({"linux/amd64": amd64, "linux/arm64": arm64})
    publisher.sign(index)
    verdict = verify(trust(private_key), registry, index)
    assert f"linux/arm64 {arm64}: refused: the smoke attestation's results are for {amd64}" in verdict.reason


def test_an_unsigned_index_is_refused_before_any_child_is_read(private_key, registry, publisher):
    amd64, arm64 = publisher.image("linux/amd64"), publisher.image("linux/arm64")
    publisher.release(amd64)
    publisher.release(arm64)
    index = publisher.index({"linux/amd64": amd64, "linux/arm64": arm64})
    verdict = verify(trust(private_key), registry, index)
    assert verdict.reason.startswith("not signed")
    assert not {amd64, arm64} & set(registry.reads)


def test_a_signed_index_of_too_many_children_is_refused_without_reading_them(private_key, registry, publisher):
    images = {f"linux/arch{n}": publisher.image(f"linux/arch{n}") for n in range(MAX_CHILDREN + 1)}
    index = publisher.index(images)
    publisher.sign(index)
    verdict = verify(trust(private_key), registry, index)
    assert not verdict.allowed and f"over {MAX_CHILDREN}" in verdict.reason
    assert not set(images.values()) & set(registry.reads)


def test_an_index_required_to_carry_its_release_record_is_refused_without_one(private_key, registry, publisher):
    release = two_platforms(publisher)
    config = trust(private_key, replace(STRICT, attestations=(*STRICT.attestations, "release")))
    assert verify(config, registry, release.index).allowed
    bare = publisher.index({"linux/arm64": release.arm64, "linux/amd64": release.amd64}, tag=None)  # another index
    publisher.sign(bare)
    verdict = verify(config, registry, bare)
    assert not verdict.allowed and verdict.reason.startswith("attestations missing: release")


def test_a_manifest_served_as_an_image_but_listing_manifests_is_judged_as_an_index(private_key, registry, publisher):
    """A runtime that reads it as an index would run children nobody verified."""
    amd64 = publisher.image("linux/amd64")
    raw = index_document([Child("linux/amd64", amd64, OCI_MANIFEST, len(registry.manifests[amd64][0]))])
    disguised = registry.put(raw, OCI_MANIFEST)
    publisher.release(disguised)
    verdict = verify(trust(private_key), registry, disguised)
    assert not verdict.allowed and "linux/amd64" in verdict.reason and "not signed" in verdict.reason


# --- a child by its own digest -----------------------------------------------------------------


def test_a_child_by_its_digest_is_verified_as_itself(private_key, registry, publisher):
    release = two_platforms(publisher, sign_arm64=False)
    assert verify(trust(private_key), registry, release.amd64).allowed
    verdict = verify(trust(private_key), registry, release.arm64)
    assert not verdict.allowed and verdict.reason.startswith("not signed") and verdict.children == ()


# --- the cache ---------------------------------------------------------------------------------


def test_an_index_verified_whole_answers_for_its_children_from_the_cache(private_key, registry, publisher):
    release = two_platforms(publisher)
    with verifier(trust(private_key), registry) as v:
        assert v.verify(f"{HOST}/{REPO}@{release.index}").allowed
        for child in (release.amd64, release.arm64):
            cached = v.cached(f"{HOST}/{REPO}@{child}")
            assert cached is not None and cached.allowed and cached.digest == child


def test_a_refused_index_and_a_verified_child_vouch_for_nothing_else(private_key, registry, publisher):
    release = two_platforms(publisher, sign_arm64=False)
    with verifier(trust(private_key), registry) as v:
        assert not v.verify(f"{HOST}/{REPO}@{release.index}").allowed
        assert v.cached(f"{HOST}/{REPO}@{release.amd64}") is None  # not verified as a whole
    other = publisher.index({"linux/amd64": release.amd64}, tag=None)
    publisher.sign(other)
    with verifier(trust(private_key), registry) as v:
        assert v.verify(f"{HOST}/{REPO}@{release.amd64}").allowed
        assert v.cached(f"{HOST}/{REPO}@{other}") is None  # a child never stands for an index


def test_children_held_to_less_inside_an_index_are_not_cached_as_if_verified_alone(private_key, registry, publisher):
    """With `release` required, a child inside an index needs none of its own (the index has it), alone it does."""
    release = two_platforms(publisher)
    config = trust(private_key, replace(STRICT, attestations=(*STRICT.attestations, "release")))
    with verifier(config, registry) as v:
        assert v.verify(f"{HOST}/{REPO}@{release.index}").allowed
        assert v.cached(f"{HOST}/{REPO}@{release.amd64}") is None
        assert not v.verify(f"{HOST}/{REPO}@{release.amd64}").allowed


# --- quarantine ----------------------------------------------------------------------------------


class Marks:
    def __init__(self, marked: dict[str, str]):
        self.marked = marked

    def refusal(self, digest: str) -> str | None:
        return self.marked.get(digest)


def test_a_quarantined_child_refuses_its_index(private_key, registry, publisher):
    release = two_platforms(publisher)
    with verifier(trust(private_key), registry) as v:
        check = with_quarantine(v.verify, Marks({release.arm64: "quarantined since today (rescan): CVE"}))
        verdict = check(f"{HOST}/{REPO}@{release.index}")
        assert not verdict.allowed
        assert verdict.reason == f"its child {release.arm64} is quarantined since today (rescan): CVE"
        assert check(f"{HOST}/{REPO}@{release.amd64}").allowed
