"""Copying an image by digest within or across registries, signatures and attestations included.

Only what the target lacks moves: a manifest the target already has by digest is skipped whole
(a registry accepts a manifest only once its blobs and children are there). Across registries
each blob is mounted from another repository of the target where earlier copies saw it, else
HEADed and, when absent, uploaded; on one registry it is mounted from the source repository. A
mount stands in for the HEAD (it answers "there" either way, and no byte moves). Uploads stream
from the source straight into PATCH windows (nothing held but a few reads), and the digest of
what was streamed is checked before the upload is committed; an interrupted window asks the
registry how much it holds and continues from there, and a source stream that breaks off is
reopened where it stopped (a Range request). The image and its own signature and attestation
tags are copied at once, their blobs through one pool. Manifests go after their blobs, children
(and, with signatures, each child's signature and attestation tags) before their index, and tags
after every manifest they reach, so no tag ever names something incomplete and an index in the
target has all of its children signed there.
"""
from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx

from imagebuild.core.errors import ImagebuildError
from imagebuild.oci.auth import AuthDenied
from imagebuild.oci.client import INDEX_TYPES, OCI_INDEX, Registry, RegistryAuthError, RegistryError
from imagebuild.oci.locations import BlobLocations
from imagebuild.oci.names import BadName, check_descriptor

MiB = 1024 * 1024
READ_SIZE = MiB  # one read from the source, the most a streamed upload holds at once
SMALL_BLOB = MiB  # configs, signatures, small layers: read whole (digest checked), one PUT
MOUNT_HINTS = 2  # repositories tried for a mount, from where earlier copies put a blob
# cosign's tag suffixes for a digest's signatures, attestations and attached SBOMs.
COSIGN_SUFFIXES = ("sig", "att", "sbom")


@dataclass(frozen=True)
class CopyOptions:
    # A blob larger than this goes in PATCH windows of this size (Content-Range), streamed from the
    # source; an interruption costs at most one window.
    chunk_size: int = 32 * MiB
    signatures: bool = False  # also copy cosign's sha256-<hex>.sig/.att/.sbom tags and OCI referrers
    concurrency: int = 8  # blobs moved at once (those of the image, its signatures and attestations)
    resume_attempts: int = 5  # per blob: continuing an interrupted upload from where the registry stands
    # Where blobs were seen, for cross-repository mounts; None: the user's cache file
    # (oci_locations.default_cache_dir()); BlobLocations() keeps them in memory only.
    locations: BlobLocations | None = field(default=None, compare=False)
    # What the caller already read from the source and checked (push: the signature and
    # attestations it verified, and the image's manifest), used instead of reading it again:
    # manifests by the source reference they were read as (a tag or a digest) as (raw, media
    # type, digest), blobs by digest.
    known_manifests: Mapping[str, tuple[bytes, str, str]] = field(default_factory=dict, compare=False)
    known_blobs: Mapping[str, bytes] = field(default_factory=dict, compare=False)


@dataclass
class CopyStats:
    """What one copy moved, for reports, benchmarks and tests."""

    blobs_present: int = 0  # already in the target repository
    blobs_mounted: int = 0  # cross-repository mounts on the same registry
    blobs_uploaded: int = 0
    bytes_uploaded: int = 0  # blob bytes sent, counting any resent after an interruption
    manifests_present: int = 0
    manifests_put: int = 0
    tags_put: int = 0
    uploads_resumed: int = 0  # interrupted chunk uploads continued from the registry's offset
    uploads_restarted: int = 0  # interrupted uploads whose session was gone: the blob started over
    source_reopened: int = 0  # source blob streams that broke off and were read again from there
    signature_tags: list[str] = field(default_factory=list)
    referrers: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


@dataclass(frozen=True)
class CopyResult:
    digest: str
    media_type: str
    stats: CopyStats
    manifest: bytes = b""  # the manifest's bytes, for tagging it later without reading it again


_default: BlobLocations | None = None
_default_lock = threading.Lock()


def _default_locations() -> BlobLocations:
    """One cache per process, read once."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BlobLocations.default()
        return _default


def cosign_tag(digest: str, suffix: str | None = None) -> str:
    """`sha256:abc` -> `sha256-abc.sig` (cosign), or `sha256-abc` (the OCI referrers fallback tag)."""
    base = digest.replace(":", "-", 1)
    return f"{base}.{suffix}" if suffix else base


class _SourceBroke(ImagebuildError):
    """The source's blob stream broke off or ended early."""


