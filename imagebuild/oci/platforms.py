"""Platforms (`linux/arm64`) and the OCI image index that joins one image per platform.

What a registry returns is untrusted: a child is accepted for a platform only when its own config
says that platform, and an index is made from children that are in the repository already, so
the index is never pushed before them (a registry would refuse it) and never names one that is
missing.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from imagebuild.core.errors import ImagebuildError
from imagebuild.oci import names
from imagebuild.oci.client import DOCKER_MANIFEST, INDEX_TYPES, OCI_INDEX, OCI_MANIFEST, Registry, RegistryError
from imagebuild.oci.compression import layer_families

MAX_CONFIG_BYTES = 4 << 20
# The platforms one index may list. A release has a handful; a hostile index listing thousands must
# be refused from its manifest alone, before one request per child goes out.
MAX_CHILDREN = 16
IMAGE_MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})


@dataclass(frozen=True)
class Platform:
    """`os/architecture[/variant]`, as BuildKit and the OCI image spec name them."""

    os: str
    architecture: str
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> Platform:
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"'{text}' is not a platform like linux/arm64")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)

    def descriptor(self) -> dict[str, str]:
        """The `platform` of an index entry."""
        out = {"architecture": self.architecture, "os": self.os}
        if self.variant:
            out["variant"] = self.variant
        return out

    def matches(self, described: Mapping[str, Any]) -> bool:
        """Does an index entry's `platform` (or an image config) describe this platform? arm64's `v8` is its
        only variant, so a missing one and `v8` are the same."""
        if described.get("os") != self.os or described.get("architecture") != self.architecture:
            return False
        theirs = described.get("variant") or None
        ours = self.variant
        if self.architecture == "arm64":
            theirs, ours = theirs or "v8", ours or "v8"
        return theirs == ours


def platform_folder(platform: str) -> str:
    """A folder name for one platform's files (`linux-arm64`): a stage's output per child of an index."""
    return str(Platform.parse(platform)).replace("/", "-")


@dataclass(frozen=True)
class Child:
    """One platform's manifest as the index lists it."""

    platform: str
    digest: str
    media_type: str
    size: int


def index_document(children: Iterable[Child]) -> bytes:
    """The index's bytes (pure): children in the order given, compact JSON, so the same children give
    the same digest on every machine."""
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{"mediaType": c.media_type, "digest": c.digest, "size": c.size,
                       "platform": Platform.parse(c.platform).descriptor()} for c in children],
    }
    return json.dumps(index, separators=(",", ":")).encode()


class BadIndex(ImagebuildError):
    """An index that cannot be a release's: why, in one line (its entries come from a registry)."""


