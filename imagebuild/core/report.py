"""The build report (WORKDIR/build-report.json): its model, its status words, and the one way to change it.

The build writes the report; every later stage (smoke, scan, gate; sign, push, rollout and
release next) records its result per variant under `variants[i].stages[<stage>]`. Several
processes may do so at once on one workdir (a scan while the tests run, a build still
writing), so every write goes through `update_report`: an exclusive lock on a sidecar file,
the file read again, the change applied, then written to a temp file, fsynced and renamed
over the report. A reader without the lock always sees a whole report, old or new.

Who owns what: the build owns everything but `stages`; each stage owns its own
`stages[<name>]`. A build's full write (`BuildReport.write`) therefore keeps every stage
entry already on disk for the same build run (`run_id`), and `record_stage` changes only
its own entry.

A stage with a typed record registers it here, beside the others, so that every reader
knows it: `BuildReport.read` turns that stage's dict into the record, and `record_stage`
writes the record's `to_dict()`. A stage no class is registered for (one a newer imagebuild
wrote) is kept as the dict it is, and written back unchanged. For a new stage:

    @stage_record("sign")
    @dataclass
    class SignStage(StageRecord):
        status: StageStatus
        digest: str | None = None  # the image signed
        signature: str | None = None
        extra: dict[str, Any] = field(default_factory=dict)  # always last

    record_stage(report_path, "sign", {variant.id: SignStage(status="passed", digest=...)})
    BuildReport.read(report_path).variants[0].stage(SignStage)  # -> SignStage | None

Passed on this digest: the record of a stage that a later one requires (a RequiredStage: smoke,
scan, gate, sign) answers `record.refusal(digest)`, why the image `digest` may not go on past it
(None: it passed on that very image), and says in `MISSING` why a variant without the record may
not. `VariantRecord.refusal(SmokeStage, GateStage)` is the one check sign, push and release make
before they touch a variant: built, then each stage in turn. A stage that passed on another
digest does not count: the image was rebuilt since.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from imagebuild.core.source import InputError

REPORT_SCHEMA = "imagebuild.build-report/v1"


class _Word(str, Enum):
    """A status word: compares equal to, and serialises as, its string (the report's JSON)."""

    def __str__(self) -> str:  # f"{status}" is the word on every Python (3.12 changed the default)
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class LayerStatus(_Word):
    PENDING = "pending"
    TO_BUILD = "to-build"  # not in the cache repository yet
    REUSED = "reused"  # its content key was there already
    BUILDING = "building"
    BUILT = "built"  # built and pushed
    FAILED = "failed"
    SKIPPED = "skipped"  # a parent failed, or the build was interrupted first


class VariantStatus(_Word):
    PENDING = "pending"  # its chain is not complete (or this is a dry run)
    BUILT = "built"  # every layer is in the registry and its tags point at it
    FAILED = "failed"  # a layer of its chain failed or was skipped


class ReportStatus(_Word):
    PENDING = "pending"
    PLANNED = "planned"  # a dry run or `plan --registry`: nothing built
    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class BuilderStatus(_Word):
    UNPROBED = "unprobed"  # no layer was due, so it was never asked
    UP = "up"  # it answered the probe and has not failed since
    DOWN = "down"  # unreachable at the start, or it went away mid-build: nothing more went to it


class StageStatus(_Word):
    """The outcome of one stage for one variant. A new stage adds its words here."""

    OK = "ok"  # scan: the scan ran (what it found is the gate's business)
    PASSED = "passed"  # smoke, gate
    FAILED = "failed"
    ERROR = "error"  # smoke: the suite could not run (timeout, no JUnit, docker error)
    SKIPPED = "skipped"  # scan: the variant was not built
    INTERRUPTED = "interrupted"  # the stage was cancelled while it ran for this variant
    REFUSED = "refused"  # sign: smoke or gate did not pass for this digest, so nothing was done


def _status(kind: type[_Word], value: Any) -> Any:
    return kind(value)  # ValueError for a word this imagebuild does not know


class _StatusField:
    """Assigning a bare string to `status` turns it into the record's status word (or fails)."""

    _status_kind: ClassVar[type[_Word]]

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "status":
            value = _status(self._status_kind, value)
        object.__setattr__(self, name, value)


# --- typed stage records ---------------------------------------------------------------------------


R = TypeVar("R", bound="StageRecord")
STAGE_RECORDS: dict[str, type[StageRecord]] = {}


def stage_record(name: str) -> Callable[[type[R]], type[R]]:
    """Register a dataclass as the typed record of stage `name` (its `stages[name]` entry)."""

    def register(cls: type[R]) -> type[R]:
        cls.STAGE = name
        STAGE_RECORDS[name] = cls
        return cls

    return register


class StageRecord(_StatusField):
    """Base of the typed stage records: dict <-> dataclass, unknown keys kept.

    Subclasses are dataclasses with a `status: StageStatus` field and an `extra` dict last:
    keys a newer imagebuild added are kept there and written back, so a round trip through
    an older imagebuild loses nothing. A status given or assigned as a string becomes its word.
    """

    _status_kind: ClassVar[type[_Word]] = StageStatus
    STAGE: ClassVar[str] = ""
    status: StageStatus
    extra: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}  # type: ignore[arg-type]
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        names = {f.name for f in fields(cls) if f.name != "extra"}  # type: ignore[arg-type]
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, extra=extra)  # type: ignore[call-arg]


