"""The rollout reconciler: moves channel tags region by region, wave by wave, resumably.

Its durable state lives in the state registry (release.yaml `state:`), so any CI job can read
it and a killed run can be resumed from anywhere:
- the rollout record, tag `rollout-<id>`: one OCI artifact (config `{}`, one JSON layer),
  rewritten after every step (blob first, then the manifest, so a kill between the two
  leaves the previous record whole). Its `events` list only grows: the audit trail;
- `channel-<tag>`: the latest rollout of that channel (what `status` without an ID shows);
- `lease-<tag>`: who is rolling that channel out now, until when;
- `rollout-<id>.abort` and `rollout-<id>.approve-<wave>`: requests other commands leave for
  the running reconciler, so they never race its record writes.

What the state repository holds is untrusted input (anyone with push rights there can write it):
every blob is hash-checked against its descriptor before it is parsed; a record is checked against
the plan release.yaml gives (rollout_plan.check_record) and may carry only progress and digests;
and every tag move, forward or back, first verifies its target in that region against the trust
configuration and refuses a quarantined digest.

Every step checks the registries before acting and is safe to repeat: a copy finds what the
target already holds, a tag already at the digest is not written again, a previous digest once
recorded is never overwritten. A step is marked done only after its effect, so a kill at any
point repeats at most the one step that was in flight.

How a run ends (halted, aborted, rolled back, completed) and a failing gate are told to the
Runtime's `notify` (release.yaml's `notify:` targets, wired by the CLI): it returns at once and
raises nothing, so no receiver can hold a rollout back or stop it.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from imagebuild.config.release_file import ApprovalGate, GateSpec, Region, ReleaseConfig
from imagebuild.config.trust import TrustConfig, load_trust_config
from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.runner import ToolMissing
from imagebuild.core.source import safe_text
from imagebuild.oci.client import ImageRef, Registry, RegistryError, RegistryUnreachable
from imagebuild.oci.copy import CopyOptions, copy_image, cosign_tag
from imagebuild.oci.platforms import pull_families
from imagebuild.rollout import gates, prepull
from imagebuild.rollout.lease import ChannelLease, open_lease
from imagebuild.rollout.plan import (
    ROLLOUT_ID_PATTERN,
    RecordMismatch,
    RollbackEntry,
    RollbackState,
    RollbackStep,
    RolloutRecord,
    Step,
    StepEntry,
    StepKind,
    check_channels,
    check_record,
    plan_rollback,
    plan_rollout,
    previous_pairs,
)
from imagebuild.rollout.quarantine import describe, find, refusal
from imagebuild.rollout.state import (
    MARKER_TYPE,
    RECORD_TYPE,
    REGION_RETRIES,
    SCHEMA,
    LeaseHeld,
    RolloutError,
    StateRefused,
    StateStore,
    now_iso,
    open_store,
    record_tag,
    region_registry,
    state_tag,
    who,
)
from imagebuild.trust.verify import Verifier, parse_image

_REGION_ATTEMPTS = 4  # a region's registry gets this many tries (backoff between) before the rollout halts
_GATE_ATTEMPTS = 3  # a gate that cannot reach its service is asked this many times before the rollout halts



@dataclass(frozen=True)
class Timing:
    """How long a rollout waits and on which clock: the CLI uses these defaults; tests inject shorter waits."""

    settle_s: float = 2.0  # the lease's settle delay between writing it and reading it back
    retry_base_s: float = 1.0  # backoff before a region's next try: base, 2x base, 4x base
    clock: Callable[[], float] = time.time  # soaks and gate polls
    sleep: Callable[[float], None] = time.sleep  # every wait: the settle, the backoffs, the gate polls
    # A lease's expiry is a wall-clock time every process reads; a test may run one process ahead of it.
    lease_clock: Callable[[], float] = time.time


StepPhase = Literal["effect", "recorded"]
# Called after each step's effect (not yet recorded) and once it is recorded: where crash tests inject a fault.
StepHook = Callable[[Step, StepPhase], None]


# (target host, event kind, why) of a notification that could not be delivered.
NotifyFailure = Callable[[str, str, str], None]


class Notify(Protocol):
    """Where a rollout tells what happened (notify.send.Notifier, which the CLI makes from release.yaml's
    `notify:`): `emit` returns at once and raises nothing; `drain` waits, boundedly, for what is in flight."""

    def emit(self, kind: str, source: str, subject: str, data: dict[str, Any],
             on_failure: NotifyFailure | None = None) -> None: ...

    def drain(self) -> None: ...


@dataclass(frozen=True)
class Runtime:
    """What a caller may inject into a rollout command: its timing, a step hook and where to notify (none by default)."""

    timing: Timing = field(default_factory=Timing)
    hook: StepHook | None = None
    notify: Notify | None = None
    # Shown the record as the run leaves it, however it ends (the command's metrics are made from it).
    on_record: Callable[[RolloutRecord], None] | None = None


class _Halt(ImagebuildError):
    """The run stops here: the record gets STATUS and REASON, the command `exit_code`."""

    def __init__(self, reason: str, exit_code: ExitCode = ExitCode.FAILED, status: str = "halted"):
        super().__init__(reason, exit_code=exit_code)
        self.reason = reason
        self.status = status


# --- the lease --------------------------------------------------------------------------------


def lease_for(config: ReleaseConfig, store: StateStore, record: RolloutRecord,
              timing: Timing | None = None) -> ChannelLease:
    """The rollout's lease on its channels: release.yaml's Kubernetes Lease, else the state repository's tag."""
    timing = timing or Timing()
    return open_lease(config, store, tuple(record["channels"]), record["id"], settle_s=timing.settle_s,
                      sleep=timing.sleep, clock=timing.lease_clock)


