"""Rebuilding a layer's tar from tar-split entries and its diff directory (imagebuild/build/layerstore.py).

Each test writes a real tar with Python's tarfile, describes it the way tar-split does (raw
header and padding bytes as base64 segments, each file's content by name and size) and
checks that the rebuilt stream is that tar, byte for byte.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from imagebuild.build.layerstore import (
    FILE_ENTRY,
    SEGMENT_ENTRY,
    EngineStorage,
    StorageUnreadable,
    reassemble,
)


def _segment(data: bytes, position: int) -> dict:
    return {"type": SEGMENT_ENTRY, "payload": base64.b64encode(data).decode(), "position": position}


def _file(name: bytes, size: int, position: int) -> dict:
    entry: dict = {"type": FILE_ENTRY, "payload": None, "position": position}
    try:
        entry["name"] = name.decode("utf-8")
    except UnicodeDecodeError:
        entry["name_raw"] = base64.b64encode(name).decode()
    if size:
        entry["size"] = size
    return entry


def _tar_and_entries(diff_dir: Path, fmt: int = tarfile.GNU_FORMAT) -> tuple[bytes, list[dict]]:
    """A tar of everything under `diff_dir`, and its tar-split entries."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as archive:
        for path in sorted(diff_dir.rglob("*")):
            archive.add(path, arcname=os.fsdecode(path.relative_to(diff_dir)), recursive=False)
    raw = buffer.getvalue()
    entries: list[dict] = []
    cursor = 0
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as archive:
        for member in archive.getmembers():
            entries.append(_segment(raw[cursor:member.offset_data], len(entries)))
            size = member.size if member.isreg() else 0
            entries.append(_file(os.fsencode(member.name), size, len(entries)))
            cursor = member.offset_data + size
            padding = -size % tarfile.BLOCKSIZE
            if padding:
                entries.append(_segment(raw[cursor:cursor + padding], len(entries)))
                cursor += padding
    entries.append(_segment(raw[cursor:], len(entries)))  # the end-of-archive blocks
    return raw, entries


@pytest.fixture
def diff_dir(tmp_path: Path) -> Path:
    root = tmp_path / "diff"
    (root / "usr" / "lib").mkdir(parents=True)
    (root / "usr" / "lib" / "big.so").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    (root / "usr" / "lib" / "empty").write_bytes(b"")
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text("imagebuild\n")
    (root / "etc" / "link").symlink_to("hostname")
    (root / ("long-" + "x" * 150)).write_text("a name longer than a ustar header holds\n")
    return root


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_rebuilt_stream_is_the_original_tar_byte_for_byte(diff_dir, fmt):
    raw, entries = _tar_and_entries(diff_dir, fmt)
    rebuilt = b"".join(reassemble(entries, diff_dir))
    assert hashlib.sha256(rebuilt).hexdigest() == hashlib.sha256(raw).hexdigest()


def test_the_stream_comes_in_chunks_of_about_the_asked_size(diff_dir):
    raw, entries = _tar_and_entries(diff_dir)
    chunks = list(reassemble(entries, diff_dir, chunk=64 * 1024))
    assert b"".join(chunks) == raw
    assert len(chunks) > 3 * 1024 // 64  # the 3 MB file is not one piece
    assert max(len(chunk) for chunk in chunks) < 2 * 64 * 1024


def test_a_name_that_is_not_utf8_is_read_from_name_raw(tmp_path):
    root = tmp_path / "diff"
    root.mkdir()
    name = b"caf\xe9.txt"
    (root / os.fsdecode(name)).write_bytes(b"latin-1 name\n")
    raw, entries = _tar_and_entries(root)
    assert any("name_raw" in entry for entry in entries)
    assert b"".join(reassemble(entries, root)) == raw


def test_a_missing_file_stops_the_stream(diff_dir):
    _, entries = _tar_and_entries(diff_dir)
    (diff_dir / "etc" / "hostname").unlink()
    with pytest.raises(StorageUnreadable, match="hostname"):
        b"".join(reassemble(entries, diff_dir))


def test_a_file_shorter_than_its_entry_stops_the_stream(diff_dir):
    _, entries = _tar_and_entries(diff_dir)
    (diff_dir / "usr" / "lib" / "big.so").write_bytes(b"truncated")
    with pytest.raises(StorageUnreadable, match="bytes missing"):
        b"".join(reassemble(entries, diff_dir))


