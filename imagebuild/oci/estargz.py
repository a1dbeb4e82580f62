"""eStargz: a layer blob a lazy puller can mount file by file, that every other puller reads as gzip (pure).

The format (stargz-snapshotter's docs/estargz.md): a gzip tar, cut into gzip members so that each
regular file's content (each 4 MiB chunk of a larger one) starts a member of its own; its last tar
entry is the TOC, `stargz.index.json`, in a member of its own: the metadata of every entry, with the
compressed offset of the member where each file or chunk starts and the sha256 of each chunk; a
51-byte footer (an empty gzip member whose extra field holds the TOC's offset) ends the blob. A lazy
puller reads the footer, then the TOC, mounts the layer from it and fetches chunks by HTTP range as
they are read, each verified against its chunkDigest; the TOC itself is verified against the layer
descriptor's `containerd.io/snapshot/stargz/toc.digest` annotation, which the signed manifest carries.

Prefetch: the files a workload's start-up needs come first, and a `.prefetch.landmark` entry (one
byte, 0x0f) marks where they end: the snapshotter fetches that range in one go before the container
starts. A layer with none of them starts with `.no.prefetch.landmark` instead.

Here every entry keeps its tar header bytes exactly (PAX and GNU long-name records included): only the
order changes (prioritized entries first, each after its parent folders and hard-link target), the
original end-of-archive blocks go, and the landmark and TOC entries are added, so the layer's tar, and
its diff_id, differ from the original's (the image config is rewritten with the new ones). The same
input gives the same blob byte for byte: each member is compressed on its own, so how many threads
compress them does not matter.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import posixpath
import struct
import tarfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from imagebuild.core.errors import ImagebuildError

TOC_NAME = "stargz.index.json"
PREFETCH_LANDMARK = ".prefetch.landmark"
NO_PREFETCH_LANDMARK = ".no.prefetch.landmark"
LANDMARK_CONTENT = b"\x0f"
TOC_DIGEST_ANNOTATION = "containerd.io/snapshot/stargz/toc.digest"
UNCOMPRESSED_SIZE_ANNOTATION = "io.containers.estargz.uncompressed-size"
CHUNK_SIZE = 4 << 20  # the Go writer's default: a lazy read fetches and verifies at most this much at once
FOOTER_SIZE = 51
BLOCK = 512

# tarfile's type -> the TOC's. Anything else (sparse files, contiguous files, volume headers) no
# layer tar of an engine holds, and the format has no word for.
_KINDS = {tarfile.REGTYPE: "reg", tarfile.AREGTYPE: "reg", tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink",
          tarfile.LNKTYPE: "hardlink", tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.FIFOTYPE: "fifo"}
_XATTR = "SCHILY.xattr."


class Sink(Protocol):
    """Where a blob is written: a file, or anything that takes bytes as one."""

    def write(self, data: bytes, /) -> int: ...


class EstargzError(ImagebuildError, ValueError):
    """The layer tar cannot be written as eStargz (a kind of entry the format has no word for, a
    malformed tar); the message says which entry."""


def clean_name(name: str) -> str:
    """A tar entry's path as the format compares them: no leading `/` or `./`, no trailing `/`."""
    return posixpath.normpath("/" + name).lstrip("/")


@dataclass(frozen=True)
class Entry:
    """One entry of the source tar: where its bytes are, and what the TOC says of it."""

    name: str  # as clean_name gives it
    kind: str  # the TOC's type: reg, dir, symlink, hardlink, char, block, fifo
    header_offset: int  # first byte of its header records (PAX or GNU long-name records included)
    data_offset: int
    size: int  # content bytes (regular files only)
    info: tarfile.TarInfo