# --- the record ------------------------------------------------------------------------------


def new_rollout_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dt%H%M%S") + "-" + secrets.token_hex(3)


def new_record(config: ReleaseConfig, rollout_id: str, source: str, digest: str, channels: tuple[str, ...],
               steps: tuple[Step, ...]) -> RolloutRecord:
    return {
        "schema": SCHEMA, "id": rollout_id, "release": str(config.path), "channels": list(channels),
        "source": source, "digest": digest, "status": "running", "reason": None,
        "created_at": now_iso(), "updated_at": now_iso(), "started_by": who(),
        "steps": [StepEntry(index=step.index, kind=step.kind.value, wave=step.wave, region=step.region, tag=step.tag,
                            state="pending") for step in steps], "next_step": 0,
        "previous": {}, "present_before": {},
        "waves": {wave.name: {"state": "pending", "moved_at": None, "gates": [], "approvals": []}
                  for wave in config.waves},
        "rollback": None, "events": [],
    }


def previous_key(region: str, tag: str) -> str:
    return f"{region}/{tag}"


def load_record(store: StateStore, rollout_id: str, config: ReleaseConfig) -> RolloutRecord:
    """The record, checked against release.yaml's plan (rollout_plan.check_record): the state repository
    is untrusted, so a record naming a tag, region or step of its own is refused before anything acts."""
    if not ROLLOUT_ID_PATTERN.fullmatch(rollout_id):
        raise RolloutError(f"'{safe_text(rollout_id, 100)}' is not a rollout ID", ExitCode.BAD_INPUT)
    where = f"{store.registry.registry}/{store.repository}:{record_tag(rollout_id)}"
    try:
        record = store.read(record_tag(rollout_id), RECORD_TYPE)
    except StateRefused as exc:
        raise StateRefused(f"rollout {rollout_id}: {exc}; nothing was changed") from None
    if record is None:
        raise RolloutError(f"no rollout {rollout_id} in {store.registry.registry}/{store.repository}",
                           ExitCode.BAD_INPUT)
    if record.get("schema") != SCHEMA:
        raise RolloutError(f"rollout {rollout_id}: record schema {safe_text(record.get('schema'), 100)} is not {SCHEMA}")
    try:
        check_record(config, record, rollout_id)
    except RecordMismatch as exc:
        raise StateRefused(f"rollout {rollout_id}: refusing its record {where}: it disagrees with "
                           f"{config.path}: {exc}; nothing was changed") from None
    return cast(RolloutRecord, record)  # its shape is what check_record just compared with the plan


@dataclass
class Journal:
    """Writes the record (registry first: it is the truth; then the local copy) and the audit trail."""

    store: StateStore
    local_dir: Path
    record: RolloutRecord
    # Notifications report their failures from their own threads (note); audit.jsonl gets whole lines.
    _audit_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def save(self) -> None:
        self.record["updated_at"] = now_iso()
        self.store.write(record_tag(self.record["id"]), self.record, RECORD_TYPE)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        cache = self.local_dir / f"{self.record['id']}.json"
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2, sort_keys=True))
        os.replace(tmp, cache)

    def event(self, what: str, **details: Any) -> dict[str, Any]:
        """An audit event: appended to the record's events (saved with it) and to local audit.jsonl."""
        entry = self._entry(what, details)
        self.record["events"].append(entry)
        self._audit(entry)
        return entry

    def note(self, what: str, **details: Any) -> None:
        """An audit line in local audit.jsonl only, from any thread: what happens after the record's last
        save (a notification failing in the background) must not change a record the lease no longer covers."""
        self._audit(self._entry(what, details))

    def _entry(self, what: str, details: dict[str, Any]) -> dict[str, Any]:
        entry: dict[str, Any] = {"at": now_iso(), "who": who(), "rollout": self.record["id"], "what": what,
                                 "channels": self.record["channels"]}
        entry.update({key: value for key, value in details.items() if value is not None})
        return entry

    def _audit(self, entry: dict[str, Any]) -> None:
        with self._audit_lock:
            self.local_dir.mkdir(parents=True, exist_ok=True)
            with open(self.local_dir / "audit.jsonl", "a", encoding="utf-8") as audit:
                audit.write(json.dumps(entry, sort_keys=True) + "\n")


# What each way a run ends is told as (release_file.NOTIFY_EVENTS).
_NOTICE_OF_STATUS = {"halted": "rollout.halted", "aborted": "rollout.aborted", "completed": "rollout.completed",
                     "rolled-back": "rollout.rolledback"}