class _Prefetch:
    """Reads a source stream on its own thread, a few pieces ahead, so that receiving from the
    source overlaps sending to the target (sockets and hashing release the GIL)."""

    DEPTH = 4  # pieces read ahead: at most DEPTH * READ_SIZE bytes held

    def __init__(self, stream: Iterator[bytes], stack: ExitStack):
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(self.DEPTH)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stream, stack), daemon=True,
                                        name="imagebuild-blob-prefetch")
        self._thread.start()

    def _put(self, item: bytes | BaseException | None) -> bool:
        while not self._stopped.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, stream: Iterator[bytes], stack: ExitStack) -> None:
        try:
            with stack:
                for piece in stream:
                    if not self._put(piece):
                        return
                self._put(None)
        except (RegistryError, httpx.HTTPError) as exc:
            self._put(exc)

    def items(self) -> Iterator[bytes]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        """Abandon the stream: the thread closes it after its current read; what it read ahead is dropped."""
        self._stopped.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


class _BlobReader:
    """One source blob read in order, reopened with a Range request wherever the upload needs it next."""

    def __init__(self, source: Registry, repository: str, digest: str, read_size: int, attempts: int):
        self.source, self.repository, self.digest, self.read_size = source, repository, digest, read_size
        self.attempts = attempts  # reopenings in a row before giving up
        self.reopened = 0
        self._prefetch: _Prefetch | None = None
        self._stream: Iterator[bytes] | None = None
        self._position = 0  # the source offset of the next byte `pieces` yields
        self._leftover = b""

    def _open(self, offset: int) -> Iterator[bytes]:
        self.reset()
        stack = ExitStack()
        response = stack.enter_context(self.source.open_blob(self.repository, self.digest, offset))
        self._prefetch = _Prefetch(response.iter_bytes(self.read_size), stack)
        self._position, self._stream = offset, self._prefetch.items()
        return self._stream

    def pieces(self, offset: int, length: int) -> Iterator[bytes]:
        """The bytes [offset, offset + length) of the blob, in pieces of at most read_size.

        A source stream that breaks off or stalls is opened again where it stopped, without the
        consumer noticing: a PATCH being fed keeps going (cut short, Distribution would drop it).
        """
        stream = self._stream if self._stream is not None and self._position == offset else None
        remaining = length
        breaks = 0
        while remaining > 0:
            try:
                if stream is None:
                    stream = self._open(offset + length - remaining)
                piece, self._leftover = self._leftover or next(stream, b""), b""
            except (RegistryError, httpx.HTTPError) as exc:
                self.reset()
                stream = None
                breaks += 1
                self.reopened += 1
                if breaks > self.attempts:
                    raise _SourceBroke(str(exc)) from None
                continue
            if not piece:
                self.reset()
                raise _SourceBroke(f"{self.digest}: the source ended {remaining} bytes early")
            if len(piece) > remaining:
                piece, self._leftover = piece[:remaining], piece[remaining:]
            self._position += len(piece)
            remaining -= len(piece)
            yield piece

    def reset(self) -> None:
        """Forget the open stream (it broke, or the upload goes on from elsewhere)."""
        if self._prefetch is not None:
            self._prefetch.stop()
        self._prefetch, self._stream, self._leftover = None, None, b""

    close = reset


def _checked_descriptors(registry: Registry, repository: str, where: str, descriptors: object,
                         what: str) -> list[dict[str, Any]]:
    """Descriptors a registry served (`where`: `@digest` or `:tag` of what listed them), every digest
    in the OCI grammar before any of them is requested."""
    listed = descriptors if isinstance(descriptors, list) else [descriptors]
    try:
        return [check_descriptor(descriptor, what) for descriptor in listed]
    except BadName as exc:
        raise RegistryError(f"{registry.registry}/{repository}{where}: {exc}", registry=registry.registry,
                            repository=repository, operation="copy") from None