def _plain(value: Any) -> Any:
    if isinstance(value, _Word):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


class RequiredStage(StageRecord, ABC):
    """The record of a stage that a later one requires to have passed on the very image it goes on with.

    Smoke, scan, gate and sign: each says why a variant without its record may not go on
    (`MISSING`), and why the image `digest` may not go on past it (`refusal`). Ask through
    `VariantRecord.refusal`, the one check.
    """

    MISSING: ClassVar[str]

    @abstractmethod
    def refusal(self, digest: str | None) -> str | None:
        """Why the image `digest` may not go on past this stage, or None: this record passed on that very image."""


P = TypeVar("P", bound="PerPlatformStage")


class PerPlatformStage(RequiredStage):
    """A stage that judges each child of a multi-platform variant on its own: smoke, scan, gate.

    The variant's record says the stage as a whole (`of_children`): about the index's digest, passing
    only when every child passed on its own digest, else the first child that did not, by platform
    ("linux/arm64: ..."). Each child's own record, of the same class, lies under `per_platform`
    (platform -> its dict), so a later stage can check the very child it goes on with. A
    single-platform variant's record has none and reads as it always did.
    """

    PASSING: ClassVar[StageStatus] = StageStatus.PASSED
    digest: str | None
    per_platform: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not self.per_platform:
            del out["per_platform"]
        return out

    def for_platform(self: P, platform: str) -> P | None:
        """The record of one child, as it was recorded; None when this record has none for `platform`."""
        data = self.per_platform.get(platform)
        return type(self).from_dict(data) if isinstance(data, dict) else None

    def children_refusal(self, digest: str | None, children: Iterable[ChildImage]) -> str | None:
        """Why a multi-platform variant (index `digest`, these children) may not go on past this stage:
        the record is about another index, or a child has no record or did not pass on its own digest."""
        if self.digest != digest or not self.per_platform:  # about another image, or one that never reached the children
            return self.refusal(digest) or f"{self.STAGE}: no per-platform result for this index (run it again)"
        children = list(children)
        if not children:
            return "the build recorded no per-platform images for this index"
        for child in children:
            record = self.for_platform(child.platform)
            why = self.MISSING if record is None else record.refusal(child.digest)
            if why is not None:
                return f"{child.platform}: {why}"
        return None

    @classmethod
    def of_children(cls: type[P], digest: str | None, image: str | None,
                    children: Sequence[tuple[ChildImage, P]]) -> P:
        """The variant's record from each child's own (in platform order): see the class."""
        why = None
        status = cls.PASSING
        for child, record in children:
            refused = record.refusal(child.digest)
            if refused is not None:
                why = f"{child.platform}: {refused}"
                status = record.status if record.status != cls.PASSING else StageStatus.FAILED
                break
        return cls.from_dict({**cls.summed([r for _, r in children]), "status": status, "digest": digest,
                              "image": image, **cls.reason_fields(why),
                              "per_platform": {c.platform: r.to_dict() for c, r in children}})

    @classmethod
    def summed(cls: type[P], records: Sequence[P]) -> dict[str, Any]:
        """What the variant's record says of its children besides status and reason (counts): none by default."""
        return {}

    @classmethod
    @abstractmethod
    def reason_fields(cls, why: str | None) -> dict[str, Any]:
        """The record's fields that say `why` it did not pass (None: it passed)."""


