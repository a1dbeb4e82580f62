"""Pushing a built layer image to the registry without `docker push`.

`docker push` (engine 20.10) gzips each layer at Go's default level on one core: measured
here, 3 GB of layers took ten minutes on a busy 2-core machine. Instead the layers the
image's parent already has in the registry are skipped, the new ones are hashed and gzipped
with ISA-L on every core, uploaded as blobs, and a Docker v2 schema 2 manifest (what Docker
20.10 and containerd pull) is put last, so the tag never points at a missing blob.

The bytes come from the engine's own storage when this process can read it (layerstore.py:
the config by image id, each new layer's tar rebuilt from its tar-split record), so a layer
costs what it adds, not its chain; each is checked against the image id and diff_ids as it
streams. Whatever the storage cannot give (another host, another driver, a layer that does
not hash right) comes from `docker save` instead, which copies the whole chain first.

The engine's save format (docker 20.10): one `<v1 id>/layer.tar` per layer, in the lexical
order of the v1 ids, the image config as `<image id>.json`, and `manifest.json` last. The v1
ids are derived from the layer chain (see `legacy_layer_ids`), so a layer is known to be new
or not before its bytes arrive; every new layer's diff_id and the final manifest.json are
checked against the engine's own record, so a wrong guess fails loudly instead of pushing a
wrong image.

zstd (opt-in, a variant's release image only; see oci/compression.py): the layers go up as
`tar+zstd` blobs under an OCI image manifest, the config bytes unchanged (its diff_ids are of
the uncompressed tars). The layers below the release are built and pushed gzip, because
BuildKit's cache follows their blobs, so a zstd release needs its parent's layers as zstd too.
Recompressing gigabytes for every release would cost more than zstd saves, so the first zstd
push over a parent also puts a zstd twin of the parent (same config, same diff_ids) in the target
repository, tagged by the parent's digest (`twin_tag`); later pushes over that parent find it,
check every descriptor against the parent and read every blob back (its bytes must hash to its
digest and, decompressed, to the parent's diff_id: a tag can be moved by anyone who can push),
and compress only their own layers.

eStargz (opt-in, a variant's release image only; see oci/estargz.py): every layer, the parent's too,
is written again as an eStargz blob (its tar spooled to disk, checked against its diff_id, reordered
so that the files the image's start-up reads come first, build/startup.py), under an OCI manifest
whose layer descriptors carry each TOC's digest. The layers' tars change (the TOC is an entry of
their own), so the config is rewritten with the new diff_ids and the pushed image has a new id. No
parent lends blobs: a gzip parent's are not eStargz, and the same layer always gives the same blob,
so a blob the registry has already is not uploaded again (its conversion is the cost of a push).
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from imagebuild.build import startup
from imagebuild.build.layerstore import EngineStorage, StorageUnreadable
from imagebuild.core.errors import ImagebuildError
from imagebuild.oci import estargz, names, platforms
from imagebuild.oci.client import ImageRef, Registry, RegistryError
from imagebuild.oci.compression import DEFAULT as GZIP
from imagebuild.oci.compression import (  # noqa: F401 (DOCKER_*, OCI_*: publish's own names for them)
    DOCKER_CONFIG,
    DOCKER_LAYER,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    OCI_MANIFEST,
    Compression,
)
from imagebuild.oci.layer_read import LayerReadError, read_layer

# ISA-L level 1: measured on 1.2 GB of ELF binaries here, 258 MB/s on one core against zlib's
# 50 MB/s at level 1 and 14 MB/s at level 6, for a blob 14% larger than level 6's.
COMPRESSION_LEVEL = 1
CHUNK = 1 << 20


class PublishError(ImagebuildError):
    """The image could not be pushed; the message says why."""


class UnsupportedSave(PublishError):
    """The engine's `docker save` stream is not in a format this module knows."""


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: tuple[tuple[str, str], ...] = ()  # eStargz: the TOC's digest, the tar's size

    def to_json(self) -> dict[str, Any]:
        described: dict[str, Any] = {"mediaType": self.media_type, "size": self.size, "digest": self.digest}
        if self.annotations:
            described["annotations"] = dict(self.annotations)
        return described


@dataclass
class PushResult:
    digest: str  # the manifest digest, as the registry computed it
    steps: dict[str, float] = field(default_factory=dict)  # seconds: export_s, compress_s, upload_s
    uploaded: int = 0  # blobs sent
    uploaded_bytes: int = 0
    present: int = 0  # blobs the registry had already (parent layers, or a rerun)
    source: str = "docker save"  # where the config and new layers were read: STORAGE or SAVE
    notes: list[str] = field(default_factory=list)  # why the engine's storage was not used, if so
    compression: str = "gzip"  # oci/compression.py's spec of the layers pushed
    twin: str | None = None  # zstd: the parent's twin reused or put ("<tag> reused" / "<tag> put")
    image_id: str = ""  # the config pushed: the engine's image id, but for eStargz (new diff_ids)
    prefetch: dict[str, Any] | None = None  # eStargz: what start-up read, and what each layer prefetches


