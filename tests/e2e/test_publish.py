"""The layer push (imagebuild/build/publish.py) against the real engine and the staging registry.

Each test builds small images of its own FROM the local base image and pushes them to a
repository of its own, so nothing here touches what other tests or people pushed.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
import httpx
import pytest

from imagebuild.build.layerstore import EngineStorage
from imagebuild.build.publish import (
    DOCKER_CONFIG,
    DOCKER_LAYER,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_LAYER_ZSTD,
    OCI_MANIFEST,
    SAVE,
    STORAGE,
    Descriptor,
    chain_ids,
    legacy_layer_ids,
    publish,
    schema2_manifest,
    sha256_digest,
    twin_tag,
)
from imagebuild.core.runner import docker_cli
from imagebuild.oci.client import INDEX_TYPES, ImageRef, Registry
from imagebuild.oci.compression import DEFAULT as GZIP
from imagebuild.oci.compression import Compression
from imagebuild.oci.platforms import platform_digest

from .conftest import STAGING, unique

BASE = f"{STAGING}/imagebuild/debian:12"
CRANE = "/opt/imagebuild-tools/bin/crane"
ZSTD = Compression("zstd", 3)


def _build(tmp_path: Path, name: str, dockerfile: str, tag: str, args: dict[str, str] | None = None) -> str:
    context = tmp_path / name
    context.mkdir()
    (context / "Dockerfile").write_text(dockerfile)
    cmd = [docker_cli(), "build", "-q", "-t", tag]
    for key, value in (args or {}).items():
        cmd += ["--build-arg", f"{key}={value}"]
    run = subprocess.run([*cmd, str(context)], capture_output=True, text=True, timeout=600, check=False,
                         env={"DOCKER_BUILDKIT": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    return tag


def _uploads(counter: list[str]):
    def hook(request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/blobs/uploads/") \
                and "mount" not in request.url.params:
            counter.append(request.url.path)
    return {"request": [hook]}


def _base(engine, child: bool = False) -> ImageRef:
    """The base the test images are built FROM, by the digest the engine pulled it at (the tag may
    have moved on in the registry since): the multi-platform index's, as a matrix that pins the base by
    its index digest names it, or (`child`) this machine's image in it, as a resolved tag names it. Found by this machine's architecture, not by the engine's
    tag, and not by the order of its RepoDigests (the index's and the child's both appear there)."""
    architecture = engine.info()["Architecture"]
    architecture = {"x86_64": "amd64", "aarch64": "arm64"}.get(architecture, architecture)
    repository = BASE.rsplit(":", 1)[0]
    images = [image for image in engine.images.list(name=repository)
              if image.attrs.get("Architecture") == architecture]
    if not images:  # an engine pruned since bootstrap: the registry has it
        images = [engine.images.pull(BASE, platform=f"linux/{architecture}")]
    pulled = {d.split("@", 1)[1] for d in images[0].attrs["RepoDigests"] if d.startswith(repository + "@")}
    path = ImageRef.parse(BASE).repository
    with Registry(STAGING) as registry:
        [index] = [d for d in sorted(pulled) if registry.get_manifest(path, d)[1] in INDEX_TYPES]
        if not child:
            return ImageRef.parse(f"{BASE}@{index}")
        digest = platform_digest(registry, path, index, f"linux/{architecture}")
    assert digest is not None
    return ImageRef.parse(f"{BASE}@{digest}")


@pytest.fixture
def repository(staging_registry) -> str:
    return f"imagebuild-e2e/{unique('publish')}"


@pytest.fixture
def parent_image(engine, tmp_path, repository):
    """A two-layer image FROM the base, unique to the test (a nonce in each layer)."""
    nonce = uuid.uuid4().hex
    tag = _build(tmp_path, "parent", f"FROM {BASE}\nRUN echo {nonce} > /parent-a\n"
                 f"RUN head -c 3000000 /dev/urandom > /parent-b && echo {nonce} >> /parent-b\n",
                 f"{STAGING}/{repository}:parent-{nonce[:8]}")
    yield tag
    for image in engine.images.list(name=f"{STAGING}/{repository}"):  # the tag, and what a test pulled
        engine.images.remove(image.id, force=True)


def test_a_pushed_image_is_pulled_by_docker_under_the_registrys_manifest_digest(engine, tmp_path, repository,
                                                                               parent_image):
    pushed = publish(parent_image, ImageRef.parse(parent_image), _base(engine), spool=tmp_path)
    ref = ImageRef.parse(parent_image)
    served = httpx.head(f"http://{STAGING}/v2/{ref.repository}/manifests/{ref.tag}",
                        headers={"Accept": DOCKER_MANIFEST})
    assert served.headers["docker-content-digest"] == pushed.digest
    manifest = httpx.get(f"http://{STAGING}/v2/{ref.repository}/manifests/{pushed.digest}",
                         headers={"Accept": DOCKER_MANIFEST}).json()
    assert manifest["mediaType"] == DOCKER_MANIFEST
    assert {layer["mediaType"] for layer in manifest["layers"]} == {DOCKER_LAYER}

    # crane reads every blob back and checks each layer against the config's diff_ids.
    by_digest = f"{ref.registry}/{ref.repository}@{pushed.digest}"
    validate = subprocess.run([CRANE, "validate", "--insecure", "--remote", by_digest],
                              capture_output=True, text=True, timeout=300, check=False)
    assert validate.returncode == 0 and "PASS" in validate.stdout, validate.stdout + validate.stderr

    local_id = engine.images.get(parent_image).id
    engine.images.remove(parent_image, force=True)
    pulled = engine.images.pull(by_digest)
    assert pulled.id == local_id  # the same config: the image docker built is the image it pulls
    out = engine.containers.run(by_digest, ["cat", "/parent-a"], remove=True)
    assert out.strip() and len(out.strip()) == 32


@pytest.mark.parametrize("base_by", ["index", "child"])
def test_layers_the_registry_has_are_not_uploaded_again(engine, tmp_path, repository, parent_image, base_by):
    uploads: list[str] = []
    # A multi-platform base named by its index lends the layers of this platform's image in it.
    parent = publish(parent_image, ImageRef.parse(parent_image), _base(engine, child=base_by == "child"),
                     spool=tmp_path, event_hooks=_uploads(uploads))
    assert len(uploads) == parent.uploaded == 3  # its two layers and its config; the base is mounted

    ref = ImageRef.parse(parent_image)
    parent_ref = f"{ref.registry}/{ref.repository}@{parent.digest}"
    child = _build(tmp_path, "child", f"ARG PARENT\nFROM ${{PARENT}}\nRUN echo {uuid.uuid4().hex} > /child\n",
                   f"{ref.registry}/{ref.repository}:child", {"PARENT": parent_ref})
    try:
        uploads.clear()
        pushed = publish(child, ImageRef.parse(child), ImageRef.parse(parent_ref), spool=tmp_path,
                         event_hooks=_uploads(uploads))
        assert len(uploads) == pushed.uploaded == 2  # only its own layer and its config
        child_manifest = httpx.get(f"http://{STAGING}/v2/{ref.repository}/manifests/{pushed.digest}",
                                   headers={"Accept": DOCKER_MANIFEST}).json()
        parent_manifest = httpx.get(f"http://{STAGING}/v2/{ref.repository}/manifests/{parent.digest}",
                                    headers={"Accept": DOCKER_MANIFEST}).json()
        assert child_manifest["layers"][:-1] == parent_manifest["layers"]  # the parent's blobs, as they are

        uploads.clear()
        again = publish(child, ImageRef.parse(child), ImageRef.parse(parent_ref), spool=tmp_path,
                        event_hooks=_uploads(uploads))
        assert again.digest == pushed.digest  # same bytes, same digest: a rerun changes nothing
        assert uploads == [] and again.present == 2
    finally:
        engine.images.remove(child, force=True)


def test_the_save_directory_of_every_layer_below_the_top_is_known_before_its_bytes(engine, tmp_path,
                                                                                   parent_image):
    saved = tmp_path / "saved.tar"
    with saved.open("wb") as handle:
        for chunk in engine.api.get_image(parent_image):
            handle.write(chunk)
    with tarfile.open(saved) as archive:
        entry = json.loads(archive.extractfile("manifest.json").read())[0]  # type: ignore[union-attr]
        directories = [layer.split("/")[0] for layer in entry["Layers"]]
        below_top = json.loads(archive.extractfile(f"{directories[0]}/json").read())  # type: ignore[union-attr]
    diff_ids = engine.images.get(parent_image).attrs["RootFS"]["Layers"]
    assert len(diff_ids) == 3
    assert legacy_layer_ids(below_top, diff_ids) == directories[:-1]


def test_a_build_pushes_its_new_layers_itself_and_reports_where_the_time_went(built_example, tmp_path,
                                                                             fresh_repository):
    from .conftest import copy_matrix, imagebuild

    nonce = uuid.uuid4().hex

    def add_layer_to_cpu_variant(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "pushed", "run": [f"echo {nonce} > /etc/imagebuild-e2e-pushed"],
                                 "when": {"paddle": "3.3.1"}}]

    matrix = copy_matrix(tmp_path, add_layer_to_cpu_variant)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"), "--only", "device=cpu")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "where the time went" in run.stdout
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    built = [rec for rec in report["layers"] if rec["status"] == "built"]
    assert {rec["path"].split("/")[0] for rec in built} == {"extra", "release"}
    for rec in built:
        assert rec["pushed_by"] == "imagebuild (engine storage)"
        assert {"build_s", "export_s", "compress_s", "upload_s", "push_s"} <= set(rec["steps"])
        ref = ImageRef.parse(rec["image"])
        assert httpx.head(f"http://{ref.registry}/v2/{ref.repository}/manifests/{ref.tag}",
                          headers={"Accept": DOCKER_MANIFEST}).headers["docker-content-digest"] == rec["digest"]
    extra = next(rec for rec in built if rec["path"].startswith("extra/"))
    # Its parent's gigabyte of layers is in the registry: only its own small layer(s) and config go up.
    assert 0 < extra["blobs"]["uploaded_bytes"] < 1_000_000


def _storage(engine) -> EngineStorage:
    return EngineStorage.from_info(engine.api.info())


def test_every_layer_rebuilt_from_the_engines_storage_hashes_to_the_engines_diff_id(engine, parent_image):
    storage = _storage(engine)
    info = engine.api.inspect_image(parent_image)
    diff_ids = info["RootFS"]["Layers"]
    assert len(diff_ids) == 3  # the base's layer and the two of the test
    for chain_id, diff_id in zip(chain_ids(diff_ids), diff_ids):
        rebuilt = hashlib.sha256()
        for chunk in storage.layer_tar(chain_id, diff_id):
            rebuilt.update(chunk)
        assert "sha256:" + rebuilt.hexdigest() == diff_id
    assert hashlib.sha256(storage.image_config(info["Id"])).hexdigest() == info["Id"].split(":")[1]


def _special_files(directory: str, names: list[str]) -> set[str]:
    """Entries that are neither files, folders nor links (device nodes, fifos, sockets)."""
    import stat

    return {n for n in names
            if not stat.S_ISREG(mode := os.lstat(os.path.join(directory, n)).st_mode)
            and not stat.S_ISDIR(mode) and not stat.S_ISLNK(mode)}


def _copy_of_storage(storage: EngineStorage, image_info: dict, root: Path) -> EngineStorage:
    """The image's config and its layers above the base, copied into a data root laid out like the
    engine's (the base's layer, with its device nodes, stays: the registry has it, so it is never read)."""
    copy = EngineStorage(root, storage.driver)
    content = Path("image") / storage.driver / "imagedb" / "content" / "sha256" / image_info["Id"].split(":")[1]
    (root / content).parent.mkdir(parents=True)
    shutil.copy2(storage.root / content, root / content)
    for chain_id in chain_ids(image_info["RootFS"]["Layers"])[1:]:
        layer = storage.layerdb / chain_id.split(":")[1]
        shutil.copytree(layer, copy.layerdb / layer.name)
        cache_id = (layer / "cache-id").read_text().strip()
        # Device nodes (an old base's /dev/zero) must not be read as files: copying them fills the disk.
        shutil.copytree(storage.root / storage.driver / cache_id / "diff", root / storage.driver / cache_id / "diff",
                        symlinks=True, ignore=_special_files)
    return copy


def _diff_dir(storage: EngineStorage, chain_id: str) -> Path:
    return storage.root / storage.driver / (storage.layerdb / chain_id.split(":")[1] / "cache-id").read_text() / "diff"


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_a_damaged_layer_in_storage_falls_back_to_docker_save_and_pushes_the_right_image(
        engine, tmp_path, repository, parent_image, damage):
    base_ref = _base(engine)
    info = engine.api.inspect_image(parent_image)
    copy = _copy_of_storage(_storage(engine), info, tmp_path / "root")
    top = _diff_dir(copy, chain_ids(info["RootFS"]["Layers"])[-1]) / "parent-b"
    if damage == "changed":  # same size, one byte different: only the hash can tell
        data = bytearray(top.read_bytes())
        data[100] ^= 0xFF
        top.write_bytes(bytes(data))
    else:
        top.unlink()

    pushed = publish(parent_image, ImageRef.parse(parent_image), base_ref, spool=tmp_path, storage=copy)
    assert pushed.source == SAVE
    why = " ".join(pushed.notes)
    assert ("hashes to" in why) if damage == "changed" else ("parent-b" in why)

    # What went up is the engine's image: the same digest as a push from the intact storage.
    clean = publish(parent_image, ImageRef.parse(parent_image), base_ref, spool=tmp_path)
    assert clean.source == STORAGE and clean.digest == pushed.digest
    ref = ImageRef.parse(parent_image)
    validate = subprocess.run([CRANE, "validate", "--insecure", "--remote",
                               f"{ref.registry}/{ref.repository}@{pushed.digest}"],
                              capture_output=True, text=True, timeout=300, check=False)
    assert validate.returncode == 0 and "PASS" in validate.stdout, validate.stdout + validate.stderr


def test_an_image_that_adds_no_layer_uploads_only_its_config(engine, tmp_path, repository, parent_image):
    base_ref = _base(engine)
    parent = publish(parent_image, ImageRef.parse(parent_image), base_ref, spool=tmp_path)
    ref = ImageRef.parse(parent_image)
    parent_ref = f"{ref.registry}/{ref.repository}@{parent.digest}"
    labelled = _build(tmp_path, "labelled", f"ARG PARENT\nFROM ${{PARENT}}\nLABEL e2e={uuid.uuid4().hex}\n",
                      f"{ref.registry}/{ref.repository}:labelled", {"PARENT": parent_ref})
    try:
        uploads: list[str] = []
        pushed = publish(labelled, ImageRef.parse(labelled), ImageRef.parse(parent_ref), spool=tmp_path,
                         event_hooks=_uploads(uploads))
        assert pushed.source == STORAGE
        assert len(uploads) == pushed.uploaded == 1 and pushed.uploaded_bytes < 100_000  # the config alone
        assert pushed.steps.get("compress_s", 0.0) == 0.0
    finally:
        engine.images.remove(labelled, force=True)


# --- zstd (a release image's opt-in compression) ------------------------------------------------------


def _manifest(repository: str, reference: str) -> tuple[bytes, str]:
    served = httpx.get(f"http://{STAGING}/v2/{repository}/manifests/{reference}",
                       headers={"Accept": f"{OCI_MANIFEST}, {DOCKER_MANIFEST}"})
    assert served.status_code == 200, served.text
    return served.content, served.headers["content-type"]


def _blob(repository: str, digest: str) -> bytes:
    served = httpx.get(f"http://{STAGING}/v2/{repository}/blobs/{digest}", follow_redirects=True, timeout=120)
    assert served.status_code == 200
    return served.content


@pytest.fixture
def zstd_child(engine, tmp_path, repository, parent_image):
    """(the gzip parent's ref by digest, a child image built FROM it that adds one layer)."""
    parent = publish(parent_image, ImageRef.parse(parent_image), _base(engine), spool=tmp_path)
    ref = ImageRef.parse(parent_image)
    parent_ref = f"{ref.registry}/{ref.repository}@{parent.digest}"
    child = _build(tmp_path, "zstd-child", f"ARG PARENT\nFROM ${{PARENT}}\n"
                   f"RUN head -c 2000000 /dev/urandom > /child && echo {uuid.uuid4().hex} > /child-id\n",
                   f"{ref.registry}/{ref.repository}:child", {"PARENT": parent_ref})
    yield parent_ref, child
    with contextlib.suppress(docker.errors.ImageNotFound):  # a test may have removed it
        engine.images.remove(child, force=True)


def test_a_zstd_push_is_an_oci_image_of_zstd_blobs_that_decompress_to_the_configs_diff_ids(
        engine, tmp_path, repository, zstd_child):
    import zstandard

    parent_ref, child = zstd_child
    uploads: list[str] = []
    target = ImageRef.parse(f"{STAGING}/{repository}:child-zstd")
    pushed = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, event_hooks=_uploads(uploads),
                     compression=ZSTD)
    assert pushed.compression == "zstd:3" and pushed.twin == f"{twin_tag(parent_ref.split('@')[1], ZSTD)} put"
    # Every layer is new as zstd (the base's and the parent's too), and the config.
    assert len(uploads) == pushed.uploaded == 5

    raw, media_type = _manifest(repository, pushed.digest)
    manifest = json.loads(raw)
    assert media_type == manifest["mediaType"] == OCI_MANIFEST
    assert manifest["config"]["mediaType"] == OCI_CONFIG
    assert {layer["mediaType"] for layer in manifest["layers"]} == {OCI_LAYER_ZSTD}
    config_raw = _blob(repository, manifest["config"]["digest"])
    assert sha256_digest(config_raw) == manifest["config"]["digest"] == engine.images.get(child).id
    assert len(config_raw) == manifest["config"]["size"]
    diff_ids = json.loads(config_raw)["rootfs"]["diff_ids"]
    assert len(diff_ids) == len(manifest["layers"]) == 4
    for layer, diff_id in zip(manifest["layers"], diff_ids):
        blob = _blob(repository, layer["digest"])
        assert (sha256_digest(blob), len(blob)) == (layer["digest"], layer["size"])
        tar = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()
        assert sha256_digest(tar) == diff_id

    # The twin: the parent's very config over the same zstd blobs as the image's lower layers.
    twin = json.loads(_manifest(repository, twin_tag(parent_ref.split("@")[1], ZSTD))[0])
    parent = json.loads(_manifest(repository, parent_ref.split("@")[1])[0])
    assert twin["config"]["digest"] == parent["config"]["digest"]
    assert twin["layers"] == manifest["layers"][:-1]
    # (`crane validate` is no check here: crane 0.22 gunzips every layer it validates.)