@stage_record("smoke")
@dataclass
class SmokeStage(PerPlatformStage):
    """`imagebuild test`: the smoke suite run inside the image (smoke_run.SmokeRunner.execute makes it)."""

    status: StageStatus  # passed, failed, error
    image: str = ""
    digest: str | None = None  # the image tested; sign/push refuse when the variant's moved since
    reason: str | None = None
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    skip_reasons: list[dict[str, str]] = field(default_factory=list)  # {test, reason}
    failures: list[dict[str, str]] = field(default_factory=list)  # {test, message}
    junit: str | None = None
    log: str | None = None
    exit_code: int | None = None
    duration_s: float | None = None
    pull_s: float | None = None
    gpu_requested: bool = False
    tiers: list[str] = field(default_factory=list)
    suite_digest: str | None = None  # what the run depended on besides the image
    emulated: bool = False  # ran under emulation (qemu-user), with the time limits scaled by `time_factor`
    time_factor: float = 1.0
    per_platform: dict[str, dict[str, Any]] = field(default_factory=dict)  # multi-platform: each child's record
    extra: dict[str, Any] = field(default_factory=dict)

    MISSING: ClassVar[str] = "no smoke test result (run `imagebuild test` first)"
    _COUNTS: ClassVar[tuple[str, ...]] = ("passed", "failed", "errors", "skipped")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not self.emulated and self.time_factor == 1.0:  # a native run's record reads as it always did
            del out["emulated"], out["time_factor"]
        return out

    @classmethod
    def summed(cls, records: Sequence[SmokeStage]) -> dict[str, Any]:
        """The children's counts added up, and the tiers every child ran."""
        tiers = [t for t in (records[0].tiers if records else []) if all(t in r.tiers for r in records)]
        return {**{name: sum(getattr(r, name) for r in records) for name in cls._COUNTS}, "tiers": tiers}

    @classmethod
    def reason_fields(cls, why: str | None) -> dict[str, Any]:
        return {"reason": why}

    def refusal(self, digest: str | None) -> str | None:
        """Passed, with the abi tier, on this very image."""
        if self.status != StageStatus.PASSED:
            return f"smoke tests {self.status}: {self.reason or 'no reason recorded'}"
        if "abi" not in (self.tiers or ()):
            return "the smoke tests that passed did not include the abi tier"
        if not digest or self.digest != digest:
            return (f"smoke tests ran on {self.digest}, but the variant is now {digest} "
                    "(rebuilt since; run `imagebuild test` again)")
        return None


@stage_record("scan")
@dataclass
class ScanStage(PerPlatformStage):
    """`imagebuild scan`: Trivy over the image by digest; the reports lie under WORKDIR/scan/."""

    status: StageStatus  # ok, failed, skipped
    digest: str | None = None
    image: str | None = None
    trivy_version: str | None = None
    db_updated_at: str | None = None
    scanned_at: str | None = None
    error: str | None = None
    duration_s: float | None = None
    reports: dict[str, str] = field(default_factory=dict)  # image, sbom, config, log: relative to WORKDIR
    dockerfiles_root: str | None = None
    dockerfiles: list[str] = field(default_factory=list)  # the chain's Dockerfiles, root first
    counts: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] | None = None  # scan.LayerUse.record()
    per_platform: dict[str, dict[str, Any]] = field(default_factory=dict)  # multi-platform: each child's record
    extra: dict[str, Any] = field(default_factory=dict)

    MISSING: ClassVar[str] = "no scan result (run imagebuild scan)"
    PASSING: ClassVar[StageStatus] = StageStatus.OK

    @classmethod
    def summed(cls, records: Sequence[ScanStage]) -> dict[str, Any]:
        """What every child's scan shares (one Trivy, one DB, one chain of Dockerfiles), and the time taken."""
        first = records[0] if records else None
        return {"trivy_version": first.trivy_version if first else None,
                "db_updated_at": first.db_updated_at if first else None,
                "scanned_at": first.scanned_at if first else None,
                "dockerfiles_root": first.dockerfiles_root if first else None,
                "dockerfiles": list(first.dockerfiles) if first else [],
                "duration_s": round(sum(r.duration_s or 0 for r in records), 1)}

    @classmethod
    def reason_fields(cls, why: str | None) -> dict[str, Any]:
        return {"error": why}

    def refusal(self, digest: str | None) -> str | None:
        """Ran (ok) on this very image; what it found is the gate's business."""
        if self.status != StageStatus.OK:
            return f"scan {self.status}: {self.error or ''}".strip()
        if self.digest != digest:
            return f"the scan was of {self.digest}, the image is now {digest}"
        return None


