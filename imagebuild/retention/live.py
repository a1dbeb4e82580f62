"""What `imagebuild gc` keeps: the live set of one repository, from what was read there and from the rollout state.

Pure: the registry was read before (retention.gc.read_view) and is changed after. A repository is
seen as its tags and the manifests read from it (RepositoryView). The live set starts from roots:
- every tag that is not cosign's (`sha256-<hex>[.sig|.att|.sbom]`): channel tags, release tags, and
  any tag a person made, which is theirs to delete, not ours;
- the digests the rollout state names (retention.state: running rollouts, each channel's latest
  rollout and its rollback targets, the last N releases of each channel, quarantine marks).
From each live manifest: the children of an index, its cosign tags (signature, attestations, SBOM),
the OCI referrers fallback tag `sha256-<hex>` and any manifest whose `subject` it is. Everything
else read is dead, and is deleted by digest in `order`: a manifest before whatever hangs off it, so
a gc stopped half-way leaves what it has not deleted yet still reachable (the next run finds a dead
signature by its tag and a dead child by its own signature tag).
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from imagebuild.oci.copy import cosign_tag

COSIGN_SUFFIXES = ("sig", "att", "sbom")
# cosign's tags and the referrers fallback tag: the subject's digest, then what hangs off it.
_COSIGN_TAG = re.compile(r"sha256-([0-9a-f]{64})(?:\.(sig|att|sbom))?")


def cosign_tag_subject(tag: str) -> str | None:
    """`sha256-<hex>.sig` -> `sha256:<hex>`: the image a cosign (or referrers fallback) tag hangs off; None
    for any other tag."""
    match = _COSIGN_TAG.fullmatch(tag)
    return f"sha256:{match.group(1)}" if match else None


def hanging_tags(digest: str) -> tuple[str, ...]:
    """The tags that hang off `digest`: cosign's three and the referrers fallback tag."""
    return (*(cosign_tag(digest, suffix) for suffix in COSIGN_SUFFIXES), cosign_tag(digest))


@dataclass(frozen=True)
class Blob:
    digest: str
    size: int


@dataclass(frozen=True)
class ManifestView:
    """One manifest as read: its own size, what it points at (children of an index; config and layers)."""

    digest: str
    size: int
    media_type: str
    children: tuple[str, ...] = ()
    blobs: tuple[Blob, ...] = ()
    subject: str | None = None


@dataclass
class RepositoryView:
    registry: str
    repository: str
    tags: dict[str, str]  # tag -> the manifest digest it names
    manifests: dict[str, ManifestView] = field(default_factory=dict)  # every manifest read, by digest
    missing: set[str] = field(default_factory=set)  # digests asked for and not there

    @property
    def where(self) -> str:
        return f"{self.registry}/{self.repository}"


@dataclass(frozen=True)
class Collection:
    """One repository judged: what stays (and the first reason found), what goes, in the order it goes."""

    view: RepositoryView
    live: dict[str, str]  # digest -> why it is kept
    dead: tuple[str, ...]  # digests to delete, each before what hangs off it

    @property
    def dead_tags(self) -> dict[str, str]:
        """The tags that go with the dead manifests (Distribution deletes a manifest's tags with it)."""
        dead = set(self.dead)
        return {tag: digest for tag, digest in sorted(self.view.tags.items()) if digest in dead}


def short(digest: str) -> str:
    return digest.split(":", 1)[-1][:12]


def is_root_tag(tag: str) -> bool:
    """What a region keeps by its tag alone: every tag but cosign's."""
    return cosign_tag_subject(tag) is None