def test_a_rerun_uploads_nothing_and_a_sibling_compresses_only_its_own_layer(engine, tmp_path, repository,
                                                                            zstd_child):
    parent_ref, child = zstd_child
    target = ImageRef.parse(f"{STAGING}/{repository}:child-zstd")
    first = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, compression=ZSTD)
    uploads: list[str] = []
    again = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, event_hooks=_uploads(uploads),
                    compression=ZSTD)
    assert again.digest == first.digest and uploads == [] and again.present == 2
    assert again.twin == f"{twin_tag(parent_ref.split('@')[1], ZSTD)} reused"

    sibling = _build(tmp_path, "zstd-sibling", f"ARG PARENT\nFROM ${{PARENT}}\nRUN echo {uuid.uuid4().hex} > /s\n",
                     f"{STAGING}/{repository}:sibling", {"PARENT": parent_ref})
    try:
        pushed = publish(sibling, ImageRef.parse(f"{sibling}-zstd"), ImageRef.parse(parent_ref), spool=tmp_path,
                         event_hooks=_uploads(uploads), compression=ZSTD)
        assert len(uploads) == pushed.uploaded == 2  # its own layer and its config: the twin lends the rest
        lower = json.loads(_manifest(repository, first.digest)[0])["layers"][:-1]
        assert json.loads(_manifest(repository, pushed.digest)[0])["layers"][:-1] == lower
    finally:
        engine.images.remove(sibling, force=True)