def _check_manifest(registry: Registry, repository: str, digest: str, document: object) -> dict[str, Any]:
    """A manifest's children, config and layers checked at once: a bad digest anywhere stops the copy
    before a request for any of them goes out."""
    if not isinstance(document, dict):
        raise RegistryError(f"{registry.registry}/{repository}@{digest}: the manifest is not a JSON object",
                            registry=registry.registry, repository=repository, operation="copy")
    if "manifests" in document:
        _checked_descriptors(registry, repository, f"@{digest}", document["manifests"], "child manifest")
    if "config" in document:
        _checked_descriptors(registry, repository, f"@{digest}", document["config"], "config")
    if "layers" in document:
        _checked_descriptors(registry, repository, f"@{digest}", document["layers"], "layer")
    return document


def _blobs(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Config and layers; non-distributable layers (foreign `urls`) stay where they are."""
    descriptors = [manifest["config"], *manifest.get("layers", [])] if "config" in manifest else []
    return [d for d in descriptors if not d.get("urls")]


class _Copier:
    def __init__(self, source: Registry, source_repository: str, target: Registry, target_repository: str,
                 options: CopyOptions, stats: CopyStats):
        self.source, self.source_repository = source, source_repository
        self.target, self.target_repository = target, target_repository
        self.options, self.stats = options, stats
        self.same_registry = source.url == target.url
        self.locations = options.locations if options.locations is not None else _default_locations()
        self._hints_refused = False
        self._tree: list[str] = []  # every manifest digest reached, for their signatures
        self._signed: set[str] = set()  # digests whose signatures and referrers are copied already
        self._signed_lock = threading.Lock()
        self._known = {found[2]: found for found in options.known_manifests.values()}
        # One pool for the blobs of every manifest copied at once (the image's, its signature's, its
        # attestations'), so `concurrency` bounds the whole copy. Its tasks never wait on it.
        self.blob_pool: ThreadPoolExecutor | None = None

    # --- manifests ------------------------------------------------------------------------

    def manifest(self, digest: str, tag: str | None = None, *, image: bool = True) -> tuple[bytes, str]:
        """Make the target hold manifest `digest` and everything it reaches, then name it `tag` (by its
        digest when None); its bytes and media type. `image`: part of the image (its signatures are copied)."""
        known = self._known.get(digest)
        raw, media_type, actual = known or self.source.get_manifest(self.source_repository, digest)
        if image:
            self._tree.append(actual)
        document = _check_manifest(self.source, self.source_repository, actual, json.loads(raw))
        if self.target.head_manifest(self.target_repository, actual) == actual:
            self.stats.add(manifests_present=1)
            for child in document.get("manifests", []) if image and media_type in INDEX_TYPES else []:
                self._tree.append(child["digest"])
            if tag is not None:
                self.target.put_manifest(self.target_repository, tag, raw, media_type)
                self.stats.add(tags_put=1)
            return raw, media_type
        if media_type in INDEX_TYPES:
            children = [child["digest"] for child in document.get("manifests", [])]
            for child in children:
                self.manifest(child, image=image)
            if image and self.options.signatures:
                # The index lands after every child's signatures and attestations: an index in the
                # target (what a rerun, and a rollout's copy step, look at first) is a whole one.
                self.signatures_of(children)
        elif "config" in document:
            self.blobs(_blobs(document))
        else:
            raise RegistryError(f"{self.source.registry}/{self.source_repository}@{digest}: cannot copy "
                                f"media type {media_type or 'unknown'}", registry=self.source.registry,
                                repository=self.source_repository, operation="copy")
        # A PUT by tag stores the manifest under its digest too: one request, not two.
        self.target.put_manifest(self.target_repository, tag or actual, raw, media_type)
        self.stats.add(manifests_put=1, tags_put=1 if tag else 0)
        return raw, media_type

    # --- blobs ----------------------------------------------------------------------------

    def blobs(self, descriptors: list[dict[str, Any]]) -> None:
        unique = list({d["digest"]: d for d in descriptors}.values())
        if len(unique) <= 1 or self.blob_pool is None:
            for descriptor in unique:
                self.blob(descriptor)
            return
        for done in [self.blob_pool.submit(self.blob, d) for d in unique]:
            done.result()

    def blob(self, descriptor: dict[str, Any]) -> None:
        digest, size = descriptor["digest"], int(descriptor.get("size", -1))
        if size < 0:
            size = self.source.blob_size(self.source_repository, digest) or 0
        # A mount answers "there" whether it linked the blob now or the target repository held it
        # already, so where a mount is possible it stands in for the HEAD; no byte moves either way.
        mounted, session = self._mount(digest, self._mount_candidates(digest))
        if mounted:
            self.stats.add(blobs_mounted=1)
            self._landed(digest)
            return
        if self.target.blob_size(self.target_repository, digest) is not None:
            if session is not None:
                self._cancel(session)
            self.stats.add(blobs_present=1)
            self._landed(digest)
            return
        location = session or self.target.start_upload(self.target_repository)
        if size <= SMALL_BLOB:
            self._upload_whole(location, digest)
        else:
            self._upload_chunked(location, digest, size)
        self.stats.add(blobs_uploaded=1)
        self._landed(digest)

    def _cancel(self, session: str) -> None:
        self.target._request("DELETE", session, repository=self.target_repository, operation="cancel upload")

    def _landed(self, digest: str) -> None:
        self.locations.remember(self.target.registry, digest, self.target_repository)

    def _mount_candidates(self, digest: str) -> list[str]:
        """Repositories of the target registry to mount from: the source repository on the same
        registry, then where earlier copies put the blob."""
        candidates = [self.source_repository] if self.same_registry else []
        if not self._hints_refused:
            candidates += [repository for repository in self.locations.hints(self.target.registry, digest)
                           if repository not in (self.target_repository, *candidates)][:MOUNT_HINTS]
        return candidates

    def _mount(self, digest: str, candidates: list[str]) -> tuple[bool, str | None]:
        """(mounted, the upload session the last refused mount opened, if any)."""
        session: str | None = None
        for repository in candidates:
            if session is not None:  # the previous mount was refused and opened a session: drop it
                self._cancel(session)
            try:
                session = self.target.try_mount(self.target_repository, digest, repository)
            except RegistryAuthError:
                # No pull on the hinted repository (token registries refuse the whole request):
                # upload instead, and stop guessing for the rest of this copy.
                self._hints_refused = True
                session = None
                continue
            if session is None:
                return True, None
            if repository != self.source_repository or not self.same_registry:
                self.locations.forget(self.target.registry, digest, repository)
        return False, session

    def _fail(self, operation: str, message: str, status: int | None = None) -> RegistryError:
        return RegistryError(f"{self.target.registry}/{self.target_repository}: {operation}: {message}",
                             registry=self.target.registry, repository=self.target_repository,
                             operation=operation, status=status)

    def _upload_whole(self, location: str, digest: str) -> None:
        content = self.options.known_blobs.get(digest)
        if content is None or "sha256:" + hashlib.sha256(content).hexdigest() != digest:
            content = self.source.get_blob(self.source_repository, digest)  # small; digest verified
        self.stats.add(bytes_uploaded=len(content))
        self._commit(location, digest, content)

    def _commit(self, location: str, digest: str, content: bytes = b"") -> None:
        # httpx's `params=` would replace the session's own query (its signed _state): merge instead.
        url = str(httpx.URL(location).copy_merge_params({"digest": digest}))
        response = self.target._request("PUT", url, content=content,
                                        headers={"Content-Type": "application/octet-stream"},
                                        repository=self.target_repository, operation="commit upload")
        if response.status_code == 201:
            return
        # A commit whose answer was lost and then retried finds its session gone: the blob is there.
        if response.status_code == 404 and self.target.blob_size(self.target_repository, digest) is not None:
            return
        raise self.target._fail(response, "commit upload", self.target_repository, digest)

    def _upload_chunked(self, location: str, digest: str, size: int) -> None:
        """Stream the blob from the source into PATCH windows of `chunk_size` bytes, nothing buffered
        beyond one read. After an interruption, ask the session how much it holds and go on from
        there, reading the source again from that offset (a Range request).

        Distribution 2.x signs the offset into the session URL and cancels a session asked about
        with a stale one (after a window that reached it but whose answer was lost): then the
        blob starts over in a new session.
        """
        reader = _BlobReader(self.source, self.source_repository, digest, min(self.options.chunk_size, READ_SIZE),
                             self.options.resume_attempts)
        hasher = hashlib.sha256()  # over the bytes [0, offset) the target acknowledged
        offset = 0
        interruptions = 0
        try:
            while offset < size:
                length = min(self.options.chunk_size, size - offset)
                window = hasher.copy()
                status, new_location = self._patch(location, reader, offset, length, window)
                if status == 202:
                    hasher, offset = window, offset + length
                    location = new_location or location
                    continue
                interruptions += 1
                if interruptions > self.options.resume_attempts:
                    raise self._fail("upload blob", f"{digest}: gave up after {interruptions - 1} interrupted "
                                     f"chunks (last: {'connection lost' if status == 0 else f'HTTP {status}'})",
                                     status or None)
                held = self.target.upload_offset(self.target_repository, location)
                if held is None or not offset <= held <= offset + length:
                    self.stats.add(uploads_restarted=1)
                    location = self.target.start_upload(self.target_repository)
                    hasher, offset = hashlib.sha256(), 0
                    continue
                self.stats.add(uploads_resumed=1)
                for piece in reader.pieces(offset, held - offset):  # kept by the registry: hash, don't send
                    hasher.update(piece)
                offset = held
        finally:
            reader.close()
            self.stats.add(source_reopened=reader.reopened)
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            self._cancel(location)
            raise RegistryError(f"{self.source.registry}/{self.source_repository}@{digest}: the blob streamed "
                                f"({offset} bytes) hashes to {actual}", registry=self.source.registry,
                                repository=self.source_repository, operation="GET blob")
        self._commit(location, digest)

    def _patch(self, location: str, reader: _BlobReader, offset: int, length: int,
               hasher: hashlib._Hash) -> tuple[int, str | None]:
        """Send one window: (status, the session's next URL); a lost connection, on either side, is status 0."""
        def body() -> Iterator[bytes]:
            for piece in reader.pieces(offset, length):
                hasher.update(piece)
                self.stats.add(bytes_uploaded=len(piece))
                yield piece

        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length),
                   "Content-Range": f"{offset}-{offset + length - 1}"}
        try:
            response = self.target.client.request("PATCH", location, content=body(), headers=headers)
        except (httpx.TransportError, httpx.StreamError, _SourceBroke):
            reader.reset()
            return 0, None
        except AuthDenied as exc:
            raise RegistryAuthError(f"{exc} (upload chunk {self.target.registry}/{self.target_repository})",
                                    registry=self.target.registry, repository=self.target_repository,
                                    operation="upload chunk", status=exc.status) from None
        if response.status_code == 202:
            return 202, (self.target._location(response, self.target_repository)
                         if "location" in response.headers else None)
        reader.reset()
        if response.status_code in (416, 429) or response.status_code >= 500:
            return response.status_code, None
        raise self.target._fail(response, "upload chunk", self.target_repository)

    # --- signatures, attestations, referrers ----------------------------------------------

    def signature(self, digest: str, suffix: str) -> None:
        """Copy cosign's `sha256-<hex>.<suffix>` tag of `digest`, when the source has one."""
        tag = cosign_tag(digest, suffix)
        known = self.options.known_manifests.get(tag)
        found = known[2] if known else self.source.head_manifest(self.source_repository, tag)
        if found is None:
            return
        self.manifest(found, tag, image=False)
        with self.stats._lock:
            self.stats.signature_tags.append(tag)

    def signatures(self, done: Iterable[str] = ()) -> None:
        """The signatures and referrers of every manifest of the image but those `done`."""
        self.signatures_of([digest for digest in dict.fromkeys(self._tree) if digest not in done])

    def signatures_of(self, digests: Iterable[str]) -> None:
        """The signatures and referrers of these manifests, each digest's once per copy."""
        for digest in digests:
            with self._signed_lock:
                if digest in self._signed:
                    continue
                self._signed.add(digest)
            for suffix in COSIGN_SUFFIXES:
                self.signature(digest, suffix)
            self.copy_referrers(digest, self.find_referrers(digest))

    def find_referrers(self, digest: str) -> list[dict[str, Any]]:
        descriptors = self.source.referrers(self.source_repository, digest)
        if descriptors is None:  # no Referrers API: the fallback tag's index lists them
            fallback = self.source.find_manifest(self.source_repository, cosign_tag(digest))
            listed = (json.loads(fallback[0]).get("manifests") or []) if fallback else []
            descriptors = _checked_descriptors(self.source, self.source_repository, f":{cosign_tag(digest)}",
                                               listed, "referrer")
        return descriptors

    def copy_referrers(self, digest: str, descriptors: list[dict[str, Any]]) -> None:
        if not descriptors:
            return
        for descriptor in descriptors:
            self.manifest(descriptor["digest"], image=False)
            self.stats.referrers.append(descriptor["digest"])
        if self.target.referrers(self.target_repository, digest) is not None:
            return  # the target indexes referrers itself from their `subject`
        self._merge_fallback_index(digest, descriptors)

    def _merge_fallback_index(self, digest: str, descriptors: list[dict[str, Any]]) -> None:
        tag = cosign_tag(digest)
        existing = self.target.find_manifest(self.target_repository, tag)
        index: dict[str, Any] = json.loads(existing[0]) if existing else {"schemaVersion": 2, "mediaType": OCI_INDEX}
        listed: list[dict[str, Any]] = list(index.get("manifests") or [])
        known = {d["digest"] for d in listed}
        added = [d for d in descriptors if d["digest"] not in known]
        if not added:
            return
        index["manifests"] = listed + added
        raw = json.dumps(index, separators=(",", ":")).encode()
        self.target.put_manifest(self.target_repository, tag, raw, OCI_INDEX)
        self.stats.add(manifests_put=1, tags_put=1)


