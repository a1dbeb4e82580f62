"""The steps of a rollout and of its rollback, in order (pure: no I/O).

A rollout of one digest to some channel tags runs wave by wave. Within a wave every region
first receives the image by digest (signatures included) and has it verified there; only
then are the tags' previous digests recorded and the tags moved; then the wave's gates run.
The reconciler (rollout.py) executes these steps one at a time and records each as done, so
the step list is the single order both a first run and a resume follow.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from .release import ReleaseConfig


class StepKind(str, Enum):
    COPY = "copy"  # copy the digest into the region's repository, signatures and attestations included
    VERIFY = "verify"  # verify the signature (and trust's attestations) in the region's registry
    RECORD = "record-previous"  # remember what the tag points at now, before anything moves it
    MOVE = "move-tag"  # point the channel tag at the digest
    GATES = "gates"  # wait until every gate of the wave passed

    def __str__(self) -> str:
        return self.value


class PlanError(ValueError):
    """The rollout asked for cannot be planned (a channel the release does not list, no digest)."""


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
    algorithm, _, hexpart = digest.partition(":")
    if algorithm != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise PlanError(f"'{digest[:80]}' is not a sha256 digest")


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