def test_a_twin_that_does_not_check_out_is_replaced_not_used(engine, tmp_path, repository, zstd_child):
    parent_ref, child = zstd_child
    target = ImageRef.parse(f"{STAGING}/{repository}:child-zstd")
    good = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, compression=ZSTD)
    tag = twin_tag(parent_ref.split("@")[1], ZSTD)
    twin = json.loads(_manifest(repository, tag)[0])
    twin["layers"][0]["size"] += 1  # a registry's word on a blob's size is checked against the registry
    put = httpx.put(f"http://{STAGING}/v2/{repository}/manifests/{tag}", content=json.dumps(twin).encode(),
                    headers={"Content-Type": OCI_MANIFEST})
    assert put.status_code == 201, put.text
    again = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, compression=ZSTD)
    assert again.digest == good.digest and again.twin == f"{tag} put"
    assert any(f"zstd twin {tag} not used" in note and "not" in note for note in again.notes)
    assert json.loads(_manifest(repository, tag)[0])["layers"] == json.loads(_manifest(repository, good.digest)[0])[
        "layers"][:-1]


def test_a_twin_whose_blob_is_another_layer_of_the_right_size_is_refused_by_its_content(
        engine, tmp_path, repository, zstd_child):
    """Whoever can push to the repository can move the twin's tag: a twin naming a real blob of the repository
    (digest and size consistent with the registry) that is not the parent's layer is caught by decompressing it."""
    parent_ref, child = zstd_child
    target = ImageRef.parse(f"{STAGING}/{repository}:child-zstd")
    good = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, compression=ZSTD)
    tag = twin_tag(parent_ref.split("@")[1], ZSTD)
    twin = json.loads(_manifest(repository, tag)[0])
    forged_layer = json.loads(_manifest(repository, good.digest)[0])["layers"][-1]  # the child's own layer
    twin["layers"][0] = forged_layer
    put = httpx.put(f"http://{STAGING}/v2/{repository}/manifests/{tag}", content=json.dumps(twin).encode(),
                    headers={"Content-Type": OCI_MANIFEST})
    assert put.status_code == 201, put.text
    again = publish(child, target, ImageRef.parse(parent_ref), spool=tmp_path, compression=ZSTD)
    assert again.digest == good.digest and again.twin == f"{tag} put"
    assert any(f"zstd twin {tag} not used" in note and f"blob {forged_layer['digest']} decompresses to" in note
               for note in again.notes), again.notes
    assert json.loads(_manifest(repository, good.digest)[0])["layers"][0] != forged_layer


