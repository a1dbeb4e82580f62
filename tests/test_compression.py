"""Layer compression, the pure parts: the matrix's spelling, the media types and manifests each
compression pushes under, which parent blobs a push may reuse, and the checks on a zstd twin."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re

import pytest

from imagebuild.build.publish import (
    Descriptor,
    PublishError,
    _Encoder,
    estargz_config,
    image_manifest,
    reusable_layers,
    schema2_manifest,
    twin_problem,
    twin_tag,
)
from imagebuild.oci import compression as media
from imagebuild.oci.compression import DEFAULT, Compression, parse_compression

ZSTD = Compression("zstd", 3)
ESTARGZ = Compression("estargz")


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# --- the matrix's spelling ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "spec"), [("gzip", "gzip"), ("zstd", "zstd:3"), ("zstd:1", "zstd:1"),
                                            ("zstd:19", "zstd:19"), (" zstd:7 ", "zstd:7"), ("estargz", "estargz")])
def test_gzip_zstd_zstd_with_a_level_and_estargz_are_read(text, spec):
    assert parse_compression(text).spec == spec


def test_gzip_is_the_default_and_says_docker_schema_2():
    assert parse_compression("gzip") == DEFAULT
    assert (DEFAULT.manifest_media_type, DEFAULT.config_media_type, DEFAULT.layer_media_type) == \
        (media.DOCKER_MANIFEST, media.DOCKER_CONFIG, media.DOCKER_LAYER)


def test_zstd_says_oci_manifest_config_and_zstd_layers():
    zstd = parse_compression("zstd")
    assert (zstd.manifest_media_type, zstd.config_media_type, zstd.layer_media_type) == \
        (media.OCI_MANIFEST, media.OCI_CONFIG, media.OCI_LAYER_ZSTD)


@pytest.mark.parametrize(("text", "message"), [
    ("brotli", "'brotli' is not a layer compression (known: gzip, zstd, zstd:<level 1-19>, estargz)"),
    ("zstd:0", "the zstd level must be a whole number from 1 to 19"),
    ("zstd:20", "the zstd level must be a whole number from 1 to 19"),
    ("zstd:-1", "the zstd level must be a whole number from 1 to 19"),
    ("zstd:", "the zstd level must be a whole number from 1 to 19"),
    ("zstd:fast", "the zstd level must be a whole number from 1 to 19"),
    ("gzip:6", "gzip takes no level"),
    ("estargz:9", "estargz takes no level"),
    ("ZSTD", "is not a layer compression"),
])
def test_anything_else_is_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        parse_compression(text)
    assert "\n" not in str(caught.value)


def test_estargz_says_oci_manifest_config_and_gzip_layers_and_is_not_the_default_gzip():
    estargz = parse_compression("estargz")
    assert estargz == ESTARGZ and estargz.is_estargz and not estargz.is_gzip
    assert (estargz.manifest_media_type, estargz.config_media_type, estargz.layer_media_type) == \
        (media.OCI_MANIFEST, media.OCI_CONFIG, media.OCI_LAYER_GZIP)


# --- manifests ---------------------------------------------------------------------------------


def test_a_gzip_push_keeps_the_schema_2_manifest_byte_for_byte():
    config = Descriptor(media.DOCKER_CONFIG, _digest("c"), 12)
    layers = [Descriptor(media.DOCKER_LAYER, _digest("l0"), 3), Descriptor(media.DOCKER_LAYER, _digest("l1"), 4)]
    assert image_manifest(config, layers) == schema2_manifest(config, layers)
    assert image_manifest(config, layers, DEFAULT) == schema2_manifest(config, layers)


def test_a_zstd_push_is_an_oci_manifest_of_the_same_config_with_zstd_layers():
    config = Descriptor(media.DOCKER_CONFIG, _digest("c"), 12)
    layers = [Descriptor(media.OCI_LAYER_ZSTD, _digest("z0"), 3), Descriptor(media.OCI_LAYER_ZSTD, _digest("z1"), 4)]
    manifest = json.loads(image_manifest(config, layers, ZSTD))
    assert manifest["schemaVersion"] == 2 and manifest["mediaType"] == media.OCI_MANIFEST
    assert manifest["config"] == {"mediaType": media.OCI_CONFIG, "digest": config.digest, "size": 12}
    assert [(layer["mediaType"], layer["digest"], layer["size"]) for layer in manifest["layers"]] == \
        [(media.OCI_LAYER_ZSTD, layer.digest, layer.size) for layer in layers]


def test_an_estargz_push_is_an_oci_manifest_whose_layers_carry_their_toc_digests():
    config = Descriptor(media.OCI_CONFIG, _digest("c"), 12)
    annotations = (("containerd.io/snapshot/stargz/toc.digest", _digest("toc")),
                   ("io.containers.estargz.uncompressed-size", "1536"))
    layer = Descriptor(media.OCI_LAYER_GZIP, _digest("e0"), 3, annotations)
    manifest = json.loads(image_manifest(config, [layer], ESTARGZ))
    assert manifest["mediaType"] == media.OCI_MANIFEST and manifest["config"]["mediaType"] == media.OCI_CONFIG
    assert manifest["layers"] == [{"mediaType": media.OCI_LAYER_GZIP, "size": 3, "digest": layer.digest,
                                   "annotations": dict(annotations)}]


def test_the_estargz_config_changes_only_the_diff_ids():
    config = {"architecture": "amd64", "config": {"Labels": {"a": "<b&c>"}, "User": "1000:1000"},
              "history": [{"created_by": "x"}, {"created_by": "y"}], "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": [_digest("d0"), _digest("d1")]}}
    rewritten = json.loads(estargz_config(json.dumps(config).encode(), [_digest("e0"), _digest("e1")]))
    assert rewritten == {**config, "rootfs": {"type": "layers", "diff_ids": [_digest("e0"), _digest("e1")]}}
    assert list(rewritten) == list(config)
    with pytest.raises(PublishError, match="lists 2 layers, the eStargz push 1"):
        estargz_config(json.dumps(config).encode(), [_digest("e0")])


# --- reuse -------------------------------------------------------------------------------------


def _parent() -> tuple[dict[str, object], dict[str, object], list[str]]:
    diff_ids = [_digest("d0"), _digest("d1"), _digest("d2")]
    manifest = {"layers": [{"mediaType": media.DOCKER_LAYER, "digest": _digest("b0"), "size": 10},
                           {"mediaType": media.OCI_LAYER_GZIP, "digest": _digest("b1"), "size": 20},
                           {"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("b2"), "size": 30}]}
    return manifest, {"rootfs": {"diff_ids": diff_ids}}, diff_ids


def test_a_gzip_push_reuses_only_gzip_blobs_a_zstd_push_only_zstd_blobs_and_an_estargz_push_none():
    manifest, config, diff_ids = _parent()
    assert set(reusable_layers(manifest, config)) == set(diff_ids[:2])
    assert reusable_layers(manifest, config, ZSTD) == {diff_ids[2]: Descriptor(media.OCI_LAYER_ZSTD, _digest("b2"), 30)}
    # A media type cannot tell an eStargz blob from a plain gzip one (and the diff_ids differ anyway).
    assert reusable_layers(manifest, config, ESTARGZ) == {}


# --- the zstd twin of a gzip parent ------------------------------------------------------------


PARENT = "sha256:" + "ab" * 32
CONFIG = Descriptor(media.DOCKER_CONFIG, _digest("config"), 99)
DIFF_IDS = [_digest("d0"), _digest("d1")]


def _twin(**changes: object) -> dict[str, object]:
    twin: dict[str, object] = json.loads(image_manifest(
        CONFIG, [Descriptor(media.OCI_LAYER_ZSTD, _digest(f"z{i}"), 10 + i) for i in range(2)], ZSTD))
    twin.update(changes)
    return twin


def test_the_twins_tag_names_the_parents_digest_and_the_level():
    assert twin_tag(PARENT, ZSTD) == "zstd3-" + "ab" * 32
    assert twin_tag(PARENT, Compression("zstd", 19)) != twin_tag(PARENT, ZSTD)
    assert len(twin_tag(PARENT, Compression("zstd", 19))) <= 128  # a tag's limit


def test_a_twin_of_the_parents_config_with_one_zstd_layer_per_diff_id_is_used():
    assert twin_problem(_twin(), media.OCI_MANIFEST, CONFIG, DIFF_IDS, ZSTD) is None


@pytest.mark.parametrize(("twin", "media_type", "problem"), [
    (_twin(), media.DOCKER_MANIFEST, "not an OCI image manifest"),
    (_twin(mediaType=media.DOCKER_MANIFEST), media.OCI_MANIFEST, "not an OCI image manifest"),
    (_twin(config={"mediaType": media.OCI_CONFIG, "digest": _digest("other"), "size": 99}), media.OCI_MANIFEST,
     "its config is not the parent's"),
    (_twin(config={"mediaType": media.OCI_CONFIG, "digest": CONFIG.digest, "size": 98}), media.OCI_MANIFEST,
     "its config is not the parent's"),
    (_twin(layers=[{"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z0"), "size": 1}]), media.OCI_MANIFEST,
     "it lists 1 layers, the parent 2"),
    (_twin(layers="none"), media.OCI_MANIFEST, "it lists no layers"),
    (_twin(layers=[{"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z0"), "size": 1},
                   {"mediaType": media.DOCKER_LAYER, "digest": _digest("z1"), "size": 1}]), media.OCI_MANIFEST,
     f"layer 1 is not {media.OCI_LAYER_ZSTD}"),
    (_twin(layers=[{"mediaType": media.OCI_LAYER_ZSTD, "digest": "sha256:../../x", "size": 1},
                   {"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z1"), "size": 1}]), media.OCI_MANIFEST,
     "layer 0 has no well-formed digest and size"),
    (_twin(layers=[{"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z0"), "size": True},
                   {"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z1"), "size": 1}]), media.OCI_MANIFEST,
     "layer 0 has no well-formed digest and size"),
    (_twin(layers=[{"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z0"), "size": 1},
                   {"mediaType": media.OCI_LAYER_ZSTD, "digest": _digest("z1"), "size": -5}]), media.OCI_MANIFEST,
     "layer 1 has no well-formed digest and size"),
])
def test_a_twin_that_does_not_stand_for_the_parent_is_not_used(twin, media_type, problem):
    found = twin_problem(twin, media_type, CONFIG, DIFF_IDS, ZSTD)
    assert found is not None and problem in found


# --- the compressor ----------------------------------------------------------------------------


def _zstd(data: bytes, threads: int, piece: int) -> bytes:
    out = io.BytesIO()
    writer = _Encoder(ZSTD, threads).writer(out)  # type: ignore[arg-type]
    for start in range(0, len(data), piece):
        writer.write(data[start:start + piece])
    writer.close()
    return out.getvalue()


def test_zstd_gives_the_same_blob_on_any_number_of_cores_however_the_stream_is_cut():
    """So the same tar gives the same blob read from storage or from `docker save`, on any machine."""
    zstandard = pytest.importorskip("zstandard")
    data = os.urandom(3 << 20) + bytes(range(256)) * 20_000
    blobs = {_zstd(data, threads, piece) for threads in (1, 2, 4) for piece in (4096, 1 << 20, 5_000_000)}
    assert len(blobs) == 1
    assert zstandard.ZstdDecompressor().decompressobj().decompress(blobs.pop()) == data


def test_layer_families_name_what_a_puller_must_decompress():
    from imagebuild.oci.compression import (
        DOCKER_LAYER,
        OCI_LAYER_GZIP,
        OCI_LAYER_ZSTD,
        layer_families,
    )

    def manifest(*types: str) -> dict:
        return {"layers": [{"mediaType": media_type, "digest": "sha256:" + "0" * 64, "size": 1} for media_type in types]}

    assert layer_families(manifest(DOCKER_LAYER, OCI_LAYER_GZIP)) == {"gzip"}  # eStargz layers are tar+gzip
    assert layer_families(manifest(OCI_LAYER_GZIP, OCI_LAYER_ZSTD)) == {"gzip", "zstd"}
    # Anything else is named by what it says, which no region lists: never read as pullable.
    assert layer_families(manifest("application/vnd.example.layer")) == {"(application/vnd.example.layer)"}
    assert layer_families({"layers": [42]}) == {"(None)"}
    assert layer_families({"manifests": []}) == {"(no layer list)"}
    assert layer_families([]) == {"(no layer list)"}
