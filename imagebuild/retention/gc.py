"""`imagebuild gc`: read every region repository and the state repository, judge them (retention.live,
retention.state), and delete what is dead by digest, holding every channel's rollout lease.

Two phases, because Distribution deletes a manifest only while it accepts writes and sweeps blobs only
while it does not:
1. `collect_garbage` (registries online): take the lease of every channel (a rollout that holds one makes gc
   refuse, exit 4), read, judge, delete dead manifests in retention.live.order, then compact the state
   repository (finished records past the retention, archived locally first; their markers; expired
   leases of channels release.yaml no longer names). A dry run reads and judges only, and takes no lease.
2. `sweep` (the registry stopped, or restarted read-only): Distribution's own `garbage-collect`, then the
   bytes its storage holds, before and after.

Anything a registry returns is untrusted: manifests are checked against their digests (the client does),
parsed here field by field, and a document of the state that cannot be read makes gc refuse rather than
guess what it protects. A run stopped at any point leaves every remaining tag on a manifest that exists
(deleting a manifest deletes its tags with it) and a rerun finishes the job.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.config.release_file import ReleaseConfig
from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.source import Reader, load_document, safe_text
from imagebuild.oci import names
from imagebuild.oci.client import INDEX_TYPES, Registry, RegistryError, RegistryUnreachable
from imagebuild.retention.cache import CacheLive
from imagebuild.retention.live import (
    Blob,
    Collection,
    ManifestView,
    Reclaim,
    RepositoryView,
    collect,
    cosign_tag_subject,
    is_root_tag,
    reclaimable,
)
from imagebuild.retention.state import (
    RecordFacts,
    RecordUnreadable,
    Retention,
    StateJudgement,
    judge_state,
    record_facts,
)
from imagebuild.rollout import quarantine
from imagebuild.rollout.lease import open_lease
from imagebuild.rollout.plan import ROLLOUT_ID_PATTERN
from imagebuild.rollout.reconciler import Timing
from imagebuild.rollout.state import (
    LEASE_TYPE,
    MARKER_TYPE,
    RECORD_TYPE,
    StateRefused,
    StateStore,
    open_store,
    region_registry,
)

MAX_MANIFESTS = 200_000  # per repository: a registry that lists more is refused, not followed
_READERS = 8  # manifests read at once per repository
# gc's name as a lease holder: always the same, so a gc run again on the host where one was killed takes its
# lease over (rollout.lease.HolderPolicy), while a second gc, or any rollout, is refused until it ends or expires.
GC_HOLDER = "gc"
RECORD_PREFIX, MARKER_SEP, POINTER_PREFIX, LEASE_PREFIX = "rollout-", ".", "channel-", "lease-"


class GcError(ImagebuildError):
    """gc cannot go on: what it read cannot be trusted, or a deletion failed."""


class GcRefused(GcError):
    """A document gc needs cannot be read; nothing was deleted."""


def parse_manifest(digest: str, raw: bytes, media_type: str) -> ManifestView:
    """What a manifest points at, each digest checked; fields that are not descriptors are ignored (their
    blobs are then not counted as freed, which errs towards promising less)."""
    try:
        document = json.loads(raw)
    except ValueError:
        return ManifestView(digest, len(raw), media_type)
    if not isinstance(document, dict):
        return ManifestView(digest, len(raw), media_type)

    def descriptors(value: Any) -> list[dict[str, Any]]:
        items = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        return [d for d in items if isinstance(d, dict) and names.is_sha256_digest(d.get("digest"))
                and isinstance(d.get("size"), int) and not isinstance(d.get("size"), bool) and d["size"] >= 0]

    subject = document.get("subject")
    subject_digest = subject.get("digest") if isinstance(subject, dict) else None
    if media_type in INDEX_TYPES or document.get("mediaType") in INDEX_TYPES:
        children = tuple(d["digest"] for d in descriptors(document.get("manifests")))
        return ManifestView(digest, len(raw), media_type, children=children,
                            subject=subject_digest if names.is_sha256_digest(subject_digest) else None)
    blobs = tuple(Blob(d["digest"], d["size"]) for d in [*descriptors(document.get("config")),
                                                        *descriptors(document.get("layers"))])
    return ManifestView(digest, len(raw), media_type, blobs=blobs,
                        subject=subject_digest if names.is_sha256_digest(subject_digest) else None)


def read_view(registry: Registry, repository: str, candidates: Iterable[str] = ()) -> RepositoryView:
    """The repository's tags and every manifest reachable from them, from the subjects their cosign tags
    name, and from `candidates` (digests the rollout state names, which may be untagged here)."""
    tags: dict[str, str] = {}
    view = RepositoryView(registry.registry, repository, tags)
    listed = sorted(registry.list_tags(repository))
    if len(listed) > MAX_MANIFESTS:
        raise GcRefused(f"{view.where}: lists {len(listed)} tags, more than gc reads ({MAX_MANIFESTS})")

    def by_tag(tag: str) -> tuple[str, ManifestView | None]:
        found = registry.find_manifest(repository, tag)
        if found is None:
            return tag, None  # deleted between the listing and now
        raw, media_type, digest = found
        return tag, parse_manifest(digest, raw, media_type)

    def by_digest(digest: str) -> ManifestView | None:
        found = registry.find_manifest(repository, digest)
        return None if found is None else parse_manifest(digest, found[0], found[1])

    with ThreadPoolExecutor(_READERS) as pool:
        for tag, manifest in pool.map(by_tag, listed):
            if manifest is not None:
                tags[tag] = manifest.digest
                view.manifests.setdefault(manifest.digest, manifest)
        wanted = {cosign_tag_subject(tag) for tag in tags} | set(candidates)
        for manifest in list(view.manifests.values()):
            wanted.update(manifest.children)
        wanted.discard(None)
        while True:
            todo = sorted(d for d in wanted if d is not None and d not in view.manifests and names.is_sha256_digest(d))
            todo = [d for d in todo if d not in view.missing]
            if not todo:
                break
            if len(view.manifests) + len(todo) > MAX_MANIFESTS:
                raise GcRefused(f"{view.where}: more than {MAX_MANIFESTS} manifests; gc refuses to read on")
            for digest, manifest in zip(todo, pool.map(by_digest, todo)):
                if manifest is None:
                    view.missing.add(digest)
                    continue
                view.manifests[digest] = manifest
                wanted.update(manifest.children)
    return view


# --- the state repository -------------------------------------------------------------------------


@dataclass
class StateSnapshot:
    records: dict[str, RecordFacts]
    raw_records: dict[str, dict[str, Any]]
    pointers: dict[str, str]  # channel -> rollout ID
    quarantined: dict[str, str]  # digest -> reason
    markers: dict[str, str]  # marker tag -> the rollout ID it belongs to
    leases: dict[str, dict[str, Any] | None]  # lease tag -> the lease (None: unreadable)


def read_state(store: StateStore) -> StateSnapshot:
    where = f"{store.registry.registry}/{store.repository}"
    tags = sorted(store.registry.list_tags(store.repository))
    records: dict[str, RecordFacts] = {}
    raw: dict[str, dict[str, Any]] = {}
    pointers: dict[str, str] = {}
    markers: dict[str, str] = {}
    leases: dict[str, dict[str, Any] | None] = {}
    for tag in tags:
        if tag.startswith(RECORD_PREFIX):
            rollout_id, _, marker = tag[len(RECORD_PREFIX):].partition(MARKER_SEP)
            if not ROLLOUT_ID_PATTERN.fullmatch(rollout_id):
                continue
            if marker:
                markers[tag] = rollout_id
                continue
            try:
                document = store.read(tag, RECORD_TYPE)
                if document is None:
                    continue
                records[rollout_id] = record_facts(rollout_id, document)
                raw[rollout_id] = document
            except (StateRefused, RecordUnreadable) as exc:
                raise GcRefused(f"{where}:{tag}: {exc}; gc deletes nothing while a record it cannot read may name "
                                f"someone's rollback (fix or delete the tag, then run gc again)") from None
        elif tag.startswith(POINTER_PREFIX):
            try:
                pointer = store.read(tag, MARKER_TYPE)
            except StateRefused as exc:
                raise GcRefused(f"{where}:{tag}: {exc}; nothing was deleted") from None
            rollout = (pointer or {}).get("rollout")
            if not isinstance(rollout, str) or not ROLLOUT_ID_PATTERN.fullmatch(rollout):
                raise GcRefused(f"{where}:{tag}: names '{safe_text(rollout, 100)}', not a rollout ID; nothing was "
                                "deleted")
            pointers[tag[len(POINTER_PREFIX):]] = rollout
        elif tag.startswith(LEASE_PREFIX):
            try:
                leases[tag] = store.read(tag, LEASE_TYPE)
            except StateRefused:
                leases[tag] = None
    quarantined: dict[str, str] = {}
    try:
        for mark in quarantine.list_marks(store):
            digest = mark.get("digest")
            if names.is_sha256_digest(digest):
                quarantined[digest] = safe_text(mark.get("reason"), 200)
    except StateRefused as exc:
        raise GcRefused(f"{where}: a quarantine mark cannot be read: {exc}; nothing was deleted") from None
    return StateSnapshot(records, raw, pointers, quarantined, markers, leases)


# --- the plan ---------------------------------------------------------------------------------------


@dataclass
class GcPlan:
    config: ReleaseConfig
    retention: Retention
    state: StateSnapshot
    judgement: StateJudgement
    collections: dict[str, Collection]  # region name -> its repository judged
    compact_markers: tuple[str, ...]
    compact_leases: tuple[str, ...]

    def reclaim(self) -> dict[str, Reclaim]:
        """What each region registry's garbage collection frees at most, once the dead manifests are gone."""
        return reclaim_by_registry(self.collections.values())

    def to_dict(self) -> dict[str, Any]:
        reclaim = self.reclaim()
        return {
            "retention": {"keep_releases": self.retention.keep_releases,
                          "record_retention_s": self.retention.record_retention_s},
            "regions": [{"region": name, **collection_record(c)} for name, c in self.collections.items()],
            **reclaim_record(reclaim),
            "state": {"registry": self.config.state_registry, "repository": self.config.state_repository,
                      "records": len(self.state.records), "kept_records": dict(sorted(self.judgement.kept_records.items())),
                      "compacted_records": list(self.judgement.compacted_records),
                      "compacted_markers": list(self.compact_markers), "compacted_leases": list(self.compact_leases)},
        }