@stage_record("gate")
@dataclass
class GateStage(PerPlatformStage):
    """`imagebuild gate`: the policy's verdict on the scan (gate.stage_record() makes it)."""

    status: StageStatus  # passed, failed
    digest: str | None = None  # the image judged
    image: str | None = None
    policy: str | None = None
    evaluated_on: str | None = None
    strict: bool = False
    severity: str | None = None
    ignore_unfixed: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    blocking: list[dict[str, Any]] = field(default_factory=list)
    excepted: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    per_platform: dict[str, dict[str, Any]] = field(default_factory=dict)  # multi-platform: each child's record
    extra: dict[str, Any] = field(default_factory=dict)

    MISSING: ClassVar[str] = "no gate result; run `imagebuild scan` and `imagebuild gate` first"

    @classmethod
    def summed(cls, records: Sequence[GateStage]) -> dict[str, Any]:
        """The one policy every child was judged by, and their counts; each child's findings are in its own record."""
        first = records[0] if records else None
        return {"policy": first.policy if first else None, "evaluated_on": first.evaluated_on if first else None,
                "strict": first.strict if first else False, "severity": first.severity if first else None,
                "ignore_unfixed": first.ignore_unfixed if first else False,
                "counts": {k: sum(r.counts.get(k, 0) for r in records) for r in records[:1] for k in r.counts},
                "warnings": list(dict.fromkeys(w for r in records for w in r.warnings))}

    @classmethod
    def reason_fields(cls, why: str | None) -> dict[str, Any]:
        return {"problems": [why] if why else []}

    def refusal(self, digest: str | None) -> str | None:
        """Judged this very image, and passed; else what blocks it (the first five)."""
        if not digest:
            return "not built (no digest)"
        if self.digest != digest:
            return f"the gate judged {self.digest}, but the image is now {digest}; scan and gate it again"
        if self.status != StageStatus.PASSED:
            reasons = [f"{b.get('id')} {b.get('package') or b.get('target') or ''}".strip()
                       for b in self.blocking or []] + list(self.problems or [])
            shown = "; ".join(reasons[:5]) + (f"; and {len(reasons) - 5} more" if len(reasons) > 5 else "")
            return f"the gate did not pass ({shown or self.status})"
        return None


@stage_record("sign")
@dataclass
class SignStage(PerPlatformStage):
    """`imagebuild sign`: the cosign signature and the six attestations, by digest (sign.py)."""

    status: StageStatus  # passed, failed, refused, interrupted
    digest: str | None = None  # the image signed: a rerun skips only while this is still the variant's digest
    image: str | None = None  # repository@digest
    key: str | None = None  # a key file's path or a KMS URI, never key material; None when keyless
    keyless: bool = False
    layout: str | None = None  # "tag": cosign v2's `<repo>:sha256-<hex>.sig` / `.att` tags
    signature: str | None = None  # the signature's tag reference
    signature_reused: bool = False  # the tag already held this key's signature of this digest: cosign sign not run
    attestation_ref: str | None = None  # the attestations' tag reference
    attestations: list[dict[str, str]] = field(default_factory=list)  # [{type, predicate_type}]
    predicates: dict[str, str] = field(default_factory=dict)  # type -> predicate file, relative to WORKDIR
    tlog: bool = False  # uploaded to a transparency log (Rekor)
    cosign_version: str | None = None
    signed_at: str | None = None
    reason: str | None = None  # why refused or failed
    # Multi-platform: each child's own signature and attestations (this record is the index's own).
    per_platform: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    MISSING: ClassVar[str] = "not signed (run `imagebuild sign` first)"

    @classmethod
    def reason_fields(cls, why: str | None) -> dict[str, Any]:
        return {"reason": why}

    def refusal(self, digest: str | None) -> str | None:
        """Signed this very image."""
        if self.status != StageStatus.PASSED:
            return f"signing {self.status}: {self.reason or 'no reason recorded'}"
        if self.digest != digest:
            return f"signed {self.digest}, but the variant is now {digest} (rebuilt since; sign it again)"
        return None


