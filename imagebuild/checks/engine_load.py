"""A zstd image into a Docker engine that cannot pull it (Docker < 23 decompresses gzip only).

Smoke must run the very digest that is scanned and signed. What an engine runs is the image's
config (its id); once the engine holds that config, a pull by digest fetches no layer and only
records the name. So where the engine cannot decompress zstd, the layers are read from the
registry here, each checked against its digest and, decompressed, against the config's diff_id,
and handed to the engine as a `docker load` archive of plain tars (the engine checks the diff_ids
again as it loads). A build host that built the image locally needs none of this; one whose
layers all came from the layer cache does.

What the registry sends is untrusted: the manifest is verified against its digest, each blob is
read up to its descriptor's size, and nothing reaches the engine before every layer checks out.
"""
from __future__ import annotations

import json
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from imagebuild.core.errors import ImagebuildError
from imagebuild.oci.client import ImageRef, Registry, RegistryError
from imagebuild.oci.compression import DOCKER_MANIFEST, LAYER_MEDIA_TYPES, OCI_LAYER_ZSTD, OCI_MANIFEST
from imagebuild.oci.layer_read import LayerReadError, read_layer

ZSTD_SINCE_MAJOR = 23  # Docker Engine 23.0 is the first to decompress zstd layers
CHUNK = 1 << 20


class EngineLoadError(ImagebuildError):
    """The registry's image cannot be handed to the engine; the message says which blob and why."""


def engine_reads_zstd(version: str) -> bool:
    """Whether a Docker Engine of `version` ("20.10.24+dfsg1", "27.3.1") pulls zstd layers itself.
    A version that does not start with a number is taken to be a new one."""
    major = version.split(".", 1)[0]
    return not major.isdigit() or int(major) >= ZSTD_SINCE_MAJOR


def has_zstd_layers(manifest: dict[str, Any]) -> bool:
    return any(isinstance(layer, dict) and layer.get("mediaType") == OCI_LAYER_ZSTD
               for layer in manifest.get("layers") or [])


def archive_chunks(config_digest: str, config: bytes, layers: list[Path]) -> Iterator[bytes]:
    """A `docker load` archive (manifest.json, the config, one tar per layer file: a tar, or a gzip tar,
    which the engine decompresses), streamed: each layer is read from its file as the engine takes it,
    so nothing but the layer files is written to disk."""
    hex_id = config_digest.split(":", 1)[1]
    names = [f"{n}/layer.tar" for n in range(len(layers))]
    manifest = json.dumps([{"Config": f"{hex_id}.json", "RepoTags": [], "Layers": names}]).encode()
    yield from _member("manifest.json", manifest)
    yield from _member(f"{hex_id}.json", config)
    for name, layer in zip(names, layers):
        size = layer.stat().st_size
        yield _header(name, size)
        with layer.open("rb") as handle:
            while chunk := handle.read(CHUNK):
                yield chunk
        yield _padding(size)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    return info.tobuf(tarfile.GNU_FORMAT)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % tarfile.BLOCKSIZE)


def _member(name: str, content: bytes) -> Iterator[bytes]:
    yield _header(name, len(content))
    yield content
    yield _padding(len(content))