def collect(view: RepositoryView, roots: Mapping[str, str],
            root_tag: Callable[[str], bool] = is_root_tag) -> Collection:
    """Judge `view`: `roots` maps digests the rollout state keeps to why. Roots missing from the registry
    keep nothing (and are not an error: a rollback target in one region may never have reached another).
    `root_tag` says which tags keep what they name (the cache repository's keeps fewer: retention.cache)."""
    queue: deque[tuple[str, str]] = deque((digest, f"tag {tag}") for tag, digest in sorted(view.tags.items())
                                          if root_tag(tag))
    queue.extend(sorted(roots.items()))
    by_subject: dict[str, list[str]] = {}
    for manifest in view.manifests.values():
        if manifest.subject is not None:
            by_subject.setdefault(manifest.subject, []).append(manifest.digest)
    live: dict[str, str] = {}
    while queue:
        digest, why = queue.popleft()
        if digest in live:
            continue
        live[digest] = why
        found = view.manifests.get(digest)
        if found is not None:
            queue.extend((child, f"in index {short(digest)}") for child in found.children)
        for tag in hanging_tags(digest):
            if tag in view.tags:
                queue.append((view.tags[tag], f"{tag.rpartition('.')[2] if '.' in tag else 'referrers'} of "
                                              f"{short(digest)}"))
        queue.extend((referrer, f"referrer of {short(digest)}") for referrer in sorted(by_subject.get(digest, ())))
    dead = [digest for digest in view.manifests if digest not in live]
    return Collection(view, live, tuple(order(view, dead)))


def _hangs_off(view: RepositoryView, dead: set[str]) -> dict[str, list[str]]:
    """dead manifest -> the dead manifests that hang off it (its children, tags and referrers)."""
    below: dict[str, list[str]] = {digest: [] for digest in dead}
    for digest in sorted(dead):
        manifest = view.manifests[digest]
        below[digest].extend(child for child in manifest.children if child in dead)
        below[digest].extend(view.tags[tag] for tag in hanging_tags(digest) if view.tags.get(tag) in dead)
        if manifest.subject in dead:
            below[manifest.subject].append(digest)
    return below


def order(view: RepositoryView, dead: Iterable[str]) -> list[str]:
    """The dead manifests, each after every dead manifest it hangs off (breadth first from the tops)."""
    dead_set = set(dead)
    below = _hangs_off(view, dead_set)
    above: dict[str, int] = {digest: 0 for digest in dead_set}
    for children in below.values():
        for child in children:
            above[child] += 1
    ordered: list[str] = []
    ready = deque(sorted(digest for digest, count in above.items() if count == 0))
    while ready:
        digest = ready.popleft()
        ordered.append(digest)
        for child in below[digest]:
            above[child] -= 1
            if above[child] == 0:
                ready.append(child)
    # A cycle can only come from forged tags (a signature tag naming its own subject): delete it last.
    ordered.extend(sorted(dead_set - set(ordered)))
    return ordered


@dataclass(frozen=True)
class Reclaim:
    """What Distribution's garbage collection frees in one registry once the dead manifests are gone."""

    manifests: int
    blobs: int
    bytes: int


def reclaimable(collections: Iterable[Collection]) -> Reclaim:
    """Blobs (manifest bytes, configs, layers) that only dead manifests of these repositories reference.

    Collections of one registry together: its garbage collection is global, so a layer that a live
    manifest of any of them still names stays. Blobs shared with repositories outside gc's view would
    stay too; this figure does not know of them, so it is what is freed at most."""
    collections = list(collections)
    live: set[str] = set()
    dead: dict[str, int] = {}
    manifests = 0
    for collection in collections:
        for digest in collection.live:
            manifest = collection.view.manifests.get(digest)
            if manifest is not None:
                live.add(digest)
                live.update(blob.digest for blob in manifest.blobs)
    for collection in collections:
        for digest in collection.dead:
            manifest = collection.view.manifests[digest]
            manifests += 1
            dead.setdefault(digest, manifest.size)
            for blob in manifest.blobs:
                dead.setdefault(blob.digest, blob.size)
    freed = {digest: size for digest, size in dead.items() if digest not in live}
    return Reclaim(manifests, len(freed), sum(freed.values()))
