"""imagebuild's OCI client against the real local registry (CNCF Distribution)."""
from __future__ import annotations

import hashlib
import json
import re

import httpx
import pytest

from imagebuild.oci.client import OCI_INDEX, ImageRef, Registry, RegistryError, head_many
from imagebuild.oci.copy import CopyOptions, copy_image, copy_within
from imagebuild.oci.locations import BlobLocations

from .conftest import STAGING, unique
from .oci_servers import RecordingServer

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
        assert copy_within(registry, source, digest, target, "release") == digest
        assert registry.head_manifest(target, "release") == digest
    # An independent reader agrees.
    response = httpx.head(f"http://{STAGING}/v2/{target}/manifests/release", headers={"Accept": MANIFEST})
    assert response.headers["docker-content-digest"] == digest


def test_image_references_parse_registry_repository_tag_and_digest():
    ref = ImageRef.parse("127.0.0.1:5000/a/b:1.0@sha256:" + "0" * 64)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == ("127.0.0.1:5000", "a/b", "1.0", "sha256:" + "0" * 64)
    assert ImageRef.parse("harbor.example.com/p/r").reference == "latest"


# --- a hostile registry's names never reach another path -----------------------------------

HEX = "ab" * 32


def _hostile_image(layer_digest: str) -> tuple[RecordingServer, str, bytes]:
    """A loopback registry of the test's own serving team/app:v1, whose one layer has `layer_digest`;
    (server, manifest digest, config)."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    layers = [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": 1}] \
        if layer_digest else []
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "layers": layers,
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": config_digest, "size": len(config)}}).encode()
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    found = {"Content-Type": MANIFEST, "Docker-Content-Digest": digest}
    server = RecordingServer({"/v2/team/app/manifests/v1": (200, found, manifest),
                              f"/v2/team/app/manifests/{digest}": (200, found, manifest),
                              f"/v2/team/app/blobs/{config_digest}": (200, {}, config)})
    return server, digest, config


def _target_requests() -> tuple[list[str], dict]:
    sent: list[str] = []
    return sent, {"request": [lambda request: sent.append(f"{request.method} {request.url.path}")]}


@pytest.mark.parametrize("layer", [f"sha256:../../other/blobs/sha256:{HEX}", f"sha256:/../../../other/blobs/sha256:{HEX}",
                                   f"sha256:{HEX}?digest=x", "sha256:\x1b[32mverified\x1b[0m"])
def test_a_layer_digest_outside_the_grammar_stops_the_copy_before_any_blob_is_asked_for(staging_registry, layer):
    server, digest, _ = _hostile_image(layer)
    sent, hooks = _target_requests()
    try:
        with Registry(server.host) as source, Registry(STAGING, event_hooks=hooks) as target:
            with pytest.raises(RegistryError, match=re.escape(f"layer digest {ascii(layer)} is not a digest")) as raised:
                copy_image(source, "team/app", "v1", target, f"e2e/{unique('hostile')}",
                           options=CopyOptions(locations=BlobLocations()))
        assert server.paths() == ["/v2/team/app/manifests/v1", f"/v2/team/app/manifests/{digest}"]
        assert sent == [], "nothing went to the target either"
        assert "\x1b" not in str(raised.value)
    finally:
        server.stop()


def test_a_referrer_digest_with_a_slash_is_refused_before_it_is_requested(staging_registry):
    server, digest, _ = _hostile_image("")
    bad = f"sha256:{HEX}/../../../../other/manifests/latest"
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": MANIFEST, "digest": bad, "size": 2, "artifactType": "application/x-test"}]}).encode()
    server.routes[f"/v2/team/app/referrers/{digest}"] = (200, {"Content-Type": OCI_INDEX}, index)
    try:
        with Registry(server.host) as source, Registry(STAGING) as target:
            with pytest.raises(RegistryError, match=re.escape(f"GET referrers: the registry's referrer digest {ascii(bad)} "
                                                              "is not a digest")):
                copy_image(source, "team/app", "v1", target, f"e2e/{unique('hostile-referrer')}",
                           options=CopyOptions(signatures=True, locations=BlobLocations()))
        assert f"/v2/team/app/referrers/{digest}" in server.paths()
        assert not [path for path in server.paths() if "other" in path or HEX in path], server.paths()
    finally:
        server.stop()


def test_tags_digests_and_urls_a_registry_answers_are_checked_before_they_are_used():
    elsewhere = RecordingServer()
    server = RecordingServer({
        "/v2/team/app/tags/list": (200, {"Content-Type": "application/json"}, b'{"tags": ["v1", "../../x"]}'),
        "/v2/team/app/manifests/v1": (200, {"Docker-Content-Digest": "sha256:../../../other/manifests/x"}, b""),
        "/v2/team/paged/tags/list": (200, {"Link": f'<http://{elsewhere.host}/v2/team/paged/tags/list?n=1>; rel="next"'},
                                     b'{"tags": ["v1"]}'),
        "/v2/team/app/blobs/uploads/": (202, {"Location": f"http://{elsewhere.host}/v2/team/app/blobs/uploads/u"}, b""),
    })
    try:
        with Registry(server.host, credentials=None, username="u", password="p-canary") as registry:
            for call, said in (
                    (lambda: registry.list_tags("team/app"),
                     "team/app: list tags: the registry's tag '../../x' is not a tag"),
                    (lambda: registry.head_manifest("team/app", "v1"),
                     "team/app: HEAD manifest: the registry's Docker-Content-Digest 'sha256:../../../other/manifests/x' "
                     "is not a digest"),
                    (lambda: registry.list_tags("team/paged"),
                     f"team/paged: list tags: the registry pointed at 'http://{elsewhere.host}/v2/team/paged/tags/list', "
                     "outside this registry's"),
                    (lambda: registry.start_upload("team/app"),
                     f"team/app: upload location: the registry pointed at "
                     f"'http://{elsewhere.host}/v2/team/app/blobs/uploads/u', outside this registry's")):
                with pytest.raises(RegistryError, match=re.escape(said)) as raised:
                    call()
                assert "p-canary" not in str(raised.value)
        assert elsewhere.seen == [], "no request followed a URL off the registry"
    finally:
        server.stop()
        elsewhere.stop()


def test_a_small_blob_is_refused_while_it_is_read_once_the_registry_sends_more_than_its_bound():
    """A config or a signature's payload is held in memory: a registry that streams more than the bound
    (here 64 MiB of zeros for any blob) is cut off at it, before the digest could even be checked."""
    from imagebuild.oci.client import MAX_SMALL_BLOB_BYTES

    from .hostile_registry import HostileRegistry

    hostile = HostileRegistry()
    try:
        with Registry(f"127.0.0.1:{hostile.port}") as registry:
            with pytest.raises(RegistryError, match=f"GET blob: larger than {MAX_SMALL_BLOB_BYTES} bytes"):
                registry.get_blob(HostileRegistry.REPOSITORY, "sha256:" + "a" * 64)
        assert hostile.blob_bytes_sent < HostileRegistry.BLOB
    finally:
        hostile.stop()
