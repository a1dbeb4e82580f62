"""One layer blob read from a registry and checked as it streams: at most its descriptor's size,
its bytes hashed against its digest, a zstd blob decompressed on the way. Publish reads a zstd twin's
blobs this way before lending them; smoke reads a zstd image's layers this way before an engine that
cannot decompress zstd is handed them. What the registry sends is untrusted until this returns."""
from __future__ import annotations

import hashlib
from collections.abc import Callable

from imagebuild.core.errors import ImagebuildError
from imagebuild.oci.client import Registry

CHUNK = 1 << 20


class LayerReadError(ImagebuildError):
    """The blob is not what its descriptor says; the message names the blob and why."""


def read_layer(registry: Registry, repository: str, digest: str, size: int, *, zstd: bool,
               sink: Callable[[bytes], object] = lambda data: None) -> str:
    """Stream `repository@digest` (a `size`-byte blob), decompressing it when `zstd`, each piece of the
    tar handed to `sink`; the tar's digest (a zstd layer's diff_id). LayerReadError when the registry
    sends more than `size` bytes, a zstd blob does not decompress, or the bytes do not hash to `digest`."""
    import zstandard  # at the first read, not when publish (which imports this module) is imported

    blob, tar = hashlib.sha256(), hashlib.sha256()
    read = 0
    decompressor = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True) if zstd else None
    try:
        with registry.open_blob(repository, digest) as response:
            for chunk in response.iter_bytes(CHUNK):
                read += len(chunk)
                if read > size:
                    raise LayerReadError(f"blob {digest} sends more than its {size} bytes")
                blob.update(chunk)
                data = decompressor.decompress(chunk) if decompressor is not None else chunk
                tar.update(data)
                sink(data)
    except zstandard.ZstdError as exc:
        raise LayerReadError(f"blob {digest} is not zstd: {str(exc)[:120]}") from None
    if "sha256:" + blob.hexdigest() != digest:
        raise LayerReadError(f"blob {digest}'s bytes hash to sha256:{blob.hexdigest()}")
    return "sha256:" + tar.hexdigest()
