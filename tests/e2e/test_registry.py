"""imagebuild's OCI client against the real local registry (CNCF Distribution)."""
from __future__ import annotations

import hashlib
import json

import httpx

from imagebuild.registry import ImageRef, Registry, head_many

from .conftest import STAGING, unique

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _push_tiny_image(registry: Registry, repository: str, tags: list[str]) -> str:
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []},
                         "config": {"Labels": {"test": repository}}}).encode()
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    start = registry.client.post(f"/v2/{repository}/blobs/uploads/")
    location = start.headers["location"]
    registry.client.put(f"{location}{'&' if '?' in location else '?'}digest={digest}", content=config).raise_for_status()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "layers": [],
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": digest, "size": len(config)}}).encode()
    digests = {registry.put_manifest(repository, tag, manifest, MANIFEST) for tag in tags}
    assert len(digests) == 1
    return digests.pop()


def test_list_tags_follows_pagination(staging_registry):
    repository = f"e2e/{unique('tags')}"
    tags = [f"t{i}" for i in range(7)]
    with Registry(STAGING) as registry:
        _push_tiny_image(registry, repository, tags)
        assert registry.list_tags(repository, page_size=2) == set(tags)
        assert registry.list_tags(f"e2e/{unique('absent')}") == set()


def test_head_many_gives_a_digest_per_existing_reference_and_none_otherwise(staging_registry):
    repository = f"e2e/{unique('heads')}"
    with Registry(STAGING) as registry:
        digest = _push_tiny_image(registry, repository, ["a", "b"])
    seen = []
    found = head_many(STAGING, [(repository, "a"), (repository, "b"), (repository, "missing"), (repository, "a")],
                      event_hooks={"request": [lambda request: seen.append(request.url.path)]})
    assert found == {(repository, "a"): digest, (repository, "b"): digest, (repository, "missing"): None}
    assert len(seen) == 3, "one request per distinct reference"


def test_copy_within_tags_another_repository_without_pushing_blobs_again(staging_registry):
    source, target = f"e2e/{unique('src')}", f"e2e/{unique('dst')}"
    with Registry(STAGING) as registry:
        digest = _push_tiny_image(registry, source, ["v1"])
        assert registry.copy_within(source, digest, target, "release") == digest
        assert registry.head_manifest(target, "release") == digest
    # An independent reader agrees.
    response = httpx.head(f"http://{STAGING}/v2/{target}/manifests/release", headers={"Accept": MANIFEST})
    assert response.headers["docker-content-digest"] == digest


def test_image_references_parse_registry_repository_tag_and_digest():
    ref = ImageRef.parse("127.0.0.1:5000/a/b:1.0@sha256:" + "0" * 64)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == ("127.0.0.1:5000", "a/b", "1.0", "sha256:" + "0" * 64)
    assert ImageRef.parse("harbor.example.com/p/r").reference == "latest"