def tell(notify: Notify | None, journal: Journal, kind: str, reason: str | None = None, **details: Any) -> None:
    """Notify `kind` about the journal's rollout; a failure to deliver becomes a `notify-failed` audit line
    (the target's host and why, never its URL or headers). Never raises, never waits."""
    if notify is None:
        return
    record = journal.record
    data: dict[str, Any] = {"rollout": record["id"], "status": record["status"], "channels": list(record["channels"]),
                            "digest": record["digest"], "image": record["source"], "release": record["release"],
                            "reason": reason, **details}

    def failed(host: str, what: str, why: str) -> None:
        journal.note("notify-failed", event=what, target=host, detail=why)

    try:
        notify.emit(kind, f"imagebuild/rollout/{record['id']}", record["digest"], data, failed)
    except Exception as exc:  # a notifier that breaks its promise still does not stop the rollout
        failed("?", kind, type(exc).__name__)


# --- regions ---------------------------------------------------------------------------------


Output = Callable[[str], None]


class Reconciler:
    """Runs (or resumes) one rollout's steps, or its rollback, against the live registries."""

    def __init__(self, config: ReleaseConfig, trust: TrustConfig, journal: Journal, lease: ChannelLease, out: Output,
                 runtime: Runtime | None = None):
        self.config = config
        self.trust = trust
        self.journal = journal
        self.record = journal.record
        self.lease = lease
        self.out = out
        self.digest: str = self.record["digest"]
        # Every step comes from release.yaml (load_record checked that the record's steps agree).
        self.steps = plan_rollout(config, self.digest, self.record["channels"])
        source = ImageRef.parse(self.record["source"])
        self.source_registry = source.registry
        self.source_repository = source.repository
        self._registries: dict[str, Registry] = {}
        self._verifier: Verifier | None = None
        runtime = runtime or Runtime()
        self.timing = runtime.timing
        self.hook = runtime.hook
        self.notify = runtime.notify
        self._at: Step | RollbackStep | None = None  # the step running now: where a halt is told to have happened

    def registry(self, region: Region) -> Registry:
        if region.name not in self._registries:
            self._registries[region.name] = region_registry(region)
        return self._registries[region.name]

    def close(self) -> None:
        for registry in self._registries.values():
            registry.close()
        if self._verifier is not None:
            self._verifier.close()

    def verifier(self) -> Verifier:
        if self._verifier is None:
            self._verifier = Verifier(self.trust, cache_ttl_seconds=0)  # no cache: every check asks the registry
        return self._verifier

    # --- shared -----------------------------------------------------------------------------

    def _abort_requested(self) -> dict[str, Any] | None:
        return self.journal.store.read(record_tag(self.record["id"]) + ".abort", MARKER_TYPE)

    def _approvals(self, wave: str) -> tuple[str, ...]:
        marker = self.journal.store.read(record_tag(self.record["id"]) + f".approve-{wave}", MARKER_TYPE)
        if marker is None:
            return ()
        approvals = self.record["waves"][wave]["approvals"]
        if not approvals:
            by, at = safe_text(marker.get("by"), 128), safe_text(marker.get("at"), 64)
            approvals.append({"by": by, "at": at})
            self.journal.event("approved", wave=wave, by=by)
        return (wave,)

    def _in_region(self, region: Region, action: Callable[[], Any]) -> Any:
        """Run one registry action for a region, retrying an unreachable registry with backoff, then halting."""
        last: Exception | None = None
        for attempt in range(_REGION_ATTEMPTS):
            try:
                return action()
            except RegistryUnreachable as exc:
                if exc.registry not in (None, region.registry):
                    raise  # the state or staging registry: not this region's fault
                last = exc
            except _RegionDown as exc:
                last = exc
            except RegistryError as exc:  # refused (auth, a bad manifest): retrying does not help
                if exc.registry != region.registry:
                    raise
                raise _Halt(f"region {region.name} ({region.registry}): {exc}") from None
            if attempt + 1 < _REGION_ATTEMPTS:
                delay = self.timing.retry_base_s * 2 ** attempt
                self.out(f"  region {region.name} ({region.registry}) unreachable; retrying in {delay:g}s")
                self.timing.sleep(delay)
        raise _Halt(f"region {region.name} ({region.registry}) unreachable after {_REGION_ATTEMPTS} attempts: {last}",
                    ExitCode.ENVIRONMENT)

    def _finish(self, status: str, reason: str | None, exit_code: ExitCode) -> ExitCode:
        self.record["status"] = status
        self.record["reason"] = reason
        self.journal.event(status, detail=reason)
        self.journal.save()
        self.lease.release()
        at = self._at if status in ("halted", "aborted") else None
        tell(self.notify, self.journal, _NOTICE_OF_STATUS.get(status, "rollout." + status), reason,
             wave=at.wave if at else None, region=at.region if at else None)
        return exit_code

    # --- the rollout ------------------------------------------------------------------------

    def run(self) -> int:
        steps = self.steps
        try:
            while self.record["next_step"] < len(steps):
                step = steps[self.record["next_step"]]
                self._at = step
                if self._abort_requested():
                    return self._finish("aborted", f"aborted before step {step.describe()}", ExitCode.FAILED)
                self.lease.renew()
                self.out(f"step {step.describe()}")
                result = self._run_step(step)
                if self.hook is not None:
                    self.hook(step, "effect")
                entry = self.record["steps"][step.index]
                entry["state"] = "done"
                entry["done_at"] = now_iso()
                if result:
                    entry["result"] = result
                self.record["next_step"] = step.index + 1
                self.journal.save()
                if self.hook is not None:
                    self.hook(step, "recorded")
        except StateRefused as refused:  # a lease, marker or quarantine mark that cannot be read
            self.out(f"halted: {refused}")
            return self._finish("halted", str(refused), ExitCode.FAILED)
        except _Halt as halt:
            self.out(f"{halt.status}: {halt.reason}")
            return self._finish(halt.status, halt.reason, halt.exit_code)
        return self._finish("completed", None, ExitCode.OK)

    def _run_step(self, step: Step) -> dict[str, Any] | None:
        wave = self.record["waves"][step.wave]
        if step.kind is StepKind.GATES:
            return self._gates(step)
        region = self.config.region(step.region or "")
        if step.kind is StepKind.COPY:
            wave["state"] = "copying"
            return self._copy(region)
        if step.kind is StepKind.VERIFY:
            return self._verify(region)
        if step.kind is StepKind.PREPULL:
            wave["state"] = "prepulling"
            return self._prepull(region)
        assert step.tag is not None
        if step.kind is StepKind.RECORD:
            return self._record_previous(region, step.tag)
        wave["state"] = "moving"
        result = self._move(region, step.tag, step.wave)
        if self._last_move_of_wave(step):
            wave["moved_at"] = self.timing.clock()
            wave["state"] = "gating"
        return result

    def _last_move_of_wave(self, step: Step) -> bool:
        following = self.steps[step.index + 1:step.index + 2]
        return not following or following[0].kind is not StepKind.MOVE or following[0].wave != step.wave

    def _copy(self, region: Region) -> dict[str, Any]:
        target = self.registry(region)
        present = self.record["present_before"]
        if region.name not in present:
            # Whether the image was there before us decides how a rollback may remove a tag it
            # created (Distribution deletes by digest only): recorded before the copy can change it.
            present[region.name] = self._in_region(
                region, lambda: target.head_manifest(region.repository, self.digest) is not None)
            self.journal.save()
        sig = cosign_tag(self.digest, "sig")
        if self._in_region(region, lambda: target.head_manifest(region.repository, self.digest) is not None
                           and target.head_manifest(region.repository, sig) is not None):
            self.journal.event("copy", region=region.name, to=self.digest, detail="already present with its signature")
            return {"copied": False, "detail": "already present with its signature"}
        source = Registry(self.source_registry, retry=REGION_RETRIES)
        try:
            copied = self._in_region(region, lambda: copy_image(
                source, self.source_repository, self.digest, target, region.repository,
                options=CopyOptions(signatures=True)))
        finally:
            source.close()
        self.journal.event("copy", region=region.name, to=self.digest,
                           detail=f"{region.registry}/{region.repository}: {copied.stats.blobs_uploaded} blobs uploaded")
        return {"copied": True, "blobs_uploaded": copied.stats.blobs_uploaded,
                "signature_tags": list(copied.stats.signature_tags)}

    def _verify_in(self, region: Region, digest: str | None = None, purpose: str = "") -> str:
        """`digest` (the rollout's by default) verifies in the region's registry against the trust config
        and is not quarantined; else the rollout halts. Every tag move asks this first."""
        digest = digest or self.digest
        image = region.image(digest)

        def check() -> Any:
            verdict = self.verifier().verify(image)
            if verdict.unreachable:
                raise _RegionDown(verdict.reason)
            return verdict

        verdict = self._in_region(region, check)
        if not verdict.allowed or verdict.digest != digest:
            raise _Halt(f"region {region.name}: {purpose}{image} does not verify: {verdict.reason}")
        self._refuse_quarantined(region, digest, purpose)
        return str(verdict.reason)

    def _refuse_quarantined(self, region: Region, digest: str, purpose: str) -> None:

        mark = find(self.journal.store, digest)
        if mark is not None:
            raise _Halt(f"region {region.name}: {purpose}{digest} is quarantined: {describe(mark)}")

    def _verify(self, region: Region) -> dict[str, Any]:
        reason = self._verify_in(region)
        if region.compressions is not None:  # the copy in the region is what its engines will pull
            target = self.registry(region)
            needs = self._in_region(region, lambda: pull_families(target, region.repository, self.digest))
            if not region.reads(needs):
                raise _Halt(f"region {region.name}: {unpullable(region, needs)}")
        self.journal.event("verify", region=region.name, to=self.digest, detail=reason)
        return {"verified": reason}

    def _prepull(self, region: Region) -> dict[str, Any]:
        """Every node of the region pulls the digest; one that cannot halts the rollout before any tag moves."""
        try:
            answers = prepull.prepull_region(
                region, self.digest, on_node=lambda answer: self.out(
                    f"  prepull {region.name}/{answer.node}: {'ready' if answer.ready else 'not ready'}: {answer.detail}"))
        except ToolMissing as missing:
            raise _Halt(f"region {region.name}: prepull: {missing}", missing.exit_code) from None
        nodes = [answer.to_dict() for answer in answers]
        self.journal.event("prepull", region=region.name, to=self.digest, nodes=nodes)
        failed = [answer for answer in answers if not answer.ready]
        if failed:
            first = failed[0]
            raise _Halt(f"region {region.name}: node {first.node} {first.detail}; "
                        f"{len(failed)} of {len(answers)} nodes not ready, no tag of the region moved")
        return {"nodes": nodes}

    def _record_previous(self, region: Region, tag: str) -> dict[str, Any]:
        key = previous_key(region.name, tag)
        previous = self.record["previous"]
        if key not in previous:  # recorded once; a repeat after a kill must not read our own move
            target = self.registry(region)
            previous[key] = self._in_region(region, lambda: target.head_manifest(region.repository, tag))
        return {"previous": previous[key]}

    def _move(self, region: Region, tag: str, wave: str) -> dict[str, Any]:
        key = previous_key(region.name, tag)
        if key not in self.record["previous"]:
            raise _Halt(f"internal: no previous digest recorded for {key} before moving it")
        target = self.registry(region)
        current = self._in_region(region, lambda: target.head_manifest(region.repository, tag))
        if current == self.digest:
            previous = self.record["previous"][key]
            if previous != self.digest:  # moved by a run of this rollout killed before it recorded the move
                self.journal.event("move-tag", wave=wave, region=region.name, tag=tag,
                                   detail="found moved (a killed run moved it)", **{"from": previous, "to": self.digest})
            return {"moved": False, "detail": "already at the digest"}
        # Checked again right before the tag points at it: signature, attestations, quarantine.
        self._verify_in(region, purpose=f"will not move {tag}: ")
        raw, media_type, _ = self._in_region(region, lambda: target.get_manifest(region.repository, self.digest))
        self._in_region(region, lambda: target.put_manifest(region.repository, tag, raw, media_type))
        self.journal.event("move-tag", wave=wave, region=region.name, tag=tag, **{"from": current, "to": self.digest})
        return {"moved": True, "from": current}

    def _gates(self, step: Step) -> dict[str, Any]:
        wave = self.config.wave(step.wave)
        state = self.record["waves"][step.wave]
        state["state"] = "gating"
        moved_at = state["moved_at"]
        if moved_at is None:
            moved_at = state["moved_at"] = self.timing.clock()
        # Each gate per region of the wave; approval is wave-wide, asked once.
        specs: list[tuple[GateSpec, Region]] = [
            (spec, self.config.region(name)) for spec in wave.gates
            for name in (wave.regions[:1] if isinstance(spec, ApprovalGate) else wave.regions)]
        last_saved = 0.0
        last_line = ""
        unreachable: dict[tuple[str, str | None], int] = {}
        while True:
            if self._abort_requested():
                raise _Halt("abort requested while waiting on the gates", ExitCode.FAILED, status="aborted")
            self.lease.renew()
            approvals = self._approvals(step.wave) if any(isinstance(s, ApprovalGate) for s, _ in specs) else ()
            results = []
            for spec, region in specs:
                ctx = gates.GateContext(wave=step.wave, region=region, image=region.image(self.digest),
                                        digest=self.digest, channels=tuple(self.record["channels"]),
                                        moved_at=float(moved_at), approvals=approvals, trust=self.trust,
                                        now=self.timing.clock(), rollout_id=self.record["id"],
                                        workdir=self.journal.local_dir / self.record["id"])
                results.append(gates.evaluate(spec, ctx))
            state["gates"] = [_result_dict(result) for result in results]
            # A gate whose service could not be reached says so with a retry_in_s: asked again a few
            # times before the rollout halts on it.
            failed = []
            for result in results:
                if result.outcome != gates.GateOutcome.FAILED:
                    continue
                key = (result.gate, result.region)
                unreachable[key] = unreachable.get(key, 0) + 1
                if result.retry_in_s is None or unreachable[key] >= _GATE_ATTEMPTS:
                    failed.append(result)
            if failed:
                state["state"] = "failed"
                first = failed[0]
                self.journal.event("gates", wave=step.wave, gates=state["gates"])
                tell(self.notify, self.journal, "gate.failed", f"gate {first.gate} failed: {first.detail}",
                     wave=step.wave, region=first.region, gate=first.gate,
                     gates=[{"gate": r.gate, "region": r.region, "detail": r.detail} for r in failed])
                raise _Halt(f"wave {step.wave}: gate {first.gate} failed in region {first.region}: {first.detail}")
            waiting = [r for r in results if r.outcome != gates.GateOutcome.PASSED]
            if not waiting:
                state["state"] = "passed"
                self.journal.event("gates", wave=step.wave, gates=state["gates"])
                return {"gates": state["gates"]}
            line = f"  wave {step.wave}: " + "; ".join(f"{r.gate}@{r.region} {r.detail}" for r in waiting)
            if line != last_line:
                self.out(line)
                last_line = line
            if self.timing.clock() - last_saved > 10:
                self.journal.save()  # `status` shows the progress from the registry
                last_saved = self.timing.clock()
            delays = [r.retry_in_s for r in waiting if r.retry_in_s]
            self.timing.sleep(min(max(min(delays, default=1.0), 0.2), 5.0))

    # --- rollback ---------------------------------------------------------------------------

    def rollback(self) -> int:
        # The plan comes from release.yaml's steps and the recorded previous digests (a stored rollback
        # plan was checked to be this same plan by load_record).
        steps = plan_rollback(self.steps, previous_pairs(self.record), self.digest)
        rollback = self.record.get("rollback")
        if rollback is None:
            rollback = RollbackState(
                steps=[RollbackEntry(index=s.index, wave=s.wave, region=s.region, tag=s.tag, moved_to=s.moved_to,
                                     restore_to=s.restore_to, state="pending") for s in steps],
                next_step=0, started_at=now_iso())
            self.record["rollback"] = rollback
        self.record["status"] = "rolling-back"
        self.journal.event("rollback-start")
        self.journal.save()
        try:
            while rollback["next_step"] < len(steps):
                step = steps[rollback["next_step"]]
                self._at = step
                self.lease.renew()
                self.out(f"rollback {step.describe()}")
                result = self._restore(step)
                entry = rollback["steps"][step.index]
                entry["state"], entry["done_at"], entry["result"] = "done", now_iso(), result
                rollback["next_step"] = step.index + 1
                self.journal.save()
        except StateRefused as refused:
            self.out(f"rollback halted: {refused}")
            return self._finish("halted", f"rollback: {refused}", ExitCode.FAILED)
        except _Halt as halt:
            self.out(f"rollback halted: {halt.reason}")
            return self._finish("halted", f"rollback: {halt.reason}", halt.exit_code)
        return self._finish("rolled-back", None, ExitCode.OK)

    def _restore(self, step: RollbackStep) -> str:
        region = self.config.region(step.region)
        target = self.registry(region)
        current = self._in_region(region, lambda: target.head_manifest(region.repository, step.tag))
        if current == step.restore_to:
            return "already restored"
        if current != step.moved_to:
            note = f"left alone: it points at {current or 'nothing'} now, not at this rollout's digest"
            self.journal.event("rollback-skip", wave=step.wave, region=step.region, tag=step.tag, detail=note)
            return note
        if step.restore_to is not None:
            restore_to = step.restore_to
            # The previous digest comes from the state repository: it is tagged only if it verifies here.
            self._verify_in(region, restore_to, purpose=f"will not point {step.tag} back: ")
            raw, media_type, _ = self._in_region(region, lambda: target.get_manifest(region.repository, restore_to))
            self._in_region(region, lambda: target.put_manifest(region.repository, step.tag, raw, media_type))
            self.journal.event("restore-tag", wave=step.wave, region=step.region, tag=step.tag,
                               **{"from": current, "to": restore_to})
            return f"restored to {restore_to}"
        return self._remove_created_tag(region, target, step, current)

    def _remove_created_tag(self, region: Region, target: Registry, step: RollbackStep, current: str) -> str:
        def delete_tag() -> int | None:
            """None when the tag is gone; else the status with which the registry refused deleting a tag."""
            try:
                target.delete_manifest(region.repository, step.tag)
            except RegistryUnreachable:
                raise
            except RegistryError as exc:
                return exc.status or 0
            return None

        refused = self._in_region(region, delete_tag)
        how = "tag deleted"
        if refused is not None:
            if refused not in (400, 405) or self.record["present_before"].get(region.name, True):
                note = f"cannot delete the tag on this registry ({refused}) and the image predates the rollout"
                self.journal.event("rollback-skip", wave=step.wave, region=step.region, tag=step.tag, detail=note)
                return note
            # The image came with this rollout: deleting it (by digest) removes the tags it created.
            self._in_region(region, lambda: target.delete_manifest(region.repository, step.moved_to))
            how = "image deleted (it came with this rollout; the registry deletes by digest only)"
        self.journal.event("delete-tag", wave=step.wave, region=step.region, tag=step.tag,
                           detail=how, **{"from": current, "to": None})
        return how


