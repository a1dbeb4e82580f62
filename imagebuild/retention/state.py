"""What the rollout state keeps alive, and which of its own documents gc may compact. Pure.

Records are read from the state repository (untrusted: retention.gc reads each through
StateStore.read, which checks the blob, then `record_facts` checks the fields gc relies on). A
record that gc cannot read makes it refuse: its digests might be someone's rollback.

Kept in the regions (roots of retention.live.collect):
- the digest and rollback targets (`previous`) of every rollout that has not finished;
- the same for each channel's latest rollout (what `rollout rollback` restores);
- the digests of each channel's last `keep_releases` completed rollouts;
- every quarantined digest (the evidence stays until the mark is lifted).
Kept in the state repository: the records above, and any record updated within `record_retention_s`.
Older finished records are compacted (archived locally first), with their request markers.
"""
from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from imagebuild.core.errors import ImagebuildError
from imagebuild.oci import names

FINISHED = frozenset({"completed", "halted", "aborted", "rolled-back"})


class RecordUnreadable(ImagebuildError):
    """A record lacks a field gc relies on, or holds one of the wrong shape (gc refuses: exit 1)."""


@dataclass(frozen=True)
class RecordFacts:
    """What gc reads from one rollout record."""

    id: str
    channels: tuple[str, ...]
    digest: str
    status: str
    updated_at: float  # seconds since the epoch
    previous: tuple[str, ...]  # the digests its tags named before (rollback targets)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


def _when(value: Any, key: str) -> float:
    if not isinstance(value, str):
        raise RecordUnreadable(f"{key} is not a time")
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        raise RecordUnreadable(f"{key} '{names.escaped(value, 60)}' is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise RecordUnreadable(f"{key} '{names.escaped(value, 60)}' has no time zone")
    return moment.timestamp()


def record_facts(rollout_id: str, record: Mapping[str, Any]) -> RecordFacts:
    """The record's facts, each checked; RecordUnreadable names the first field that is wrong."""
    if record.get("id") != rollout_id:
        raise RecordUnreadable(f"its id is '{names.escaped(record.get('id'), 100)}', not its tag's")
    channels = record.get("channels")
    if not isinstance(channels, list) or not channels or not all(names.is_tag(c) for c in channels):
        raise RecordUnreadable("channels is not a list of tags")
    digest = record.get("digest")
    if not names.is_sha256_digest(digest):
        raise RecordUnreadable("digest is not a sha256 digest")
    status = record.get("status")
    if not isinstance(status, str) or not status:
        raise RecordUnreadable("status is not a string")
    previous = record.get("previous")
    if not isinstance(previous, dict):
        raise RecordUnreadable("previous is not a mapping")
    targets = []
    for key, value in previous.items():
        if value is None:
            continue
        if not names.is_sha256_digest(value):
            raise RecordUnreadable(f"previous[{names.escaped(key, 100)}] is not a sha256 digest")
        targets.append(value)
    return RecordFacts(rollout_id, tuple(channels), digest, status, _when(record.get("updated_at"), "updated_at"),
                       tuple(dict.fromkeys(targets)))


@dataclass(frozen=True)
class Retention:
    keep_releases: int = 3  # completed rollouts per channel whose digests stay in the regions
    record_retention_s: float = 90 * 86400.0  # finished records younger than this stay in the state repository


@dataclass
class StateJudgement:
    roots: dict[str, str]  # digest -> why the regions keep it
    kept_records: dict[str, str]  # rollout ID -> why its record stays
    compacted_records: tuple[str, ...]  # rollout IDs whose records (and markers) go
    candidates: set[str] = field(default_factory=set)  # every digest any record names (to look for in the regions)


def judge_state(records: Iterable[RecordFacts], latest: Mapping[str, str], quarantined: Mapping[str, str],
                retention: Retention, now: float) -> StateJudgement:
    """`latest`: channel -> the rollout ID its pointer names; `quarantined`: digest -> the mark's reason."""
    records = sorted(records, key=lambda r: (-r.updated_at, r.id))
    by_id = {r.id: r for r in records}
    roots: dict[str, str] = {}
    kept: dict[str, str] = {}

    def keep(record: RecordFacts, why: str, with_previous: bool) -> None:
        kept.setdefault(record.id, why)
        roots.setdefault(record.digest, f"{why} (rollout {record.id})")
        if with_previous:
            for digest in record.previous:
                roots.setdefault(digest, f"rollback target of {why} (rollout {record.id})")

    for record in records:
        if not record.finished:
            keep(record, f"running rollout of {', '.join(record.channels)}", True)
    channels = sorted({c for r in records for c in r.channels} | set(latest))
    for channel in channels:
        pointed = by_id.get(latest.get(channel, ""))
        newest = pointed or next((r for r in records if channel in r.channels), None)
        if newest is not None:
            keep(newest, f"latest rollout of {channel}", True)
        completed = [r for r in records if channel in r.channels and r.status == "completed"]
        for n, record in enumerate(completed[:retention.keep_releases], start=1):
            keep(record, f"release {n} of {retention.keep_releases} kept for {channel}", False)
    for record in records:
        if now - record.updated_at < retention.record_retention_s:
            kept.setdefault(record.id, "younger than the record retention")
    for digest, reason in sorted(quarantined.items()):
        roots.setdefault(digest, f"quarantined: {reason}")
    compacted = tuple(r.id for r in records if r.id not in kept)
    candidates = {d for r in records for d in (r.digest, *r.previous)}
    return StateJudgement(roots, kept, compacted, candidates)
