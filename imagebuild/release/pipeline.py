"""`imagebuild release`: plan -> build -> smoke -> scan -> gate -> sign/attest -> push, in one process.

Each stage is the stage's own code (build.Builder, smoke_run, scan.ScanRun, gate_run, sign.SignRun,
push.PushRun), run for the variants still going: a variant stops at its first failing stage and
the others go on. Everything goes into one build report (WORKDIR/build-report.json), as when the
stages run one by one.

A rerun does only what is not done yet. The build reuses every layer the registry has by content
key, so an unchanged variant comes back with the same digest; its earlier stage records (for that
very digest) are carried into the new report, and each stage then reuses its own earlier result:

- smoke: passed on this digest with the same suite (smoke_run compares `suite_digest`);
- scan: ok on this digest with the same Trivy version and vulnerability DB (`db_updated_at`);
- gate: passed on this digest for the same scan, the same policy file (sha256) and the same day
  (exceptions expire by date): recorded as `inputs` in the gate record;
- sign: still signed in the registry for this digest with this key (sign.SignRun.already_signed);
- push: the target already holds the digest, audited and tagged (push.Promoter: "unchanged").

The summary says per variant and stage whether the work was done now or reused.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from imagebuild.build import scheduler as building
from imagebuild.build.plan import Plan
from imagebuild.build.pool import layer_builder_for
from imagebuild.build.scheduler import Event as LayerEvent
from imagebuild.build.scheduler import SecretLane
from imagebuild.checks import scan as scanning
from imagebuild.checks import smoke_run
from imagebuild.checks.gate_run import run_gate
from imagebuild.checks.smoke import SmokeResult
from imagebuild.config.builders import BuildersConfig
from imagebuild.config.matrix import Matrix
from imagebuild.config.selection import Selection
from imagebuild.config.trust import TrustConfig
from imagebuild.core.report import (
    BuildReport,
    GateStage,
    LayerStatus,
    ScanStage,
    SmokeStage,
    StageStatus,
    VariantRecord,
    VariantStatus,
    record_blocked,
    record_stage,
)
from imagebuild.release import push as pushing
from imagebuild.release import push_plan
from imagebuild.trust import sign as signing

STAGES = ("build", "smoke", "scan", "gate", "sign", "push")
SUMMARY_SCHEMA = "imagebuild.release-summary/v1"
REPORT_NAME = "build-report.json"


class Outcome(str, Enum):
    DONE = "done"  # the stage did its work in this run
    REUSED = "reused"  # an earlier result for the same digest and inputs stands; no work was done
    FAILED = "failed"
    NOT_REACHED = "not reached"  # an earlier stage of this variant failed
    OFF = "off"  # not asked for (push without --push-to)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Cell:
    """One stage of one variant: what happened, in a word or two, and why when it failed."""

    outcome: Outcome
    word: str  # the table's text: "built 1 of 5 layers", "reused", "already signed", "blocked"
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"outcome": self.outcome.value, "result": self.word, "detail": self.detail}


@dataclass
class VariantRelease:
    id: str
    image: str | None = None  # repository@digest once built
    digest: str | None = None
    tags: list[str] = field(default_factory=list)
    stages: dict[str, Cell] = field(default_factory=dict)
    platforms: list[str] = field(default_factory=list)  # two or more: `digest` is an index, each child judged

    @property
    def failed_stage(self) -> str | None:
        return next((name for name in STAGES if name in self.stages
                     and self.stages[name].outcome is Outcome.FAILED), None)

    @property
    def status(self) -> str:
        return "failed" if self.failed_stage else "released"

    @property
    def all_reused(self) -> bool:
        return all(self.stages[name].outcome in (Outcome.REUSED, Outcome.OFF) for name in STAGES)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "status": self.status, "failed_stage": self.failed_stage, "image": self.image,
                "digest": self.digest, "tags": self.tags,
                "stages": {name: self.stages[name].to_dict() for name in STAGES if name in self.stages}}


@dataclass(frozen=True)
class ReleaseOptions:
    workdir: Path
    jobs: int = 2
    dockerfiles: Path | None = None  # default: dockerfiles/ beside the matrix
    layer_timeout_s: int = 3600
    secret_overrides: tuple[str, ...] = ()
    secret_lane: SecretLane | None = None  # what the matrix's secrets may name (the operator's flags)
    smoke_tier: str = "all"
    smoke_timeout_s: int = 900
    policy: Path = Path("policies/vulnerabilities.yaml")
    push_to: str | None = None  # REGISTRY/PROJECT; None: no push stage
    builders: BuildersConfig | None = None  # --builders: the pool the layers are built on; None: the local engine


Event = Callable[[str], None]


@dataclass
class ReleaseRun:
    """The six stages over the selected variants. The caller checks input first and hands the parts in."""

    options: ReleaseOptions
    scan_options: scanning.ScanOptions
    sign_options: signing.SignOptions
    trust: TrustConfig | None = None  # for push; None without --push-to
    on_layer: LayerEvent = lambda _event, _layer: None  # the build's per-layer progress (the CLI shows it)
    on_event: Event = lambda _: None
    results: dict[str, VariantRelease] = field(default_factory=dict)
    duration_s: float | None = None
    work: dict[str, int] = field(default_factory=lambda: {"layers_built": 0, "smoke_runs": 0, "scans": 0,
                                                          "gate_runs": 0, "signed": 0, "pushed": 0})

    @property
    def report_path(self) -> Path:
        return self.options.workdir / REPORT_NAME

    # --- the whole run --------------------------------------------------------------------------

    def run(self, matrix: Matrix, selection: Selection, revision: str, created: str, matrix_sha256: str) -> list[VariantRelease]:
        started = time.monotonic()
        self.build(matrix, selection, revision, created, matrix_sha256)
        self.after_build(started)
        return list(self.results.values())

    def after_build(self, started: float) -> None:
        """Every stage after the build, for the variants it built, in order (the webhook image's run too)."""
        going = self._going()
        for name, stage in (("smoke", self.smoke), ("scan", self.scan), ("gate", self.gate), ("sign", self.sign),
                            ("push", self.push)):
            stage(going)
            for vid in going:  # a stage that gave no result for a variant (cut short) did not pass it
                if name not in self.results[vid].stages:
                    self._set(vid, name, Cell(Outcome.FAILED, "no result", f"{name} gave no result for it"))
            going = self._going()
        self.duration_s = round(time.monotonic() - started, 1)

    def _going(self) -> list[str]:
        return [v.id for v in self.results.values() if v.failed_stage is None]

    def _variants(self, ids: list[str]) -> list[VariantRecord]:
        """Fresh from the report (each stage reads what the earlier ones recorded), in report order."""
        wanted = set(ids)
        return [v for v in BuildReport.read(self.report_path).variants if v.id in wanted]

    def _set(self, variant_id: str, stage: str, cell: Cell) -> None:
        self.results[variant_id].stages[stage] = cell
        later = STAGES[STAGES.index(stage) + 1:]
        if cell.outcome is Outcome.FAILED:
            for name in later:
                self.results[variant_id].stages[name] = Cell(Outcome.NOT_REACHED, "-")

    # --- build --------------------------------------------------------------------------------

    def build(self, matrix: Matrix, selection: Selection, revision: str, created: str, matrix_sha256: str) -> None:
        the_plan = building.prepare(matrix, revision, created)
        variants = selection.choose(the_plan.variants, str(matrix.file))
        report = building.registry_plan(the_plan, variants)
        report.revision = revision
        report.matrix_sha256 = matrix_sha256
        dockerfiles = self.options.dockerfiles or Path(matrix.file).parent / "dockerfiles"
        secrets = building.secret_files(matrix, building.parse_secret_overrides(self.options.secret_overrides),
                                        lane=self.options.secret_lane)
        options = building.BuildOptions(jobs=self.options.jobs, dry_run=False, dockerfiles=dockerfiles,
                                        workdir=self.options.workdir, secrets=secrets.paths,
                                        secret_values=secrets.values, layer_timeout_s=self.options.layer_timeout_s)
        try:
            self.build_layers(the_plan, report, options)
        finally:
            secrets.close()

    def build_layers(self, the_plan: Plan, report: BuildReport, options: building.BuildOptions) -> None:
        """Build what the registry lacks (report: as registry_plan made it), then keep each earlier
        stage record about a digest that did not change."""
        earlier = earlier_stages(self.report_path)
        to_build = sum(rec.status == LayerStatus.TO_BUILD for rec in report.layers)
        self.on_event(f"build: {to_build} of {len(report.layers)} layers to build, the rest are in the registry")
        pool = layer_builder_for(self.options.builders, report, options)
        report = building.Builder(the_plan, report, options, self.on_layer, layer_builder=pool).run()
        carried = carry_forward(self.report_path, report, earlier)
        if carried:
            self.on_event(f"build: earlier results kept for the unchanged digests: {carried}")
        layers = {rec.key: rec for rec in report.layers}
        self.work["layers_built"] = sum(rec.status == LayerStatus.BUILT for rec in report.layers)
        for v in report.variants:
            result = self.results[v.id] = VariantRelease(v.id, v.image, v.digest, list(v.images),
                                                         platforms=list(v.platforms))
            chain = [layers[key] for key in v.chain if key in layers]
            built = sum(rec.status == LayerStatus.BUILT for rec in chain)
            if v.status == VariantStatus.BUILT:
                cell = (Cell(Outcome.DONE, f"built {built} of {len(chain)} layers") if built
                        else Cell(Outcome.REUSED, f"reused ({len(chain)} layers)"))
            else:
                broken = next((rec for rec in chain if rec.status in (LayerStatus.FAILED, LayerStatus.SKIPPED)), None)
                why = (f"{broken.path}: {first_line(broken.error) or broken.status}" if broken
                       else f"variant {v.status}")
                cell = Cell(Outcome.FAILED, "failed", why)
            self._set(result.id, "build", cell)

    # --- smoke --------------------------------------------------------------------------------

    def smoke(self, ids: list[str]) -> list[str]:
        if not ids:
            return ids
        import os


        out = self.options.workdir / "smoke"
        cpus = min(4.0, float(os.cpu_count() or 1))
        run_options = smoke_run.RunOptions(timeout_s=self.options.smoke_timeout_s, cpus=cpus,
                                           tier=self.options.smoke_tier)

        def make_runner() -> smoke_run.SmokeRunner:
            return smoke_run.SmokeRunner(smoke_run.docker_client(), run_options, out,
                                         smoke_run.ensure_harness(out / ".harness"))

        self.on_event(f"smoke: {len(ids)} image(s), tier {self.options.smoke_tier}")
        results = smoke_run.run_report(self.report_path, None, Selection.parse([f"id={','.join(ids)}"]),
                                       make_runner, self.smoke_progress)
        self.smoke_results(results)
        self.block_failed_indexes(ids, SmokeStage)
        return self._going()

    def block_failed_indexes(self, ids: list[str], kind: type[SmokeStage] | type[GateStage]) -> None:
        """A multi-platform variant one of whose children failed `kind` is blocked whole: the report says it
        failed, naming the platform (nothing signs, pushes or rolls out a failed variant)."""
        for v in self._variants(ids):
            cell = self.results[v.id].stages.get(kind.STAGE)
            problem = v.stage_problem(kind)
            if v.multi_platform and cell is not None and cell.outcome is Outcome.FAILED and problem:
                record_blocked(self.report_path, v.id, problem)

    def smoke_progress(self, r: SmokeResult) -> None:
        self.on_event(f"  smoke {r.record.status} {r.name}" + (" (reused)" if r.reused else ""))

    def smoke_results(self, results: list[SmokeResult]) -> None:
        for r in results:
            s = r.record
            counts = f"{s.passed} passed, {s.skipped} skipped"
            if s.status == StageStatus.PASSED:
                cell = Cell(Outcome.REUSED, "already passed", counts) if r.reused else Cell(Outcome.DONE, "passed", counts)
                self.work["smoke_runs"] += not r.reused
            else:
                self.work["smoke_runs"] += 1
                failures = "; ".join(f["test"] for f in s.failures[:3])
                # An index's record names the child that failed first; its tests are in the child's record.
                detail = first_line(s.reason) if s.per_platform else failures or first_line(s.reason)
                cell = Cell(Outcome.FAILED, s.status.value, detail or s.status.value)
            self._set(r.variant or r.name, "smoke", cell)

    # --- scan ---------------------------------------------------------------------------------

    def scan(self, ids: list[str]) -> list[str]:
        if not ids:
            return ids

        trivy = scanning.Trivy.find()
        options = self.scan_options
        variants = self._variants(ids)
        fresh = variants
        if any(earlier_scan_of(v) for v in variants):
            # Which DB would scan now decides whether an earlier scan stands (ScanRun asks again
            # for the ones it scans: offline that is a file read, online Trivy's own freshness check).
            db = scanning.prepare_db(trivy, options)
            fresh = [v for v in variants if not scan_reusable(v, self.options.workdir, trivy.version, db.updated_at)]
        for v in variants:
            if v not in fresh:
                self._set(v.id, "scan", Cell(Outcome.REUSED, "already scanned", scan_counts(v)))
        if fresh:
            self.on_event(f"scan: {len(fresh)} image(s) with Trivy {trivy.version}")
            report = BuildReport.read(self.report_path)
            scanned = [v for v in report.variants if v.id in {f.id for f in fresh}]
            scanning.ScanRun(report, self.report_path, options, trivy).run(scanned)  # records each in `scanned`
            for v in scanned:
                record = v.stage(ScanStage)
                if record is None:
                    continue  # no result: the run loop says so
                self.work["scans"] += 1
                why = v.stage_refusal(ScanStage)
                if why is None:
                    self._set(v.id, "scan", Cell(Outcome.DONE, "scanned", scan_counts(v)))
                else:
                    self._set(v.id, "scan", Cell(Outcome.FAILED, record.status.value, first_line(record.error or why)))
        return self._going()

    # --- gate ---------------------------------------------------------------------------------

    def gate(self, ids: list[str]) -> list[str]:
        if not ids:
            return ids

        policy = self.options.policy
        policy_sha256 = "sha256:" + hashlib.sha256(policy.read_bytes()).hexdigest()
        today = dt.datetime.now(dt.timezone.utc).date()
        variants = self._variants(ids)
        inputs = {v.id: gate_inputs(v, policy_sha256, today) for v in variants}
        fresh = []
        for v in variants:
            earlier = v.stage(GateStage)
            if earlier is not None and v.stage_refusal(GateStage) is None and earlier.extra.get("inputs") == inputs[v.id]:
                self._set(v.id, "gate", Cell(Outcome.REUSED, "already passed", f"policy {policy}"))
            else:
                fresh.append(v.id)
        if fresh:
            self.on_event(f"gate: {len(fresh)} image(s) against {policy}")
            outcome = run_gate(self.options.workdir, policy, Selection.parse([f"id={','.join(fresh)}"]), today=today)
            self.work["gate_runs"] += len(fresh)
            records = {}
            judged = self._variants(fresh)
            for v in judged:
                record = v.stage(GateStage)
                if record is not None:
                    record.extra["inputs"] = inputs[v.id]  # what decided it: a rerun with the same reuses it
                    records[v.id] = record
            record_stage(self.report_path, "gate", records)
            verdicts = {(image.variant, image.platform): image for image in outcome.result.images}
            for v in judged:
                failed = [image for image in (verdicts.get((v.id, p)) for p in gated_platforms(v))
                          if image is not None and not image.passed]
                if not failed:
                    self._set(v.id, "gate", Cell(Outcome.DONE, "passed", f"policy {policy}"))
                    continue
                image = failed[0]  # the first platform that did not pass names the variant's failure
                blocking = [d.finding.id for d in image.blocking][:5]
                why = ", ".join(blocking) or "; ".join(image.problems)[:300]
                self._set(v.id, "gate", Cell(Outcome.FAILED, "blocked", f"{image.platform}: {why}" if image.platform else why))
            self.block_failed_indexes(fresh, GateStage)
        return self._going()

    # --- sign ---------------------------------------------------------------------------------

    def sign(self, ids: list[str]) -> list[str]:
        if not ids:
            return ids

        cosign = signing.Cosign.find()
        self.on_event(f"sign: {len(ids)} image(s) with cosign {cosign.version}")
        # The OpenVEX documents come from the policy the gate stage judged by.
        outcomes = signing.SignRun(self.report_path, self.sign_options, cosign,
                                   policy=self.options.policy).run(self._variants(ids))
        for o in outcomes:
            if o.action == "signed":
                self.work["signed"] += 1
                reused = "; signature already there, reused" if o.record.signature_reused else ""
                cell = Cell(Outcome.DONE, "signed", f"{len(o.record.attestations)} attestations{reused}")
            elif o.action == "skipped":
                cell = Cell(Outcome.REUSED, "already signed", f"{len(o.record.attestations)} attestations")
            else:
                cell = Cell(Outcome.FAILED, o.action, first_line(o.record.reason))
            self._set(o.variant, "sign", cell)
        return self._going()

    # --- push ---------------------------------------------------------------------------------

    def push(self, ids: list[str]) -> list[str]:
        if self.options.push_to is None:
            for v in self.results.values():
                if "push" not in v.stages:
                    v.stages["push"] = Cell(Outcome.OFF, "not asked", "no --push-to")
            return ids
        if not ids:
            return ids

        to = self.options.push_to
        if self.trust is None:
            raise ValueError("the push stage needs the trust configuration (ReleaseRun.trust)")
        self.on_event(f"push: {len(ids)} image(s) to {to}")
        with pushing.Promoter(self.trust, push_plan.Force.parse(False, None),
                              self.options.workdir / pushing.AUDIT_LOG, on_event=self.on_event) as promoter:
            outcomes = pushing.PushRun(self.report_path, to, promoter, on_event=self.on_event).run(self._variants(ids))
        for o in outcomes:
            target = o.record.target or to
            if o.action == "pushed":
                self.work["pushed"] += 1
                cell = Cell(Outcome.DONE, "pushed", f"{target}: {', '.join(o.record.tags)}")
            elif o.action == "unchanged":
                cell = Cell(Outcome.REUSED, "already pushed", f"{target}: {', '.join(o.record.tags)}")
            else:
                cell = Cell(Outcome.FAILED, o.action, first_line(o.record.reason))
            self._set(o.variant, "push", cell)
        return self._going()

    # --- the summary --------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        variants = list(self.results.values())
        return {
            "schema": SUMMARY_SCHEMA,
            "report": str(self.report_path),
            "status": "released" if variants and all(v.status == "released" for v in variants) else "failed",
            "nothing_new": bool(variants) and all(v.all_reused for v in variants),
            "duration_s": self.duration_s,
            "work": dict(self.work),
            "variants": [v.to_dict() for v in variants],
        }


# --- carrying earlier results over a rebuild of the report ---------------------------------------


def earlier_stages(report_path: Path) -> dict[str, tuple[str | None, dict[str, Any]]]:
    """variant id -> (digest, stage records) of the report a previous run left; {} when none is readable."""
    try:
        data = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    found = {}
    for v in data.get("variants") or []:
        if isinstance(v, dict) and isinstance(v.get("id"), str) and isinstance(v.get("stages"), dict):
            found[v["id"]] = (v.get("digest"), v["stages"])
    return found


def carry_forward(report_path: Path, report: BuildReport,
                  earlier: dict[str, tuple[str | None, dict[str, Any]]]) -> int:
    """Put back each earlier stage record that was about the very digest the variant has now.

    The build starts a new report each run (a new run id drops the stages); a record about
    another digest stays dropped, so every stage of a rebuilt variant runs again.
    Returns how many records were carried.
    """
    by_stage: dict[str, dict[str, dict[str, Any]]] = {}
    for v in report.variants:
        digest, stages = earlier.get(v.id, (None, {}))
        if not v.digest or digest != v.digest:
            continue
        for name, record in stages.items():
            if isinstance(record, dict) and record.get("digest") == v.digest and name not in v.stages:
                by_stage.setdefault(name, {})[v.id] = record
    for name, records in by_stage.items():
        record_stage(report_path, name, records)
    return sum(len(records) for records in by_stage.values())


def earlier_scan_of(variant: VariantRecord) -> bool:
    return variant.stage_refusal(ScanStage) is None


def scan_reusable(variant: VariantRecord, workdir: Path, trivy_version: str, db_updated_at: str | None) -> bool:
    """Scanned ok on this digest (each child of an index on its own) by the same Trivy with the same DB, and
    its reports are still there."""
    if variant.stage_refusal(ScanStage) is not None or db_updated_at is None:
        return False
    for each in variant.platform_images(ScanStage):
        record = each.record
        if record is None or record.trivy_version != trivy_version or record.db_updated_at != db_updated_at:
            return False
        files = [record.reports.get(name) for name in ("image", "sbom", "config")]
        if not all(f and (workdir / f).is_file() for f in files):
            return False
    return (workdir / "scan" / "summary.json").is_file()


def gate_inputs(variant: VariantRecord, policy_sha256: str, today: dt.date) -> dict[str, Any]:
    """What decides a gate verdict: the scan it judged, the policy's bytes, and the day (exceptions expire)."""
    scan = variant.stage(ScanStage)
    return {"digest": variant.digest, "scan": {"scanned_at": scan.scanned_at if scan else None,
                                               "db_updated_at": scan.db_updated_at if scan else None},
            "policy_sha256": policy_sha256, "date": today.isoformat(), "strict": False}


def gated_platforms(variant: VariantRecord) -> list[str | None]:
    """The platforms the gate judges one image of: each child's, or None for a variant's only image."""
    return [each.platform for each in variant.platform_images(GateStage)]


def scan_counts(variant: VariantRecord) -> str:
    """C0 H1 M2 L3 of the variant's image; of each child, by platform, for an index."""
    def one(record: ScanStage | None) -> str:
        vulns = ((record.counts if record else {}) or {}).get("vulnerabilities") or {}
        return " ".join(f"{s[0]}{vulns.get(s, 0)}" for s in ("CRITICAL", "HIGH", "MEDIUM", "LOW"))

    return "; ".join(each.label + one(each.record) for each in variant.platform_images(ScanStage))


def first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:300] if lines else ""


def with_registry(matrix: Matrix, registry: str | None) -> Matrix:
    """The matrix with its staging registry replaced (CI passes its own); the Dockerfiles do not name it."""
    return replace(matrix, registry=registry) if registry else matrix