def collection_record(collection: Collection) -> dict[str, Any]:
    """One repository judged, as the report gives it: counts, what stays and why, what goes with its tags."""
    view = collection.view
    dead_tags: dict[str, list[str]] = {}
    for tag, digest in collection.dead_tags.items():
        dead_tags.setdefault(digest, []).append(tag)
    return {"registry": view.registry, "repository": view.repository, "tags": len(view.tags),
            "manifests": len(view.manifests), "live": len(collection.live),
            "kept": [{"digest": d, "why": why} for d, why in collection.live.items() if d in view.manifests],
            "dead": [{"digest": d, "media_type": view.manifests[d].media_type, "tags": dead_tags.get(d, [])}
                     for d in collection.dead]}


def reclaim_by_registry(collections: Iterable[Collection]) -> dict[str, Reclaim]:
    """retention.live.reclaimable for each registry's repositories together (its garbage collection is global)."""
    by_registry: dict[str, list[Collection]] = {}
    for collection in collections:
        by_registry.setdefault(collection.view.registry, []).append(collection)
    return {registry: reclaimable(group) for registry, group in sorted(by_registry.items())}


def reclaim_record(reclaim: Mapping[str, Reclaim]) -> dict[str, Any]:
    return {"registries": [{"registry": r, "manifests": x.manifests, "blobs": x.blobs, "bytes": x.bytes}
                           for r, x in reclaim.items()],
            "reclaimable_bytes": sum(x.bytes for x in reclaim.values())}