@stage_record("push")
@dataclass
class PushStage(StageRecord):
    """`imagebuild push`: the image copied by digest to its release repository, audited there, then tagged (push.py)."""

    status: StageStatus  # passed, failed, refused, interrupted
    digest: str | None = None  # the image pushed: a rerun is a no-op only while this is still the variant's digest
    source: str | None = None  # repository@digest it was copied from
    target: str | None = None  # the release repository (registry/path)
    tags: list[str] = field(default_factory=list)  # release tags naming `digest` in the target after this run
    tags_written: list[str] = field(default_factory=list)  # written by this run (moved ones included)
    tags_moved: list[dict[str, str]] = field(default_factory=list)  # {tag, from, to, reason}: --force, audit-logged
    tags_refused: list[str] = field(default_factory=list)  # naming another digest there (immutable without --force)
    bytes_uploaded: int = 0  # blob bytes this run sent to the target
    blobs_uploaded: int = 0
    blobs_reused: int = 0  # already in the target, or mounted from another repository of it
    blobs_mounted: int = 0
    signature_tags: list[str] = field(default_factory=list)  # cosign's sha256-<hex>.sig/.att copied with it
    audit: dict[str, Any] | None = None  # push_plan.AuditResult.to_dict(): digest, key, attestations, problems
    audited_at: str | None = None
    harbor: dict[str, Any] | None = None  # Harbor's scan overview of the artifact, with --harbor-url
    reason: str | None = None  # why refused or failed
    extra: dict[str, Any] = field(default_factory=dict)


Stage = StageRecord | dict[str, Any]  # a typed record, or the dict of a stage no class is registered for


def parse_stage(name: str, data: Mapping[str, Any]) -> Stage:
    cls = STAGE_RECORDS.get(name)
    return cls.from_dict(data) if cls is not None else dict(data)


def stage_dict(record: Stage | Mapping[str, Any]) -> dict[str, Any]:
    return record.to_dict() if isinstance(record, StageRecord) else dict(record)


# --- the report ------------------------------------------------------------------------------------


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """The fields this imagebuild knows: a newer one's additions are ignored when reading."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class LayerRecord(_StatusField):
    _status_kind: ClassVar[type[_Word]] = LayerStatus

    key: str
    kind: str
    path: str
    image: str  # cache repository reference with tag
    platform: str = "linux/amd64"  # the platform this layer image is built for
    status: LayerStatus = LayerStatus.PENDING
    digest: str | None = None
    base_digest: str | None = None  # the image it was built FROM
    duration_s: float | None = None
    log: str | None = None
    error: str | None = None
    steps: dict[str, float] | None = None  # seconds per step: build_s, export_s, compress_s, upload_s, push_s
    pushed_by: str | None = None  # "imagebuild (engine storage)", "imagebuild (docker save)" or "docker push"
    blobs: dict[str, int] | None = None  # uploaded, uploaded_bytes, present (already in the registry)
    builder: str | None = None  # with a builders file: the builder (its name) that built it, or tried last
    attempts: int | None = None  # with a builders file: builds started for it (more than 1: a builder went down)

    # Written only when set: a layer that was reused, not pushed, reads as it did before they existed.
    _OPTIONAL: ClassVar[tuple[str, ...]] = ("steps", "pushed_by", "blobs", "builder", "attempts")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)
                if not (f.name in self._OPTIONAL and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerRecord:
        return cls(**_known(cls, data))


@dataclass(frozen=True)
class ChildImage:
    """One platform's image in a multi-platform variant's index: the manifest a node of that platform runs."""

    platform: str
    digest: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChildImage:
        return cls(platform=str(data["platform"]), digest=str(data["digest"]))


@dataclass(frozen=True)
class PlatformImage(Generic[P]):
    """One image of a variant as a per-platform stage sees it: which platform (None: the variant's only
    image), its digest and reference, and that stage's record of it (None: none yet)."""

    platform: str | None
    digest: str
    image: str
    record: P | None = None

    @property
    def label(self) -> str:
        """How messages name it: the platform of a child, else nothing."""
        return f"{self.platform}: " if self.platform else ""


