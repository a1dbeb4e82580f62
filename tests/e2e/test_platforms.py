"""Multi-platform variants, built for real: the example's Paddle 3.2.2 CPU variant is one OCI image index
whose children are a linux/amd64 and a linux/arm64 image (the Arm64 one built under qemu-user-static),
tagged only when both are in the registry; and the registry's own answers are checked before an index
is made of them.

Checked with tools other than imagebuild's own client: crane reads the index, docker runs each child.
"""
from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from imagebuild.core.runner import docker_cli
from imagebuild.oci.client import Registry, RegistryError
from imagebuild.oci.platforms import platform_digest, push_index

from .conftest import STAGING, copy_matrix, imagebuild
from .tools import crane, push_tiny_image, tool

MULTI_VARIANT = "paddle3.2.2-cpu-py3.11-debian12"
MACHINE = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
INDEX = "application/vnd.oci.image.index.v1+json"


def variant(report: dict, name: str) -> dict:
    return next(v for v in report["variants"] if v["id"] == name)


def index_of(reference: str) -> dict:
    return json.loads(crane("manifest", reference))


def test_the_two_platform_variant_is_tagged_as_an_index_of_both_platforms_images(built_example):
    built = variant(built_example.report, MULTI_VARIANT)
    assert built["platforms"] == ["linux/amd64", "linux/arm64"]
    repository = built["image"].split("@")[0]
    # The tag is shared: the example's whole-pipeline test (another worker) builds and tags it too, so
    # the tag is an index of both platforms, and what this build made is read by its digest.
    tagged = index_of(f"{repository}:3.2.2")
    assert tagged["mediaType"] == INDEX
    assert [m["platform"]["architecture"] for m in tagged["manifests"]] == ["amd64", "arm64"]
    index = index_of(built["image"])
    assert index["mediaType"] == INDEX
    assert crane("digest", built["image"]).strip() == built["digest"]
    listed = [(f"{m['platform']['os']}/{m['platform']['architecture']}", m["digest"]) for m in index["manifests"]]
    assert listed == [(c["platform"], c["digest"]) for c in built["children"]]
    for platform, digest in listed:
        config = json.loads(crane("config", f"{repository}@{digest}"))
        assert f"{config['os']}/{config['architecture']}" == platform
        # Each child is that platform's release layer, which the report lists with its platform.
        [release] = [layer for layer in built_example.report["layers"]
                     if layer["path"] == f"release/{MULTI_VARIANT}" and layer["platform"] == platform]
        assert release["digest"] == digest


def test_docker_runs_the_released_tag_on_each_platform_and_paddle_imports(built_example):
    built = variant(built_example.report, MULTI_VARIANT)
    tag = f"{built['image'].split('@')[0]}:3.2.2"
    docker = docker_cli()
    probe = "import paddle, platform; print(platform.machine(), paddle.__version__)"
    # arm64 first, amd64 last: the engine's local copy of the tag ends as this machine's image again.
    for platform in ("linux/arm64", "linux/amd64"):
        run = subprocess.run([docker, "run", "--rm", "--pull", "always", "--network", "none", "--platform", platform,
                              tag, "python", "-c", probe], capture_output=True, text=True, timeout=900, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.split()[-2:] == [MACHINE[platform], "3.2.2"]


def test_a_platform_that_fails_to_build_fails_its_variant_and_no_index_is_tagged(built_example, tmp_path,
                                                                                  fresh_repository):
    nonce = uuid.uuid4().hex

    def break_the_arm64_image_only(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "arch-check", "when": {"paddle": "3.2.2"}, "run": [
            f': {nonce}; if [ "$(uname -m)" = aarch64 ]; then echo "fails on aarch64 on purpose" >&2; exit 3; fi']}]

    matrix = copy_matrix(tmp_path, break_the_arm64_image_only)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"), "--only", "device=cpu")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    layers = {(layer["path"], layer["platform"]): layer["status"] for layer in report["layers"]}
    extra = "extra/debian12-py3.11-paddle3.2.2-arch-check"
    assert layers[(extra, "linux/arm64")] == "failed"
    assert layers[(extra, "linux/amd64")] == "built"
    assert layers[(f"release/{MULTI_VARIANT}", "linux/amd64")] == "built"
    assert layers[(f"release/{MULTI_VARIANT}", "linux/arm64")] == "skipped"
    failed = variant(report, MULTI_VARIANT)
    assert failed["status"] == "failed"
    assert failed["error"].startswith("linux/arm64: ")
    assert not failed.get("digest")
    # Nothing under the variant's tag, though its amd64 image is complete; the other variant is tagged.
    repository = f"{STAGING}/imagebuild-example/{fresh_repository}"
    assert subprocess.run([tool("crane"), "digest", "--insecure", f"{repository}:3.2.2"], capture_output=True,
                          text=True).returncode != 0
    assert crane("digest", f"{repository}:3.3.1").strip() == variant(report, "paddle3.3.1-cpu-py3.11-debian12")["digest"]


@pytest.fixture
def two_platforms(tmp_path) -> tuple[str, str, str]:
    """(repository, an amd64 image's digest, an arm64 image's digest) of tiny images pushed with crane."""
    repository = f"imagebuild-e2e/platforms-{uuid.uuid4().hex[:8]}"
    push_tiny_image(tmp_path / "image", f"{STAGING}/{repository}:image")  # its config names no platform
    digests = []
    for platform in ("linux/amd64", "linux/arm64"):
        tag = f"{STAGING}/{repository}:{platform.split('/')[1]}"
        crane("mutate", "--set-platform", platform, "-t", tag, f"{STAGING}/{repository}:image")
        digests.append(crane("digest", tag).strip())
    return repository, digests[0], digests[1]


def test_an_index_is_made_only_of_children_whose_config_says_their_platform(staging_registry, two_platforms):
    repository, amd64, arm64 = two_platforms
    with Registry(STAGING) as registry:
        digest = push_index(registry, repository, {"linux/amd64": amd64, "linux/arm64": arm64})
        assert platform_digest(registry, repository, digest, "linux/arm64") == arm64
        assert platform_digest(registry, repository, digest, "linux/amd64") == amd64
        with pytest.raises(RegistryError, match="no linux/s390x image"):
            platform_digest(registry, repository, digest, "linux/s390x")
        with pytest.raises(RegistryError, match="is a linux/amd64 image, not linux/arm64"):
            push_index(registry, repository, {"linux/arm64": amd64})
    index = index_of(f"{STAGING}/{repository}@{digest}")
    assert [m["digest"] for m in index["manifests"]] == [amd64, arm64]