def test_a_changed_file_of_the_same_size_rebuilds_a_tar_with_another_hash(diff_dir):
    raw, entries = _tar_and_entries(diff_dir)
    (diff_dir / "etc" / "hostname").write_text("IMAGEBUILD\n")
    rebuilt = b"".join(reassemble(entries, diff_dir))
    assert len(rebuilt) == len(raw) and hashlib.sha256(rebuilt).digest() != hashlib.sha256(raw).digest()


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "usr/../../outside"])
def test_a_name_outside_the_diff_directory_is_refused(tmp_path, name):
    (tmp_path / "outside").write_text("not in the layer\n")
    root = tmp_path / "diff"
    root.mkdir()
    with pytest.raises(StorageUnreadable, match="outside the layer"):
        list(reassemble([_file(name.encode(), 17, 0)], root))


def test_a_symlink_where_a_file_is_named_is_not_followed(tmp_path):
    (tmp_path / "secret").write_text("outside the layer\n")
    root = tmp_path / "diff"
    root.mkdir()
    (root / "innocent").symlink_to(tmp_path / "secret")
    with pytest.raises(StorageUnreadable, match="innocent"):
        list(reassemble([_file(b"innocent", 18, 0)], root))


def test_an_entry_of_an_unknown_type_is_refused(tmp_path):
    with pytest.raises(StorageUnreadable, match="unknown type"):
        list(reassemble([{"type": 7, "position": 0}], tmp_path))


def _storage_with_layer(root: Path, diff_dir_files: Path, diff_id: str, chain_id: str, entries: list[dict]) -> None:
    layer = root / "image" / "overlay2" / "layerdb" / "sha256" / chain_id.split(":")[1]
    layer.mkdir(parents=True)
    (layer / "diff").write_text(diff_id)
    (layer / "cache-id").write_text("abc123")
    with gzip.open(layer / "tar-split.json.gz", "wt") as handle:
        for entry in entries:
            handle.write(json.dumps(entry) + "\n")
    (root / "overlay2" / "abc123").mkdir(parents=True)
    diff_dir_files.rename(root / "overlay2" / "abc123" / "diff")


def test_a_layer_is_found_by_its_chain_id_in_a_storage_laid_out_like_the_engines(tmp_path, diff_dir):
    raw, entries = _tar_and_entries(diff_dir)
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    chain_id = "sha256:" + hashlib.sha256(b"some chain").hexdigest()
    _storage_with_layer(tmp_path / "root", diff_dir, diff_id, chain_id, entries)
    storage = EngineStorage.from_info({"Driver": "overlay2", "DockerRootDir": str(tmp_path / "root")})
    assert b"".join(storage.layer_tar(chain_id, diff_id)) == raw
    with pytest.raises(StorageUnreadable, match="records diff"):
        storage.layer_tar(chain_id, "sha256:" + "0" * 64)


def test_a_stored_config_is_accepted_only_when_it_hashes_to_the_image_id(tmp_path):
    config = b'{"rootfs":{"type":"layers","diff_ids":[]}}'
    image_id = "sha256:" + hashlib.sha256(config).hexdigest()
    content = tmp_path / "image" / "overlay2" / "imagedb" / "content" / "sha256"
    content.mkdir(parents=True)
    (tmp_path / "image" / "overlay2" / "layerdb" / "sha256").mkdir(parents=True)
    storage = EngineStorage.from_info({"Driver": "overlay2", "DockerRootDir": str(tmp_path)})
    (content / image_id.split(":")[1]).write_bytes(config)
    assert storage.image_config(image_id) == config
    (content / image_id.split(":")[1]).write_bytes(config + b" ")
    with pytest.raises(StorageUnreadable, match="does not hash"):
        storage.image_config(image_id)


def test_a_driver_other_than_overlay2_or_an_unreadable_root_is_not_used(tmp_path):
    with pytest.raises(StorageUnreadable, match="overlay2"):
        EngineStorage.from_info({"Driver": "btrfs", "DockerRootDir": str(tmp_path)})
    with pytest.raises(StorageUnreadable, match="not readable"):
        EngineStorage.from_info({"Driver": "overlay2", "DockerRootDir": str(tmp_path / "elsewhere")})