def copy_image(source: Registry, source_repository: str, reference: str, target: Registry,
               target_repository: str, tags: Iterable[str] = (), options: CopyOptions | None = None) -> CopyResult:
    """Copy `source_repository@reference` (a tag or digest) into `target_repository`, then tag it.

    Indexes are copied whole, children first. With `options.signatures`, cosign's signature,
    attestation and SBOM tags of every manifest reached, and its OCI referrers, go too, before
    any tag is written.
    """
    options = options or CopyOptions()
    stats = CopyStats()
    digest = reference
    if not reference.startswith("sha256:"):
        found = source.head_manifest(source_repository, reference)
        if found is None:
            raise RegistryError(f"{source.registry}/{source_repository}:{reference}: no such manifest",
                                registry=source.registry, repository=source_repository,
                                operation="HEAD manifest", status=404)
        digest = found
    copier = _Copier(source, source_repository, target, target_repository, options, stats)
    try:
        with ExitStack() as stack:
            if options.concurrency > 1:
                copier.blob_pool = stack.enter_context(
                    ThreadPoolExecutor(max_workers=options.concurrency, thread_name_prefix="imagebuild-blob"))
            raw, media_type = _copy(copier, digest, tags)
    finally:
        copier.locations.save()
    return CopyResult(digest, media_type, stats, raw)


