"""`imagebuild rescan`: every image behind a channel tag, scanned against today's DB and judged by the gate.

Each digest is scanned once, from the first region that has it (scan.scan_image, the same flags as
`imagebuild scan`), and judged with the vulnerability policy (gate.evaluate, as `imagebuild gate`);
each one that fails is quarantined (quarantine.mark), so that no rollout moves it on.

The image's signed OpenVEX attestation (`imagebuild vex attest`), verified with the release's trust
file, is handed to Trivy (`--vex`) with its expired statements left out: a newer DB respects exactly
the exceptions that were signed for that digest, until each one's last day.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.checks import gate as gating
from imagebuild.checks import scan as scanning
from imagebuild.config.release_file import ReleaseConfig
from imagebuild.config.trust import load_trust_config
from imagebuild.core.source import load_document
from imagebuild.oci.client import RegistryError
from imagebuild.rollout.quarantine import find, mark, open_state
from imagebuild.rollout.state import region_registry
from imagebuild.trust.verify import Verifier
from imagebuild.trust.vex_attest import SignedVex, signed_for_scan


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
    vex: SignedVex = field(default_factory=SignedVex)  # the signed statements Trivy was given

    @property
    def fails(self) -> bool:
        return self.status != "passed"

    def to_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "image": self.image, "tags": self.tags, "status": self.status,
                "blocking": self.blocking, "problems": self.problems, "error": self.error,
                "db_updated_at": self.db_updated_at, "vex": self.vex.record()}


def channel_images(config: ReleaseConfig, unreachable: Callable[[str, str], None]) -> list[ChannelImage]:
    """Every digest a channel tag names in some region, deduplicated (a region down is reported, not fatal)."""
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
    verifier = Verifier(load_trust_config(config.trust_path), cache_ttl_seconds=0)
    results = []
    try:
        for image in images:
            on_event(f"rescanning {image.pulled_from} ({', '.join(image.tags)})")
            hex_digest = image.digest.split(":", 1)[1]
            name = hex_digest[:12]
            folder = out / f"sha256-{hex_digest}"
            signed = signed_for_scan(verifier, image.pulled_from, folder, today)
            try:
                report, _ = scanning.scan_image(trivy, image.pulled_from, name, scan_options, folder, vex=signed.path)
                findings = gating.findings(report)
            except (scanning.ScanError, gating.ReportError) as exc:
                results.append(RescanResult(image.digest, image.pulled_from, image.tags, "failed",
                                            error=str(exc).splitlines()[0][:500], db_updated_at=db.updated_at,
                                            vex=signed))
                continue
            scan = gating.ImageScan(name, image.pulled_from, image.digest, tuple(findings))
            verdict = gating.evaluate(policy, [scan], today).images[0]
            result = RescanResult(image.digest, image.pulled_from, image.tags, "passed", db_updated_at=db.updated_at,
                                  blocking=[{"id": d.finding.id, "package": d.finding.package,
                                             "severity": d.finding.severity, "installed": d.finding.installed,
                                             "fixed": d.finding.fixed, "why": d.why} for d in verdict.blocking],
                                  problems=list(verdict.problems), vex=signed)
            if not verdict.passed:
                earlier = find(store, image.digest)
                what = ", ".join(b["id"] for b in result.blocking[:5]) or "; ".join(result.problems)[:200]
                mark(store, image.digest, f"fails the gate ({policy_path}) with the DB of {db.updated_at}: {what}",
                     images=image.tags, findings=result.blocking, source="rescan")
                result.status = "still-quarantined" if earlier else "quarantined"
            results.append(result)
    finally:
        verifier.close()
        store.registry.close()
    return results
