"""The local base image, built for real: mmdebstrap from this machine's apt sources (bookworm,
-updates, -security), assembled by imagebuild.build.baseimage, pushed to the staging registry.

The claim under test: the same package set gives the same digest, whoever builds it. Two builds
in separate folders on this machine, and one inside a clean container started from the image
itself, must agree byte for byte. The mirror moves (a security update may land between two
builds), so each comparison first checks that the package lists match and says so when not.
"""
from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from imagebuild.core.runner import docker_cli

from .conftest import REPO, STAGING

# The fixed time bootstrap builds with (scripts/versions.env), so these builds match its base.
EPOCH = next(line.split("=", 1)[1].strip() for line in (REPO / "scripts" / "versions.env").read_text().splitlines()
             if line.startswith("BASE_SOURCE_DATE_EPOCH="))
MOVED = "the mirror moved between the two builds (another package set); rerun the test"


@dataclass
class Built:
    digest: str
    packages: list[str]
    sources: list[str]
    workdir: Path


def build(workdir: Path, *push: str) -> Built:
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed; run scripts/bootstrap.sh", pytrace=False)
    proc = subprocess.run([sys.executable, "-m", "imagebuild.build.baseimage", "build", "--workdir", str(workdir),
                           "--epoch", EPOCH, *push], cwd=REPO, check=False, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    return Built(out["digest"], (workdir / "packages.txt").read_text().splitlines(), out["sources"], workdir)


@pytest.fixture(scope="module")
def first(engine, staging_registry, tmp_path_factory) -> tuple[Built, str]:
    """One build, pushed to a repository of its own; (the build, its reference by tag)."""
    ref = f"{STAGING}/imagebuild-e2e/base-{uuid.uuid4().hex[:8]}:12"
    return build(tmp_path_factory.mktemp("base-one"), "--push", ref), ref


def test_the_base_takes_bookworm_its_updates_and_its_security_suite(first):
    built, _ = first
    assert [line.split()[2] for line in built.sources] == ["bookworm", "bookworm-updates", "bookworm-security"]


def test_two_builds_in_separate_folders_give_the_same_digest(first, tmp_path):
    built, _ = first
    again = build(tmp_path / "two")
    assert again.packages == built.packages, MOVED
    assert again.digest == built.digest
    assert (again.workdir / "image" / "layer.tar.gz").read_bytes() == (built.workdir / "image" / "layer.tar.gz").read_bytes()


def test_the_registry_serves_the_digest_computed_before_the_push(first):
    built, ref = first
    repository, tag = ref.split("/", 1)[1].rsplit(":", 1)
    response = httpx.head(f"http://{STAGING}/v2/{repository}/manifests/{tag}", timeout=30,
                          headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    assert response.status_code == 200 and response.headers["docker-content-digest"] == built.digest


def test_docker_pulls_and_runs_it_with_the_security_updates_configured(first):
    built, ref = first
    docker = docker_cli()
    by_digest = f"{ref.rsplit(':', 1)[0]}@{built.digest}"
    pulled = subprocess.run([docker, "pull", by_digest], check=False, capture_output=True, text=True, timeout=600)
    assert pulled.returncode == 0, pulled.stderr
    run = subprocess.run([docker, "run", "--rm", by_digest, "cat", "/etc/apt/sources.list"], check=False,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [line for line in run.stdout.splitlines() if line.strip()] == built.sources
    inspect = subprocess.run([docker, "image", "inspect", by_digest, "--format", "{{.Created}} {{json .Config.Cmd}}"],
                             check=False, capture_output=True, text=True, timeout=60)
    created = dt.datetime.fromtimestamp(int(EPOCH), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert inspect.stdout.split() == [created, '["/bin/bash"]']
    subprocess.run([docker, "rmi", by_digest], check=False, capture_output=True)


# Inside the container: the image's own apt sources (written by mmdebstrap from the host's),
# Debian's python3 and mmdebstrap, and this checkout read-only. mmdebstrap's root mode mounts
# /proc and /sys in its chroot, hence CAP_SYS_ADMIN (no --privileged needed).
IN_CONTAINER = """set -eu
apt-get update -qq
apt-get install -y -qq --no-install-recommends mmdebstrap python3 >/dev/null 2>&1
cd /src
python3 -m imagebuild.build.baseimage build --workdir /tmp/base --epoch {epoch} >/out/result.json
cp /tmp/base/packages.txt /out/packages.txt
"""


def test_a_build_inside_a_clean_container_of_the_image_gives_the_same_digest(first, tmp_path):
    built, ref = first
    out = tmp_path / "out"
    out.mkdir()
    docker = docker_cli()
    run = subprocess.run([docker, "run", "--rm", "--cap-add", "SYS_ADMIN", "-v", f"{REPO}:/src:ro",
                          "-v", f"{out}:/out", f"{ref.rsplit(':', 1)[0]}@{built.digest}",
                          "bash", "-c", IN_CONTAINER.format(epoch=EPOCH)],
                         check=False, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    inside = json.loads((out / "result.json").read_text())
    assert (out / "packages.txt").read_text().splitlines() == built.packages, MOVED
    assert inside["sources"] == built.sources
    assert inside["digest"] == built.digest


# The versions.env platforms bootstrap built the shared base for, as an OCI index under its tag.
BASE_PLATFORMS = next(line.split("=", 1)[1].strip() for line in (REPO / "scripts" / "versions.env").read_text()
                      .splitlines() if line.startswith("BASE_PLATFORMS="))
MACHINE = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}


def test_the_shared_base_is_an_index_whose_every_platform_runs_as_its_own_machine(engine, staging_registry):
    platforms = BASE_PLATFORMS.split('"')[1].split() if '"' in BASE_PLATFORMS else BASE_PLATFORMS.split()
    assert "linux/arm64" in platforms
    response = httpx.get(f"http://{STAGING}/v2/imagebuild/debian/manifests/12", timeout=30,
                         headers={"Accept": "application/vnd.oci.image.index.v1+json"})
    assert response.status_code == 200
    index = response.json()
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    children = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in index["manifests"]}
    assert list(children) == platforms
    docker = docker_cli()
    for platform, digest in children.items():
        run = subprocess.run([docker, "run", "--rm", "--platform", platform, f"{STAGING}/imagebuild/debian@{digest}",
                              "uname", "-m"], check=False, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == MACHINE[platform]