def test_a_gzip_push_of_the_same_image_is_the_schema_2_image_it_always_was(engine, tmp_path, repository,
                                                                          zstd_child):
    parent_ref, child = zstd_child
    publish(child, ImageRef.parse(f"{STAGING}/{repository}:child-zstd"), ImageRef.parse(parent_ref),
            spool=tmp_path, compression=ZSTD)
    default = publish(child, ImageRef.parse(child), ImageRef.parse(parent_ref), spool=tmp_path)
    gzip = publish(child, ImageRef.parse(child), ImageRef.parse(parent_ref), spool=tmp_path, compression=GZIP)
    assert gzip.digest == default.digest and gzip.twin is None and gzip.compression == "gzip"
    raw, media_type = _manifest(repository, gzip.digest)
    manifest = json.loads(raw)
    assert media_type == DOCKER_MANIFEST
    parent = json.loads(_manifest(repository, parent_ref.split("@")[1])[0])
    assert manifest["layers"][:-1] == parent["layers"]  # the parent's gzip blobs, as they are
    layers = [Descriptor(layer["mediaType"], layer["digest"], layer["size"]) for layer in manifest["layers"]]
    config = Descriptor(DOCKER_CONFIG, manifest["config"]["digest"], manifest["config"]["size"])
    assert raw == schema2_manifest(config, layers) and {d.media_type for d in layers} == {DOCKER_LAYER}