def fetch_layers(registry: Registry, repository: str, manifest: dict[str, Any], diff_ids: list[str],
                 spool: Path) -> list[Path]:
    """Each layer into `spool`: gzip blobs as they are, zstd blobs decompressed; every blob's bytes
    must hash to its digest within its size, and a zstd blob's tar to its diff_id."""
    layers = manifest.get("layers")
    if not isinstance(layers, list) or len(layers) != len(diff_ids):
        raise EngineLoadError(f"{repository}: the manifest's layers do not match the config's "
                              f"{len(diff_ids)} diff_ids")
    files = []
    for number, (layer, diff_id) in enumerate(zip(layers, diff_ids)):
        media_type, digest, size = (layer.get("mediaType"), layer.get("digest"), layer.get("size")) \
            if isinstance(layer, dict) else (None, None, None)
        if media_type not in LAYER_MEDIA_TYPES or not isinstance(digest, str) \
                or not isinstance(size, int) or size < 0:
            raise EngineLoadError(f"{repository}: layer {number} is not a gzip or zstd layer descriptor")
        path = spool / f"{number}.tar"
        zstd = media_type == OCI_LAYER_ZSTD
        with path.open("wb") as out:
            try:
                tar = read_layer(registry, repository, digest, size, zstd=zstd, sink=out.write)
            except LayerReadError as exc:
                raise EngineLoadError(f"{repository}: {exc}") from None
        if zstd and tar != diff_id:
            raise EngineLoadError(f"{repository}: blob {digest} decompresses to {tar}, "
                                  f"not the config's diff_id {diff_id}")
        files.append(path)
    return files


def load_from_registry(client: Any, ref: ImageRef) -> str | None:
    """Put the image `ref` (by digest) names into the engine `client` from its registry blobs when it
    has zstd layers; the image id (its config digest) the engine now holds, or None when it has no zstd
    layer or the registry has no such manifest (the engine's own pull then reads it, or says so).
    EngineLoadError when the registry's image does not check out."""
    assert ref.digest is not None
    try:
        with Registry(ref.registry) as registry:
            found = registry.find_manifest(ref.repository, ref.digest)
            if found is None:
                return None  # the engine's own pull says "not found", as for any image
            raw, media_type, _ = found
            manifest = json.loads(raw)
            if media_type not in (DOCKER_MANIFEST, OCI_MANIFEST) or not isinstance(manifest, dict) or not has_zstd_layers(manifest):
                return None
            descriptor = manifest.get("config")
            config_digest = descriptor.get("digest") if isinstance(descriptor, dict) else None
            if not isinstance(config_digest, str) or not config_digest.startswith("sha256:"):
                raise EngineLoadError(f"{ref}: the manifest names no sha256 config")
            if _engine_holds(client, config_digest):
                return config_digest  # built here, or loaded before: the pull fetches nothing
            config = registry.get_blob(ref.repository, config_digest)
            diff_ids = _diff_ids(config, ref)
            with tempfile.TemporaryDirectory(prefix="imagebuild-load-") as spool:
                layers = fetch_layers(registry, ref.repository, manifest, diff_ids, Path(spool))
                _load(client, config_digest, config, layers, ref)
    except (RegistryError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineLoadError(f"{ref}: {exc}") from None
    return config_digest


def _engine_holds(client: Any, image_id: str) -> bool:
    import docker.errors

    try:
        client.images.get(image_id)
    except docker.errors.ImageNotFound:
        return False
    return True


def _diff_ids(config: bytes, ref: ImageRef) -> list[str]:
    parsed = json.loads(config)
    rootfs = parsed.get("rootfs") if isinstance(parsed, dict) else None
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or not all(isinstance(d, str) for d in diff_ids):
        raise EngineLoadError(f"{ref}: the config has no rootfs.diff_ids")
    return diff_ids


def _load(client: Any, config_digest: str, config: bytes, layers: list[Path], ref: ImageRef) -> None:
    """POST the archive; the engine's progress (quiet off) keeps the connection busy while it unpacks."""
    loaded = None
    for event in client.api.load_image(archive_chunks(config_digest, config, layers), quiet=False):
        if "errorDetail" in event or "error" in event:
            detail = event.get("errorDetail", {}).get("message") or event.get("error")
            raise EngineLoadError(f"{ref}: the engine refused the image: {str(detail)[:300]}")
        stream = event.get("stream", "")
        if stream.startswith("Loaded image ID: "):
            loaded = stream.removeprefix("Loaded image ID: ").strip()
    if loaded != config_digest:
        raise EngineLoadError(f"{ref}: the engine loaded {loaded or 'nothing'}, not {config_digest}")