def read_entries(source: IO[bytes]) -> list[Entry]:
    """Every entry of the tar in `source` (seekable), in order; a name given twice keeps its last entry,
    as extracting the tar would."""
    try:
        archive = tarfile.open(fileobj=source, mode="r:")  # noqa: SIM115 (closed below; the file is the caller's)
    except tarfile.TarError as exc:
        raise EstargzError(f"not a tar: {exc}") from None
    entries: dict[str, Entry] = {}
    try:
        for member in archive:
            name = clean_name(member.name)
            if not _utf8(member.name) or not _utf8(member.linkname):
                raise EstargzError(f"{member.name!r}: a name that is not UTF-8 has no place in the TOC's JSON")
            kind = _KINDS.get(member.type)
            if kind is None:
                raise EstargzError(f"{member.name}: tar type {member.type!r} has no eStargz equivalent")
            if name in (TOC_NAME, PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK):
                continue  # a layer written as eStargz before: its own are written again
            entries.pop(name, None)
            entries[name] = Entry(name, kind, member.offset, member.offset_data,
                                  member.size if kind == "reg" else 0, member)
        if archive.pax_headers:
            raise EstargzError("the tar has a global PAX header, which would not follow its entries when reordered")
    except tarfile.TarError as exc:
        raise EstargzError(f"malformed tar: {exc}") from None
    finally:
        archive.close()
    return list(entries.values())


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # tarfile keeps undecodable bytes as lone surrogates
        return False
    return True


@dataclass(frozen=True)
class Ordered:
    """The entries in the order they are written, and which of the prioritized paths were in the layer."""

    entries: list[Entry]
    prioritized: int  # how many entries come before the prefetch landmark (0: no-prefetch landmark first)
    found: list[str] = field(default_factory=list)  # the prioritized paths this layer has


def prioritize(entries: Sequence[Entry], paths: Iterable[str]) -> Ordered:
    """The prioritized `paths` this layer has first, in the order given, each after its parent folders
    and its hard link's target (an extractor needs them first); then every other entry in tar order.

    A path the layer lacks is left out (a lower layer has it); so is a parent folder the layer lacks,
    which the snapshotter makes up as extraction would.
    """
    index = {entry.name: entry for entry in entries}
    picked: set[str] = set()
    front: list[Entry] = []
    found: list[str] = []

    def move(name: str, depth: int = 0) -> None:
        if depth > 64 or name in picked or name not in index:  # depth: a hard-link cycle is a malformed tar
            return
        if name:
            move(clean_name(posixpath.dirname(name)), depth + 1)
        entry = index[name]
        if entry.kind == "hardlink":
            move(clean_name(entry.info.linkname), depth + 1)
        if name not in picked:
            picked.add(name)
            front.append(entry)

    for path in paths:
        name = clean_name(path)
        if name in index and name not in picked:
            found.append(name)
        move(name)
    rest = [entry for entry in entries if entry.name not in picked]
    return Ordered(front + rest, len(front), found)


# --- the TOC ---------------------------------------------------------------------------------------


def _modtime(mtime: float) -> str | None:
    seconds = round(mtime)
    return None if seconds == 0 else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _toc_entry(entry: Entry, names: dict[tuple[str, int], str]) -> dict[str, Any]:
    """The TOC's record of one entry: the Go package's field names, zero values left out as it does;
    the owner's names only where they change for an id, as the Go writer writes them."""
    info = entry.info
    record: dict[str, Any] = {"name": info.name, "type": entry.kind}
    if entry.kind == "reg" and entry.size:
        record["size"] = entry.size
    modtime = _modtime(info.mtime)
    if modtime:
        record["modtime"] = modtime
    if entry.kind in ("symlink", "hardlink"):
        record["linkName"] = info.linkname
    for key, value in (("mode", info.mode), ("uid", info.uid), ("gid", info.gid)):
        if value:
            record[key] = value
    for key, kind, owner_id, owner in (("userName", "u", info.uid, info.uname), ("groupName", "g", info.gid, info.gname)):
        if owner and names.get((kind, owner_id)) != owner:
            names[(kind, owner_id)] = owner
            record[key] = owner
    if entry.kind in ("char", "block"):
        if info.devmajor:
            record["devMajor"] = info.devmajor
        if info.devminor:
            record["devMinor"] = info.devminor
    xattrs = {key[len(_XATTR):]: base64.b64encode(value.encode("utf-8", "surrogateescape")).decode()
              for key, value in sorted(info.pax_headers.items()) if key.startswith(_XATTR)}
    if xattrs:
        record["xattrs"] = xattrs
    return record