class _RegionDown(ImagebuildError):
    """A region's registry did not answer a verification (retried, then the run halts with exit 3)."""

    exit_code = ExitCode.ENVIRONMENT


def _result_dict(result: Any) -> dict[str, Any]:
    data = asdict(result)
    data["outcome"] = str(getattr(result.outcome, "value", result.outcome))
    return data


# --- entry points (the CLI calls these) -----------------------------------------------------


def _trust(config: ReleaseConfig) -> TrustConfig:
    return load_trust_config(config.trust_path)


def check_source(trust: TrustConfig, image: str) -> str:
    """The source must verify in staging (signed, with trust's attestations) before anything moves."""
    with Verifier(trust, cache_ttl_seconds=0) as verifier:
        verdict = verifier.verify(image)
    if verdict.unreachable:
        raise RolloutError(f"staging registry unreachable: {verdict.reason}", ExitCode.ENVIRONMENT)
    if not verdict.allowed:
        raise RolloutError(f"refusing to roll out {image}: it does not verify in staging: {verdict.reason}")
    return str(verdict.reason)


def unpullable(region: Region, needs: frozenset[str]) -> str:
    return (f"its engines pull {', '.join(sorted(region.compressions or ()))} layers (release.yaml compressions), "
            f"and the image has {', '.join(sorted(needs - (region.compressions or frozenset())))} layers: release a "
            f"variant compressed for this region (matrix compression) instead")


