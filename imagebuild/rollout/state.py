"""The rollout's state repository: JSON documents as small OCI artifacts under tags, read as untrusted input.

What lives there (rollout records, channel pointers, leases, requests, quarantine marks) is written
by the reconciler and by `imagebuild rescan`; anyone with push rights to the repository can write it
too, so every read checks the blob against its descriptor before parsing it (StateStore.read).
"""
from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

from imagebuild.config.release_file import Region, ReleaseConfig
from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.source import safe_text
from imagebuild.oci import names
from imagebuild.oci.client import OCI_MANIFEST, Registry, RegistryError, RegistryUnreachable
from imagebuild.oci.retry import RetryPolicy
from imagebuild.rollout.plan import DIGEST_PATTERN

SCHEMA = 1
RECORD_TYPE = "application/vnd.imagebuild.rollout.record.v1+json"
LEASE_TYPE = "application/vnd.imagebuild.rollout.lease.v1+json"
MARKER_TYPE = "application/vnd.imagebuild.rollout.request.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
EMPTY_CONFIG = b"{}"
MAX_RECORD_BYTES = 16 * 1024 * 1024

FINISHED = frozenset({"completed", "halted", "aborted", "rolled-back"})

# Who did it: only these CI variables are read (never the environment at large, which holds secrets).
_CI_VARIABLES = ("CI", "GITHUB_ACTOR", "GITHUB_REPOSITORY", "GITHUB_RUN_ID", "GITHUB_RUN_ATTEMPT", "GITHUB_WORKFLOW",
                 "GITHUB_SHA", "GITLAB_USER_LOGIN", "CI_PROJECT_PATH", "CI_PIPELINE_ID", "CI_JOB_ID", "BUILD_URL")
REGION_RETRIES = RetryPolicy(attempts=2, base_delay_s=0.2, max_delay_s=1.0, max_elapsed_s=3.0, max_retry_after_s=5.0)


class RolloutError(ImagebuildError):
    """The rollout cannot go on; `exit_code` says why (FAILED by default; BAD_INPUT, ENVIRONMENT when
    a registry is unreachable, LEASE_HELD)."""

    def __init__(self, message: str, exit_code: ExitCode | None = None):
        super().__init__(message, exit_code=exit_code)


class LeaseHeld(RolloutError):
    """The channel's lease is held by another rollout (exit 4)."""

    exit_code = ExitCode.LEASE_HELD


class StateRefused(RolloutError):
    """A document of the state repository is refused: malformed, or its blob does not match its descriptor."""


def now_iso(now: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc).isoformat(timespec="seconds")


def who() -> dict[str, str]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    found = {"user": user, "host": socket.gethostname()}
    found.update({name: os.environ[name] for name in _CI_VARIABLES if os.environ.get(name)})
    return found


def short(digest: str | None) -> str:
    return digest.split(":", 1)[1][:12] if digest and ":" in digest else (digest or "-")


def record_tag(rollout_id: str) -> str:
    """The tag of a rollout's record."""
    return state_tag("rollout", rollout_id)


def state_tag(prefix: str, name: str) -> str:
    """A tag in the state repository; a long name is shortened with its hash so the tag stays within 128."""
    tag = f"{prefix}-{name}"
    if len(tag) <= 128:
        return tag
    return f"{prefix}-{name[:64]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


# --- the state repository -----------------------------------------------------------------


