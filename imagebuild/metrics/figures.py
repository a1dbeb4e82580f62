"""What each pipeline run tells Prometheus, as metric families made from the run's own record (pure).

The inputs are the records the commands already write (the build report, a rollout record, the rescan
results, gc's report), read as plain dicts: a record written by an older imagebuild, or a field that is
missing, gives fewer samples, never an error. Label values come from the release file and the records
(variants, regions, channels, waves, digests), all bounded by the release; never an error message.

monitoring/prometheus/imagebuild-alerts.yaml and monitoring/grafana/imagebuild.json are written against
the names below; tests/test_monitoring.py checks that every name they use is one made here.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PREFIX = "imagebuild_"

ROLLOUT_STATUSES = ("running", "halted", "aborted", "completed", "rolling-back", "rolled-back")
WAVE_STATES = ("pending", "copying", "prepulling", "moving", "gating", "passed", "failed")
RESCAN_STATUSES = ("passed", "quarantined", "still-quarantined", "failed")
SEVERITIES = ("CRITICAL", "HIGH", "MEDIUM", "LOW", "UNKNOWN")
MOVE_STEP = "move-tag"  # rollout.plan.StepKind.MOVE as records spell it (tests/test_metrics_units.py holds the two equal)


@dataclass(frozen=True)
class Sample:
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass
class Family:
    """One gauge: its name (without the prefix), help and samples. (Every figure of a run is a gauge: the run
    states what is, a Pushgateway keeps the last push, and counters would restart with every run.)"""

    name: str
    help: str
    samples: list[Sample] = field(default_factory=list)

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    def add(self, value: float, **labels: str) -> Family:
        self.samples.append(Sample(tuple(sorted(labels.items())), float(value)))
        return self


@dataclass(frozen=True)
class Run:
    """One command's run: which command, how it ended and when."""

    command: str  # release, rollout, rescan, gc
    exit_code: int
    started_at: float  # seconds since the epoch
    finished_at: float


def run_figures(run: Run) -> list[Family]:
    labels = {"command": run.command}
    return [
        Family("run_duration_seconds", "How long the command ran.").add(run.finished_at - run.started_at, **labels),
        Family("run_timestamp_seconds", "When the command finished.").add(run.finished_at, **labels),
        Family("run_exit_code", "The command's exit code (0 success, 1 failed, 2 bad input, 3 a service "
                                "missing, 4 a lease held).").add(run.exit_code, **labels),
        Family("run_success", "1 when the command succeeded.").add(1 if run.exit_code == 0 else 0, **labels),
    ]