@dataclass
class VariantRecord(_StatusField):
    """One variant as built. The selector axes (id, os, device, cuda, cudnn, python, paddle) are fields."""

    _status_kind: ClassVar[type[_Word]] = VariantStatus

    id: str
    tags: list[str]
    images: list[str]
    chain: list[str]
    device: str
    paddle: str
    python: str
    cuda: str | None
    cudnn: str | None
    status: VariantStatus = VariantStatus.PENDING
    digest: str | None = None
    image: str | None = None  # repository@digest
    stages: dict[str, Stage] = field(default_factory=dict)  # each later stage's record, by stage name
    os: str | None = None  # None in reports written before it was recorded
    platforms: list[str] = field(default_factory=lambda: ["linux/amd64"])
    error: str | None = None  # why it failed: which platform
    # With two or more platforms `digest` names an OCI image index, and these are its children, in
    # `platforms` order; empty for a single-platform variant (its digest is that platform's image).
    children: list[ChildImage] = field(default_factory=list)
    # How the release image's layers were pushed (oci/compression.py's spec): "gzip" (Docker schema 2,
    # what every engine reads; also in reports written before it was recorded), "zstd:<level>" (OCI) or
    # "estargz" (OCI, lazily pullable gzip layers).
    compression: str = "gzip"

    @property
    def multi_platform(self) -> bool:
        return len(self.platforms) > 1

    def child(self, platform: str) -> ChildImage | None:
        return next((c for c in self.children if c.platform == platform), None)

    def child_image(self, child: ChildImage) -> str:
        """`repository@<child digest>`: the child's image in the index's repository."""
        # The index's own reference with the child's digest in place of its digest: no reference parsing
        # here (the oci package's), and the build always records `image` as `repository@digest`.
        index, digest = self.image or "", self.digest or ""
        if not digest or not index.endswith("@" + digest):
            raise ValueError(f"{self.id}: its image {index!r} is not addressed by its digest {digest!r}")
        return index[: len(index) - len(digest)] + child.digest

    def platform_images(self, kind: type[P]) -> list[PlatformImage[P]]:
        """Each image a per-platform stage judges, with its own record of `kind`: the variant's one image
        (platform None), or each child of its index (the child's record under the variant's)."""
        record = self.stage(kind)
        if not self.children:  # single-platform, or an index not built (judged as one image that is not there)
            return [PlatformImage(None, self.digest or "", self.image or "", record)]
        return [PlatformImage(c.platform, c.digest, self.child_image(c),
                              record.for_platform(c.platform) if record is not None else None)
                for c in self.children]

    def stage(self, kind: type[R]) -> R | None:
        """This variant's typed record of one stage, e.g. `variant.stage(ScanStage)`; None when absent."""
        record = self.stages.get(kind.STAGE)
        return record if isinstance(record, kind) else None

    def stage_refusal(self, kind: type[RequiredStage]) -> str | None:
        """Why this variant may not go on past one stage (`<id>: <why>`), or None: it passed on the variant's digest."""
        why = self.stage_problem(kind)
        return f"{self.id}: {why}" if why else None

    def stage_problem(self, kind: type[RequiredStage]) -> str | None:
        """`stage_refusal` without the variant's id: a multi-platform variant's names the child's platform
        first ("linux/arm64: smoke tests failed: ...")."""
        record = self.stage(kind)
        if record is None:
            return kind.MISSING
        if self.multi_platform and isinstance(record, PerPlatformStage):
            return record.children_refusal(self.digest, self.children)  # every child, on its own digest
        return record.refusal(self.digest)

    def refusal(self, *needs: type[RequiredStage]) -> str | None:
        """Why this variant may not go on (`<id>: <why>`), or None: it is built, and each stage of
        `needs` passed on its very digest (asked in order; the first refusal is the answer).

        Sign asks `refusal(SmokeStage, GateStage)` and push adds `SignStage`, so a report edited
        after signing cannot slip past smoke or the gate either.
        """
        if self.status != VariantStatus.BUILT or not self.digest or not self.image:
            return f"{self.id}: not built (status {self.status})"
        return next((why for why in map(self.stage_refusal, needs) if why is not None), None)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out["stages"] = {name: stage_dict(record) for name, record in self.stages.items()}
        out["children"] = [{"platform": c.platform, "digest": c.digest} for c in self.children]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VariantRecord:
        known = _known(cls, data)
        known["stages"] = {name: parse_stage(name, record) for name, record in (data.get("stages") or {}).items()}
        known["children"] = [ChildImage.from_dict(c) for c in data.get("children") or []]
        return cls(**known)


