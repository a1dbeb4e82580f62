"""`imagebuild push` and `imagebuild promote`: copy by digest, audit in the target, then tag (effects).

One image moves in this order, so that no release tag ever names something unaudited:

1. Verify the signature and the attestations in the SOURCE: a build report can say "signed" and
   be wrong, and an unsigned image must not travel. At the same time, read the source's
   manifest and what the target's release tags name now (and, when every one already names
   this digest, what its signature and attestation tags name: a rerun copies nothing).
2. Decide the release tags (push_plan.decide_tags): a tag naming another digest is refused
   (release tags are immutable) unless --force with a reason.
3. Copy by digest (oci_copy): the blobs the target lacks, the manifest, and cosign's
   sha256-<hex>.sig/.att tags as the very bytes verified in step 1. No release tag yet.
4. Audit in the TARGET, a full verification there: the digest is there, the signature verifies
   with the configured keys, and every attestation that verified in the source verifies too. An
   index is verified whole there, every child with its own signature and attestations.
5. Only then write the release tags; a moved tag is appended to WORKDIR/audit.jsonl first.

An interrupted run leaves at most an untagged, unaudited copy (and its signature tags); a rerun
copies what is missing, audits, and tags. A rerun after success copies and writes nothing.
Registry credentials come from the Docker config and its credential helpers (oci_auth), never
from the command line; nothing here prints or records them.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from imagebuild.config.trust import TrustConfig
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import PushStage, SignStage, StageStatus, VariantRecord, record_stage
from imagebuild.oci.client import ImageRef, Registries, Registry, RegistryAuthError, RegistryError, RegistryUnreachable
from imagebuild.oci.copy import CopyOptions, CopyStats, copy_image
from imagebuild.release import push_plan as plan
from imagebuild.trust.sign import SIGN_NEEDS
from imagebuild.trust.verify import INDEX_KINDS, Evidence, Verifier, parse_image, signature_tag

AUDIT_LOG = "audit.jsonl"
# What must have passed on a variant's very digest before it is pushed (VariantRecord.refusal): signing,
# and smoke and gate again, so that a report edited after signing cannot slip past them. The report can
# still lie, so the signature is verified in the registry too before anything is copied.
PUSH_NEEDS = (*SIGN_NEEDS, SignStage)
Event = Callable[[str], None]


class PushError(ImagebuildError):
    """The copy or the audit failed for one image; nothing was tagged."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def audit_config(config: TrustConfig) -> TrustConfig:
    """The trust config's keys and requirements for every repository: push checks images it was
    told to move, wherever they are; which repositories a policy covers is admission's business."""
    return replace(config, images=("**",))


@dataclass
class PromoteOutcome:
    """What happened to one image: pushed, unchanged (a rerun), refused or failed."""

    source: str  # as asked
    target: str  # the target repository
    digest: str | None
    action: str  # pushed | unchanged | refused | failed
    decisions: list[plan.TagDecision] = field(default_factory=list)
    stats: CopyStats | None = None
    audit: plan.AuditResult | None = None
    tags_written: list[str] = field(default_factory=list)
    tags_moved: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None

    @property
    def tags(self) -> list[str]:
        """Release tags that name the digest in the target now."""
        if self.action not in ("pushed", "unchanged"):
            return []
        return [d.tag for d in self.decisions]

    @property
    def tags_refused(self) -> list[str]:
        return [d.tag for d in self.decisions if d.action is plan.TagAction.REFUSE]

    def moved(self) -> dict[str, int]:
        s = self.stats or CopyStats()
        return {"bytes_uploaded": s.bytes_uploaded, "blobs_uploaded": s.blobs_uploaded,
                "blobs_present": s.blobs_present, "blobs_mounted": s.blobs_mounted,
                "manifests_put": s.manifests_put}

    def row(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "digest": self.digest, "action": self.action,
                "tags": self.tags, "tags_written": self.tags_written, "tags_moved": self.tags_moved,
                "tags_refused": self.tags_refused,
                **self.moved(), "signature_tags": list(self.stats.signature_tags) if self.stats else [],
                "audit": self.audit.to_dict() if self.audit else None,
                "audited_at": self.audit.audited_at if self.audit else None, "reason": self.reason}