def check_pullable(config: ReleaseConfig, image: str) -> None:
    """Every region's engines can pull the image's layers (release.yaml `compressions:`): checked in staging
    before anything moves, so a zstd image never reaches the canary of a rollout that a gzip-only region
    would halt. The verify step checks each region's copy again."""
    limited = [region for region in config.regions if region.compressions is not None]
    if not limited:
        return
    ref = ImageRef.parse(image)
    assert ref.digest is not None
    with Registry(ref.registry, retry=REGION_RETRIES) as registry:
        needs = pull_families(registry, ref.repository, ref.digest)
    for region in limited:
        if not region.reads(needs):
            raise RolloutError(f"refusing to roll out {image}: region {region.name}: {unpullable(region, needs)}")


def refuse_quarantined(config: ReleaseConfig, digest: str, image: str) -> None:
    """A quarantined digest (`imagebuild rescan` found it failing the gate) goes no further."""

    why = refusal(config, digest)
    if why:
        raise RolloutError(f"refusing to roll out {image}: {why}")


def start(config: ReleaseConfig, image: str, channels: tuple[str, ...], local_dir: Path, out: Output,
          runtime: Runtime | None = None) -> int:
    runtime = runtime or Runtime()
    ref = ImageRef.parse(image)
    if not ref.digest:
        raise RolloutError(f"{image}: give the image by digest (REF@sha256:...)", ExitCode.BAD_INPUT)
    steps = plan_rollout(config, ref.digest, channels)
    channels = check_channels(config, channels)  # each once, as planned
    refuse_quarantined(config, ref.digest, image)
    trust = _trust(config)
    rollout_id = new_rollout_id()
    store = open_store(config)
    record = new_record(config, rollout_id, image, ref.digest, channels, steps)
    journal = Journal(store, local_dir, record)
    lease = lease_for(config, store, record, runtime.timing)  # a bad kubeconfig says so before the verification
    try:
        out(f"source {image}: {check_source(trust, image)}")
        check_pullable(config, image)
        lease.acquire()
    except BaseException:
        lease.close()
        raise
    journal.event("start", to=ref.digest, detail=f"{len(steps)} steps over waves "
                                                  f"{', '.join(w.name for w in config.waves)}")
    journal.save()
    for channel in channels:
        store.write(state_tag("channel", channel), {"rollout": rollout_id, "at": now_iso()}, MARKER_TYPE)
    out(f"rollout {rollout_id}: {image} -> {', '.join(channels)}")
    return _run(config, trust, journal, lease, out, runtime, lambda r: r.run())


