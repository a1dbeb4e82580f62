"""The steps of a rollout and of its rollback, in order (pure: no I/O).

A rollout of one digest to some channel tags runs wave by wave. Within a wave every region
first receives the image by digest (signatures included) and has it verified there; only
then are the tags' previous digests recorded and the tags moved; then the wave's gates run.
The reconciler (rollout.py) executes these steps one at a time and records each as done, so
the step list is the single order both a first run and a resume follow.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypedDict

from imagebuild.config.release_file import ReleaseConfig
from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.oci import names


class StepKind(str, Enum):
    COPY = "copy"  # copy the digest into the region's repository, signatures and attestations included
    VERIFY = "verify"  # verify the signature (and trust's attestations) in the region's registry
    PREPULL = "prepull"  # every node of the region (release.yaml prepull:) pulls and unpacks the digest
    RECORD = "record-previous"  # remember what the tag points at now, before anything moves it
    MOVE = "move-tag"  # point the channel tag at the digest
    GATES = "gates"  # wait until every gate of the wave passed

    def __str__(self) -> str:
        return self.value


class PlanError(ImagebuildError, ValueError):
    """The rollout asked for cannot be planned (a channel the release does not list, no digest)."""

    exit_code = ExitCode.BAD_INPUT


class RecordMismatch(ImagebuildError, ValueError):
    """A record read from the state repository disagrees with the plan release.yaml gives (or is malformed)."""


DIGEST_PATTERN = names.SHA256_DIGEST
ROLLOUT_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,80}")
STATUSES = frozenset({"running", "halted", "aborted", "completed", "rolling-back", "rolled-back"})


# --- the record's shape ---------------------------------------------------------------------
# The rollout record as JSON in the state repository (tag rollout-<id>). The reconciler writes
# it; what is read back is untrusted until check_record has compared it with the plan.


class _StepDone(TypedDict, total=False):
    done_at: str
    result: dict[str, Any]  # what the step found or did (digests, bytes copied, gate outcomes)


class _RollbackDone(TypedDict, total=False):
    done_at: str
    result: str  # what became of the tag (restored, deleted, already so)


class StepEntry(_StepDone):
    index: int
    kind: str  # a StepKind's value
    wave: str
    region: str | None
    tag: str | None
    state: str  # pending | done


class RollbackEntry(_RollbackDone):
    index: int
    wave: str
    region: str
    tag: str
    moved_to: str
    restore_to: str | None
    state: str


class RollbackState(TypedDict):
    steps: list[RollbackEntry]
    next_step: int
    started_at: str


class Approval(TypedDict):
    by: str
    at: str


class WaveState(TypedDict):
    state: str  # pending | copying | moving | gating | passed | ...
    moved_at: float | None  # when its last tag moved: a soak counts from here
    gates: list[dict[str, Any]]  # the latest outcome of each gate
    approvals: list[Approval]


class RolloutRecord(TypedDict):
    schema: int
    id: str
    release: str
    channels: list[str]
    source: str
    digest: str
    status: str  # one of STATUSES
    reason: str | None
    created_at: str
    updated_at: str
    started_by: dict[str, str]
    steps: list[StepEntry]
    next_step: int
    previous: dict[str, str | None]  # "region/tag" -> the digest it named before (None: absent)
    present_before: dict[str, bool]  # region -> whether the digest was there before the copy
    waves: dict[str, WaveState]
    rollback: RollbackState | None
    events: list[dict[str, Any]]  # the audit trail: only ever appended to


@dataclass(frozen=True)
class Step:
    index: int
    kind: StepKind
    wave: str
    region: str | None = None  # None for a wave's gates
    tag: str | None = None  # for record-previous and move-tag

    def describe(self) -> str:
        where = "/".join(part for part in (self.wave, self.region, self.tag) if part)
        return f"#{self.index} {self.kind} {where}"

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "kind": self.kind.value, "wave": self.wave, "region": self.region,
                "tag": self.tag}


@dataclass(frozen=True)
class RollbackStep:
    """Put one tag back: at `restore_to`, or gone (None) when the rollout created it."""

    index: int
    wave: str
    region: str
    tag: str
    moved_to: str  # the rollout's digest: the tag is restored only while it still points here
    restore_to: str | None

    def describe(self) -> str:
        target = self.restore_to or "(delete: it did not exist before)"
        return f"#{self.index} restore {self.wave}/{self.region}/{self.tag} -> {target}"

    def to_dict(self) -> dict[str, object]:
        return {"index": self.index, "wave": self.wave, "region": self.region, "tag": self.tag,
                "moved_to": self.moved_to, "restore_to": self.restore_to}


def _check_digest(digest: str) -> None:
    if not isinstance(digest, str) or not DIGEST_PATTERN.fullmatch(digest):
        raise PlanError(f"'{str(digest)[:80]}' is not a sha256 digest")


def check_channels(config: ReleaseConfig, channels: Sequence[str]) -> tuple[str, ...]:
    if not channels:
        raise PlanError("give at least one channel tag to move")
    unknown = [tag for tag in channels if tag not in config.channels]
    if unknown:
        raise PlanError(f"channel '{unknown[0]}' is not among the release's channels ({', '.join(config.channels)})")
    return tuple(dict.fromkeys(channels))


def plan_rollout(config: ReleaseConfig, digest: str, channels: Sequence[str]) -> tuple[Step, ...]:
    """Every step of moving `channels` to `digest`, wave after wave."""
    _check_digest(digest)
    tags = check_channels(config, channels)
    kinds: list[tuple[StepKind, str, str | None, str | None]] = []
    for wave in config.waves:
        for region in wave.regions:
            kinds.append((StepKind.COPY, wave.name, region, None))
            kinds.append((StepKind.VERIFY, wave.name, region, None))
            if config.region(region).prepull is not None:  # warm the nodes before any tag of the wave moves
                kinds.append((StepKind.PREPULL, wave.name, region, None))
        # Every previous digest of the wave is recorded before any of its tags moves.
        for region in wave.regions:
            kinds.extend((StepKind.RECORD, wave.name, region, tag) for tag in tags)
        for region in wave.regions:
            kinds.extend((StepKind.MOVE, wave.name, region, tag) for tag in tags)
        kinds.append((StepKind.GATES, wave.name, None, None))
    return tuple(Step(index, kind, wave_name, region, tag) for index, (kind, wave_name, region, tag) in enumerate(kinds))


def plan_rollback(steps: Iterable[Step], previous: Mapping[tuple[str, str], str | None],
                  digest: str) -> tuple[RollbackStep, ...]:
    """Put back every tag whose previous digest was recorded, in reverse wave order.

    `previous` maps (region, tag) to the digest the tag held before the rollout, None when the
    tag did not exist. A tag without a recorded previous digest was never moved (its record
    step precedes its move step), so it is left alone. Within a wave, tags that get a digest
    back come before tags that are deleted: on registries that delete only by digest, removing
    the image must not take a restored tag with it.
    """
    _check_digest(digest)
    waves: list[str] = []
    moves: dict[str, list[Step]] = {}
    for step in steps:
        if step.kind is StepKind.MOVE and step.region and step.tag and (step.region, step.tag) in previous:
            if step.wave not in moves:
                waves.append(step.wave)
                moves[step.wave] = []
            moves[step.wave].append(step)
    ordered: list[tuple[str, str, str, str | None]] = []
    for wave in reversed(waves):
        in_wave = list(reversed(moves[wave]))
        restores = [s for s in in_wave if previous[(s.region or "", s.tag or "")] is not None]
        deletes = [s for s in in_wave if previous[(s.region or "", s.tag or "")] is None]
        for step in restores + deletes:
            region, tag = step.region or "", step.tag or ""
            ordered.append((wave, region, tag, previous[(region, tag)]))
    return tuple(RollbackStep(index, wave, region, tag, digest, restore_to)
                 for index, (wave, region, tag, restore_to) in enumerate(ordered))


# --- a record read back from the state repository ----------------------------------------------
#
# Anyone who can push to the state repository can write a record, so a record is checked against
# the plan release.yaml gives for its digest and channels before anything acts on it. It may only
# carry progress (which steps are done, gate results, events) and digests (the one rolled out, the
# previous digest of each tag); every tag, region, wave and repository comes from release.yaml.


def _need(condition: bool, message: str) -> None:
    if not condition:
        raise RecordMismatch(message)


def _digest_or_none(value: Any, where: str) -> str | None:
    _need(value is None or (isinstance(value, str) and DIGEST_PATTERN.fullmatch(value) is not None),
          f"{where} is {names.escaped(value)}, not a sha256 digest")
    return value  # type: ignore[no-any-return]


_STEP_KEYS = frozenset({"index", "kind", "wave", "region", "tag", "state", "done_at", "result"})


def _step_fields(entry: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(entry, dict):
        raise RecordMismatch(f"{where} is not a mapping")
    # A key of its own (a repository, a registry) would be ignored, but a record that carries one was not
    # written by a rollout: refused rather than half-believed.
    extra = sorted(set(entry) - _STEP_KEYS)
    _need(not extra, f"{where} carries {names.escaped(extra)}, which a rollout step never records")
    return tuple(entry.get(key) for key in ("index", "kind", "wave", "region", "tag"))


def check_record(config: ReleaseConfig, record: Any, rollout_id: str) -> tuple[Step, ...]:
    """The steps release.yaml gives this record's digest and channels; RecordMismatch when the record
    names anything else (a tag, region, wave or step of its own), or is malformed."""
    _need(isinstance(record, dict), "the record is not a mapping")
    _need(record.get("id") == rollout_id, f"its id is {names.escaped(record.get('id'))}, not {rollout_id}")
    _need(record.get("status") in STATUSES, f"status {names.escaped(record.get('status'))} is not a rollout status")
    channels = record.get("channels")
    _need(isinstance(channels, list) and all(isinstance(c, str) for c in channels), "channels is not a list of tags")
    digest = record.get("digest")
    try:
        steps = plan_rollout(config, digest, channels)
    except PlanError as exc:
        raise RecordMismatch(str(exc)) from None
    _need(isinstance(record.get("source"), str), "source is not an image reference")
    recorded = record.get("steps")
    _need(isinstance(recorded, list), "steps is not a list")
    _need(len(recorded) == len(steps), f"it has {len(recorded)} steps; release.yaml plans {len(steps)} "
                                       f"for these channels")
    for step, entry in zip(steps, recorded):
        expected = (step.index, step.kind.value, step.wave, step.region, step.tag)
        found = _step_fields(entry, f"step {step.index}")
        _need(found == expected, f"step {step.index} is {names.escaped(found)}; release.yaml plans {step.describe()}")
        _need(entry.get("state") in ("pending", "done"), f"step {step.index} has state {names.escaped(entry.get('state'))}")
    next_step = record.get("next_step")
    _need(isinstance(next_step, int) and not isinstance(next_step, bool) and 0 <= next_step <= len(steps),
          f"next_step {names.escaped(next_step)} is not a step number")
    _check_previous(steps, record, next_step)
    _check_present_before(steps, record)
    _check_waves(config, record)
    _check_rollback(steps, record)
    _need(isinstance(record.get("events"), list), "events is not a list")
    _need(record.get("reason") is None or isinstance(record.get("reason"), str), "reason is not text")
    return steps


def previous_pairs(record: Mapping[str, Any]) -> dict[tuple[str, str], str | None]:
    """The record's `previous` map as (region, tag) -> digest (check_record has vetted it)."""
    pairs: dict[tuple[str, str], str | None] = {}
    for key, value in record["previous"].items():
        region, _, tag = key.partition("/")
        pairs[(region, tag)] = value
    return pairs