def test_containerd_pulls_and_unpacks_a_zstd_image(engine, tmp_path, repository, zstd_child):
    """containerd 1.6 (the nodes' runtime here) reads zstd; its unpack checks each layer's diff_id."""
    from .nodes import ContainerdNode

    parent_ref, child = zstd_child
    pushed = publish(child, ImageRef.parse(f"{STAGING}/{repository}:child-zstd"), ImageRef.parse(parent_ref),
                     spool=tmp_path, compression=ZSTD)
    node = ContainerdNode(tmp_path, "zstd-e2e")
    try:
        ref = f"{STAGING}/{repository}@{pushed.digest}"
        pulled = node.ctr("images", "pull", "--plain-http", ref, timeout=300)
        assert pulled.returncode == 0, pulled.stderr
        made = node.ctr("containers", "create", ref, "zstd-e2e", timeout=120)
        assert made.returncode == 0, made.stderr
        assert node.ctr("snapshots", "ls").stdout.count("Committed") == 4
    finally:
        node.stop()



def test_docker_20_10_runs_a_zstd_image_by_digest_where_it_holds_its_config_and_smoke_takes_it(
        engine, tmp_path, repository, zstd_child):
    """Docker 20.10 (this host's engine) decompresses gzip only, but a pull whose config (the image id) the
    engine holds fetches no layer: the build host, where the release image was built, runs the zstd
    image, smoke included. Elsewhere it cannot, and says so."""
    from imagebuild.checks.smoke_run import RunOptions, SmokeRunner

    parent_ref, child = zstd_child
    pushed = publish(child, ImageRef.parse(f"{STAGING}/{repository}:child-zstd"), ImageRef.parse(parent_ref),
                     spool=tmp_path, compression=ZSTD)
    ref = f"{STAGING}/{repository}@{pushed.digest}"
    image, _ = SmokeRunner(engine, RunOptions(), tmp_path / "out", tmp_path).pull(ref)
    assert image.id == engine.images.get(child).id
    assert engine.containers.run(ref, ["cat", "/child-id"], remove=True).strip()
    if int(engine.version()["Version"].split(".")[0]) < 23:
        engine.images.remove(image.id, force=True)  # the config (and the digest's name) gone with it
        pulled = subprocess.run([docker_cli(), "pull", ref], capture_output=True, text=True, timeout=300, check=False)
        assert pulled.returncode != 0 and "invalid tar header" in pulled.stderr, pulled.stdout + pulled.stderr


