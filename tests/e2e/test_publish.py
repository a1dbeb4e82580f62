"""The layer push (imagebuild/publish.py) against the real engine and the staging registry.

Each test builds small images of its own FROM the local base image and pushes them to a
repository of its own, so nothing here touches what other tests or people pushed.
"""
from __future__ import annotations

import json
import subprocess
import tarfile
import uuid
from pathlib import Path

import httpx
import pytest

from imagebuild.publish import DOCKER_LAYER, DOCKER_MANIFEST, legacy_layer_ids, publish
from imagebuild.registry import ImageRef
from imagebuild.tools import docker_cli

from .conftest import STAGING, unique

BASE = f"{STAGING}/imagebuild/debian:12"
CRANE = "/opt/imagebuild-tools/bin/crane"


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
    base_digest = engine.images.get_registry_data(BASE).id
    pushed = publish(parent_image, ImageRef.parse(parent_image), ImageRef.parse(f"{BASE}@{base_digest}"),
                     spool=tmp_path)
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


def test_layers_the_registry_has_are_not_uploaded_again(engine, tmp_path, repository, parent_image):
    base_digest = engine.images.get_registry_data(BASE).id
    uploads: list[str] = []
    parent = publish(parent_image, ImageRef.parse(parent_image), ImageRef.parse(f"{BASE}@{base_digest}"),
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
        assert rec["pushed_by"] == "imagebuild"
        assert {"build_s", "export_s", "compress_s", "upload_s", "push_s"} <= set(rec["steps"])
        ref = ImageRef.parse(rec["image"])
        assert httpx.head(f"http://{ref.registry}/v2/{ref.repository}/manifests/{ref.tag}",
                          headers={"Accept": DOCKER_MANIFEST}).headers["docker-content-digest"] == rec["digest"]
    extra = next(rec for rec in built if rec["path"].startswith("extra/"))
    # Its parent's gigabyte of layers is in the registry: only its own small layer(s) and config go up.
    assert 0 < extra["blobs"]["uploaded_bytes"] < 1_000_000
