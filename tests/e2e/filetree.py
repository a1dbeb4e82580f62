"""An image's file tree as the engine exports it, and its layers' sizes: for tests (and one-off checks) that
prove two images hold the same files however their layers cut them.

    python -m tests.e2e.filetree REF_A REF_B     # compare two images the engine holds; exit 1 on a difference
"""
from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from typing import IO

import docker

from .layers import CHUNK, _ChunkStream


@dataclass(frozen=True)
class FileInfo:
    """What two images must agree on for a path: everything but its times."""

    kind: str  # file, dir, symlink, hardlink, other
    mode: int
    uid: int
    gid: int
    size: int
    digest: str  # the content's sha256 (files), the target (links), "" otherwise


_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "symlink",
          tarfile.LNKTYPE: "hardlink"}


def image_tree(engine: docker.DockerClient, reference: str) -> dict[str, FileInfo]:
    """Every path of the image's root file system (a created, never started container's export)."""
    container = engine.containers.create(reference, command=["true"], network_disabled=True)
    try:
        stream = io.BufferedReader(_ChunkStream(container.export(chunk_size=CHUNK)), CHUNK)
        tree: dict[str, FileInfo] = {}
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for member in archive:
                kind = _KINDS.get(member.type, "other")
                digest = ""
                if kind == "file":
                    handle = archive.extractfile(member)
                    assert handle is not None
                    digest = _content_digest(handle, member.name.endswith(".pyc"))
                elif kind in ("symlink", "hardlink"):
                    digest = member.linkname
                tree["/" + member.name.rstrip("/")] = FileInfo(kind, member.mode, member.uid, member.gid,
                                                               member.size, digest)
        return tree
    finally:
        container.remove(force=True)


# ldconfig's record of each library's inode and change time: it differs between any two builds of one
# Dockerfile (the ld.so.cache it speeds up does not).
BUILD_NOISE = frozenset({"/var/cache/ldconfig/aux-cache"})


def _content_digest(handle: IO[bytes], bytecode: bool) -> str:
    hasher = hashlib.sha256()
    if bytecode:
        # A timestamp .pyc (PEP 552 flags 0) holds its source's mtime in bytes 8-12, and pip writes each
        # source at install time: the one byte range two builds of one wheel never agree on.
        head = handle.read(16)
        flags = int.from_bytes(head[4:8], "little") if len(head) == 16 else 1
        hasher.update(head[:8] + head[12:] if flags == 0 else head)
    for chunk in iter(lambda: handle.read(CHUNK), b""):
        hasher.update(chunk)
    return hasher.hexdigest()


def differences(one: dict[str, FileInfo], other: dict[str, FileInfo], limit: int = 20) -> list[str]:
    """What differs between two trees (BUILD_NOISE aside), one line per path (at most `limit`)."""
    lines = []
    for path in sorted((set(one) | set(other)) - BUILD_NOISE):
        a, b = one.get(path), other.get(path)
        if a != b:
            lines.append(f"{path}: {a} != {b}")
            if len(lines) == limit:
                break
    return lines


@dataclass(frozen=True)
class LayerSize:
    created_by: str  # the history step that made the layer
    size: int  # the layer's files, unpacked, in bytes (as the engine counts them)


def layer_sizes(engine: docker.DockerClient, reference: str, crane: str) -> list[LayerSize]:
    """Each layer of an image the engine holds and a registry serves, oldest first, with the step that made it.

    The engine's history has one entry per step of the image config's history, with the size of the layer
    a step made; the config (asked of the registry with crane) says which steps made none.
    """
    asked = subprocess.run([crane, "config", "--insecure", reference], capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    steps = json.loads(asked.stdout)["history"]
    history = list(reversed(engine.api.history(reference)))
    assert len(history) == len(steps), (len(history), len(steps))
    return [LayerSize(step.get("created_by", ""), int(entry["Size"]))
            for step, entry in zip(steps, history) if not step.get("empty_layer")]


def main(argv: list[str]) -> int:
    engine = docker.from_env(timeout=600)
    one, other = (image_tree(engine, ref) for ref in argv[:2])
    lines = differences(one, other)
    print(f"{len(one)} and {len(other)} paths; {'the same' if not lines else 'they differ:'}")
    for line in lines:
        print(f"  {line}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
