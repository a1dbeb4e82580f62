"""The pure parts of the layer push: manifest assembly, blob reuse, layer chain ids."""
from __future__ import annotations

import hashlib
import json

from imagebuild.build.publish import (
    DOCKER_CONFIG,
    DOCKER_LAYER,
    DOCKER_MANIFEST,
    OCI_LAYER_GZIP,
    Descriptor,
    chain_ids,
    reusable_layers,
    schema2_manifest,
    sha256_digest,
)


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def test_the_manifest_is_docker_schema_2_with_config_and_layers_in_order():
    config = Descriptor(DOCKER_CONFIG, _digest("config"), 123)
    layers = [Descriptor(DOCKER_LAYER, _digest(f"layer{i}"), 1000 + i) for i in range(3)]
    raw = schema2_manifest(config, layers)
    manifest = json.loads(raw)
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == DOCKER_MANIFEST
    assert manifest["config"] == {"mediaType": DOCKER_CONFIG, "size": 123, "digest": config.digest}
    assert [layer["digest"] for layer in manifest["layers"]] == [layer.digest for layer in layers]
    assert {layer["mediaType"] for layer in manifest["layers"]} == {DOCKER_LAYER}


def test_the_same_image_gives_the_same_manifest_bytes_and_digest():
    config = Descriptor(DOCKER_CONFIG, _digest("c"), 1)
    layers = [Descriptor(DOCKER_LAYER, _digest("l"), 2)]
    assert sha256_digest(schema2_manifest(config, layers)) == sha256_digest(schema2_manifest(config, list(layers)))
    other = [Descriptor(DOCKER_LAYER, _digest("other"), 2)]
    assert sha256_digest(schema2_manifest(config, layers)) != sha256_digest(schema2_manifest(config, other))


def test_a_parents_gzip_layers_are_reused_by_diff_id_under_dockers_media_type():
    diff_ids = [_digest("d0"), _digest("d1")]
    manifest = {"layers": [{"mediaType": DOCKER_LAYER, "digest": _digest("b0"), "size": 10},
                           {"mediaType": OCI_LAYER_GZIP, "digest": _digest("b1"), "size": 20}]}
    reused = reusable_layers(manifest, {"rootfs": {"diff_ids": diff_ids}})
    assert reused == {diff_ids[0]: Descriptor(DOCKER_LAYER, _digest("b0"), 10),
                      diff_ids[1]: Descriptor(DOCKER_LAYER, _digest("b1"), 20)}


def test_layers_in_other_encodings_are_not_reused():
    diff_ids = [_digest("d0"), _digest("d1")]
    manifest = {"layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
                            "digest": _digest("b0"), "size": 10},
                           {"mediaType": "application/vnd.oci.image.layer.v1.tar",
                            "digest": _digest("b1"), "size": 20}]}
    assert reusable_layers(manifest, {"rootfs": {"diff_ids": diff_ids}}) == {}


def test_a_manifest_and_config_that_disagree_on_the_layer_count_lend_nothing():
    manifest = {"layers": [{"mediaType": DOCKER_LAYER, "digest": _digest("b0"), "size": 10}]}
    assert reusable_layers(manifest, {"rootfs": {"diff_ids": [_digest("a"), _digest("b")]}}) == {}


def test_chain_ids_start_with_the_first_diff_id_and_hash_each_parent_with_the_next():
    a, b, c = _digest("a"), _digest("b"), _digest("c")
    chain = chain_ids([a, b, c])
    assert chain[0] == a
    assert chain[1] == _digest(f"{a} {b}")
    assert chain[2] == _digest(f"{chain[1]} {c}")


def test_the_compressor_gets_the_same_pieces_however_the_stream_was_cut():
    from imagebuild.build.publish import _even_chunks

    data = bytes(range(256)) * 40
    one_way = list(_even_chunks([data[:7], data[7:3000], data[3000:]], size=1024))
    other_way = list(_even_chunks([data[i:i + 100] for i in range(0, len(data), 100)], size=1024))
    assert one_way == other_way
    assert [len(piece) for piece in one_way] == [1024] * 10