def _run(config: ReleaseConfig, trust: TrustConfig, journal: Journal, lease: ChannelLease, out: Output,
         runtime: Runtime,
         action: Callable[[Reconciler], int]) -> int:
    reconciler = Reconciler(config, trust, journal, lease, out, runtime)
    try:
        return action(reconciler)
    except LeaseHeld:
        raise
    except BaseException:
        lease.release()
        raise
    finally:
        reconciler.close()
        if runtime.on_record is not None:
            runtime.on_record(journal.record)


def _reopen(config: ReleaseConfig, rollout_id: str, local_dir: Path,
            timing: Timing | None = None) -> tuple[Journal, ChannelLease]:
    store = open_store(config)
    record = load_record(store, rollout_id, config)
    return Journal(store, local_dir, record), lease_for(config, store, record, timing)


def _reload(config: ReleaseConfig, journal: Journal, lease: ChannelLease) -> RolloutRecord:
    """The record as it stands now that we hold the lease (checked again); the lease is let go on a refusal."""
    try:
        journal.record = load_record(journal.store, journal.record["id"], config)
    except BaseException:
        lease.release()
        raise
    return journal.record


def check_resumable_source(trust: TrustConfig, record: RolloutRecord) -> str:
    """The record's source names its digest and verifies in staging now, as `start` demanded."""
    try:
        ref = parse_image(record["source"])
    except ValueError as exc:
        raise StateRefused(f"rollout {record['id']}: its source '{safe_text(record['source'], 100)}' is not an image "
                           f"reference: {exc}") from None
    if ref.digest != record["digest"]:
        raise StateRefused(f"rollout {record['id']}: its source '{safe_text(record['source'], 100)}' does not name "
                           f"its digest {record['digest']}")
    return check_source(trust, record["source"])


