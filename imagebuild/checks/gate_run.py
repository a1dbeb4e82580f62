"""Running the gate: the effects behind `imagebuild gate` (the rules themselves are gate.py, pure).

Reads the policy and the build report, judges the selected variants' scan results, records
each verdict in the report (`stages["gate"]`), and writes WORKDIR/gate/result.json and
result.sarif. The CLI prints what this returns.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuild.checks import gate as gating
from imagebuild.checks.scan import image_scans
from imagebuild.config.selection import Selection
from imagebuild.core.report import BuildReport, GateStage, ScanStage, StageStatus, VariantRecord, record_stage
from imagebuild.core.source import load_document


@dataclass(frozen=True)
class GateOutcome:
    result: gating.GateResult
    record: dict[str, Any]  # what gate/result.json holds (gate.to_json)
    sarif: dict[str, Any]  # what gate/result.sarif holds
    result_path: Path
    sarif_path: Path

    @property
    def passed(self) -> bool:
        return self.result.passed


def run_gate(workdir: Path, policy_path: Path, selection: Selection, *, strict: bool = False,
             today: dt.date | None = None) -> GateOutcome:
    """Judge, record, write. Bad input (policy, report, --only) raises InputError before anything is written."""
    policy = gating.parse_policy(load_document(policy_path))
    report_path = workdir / "build-report.json"
    report = BuildReport.read(report_path)
    variants = selection.choose(report.variants, str(report_path))
    scans = image_scans(report, report_path, variants)
    try:
        result = gating.evaluate(policy, scans, today or dt.datetime.now(dt.timezone.utc).date(), strict=strict)
    except Exception as exc:  # no earlier verdict may stand for a gate that did not finish
        error = f"the gate stopped on an error: {type(exc).__name__}: {exc}"
        record_stage(report_path, GateStage.STAGE, {
            v.id: GateStage(status=StageStatus.FAILED, digest=v.digest, image=v.image, problems=[error])
            for v in variants})
        raise
    records = {}
    for variant in variants:
        variant.stages[GateStage.STAGE] = records[variant.id] = variant_record(variant, result)
    record_stage(report_path, GateStage.STAGE, records)
    locations, root = sarif_locations(variants)
    sarif = gating.to_sarif(result, tool_version=tool_version(), locations=locations, dockerfiles_root=root)
    record = gating.to_json(result)
    out = workdir / "gate"
    out.mkdir(parents=True, exist_ok=True)
    result_path, sarif_path = out / "result.json", out / "result.sarif"
    result_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    sarif_path.write_text(json.dumps(sarif, indent=2) + "\n", encoding="utf-8")
    return GateOutcome(result, record, sarif, result_path, sarif_path)


def variant_record(variant: VariantRecord, result: gating.GateResult) -> GateStage:
    """A variant's gate record: its image's verdict, or each child's under the index's (passing only if all pass)."""
    verdicts = {(v.variant, v.platform): v for v in result.images}
    if not variant.children:  # one image (an index not built is judged as one, not there)
        return gating.stage_record(verdicts[(variant.id, None)], result)
    return GateStage.of_children(variant.digest, variant.image,
                                 [(c, gating.stage_record(verdicts[(variant.id, c.platform)], result))
                                  for c in variant.children])


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("imagebuild")
    except PackageNotFoundError:
        return "0"


def sarif_locations(variants: list[VariantRecord]) -> tuple[dict[str, str], str]:
    """Each variant's release Dockerfile, relative to here when it can be: code scanning wants repository paths."""
    locations, root = {}, ""
    for v in variants:
        record = v.stage(ScanStage)
        if record is None or not record.dockerfiles:
            continue
        base = Path(record.dockerfiles_root or "")
        try:
            base = base.resolve().relative_to(Path.cwd())
        except ValueError:
            pass
        root = str(base)
        locations[v.id] = f"{base}/{record.dockerfiles[-1]}"
    return locations, root