# --- pure parts -------------------------------------------------------------------------


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The layer chain IDs: the first diff_id, then sha256 of "<parent chain id> <diff_id>"."""
    chain: list[str] = []
    for diff_id in diff_ids:
        chain.append(diff_id if not chain else
                     "sha256:" + hashlib.sha256(f"{chain[-1]} {diff_id}".encode()).hexdigest())
    return chain


def _go_json(value: Any) -> str:
    # Go's encoding/json: compact, UTF-8 kept, <, > and & escaped.
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def legacy_layer_ids(template: dict[str, Any], diff_ids: list[str]) -> list[str]:
    """The `docker save` directory names (v1 ids) of every layer but the top one.

    Docker 20.10 names each non-top layer's directory by sha256 of a small v1 image JSON
    (the `json` file in that directory, less id, parent and os) with the layer's chain id
    and the parent's v1 id added, keys sorted. The top layer carries the full image config
    instead, which is how the caller tells it apart.
    """
    base = {k: v for k, v in template.items() if k not in ("id", "parent", "os")}
    ids: list[str] = []
    for chain_id in chain_ids(diff_ids)[:-1]:
        fields = dict(base, layer_id=chain_id)
        if ids:
            fields["parent"] = "sha256:" + ids[-1]
        text = "{" + ",".join(f"{_go_json(k)}:{_go_json(fields[k])}" for k in sorted(fields)) + "}"
        ids.append(hashlib.sha256(text.encode()).hexdigest())
    return ids


def reusable_layers(manifest: dict[str, Any], config: dict[str, Any],
                    compression: Compression = GZIP) -> dict[str, Descriptor]:
    """diff_id -> the blob a registry image already holds for it, compressed as `compression` wants
    (none for other encodings)."""
    diff_ids = config.get("rootfs", {}).get("diff_ids") or []
    layers = manifest.get("layers") or []
    if len(diff_ids) != len(layers):
        return {}
    found: dict[str, Descriptor] = {}
    for diff_id, layer in zip(diff_ids, layers):
        if compression.reusable(layer.get("mediaType")):
            # gzip: the same bytes under Docker's name, as a schema 2 manifest lists them.
            found.setdefault(diff_id, Descriptor(compression.layer_media_type, layer["digest"], int(layer["size"])))
    return found


def image_manifest(config: Descriptor, layers: list[Descriptor], compression: Compression = GZIP) -> bytes:
    """The manifest `compression` pushes under: gzip, Docker v2 schema 2 (what Docker 20.10 and
    containerd pull, byte for byte as ever); zstd, an OCI image manifest with the OCI config type."""
    if compression.is_gzip:
        return schema2_manifest(config, layers)
    return json.dumps({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": Descriptor(OCI_CONFIG, config.digest, config.size).to_json(),
        "layers": [layer.to_json() for layer in layers],
    }, indent=3).encode()


def schema2_manifest(config: Descriptor, layers: list[Descriptor]) -> bytes:
    """The Docker v2 schema 2 manifest: what Docker 20.10 and containerd pull."""
    return json.dumps({
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST,
        "config": config.to_json(),
        "layers": [layer.to_json() for layer in layers],
    }, indent=3).encode()


def twin_tag(parent_digest: str, compression: Compression) -> str:
    """The tag of a gzip image's zstd twin: the level and the image's digest, so a twin names exactly
    the image (and level) it was made from, whatever tags that image has (publish sees it by digest)."""
    return f"zstd{compression.level}-{parent_digest.partition(':')[2]}"


def twin_problem(twin: dict[str, Any], media_type: str, config: Descriptor, diff_ids: list[str],
                 compression: Compression) -> str | None:
    """Why a registry's twin manifest cannot stand for the parent (None: its layers may be used).

    What the registry sent is untrusted: the twin must be an OCI manifest of the parent's very
    config, with one well-formed `tar+zstd` descriptor per diff_id; the blobs' sizes are checked
    against the registry separately.
    """
    if media_type != OCI_MANIFEST or twin.get("mediaType", OCI_MANIFEST) != OCI_MANIFEST:
        return f"it is {str(media_type)[:80]}, not an OCI image manifest"
    given = twin.get("config")
    if not isinstance(given, dict) or given.get("digest") != config.digest or given.get("size") != config.size:
        return "its config is not the parent's"
    layers = twin.get("layers")
    if not isinstance(layers, list) or len(layers) != len(diff_ids):
        return f"it lists {len(layers) if isinstance(layers, list) else 'no'} layers, the parent {len(diff_ids)}"
    for index, layer in enumerate(layers):
        if not isinstance(layer, dict) or layer.get("mediaType") != compression.layer_media_type:
            return f"layer {index} is not {compression.layer_media_type}"
        size = layer.get("size")
        if not isinstance(layer.get("digest"), str) or not names.SHA256_DIGEST.fullmatch(layer["digest"]) \
                or not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            return f"layer {index} has no well-formed digest and size"
    return None


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def estargz_config(config_raw: bytes, diff_ids: list[str]) -> bytes:
    """The image config with its layers' new diff_ids (eStargz tars have a TOC entry of their own);
    everything else as the engine wrote it."""
    config = json.loads(config_raw)
    if len(config.get("rootfs", {}).get("diff_ids") or []) != len(diff_ids):
        raise PublishError(f"the config lists {len(config.get('rootfs', {}).get('diff_ids') or [])} layers, "
                           f"the eStargz push {len(diff_ids)}")
    config["rootfs"]["diff_ids"] = diff_ids
    return json.dumps(config, separators=(",", ":"), ensure_ascii=False).encode()


# --- streaming the image out of the engine --------------------------------------------


class _ChunkReader(io.RawIOBase):
    """A file over an iterator of byte chunks (the engine's save stream), for tarfile's "r|"."""

    def __init__(self, chunks: Iterable[bytes]):
        self._chunks: Iterator[bytes] = iter(chunks)
        self._buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        while not self._buffer:
            try:
                self._buffer = next(self._chunks)
            except StopIteration:
                return 0
        size = min(len(target), len(self._buffer))
        target[:size] = self._buffer[:size]
        self._buffer = self._buffer[size:]
        return size


class _HashingFile(io.RawIOBase):
    """Writes through to a file, hashing and counting what passes; setting `cancelled` stops the next write."""

    def __init__(self, handle: IO[bytes], cancelled: threading.Event | None = None):
        self.handle = handle
        self.hash = hashlib.sha256()
        self.size = 0
        self.cancelled = cancelled

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.cancelled is not None and self.cancelled.is_set():
            raise PublishError("interrupted")
        self.hash.update(data)
        self.size += len(data)
        self.handle.write(data)
        return len(data)


@dataclass
class _Compressed:
    diff_id: str  # of the tar read (checked against the engine's)
    blob: Descriptor
    path: Path
    estargz: estargz.Written | None = None  # eStargz: what the blob's own tar is (its diff_id, its TOC)


def _even_chunks(chunks: Iterable[bytes], size: int = CHUNK) -> Iterator[bytes]:
    """The same bytes in pieces of exactly `size` (the last may be shorter).

    igzip_threaded's output depends on how its input was cut, so the same tar must reach it
    in the same pieces whether it came from the engine's storage or from `docker save`:
    otherwise the same layer gets another blob digest, and the image another manifest digest.
    """
    pending = bytearray()
    for chunk in chunks:
        if not pending and len(chunk) == size:
            yield chunk
            continue
        pending += chunk
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


@dataclass(frozen=True)
class _Encoder:
    """How new layers are compressed: `compression` on `threads` cores (gzip at ISA-L `gzip_level`)."""

    compression: Compression
    threads: int
    gzip_level: int = COMPRESSION_LEVEL
    prioritized: tuple[str, ...] = ()  # eStargz: the paths each layer puts before its prefetch landmark

    def writer(self, sink: io.RawIOBase) -> Any:
        """A file whose writes land compressed in `sink`; closing it flushes, and leaves `sink` open."""
        if self.compression.is_gzip:
            from isal import igzip_threaded  # the one module that needs ISA-L

            return igzip_threaded.open(sink, "wb", compresslevel=self.gzip_level,  # type: ignore[no-untyped-call]
                                       threads=self.threads)
        import zstandard  # only a zstd push needs it

        # Multi-threaded zstd cuts the input into jobs of a size set by the level, not by how it is
        # fed or by the thread count, so the same tar gives the same blob from storage or save.
        compressor = zstandard.ZstdCompressor(level=self.compression.level or 3, threads=self.threads)
        return compressor.stream_writer(sink, closefd=False)  # type: ignore[arg-type]


def _compress(chunks: Iterable[bytes], target: Path, encoder: _Encoder,
              cancelled: threading.Event) -> tuple[_Compressed, float]:
    """Compress the stream `chunks` into `target` as `encoder` says, hashing it in the same pass:
    (result, seconds spent compressing)."""
    if encoder.compression.is_estargz:
        return _write_estargz(chunks, target, encoder, cancelled)
    diff = hashlib.sha256()
    busy = 0.0
    with target.open("wb") as handle:
        sink = _HashingFile(handle)
        writer = encoder.writer(sink)
        try:
            for chunk in _even_chunks(chunks):
                if cancelled.is_set():
                    raise PublishError("interrupted")
                diff.update(chunk)
                started = time.monotonic()
                writer.write(chunk)
                busy += time.monotonic() - started
        finally:
            started = time.monotonic()
            writer.close()
            busy += time.monotonic() - started
    blob = Descriptor(encoder.compression.layer_media_type, "sha256:" + sink.hash.hexdigest(), sink.size)
    return _Compressed("sha256:" + diff.hexdigest(), blob, target), busy


def _write_estargz(chunks: Iterable[bytes], target: Path, encoder: _Encoder,
                   cancelled: threading.Event) -> tuple[_Compressed, float]:
    """The layer's tar spooled beside `target` (hashed as it comes: the caller checks it against the
    diff_id), then written to `target` as eStargz with the members compressed on every core."""
    spool = target.with_name(target.name + ".tar")
    diff = hashlib.sha256()
    try:
        with spool.open("w+b") as tar:
            for chunk in chunks:
                if cancelled.is_set():
                    raise PublishError("interrupted")
                diff.update(chunk)
                tar.write(chunk)
            tar.flush()
            started = time.monotonic()
            tar.seek(0)
            try:
                ordered = estargz.prioritize(estargz.read_entries(tar), encoder.prioritized)
                with target.open("wb") as handle, ThreadPoolExecutor(encoder.threads,
                                                                     thread_name_prefix="estargz") as pool:
                    sink = _HashingFile(handle, cancelled)
                    written = estargz.write(tar, ordered, sink, executor=pool, ahead=4 * encoder.threads)
            except estargz.EstargzError as exc:
                raise PublishError(f"the layer cannot be written as eStargz: {exc}") from None
            busy = time.monotonic() - started
    finally:
        spool.unlink(missing_ok=True)
    annotations = ((estargz.TOC_DIGEST_ANNOTATION, written.toc_digest),
                   (estargz.UNCOMPRESSED_SIZE_ANNOTATION, str(written.uncompressed_size)))
    blob = Descriptor(encoder.compression.layer_media_type, "sha256:" + sink.hash.hexdigest(), sink.size, annotations)
    return _Compressed("sha256:" + diff.hexdigest(), blob, target, written), busy


# --- the registry side -------------------------------------------------------------------


def _blob_exists(registry: Registry, repository: str, digest: str) -> bool:
    response = registry._request("HEAD", f"/v2/{repository}/blobs/{digest}")
    if response.status_code not in (200, 404):
        raise RegistryError(f"{registry.registry}/{repository}@{digest}: HEAD blob answered {response.status_code}")
    return response.status_code == 200


def _upload_blob(registry: Registry, repository: str, digest: str, path: Path | None = None,
                 data: bytes | None = None) -> None:
    """One monolithic upload: POST for a session, PUT the bytes with the digest."""
    start = registry._request("POST", f"/v2/{repository}/blobs/uploads/")
    if start.status_code != 202:
        raise RegistryError(f"{registry.registry}/{repository}: starting an upload answered {start.status_code}")
    location = start.headers["location"]
    separator = "&" if "?" in location else "?"
    url = f"{location}{separator}digest={digest}"
    headers = {"Content-Type": "application/octet-stream"}
    if path is not None:
        headers["Content-Length"] = str(path.stat().st_size)
        with path.open("rb") as handle:
            response = registry._request("PUT", url, content=iter(lambda: handle.read(CHUNK), b""),
                                         headers=headers)
    else:
        response = registry._request("PUT", url, content=data or b"", headers=headers)
    if response.status_code != 201:
        raise RegistryError(f"{registry.registry}/{repository}: uploading {digest} answered "
                            f"{response.status_code}: {response.text[:200]}")


class _Uploads:
    """Blob uploads running beside the save stream; counts what was sent and what was there."""

    def __init__(self, registry: Registry, repository: str):
        self.registry, self.repository = registry, repository
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="blob-upload")
        self.futures: list[Future[Any]] = []
        self.lock = threading.Lock()
        self.uploaded = self.uploaded_bytes = self.present = 0
        self.first: float | None = None
        self.last: float | None = None

    def submit(self, digest: str, size: int, path: Path | None = None, data: bytes | None = None) -> None:
        self.futures.append(self.pool.submit(self._one, digest, size, path, data))

    def _one(self, digest: str, size: int, path: Path | None, data: bytes | None) -> None:
        started = time.monotonic()
        with self.lock:
            self.first = started if self.first is None else min(self.first, started)
        if _blob_exists(self.registry, self.repository, digest):
            with self.lock:
                self.present += 1
        else:
            _upload_blob(self.registry, self.repository, digest, path, data)
            with self.lock:
                self.uploaded += 1
                self.uploaded_bytes += size
        if path is not None:
            path.unlink(missing_ok=True)
        with self.lock:
            self.last = time.monotonic()

    def wait(self) -> None:
        try:
            for future in self.futures:
                future.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)

    @property
    def seconds(self) -> float:
        return (self.last - self.first) if self.first is not None and self.last is not None else 0.0


# --- the whole push ----------------------------------------------------------------------


@dataclass(frozen=True)
class _TwinWanted:
    """A zstd twin of the parent to put once its layers are compressed: same config, same diff_ids."""

    tag: str
    config: Descriptor
    diff_ids: list[str]


@dataclass
class _Lent:
    """What the parent lends a push: diff_id -> a blob the target repository holds, compressed as wanted."""

    blobs: dict[str, Descriptor] = field(default_factory=dict)
    twin: _TwinWanted | None = None  # zstd: no usable twin of the parent yet
    twin_used: str | None = None  # zstd: the twin whose blobs are lent
    notes: list[str] = field(default_factory=list)


def _parent_blobs(registry: Registry, parent: ImageRef | None, target: ImageRef,
                  compression: Compression = GZIP, platform: str | None = None) -> _Lent:
    """What the parent image already has in the target's registry (nothing when elsewhere): its own
    blobs when compressed as wanted, else (zstd over a gzip parent) its zstd twin's. A multi-platform
    parent (an index) lends its `platform` child's blobs."""
    if parent is None or parent.registry != target.registry or not parent.digest:
        return _Lent()
    raw, media_type, _ = registry.get_manifest(parent.repository, parent.digest)
    manifest = json.loads(raw)
    if manifest.get("mediaType", media_type) not in (DOCKER_MANIFEST, OCI_MANIFEST):
        try:  # the index read once; what the child lends is keyed by its own config's diff_ids
            child = platforms.listed_child(raw, platform) if platform is not None else None
        except platforms.BadIndex:
            child = None
        if child is None:  # no child for this platform: its layers are compressed here instead
            return _Lent(notes=[f"the parent {parent} has no {platform or 'known platform'} image to lend"])
        raw, media_type, _ = registry.get_manifest(parent.repository, child)
        manifest = json.loads(raw)
    config_digest = manifest["config"]["digest"]
    config_raw = registry.get_blob(parent.repository, config_digest)
    config = json.loads(config_raw)
    blobs = reusable_layers(manifest, config, compression)
    if parent.repository != target.repository:
        for blob in blobs.values():  # cross-repository mount: no bytes move
            registry.mount_blob(target.repository, blob.digest, parent.repository)
    diff_ids = list(config.get("rootfs", {}).get("diff_ids") or [])
    if compression.is_gzip or all(d in blobs for d in diff_ids):
        return _Lent(blobs)
    if parent.repository != target.repository:  # the twin, in the target repository, needs the config there
        registry.mount_blob(target.repository, config_digest, parent.repository)
    return _zstd_twin(registry, target.repository, _TwinWanted(twin_tag(parent.digest, compression),
                                                               Descriptor(DOCKER_CONFIG, config_digest,
                                                                          len(config_raw)), diff_ids),
                      blobs, compression)