def toc_json(entries: list[dict[str, Any]]) -> bytes:
    """The TOC's bytes: what its digest, and the manifest's annotation, are of."""
    return json.dumps({"version": 1, "entries": entries}, indent="\t").encode()


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o644, 0, tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _padding(size: int) -> bytes:
    return bytes(-size % BLOCK)


def footer(toc_offset: int) -> bytes:
    """The 51-byte footer: an empty gzip member whose extra field (subfield `SG`) holds the TOC's offset."""
    subfield = f"{toc_offset:016x}STARGZ".encode()
    extra = b"SG" + struct.pack("<H", len(subfield)) + subfield
    header = b"\x1f\x8b\x08\x04" + bytes(4) + b"\x00\xff" + struct.pack("<H", len(extra)) + extra
    stored_empty_block = b"\x01\x00\x00\xff\xff"
    crc_and_size = bytes(8)  # CRC-32 and length of nothing
    blob = header + stored_empty_block + crc_and_size
    assert len(blob) == FOOTER_SIZE
    return blob


def parse_footer(blob_tail: bytes) -> int:
    """The TOC's offset from a blob's last 51 bytes; EstargzError when they are not an eStargz footer."""
    if len(blob_tail) != FOOTER_SIZE or blob_tail[:4] != b"\x1f\x8b\x08\x04" or blob_tail[12:16] != b"SG\x16\x00":
        raise EstargzError("no eStargz footer")
    subfield = blob_tail[16:38]
    if subfield[16:] != b"STARGZ":
        raise EstargzError("no STARGZ mark in the footer")
    try:
        return int(subfield[:16], 16)
    except ValueError:
        raise EstargzError("the footer's TOC offset is not hexadecimal") from None


# --- writing ---------------------------------------------------------------------------------------


def gzip_member(data: bytes) -> bytes:
    """One gzip member of `data`: ISA-L at level 1 (the same speed-for-size choice as gzip pushes), no
    timestamp, so the same bytes always give the same member."""
    from isal import igzip  # the one dependency of the writer

    return igzip.compress(data, compresslevel=1, mtime=0)


@dataclass(frozen=True)
class Written:
    """What a written eStargz blob is: its TOC's digest, and its tar's digest and size (the new diff_id)."""

    toc_digest: str
    diff_id: str
    uncompressed_size: int
    compressed_size: int
    prioritized: int  # entries before the prefetch landmark
    prefetch_bytes: int  # compressed bytes before the landmark's member: what the snapshotter prefetches
    entries: int


@dataclass
class _Member:
    data: bytes
    starts: list[dict[str, Any]]  # TOC records whose `offset` is this member's


