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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .oci import names
from .registry import ImageRef, RegistryError
from .release import ReleaseConfig
from .source import safe_text

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


def open_state(config: ReleaseConfig) -> Any:
    """The release's state repository (rollout.StateStore), where the marks live."""
    from .rollout import open_store

    return open_store(config)


def find(store: Any, digest: str) -> dict[str, Any] | None:
    """The quarantine mark of `digest`, or None. A mark that cannot be read (its blob does not match its
    descriptor, not a JSON object) is refused by the store: StateRefused, never "not quarantined"."""
    return store.read(quarantine_tag(digest), MEDIA_TYPE)


def describe(mark: dict[str, Any]) -> str:
    """A mark's when, how and why in one line; its text came from the state repository, so escaped."""
    since, source, reason = (safe_text(str(mark.get(key)), limit)
                             for key, limit in (("since", 64), ("source", 32), ("reason", 600)))
    return f"since {since} ({source}): {reason}"


def mark(store: Any, digest: str, reason: str, *, images: list[str] | None = None,
         findings: list[dict[str, Any]] | None = None, source: str = "manual") -> dict[str, Any]:
    """Quarantine `digest` (again: the newest reason and findings replace the old ones, `since` stays)."""
    earlier = find(store, digest)
    record = {"schema": SCHEMA, "digest": digest, "reason": reason, "source": source, "by": _who(), "at": _now(),
              "since": (earlier or {}).get("since") or _now(), "images": sorted(set(images or [])),
              "findings": findings or []}
    store.write(quarantine_tag(digest), record, MEDIA_TYPE)
    return record


def clear(store: Any, digest: str) -> bool:
    """Lift the quarantine of `digest`; False when it was not quarantined."""
    if find(store, digest) is None:
        return False
    store.delete(quarantine_tag(digest))
    return True


def list_marks(store: Any) -> list[dict[str, Any]]:
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


# --- rescan -------------------------------------------------------------------------------------


@dataclass
class ChannelImage:
    """One digest behind one or more channel tags, in one or more regions."""

    digest: str
    pulled_from: str  # registry/repository@digest, the first region that has it
    tags: list[str] = field(default_factory=list)  # region registry/repository:tag naming it
    regions: list[str] = field(default_factory=list)


@dataclass
class RescanResult:
    digest: str
    image: str
    tags: list[str]
    status: str  # passed | quarantined | still-quarantined | failed (the scan could not run)
    blocking: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    db_updated_at: str | None = None

    @property
    def fails(self) -> bool:
        return self.status != "passed"

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "image": self.image, "tags": self.tags, "status": self.status,
                "blocking": self.blocking, "problems": self.problems, "error": self.error,
                "db_updated_at": self.db_updated_at}


def channel_images(config: ReleaseConfig, unreachable: Callable[[str, str], None]) -> list[ChannelImage]:
    """Every digest a channel tag names in some region, deduplicated (a region down is reported, not fatal)."""
    from .rollout import region_registry

    found: dict[str, ChannelImage] = {}
    for region in config.regions:
        registry = region_registry(region)
        try:
            for tag in config.channels:
                digest = registry.head_manifest(region.repository, tag)
                if not digest:
                    continue
                entry = found.setdefault(digest, ChannelImage(digest, f"{region.registry}/{region.repository}@{digest}"))
                entry.tags.append(f"{region.registry}/{region.repository}:{tag}")
                if region.name not in entry.regions:
                    entry.regions.append(region.name)
        except RegistryError as exc:
            unreachable(region.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        finally:
            registry.close()
    return list(found.values())


def rescan(config: ReleaseConfig, policy_path: Path, scan_options: Any, out: Path,
           on_event: Callable[[str], None] = lambda _: None, today: dt.date | None = None,
           unreachable: dict[str, str] | None = None) -> list[RescanResult]:
    """Scan and judge every image behind a channel tag; quarantine each that fails.

    A region that cannot be reached is skipped and named in `unreachable` (region -> why):
    what it serves was not judged, which the caller must report."""
    from . import gate as gating
    from . import scan as scanning
    from .report import VariantRecord
    from .source import load_document

    policy = gating.parse_policy(load_document(policy_path))
    today = today or dt.datetime.now(dt.timezone.utc).date()
    trivy = scanning.Trivy.find()
    db = scanning.prepare_db(trivy, scan_options)
    def down(region: str, why: str) -> None:
        on_event(f"region {region} unreachable: {why}")
        if unreachable is not None:
            unreachable[region] = why

    images = channel_images(config, down)
    store = open_state(config)
    results = []
    try:
        for image in images:
            on_event(f"rescanning {image.pulled_from} ({', '.join(image.tags)})")
            hex_digest = image.digest.split(":", 1)[1]
            record = VariantRecord(id=hex_digest[:12], tags=[], images=image.tags, chain=[], device="", paddle="",
                                   python="", cuda=None, cudnn=None, image=image.pulled_from, digest=image.digest)
            try:
                report, _ = scanning.scan_image(trivy, record, scan_options, out / f"sha256-{hex_digest}")
                findings = gating.findings(report)
            except (scanning.ScanError, gating.ReportError) as exc:
                results.append(RescanResult(image.digest, image.pulled_from, image.tags, "failed",
                                            error=str(exc).splitlines()[0][:500], db_updated_at=db.updated_at))
                continue
            scan = gating.ImageScan(record.id, image.pulled_from, image.digest, tuple(findings))
            verdict = gating.evaluate(policy, [scan], today).images[0]
            result = RescanResult(image.digest, image.pulled_from, image.tags, "passed", db_updated_at=db.updated_at,
                                  blocking=[{"id": d.finding.id, "package": d.finding.package,
                                             "severity": d.finding.severity, "installed": d.finding.installed,
                                             "fixed": d.finding.fixed, "why": d.why} for d in verdict.blocking],
                                  problems=list(verdict.problems))
            if not verdict.passed:
                earlier = find(store, image.digest)
                what = ", ".join(b["id"] for b in result.blocking[:5]) or "; ".join(result.problems)[:200]
                mark(store, image.digest, f"fails the gate ({policy_path}) with the DB of {db.updated_at}: {what}",
                     images=image.tags, findings=result.blocking, source="rescan")
                result.status = "still-quarantined" if earlier else "quarantined"
            results.append(result)
    finally:
        store.registry.close()
    return results


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
