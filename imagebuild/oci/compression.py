"""Layer compression: which one a release image is pushed with, and the media types that say it (pure).

gzip is the default: Docker 20.10 engines read nothing else. zstd (OCI's `tar+zstd` layers under an
OCI image manifest) is opt-in per variant: containerd >= 1.5 and Docker >= 23 read it, and it
decompresses several times faster than gzip, which is most of a fresh node's time to ready.
eStargz (oci/estargz.py) is opt-in too: gzip layers (`tar+gzip` under an OCI manifest) that every
engine pulls as ever, and that a node with the stargz snapshotter mounts lazily, file by file, from
the registry; each layer descriptor carries its TOC's digest, so the signed manifest covers every chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

GZIP = "gzip"
ZSTD = "zstd"
ESTARGZ = "estargz"
ALGORITHMS = (GZIP, ZSTD, ESTARGZ)
ZSTD_LEVELS = range(1, 20)  # zstd's ordinary levels; 20-22 ("ultra") need windows a puller may refuse
ZSTD_DEFAULT_LEVEL = 3  # zstd's own default: ~3x gzip level 1's speed for a smaller blob

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
# Every layer media type an image of ours may carry (the copy, scans and checks accept them all).
LAYER_MEDIA_TYPES = frozenset({DOCKER_LAYER, OCI_LAYER_GZIP, OCI_LAYER_ZSTD})


@dataclass(frozen=True)
class Compression:
    """How an image's layers are compressed: gzip (Docker schema 2, as ever), zstd at `level` (OCI) or
    eStargz (OCI, gzip members)."""

    algorithm: str = GZIP
    level: int | None = None  # zstd's level; gzip's (eStargz's too) is publish.COMPRESSION_LEVEL, never configured

    @property
    def spec(self) -> str:
        """As the matrix writes it, and as the plan and the report show it: `gzip`, `zstd:<level>` or `estargz`."""
        return f"{ZSTD}:{self.level}" if self.algorithm == ZSTD else self.algorithm

    @property
    def is_gzip(self) -> bool:
        """The default: Docker schema 2 gzip layers, what every engine reads (not eStargz's gzip)."""
        return self.algorithm == GZIP

    @property
    def is_estargz(self) -> bool:
        return self.algorithm == ESTARGZ

    @property
    def layer_media_type(self) -> str:
        return DOCKER_LAYER if self.is_gzip else OCI_LAYER_GZIP if self.is_estargz else OCI_LAYER_ZSTD

    @property
    def manifest_media_type(self) -> str:
        return DOCKER_MANIFEST if self.is_gzip else OCI_MANIFEST

    @property
    def config_media_type(self) -> str:
        return DOCKER_CONFIG if self.is_gzip else OCI_CONFIG

    def reusable(self, media_type: object) -> bool:
        """Whether a registry blob of `media_type` holds a layer compressed as this one wants (eStargz: none,
        since a media type cannot tell an eStargz blob from a plain gzip one)."""
        if self.is_estargz:
            return False
        return media_type in ((DOCKER_LAYER, OCI_LAYER_GZIP) if self.is_gzip else (OCI_LAYER_ZSTD,))


DEFAULT = Compression()


def parse_compression(text: str) -> Compression:
    """`gzip`, `zstd`, `zstd:<level>` (1-19) or `estargz`; ValueError with a one-line message otherwise."""
    algorithm, sep, level_text = text.strip().partition(":")
    if algorithm == GZIP and not sep:
        return DEFAULT
    if algorithm == ESTARGZ and not sep:
        return Compression(ESTARGZ)
    if algorithm == ZSTD:
        if not sep:
            return Compression(ZSTD, ZSTD_DEFAULT_LEVEL)
        if level_text.isdigit() and int(level_text) in ZSTD_LEVELS:
            return Compression(ZSTD, int(level_text))
        raise ValueError(f"'{text}': the zstd level must be a whole number from {ZSTD_LEVELS.start} "
                         f"to {ZSTD_LEVELS.stop - 1}")
    if algorithm in (GZIP, ESTARGZ):
        raise ValueError(f"'{text}': {algorithm} takes no level (imagebuild's is fixed: ISA-L level 1)")
    raise ValueError(f"'{text}' is not a layer compression (known: gzip, zstd, zstd:<level 1-19>, estargz)")


# What an engine must decompress to pull a layer of each media type: a region's nodes say which of these
# they read (release.yaml `compressions:`). eStargz is gzip to every engine, zstd:chunked is zstd.
PULL_FAMILIES = (GZIP, ZSTD)
_FAMILY_OF_LAYER = {DOCKER_LAYER: GZIP, OCI_LAYER_GZIP: GZIP, OCI_LAYER_ZSTD: ZSTD}


def layer_families(manifest: object) -> frozenset[str]:
    """The compressions a puller must read for an image manifest's layers (pure). A layer of any other
    media type (or a manifest without a layer list) is named by what it says, which no region reads."""
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list):
        return frozenset({"(no layer list)"})
    families = set()
    for layer in layers:
        media_type = layer.get("mediaType") if isinstance(layer, dict) else None
        family = _FAMILY_OF_LAYER.get(media_type) if isinstance(media_type, str) else None
        families.add(family or f"({str(media_type)[:80]})")
    return frozenset(families)
