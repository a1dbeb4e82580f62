"""An image's config and layer tars read straight from the engine's own storage (overlay2).

`docker save` (engine 20.10) copies an image's whole layer chain before it streams a byte,
about 10 s per GB here, even when only the top layer is wanted. The engine keeps what is
needed to rebuild any one layer's tar exactly, the way it does for `docker save` itself:

- `<root>/image/<driver>/imagedb/content/sha256/<image id>`: the image config's raw bytes;
- `<root>/image/<driver>/layerdb/sha256/<chain id>/`: `diff` (the layer's diff_id), `cache-id`
  (its directory `<root>/<driver>/<cache id>/diff`) and `tar-split.json.gz`, the tar's
  headers and padding with a reference to the file that holds each entry's content.

tar-split (github.com/vbatts/tar-split) writes one JSON object per line: type 2 ("segment")
carries raw tar bytes, base64, in `payload`; type 1 ("file") names a path in the diff
directory (`name`, or base64 `name_raw` when not UTF-8) whose first `size` bytes come next.

Nothing read here is trusted: the config must hash to the image id, and the caller hashes
each rebuilt tar against the layer's diff_id as it streams.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuild.core.errors import ImagebuildError

FILE_ENTRY = 1
SEGMENT_ENTRY = 2
CHUNK = 1 << 20


class StorageUnreadable(ImagebuildError):
    """The engine's storage cannot give this image's bytes; the message says why."""


def tar_split_entries(path: Path) -> Iterator[dict[str, Any]]:
    """The entries of a `tar-split.json.gz`, in order."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise StorageUnreadable(f"{path}:{number}: not JSON ({exc.msg})") from None


def _entry_path(entry: dict[str, Any]) -> bytes:
    raw = base64.b64decode(entry["name_raw"]) if entry.get("name_raw") else os.fsencode(entry.get("name") or "")
    parts = raw.split(b"/")
    if raw.startswith(b"/") or b".." in parts:
        raise StorageUnreadable(f"tar-split names a path outside the layer: {raw!r}")
    return raw


def reassemble(entries: Iterable[dict[str, Any]], diff_dir: Path, chunk: int = CHUNK) -> Iterator[bytes]:
    """The layer's tar stream, rebuilt from its tar-split entries and the files in `diff_dir`.

    Yields chunks of about `chunk` bytes. A file shorter than its entry's size, or an entry
    of a type tar-split does not write, stops the stream with StorageUnreadable.
    """
    pending = bytearray()
    base = os.fsencode(diff_dir)
    for entry in entries:
        kind = entry.get("type")
        if kind == SEGMENT_ENTRY:
            pending += base64.b64decode(entry.get("payload") or b"")
        elif kind == FILE_ENTRY:
            size = int(entry.get("size") or 0)
            if size <= 0:
                continue  # directories, links, empty files: the header said it all
            path = base + b"/" + _entry_path(entry)
            try:
                handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError as exc:
                raise StorageUnreadable(f"{os.fsdecode(path)}: {exc.strerror}") from None
            with os.fdopen(handle, "rb") as source:
                left = size
                while left:
                    if len(pending) >= chunk:
                        yield bytes(pending)
                        pending.clear()
                    data = source.read(min(chunk, left))
                    if not data:
                        raise StorageUnreadable(f"{os.fsdecode(path)}: {left} of its {size} bytes missing")
                    pending += data
                    left -= len(data)
        else:
            raise StorageUnreadable(f"tar-split entry of unknown type {kind!r}")
        if len(pending) >= chunk:
            yield bytes(pending)
            pending.clear()
    if pending:
        yield bytes(pending)


@dataclass(frozen=True)
class EngineStorage:
    """An engine's data root (`docker info`: DockerRootDir) and storage driver, readable here."""

    root: Path
    driver: str

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> EngineStorage:
        """The storage `docker info` describes, or StorageUnreadable saying why not."""
        driver, root = info.get("Driver"), info.get("DockerRootDir")
        if driver != "overlay2":
            raise StorageUnreadable(f"storage driver {driver!r}, not overlay2")
        if not root:
            raise StorageUnreadable("the engine names no data root")
        storage = cls(Path(root), driver)
        if not os.access(storage.layerdb, os.R_OK | os.X_OK):
            raise StorageUnreadable(f"{storage.layerdb} is not readable here (another host, or not root)")
        return storage

    @property
    def layerdb(self) -> Path:
        return self.root / "image" / self.driver / "layerdb" / "sha256"

    def image_config(self, image_id: str) -> bytes:
        """The config's raw bytes, which must hash to `image_id`."""
        algorithm, _, hex_id = image_id.partition(":")
        path = self.root / "image" / self.driver / "imagedb" / "content" / algorithm / hex_id
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise StorageUnreadable(f"{path}: {exc.strerror}") from None
        if "sha256:" + hashlib.sha256(raw).hexdigest() != image_id:
            raise StorageUnreadable(f"{path} does not hash to the image id")
        return raw

    def layer_tar(self, chain_id: str, diff_id: str) -> Iterator[bytes]:
        """The layer's tar stream, unverified: the caller hashes it against `diff_id`."""
        layer = self.layerdb / chain_id.partition(":")[2]
        try:
            recorded = (layer / "diff").read_text().strip()
            cache_id = (layer / "cache-id").read_text().strip()
        except OSError as exc:
            raise StorageUnreadable(f"{layer}: {exc.strerror}") from None
        if recorded != diff_id:
            raise StorageUnreadable(f"{layer} records diff {recorded}, not {diff_id}")
        if not cache_id or "/" in cache_id or cache_id.startswith("."):
            raise StorageUnreadable(f"{layer}/cache-id is not a directory name")
        diff_dir = self.root / self.driver / cache_id / "diff"
        if not diff_dir.is_dir():
            raise StorageUnreadable(f"{diff_dir} is missing")
        return _unreadable_on_error(reassemble(tar_split_entries(layer / "tar-split.json.gz"), diff_dir))


def _unreadable_on_error(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Any failure to read the storage (missing file, bad gzip or base64) as StorageUnreadable."""
    try:
        yield from chunks
    except (OSError, EOFError, ValueError, KeyError, TypeError) as exc:
        raise StorageUnreadable(f"{exc.__class__.__name__}: {exc}") from None