def _when(value: Any) -> float | None:
    """An ISO 8601 time of a record as seconds since the epoch; None when it is not one (old or odd records)."""
    if not isinstance(value, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def _text(value: Any, limit: int = 200) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# --- release: the build report --------------------------------------------------------------------------------


def release_figures(report: Mapping[str, Any], summary: Mapping[str, Any] | None = None,
                    sizes: Mapping[str, Mapping[str, int]] | None = None) -> list[Family]:
    """Per variant: released or not (the release run's summary), seconds per stage, layers of its chain by
    what the run did with them, image bytes per platform (`sizes`: variant -> platform -> bytes, read from
    the registry by metrics.sizes), findings by kind and severity, the gate's verdict counts."""
    released = Family("variant_released", "1 when the variant passed every stage of its last release run.")
    for variant in _dicts((summary or {}).get("variants")):
        if vid := _text(variant.get("id")):
            released.add(1 if variant.get("status") == "released" else 0, variant=vid)
    seconds = Family("stage_duration_seconds", "Seconds a stage took for a variant in the last run "
                                               "(build: the layers of its chain built in that run, added up).")
    layers = Family("variant_layers", "Layers of the variant's chain, by what the last build did with them.")
    size = Family("image_size_bytes", "Compressed bytes of the variant's image (its layers and config), "
                                      "per platform, as pushed.")
    findings = Family("image_findings", "What the scan found in the variant's image, by kind (vulnerability, "
                                        "misconfiguration, secret) and severity; excepted ones included.")
    judged = Family("image_gate_findings", "The variant's findings by the gate's verdict (blocked, excepted, "
                                           "ignored-unfixed, below-threshold).")
    by_key = {layer.get("key"): layer for layer in _dicts(report.get("layers"))}
    for variant in _dicts(report.get("variants")):
        vid = _text(variant.get("id"))
        if not vid:
            continue
        chain = [by_key[key] for key in variant.get("chain") or () if isinstance(key, str) and key in by_key]
        seconds.add(sum(_number(layer.get("duration_s")) or 0.0 for layer in chain
                        if layer.get("status") == "built"), variant=vid, stage="build")
        counts: dict[str, int] = {}
        for layer in chain:
            word = _text(layer.get("status"), 40) or "unknown"
            counts[word] = counts.get(word, 0) + 1
        for word, count in sorted(counts.items()):
            layers.add(count, variant=vid, status=word)
        stages = _mapping(variant.get("stages"))
        for name in ("smoke", "scan"):
            stage = stages.get(name)
            if isinstance(stage, Mapping) and (value := _number(stage.get("duration_s"))) is not None:
                seconds.add(value, variant=vid, stage=name)
        for platform, nbytes in sorted((sizes or {}).get(vid, {}).items()):
            size.add(nbytes, variant=vid, platform=platform)
        scan = stages.get("scan")
        scan_counts = _mapping(_mapping(scan).get("counts"))
        for kind in ("vulnerabilities", "misconfigurations"):
            for severity, value in sorted(_mapping(scan_counts.get(kind)).items()):
                if severity in SEVERITIES and (number := _number(value)) is not None:
                    findings.add(number, variant=vid, kind=_KINDS[kind],
                                 severity=severity)
        if (secrets := _number(scan_counts.get("secrets"))) is not None:
            findings.add(secrets, variant=vid, kind="secret", severity="CRITICAL")
        gate = _mapping(stages.get("gate"))
        for verdict, value in sorted(_mapping(gate.get("counts")).items()):
            if isinstance(verdict, str) and (number := _number(value)) is not None:
                judged.add(number, variant=vid, verdict=verdict[:40])
    return [released, seconds, layers, size, findings, judged]


_KINDS = {"vulnerabilities": "vulnerability", "misconfigurations": "misconfiguration"}


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [item for item in value if isinstance(item, Mapping)] if isinstance(value, list) else []


# --- rollout: one record, per channel -------------------------------------------------------------------------


def rollout_figures(record: Mapping[str, Any], channel: str, wave_order: Sequence[str]) -> list[Family]:
    """The channel's latest rollout as one record tells it: its status, each wave's state, each region's tag
    (moved to the rollout's digest or not), and when the first wave (the canary) moved."""
    labels = {"channel": channel}
    rollout_id = _text(record.get("id"), 100)
    status_now = _text(record.get("status"), 40)
    status = Family("rollout_status", "1 for the status of the channel's latest rollout, 0 for the others.")
    for word in ROLLOUT_STATUSES:
        status.add(1 if word == status_now else 0, status=word, **labels)
    info = Family("rollout_info", "The channel's latest rollout: its ID and the digest it rolls out.").add(
        1, rollout=rollout_id, digest=_text(record.get("digest"), 80), **labels)
    waves = Family("rollout_wave_state", "1 for each wave's state in the channel's latest rollout.")
    for name, wave in sorted(_mapping(record.get("waves")).items()):
        if not isinstance(wave, Mapping):
            continue
        state = _text(wave.get("state"), 40)
        for word in WAVE_STATES:
            waves.add(1 if word == state else 0, wave=str(name)[:100], state=word, **labels)
    moved = Family("rollout_region_moved", "1 when the region's channel tag was moved to the rollout's digest.")
    moved_at = Family("rollout_region_moved_timestamp_seconds", "When the region's channel tag was moved.")
    steps = _dicts(record.get("steps"))
    regions: dict[str, tuple[str, float | None]] = {}
    for step in steps:
        region, wave = _text(step.get("region"), 100), _text(step.get("wave"), 100)
        if not region or step.get("kind") != MOVE_STEP or step.get("tag") != channel:
            continue
        done = step.get("state") == "done"
        regions[region] = (wave, _when(step.get("done_at")) if done else None)
    rolled_back = status_now in ("rolling-back", "rolled-back")
    for region, (wave, when) in sorted(regions.items()):
        moved.add(1 if when is not None and not rolled_back else 0, region=region, wave=wave, **labels)
        if when is not None:
            moved_at.add(when, region=region, wave=wave, **labels)
    families = [status, info, waves, moved, moved_at]
    canary = wave_order[0] if wave_order else None
    canary_times = [when for wave, when in regions.values() if wave == canary and when is not None]
    if canary_times:
        families.append(Family("rollout_canary_moved_timestamp_seconds",
                               "When the first wave (the canary) moved the channel's tag.").add(min(canary_times),
                                                                                                **labels))
    if (started := _when(record.get("created_at"))) is not None:
        families.append(Family("rollout_started_timestamp_seconds", "When the channel's latest rollout started.")
                        .add(started, **labels))
    done_steps = sum(step.get("state") == "done" for step in steps)
    families.append(Family("rollout_steps_done", "Steps of the rollout done so far.").add(done_steps, **labels))
    families.append(Family("rollout_steps", "Steps of the rollout in all.").add(len(steps), **labels))
    return families


# --- rescan ---------------------------------------------------------------------------------------------------


def rescan_figures(results: Sequence[Mapping[str, Any]], unreachable: Mapping[str, str]) -> list[Family]:
    """The images behind the channel tags, by what today's scan made of them; blocking findings by severity."""
    images = Family("rescan_images", "Images behind the channel tags, by the last rescan's status.")
    counts = dict.fromkeys(RESCAN_STATUSES, 0)
    blocking = Family("rescan_blocking_findings", "Findings that now block an image behind a channel tag.")
    quarantined = 0
    for result in results:
        word = _text(result.get("status"), 40)
        counts[word] = counts.get(word, 0) + 1
        if word in ("quarantined", "still-quarantined"):
            quarantined += 1
        by_severity: dict[str, int] = {}
        for finding in _dicts(result.get("blocking")):
            severity = _text(finding.get("severity"), 20) or "UNKNOWN"
            by_severity[severity] = by_severity.get(severity, 0) + 1
        for severity, count in sorted(by_severity.items()):
            blocking.add(count, digest=_text(result.get("digest"), 80), severity=severity)
    for word, count in counts.items():
        images.add(count, status=word)
    regions = Family("rescan_unreachable_regions", "Regions the last rescan could not read.").add(len(unreachable))
    return [images, blocking, regions,
            Family("quarantined_images", "Images behind channel tags that are quarantined.").add(quarantined)]


@dataclass(frozen=True)
class ExceptionFact:
    """One accepted risk of the vulnerability policy, as far as an alert needs it."""

    id: str
    owner: str
    expires: dt.date  # the last valid day


def exception_figures(exceptions: Iterable[ExceptionFact]) -> list[Family]:
    """When each exception stops counting: the end of its last valid day (UTC)."""
    family = Family("policy_exception_expiry_timestamp_seconds",
                    "When an exception of the vulnerability policy stops counting (the end of its last valid day).")
    for exc in exceptions:
        end = dt.datetime.combine(exc.expires + dt.timedelta(days=1), dt.time(), dt.timezone.utc)
        family.add(end.timestamp(), id=exc.id[:100], owner=exc.owner[:100])
    return [family]


# --- gc -------------------------------------------------------------------------------------------------------


def gc_figures(report: Mapping[str, Any]) -> list[Family]:
    """What gc found (and, with --apply, deleted) per region, and the bytes a sweep frees per registry."""
    manifests = Family("gc_manifests", "Manifests in the region's repository, by what gc judged them.")
    for region in _dicts(report.get("regions")):
        name = _text(region.get("region"), 100)
        manifests.add(_number(region.get("live")) or 0, region=name, judged="live")
        manifests.add(len(region.get("dead") or ()), region=name, judged="dead")
    reclaimable = Family("gc_reclaimable_bytes", "Bytes of blobs only dead manifests use: what a sweep frees.")
    for registry in _dicts(report.get("registries")):
        reclaimable.add(_number(registry.get("bytes")) or 0, registry=_text(registry.get("registry"), 200))
    state = _mapping(report.get("state"))
    return [manifests, reclaimable,
            Family("gc_deleted_manifests", "Manifests the last gc deleted (0 on a dry run).")
            .add(len(report.get("deleted") or ())),
            Family("gc_state_records", "Rollout records in the state repository.").add(_number(state.get("records")) or 0),
            Family("gc_compacted_records", "Rollout records gc archived and deleted (or would, on a dry run).")
            .add(len(state.get("compacted_records") or ()))]


def names_of(families: Iterable[Family]) -> set[str]:
    return {family.full_name for family in families}
