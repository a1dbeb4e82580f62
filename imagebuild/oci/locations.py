"""Where blobs were last seen, per registry: hints for cross-repository mounts.

A registry mounts a blob from another of its repositories without a byte moving, but only when
told which one. Copies remember where each blob landed, so a later copy of an image sharing
blobs with an earlier one, into another repository of the same registry, mounts them instead
of uploading them again (skopeo keeps a blob-info cache for the same reason). The file holds
digests and repository names only; a wrong or stale hint costs one refused mount, nothing more.
Entries outside the OCI grammar (a damaged or edited file) are dropped when read: a hint goes
into a mount request's query.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from imagebuild.oci.names import is_digest, is_repository

MAX_DIGESTS_PER_REGISTRY = 20000
MAX_REPOSITORIES_PER_DIGEST = 4


def default_cache_dir(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("IMAGEBUILD_CACHE_DIR"):
        return Path(env["IMAGEBUILD_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".cache")
    return Path(base) / "imagebuild"


class BlobLocations:
    """registry -> digest -> repositories (most recent first); in memory, saved to `path` when given."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._known: dict[str, dict[str, list[str]]] = self._read() if path else {}
        self._changed = False

    @classmethod
    def default(cls) -> BlobLocations:
        return cls(default_cache_dir() / "blob-locations.json")

    def _read(self) -> dict[str, dict[str, list[str]]]:
        try:
            data = json.loads(self.path.read_text()) if self.path else {}
        except (OSError, ValueError):
            return {}  # absent or damaged: start afresh, it is only a cache
        known = data.get("locations") if isinstance(data, dict) else None
        if not isinstance(known, dict):
            return {}
        return {str(registry): {d: [r for r in repos if is_repository(r)][:MAX_REPOSITORIES_PER_DIGEST]
                                for d, repos in digests.items() if is_digest(d) and isinstance(repos, list)}
                for registry, digests in known.items() if isinstance(digests, dict)}

    def hints(self, registry: str, digest: str) -> list[str]:
        with self._lock:
            return list(self._known.get(registry, {}).get(digest, []))

    def remember(self, registry: str, digest: str, repository: str) -> None:
        with self._lock:
            digests = self._known.setdefault(registry, {})
            repositories = [repository, *(r for r in digests.pop(digest, []) if r != repository)]
            digests[digest] = repositories[:MAX_REPOSITORIES_PER_DIGEST]  # re-inserted: newest last
            while len(digests) > MAX_DIGESTS_PER_REGISTRY:
                digests.pop(next(iter(digests)))
            self._changed = True

    def forget(self, registry: str, digest: str, repository: str) -> None:
        with self._lock:
            repositories = self._known.get(registry, {}).get(digest)
            if repositories and repository in repositories:
                repositories.remove(repository)
                self._changed = True

    def save(self) -> None:
        """Merge into the file (other processes may have written since) and replace it atomically."""
        if self.path is None or not self._changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._file_lock():
                on_disk = self._read()
                with self._lock:
                    for registry, digests in self._known.items():
                        merged = on_disk.setdefault(registry, {})
                        for digest, repositories in digests.items():
                            older = [r for r in merged.pop(digest, []) if r not in repositories]
                            merged[digest] = (repositories + older)[:MAX_REPOSITORIES_PER_DIGEST]
                        while len(merged) > MAX_DIGESTS_PER_REGISTRY:
                            merged.pop(next(iter(merged)))
                    self._changed = False
                temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                temporary.write_text(json.dumps({"version": 1, "locations": on_disk}, separators=(",", ":")))
                temporary.replace(self.path)
        except OSError:
            pass  # a cache that cannot be written only makes a later copy slower

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        assert self.path is not None
        with open(self.path.with_name(f".{self.path.name}.lock"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
