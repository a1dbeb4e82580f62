"""The `docker load` archive smoke hands an engine that cannot pull zstd (imagebuild/checks/engine_load.py)."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from imagebuild.checks.engine_load import archive_chunks, engine_reads_zstd, has_zstd_layers
from imagebuild.oci.compression import DOCKER_LAYER, OCI_LAYER_ZSTD


@pytest.mark.parametrize("version, reads", [
    ("20.10.24+dfsg1", False), ("22.06.0-beta.0", False), ("23.0.0", True), ("27.3.1", True), ("master-dockerproject", True),
])
def test_docker_23_is_the_first_engine_that_pulls_zstd_itself(version, reads):
    assert engine_reads_zstd(version) is reads


def test_only_a_manifest_with_a_zstd_layer_needs_loading():
    assert has_zstd_layers({"layers": [{"mediaType": DOCKER_LAYER}, {"mediaType": OCI_LAYER_ZSTD}]})
    assert not has_zstd_layers({"layers": [{"mediaType": DOCKER_LAYER}]})
    assert not has_zstd_layers({"layers": "not a list"}) and not has_zstd_layers({})


def test_the_archive_is_a_tar_docker_load_reads_config_and_layers_in_the_configs_order(tmp_path):
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": []}}).encode()
    digest = "sha256:" + hashlib.sha256(config).hexdigest()
    layers = []
    for number, size in enumerate((0, 511, 512, 70_000)):  # block boundaries: none, one short, exact, several
        path = tmp_path / f"{number}.tar"
        path.write_bytes(bytes([number + 1]) * size)
        layers.append(path)
    raw = b"".join(archive_chunks(digest, config, layers))
    assert len(raw) % tarfile.BLOCKSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(raw)) as archive:
        names = archive.getnames()
        [entry] = json.loads(archive.extractfile("manifest.json").read())
        assert entry == {"Config": f"{digest.split(':')[1]}.json", "RepoTags": [],
                         "Layers": ["0/layer.tar", "1/layer.tar", "2/layer.tar", "3/layer.tar"]}
        assert archive.extractfile(entry["Config"]).read() == config
        for layer, name in zip(layers, entry["Layers"]):
            assert archive.extractfile(name).read() == layer.read_bytes()
    assert names == ["manifest.json", entry["Config"], *entry["Layers"]]