def plan_gc(config: ReleaseConfig, store: StateStore, registries: Mapping[str, Registry], retention: Retention,
            now: float) -> GcPlan:
    state = read_state(store)
    judgement = judge_state(state.records.values(), state.pointers, state.quarantined, retention, now)
    collections: dict[str, Collection] = {}
    for region in config.regions:
        view = read_view(registries[region.name], region.repository, judgement.candidates)
        collections[region.name] = collect(view, judgement.roots)
    compacted = set(judgement.compacted_records)
    markers = tuple(tag for tag, rollout in sorted(state.markers.items())
                    if rollout in compacted or rollout not in state.records)
    channels = set(config.channels)
    leases = tuple(tag for tag, lease in sorted(state.leases.items())
                   if tag[len(LEASE_PREFIX):] not in channels and _expired(lease, now))
    return GcPlan(config, retention, state, judgement, collections, markers, leases)


def _expired(lease: Mapping[str, Any] | None, now: float) -> bool:
    expires = (lease or {}).get("expires_at")
    return isinstance(expires, (int, float)) and not isinstance(expires, bool) and expires <= now


# --- applying it -----------------------------------------------------------------------------------


@dataclass
class GcRun:
    """What an applied gc did, in order (the report's `deleted`)."""

    deleted: list[dict[str, Any]] = field(default_factory=list)
    archived: list[str] = field(default_factory=list)


@dataclass
class GcOptions:
    retention: Retention = field(default_factory=Retention)
    apply: bool = False
    state_dir: Path = Path(".imagebuild/rollouts")
    timing: Timing = field(default_factory=Timing)  # the lease's settle wait and clocks, as a rollout's
    # Called before each deletion with what is about to go: where the tests stop a gc part-way.
    before_delete: Callable[[dict[str, Any]], None] = lambda entry: None