def _members(source: IO[bytes], ordered: Ordered, chunk_size: int, toc: list[dict[str, Any]]) -> Iterator[_Member]:
    """The blob's members before the TOC's, uncompressed, in order; fills `toc` as it goes."""
    names: dict[tuple[str, int], str] = {}
    pending = bytearray()  # the current member: headers (and a chunk's tail) until the next content
    starts: list[dict[str, Any]] = []
    landmark = Entry(PREFETCH_LANDMARK if ordered.prioritized else NO_PREFETCH_LANDMARK, "reg", 0, 0,
                     len(LANDMARK_CONTENT), tarfile.TarInfo())
    sequence: list[Entry | None] = list(ordered.entries)
    sequence.insert(ordered.prioritized, None)  # None: the landmark
    for entry in sequence:
        if entry is None:
            header, size = _tar_header(landmark.name, landmark.size), landmark.size
            record = {"name": landmark.name, "type": "reg", "size": size, "mode": 0o644}
            read: Callable[[int], bytes] = io.BytesIO(LANDMARK_CONTENT).read
        else:
            source.seek(entry.header_offset)
            header, size = source.read(entry.data_offset - entry.header_offset), entry.size
            if len(header) != entry.data_offset - entry.header_offset:
                raise EstargzError(f"{entry.name}: the tar ends inside its header")
            record = _toc_entry(entry, names)
            read = source.read
        pending += header
        if entry is None or entry.kind == "reg":
            record["digest"] = "sha256:" + hashlib.sha256(b"").hexdigest()
        if not size:
            toc.append(record)
            continue
        yield _Member(bytes(pending), starts)
        pending, starts = bytearray(), []
        whole = hashlib.sha256() if size > chunk_size else None  # one chunk: the file's digest is the chunk's
        first = record
        for chunk_offset in range(0, size, chunk_size):
            length = min(chunk_size, size - chunk_offset)
            chunk = read(length)
            if len(chunk) != length:
                raise EstargzError(f"{first['name']}: the tar ends inside its content")
            if whole is not None:
                whole.update(chunk)
            if chunk_offset:
                record = {"name": first["name"], "type": "chunk", "chunkOffset": chunk_offset}
            if size - chunk_offset > chunk_size:  # the last chunk's size is left out: "to the end"
                record["chunkSize"] = chunk_size
            record["chunkDigest"] = "sha256:" + hashlib.sha256(chunk).hexdigest()
            toc.append(record)
            if chunk_offset + chunk_size < size:
                yield _Member(chunk, [record])
            else:  # the last chunk's member goes on with the padding and the next headers
                pending, starts = bytearray(chunk + _padding(size)), [record]
        first["digest"] = "sha256:" + whole.hexdigest() if whole is not None else first["chunkDigest"]
    if pending:
        yield _Member(bytes(pending), starts)


def write(source: IO[bytes], ordered: Ordered, sink: Sink, *, executor: Executor | None = None,
          ahead: int = 4, compress: Callable[[bytes], bytes] = gzip_member, chunk_size: int = CHUNK_SIZE) -> Written:
    """Write `ordered` (entries of the tar in `source`) to `sink` as an eStargz blob.

    With an `executor`, members are compressed on its threads, up to `ahead` members beyond the one
    being written (what bounds the memory: a member is at most `chunk_size` and some headers); the
    blob is the same either way.
    """
    toc: list[dict[str, Any]] = []
    diff = hashlib.sha256()
    uncompressed = offset = 0
    prefetch_bytes = -1
    window: deque[tuple[_Member, Future[bytes] | bytes]] = deque()

    def emit() -> None:
        nonlocal offset, prefetch_bytes
        member, compressed = window.popleft()
        data = compressed if isinstance(compressed, bytes) else compressed.result()
        for record in member.starts:
            record["offset"] = offset
            if record["name"] == PREFETCH_LANDMARK:
                prefetch_bytes = offset
        sink.write(data)
        offset += len(data)

    for member in _members(source, ordered, chunk_size, toc):
        diff.update(member.data)
        uncompressed += len(member.data)
        window.append((member, executor.submit(compress, member.data) if executor else compress(member.data)))
        if len(window) > ahead:
            emit()
    while window:
        emit()

    raw_toc = toc_json(toc)
    toc_member = _tar_header(TOC_NAME, len(raw_toc)) + raw_toc + _padding(len(raw_toc)) + bytes(2 * BLOCK)
    diff.update(toc_member)
    uncompressed += len(toc_member)
    compressed_toc = compress(toc_member)
    sink.write(compressed_toc)
    sink.write(footer(offset))
    return Written(toc_digest="sha256:" + hashlib.sha256(raw_toc).hexdigest(), diff_id="sha256:" + diff.hexdigest(),
                   uncompressed_size=uncompressed, compressed_size=offset + len(compressed_toc) + FOOTER_SIZE,
                   prioritized=ordered.prioritized,
                   prefetch_bytes=max(prefetch_bytes, 0), entries=len(ordered.entries))