def _engine_platform(info: dict[str, Any]) -> str:
    """os/architecture[/variant] of an image as the engine's inspect says it."""
    parts = [str(info.get("Os") or "linux"), str(info.get("Architecture") or "amd64")]
    return "/".join(parts + ([str(info["Variant"])] if info.get("Variant") else []))


def _zstd_twin(registry: Registry, repository: str, wanted: _TwinWanted, blobs: dict[str, Descriptor],
               compression: Compression) -> _Lent:
    """The parent's zstd twin's blobs when `repository` holds a twin that checks out, else the twin to put."""
    found = registry.find_manifest(repository, wanted.tag)
    if found is None:
        return _Lent(blobs, twin=wanted)
    raw, media_type, _ = found
    try:
        twin: Any = json.loads(raw)
    except ValueError:
        twin = None
    problem = twin_problem(twin, media_type, wanted.config, wanted.diff_ids, compression) \
        if isinstance(twin, dict) else "it is not a JSON object"
    for layer, diff_id in zip(twin["layers"], wanted.diff_ids) if problem is None else []:
        problem = _twin_layer_problem(registry, repository, layer, diff_id)
        if problem is not None:
            break
    if problem is not None:
        return _Lent(blobs, twin=wanted, notes=[f"zstd twin {wanted.tag} not used: {problem}; "
                                                "the parent's layers are compressed again"])
    lent = {d: Descriptor(compression.layer_media_type, layer["digest"], layer["size"])
            for d, layer in zip(wanted.diff_ids, twin["layers"])}
    return _Lent(lent | blobs, twin_used=wanted.tag)