def _delete(registry: Registry, repository: str, digest: str, entry: dict[str, Any], run: GcRun,
            options: GcOptions) -> None:
    options.before_delete(entry)
    try:
        gone = registry.delete_manifest(repository, digest)
    except RegistryError as exc:
        raise GcError(f"{registry.registry}/{repository}@{digest}: the registry refused the deletion: {exc}; "
                      "run gc again once it accepts deletions (storage.delete.enabled)") from None
    entry = {**entry, "result": "deleted" if gone else "already gone"}
    run.deleted.append(entry)
    quarantine.audit(options.state_dir, {"event": "gc-delete", **entry})


def collect_garbage(config: ReleaseConfig, options: GcOptions,
                    on_event: Callable[[str], None] = lambda line: None) -> tuple[GcPlan, GcRun]:
    """Judge (and with options.apply, delete) what release.yaml's regions and state repository hold."""
    store = open_store(config)
    registries: dict[str, Registry] = {}
    run = GcRun()
    lease = None
    try:
        for region in config.regions:
            registries[region.name] = region_registry(region)
        if options.apply:
            lease = open_lease(config, store, config.channels, GC_HOLDER,
                               settle_s=options.timing.settle_s, sleep=options.timing.sleep,
                               clock=options.timing.lease_clock)
            lease.acquire()  # LeaseHeld (exit 4) when a rollout holds a channel
            on_event(f"holding the lease of {', '.join(config.channels)}")
        plan = plan_gc(config, store, registries, options.retention, options.timing.clock())
        if not options.apply:
            return plan, run
        assert lease is not None
        for name, collection in plan.collections.items():
            _delete_dead(registries[name], collection, {"region": name}, run, options, lease.renew)
            on_event(f"{name}: {len(collection.dead)} dead manifest(s) deleted")
        _compact(store, plan, run, options)
        return plan, run
    except RegistryUnreachable as exc:
        raise GcError(f"{exc}; run gc again once the registry answers", exit_code=ExitCode.ENVIRONMENT) from None
    finally:
        if lease is not None:
            lease.release()
            lease.close()
        for registry in registries.values():
            registry.close()
        store.registry.close()


def _delete_dead(registry: Registry, collection: Collection, entry: dict[str, Any], run: GcRun,
                 options: GcOptions, renew: Callable[[], None] = lambda: None) -> None:
    """Every dead manifest of one repository by digest, in retention.live.order (each before what hangs off it)."""
    tags_of: dict[str, list[str]] = {}
    for tag, digest in collection.dead_tags.items():
        tags_of.setdefault(digest, []).append(tag)
    for digest in collection.dead:
        renew()
        _delete(registry, collection.view.repository, digest,
                {**entry, "registry": collection.view.registry, "repository": collection.view.repository,
                 "digest": digest, "tags": tags_of.get(digest, [])}, run, options)


# --- the build side: the layer cache and the staging release repository (retention.cache) ----------


@dataclass
class CachePlan:
    live: CacheLive
    collections: dict[str, Collection]  # "cache", "release" -> that repository judged

    def to_dict(self) -> dict[str, Any]:
        return {"repositories": [{"role": role, **collection_record(c)} for role, c in self.collections.items()],
                "live_tags": len(self.live.tags), **reclaim_record(reclaim_by_registry(self.collections.values()))}


def collect_cache_garbage(registry_host: str, repositories: Mapping[str, str], live: CacheLive, options: GcOptions,
                          on_event: Callable[[str], None] = lambda line: None) -> tuple[CachePlan, GcRun]:
    """Judge (and with options.apply, delete) what a matrix's cache ("cache") and staging release ("release")
    repositories hold: `repositories` maps each role to its repository on `registry_host`."""
    run = GcRun()
    try:
        with Registry(registry_host) as registry:
            collections: dict[str, Collection] = {}
            for role, repository in repositories.items():
                view = read_view(registry, repository, live.digests)
                collections[role] = collect(view, live.digests, live.root_tag() if role == "cache" else is_root_tag)
            plan = CachePlan(live, collections)
            if options.apply:
                for role, collection in collections.items():
                    _delete_dead(registry, collection, {"role": role}, run, options)
                    on_event(f"{collection.view.where}: {len(collection.dead)} dead manifest(s) deleted")
            return plan, run
    except RegistryUnreachable as exc:
        raise GcError(f"{exc}; run gc again once the registry answers", exit_code=ExitCode.ENVIRONMENT) from None


