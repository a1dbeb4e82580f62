"""The eStargz writer (imagebuild/oci/estargz.py), the pure parts: the blob's gzip members, the TOC and its
chunks, the footer, the prefetch landmark, the order prioritized entries take, and the odd entries a layer
holds (hard and symbolic links, long names, extended attributes, devices). The Go reader's verdict on the
same blobs is tests/e2e/test_estargz.py's."""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from imagebuild.oci import estargz

MiB = 1 << 20
BIG = os.urandom(9 * MiB + 123)
EXACT = os.urandom(4 * MiB)
LONG_DIR = "usr/" + "d" * 150
LONG_FILE = f"{LONG_DIR}/long-" + "f" * 120


def _add(archive: tarfile.TarFile, name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **fields) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mtime = kind, fields.pop("mtime", 1_700_000_000)
    info.mode = fields.pop("mode", 0o755 if kind == tarfile.DIRTYPE else 0o644)
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    for key, value in fields.items():
        setattr(info, key, value)
    archive.addfile(info, io.BytesIO(data) if data else None)


def layer_tar(fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A layer as an engine writes one: folders first, then what is in them, every kind of entry."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        _add(archive, "etc/", tarfile.DIRTYPE)
        _add(archive, "etc/hosts", data=b"127.0.0.1 localhost\n", uname="root", gname="root")
        _add(archive, "etc/passwd", data=b"root:x:0:0::/root:/bin/sh\n", uname="root", gname="root")
        _add(archive, "etc/.wh.gone")  # a whiteout: an empty regular file
        _add(archive, "usr/", tarfile.DIRTYPE)
        _add(archive, "usr/bin/", tarfile.DIRTYPE)
        _add(archive, "usr/bin/big", data=BIG, uid=1000, gid=1000, uname="paddle", gname="paddle")
        _add(archive, "usr/bin/exact", data=EXACT, uid=1000, gid=1000, uname="paddle", gname="paddle")
        _add(archive, "usr/bin/empty")
        _add(archive, "usr/bin/link", tarfile.SYMTYPE, linkname="big")
        _add(archive, "usr/bin/hard", tarfile.LNKTYPE, linkname="usr/bin/big")
        _add(archive, LONG_DIR + "/", tarfile.DIRTYPE)
        _add(archive, LONG_FILE, data=b"a long name\n")
        _add(archive, "usr/bin/cap", data=b"\x7fELF", pax_headers={"SCHILY.xattr.security.capability": "\x01\x00\x00\x02"})
        _add(archive, "dev/", tarfile.DIRTYPE)
        _add(archive, "dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
        _add(archive, "dev/fifo", tarfile.FIFOTYPE)
    return buffer.getvalue()


def convert(tar: bytes, prioritized: list[str] | None = None, threads: int = 0,
            chunk_size: int = estargz.CHUNK_SIZE) -> tuple[bytes, estargz.Written]:
    source = io.BytesIO(tar)
    ordered = estargz.prioritize(estargz.read_entries(source), prioritized or [])
    sink = io.BytesIO()
    if threads:
        with ThreadPoolExecutor(threads) as pool:
            written = estargz.write(source, ordered, sink, executor=pool, ahead=2 * threads, chunk_size=chunk_size)
    else:
        written = estargz.write(source, ordered, sink, chunk_size=chunk_size)
    return sink.getvalue(), written


def gunzip(blob: bytes) -> bytes:
    """Every member, as one stream. (Not gzip.decompress: it copies what is left after each member, so a
    blob of thousands of members, as an image layer's is, takes minutes.)"""
    with gzip.GzipFile(fileobj=io.BytesIO(blob)) as stream:
        return stream.read()


def toc_of(blob: bytes) -> tuple[bytes, dict]:
    offset = estargz.parse_footer(blob[-estargz.FOOTER_SIZE:])
    with tarfile.open(fileobj=io.BytesIO(gunzip(blob[offset:-estargz.FOOTER_SIZE]))) as archive:
        member = archive.next()
        assert member is not None and member.name == estargz.TOC_NAME
        raw = archive.extractfile(member).read()  # type: ignore[union-attr]
        assert archive.next() is None, "the TOC is the last entry"
    return raw, json.loads(raw)


def member_at(blob: bytes, offset: int) -> bytes:
    """The one gzip member starting at `offset`, decompressed (it must start there: a gzip header)."""
    assert blob[offset:offset + 2] == b"\x1f\x8b", f"no gzip member starts at {offset}"
    return zlib.decompressobj(31).decompress(blob[offset:])


def test_the_blob_is_one_gzip_tar_with_every_entry_in_it_and_the_toc_last():
    tar = layer_tar()
    blob, written = convert(tar)
    plain = gunzip(blob)  # every gzip reader takes the members as one stream
    assert (hashlib.sha256(plain).hexdigest(), len(plain)) == (written.diff_id.split(":")[1], written.uncompressed_size)
    assert len(blob) == written.compressed_size
    with tarfile.open(fileobj=io.BytesIO(plain)) as archive:
        names = [m.name for m in archive]
        assert archive.extractfile(LONG_FILE).read() == b"a long name\n"  # type: ignore[union-attr]
        assert archive.extractfile("usr/bin/big").read() == BIG  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(tar)) as original:
        originals = [m.name for m in original]
    # No prioritized files: the no-prefetch landmark first, the layer's entries in their order, the TOC last.
    assert names == [estargz.NO_PREFETCH_LANDMARK, *originals, estargz.TOC_NAME]


def test_each_entrys_header_bytes_are_kept_exactly():
    tar = layer_tar()
    plain = gunzip(convert(tar)[0])
    source = io.BytesIO(tar)
    for entry in estargz.read_entries(source):
        source.seek(entry.header_offset)
        header = source.read(entry.data_offset - entry.header_offset)
        assert header in plain, entry.name  # PAX and GNU long-name records included


def test_the_toc_digest_covers_the_toc_and_each_file_has_its_content_digest():
    blob, written = convert(layer_tar())
    raw, toc = toc_of(blob)
    assert written.toc_digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert toc["version"] == 1
    regs = {e["name"]: e for e in toc["entries"] if e["type"] == "reg"}
    assert regs["usr/bin/big"]["digest"] == "sha256:" + hashlib.sha256(BIG).hexdigest()
    assert regs["usr/bin/big"]["size"] == len(BIG)
    assert regs["usr/bin/empty"]["digest"] == "sha256:" + hashlib.sha256(b"").hexdigest()
    assert "offset" not in regs["usr/bin/empty"] and "size" not in regs["usr/bin/empty"]


def test_a_large_file_is_cut_into_4_mib_chunks_each_in_a_gzip_member_of_its_own_with_its_digest():
    blob, _ = convert(layer_tar())
    _, toc = toc_of(blob)
    entries = toc["entries"]
    first = next(i for i, e in enumerate(entries) if e["name"] == "usr/bin/big")
    chunks = entries[first:first + 3]
    assert [c["type"] for c in chunks] == ["reg", "chunk", "chunk"]
    assert [c.get("chunkOffset", 0) for c in chunks] == [0, 4 * MiB, 8 * MiB]
    # Every chunk but the last says its size; the last runs to the end of the file (size left out).
    assert [c.get("chunkSize") for c in chunks] == [4 * MiB, 4 * MiB, None]
    for chunk in chunks:
        start = chunk.get("chunkOffset", 0)
        data = BIG[start:start + (chunk.get("chunkSize") or len(BIG) - start)]
        assert chunk["chunkDigest"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert member_at(blob, chunk["offset"]).startswith(data)
    assert len({c["offset"] for c in chunks}) == 3


def test_a_file_of_exactly_one_chunk_is_one_member_with_no_chunk_size():
    blob, _ = convert(layer_tar())
    _, toc = toc_of(blob)
    exact = [e for e in toc["entries"] if e["name"] == "usr/bin/exact" or
             (e["type"] == "chunk" and e["name"] == "usr/bin/exact")]
    assert len(exact) == 1 and "chunkSize" not in exact[0]
    assert member_at(blob, exact[0]["offset"])[:len(EXACT)] == EXACT


def test_the_footer_is_51_bytes_an_empty_gzip_member_naming_the_tocs_offset():
    blob, _ = convert(layer_tar())
    tail = blob[-estargz.FOOTER_SIZE:]
    assert gunzip(tail) == b""
    offset = estargz.parse_footer(tail)
    assert tail == estargz.footer(offset)
    assert member_at(blob, offset)[:512].startswith(estargz.TOC_NAME.encode())
    with pytest.raises(estargz.EstargzError, match="no eStargz footer"):
        estargz.parse_footer(gzip.compress(b"x")[-estargz.FOOTER_SIZE:].rjust(estargz.FOOTER_SIZE, b"\0"))


def test_prioritized_files_come_first_each_after_its_folders_then_the_prefetch_landmark():
    blob, written = convert(layer_tar(), ["/etc/passwd", "/usr/bin/cap", "/not/in/this/layer"])
    with tarfile.open(fileobj=io.BytesIO(gunzip(blob))) as archive:
        names = [m.name for m in archive]
        landmark = archive.extractfile(estargz.PREFETCH_LANDMARK).read()  # type: ignore[union-attr]
    assert names[:6] == ["etc", "etc/passwd", "usr", "usr/bin", "usr/bin/cap", estargz.PREFETCH_LANDMARK]
    assert landmark == b"\x0f" and estargz.NO_PREFETCH_LANDMARK not in names
    assert names.count("etc") == 1 and names.index("etc/hosts") > names.index(estargz.PREFETCH_LANDMARK)
    assert written.prioritized == 5
    # The snapshotter prefetches the blob up to the landmark's member: that range holds the prioritized files.
    _, toc = toc_of(blob)
    mark = next(e for e in toc["entries"] if e["name"] == estargz.PREFETCH_LANDMARK)
    assert mark["offset"] == written.prefetch_bytes > 0
    cap = next(e for e in toc["entries"] if e["name"] == "usr/bin/cap")
    assert cap["offset"] < mark["offset"]
    assert member_at(blob, mark["offset"]).startswith(b"\x0f")


def test_a_prioritized_hard_link_brings_its_target_first():
    blob, written = convert(layer_tar(), ["usr/bin/hard"])
    with tarfile.open(fileobj=io.BytesIO(gunzip(blob))) as archive:
        names = [m.name for m in archive]
    assert names[:5] == ["usr", "usr/bin", "usr/bin/big", "usr/bin/hard", estargz.PREFETCH_LANDMARK]
    _, toc = toc_of(blob)
    hard = next(e for e in toc["entries"] if e["name"] == "usr/bin/hard")
    assert hard["type"] == "hardlink" and hard["linkName"] == "usr/bin/big" and "offset" not in hard


def test_symbolic_links_devices_fifos_long_names_and_xattrs_are_in_the_toc():
    _, toc = toc_of(convert(layer_tar(fmt=tarfile.GNU_FORMAT))[0])
    by_name = {e["name"]: e for e in toc["entries"] if e["type"] != "chunk"}
    assert by_name["usr/bin/link"] == {"name": "usr/bin/link", "type": "symlink", "modtime": "2023-11-14T22:13:20Z",
                                       "linkName": "big", "mode": 0o644}
    assert (by_name["dev/null"]["type"], by_name["dev/null"]["devMajor"], by_name["dev/null"]["devMinor"]) == ("char", 1, 3)
    assert by_name["dev/fifo"]["type"] == "fifo"
    assert by_name[LONG_FILE]["size"] == len(b"a long name\n")  # GNU long-name records resolved
    assert by_name["etc"]["type"] == "dir" and by_name["etc"]["mode"] == 0o755
    _, pax = toc_of(convert(layer_tar())[0])
    cap = next(e for e in pax["entries"] if e["name"] == "usr/bin/cap")
    assert base64.b64decode(cap["xattrs"]["security.capability"]) == b"\x01\x00\x00\x02"


def test_owner_names_are_written_where_they_change_for_an_id():
    _, toc = toc_of(convert(layer_tar())[0])
    named = [(e["name"], e.get("userName")) for e in toc["entries"] if e.get("userName")]
    assert named == [("etc/hosts", "root"), ("usr/bin/big", "paddle")]
    assert next(e for e in toc["entries"] if e["name"] == "usr/bin/exact")["uid"] == 1000


def test_the_same_layer_gives_the_same_blob_whatever_the_threads():
    tar = layer_tar()
    alone, _ = convert(tar, ["etc/hosts"])
    assert convert(tar, ["etc/hosts"], threads=2)[0] == alone
    assert convert(tar, ["etc/hosts"], threads=4)[0] == alone


def test_a_layer_written_as_estargz_before_is_written_again_without_its_old_toc_and_landmark():
    once, _ = convert(layer_tar(), ["etc/hosts"])
    again, _ = convert(gunzip(once), ["etc/hosts"])
    with tarfile.open(fileobj=io.BytesIO(gunzip(again))) as archive:
        names = [m.name for m in archive]
    assert names.count(estargz.TOC_NAME) == 1 and names.count(estargz.PREFETCH_LANDMARK) == 1


def test_a_name_given_twice_keeps_its_last_entry_as_extraction_would():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        _add(archive, "a", data=b"first")
        _add(archive, "b", data=b"between")
        _add(archive, "a", data=b"second")
    blob, _ = convert(buffer.getvalue())
    with tarfile.open(fileobj=io.BytesIO(gunzip(blob))) as archive:
        assert [m.name for m in archive][1:-1] == ["b", "a"]
        assert archive.extractfile("a").read() == b"second"  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", [tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE])
def test_an_entry_the_format_has_no_word_for_is_refused_by_name(kind):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        _add(archive, "odd", kind)
    with pytest.raises(estargz.EstargzError, match="odd"):
        estargz.read_entries(io.BytesIO(buffer.getvalue()))


def test_a_name_that_is_not_utf8_is_refused():
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT, encoding="latin-1") as archive:
        _add(archive, "caf\xe9")
    with pytest.raises(estargz.EstargzError, match="not UTF-8"):
        estargz.read_entries(io.BytesIO(buffer.getvalue()))


def test_a_truncated_tar_is_refused():
    with pytest.raises(estargz.EstargzError, match="malformed tar: unexpected end of data"):
        convert(layer_tar()[:5 * MiB])


def test_a_small_chunk_size_cuts_every_file_into_members_that_each_start_at_their_offset():
    blob, _ = convert(layer_tar(), chunk_size=64 * 1024)
    _, toc = toc_of(blob)
    data = [e for e in toc["entries"] if "offset" in e]
    assert len(data) > 200
    assert len({e["offset"] for e in data}) == len(data)  # one member per chunk
    for entry in data[:20]:
        assert blob[entry["offset"]:entry["offset"] + 2] == b"\x1f\x8b"