def _twin_layer_problem(registry: Registry, repository: str, layer: dict[str, Any], diff_id: str) -> str | None:
    """Why one of a twin's blobs cannot stand for the parent's layer `diff_id` (None: it can).

    The twin is found by a tag, which anyone who can push to the repository can move, so each blob
    is read whole: its bytes must hash to the descriptor's digest and, decompressed, to the parent's
    diff_id. Reading and decompressing costs a fraction of compressing the layer again.
    """
    size = registry.blob_size(repository, layer["digest"])
    if size != layer["size"]:
        return f"blob {layer['digest']} is {'missing' if size is None else f'{size} bytes'}, not {layer['size']}"
    try:
        tar = read_layer(registry, repository, layer["digest"], layer["size"], zstd=True)
    except LayerReadError as exc:
        return str(exc)
    if tar != diff_id:
        return f"blob {layer['digest']} decompresses to {tar}, not the parent's {diff_id}"
    return None


def _put_twin(registry: Registry, repository: str, wanted: _TwinWanted, diff_ids: list[str],
              blobs: dict[str, Descriptor], compression: Compression) -> str | None:
    """Put the parent's zstd twin from the blobs just pushed; its tag, or None when the image does not
    start with the parent's layers (then the twin would not be the parent's)."""
    if diff_ids[:len(wanted.diff_ids)] != wanted.diff_ids or any(d not in blobs for d in wanted.diff_ids):
        return None
    raw = image_manifest(wanted.config, [blobs[d] for d in wanted.diff_ids], compression)
    registry.put_manifest(repository, wanted.tag, raw, compression.manifest_media_type)
    return wanted.tag