def _check_previous(steps: tuple[Step, ...], record: Mapping[str, Any], next_step: int) -> None:
    previous = record.get("previous")
    if not isinstance(previous, dict):
        raise RecordMismatch("previous is not a mapping")
    # A previous digest is recorded by its record-previous step, saved with that step's completion.
    recorded = {f"{s.region}/{s.tag}" for s in steps if s.kind is StepKind.RECORD and s.index < next_step}
    for key, value in previous.items():
        _need(key in recorded, f"previous names {names.escaped(key)}, which no completed record-previous step "
                               f"of release.yaml's plan recorded")
        _digest_or_none(value, f"previous[{key}]")


def _check_present_before(steps: tuple[Step, ...], record: Mapping[str, Any]) -> None:
    present = record.get("present_before")
    if not isinstance(present, dict):
        raise RecordMismatch("present_before is not a mapping")
    copied = {s.region for s in steps if s.kind is StepKind.COPY}
    for region, value in present.items():
        _need(region in copied and isinstance(value, bool), f"present_before names {names.escaped(region)}: "
                                                            f"{names.escaped(value)}")


def _check_waves(config: ReleaseConfig, record: Mapping[str, Any]) -> None:
    waves = record.get("waves")
    if not isinstance(waves, dict) or set(waves) != {w.name for w in config.waves}:
        raise RecordMismatch(f"waves {names.escaped(list(waves) if isinstance(waves, dict) else waves)} are not "
                             f"release.yaml's ({', '.join(w.name for w in config.waves)})")
    for name, state in waves.items():
        _need(isinstance(state, dict) and isinstance(state.get("state"), str), f"wave {name} has no state")
        moved_at = state.get("moved_at")
        _need(moved_at is None or (isinstance(moved_at, (int, float)) and not isinstance(moved_at, bool)),
              f"wave {name}: moved_at {names.escaped(moved_at)} is not a time")
        _need(isinstance(state.get("gates"), list) and isinstance(state.get("approvals"), list),
              f"wave {name}: gates and approvals are not lists")


def _check_rollback(steps: tuple[Step, ...], record: Mapping[str, Any]) -> None:
    rollback = record.get("rollback")
    if rollback is None:
        return
    _need(isinstance(rollback, dict) and isinstance(rollback.get("steps"), list), "rollback is malformed")
    planned = plan_rollback(steps, previous_pairs(record), record["digest"])
    found = rollback["steps"]
    _need(len(found) == len(planned), f"its rollback has {len(found)} steps; its previous digests give "
                                      f"{len(planned)}")
    for step, entry in zip(planned, found):
        _need(isinstance(entry, dict), f"rollback step {step.index} is not a mapping")
        got = {key: entry.get(key) for key in step.to_dict()}
        _need(got == step.to_dict(), f"rollback step {step.index} is {names.escaped(got)}; the plan is {step.describe()}")
    next_step = rollback.get("next_step")
    _need(isinstance(next_step, int) and not isinstance(next_step, bool) and 0 <= next_step <= len(planned),
          f"rollback next_step {names.escaped(next_step)} is not a step number")
