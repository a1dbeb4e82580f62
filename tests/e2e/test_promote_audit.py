"""The promote audit against real registries: what the target serves is what is judged.

Promote verifies in the source and copies those very bytes; the audit then verifies the
manifests the target serves, and for blobs it verified a moment ago in the source asks the
target only whether it holds them (by digest and size). These tests break the target after a
copy, as a registry losing data or a second writer would, and call the audit again.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from imagebuild.config import trust
from imagebuild.oci.client import ImageRef
from imagebuild.release import push_plan
from imagebuild.release.push import Promoter
from imagebuild.trust.verify import DSSE_MEDIA_TYPE, signature_tag

from .conftest import COSIGN_PUB, STAGING

REGION = "127.0.0.1:5001"


@pytest.fixture
def promoter(tmp_path: Path):
    with Promoter(trust.trust_config_for_keys([COSIGN_PUB]), push_plan.Force(), tmp_path / "audit.jsonl") as made:
        yield made


def promoted(promoter: Promoter, image: str, registry: str) -> tuple[str, str]:
    """(target repository path, digest) of a fresh promote of `image` into `registry`."""
    path = f"promote-audit-{uuid.uuid4().hex[:10]}/paddle"
    outcome = promoter.promote(image, f"{registry}/{path}", ["audited"])
    assert outcome.action == "pushed", outcome.reason
    assert outcome.audit is not None and outcome.audit.passed
    assert outcome.digest is not None
    return path, outcome.digest


def largest_attestation_blob(registry: str, path: str, digest: str) -> str:
    manifest = httpx.get(f"http://{registry}/v2/{path}/manifests/{signature_tag(digest, '.att')}",
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=30).json()
    layers = [layer for layer in manifest["layers"] if layer["mediaType"] == DSSE_MEDIA_TYPE]
    return max(layers, key=lambda layer: layer["size"])["digest"]


@pytest.mark.parametrize("registry", [STAGING, REGION], ids=["same registry", "cross-registry"])
def test_an_attestation_blob_lost_in_the_target_fails_the_audit_with_or_without_the_source_evidence(
        signed_example, promoter, registry):
    image = signed_example.images[0]
    path, digest = promoted(promoter, image, registry)
    source = ImageRef.parse(image)
    _, evidence = promoter.verifier.examine(f"{source.registry}/{source.repository}@{digest}")
    kinds = set(evidence.attestation_kinds)
    assert {"sbom", "vuln", "smoke", "gate"} <= kinds
    target = promoter.registry(registry)

    # Before: the audit passes both ways (the source's evidence spares downloading what it verified).
    assert promoter.audit(target, path, digest, kinds, evidence).passed
    assert promoter.audit(target, path, digest, kinds).passed

    lost = largest_attestation_blob(registry, path, digest)
    deleted = httpx.delete(f"http://{registry}/v2/{path}/blobs/{lost}", timeout=30)
    assert deleted.status_code == 202, deleted.text
    assert httpx.head(f"http://{registry}/v2/{path}/blobs/{lost}", timeout=30).status_code == 404

    for known in (evidence, None):
        audit = promoter.audit(target, path, digest, kinds, known)
        assert not audit.passed, known
        assert audit.attestations == () or set(audit.attestations) < kinds
        assert lost in " ".join(audit.problems), audit.problems


def test_a_signature_tag_rewritten_in_the_target_is_judged_as_the_target_serves_it(signed_example, promoter):
    """The audit reads the target's manifests: a `.sig` tag that now names another image's signature
    fails it, although the source (and the evidence kept from it) is unchanged."""
    first, second = signed_example.images[0], signed_example.images[1]
    path, digest = promoted(promoter, first, REGION)
    source = ImageRef.parse(first)
    _, evidence = promoter.verifier.examine(f"{source.registry}/{source.repository}@{digest}")

    other = ImageRef.parse(second)
    other_sig = httpx.get(f"http://{other.registry}/v2/{other.repository}/manifests/"
                          f"{signature_tag(other.digest or '', '.sig')}",
                          headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=30)
    assert other_sig.status_code == 200
    manifest = json.loads(other_sig.content)
    target = promoter.registry(REGION)
    for blob in [manifest["config"], *manifest["layers"]]:  # the other image's signature, whole, in the target
        content = httpx.get(f"http://{other.registry}/v2/{other.repository}/blobs/{blob['digest']}", timeout=30)
        assert target.put_blob(path, content.content) == blob["digest"]
    target.put_manifest(path, signature_tag(digest, ".sig"), other_sig.content,
                        "application/vnd.oci.image.manifest.v1+json")

    audit = promoter.audit(target, path, digest, set(evidence.attestation_kinds), evidence)
    assert not audit.passed
    assert audit.key is None
    assert "not this image's digest" in " ".join(audit.problems)