STORAGE = "engine storage"
SAVE = "docker save"


def publish(image: str, target: ImageRef, parent: ImageRef | None = None, *, spool: Path,
            threads: int | None = None, level: int = COMPRESSION_LEVEL, docker_client: Any = None,
            event_hooks: dict[str, Any] | None = None, cancelled: threading.Event | None = None,
            storage: EngineStorage | bool = True, compression: Compression = GZIP,
            prioritized: Sequence[str] | None = None) -> PushResult:
    """Push the local image `image` to `target` (repository and tag) and return its digest.

    `parent`, the image it was built FROM (by digest), lends its blobs: only the layers it
    lacks are compressed and uploaded. `spool` holds the compressed layers until uploaded.
    The config and new layers are read from the engine's storage (`storage`: True to find it
    with `docker info`, False to never read it, or the storage to read) and checked against
    the image id and diff_ids; whatever it cannot give comes from `docker save` instead.
    Setting `cancelled` stops the push between chunks; the tag is put last, so it is untouched.
    `compression`: gzip (ISA-L at `level`, schema 2), zstd (OCI; over a gzip parent, its twin's
    blobs are lent, or the twin is put; see the module's docstring) or eStargz (every layer; the files
    `prioritized` names first in each layer, by default those the image's health check reads).
    """
    import docker  # only the engine side needs the SDK

    cancelled = cancelled or threading.Event()
    client = docker_client or docker.from_env(timeout=900)
    api = client.api
    info = api.inspect_image(image)
    image_id: str = info["Id"]
    diff_ids: list[str] = list(info["RootFS"].get("Layers") or [])
    if not diff_ids:
        raise PublishError(f"{image}: the engine lists no layers")
    steps: dict[str, float] = {}
    notes: list[str] = []
    prefetch: dict[str, Any] | None = None
    on_demand = 0
    if compression.is_estargz and prioritized is None:
        started = time.monotonic()
        recorded = startup.record(client, image_id, info.get("Config") or {}, estargz.CHUNK_SIZE)
        steps["startup_s"] = round(time.monotonic() - started, 1)
        prioritized, on_demand = recorded.files, len(recorded.on_demand)
        notes.append(recorded.note)
    if compression.is_estargz:
        prefetch = {"files": len(prioritized or []), "on_demand": on_demand}
    encoder = _Encoder(compression, threads or len(os.sched_getaffinity(0)), level, tuple(prioritized or ()))
    with Registry(target.registry) as registry:
        if event_hooks:
            registry.client.event_hooks = event_hooks
        # eStargz: a parent's blobs are plain gzip, and every layer is written again.
        lent = _Lent() if compression.is_estargz else _parent_blobs(registry, parent, target, compression,
                                                                    _engine_platform(info))
        reused = lent.blobs
        notes.extend(lent.notes)
        needed = [d for d in dict.fromkeys(diff_ids) if d not in reused]
        uploads = _Uploads(registry, target.repository)
        compressed: dict[str, _Compressed] = {}
        config_raw: bytes | None = None
        source = STORAGE
        started = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(prefix="imagebuild-push-", dir=spool) as tmp:
                try:
                    engine_storage = storage if isinstance(storage, EngineStorage) else \
                        EngineStorage.from_info(api.info()) if storage else None
                    if engine_storage is None:
                        raise StorageUnreadable("not asked to read it")
                    config_raw = _from_storage(engine_storage, image, image_id, diff_ids, needed, compressed,
                                               uploads, Path(tmp), encoder, cancelled, steps)
                except StorageUnreadable as exc:
                    # Layers already checked and sent stay; the rest comes from the save stream.
                    source = SAVE
                    if storage is not False:
                        notes.append(f"engine storage unusable for {image}: {exc}; using docker save")
                    config_raw = _from_save(api, image, image_id, diff_ids, needed, compressed, uploads,
                                            Path(tmp), encoder, cancelled, steps)
                steps["export_s"] = round(time.monotonic() - started, 1)
                if compression.is_estargz:
                    written = [_written(compressed[d]) for d in diff_ids]
                    config_raw = estargz_config(config_raw, [w.diff_id for w in written])
                    config = Descriptor(OCI_CONFIG, sha256_digest(config_raw), len(config_raw))
                    assert prefetch is not None
                    prefetch["layers"] = [{"prioritized": w.prioritized, "prefetch_bytes": w.prefetch_bytes,
                                           "entries": w.entries} for w in written]
                else:
                    config = Descriptor(DOCKER_CONFIG, image_id, len(config_raw))
                uploads.submit(config.digest, config.size, data=config_raw)
                uploads.wait()
        finally:
            uploads.pool.shutdown(wait=True, cancel_futures=True)
        blobs = {**reused, **{d: c.blob for d, c in compressed.items()}}
        raw = image_manifest(config, [blobs[d] for d in diff_ids], compression)
        put_started = time.monotonic()
        twin = f"{lent.twin_used} reused" if lent.twin_used else None
        if lent.twin is not None:  # before the image's own tag, which a rerun then finds complete
            put = _put_twin(registry, target.repository, lent.twin, diff_ids, blobs, compression)
            twin = f"{put} put" if put else None
        digest = registry.put_manifest(target.repository, target.tag or target.reference, raw,
                                       compression.manifest_media_type)
        steps["upload_s"] = round(uploads.seconds + time.monotonic() - put_started, 1)
    expected = sha256_digest(raw)
    if digest != expected:
        raise PublishError(f"{target}: the registry stored the manifest as {digest}, expected {expected}")
    return PushResult(digest=digest, steps=steps, uploaded=uploads.uploaded,
                      uploaded_bytes=uploads.uploaded_bytes, present=uploads.present, source=source, notes=notes,
                      compression=compression.spec, twin=twin, image_id=config.digest, prefetch=prefetch)


