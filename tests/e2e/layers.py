"""Reading every file of every layer of an image, for tests that prove what is not there."""
from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import docker

CHUNK = 1 << 20


class _ChunkStream(io.RawIOBase):
    """A file-like view of the generator docker's `image.save()` returns."""

    def __init__(self, chunks: Iterator[bytes]):
        self.chunks = iter(chunks)
        self.buffer = b""

    def readable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        while not self.buffer:
            try:
                self.buffer = next(self.chunks)
            except StopIteration:
                return 0
        n = min(len(target), len(self.buffer))
        target[:n] = self.buffer[:n]
        self.buffer = self.buffer[n:]
        return n


@dataclass
class Findings:
    """Where each needle was found: 'layer <n>: <path>' or 'config'."""

    hits: dict[bytes, list[str]] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)  # every file path seen, all layers
    layers: int = 0
    files: int = 0

    def add(self, needle: bytes, where: str) -> None:
        self.hits.setdefault(needle, []).append(where)


def _contains(stream, needles: list[bytes]) -> set[bytes]:
    found: set[bytes] = set()
    overlap = max(len(n) for n in needles) - 1
    tail = b""
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            return found
        window = tail + chunk
        for needle in needles:
            if needle not in found and needle in window:
                found.add(needle)
        tail = window[-overlap:] if overlap > 0 else b""


def scan_image(engine: docker.DockerClient, reference: str, needles: Iterable[bytes]) -> Findings:
    """Search the config (history, env, labels) and every file of every layer for the needles."""
    needles = [n for n in needles if n]
    findings = Findings()
    image = engine.images.get(reference)
    outer = tarfile.open(fileobj=io.BufferedReader(_ChunkStream(image.save(chunk_size=CHUNK)), CHUNK), mode="r|")
    for member in outer:
        if not member.isfile():
            continue
        handle = outer.extractfile(member)
        if member.name.endswith("layer.tar"):
            findings.layers += 1
            inner = tarfile.open(fileobj=handle, mode="r|")
            for entry in inner:
                findings.paths.append("/" + entry.name.lstrip("./"))
                if not entry.isfile() or entry.size == 0:
                    continue
                findings.files += 1
                for needle in _contains(inner.extractfile(entry), needles):
                    findings.add(needle, f"layer {findings.layers}: /{entry.name}")
        elif member.name.endswith(".json"):
            data = handle.read()
            for needle in needles:
                if needle in data:
                    findings.add(needle, member.name)
    history = json.dumps(image.history()).encode()
    for needle in needles:
        if needle in history:
            findings.add(needle, "history")
    return findings


def pem_blocks(text: str) -> list[str]:
    """The base64 body of each PEM certificate in `text`, one string per certificate."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("-----BEGIN CERTIFICATE"):
            current = []
        elif line.startswith("-----END CERTIFICATE") and current is not None:
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line.strip())
    return blocks