def _compact(store: StateStore, plan: GcPlan, run: GcRun, options: GcOptions) -> None:
    """Old finished records (archived to STATE_DIR/gc-archive first), then markers and stale leases."""
    archive = options.state_dir / "gc-archive"
    where = {"registry": store.registry.registry, "repository": store.repository}
    for rollout_id in plan.judgement.compacted_records:
        archive.mkdir(parents=True, exist_ok=True)
        path = archive / f"{rollout_id}.json"
        path.write_text(json.dumps(plan.state.raw_records[rollout_id], indent=2, sort_keys=True) + "\n")
        run.archived.append(str(path))
        _delete_state(store, f"{RECORD_PREFIX}{rollout_id}", {**where, "record": rollout_id}, run, options)
    for tag in (*plan.compact_markers, *plan.compact_leases):
        _delete_state(store, tag, {**where, "tag": tag}, run, options)


def _delete_state(store: StateStore, tag: str, entry: dict[str, Any], run: GcRun, options: GcOptions) -> None:
    digest = store.registry.head_manifest(store.repository, tag)
    if digest is None:
        return
    _delete(store.registry, store.repository, digest, {**entry, "digest": digest, "tags": [tag]}, run, options)


# --- phase 2: the registry's own garbage collection ------------------------------------------------


@dataclass(frozen=True)
class SweepResult:
    registry: str
    config: str
    root: str
    before: tuple[int, int]  # blobs, bytes in the storage before
    after: tuple[int, int]
    output: str  # the tail of garbage-collect's own output

    @property
    def freed_bytes(self) -> int:
        return self.before[1] - self.after[1]

    def to_dict(self) -> dict[str, Any]:
        return {"registry": self.registry, "config": self.config, "root": self.root,
                "blobs_before": self.before[0], "bytes_before": self.before[1], "blobs_after": self.after[0],
                "bytes_after": self.after[1], "freed_bytes": self.freed_bytes}


@dataclass(frozen=True)
class DistributionConfig:
    path: Path
    root: Path  # storage.filesystem.rootdirectory
    addr: str  # http.addr: where the registry answers when it runs


def read_distribution_config(path: Path) -> DistributionConfig:
    """The two keys gc needs from a Distribution config.yml; an InputError (file, line, key) otherwise."""
    doc = load_document(path)
    r = Reader(doc)
    top = r.mapping(doc.data, ())
    storage = r.mapping(top.get("storage"), ("storage",))
    filesystem = r.mapping(storage.get("filesystem"), ("storage", "filesystem"))
    root = filesystem.get("rootdirectory")
    if not isinstance(root, str) or not root.startswith("/"):
        raise r.error(("storage", "filesystem", "rootdirectory"), "must be an absolute path (gc sweeps the "
                      "filesystem driver only)")
    http = r.mapping(top.get("http"), ("http",))
    addr = http.get("addr")
    if not isinstance(addr, str) or not addr:
        raise r.error(("http", "addr"), "must be host:port")
    return DistributionConfig(path, Path(root), addr if not addr.startswith(":") else f"127.0.0.1{addr}")


def storage_bytes(root: Path) -> tuple[int, int]:
    """Blobs and their bytes in a Distribution filesystem store (each blob is one `data` file)."""
    count = total = 0
    for data in (root / "docker" / "registry" / "v2" / "blobs").glob("*/*/*/data"):
        count += 1
        total += data.stat().st_size
    return count, total


def _accepts_writes(addr: str) -> bool:
    with Registry(addr, retry=None) as registry:
        try:
            registry.check_access("imagebuild-gc/probe", push=True)
        except RegistryUnreachable:
            return False  # stopped
        except RegistryError:
            return False  # read-only (storage.maintenance.readonly): uploads refused
    return True


def sweep(config_path: Path, binary: str, runner: Any) -> SweepResult:
    """Distribution's `garbage-collect` on a registry that is stopped or read-only; refuses one that
    accepts uploads (a blob pushed while the sweep runs could be deleted under a manifest)."""
    config = read_distribution_config(config_path)
    if _accepts_writes(config.addr):
        raise GcError(f"the registry at {config.addr} ({config_path}) accepts uploads: stop it, or restart it with "
                      "storage.maintenance.readonly.enabled: true, then sweep; restart it writable afterwards "
                      "(which also empties its in-memory blob cache)")
    before = storage_bytes(config.root)
    result = runner.run([binary, "garbage-collect", str(config_path)], timeout=3600)
    if result.returncode != 0:
        raise GcError(f"{binary} garbage-collect {config_path} exited {result.returncode}: "
                      f"{safe_text(result.output[-2000:], 2000)}")
    return SweepResult(config.addr, str(config_path), str(config.root), before, storage_bytes(config.root),
                       result.output[-2000:])