def test_smoke_gets_a_zstd_image_whose_config_the_engine_lacks_by_loading_its_checked_layers(
        engine, tmp_path, repository, zstd_child):
    """A build host whose release layer came from the layer cache holds no config of it; Docker 20.10
    cannot decompress the zstd layers, so smoke reads them from the registry, checks each against its
    digest and diff_id, and loads them: the engine then runs the pushed config under the pushed digest."""
    from imagebuild.checks.smoke_run import RunOptions, SmokeRunner

    parent_ref, child = zstd_child
    pushed = publish(child, ImageRef.parse(f"{STAGING}/{repository}:child-zstd"), ImageRef.parse(parent_ref),
                     spool=tmp_path, compression=ZSTD)
    expected = engine.containers.run(child, ["cat", "/child-id"], remove=True)
    engine.images.remove(child, force=True)  # the config (the image id) is gone from the engine
    ref = f"{STAGING}/{repository}@{pushed.digest}"
    try:
        image, _ = SmokeRunner(engine, RunOptions(), tmp_path / "out", tmp_path).pull(ref)
        assert image.id == pushed.image_id
        assert ref in image.attrs["RepoDigests"]
        assert engine.containers.run(ref, ["cat", "/child-id"], remove=True) == expected
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.images.remove(pushed.image_id, force=True)


def test_smoke_refuses_a_zstd_image_whose_layer_is_not_what_its_config_says_and_loads_nothing(
        engine, tmp_path, repository, zstd_child):
    """Someone who can push to the repository puts a config whose last diff_id names other content
    (a new config, so a new image id) over the same zstd blobs: smoke names the blob and the diff_id,
    and the engine is handed nothing."""
    from imagebuild.checks.smoke_run import RunOptions, SmokeRunner

    parent_ref, child = zstd_child
    pushed = publish(child, ImageRef.parse(f"{STAGING}/{repository}:child-zstd"), ImageRef.parse(parent_ref),
                     spool=tmp_path, compression=ZSTD)
    path = repository
    with Registry(STAGING) as registry:
        manifest = json.loads(registry.get_manifest(path, pushed.digest)[0])
        config = json.loads(registry.get_blob(path, manifest["config"]["digest"]))
        forged_diff_id = sha256_digest(b"not this layer")
        config["rootfs"]["diff_ids"][-1] = forged_diff_id
        raw_config = json.dumps(config).encode()
        manifest["config"] = {**manifest["config"], "digest": registry.put_blob(path, raw_config),
                              "size": len(raw_config)}
        raw = json.dumps(manifest).encode()
        forged = registry.put_manifest(path, sha256_digest(raw), raw, OCI_MANIFEST)
    ref = f"{STAGING}/{repository}@{forged}"
    runner = SmokeRunner(engine, RunOptions(), tmp_path / "out", tmp_path)
    # An engine that pulls zstd itself (Docker >= 23) checks the diff_ids as it unpacks, with words of its own.
    ours = None if runner.engine_reads_zstd() else f"decompresses to .*not the config's diff_id {forged_diff_id}"
    with pytest.raises(docker.errors.DockerException, match=ours):
        runner.pull(ref)
    with pytest.raises(docker.errors.ImageNotFound, match="(?i)no such image"):
        engine.images.get(manifest["config"]["digest"])


def test_a_zstd_image_and_its_blobs_are_copied_into_a_region_registry_as_they_are(engine, tmp_path, repository,
                                                                                  zstd_child):
    from imagebuild.oci.copy import copy_image

    from .conftest import REGIONS

    parent_ref, child = zstd_child
    pushed = publish(child, ImageRef.parse(f"{STAGING}/{repository}:child-zstd"), ImageRef.parse(parent_ref),
                     spool=tmp_path, compression=ZSTD)
    region = REGIONS["eu-west"]
    with Registry(STAGING) as source, Registry(region) as target:
        copied = copy_image(source, repository, pushed.digest, target, repository, tags=["zstd"])
        assert copied.digest == pushed.digest and copied.media_type == OCI_MANIFEST
        raw, media_type, digest = target.get_manifest(repository, "zstd")
        assert (digest, media_type) == (pushed.digest, OCI_MANIFEST)
        for layer in json.loads(raw)["layers"]:
            assert layer["mediaType"] == OCI_LAYER_ZSTD
            assert target.blob_size(repository, layer["digest"]) == layer["size"]


# --- eStargz (a release image's opt-in lazy-pull format) -----------------------------------------------------


ESTARGZ = Compression("estargz")
ESTARGZ_VERIFY = "/opt/imagebuild-tools/bin/estargz-verify"
LONG = "d" * 150


@dataclass
class EstargzImage:
    local: str  # the engine's image (tag)
    repository: str
    digest: str
    nonce: str
    pushed: object  # the PushResult


@pytest.fixture(scope="module")
def estargz_image(engine, staging_registry, tmp_path_factory):
    """An image FROM the base whose own layer holds a chunked file, a symbolic and a hard link to it and a long
    name, pushed once as eStargz with two of its files prioritized (the module's tests read it, none change it)."""
    tmp = tmp_path_factory.mktemp("estargz")
    repository = f"imagebuild-e2e/{unique('estargz')}"
    nonce = uuid.uuid4().hex
    local = _build(tmp, "estargz", f"FROM {BASE}\n"
                   "RUN mkdir -p /opt/app/lib && head -c 9000000 /dev/urandom > /opt/app/lib/big.so "
                   "&& ln -s big.so /opt/app/lib/link.so && ln /opt/app/lib/big.so /opt/app/lib/hard.so "
                   f"&& mkdir -p /opt/app/{LONG} && echo long > /opt/app/{LONG}/{'f' * 120} "
                   f"&& echo {nonce} > /opt/app/id\n",
                   f"{STAGING}/{repository}:local")
    pushed = publish(local, ImageRef.parse(f"{STAGING}/{repository}:estargz"), None, spool=tmp,
                     compression=ESTARGZ, prioritized=["/opt/app/id", "/opt/app/lib/hard.so"])
    yield EstargzImage(local, repository, pushed.digest, nonce, pushed)
    for image in engine.images.list(name=f"{STAGING}/{repository}"):
        engine.images.remove(image.id, force=True)