def _written(done: _Compressed) -> estargz.Written:
    if done.estargz is None:
        raise PublishError(f"layer {done.diff_id} was not written as eStargz")
    return done.estargz


def _from_storage(storage: EngineStorage, image: str, image_id: str, diff_ids: list[str], needed: list[str],
                  compressed: dict[str, _Compressed], uploads: _Uploads, tmp: Path, encoder: _Encoder,
                  cancelled: threading.Event, steps: dict[str, float]) -> bytes:
    """The config, and each needed layer compressed and submitted, from the engine's storage.

    Only the layers in `needed` are read. Each is hashed while it is compressed and sent only
    when it hashes to its diff_id; any other outcome is StorageUnreadable.
    """
    config_raw = storage.image_config(image_id)
    if json.loads(config_raw).get("rootfs", {}).get("diff_ids") != diff_ids:
        raise StorageUnreadable(f"{image}: the stored config lists other layers than the engine")
    chains = dict(zip(diff_ids, chain_ids(diff_ids)))
    steps.setdefault("compress_s", 0.0)  # every push reports the same steps, a label-only image's too
    for diff_id in needed:
        if diff_id in compressed:
            continue
        done, busy = _compress(storage.layer_tar(chains[diff_id], diff_id), tmp / f"{len(compressed)}.blob",
                               encoder, cancelled)
        steps["compress_s"] = round(steps.get("compress_s", 0.0) + busy, 1)
        if done.diff_id != diff_id:
            done.path.unlink(missing_ok=True)
            raise StorageUnreadable(f"layer {diff_ids.index(diff_id)} of {image} rebuilt from storage hashes to "
                                    f"{done.diff_id}, the engine says {diff_id}")
        compressed[diff_id] = done
        uploads.submit(done.blob.digest, done.blob.size, path=done.path)
    return config_raw


