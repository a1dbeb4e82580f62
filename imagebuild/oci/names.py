"""The OCI grammar for what goes into a registry URL (digests, tags, repositories), and loopback hosts.

A registry's answers are untrusted: a descriptor digest `sha256:../../other/blobs/…` or a tag with
a `/` would, pasted into a path, reach another repository (httpx removes dot segments). Every
digest, tag and repository is checked here before it becomes part of a URL, and a refusal names
the value escaped, so a hostile value cannot rewrite the line that reports it.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any, TypeGuard

from imagebuild.core.errors import ImagebuildError

# The one grammar (imagebuild.oci.reference builds references from these pieces).
# The registered algorithms only (OCI image spec, descriptor.md): anything else is refused.
DIGEST_HEX = {"sha256": re.compile(r"[a-f0-9]{64}"), "sha512": re.compile(r"[a-f0-9]{128}")}
_DIGEST = re.compile(r"(?:sha256:[a-f0-9]{64}|sha512:[a-f0-9]{128})")
# What imagebuild itself names images, signatures, marks and rollouts by: cosign's tag scheme
# (sha256-<hex>.sig) and every record of ours know sha256 only.
SHA256_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # a path component: separators ., _, __, -+
REPOSITORY = re.compile(rf"{COMPONENT}(?:/{COMPONENT})*")
# A Harbor project, and a region's or wave's name in a release file: Harbor refuses doubled
# separators in a project, and a region name goes into PromQL label matchers, URLs and tags.
PROJECT = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")
NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")  # a DNS label
_TAG, _REPOSITORY = TAG, REPOSITORY
# A layer image's tag in the cache repository: its kind and the first 32 hex digits of its content key
# (build.plan). `gc cache` tells these from a person's tags by this pattern.
LAYER_CACHE_KINDS = ("base", "cuda", "python", "paddle", "extra", "release")
LAYER_CACHE_TAG = re.compile(rf"(?:{'|'.join(LAYER_CACHE_KINDS)})-[0-9a-f]{{32}}")
_ESCAPED_LIMIT = 200  # characters of a refused value quoted in a message


class BadName(ImagebuildError, ValueError):
    """A digest, tag or repository outside the OCI grammar (the message quotes it escaped)."""


def escaped(value: object, limit: int = _ESCAPED_LIMIT) -> str:
    """The value quoted with every control or non-ASCII character escaped, at most `limit` characters
    of it (an escape takes up to 10, so the cut is made after escaping) and "..." when cut."""
    # A number, list or null where text belonged is shown as Python's ascii() shows it.
    cut = isinstance(value, str) and len(value) > limit
    shown = ascii(value[:limit] if isinstance(value, str) else value)
    if len(shown) > limit:
        shown, cut = shown[:limit], True
    return shown + ("..." if cut else "")


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def is_sha256_digest(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and SHA256_DIGEST.fullmatch(value) is not None


def is_tag(value: object) -> bool:
    return isinstance(value, str) and _TAG.fullmatch(value) is not None


def layer_cache_tag(kind: str, key: str) -> str:
    """The cache repository's tag of the layer image `kind` with content key `key`."""
    return f"{kind}-{key[:32]}"


def is_layer_cache_tag(value: object) -> bool:
    return isinstance(value, str) and LAYER_CACHE_TAG.fullmatch(value) is not None


def is_repository(value: object) -> bool:
    return isinstance(value, str) and _REPOSITORY.fullmatch(value) is not None


def check_digest(value: object, what: str = "digest") -> str:
    if not is_digest(value):
        raise BadName(f"{what} {escaped(value)} is not a digest (sha256:<64 hex> or sha512:<128 hex>)")
    assert isinstance(value, str)
    return value


def check_tag(value: object, what: str = "tag") -> str:
    if not is_tag(value):
        raise BadName(f"{what} {escaped(value)} is not a tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")
    assert isinstance(value, str)
    return value


def check_reference(value: object, what: str = "reference") -> str:
    """A manifest reference: a digest, or else a tag."""
    if isinstance(value, str) and ":" in value:
        return check_digest(value, what)
    return check_tag(value, what)


def check_repository(value: object, what: str = "repository") -> str:
    if not is_repository(value):
        raise BadName(f"{what} {escaped(value)} is not a repository name (lower-case path components)")
    assert isinstance(value, str)
    return value


def check_descriptor(descriptor: object, what: str = "descriptor") -> dict[str, Any]:
    """A descriptor whose digest may go into a URL and whose size, when given, is a byte count."""
    if not isinstance(descriptor, dict):
        raise BadName(f"{what} {escaped(descriptor)} is not an object")
    check_digest(descriptor.get("digest"), f"{what} digest")
    size = descriptor.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise BadName(f"{what} {descriptor['digest']}: size {escaped(size)} is not a byte count")
    return descriptor


def split_host(registry: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]:port` or a bare IPv6 literal -> (host without brackets, port or None)."""
    if registry.startswith("["):
        host, _, rest = registry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif registry.count(":") == 1:
        host, _, port = registry.partition(":")
    else:
        host, port = registry, ""
    return host.lower(), int(port) if port.isdigit() else None


def is_loopback(host: str) -> bool:
    """`localhost` or an address that parses as a loopback one, with or without a port:
    `127.evil.example` is a name, not 127/8, and is reached over https like any other."""
    name = host.lower()
    if name.startswith("["):
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