def _copy(copier: _Copier, digest: str, tags: Iterable[str]) -> tuple[bytes, str]:
    if copier.options.signatures:
        raw, media_type = _image_and_its_signatures(copier, digest)
        copier.signatures(done=(digest,))  # an index's children, one by one
    else:
        raw, media_type = copier.manifest(digest)
    for tag in tags:
        copier.target.put_manifest(copier.target_repository, tag, raw, media_type)
        copier.stats.add(tags_put=1)
    return raw, media_type


def _image_and_its_signatures(copier: _Copier, digest: str) -> tuple[bytes, str]:
    """The image and its own signature, attestation and SBOM tags reach nothing of each other: copy
    them at once (round trips, not bandwidth, bound a promote). Referrers name the image as their
    subject, so they follow it; only finding them overlaps."""
    with ThreadPoolExecutor(max_workers=len(COSIGN_SUFFIXES) + 2, thread_name_prefix="imagebuild-copy") as pool:
        image = pool.submit(copier.manifest, digest)
        signatures: list[Future[None]] = [pool.submit(copier.signature, digest, suffix)
                                          for suffix in COSIGN_SUFFIXES]
        referrers = pool.submit(copier.find_referrers, digest)
        raw, media_type = image.result()
        for done in signatures:
            done.result()
        copier.copy_referrers(digest, referrers.result())
    return raw, media_type


def copy_within(registry: Registry, source_repository: str, digest: str, repository: str, tag: str) -> str:
    """Tag `source@digest` as `repository:tag` on one registry (blobs are mounted, not copied); the digest."""
    # On one registry the source repository is where to mount from: no hints to keep.
    copy_image(registry, source_repository, digest, registry, repository, tags=(tag,),
               options=CopyOptions(locations=BlobLocations()))
    return digest