def resume(config: ReleaseConfig, rollout_id: str, local_dir: Path, out: Output,
           runtime: Runtime | None = None) -> int:
    runtime = runtime or Runtime()
    journal, lease = _reopen(config, rollout_id, local_dir, runtime.timing)
    record = journal.record
    if record["status"] == "completed":
        out(f"rollout {rollout_id} is already completed")
        return ExitCode.OK
    if record["status"] in ("aborted", "rolling-back", "rolled-back"):
        raise RolloutError(f"rollout {rollout_id} is {record['status']}: only `rollback` applies to it now")
    refuse_quarantined(config, record["digest"], record["source"])
    trust = _trust(config)
    check_resumable_source(trust, record)
    verified = (record["digest"], record["source"])
    lease.acquire()
    record = _reload(config, journal, lease)
    if (record["digest"], record["source"]) != verified:  # the source checked above is the one resumed
        lease.release()
        raise StateRefused(f"rollout {rollout_id}: its record changed its image while we took the lease")
    record["status"] = "running"
    record["reason"] = None
    journal.event("resume", detail=f"from step {record['next_step']}")
    journal.save()
    return _run(config, trust, journal, lease, out, runtime, lambda r: r.run())


def rollback(config: ReleaseConfig, rollout_id: str, local_dir: Path, out: Output,
             runtime: Runtime | None = None) -> int:
    runtime = runtime or Runtime()
    journal, lease = _reopen(config, rollout_id, local_dir, runtime.timing)
    if journal.record["status"] == "rolled-back":
        out(f"rollout {rollout_id} is already rolled back")
        return ExitCode.OK
    trust = _trust(config)
    lease.acquire()
    _reload(config, journal, lease)
    return _run(config, trust, journal, lease, out, runtime, lambda r: r.rollback())