class Promoter:
    """Moves images between registries: verify in the source, copy, audit in the target, tag."""

    def __init__(self, config: TrustConfig, force: plan.Force, audit_log: Path, *,
                 insecure_registries: Iterable[str] = (), copy_options: CopyOptions | None = None,
                 environ: Mapping[str, str] | None = None, on_event: Event = lambda _: None):
        self.config = audit_config(config)
        self.verifier = Verifier(self.config, check_attestations=True, cache_ttl_seconds=0)
        self.force = force
        self.audit_log = audit_log
        self.copy_options = copy_options or CopyOptions(signatures=True)
        self.environ = dict(os.environ if environ is None else environ)
        self.on_event = on_event
        self._registries = Registries(insecure=insecure_registries)

    def close(self) -> None:
        self.verifier.close()
        self._registries.close()

    def __enter__(self) -> Promoter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def registry(self, host: str) -> Registry:
        return self._registries.get(host)

    # --- one image ------------------------------------------------------------------------------

    def promote(self, source: str, target_repository: str, tags: Iterable[str],
                expected_attestations: Iterable[str] = ()) -> PromoteOutcome:
        """Copy SOURCE (tag or digest reference) to TARGET_REPOSITORY (registry/path) and tag it there.

        `expected_attestations`: kinds the caller knows were attested (push: the sign stage's);
        the source must hold them, verified, or nothing moves.
        """
        ref = parse_image(source)
        target_host, target_path = plan.split_repository(target_repository)
        source_registry, target = self.registry(ref.registry), self.registry(target_host)
        outcome = PromoteOutcome(source, target_repository, ref.digest, "refused")

        digest = ref.digest or source_registry.head_manifest(ref.repository, ref.reference)
        if digest is None:
            outcome.action, outcome.reason = "failed", f"{source}: no such image"
            return outcome
        outcome.digest = digest
        source_image = f"{ref.registry}/{ref.repository}@{digest}"

        self.on_event(f"verifying {source_image} in the source")
        # The source's verification, its manifest (the copy needs it) and what the target's tags
        # name now are independent reads: at once.
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="imagebuild-promote") as pool:
            examined = pool.submit(self.verifier.examine, source_image)
            image_manifest = pool.submit(source_registry.find_manifest, ref.repository, digest)
            held = {tag: pool.submit(target.head_manifest, target_path, tag) for tag in dict.fromkeys(tags)}
            verdict, evidence = examined.result()
            if verdict.unreachable:
                raise RegistryUnreachable(verdict.reason, registry=ref.registry, repository=ref.repository,
                                          operation="verify")
            if not verdict.allowed:
                outcome.reason = f"the source does not verify: {verdict.reason}"
                return outcome
            expected = set(expected_attestations)
            if verdict.children:  # an index: the verdict held each child to its own; the index carries these
                expected &= set(INDEX_KINDS)
            unattested = sorted(expected - set(evidence.attestation_kinds))
            if unattested:
                outcome.reason = (f"the source lacks verifying attestations the build report records: "
                                  f"{', '.join(unattested)}")
                return outcome
            current = {reference: future.result() for reference, future in held.items()}
            found = image_manifest.result()

        outcome.decisions = plan.decide_tags(digest, {tag: current[tag] for tag in dict.fromkeys(tags)}, self.force)
        refused = plan.refusals(outcome.decisions, target_repository)
        if refused:
            outcome.reason = "; ".join(refused)
            return outcome

        manifest: tuple[bytes, str] | None = None
        if all(d.action is plan.TagAction.PRESENT for d in outcome.decisions):  # a rerun, most likely
            current.update(self.held(target, target_path, [
                reference for manifest in (digest, *evidence.children)
                for reference in (manifest, *(signature_tag(manifest, s) for s in (".sig", ".att")))]))
        if already_there(digest, outcome.decisions, current, evidence):
            outcome.stats, changed = CopyStats(), False
        else:
            self.on_event(f"copying {digest} to {target_repository}")
            # The signature and attestations go as verified: the bytes just read, not a second read.
            known = {**evidence.manifests, **({digest: found} if found else {})}
            options = replace(self.copy_options, known_manifests=known, known_blobs=evidence.blobs)
            copied = copy_image(source_registry, ref.repository, digest, target, target_path, (), options)
            outcome.stats, manifest, changed = copied.stats, (copied.manifest, copied.media_type), True

        self.on_event(f"auditing {target_repository}@{digest}")
        expected = set(evidence.attestation_kinds) | set(self.config.require.attestations)
        outcome.audit = self.audit(target, target_path, digest, expected, evidence)
        if not outcome.audit.passed:
            outcome.action = "failed"
            outcome.reason = "the audit in the target failed: " + "; ".join(outcome.audit.problems)
            return outcome

        written, moved = self.write_tags(target, target_path, target_repository, source_image, outcome.decisions,
                                         manifest)
        outcome.tags_written, outcome.tags_moved = written, moved
        outcome.action = "pushed" if changed or written else "unchanged"
        return outcome

    @staticmethod
    def held(target: Registry, path: str, references: list[str]) -> dict[str, str | None]:
        """What each reference names in the target now (HEADs at once)."""
        with ThreadPoolExecutor(max_workers=min(16, len(references)), thread_name_prefix="imagebuild-promote") as pool:
            return dict(zip(references, pool.map(lambda reference: target.head_manifest(path, reference), references)))

    def audit(self, target: Registry, target_path: str, digest: str, expected: set[str],
              source: Evidence | None = None) -> plan.AuditResult:
        """The checks in the target, after the copy and before any tag: a verification there, of the
        manifests the target serves now. The blobs verified in the source (`source`) are not
        downloaded again: the target must hold each by digest and size, which is holding those bytes."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="imagebuild-audit") as pool:
            there = pool.submit(target.head_manifest, target_path, digest)
            verdict, evidence = self.verifier.examine(f"{target.registry}/{target_path}@{digest}", source)
            digest_there = there.result()
        if verdict.unreachable:
            raise RegistryUnreachable(verdict.reason, registry=target.registry, repository=target_path,
                                      operation="audit")
        kinds = evidence.attestation_kinds if verdict.allowed else ()
        facts = plan.AuditFacts(digest=digest_there, signature_verified=verdict.allowed,
                                signature_reason=verdict.reason, key=verdict.key, attestations=kinds)
        return plan.judge_audit(digest, expected, facts, _now())

    def write_tags(self, target: Registry, target_path: str, target_repository: str, source_image: str,
                   decisions: list[plan.TagDecision],
                   manifest: tuple[bytes, str] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
        """Write the release tags; each is read again just before, so a tag moved meanwhile is not
        overwritten. `manifest`: the bytes and media type just copied (else they are read from the target)."""
        written: list[str] = []
        moved: list[dict[str, Any]] = []
        pending = [d for d in decisions if d.action is not plan.TagAction.PRESENT]
        if not pending:
            return written, moved
        if manifest is not None and "sha256:" + hashlib.sha256(manifest[0]).hexdigest() == pending[0].wanted:
            raw, media_type = manifest
        else:
            raw, media_type, _ = target.get_manifest(target_path, pending[0].wanted)
        for decision in pending:
            now = target.head_manifest(target_path, decision.tag)
            if now == decision.wanted:
                continue
            if now is not None and not self.force.enabled:
                raise PushError(plan.TagDecision(decision.tag, plan.TagAction.REFUSE, now, decision.wanted)
                                .refusal(target_repository) + " (it was moved while this ran)")
            if now is not None:
                actual = replace(decision, action=plan.TagAction.MOVE, current=now)
                self.log_move(target_repository, actual, source_image)
                moved.append({"tag": decision.tag, "from": now, "to": decision.wanted,
                              "reason": self.force.reason or ""})
            target.put_manifest(target_path, decision.tag, raw, media_type)
            written.append(decision.tag)
        return written, moved

    def log_move(self, repository: str, decision: plan.TagDecision, source_image: str) -> None:
        """Append (and sync) the audit line before the tag moves: a crash after it still leaves the record."""
        entry = plan.audit_entry(action="move-tag", repository=repository, decision=decision,
                                 reason=self.force.reason or "", who=plan.actor(self.environ),
                                 source=source_image, now=_now())
        self.audit_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.audit_log, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def already_there(digest: str, decisions: list[plan.TagDecision], held: Mapping[str, str | None],
                  evidence: Evidence) -> bool:
    """A rerun: every tag names the digest, and the target holds the image (an index: and each child)
    and, as its signature and attestation tags, the very manifests verified in the source (`held`:
    what the target's references name)."""
    if any(d.action is not plan.TagAction.PRESENT for d in decisions):
        return False
    for manifest in (digest, *evidence.children):
        if held.get(manifest) != manifest:
            return False
        for suffix in (".sig", ".att"):
            tag = signature_tag(manifest, suffix)
            verified = evidence.manifests.get(tag)
            if held.get(tag) != (verified[2] if verified else None):
                return False
    return True


# --- push: the build report's variants --------------------------------------------------------------


def push_stage(variant: VariantRecord, outcome: PromoteOutcome | None, *, status: StageStatus,
               reason: str | None = None, harbor: dict[str, Any] | None = None) -> PushStage:
    if outcome is None:
        return PushStage(status=status, digest=variant.digest, source=variant.image, reason=reason)
    stats = outcome.stats or CopyStats()
    return PushStage(
        status=status, digest=outcome.digest or variant.digest, source=variant.image, target=outcome.target,
        tags=outcome.tags, tags_written=outcome.tags_written, tags_moved=outcome.tags_moved,
        tags_refused=outcome.tags_refused,
        bytes_uploaded=stats.bytes_uploaded, blobs_uploaded=stats.blobs_uploaded,
        blobs_reused=stats.blobs_present + stats.blobs_mounted, blobs_mounted=stats.blobs_mounted,
        signature_tags=list(stats.signature_tags), audit=outcome.audit.to_dict() if outcome.audit else None,
        audited_at=outcome.audit.audited_at if outcome.audit else None, harbor=harbor,
        reason=reason if reason is not None else outcome.reason)


def sign_kinds(variant: VariantRecord) -> tuple[str, ...]:
    record = variant.stage(SignStage)
    if record is None:
        return ()
    return tuple(a["type"] for a in record.attestations if a.get("type"))


@dataclass
class PushOutcome:
    variant: str
    action: str  # pushed | unchanged | refused | failed
    record: PushStage
    promote: PromoteOutcome | None

    def row(self) -> dict[str, Any]:
        return {"id": self.variant, "action": self.action, **self.record.to_dict()}


ScanReader = Callable[[str, str], dict[str, Any] | None]  # (target repository, digest) -> Harbor's overview


@dataclass
class PushRun:
    report_path: Path
    to: str  # REGISTRY/PROJECT
    promoter: Promoter
    scan_overview: ScanReader | None = None
    on_event: Event = lambda _: None

    def run(self, variants: list[VariantRecord]) -> list[PushOutcome]:
        outcomes = []
        for variant in variants:
            outcomes.append(self.one(variant))
        return outcomes

    def _record(self, variant: VariantRecord, record: PushStage) -> None:
        variant.stages[PushStage.STAGE] = record
        record_stage(self.report_path, PushStage.STAGE, {variant.id: record})

    def one(self, variant: VariantRecord) -> PushOutcome:
        why = variant.refusal(*PUSH_NEEDS)
        if why:
            record = push_stage(variant, None, status=StageStatus.REFUSED, reason=why)
            self._record(variant, record)
            return PushOutcome(variant.id, "refused", record, None)
        source = ImageRef.parse(variant.image or "")
        target = plan.target_repository(self.to, f"{source.registry}/{source.repository}")
        self.on_event(f"pushing {variant.id} to {target}")
        try:
            outcome = self.promoter.promote(variant.image or "", target, variant.tags,
                                            expected_attestations=sign_kinds(variant))
        except KeyboardInterrupt:
            self._record(variant, push_stage(variant, None, status=StageStatus.INTERRUPTED, reason="interrupted"))
            raise
        except (PushError, RegistryError) as exc:
            record = push_stage(variant, None, status=StageStatus.FAILED, reason=str(exc).splitlines()[0][:500])
            record.target = target
            self._record(variant, record)
            if isinstance(exc, RegistryError) and environmental(exc):
                raise
            return PushOutcome(variant.id, "failed", record, None)
        status = {"pushed": StageStatus.PASSED, "unchanged": StageStatus.PASSED,
                  "refused": StageStatus.REFUSED}.get(outcome.action, StageStatus.FAILED)
        harbor = None
        if self.scan_overview is not None and status is StageStatus.PASSED and outcome.digest:
            harbor = self.scan_overview(target, outcome.digest)
        record = push_stage(variant, outcome, status=status, harbor=harbor)
        self._record(variant, record)
        return PushOutcome(variant.id, outcome.action, record, outcome)


def environmental(exc: RegistryError) -> bool:
    """Unreachable or refusing our credentials: a setup problem (exit 3), not this image's fault."""
    return isinstance(exc, (RegistryUnreachable, RegistryAuthError))
