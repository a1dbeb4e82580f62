"""Copying an image by digest within or across registries, signatures and attestations included.

Only what the target lacks moves: a manifest the target already has by digest is skipped
whole (a registry accepts a manifest only once its blobs and children are there), each blob
is HEADed first, and on one registry a blob is mounted from the source repository instead of
uploaded. Blobs are streamed in chunks and the digest of what was streamed is checked before
the upload is committed; an interrupted chunk upload asks the registry how much it holds and
continues from there. Manifests go last, children before their index, and tags after every
manifest they reach (signatures included), so no tag ever names something incomplete.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from .registry import INDEX_TYPES, OCI_INDEX, Registry, RegistryError

MiB = 1024 * 1024
# cosign's tag suffixes for a digest's signatures, attestations and attached SBOMs.
COSIGN_SUFFIXES = ("sig", "att", "sbom")


@dataclass(frozen=True)
class CopyOptions:
    chunk_size: int = 16 * MiB  # a blob larger than this is uploaded in chunks (PATCH with Content-Range)
    signatures: bool = False  # also copy cosign's sha256-<hex>.sig/.att/.sbom tags and OCI referrers
    concurrency: int = 4  # blobs moved at once
    resume_attempts: int = 5  # per blob: continuing an interrupted upload from where the registry stands


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


def cosign_tag(digest: str, suffix: str | None = None) -> str:
    """`sha256:abc` -> `sha256-abc.sig` (cosign), or `sha256-abc` (the OCI referrers fallback tag)."""
    base = digest.replace(":", "-", 1)
    return f"{base}.{suffix}" if suffix else base


def _once(data: bytes) -> Iterator[bytes]:
    """A request body that lets go of its bytes once sent. httpx's responses sit in reference
    cycles with their requests, so a body given as bytes lives until the garbage collector
    runs: one chunk per PATCH piled up, the whole blob by the end."""
    yield data


def _blobs(manifest: dict) -> list[dict]:
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
        self._tree: list[str] = []  # every manifest digest reached, for their signatures

    # --- manifests ------------------------------------------------------------------------

    def manifest(self, digest: str) -> tuple[bytes, str]:
        """Make the target hold manifest `digest` and everything it reaches; its bytes and media type."""
        raw, media_type, actual = self.source.get_manifest(self.source_repository, digest)
        self._tree.append(actual)
        document = json.loads(raw)
        if self.target.head_manifest(self.target_repository, actual) == actual:
            self.stats.add(manifests_present=1)
            for child in document.get("manifests", []) if media_type in INDEX_TYPES else []:
                self._tree.append(child["digest"])
            return raw, media_type
        if media_type in INDEX_TYPES:
            for child in document.get("manifests", []):
                self.manifest(child["digest"])
        elif "config" in document:
            self.blobs(_blobs(document))
        else:
            raise RegistryError(f"{self.source.registry}/{self.source_repository}@{digest}: cannot copy "
                                f"media type {media_type or 'unknown'}", registry=self.source.registry,
                                repository=self.source_repository, operation="copy")
        self.target.put_manifest(self.target_repository, actual, raw, media_type)
        self.stats.add(manifests_put=1)
        return raw, media_type

    # --- blobs ----------------------------------------------------------------------------

    def blobs(self, descriptors: list[dict]) -> None:
        unique = list({d["digest"]: d for d in descriptors}.values())
        if len(unique) <= 1 or self.options.concurrency <= 1:
            for descriptor in unique:
                self.blob(descriptor)
            return
        with ThreadPoolExecutor(max_workers=min(self.options.concurrency, len(unique))) as pool:
            for done in [pool.submit(self.blob, d) for d in unique]:
                done.result()

    def blob(self, descriptor: dict) -> None:
        digest, size = descriptor["digest"], int(descriptor.get("size", -1))
        if self.target.blob_size(self.target_repository, digest) is not None:
            self.stats.add(blobs_present=1)
            return
        if self.same_registry:
            mounted_or_session = self.target.try_mount(self.target_repository, digest, self.source_repository)
            if mounted_or_session is None:
                self.stats.add(blobs_mounted=1)
                return
            location = mounted_or_session
        else:
            location = self.target.start_upload(self.target_repository)
        if 0 <= size <= self.options.chunk_size:
            self._upload_whole(location, digest)
        else:
            self._upload_chunked(location, digest, size)
        self.stats.add(blobs_uploaded=1)

    def _fail(self, operation: str, message: str, status: int | None = None) -> RegistryError:
        return RegistryError(f"{self.target.registry}/{self.target_repository}: {operation}: {message}",
                             registry=self.target.registry, repository=self.target_repository,
                             operation=operation, status=status)

    def _upload_whole(self, location: str, digest: str) -> None:
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

    def _source_stream(self, digest: str, offset: int) -> Generator[bytes, None, None]:
        with self.source.open_blob(self.source_repository, digest, offset) as response:
            yield from response.iter_bytes(min(self.options.chunk_size, MiB))

    def _upload_chunked(self, location: str, digest: str, size: int) -> None:
        """PATCH chunks in order; on an interruption ask the session's Range and continue from there.

        Distribution 2.x signs the offset into the session URL and cancels a session asked about
        with a stale one (after a chunk whose answer was lost): then the blob starts over.
        """
        chunk_size = self.options.chunk_size
        hasher = hashlib.sha256()
        offset = 0  # bytes the target has acknowledged (and hashed)
        pending = b""  # read from the source, not yet acknowledged
        stream: Generator[bytes, None, None] | None = None
        interruptions = 0
        while True:
            try:
                if stream is None:
                    stream = self._source_stream(digest, offset + len(pending))
                while len(pending) < chunk_size:
                    piece = next(stream, None)
                    if piece is None:
                        break
                    pending += piece
            except (RegistryError, httpx.HTTPError):
                # The source dropped the stream: open it again after what we hold.
                stream = None
                interruptions += 1
                if interruptions > self.options.resume_attempts:
                    raise
                continue
            if not pending:
                break
            piece = pending[:chunk_size]
            self.stats.add(bytes_uploaded=len(piece))
            status, new_location = self._patch(location, piece, offset)
            if status == 202:
                hasher.update(piece)
                offset += len(piece)
                pending = pending[len(piece):]
                location = new_location or location
                continue
            interruptions += 1
            if interruptions > self.options.resume_attempts:
                raise self._fail("upload blob", f"{digest}: gave up after {interruptions - 1} interrupted chunk "
                                 f"uploads (last: {'connection lost' if status == 0 else f'HTTP {status}'})", status)
            held = self.target.upload_offset(self.target_repository, location)
            if held is None or not 0 <= held - offset <= len(piece):
                self.stats.add(uploads_restarted=1)
                location = self.target.start_upload(self.target_repository)
                hasher, offset, pending = hashlib.sha256(), 0, b""
                if stream is not None:
                    stream.close()
                stream = None
                continue
            self.stats.add(uploads_resumed=1)
            accepted = held - offset
            hasher.update(piece[:accepted])
            offset, pending = held, pending[accepted:]
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest or (size >= 0 and offset != size):
            self.target._request("DELETE", location, repository=self.target_repository, operation="cancel upload")
            raise RegistryError(f"{self.source.registry}/{self.source_repository}@{digest}: the blob streamed "
                                f"({offset} bytes) hashes to {actual}", registry=self.source.registry,
                                repository=self.source_repository, operation="GET blob")
        self._commit(location, digest)

    def _patch(self, location: str, piece: bytes, offset: int) -> tuple[int, str | None]:
        """Send one chunk: (status, the session's next URL); a lost connection reads as status 0."""
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(piece)),
                   "Content-Range": f"{offset}-{offset + len(piece) - 1}"}
        try:
            response = self.target.client.request("PATCH", location, content=_once(piece), headers=headers)
        except httpx.TransportError:
            return 0, None
        if response.status_code == 202:
            return 202, self.target._location(response) if "location" in response.headers else None
        if response.status_code in (416, 429) or response.status_code >= 500:
            return response.status_code, None
        raise self.target._fail(response, "upload chunk", self.target_repository)

    # --- signatures, attestations, referrers ----------------------------------------------

    def signatures(self) -> None:
        for digest in dict.fromkeys(self._tree):
            for suffix in COSIGN_SUFFIXES:
                tag = cosign_tag(digest, suffix)
                found = self.source.head_manifest(self.source_repository, tag)
                if found is None:
                    continue
                raw, media_type = self.manifest(found)
                self.target.put_manifest(self.target_repository, tag, raw, media_type)
                self.stats.add(tags_put=1)
                self.stats.signature_tags.append(tag)
            self.referrers_of(digest)

    def referrers_of(self, digest: str) -> None:
        descriptors = self.source.referrers(self.source_repository, digest)
        if descriptors is None:  # no Referrers API: the fallback tag's index lists them
            fallback = self.source.find_manifest(self.source_repository, cosign_tag(digest))
            descriptors = list(json.loads(fallback[0]).get("manifests") or []) if fallback else []
        if not descriptors:
            return
        for descriptor in descriptors:
            self.manifest(descriptor["digest"])
            self.stats.referrers.append(descriptor["digest"])
        if self.target.referrers(self.target_repository, digest) is not None:
            return  # the target indexes referrers itself from their `subject`
        self._merge_fallback_index(digest, descriptors)

    def _merge_fallback_index(self, digest: str, descriptors: list[dict]) -> None:
        tag = cosign_tag(digest)
        existing = self.target.find_manifest(self.target_repository, tag)
        index: dict = json.loads(existing[0]) if existing else {"schemaVersion": 2, "mediaType": OCI_INDEX}
        listed: list[dict] = list(index.get("manifests") or [])
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
    raw, media_type = copier.manifest(digest)
    if options.signatures:
        copier.signatures()
    for tag in tags:
        target.put_manifest(target_repository, tag, raw, media_type)
        stats.add(tags_put=1)
    return CopyResult(digest, media_type, stats)