def abort(config: ReleaseConfig, rollout_id: str, local_dir: Path, out: Output,
          runtime: Runtime | None = None) -> int:
    runtime = runtime or Runtime()
    journal, lease = _reopen(config, rollout_id, local_dir, runtime.timing)
    record = journal.record
    if record["status"] in ("completed", "rolled-back", "aborted"):
        out(f"rollout {rollout_id} is {record['status']}; nothing to abort")
        return ExitCode.OK
    journal.store.write(record_tag(rollout_id) + ".abort", {"by": who()["user"], "at": now_iso()}, MARKER_TYPE)
    if record["status"] == "running":
        out(f"abort requested: rollout {rollout_id} stops before its next step")
        return ExitCode.OK
    lease.acquire()  # halted: nobody runs it; mark it aborted ourselves
    try:
        journal.record = load_record(journal.store, rollout_id, config)
        journal.record["status"] = "aborted"
        journal.event("aborted", detail="aborted while halted")
        journal.save()
    finally:
        lease.release()
    tell(runtime.notify, journal, "rollout.aborted", "aborted while halted")
    out(f"rollout {rollout_id} aborted")
    return ExitCode.OK


def approve(config: ReleaseConfig, rollout_id: str, wave: str, local_dir: Path, out: Output) -> int:
    journal, _ = _reopen(config, rollout_id, local_dir)
    if wave not in journal.record["waves"]:
        raise RolloutError(f"rollout {rollout_id} has no wave '{wave}' "
                           f"(its waves: {', '.join(journal.record['waves'])})", ExitCode.BAD_INPUT)
    journal.store.write(record_tag(rollout_id) + f".approve-{wave}", {"by": who()["user"], "at": now_iso(),
                                                                      "who": who()}, MARKER_TYPE)
    out(f"wave {wave} of rollout {rollout_id} approved")
    return ExitCode.OK


def latest_rollout(config: ReleaseConfig, channels: Iterable[str]) -> str | None:
    store = open_store(config)
    found: list[tuple[str, str]] = []
    try:
        for channel in channels:
            pointer = store.read(state_tag("channel", channel), MARKER_TYPE)
            if not pointer or not pointer.get("rollout"):
                continue
            rollout = pointer["rollout"]
            if not isinstance(rollout, str) or not ROLLOUT_ID_PATTERN.fullmatch(rollout):
                # It becomes a tag in a URL: only a rollout ID's grammar gets that far.
                raise StateRefused(f"{state_tag('channel', channel)} names '{safe_text(rollout, 100)}', not a rollout ID")
            found.append((str(pointer.get("at", "")), rollout))
    finally:
        store.registry.close()
    return max(found)[1] if found else None


def status(config: ReleaseConfig, rollout_id: str) -> dict[str, Any]:
    """The record plus, per region and tag, where the tag points now (read live from the region)."""
    store = open_store(config)
    record = load_record(store, rollout_id, config)
    wave_of = {region: wave.name for wave in config.waves for region in wave.regions}
    rows = []
    for region in config.regions:
        if region.name not in wave_of:
            continue
        registry = region_registry(region)
        try:
            for tag in record["channels"]:
                try:
                    current: str | None = registry.head_manifest(region.repository, tag)
                    error = None
                except RegistryError as exc:
                    current, error = None, str(exc)
                key = previous_key(region.name, tag)
                rows.append({"wave": wave_of[region.name], "region": region.name, "registry": region.registry,
                             "repository": region.repository, "tag": tag, "current": current,
                             "previous": record["previous"].get(key), "previous_recorded": key in record["previous"],
                             "at_rollout_digest": current == record["digest"], "error": error,
                             "wave_state": record["waves"][wave_of[region.name]]["state"]})
        finally:
            registry.close()
    channel_lease = lease_for(config, store, record)
    try:
        lease = channel_lease.holder()
    finally:
        channel_lease.close()
    return {"id": record["id"], "status": record["status"], "reason": record.get("reason"),
            "digest": record["digest"], "source": record["source"], "channels": record["channels"],
            "next_step": record["next_step"], "steps": len(record["steps"]), "waves": record["waves"],
            "tags": rows, "rollback": record.get("rollback"),
            "lease": lease,
            "events": len(record["events"]), "updated_at": record.get("updated_at")}