def _verify_estargz(blob: Path, toc_digest: str) -> subprocess.CompletedProcess:
    if not Path(ESTARGZ_VERIFY).is_file():
        pytest.fail(f"{ESTARGZ_VERIFY} is missing: scripts/build-test-tools.sh builds it")
    return subprocess.run([ESTARGZ_VERIFY, "--toc-digest", toc_digest, str(blob)], capture_output=True, text=True,
                          timeout=300, check=False)


def test_an_estargz_push_is_an_oci_image_of_estargz_layers_each_verified_by_the_go_reader(
        engine, tmp_path, estargz_image):
    """Every layer (the base's too) is an eStargz blob: its digest and size as described, its TOC's digest the
    descriptor's annotation, accepted by the Go estargz package (TOC, every chunk against its digest, the tar
    against the TOC), and its tar hashes to the rewritten config's diff_id; the config is otherwise the engine's."""
    from imagebuild.oci import estargz
    from tests.test_estargz import gunzip

    raw, media_type = _manifest(estargz_image.repository, estargz_image.digest)
    manifest = json.loads(raw)
    assert media_type == manifest["mediaType"] == OCI_MANIFEST
    assert manifest["config"]["mediaType"] == OCI_CONFIG
    config_raw = _blob(estargz_image.repository, manifest["config"]["digest"])
    assert (sha256_digest(config_raw), len(config_raw)) == (manifest["config"]["digest"], manifest["config"]["size"])
    config, local = json.loads(config_raw), engine.images.get(estargz_image.local)
    assert estargz_image.pushed.image_id == manifest["config"]["digest"] != local.id  # new diff_ids, new id
    engine_config = json.loads(EngineStorage.from_info(engine.api.info()).image_config(local.id))
    assert {**config, "rootfs": None} == {**engine_config, "rootfs": None}
    diff_ids = config["rootfs"]["diff_ids"]
    assert len(diff_ids) == len(manifest["layers"]) == 2 and diff_ids != local.attrs["RootFS"]["Layers"]
    landmarks = []
    for layer, diff_id in zip(manifest["layers"], diff_ids):
        assert layer["mediaType"] == OCI_LAYER_GZIP
        blob = _blob(estargz_image.repository, layer["digest"])
        assert (sha256_digest(blob), len(blob)) == (layer["digest"], layer["size"])
        path = tmp_path / layer["digest"].split(":")[1]
        path.write_bytes(blob)
        toc_digest = layer["annotations"][estargz.TOC_DIGEST_ANNOTATION]
        verified = _verify_estargz(path, toc_digest)
        assert verified.returncode == 0, verified.stderr
        verdict = json.loads(verified.stdout)
        assert verdict["toc_digest"] == toc_digest and verdict["diff_id"] == diff_id
        assert verdict["uncompressed_size"] == int(layer["annotations"][estargz.UNCOMPRESSED_SIZE_ANNOTATION])
        landmarks.append(verdict["landmark"])
        tar = gunzip(blob)
        assert sha256_digest(tar) == diff_id
    # Only the test's own layer holds the prioritized files; the base's starts with the no-prefetch landmark.
    assert landmarks == [".no.prefetch.landmark", ".prefetch.landmark"]
    assert estargz_image.pushed.prefetch["layers"][1]["prioritized"] == 6  # opt, app, id, lib, big.so, hard.so
    # The verifier is no rubber stamp: another TOC digest is refused.
    wrong = _verify_estargz(path, sha256_digest(b"another toc"))
    assert wrong.returncode == 1 and "invalid TOC JSON" in wrong.stderr


def test_the_go_reader_takes_every_odd_entry_the_writer_writes(tmp_path):
    """The unit tests' layer (devices, a fifo, xattrs, GNU and PAX long names, hard and symbolic links, a file
    of exactly one chunk) through the Go estargz package."""
    from tests.test_estargz import convert, layer_tar

    for fmt, prioritized in ((tarfile.PAX_FORMAT, ["usr/bin/hard", "etc/hosts"]), (tarfile.GNU_FORMAT, [])):
        blob, written = convert(layer_tar(fmt), prioritized, threads=2)
        path = tmp_path / f"layer-{fmt}"
        path.write_bytes(blob)
        verified = _verify_estargz(path, written.toc_digest)
        assert verified.returncode == 0, verified.stderr
        verdict = json.loads(verified.stdout)
        assert (verdict["diff_id"], verdict["uncompressed_size"]) == (written.diff_id, written.uncompressed_size)
        assert verdict["chunks"] == 3 + 1 + 4 + 1  # big's three, exact's one, four small files, the landmark
        assert verdict["landmark"] == (".prefetch.landmark" if prioritized else ".no.prefetch.landmark")


def test_an_estargz_rerun_gives_the_same_digest_and_uploads_nothing(tmp_path, estargz_image):
    uploads: list[str] = []
    again = publish(estargz_image.local, ImageRef.parse(f"{STAGING}/{estargz_image.repository}:estargz"), None,
                    spool=tmp_path, event_hooks=_uploads(uploads), compression=ESTARGZ,
                    prioritized=["/opt/app/id", "/opt/app/lib/hard.so"])
    assert again.digest == estargz_image.digest and uploads == [] and again.present == 3