def _from_save(api: Any, image: str, image_id: str, diff_ids: list[str], needed: list[str],
               compressed: dict[str, _Compressed], uploads: _Uploads, tmp: Path, encoder: _Encoder,
               cancelled: threading.Event, steps: dict[str, float]) -> bytes:
    """The config, and each needed layer not yet in `compressed`, from the `docker save` stream."""
    save_order: list[str] | None = None
    positions: dict[str, int] = {}  # save directory -> layer index
    v1_ids: list[str] | None = None
    config_raw: bytes | None = None
    compress_s = 0.0
    stream = io.BufferedReader(_ChunkReader(api.get_image(image, chunk_size=CHUNK)), CHUNK)
    with tarfile.open(fileobj=stream, mode="r|") as archive:
        for member in archive:
            if cancelled.is_set():
                raise PublishError("interrupted")
            name = member.name
            directory, _, leaf = name.rpartition("/")
            if name.startswith("blobs/") or name in ("index.json", "oci-layout"):
                raise UnsupportedSave("the engine saves images as an OCI layout (docker >= 25); "
                                      "this push reads docker 20.10's format")
            if leaf == "json" and directory and member.isfile():
                meta = json.loads(_read(archive, member))
                if "config" in meta:  # only the top layer carries the image config
                    positions[directory] = len(diff_ids) - 1
                else:
                    if v1_ids is None:
                        v1_ids = legacy_layer_ids(meta, diff_ids)
                    if directory not in v1_ids:
                        raise UnsupportedSave(f"save directory {directory} matches no layer of {image}")
                    positions[directory] = v1_ids.index(directory)
            elif leaf == "layer.tar" and member.isfile():
                if directory not in positions:
                    raise UnsupportedSave(f"{name} came before its json")
                diff_id = diff_ids[positions[directory]]
                if diff_id in needed and diff_id not in compressed:
                    source = archive.extractfile(member)
                    assert source is not None
                    done, busy = _compress(iter(functools.partial(source.read, CHUNK), b""),
                                           tmp / f"{len(compressed)}.blob", encoder, cancelled)
                    compress_s += busy
                    if done.diff_id != diff_id:
                        raise PublishError(f"layer {positions[directory]} of {image}: the saved "
                                           f"bytes hash to {done.diff_id}, the engine says {diff_id}")
                    compressed[diff_id] = done
                    uploads.submit(done.blob.digest, done.blob.size, path=done.path)
            elif name == image_id.split(":", 1)[1] + ".json":
                config_raw = _read(archive, member)
            elif name == "manifest.json":
                entries = json.loads(_read(archive, member))
                save_order = [layer.split("/")[0] for layer in entries[0]["Layers"]]
    steps["compress_s"] = round(steps.get("compress_s", 0.0) + compress_s, 1)
    _check_save(image, image_id, diff_ids, positions, save_order, config_raw, needed, compressed)
    assert config_raw is not None
    return config_raw