@dataclass
class BuilderRecord(_StatusField):
    """One builder of a builders file as this build found it (build/pool.py): what it serves, whether
    it stayed up, how many layers it built. Paths of its TLS files are not recorded, nor their contents."""

    _status_kind: ClassVar[type[_Word]] = BuilderStatus

    name: str
    kind: str  # "buildkit" (a BuildKit daemon) or "local" (this machine's Docker engine)
    endpoint: str | None  # tcp://host:port or unix:///path; None for the local engine
    platforms: list[str]  # what layers it is sent: the file's list (as the daemon confirmed it), or all it reported
    concurrency: int
    status: BuilderStatus = BuilderStatus.UNPROBED
    error: str | None = None  # why it is down
    version: str | None = None  # the daemon's BuildKit version, from the probe
    built: int = 0  # layers it built and pushed in this run

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BuilderRecord:
        return cls(**_known(cls, data))


def new_run_id() -> str:
    return uuid.uuid4().hex


@dataclass
class BuildReport(_StatusField):
    _status_kind: ClassVar[type[_Word]] = ReportStatus

    matrix: str
    revision: str
    registry: str
    repository: str
    cache_repository: str
    created: str
    variants: list[VariantRecord]
    layers: list[LayerRecord]
    status: ReportStatus = ReportStatus.PENDING
    schema: str = REPORT_SCHEMA
    run_id: str = field(default_factory=new_run_id)  # one build run: its writes merge, a new run replaces
    finished: str | None = None  # when the build's final write happened (provenance's runDetails.metadata)
    matrix_sha256: str | None = None  # "sha256:..." of the matrix file as the build read it
    builders: list[BuilderRecord] = field(default_factory=list)  # with a builders file: each builder; else empty

    def layer(self, key: str) -> LayerRecord:
        return next(rec for rec in self.layers if rec.key == key)

    def child_variant(self, variant: VariantRecord, child: ChildImage) -> VariantRecord:
        """One child of a multi-platform variant's index as a single-platform variant: its digest and image,
        its platform's chain, and each per-platform stage's record of it. What signs and attests a child sees."""
        stages: dict[str, Stage] = {}
        for name, record in variant.stages.items():
            own = record.for_platform(child.platform) if isinstance(record, PerPlatformStage) else None
            if own is not None:
                stages[name] = own
        return replace(variant, digest=child.digest, image=variant.child_image(child), platforms=[child.platform],
                       children=[], stages=stages,
                       chain=[k for k in variant.chain if self.layer(k).platform == child.platform])

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for rec in self.layers:
            counts[rec.status.value] = counts.get(rec.status.value, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        out["variants"] = [v.to_dict() for v in self.variants]
        out["layers"] = [rec.to_dict() for rec in self.layers]
        out["builders"] = [{f.name: _plain(getattr(b, f.name)) for f in fields(b)} for b in self.builders]
        out["summary"] = self.summary()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def write(self, path: Path) -> None:
        """The build's write: everything the build owns, merged with the stages on disk.

        A stage recorded (by another process) since this run last wrote stays: for a variant
        of the same run, every stage entry on disk wins over this object's. A report of
        another run is replaced whole.
        """
        new = self.to_dict()
        with update_report(path, create=True) as data:
            if data.get("run_id") == self.run_id:
                on_disk = {v.get("id"): v.get("stages") or {} for v in data.get("variants", [])}
                for variant in new["variants"]:
                    variant["stages"] = {**variant["stages"], **on_disk.get(variant["id"], {})}
            data.clear()
            data.update(new)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BuildReport:
        known = _known(cls, data)
        known["variants"] = [VariantRecord.from_dict(v) for v in data["variants"]]
        known["layers"] = [LayerRecord.from_dict(rec) for rec in data["layers"]]
        known["builders"] = [BuilderRecord.from_dict(b) for b in data.get("builders") or []]
        if "run_id" not in data:
            known["run_id"] = ""  # written before runs had ids: no later run merges with it
        return cls(**known)

    @classmethod
    def read(cls, path: Path) -> BuildReport:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(str(path), None, "", "build report not found (run imagebuild build first)") from None
        except json.JSONDecodeError as exc:
            raise InputError(str(path), exc.lineno, "", f"not JSON: {exc.msg}") from None
        if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else None
            raise InputError(str(path), None, "schema", f"expected {REPORT_SCHEMA}, got {found!r}")
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(str(path), None, "", f"not a build report this imagebuild can read ({exc})") from None


# --- the one read-modify-write -------------------------------------------------------------------------


@contextlib.contextmanager
def report_lock(report_path: Path) -> Iterator[None]:
    """Exclusive across processes: fcntl on `<report>.lock` (the report itself is replaced, not locked)."""
    with open(report_path.with_name(report_path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def update_report(report_path: Path, *, create: bool = False) -> Iterator[dict[str, Any]]:
    """`with update_report(path) as data:` change `data` (the report as JSON); it is written on exit.

    Under the lock the file is read afresh, so nothing another writer recorded is lost; it is
    written to a temp file in the same folder, fsynced and renamed over the report (keeping its
    permissions), so a reader never sees half a report. An exception inside the block writes
    nothing. With `create` (the build, which writes the whole report), a missing or unreadable
    report starts as {}; new files get 0644 less the umask.
    """
    if create:
        report_path.parent.mkdir(parents=True, exist_ok=True)
    elif not report_path.is_file():  # before the lock: bad input leaves no lock file behind either
        raise InputError(str(report_path), None, "", "build report not found (run imagebuild build first)")
    with report_lock(report_path):
        mode: int | None = None
        try:
            mode = report_path.stat().st_mode & 0o777
            data = json.loads(report_path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except FileNotFoundError:
            if not create:
                raise InputError(str(report_path), None, "",
                                 "build report not found (run imagebuild build first)") from None
            data = {}
        except ValueError as exc:  # JSONDecodeError included
            if not create:
                raise InputError(str(report_path), getattr(exc, "lineno", None), "",
                                 f"not a build report: {getattr(exc, 'msg', exc)}") from None
            data = {}
        yield data
        _replace(report_path, json.dumps(data, indent=2) + "\n", mode)


def _replace(path: Path, text: str, mode: int | None) -> None:
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o644 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash once the folder is synced
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


def record_blocked(report_path: Path, variant_id: str, error: str) -> None:
    """A later stage blocked a variant whose build succeeded (a child of its index failed smoke or the gate):
    it is `failed`, and `error` says which platform and why, so nothing after reads it as releasable."""
    with update_report(report_path) as data:
        for variant in data.get("variants", []):
            if variant.get("id") == variant_id:
                variant["status"], variant["error"] = VariantStatus.FAILED.value, error


def record_stage(report_path: Path, stage: str, by_variant: Mapping[str, Stage | Mapping[str, Any]]) -> None:
    """Put each variant's result for one stage into the report (`stages[stage]`), under the lock.

    Only that stage of those variants changes; whatever the build or another stage wrote in
    the meantime stays. Records may be typed (a registered StageRecord) or plain dicts; a dict
    for a typed stage is checked against its record (ValueError for an unknown status word).
    """
    for record in by_variant.values():
        if isinstance(record, StageRecord) and record.STAGE != stage:
            raise ValueError(f"a {type(record).__name__} is the {record.STAGE} stage's record, not {stage}'s")
        if not isinstance(record, StageRecord):
            parse_stage(stage, record)  # a dict for a typed stage must read back (known status word)
    with update_report(report_path) as data:
        for variant in data.get("variants", []):
            if variant.get("id") in by_variant:
                variant.setdefault("stages", {})[stage] = stage_dict(by_variant[variant["id"]])