def index_children(raw: bytes, max_children: int = MAX_CHILDREN) -> tuple[Child, ...]:
    """The children an index lists (pure), each as its entry says: strictly, since every one is a
    platform a node may run. At most `max_children` (checked before anything else is looked at);
    each entry an image manifest (an index inside an index is refused: nesting depth 1) named by a
    sha256 digest, with a platform. The same digest listed twice is one child. BadIndex otherwise.
    Whether each child's config says its platform is child_for's to check, with the registry."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadIndex("the index is not JSON") from None
    entries = document.get("manifests") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise BadIndex("the index lists no manifests")
    if len(entries) > max_children:
        raise BadIndex(f"the index lists {len(entries)} manifests, over {max_children}")
    children: dict[str, Child] = {}
    for position, entry in enumerate(entries):
        where = f"entry {position}"
        if not isinstance(entry, dict):
            raise BadIndex(f"{where} is not a descriptor")
        digest, media_type, size = entry.get("digest"), entry.get("mediaType"), entry.get("size")
        if not names.is_sha256_digest(digest):
            raise BadIndex(f"{where} names {names.escaped(str(digest)[:80])}, not a sha256 digest")
        if media_type not in IMAGE_MANIFEST_TYPES:
            nested = " (an index in an index)" if media_type in INDEX_TYPES else ""
            raise BadIndex(f"{where} ({digest}) is {names.escaped(str(media_type)[:80])}{nested}, "
                              "not an image manifest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BadIndex(f"{where} ({digest}) has no size")
        parsed = _entry_platform(entry.get("platform"))
        if parsed is None:
            raise BadIndex(f"{where} ({digest}) names no platform os/architecture[/variant]")
        children.setdefault(digest, Child(str(parsed), digest, str(media_type), size))
    return tuple(children.values())


def listed_child(raw: bytes, platform: str) -> str | None:
    """The digest of the image an index lists for `platform` (pure; index_children's checks, BadIndex when
    they fail); None when it lists none for that platform."""
    wanted = Platform.parse(platform)
    return next((child.digest for child in index_children(raw)
                 if wanted.matches(Platform.parse(child.platform).descriptor())), None)


def child_for(registry: Registry, repository: str, digest: str, platform: str) -> Child:
    """`repository@digest` as the `platform` child of an index, after checking that its config says so."""
    raw, media_type, actual = registry.get_manifest(repository, digest)
    document = _json_object(registry, repository, digest, raw)
    if media_type in INDEX_TYPES or not isinstance(document.get("config"), dict):
        raise RegistryError(f"{registry.registry}/{repository}@{digest}: not an image manifest "
                            f"({media_type or 'no media type'}); an index's child must be one",
                            registry=registry.registry, repository=repository, operation="index")
    config_digest = str(document["config"].get("digest"))
    config_bytes = registry.get_blob_limited(repository, config_digest, MAX_CONFIG_BYTES)
    if _digest_of(config_bytes) != config_digest:
        raise RegistryError(f"{registry.registry}/{repository}@{digest}: its config does not match its digest",
                            registry=registry.registry, repository=repository, operation="index")
    config = _json_object(registry, repository, config_digest, config_bytes)
    if not Platform.parse(platform).matches(config):
        found = f"{config.get('os')}/{config.get('architecture')}"
        raise RegistryError(f"{registry.registry}/{repository}@{digest} is a {found} image, not {platform}",
                            registry=registry.registry, repository=repository, operation="index")
    return Child(platform, actual, media_type, len(raw))


def push_index(registry: Registry, repository: str, children: Mapping[str, str]) -> str:
    """Put the index of `children` (platform -> manifest digest, in order) into `repository` by its
    digest (no tag: tagging is the caller's, once the index is complete); the index's digest."""
    checked = [child_for(registry, repository, digest, platform) for platform, digest in children.items()]
    raw = index_document(checked)
    return registry.put_manifest(repository, _digest_of(raw), raw, OCI_INDEX)


def platform_digest(registry: Registry, repository: str, reference: str, platform: str) -> str | None:
    """The digest of `platform`'s image that `repository:reference` names: the matching child of an index,
    or the manifest itself when its config is that platform. None when the reference does not exist;
    RegistryError when it exists but has no image for `platform`."""
    found = registry.find_manifest(repository, reference)
    if found is None:
        return None
    raw, media_type, digest = found
    wanted = Platform.parse(platform)
    if media_type in INDEX_TYPES:
        entries = _json_object(registry, repository, digest, raw).get("manifests") or []
        if not isinstance(entries, list):
            entries = []
        for entry in entries:
            if isinstance(entry, dict) and wanted.matches(entry.get("platform") or {}):
                return child_for(registry, repository, str(entry.get("digest")), platform).digest
        listed = ", ".join(sorted({_described(e["platform"]) for e in entries if isinstance(e, dict)
                                   and isinstance(e.get("platform"), dict)})) or "none"
        raise RegistryError(f"{registry.registry}/{repository}:{reference} has no {platform} image "
                            f"(platforms: {listed})", registry=registry.registry, repository=repository,
                            operation="platform")
    return child_for(registry, repository, digest, platform).digest


def _entry_platform(platform: object) -> Platform | None:
    """An index entry's `platform` as a Platform, when each part it names is a plain word."""
    if not isinstance(platform, dict):
        return None
    parts = [platform.get(key) for key in ("os", "architecture", "variant")]
    if parts[2] in (None, ""):
        parts = parts[:2]
    if not all(isinstance(part, str) and part and "/" not in part for part in parts):
        return None
    return Platform.parse("/".join(str(part) for part in parts))


def _described(platform: Mapping[str, Any]) -> str:
    """An index entry's platform as os/architecture[/variant], for messages."""
    return "/".join(str(platform[k]) for k in ("os", "architecture", "variant") if platform.get(k))


def _json_object(registry: Registry, repository: str, digest: str, raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise RegistryError(f"{registry.registry}/{repository}@{digest}: not a JSON object",
                            registry=registry.registry, repository=repository, operation="index")
    return value


def _digest_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def pull_families(registry: Registry, repository: str, digest: str) -> frozenset[str]:
    """The layer compressions a node must read to pull `repository@digest`: its own layers', or every child's
    of an index (compression.layer_families). The index is read as index_children reads a release's."""
    raw, media_type, actual = registry.get_manifest(repository, digest)
    if media_type in INDEX_TYPES:
        try:
            children = index_children(raw)
        except BadIndex as exc:
            raise RegistryError(f"{registry.registry}/{repository}@{digest}: {exc}", registry=registry.registry,
                                repository=repository, operation="index") from None
        families: set[str] = set()
        for child in children:
            child_raw, _, _ = registry.get_manifest(repository, child.digest)
            families |= layer_families(_json_object(registry, repository, child.digest, child_raw))
        return frozenset(families)
    return layer_families(_json_object(registry, repository, actual, raw))
