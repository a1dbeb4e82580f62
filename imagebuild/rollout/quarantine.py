"""Quarantine: images behind a channel tag that now fail the gate, marked so that no rollout moves them on.

`imagebuild rescan --release release.yaml` resolves every channel tag in every region to a
digest (each digest scanned once, from the first region that has it), scans it with Trivy
against today's DB (scan.scan_image, the same flags as `imagebuild scan`) and judges it with
the vulnerability policy (gate.evaluate, as `imagebuild gate`). Each digest that fails is
quarantined.

The mark is a document in the release's state repository (release.yaml `state`, where rollout
records and leases live), under the tag `quarantine-sha256-<hex>`: durable, shared by every
machine that rolls out, and keyed by digest, so it holds in every region and under every tag.
It says when, by whom, why, and the blocking findings. `rollout start` and `rollout resume`
call `refusal()` and refuse a quarantined digest. `imagebuild quarantine IMAGE --reason TEXT`
marks one by hand; `--clear` lifts it (both are appended to the local audit log).

The tag moves nothing that serves traffic: taking an image out of a channel is a rollback
(`imagebuild rollout rollback`), a decision for a person, which the alert asks for.
"""
from __future__ import annotations

import datetime as dt
import getpass
import json
import socket
from pathlib import Path
from typing import Any

from imagebuild.config.release_file import ReleaseConfig
from imagebuild.core.source import safe_text
from imagebuild.oci import names
from imagebuild.oci.client import ImageRef
from imagebuild.rollout.state import StateStore, open_store

PREFIX = "quarantine-"
MEDIA_TYPE = "application/vnd.imagebuild.quarantine.v1+json"
SCHEMA = 1


def quarantine_tag(digest: str) -> str:
    if not names.is_sha256_digest(digest):
        raise ValueError(f"{digest!r} is not a sha256 digest")
    return f"{PREFIX}{digest.replace(':', '-', 1)}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def open_state(config: ReleaseConfig) -> StateStore:
    """The release's state repository, where the marks live."""
    return open_store(config)


def find(store: StateStore, digest: str) -> dict[str, Any] | None:
    """The quarantine mark of `digest`, or None. A mark that cannot be read (its blob does not match its
    descriptor, not a JSON object) is refused by the store: StateRefused, never "not quarantined"."""
    return store.read(quarantine_tag(digest), MEDIA_TYPE)


def describe(mark: dict[str, Any]) -> str:
    """A mark's when, how and why in one line; its text came from the state repository, so escaped."""
    since, source, reason = (safe_text(str(mark.get(key)), limit)
                             for key, limit in (("since", 64), ("source", 32), ("reason", 600)))
    return f"since {since} ({source}): {reason}"


def mark(store: StateStore, digest: str, reason: str, *, images: list[str] | None = None,
         findings: list[dict[str, Any]] | None = None, source: str = "manual") -> dict[str, Any]:
    """Quarantine `digest` (again: the newest reason and findings replace the old ones, `since` stays)."""
    earlier = find(store, digest)
    record = {"schema": SCHEMA, "digest": digest, "reason": reason, "source": source, "by": _who(), "at": _now(),
              "since": (earlier or {}).get("since") or _now(), "images": sorted(set(images or [])),
              "findings": findings or []}
    store.write(quarantine_tag(digest), record, MEDIA_TYPE)
    return record


def clear(store: StateStore, digest: str) -> bool:
    """Lift the quarantine of `digest`; False when it was not quarantined."""
    if find(store, digest) is None:
        return False
    store.delete(quarantine_tag(digest))
    return True


def list_marks(store: StateStore) -> list[dict[str, Any]]:
    tags = sorted(t for t in store.registry.list_tags(store.repository) if t.startswith(PREFIX))
    found = []
    for tag in tags:
        record = store.read(tag, MEDIA_TYPE)
        if record is not None:
            found.append(record)
    return found


def refusal(config: ReleaseConfig, digest: str) -> str | None:
    """Why `digest` may not be rolled out (it is quarantined), or None. rollout start/resume call this."""
    store = open_state(config)
    try:
        record = find(store, digest)
    finally:
        store.registry.close()
    if record is None:
        return None
    return (f"{digest} is quarantined {describe(record)}; "
            f"`imagebuild quarantine --release {config.path} --clear {digest}` lifts it")


def audit(local_dir: Path, entry: dict[str, Any]) -> None:
    local_dir.mkdir(parents=True, exist_ok=True)
    with open(local_dir / "audit.jsonl", "a", encoding="utf-8") as log:
        log.write(json.dumps({"at": _now(), "by": _who(), **entry}, sort_keys=True) + "\n")


def parse_digest_of(image: str) -> str:
    """The digest of IMAGE (REF@sha256:..., or a bare sha256:...); ValueError when it names none."""
    if image.startswith("sha256:"):
        quarantine_tag(image)
        return image
    ref = ImageRef.parse(image)
    if not ref.digest:
        raise ValueError(f"{image}: give the image by digest (REF@sha256:...); a tag can move")
    quarantine_tag(ref.digest)
    return ref.digest