def test_docker_20_10_pulls_an_estargz_image_in_full_and_runs_it(engine, estargz_image):
    """An eStargz layer is a gzip tar: an engine that knows nothing of it pulls every layer (a new config,
    so nothing is found locally) and runs the image."""
    ref = f"{STAGING}/{estargz_image.repository}@{estargz_image.digest}"
    pulled = subprocess.run([docker_cli(), "pull", ref], capture_output=True, text=True, timeout=600, check=False)
    assert pulled.returncode == 0, pulled.stderr
    image = engine.images.get(ref)
    try:
        assert image.id == estargz_image.pushed.image_id
        out = engine.containers.run(ref, ["sh", "-c", "cat /opt/app/id && cmp /opt/app/lib/big.so /opt/app/lib/hard.so"
                                          " && cmp /opt/app/lib/big.so /opt/app/lib/link.so && echo same"],
                                    remove=True).decode()
        assert out.split() == [estargz_image.nonce, "same"]
    finally:
        engine.images.remove(image.id, force=True)


def test_a_plain_containerd_node_pulls_and_unpacks_an_estargz_image_in_full(tmp_path, estargz_image):
    from .nodes import ContainerdNode

    with ContainerdNode(tmp_path, "estargz-full") as node:
        ref = f"{STAGING}/{estargz_image.repository}@{estargz_image.digest}"
        pulled = node.ctr("images", "pull", "--plain-http", ref, timeout=300)
        assert pulled.returncode == 0, pulled.stderr
        ran = node.ctr("run", "--rm", ref, "full", "cat", "/opt/app/id", timeout=120)
        assert ran.returncode == 0 and ran.stdout.strip() == estargz_image.nonce, ran.stderr
        layers = [layer["digest"] for layer in json.loads(_manifest(estargz_image.repository,
                                                                    estargz_image.digest)[0])["layers"]]
        assert set(layers) <= set(node.ctr("content", "ls", "-q").stdout.split())  # every layer fetched


def test_a_stargz_node_mounts_each_layer_lazily_over_fuse_and_runs_a_process_on_them(tmp_path, estargz_image):
    """The stargz snapshotter (containerd's proxy snapshotter plugin) mounts every layer from the registry over
    FUSE, checked against the manifest's TOC digests; containerd fetches no layer blob; runc runs a process on
    the lazily mounted root file system, reading a chunked file through its links."""
    from .nodes import STARGZ, ContainerdNode

    with ContainerdNode(tmp_path, "estargz-lazy", lazy=True) as node:
        ref = f"{STAGING}/{estargz_image.repository}@{estargz_image.digest}"
        pulled = node.rpull(ref, timeout=300)
        assert pulled.returncode == 0 and pulled.stdout.strip() == estargz_image.digest, pulled.stderr
        assert len(node.fuse_mounts()) == 2, node.fuse_mounts()  # one per layer: nothing was unpacked
        layers = [layer["digest"] for layer in json.loads(_manifest(estargz_image.repository,
                                                                    estargz_image.digest)[0])["layers"]]
        assert not set(layers) & set(node.ctr("content", "ls", "-q").stdout.split())
        ran = node.ctr("run", "--rm", "--snapshotter", STARGZ, ref, "lazy", "sh", "-c",
                       "cat /opt/app/id && sha256sum /opt/app/lib/big.so /opt/app/lib/hard.so /opt/app/lib/link.so "
                       f"&& cat /opt/app/{LONG}/{'f' * 120}", timeout=120)
        assert ran.returncode == 0, ran.stderr + node.stargz_log.read_text()[-2000:]
        lines = ran.stdout.split("\n")
        assert lines[0] == estargz_image.nonce
        assert len({line.split()[0] for line in lines[1:4]}) == 1  # the file, its hard link and its symbolic link
        assert lines[4] == "long"


def test_a_layer_whose_toc_digest_is_not_the_manifests_is_not_mounted_lazily(tmp_path, estargz_image):
    """The snapshotter checks each TOC against the digest in the manifest (which cosign signs): a manifest naming
    another TOC digest gets no lazy mount for that layer; containerd fetches it whole, checked by its digest."""
    from imagebuild.oci import estargz

    from .nodes import ContainerdNode

    manifest = json.loads(_manifest(estargz_image.repository, estargz_image.digest)[0])
    manifest["layers"][1]["annotations"][estargz.TOC_DIGEST_ANNOTATION] = sha256_digest(b"not this layer's toc")
    raw = json.dumps(manifest).encode()
    put = httpx.put(f"http://{STAGING}/v2/{estargz_image.repository}/manifests/wrong-toc", content=raw,
                    headers={"Content-Type": OCI_MANIFEST})
    assert put.status_code == 201, put.text
    with ContainerdNode(tmp_path, "estargz-wrong", lazy=True) as node:
        pulled = node.rpull(f"{STAGING}/{estargz_image.repository}@{sha256_digest(raw)}", timeout=300)
        assert pulled.returncode == 0, pulled.stderr
        assert len(node.fuse_mounts()) == 1  # the base's layer only
        assert manifest["layers"][1]["digest"] in node.ctr("content", "ls", "-q").stdout.split()
        assert "invalid stargz layer" in node.stargz_log.read_text()