class StateStore:
    """JSON documents as small OCI artifacts under tags of the state repository."""

    def __init__(self, registry: Registry, repository: str):
        self.registry = registry
        self.repository = repository

    def read(self, tag: str, media_type: str | None = None) -> dict[str, Any] | None:
        """The document under `tag` (None when the tag is absent), read as untrusted input: its one
        layer's descriptor is checked (digest grammar, size, media type) before the digest goes into a
        URL, and the blob's sha256 and length must match it before it is parsed. Else StateRefused."""
        if not names.TAG.fullmatch(tag):
            raise StateRefused(f"state repository: '{safe_text(tag, 100)}' is not a tag")
        found = self.registry.find_manifest(self.repository, tag)
        if found is None:
            return None
        where = f"{self.registry.registry}/{self.repository}:{tag}"
        layer = _state_layer(found[0], where, media_type)
        digest, size = layer["digest"], layer["size"]
        try:
            blob = self.registry.get_blob_limited(self.repository, digest, size)
        except RegistryUnreachable:
            raise
        except RegistryError as exc:
            if exc.status is not None:
                raise
            raise StateRefused(f"{where}: blob {digest} is longer than its descriptor's {size} bytes; refused") from None
        actual = "sha256:" + hashlib.sha256(blob).hexdigest()
        if actual != digest or len(blob) != size:
            raise StateRefused(f"{where}: blob {digest} does not match its content ({actual}, {len(blob)} bytes "
                               f"of {size}); refused")
        try:
            data = json.loads(blob)
        except ValueError:
            raise StateRefused(f"{where}: its document is not JSON") from None
        if not isinstance(data, dict):
            raise StateRefused(f"{where}: its document is not a JSON object")
        return data

    def write(self, tag: str, data: Mapping[str, Any], media_type: str) -> None:
        content = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        config = self.registry.put_blob(self.repository, EMPTY_CONFIG)
        layer = self.registry.put_blob(self.repository, content)
        manifest = {
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": CONFIG_TYPE, "digest": config, "size": len(EMPTY_CONFIG)},
            "layers": [{"mediaType": media_type, "digest": layer, "size": len(content)}],
            # The tag's own name keeps two documents with equal content from sharing a manifest,
            # so deleting one (by digest: Distribution deletes no tags) never removes the other.
            "annotations": {"org.imagebuild.rollout.tag": tag},
        }
        raw = json.dumps(manifest, separators=(",", ":")).encode()
        self.registry.put_manifest(self.repository, tag, raw, OCI_MANIFEST)

    def delete(self, tag: str) -> None:
        digest = self.registry.head_manifest(self.repository, tag)
        if digest:
            self.registry.delete_manifest(self.repository, digest)


def _state_layer(raw: bytes, where: str, media_type: str | None) -> dict[str, Any]:
    """The one layer descriptor of a state document's manifest, checked before its digest is used."""
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise StateRefused(f"{where}: the manifest is not JSON") from None
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list) or len(layers) != 1 or not isinstance(layers[0], dict):
        raise StateRefused(f"{where}: not a state document (one JSON layer expected)")
    layer = layers[0]
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not DIGEST_PATTERN.fullmatch(digest):
        raise StateRefused(f"{where}: layer digest '{safe_text(digest, 100)}' is not sha256:<64 hex>")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_RECORD_BYTES:
        raise StateRefused(f"{where}: layer size {safe_text(size, 100)} is not 0..{MAX_RECORD_BYTES}")
    if media_type is not None and layer.get("mediaType") != media_type:
        raise StateRefused(f"{where}: layer type '{safe_text(layer.get('mediaType'), 100)}' is not {media_type}")
    return layer


def open_store(config: ReleaseConfig) -> StateStore:
    return StateStore(Registry(config.state_registry, retry=REGION_RETRIES), config.state_repository)


def region_registry(region: Region) -> Registry:
    credentials = region.credentials
    if credentials is not None and credentials.env:
        value = os.environ.get(credentials.env)
        if not value or ":" not in value:
            raise RolloutError(f"region {region.name}: environment variable {credentials.env} must hold USER:PASSWORD",
                               ExitCode.BAD_INPUT)
        user, password = value.split(":", 1)
        return Registry(region.registry, user, password, retry=REGION_RETRIES)
    config = credentials.docker_config if credentials is not None else None
    return Registry(region.registry, docker_config=config, retry=REGION_RETRIES)
