"""How many compressed bytes a node pulls for an image: its config and layers as its manifest lists them,
per platform of an index. Read from the registry (the manifests only, never a blob), checked as it is read."""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from imagebuild.oci import names
from imagebuild.oci.client import ImageRef, Registries, RegistryError

MAX_CHILDREN = 64  # an index of ours has one child per platform (and their attestation manifests)


def platform_of(descriptor: Mapping[str, Any]) -> str | None:
    """`os/architecture[/variant]` of an index entry; None for an entry that is no runnable image."""
    platform = descriptor.get("platform")
    if not isinstance(platform, Mapping):
        return None
    os_name, arch = platform.get("os"), platform.get("architecture")
    if not isinstance(os_name, str) or not isinstance(arch, str) or "unknown" in (os_name, arch):
        return None  # BuildKit's attestation manifests say unknown/unknown
    variant = platform.get("variant")
    return "/".join([os_name, arch, *([variant] if isinstance(variant, str) and variant else [])])[:60]


def pulled_bytes(manifest: Mapping[str, Any]) -> int:
    """Config and layers of one image manifest, as their descriptors give their sizes."""
    descriptors = [manifest.get("config"), *(manifest.get("layers") or [])]
    total = 0
    for descriptor in descriptors:
        checked = names.check_descriptor(descriptor, "blob")
        size = checked.get("size")
        if size is None:
            raise names.BadName(f"blob {checked['digest']} has no size")
        total += size
    return total


def _document(raw: bytes) -> dict[str, Any]:
    document = json.loads(raw)
    if not isinstance(document, dict):
        raise names.BadName("the manifest is not a JSON object")
    return document


def image_sizes(registries: Registries, image: str, platforms: Iterable[str]) -> dict[str, int]:
    """Compressed bytes per platform of `image` (repository@digest): an index's each child, or the one image
    (named by the variant's only platform). {} when the registry cannot say (the figures leave it out)."""
    ref = ImageRef.parse(image)
    registry = registries.get(ref.registry)
    try:
        raw, _, _ = registry.get_manifest(ref.repository, ref.reference)
        document = _document(raw)
        if "manifests" not in document:
            only = list(platforms)
            return {only[0] if len(only) == 1 else "linux/amd64": pulled_bytes(document)}
        sizes: dict[str, int] = {}
        for descriptor in (document.get("manifests") or [])[:MAX_CHILDREN]:
            platform = platform_of(names.check_descriptor(descriptor, "child manifest"))
            if platform is None:
                continue
            child, _, _ = registry.get_manifest(ref.repository, descriptor["digest"])
            sizes[platform] = pulled_bytes(_document(child))
        return sizes
    except (RegistryError, names.BadName, ValueError):
        return {}