def _read(archive: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = archive.extractfile(member)
    assert handle is not None
    return handle.read()


def _check_save(image: str, image_id: str, diff_ids: list[str], positions: dict[str, int],
                save_order: list[str] | None, config_raw: bytes | None, needed: list[str],
                compressed: dict[str, _Compressed]) -> None:
    """The stream must have been what the engine says the image is: same config, same layer order."""
    if config_raw is None or sha256_digest(config_raw) != image_id:
        raise PublishError(f"{image}: the saved image config is missing or does not hash to {image_id}")
    if save_order is None or len(save_order) != len(diff_ids):
        raise UnsupportedSave(f"{image}: manifest.json is missing or lists {len(save_order or [])} layers, "
                              f"the engine {len(diff_ids)}")
    for index, directory in enumerate(save_order):
        if directory in positions and positions[directory] != index:
            raise PublishError(f"{image}: save directory {directory} is layer {index}, taken for "
                               f"{positions[directory]}")
    missing = [d for d in needed if d not in compressed]
    if missing:
        raise PublishError(f"{image}: the save stream lacked layers {missing}")


# --- the push for each layer ------------------------------------------------------------------


@dataclass
class Pushed:
    digest: str | None
    by: str  # "imagebuild (engine storage)", "imagebuild (docker save)" or "docker push"
    output: str  # for the layer's log
    steps: dict[str, float] = field(default_factory=dict)
    blobs: dict[str, int] | None = None
    timed_out: bool = False  # `docker push` ran past the push timeout


class Pusher:
    """Pushes each built layer image: `publish` unless told otherwise or the save format is unknown.

    `docker push` is no cheaper even for a layer that adds nothing: it re-gzips every layer
    whose registry blob the engine has no record of, and the engine records blobs only when
    it pushes or pulls them itself, never for a FROM image BuildKit pulled or an image it
    already holds (measured: a metadata-only child of a 1 GB chain took 62 s to `docker push`).
    """

    def __init__(self, docker: str, runner: Any, spool: Path, cancelled: threading.Event,
                 mode: str = "imagebuild", secrets: tuple[str, ...] = (), timeout_s: float | None = None):
        self.docker, self.runner, self.spool, self.cancelled = docker, runner, spool, cancelled
        self.mode, self.secrets, self.timeout_s = mode, secrets, timeout_s

    def push(self, image: str, parent: ImageRef | None, compression: Compression = GZIP) -> Pushed:
        if self.mode == "docker" and compression.is_gzip:
            return self._docker_push(image, "")
        try:
            self.spool.mkdir(parents=True, exist_ok=True)
            result = publish(image, ImageRef.parse(image), parent, spool=self.spool, cancelled=self.cancelled,
                             compression=compression)
        except UnsupportedSave as exc:
            if not compression.is_gzip:  # `docker push` (20.10) writes plain gzip only: no fallback
                raise PublishError(f"{image}: a {compression.spec} push cannot read this engine's save "
                                   f"format ({exc})") from None
            return self._docker_push(image, f"imagebuild: push: {exc}; falling back to `docker push`\n")
        notes = "".join(f"imagebuild: {note}\n" for note in result.notes)
        if result.prefetch is not None:
            notes += "".join(f"imagebuild: eStargz layer {i}: {layer['prioritized']} of {layer['entries']} entries "
                             f"before the prefetch landmark ({layer['prefetch_bytes']} bytes prefetched)\n"
                             for i, layer in enumerate(result.prefetch.get("layers") or []))
        twin = f", zstd twin of the parent {result.twin}" if result.twin else ""
        return Pushed(result.digest, f"imagebuild ({result.source})",
                      f"{notes}imagebuild: pushed {image}@{result.digest} ({result.compression}{twin}) from "
                      f"{result.source}: {result.uploaded} blob(s) uploaded ({result.uploaded_bytes} bytes), "
                      f"{result.present} already there; {result.steps}\n",
                      dict(result.steps), {"uploaded": result.uploaded, "uploaded_bytes": result.uploaded_bytes,
                                           "present": result.present})

    def _docker_push(self, image: str, note: str) -> Pushed:
        run = self.runner.run([self.docker, "push", image], log=None, secrets=self.secrets, timeout=self.timeout_s)
        digest = pushed_digest(run.output) if run.returncode == 0 else None
        return Pushed(digest, "docker push", note + run.output, timed_out=run.timed_out)


def pushed_digest(output: str) -> str | None:
    """The manifest digest in `docker push` output."""
    for line in output.splitlines():
        if "digest: sha256:" in line:
            return "sha256:" + line.split("digest: sha256:", 1)[1].split()[0]
    return None
