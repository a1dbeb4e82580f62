"""Trust for multi-platform images end to end: real cosign, the real local registries.

Small two-platform indexes are made here (two tiny images, one set to linux/arm64 with crane, joined
by imagebuild.oci.platforms.push_index) and signed in cosign's standard layout: `sha256-<hex>.sig`
and `.att` of the index and of each child. `imagebuild verify` accepts the whole index and each child,
refuses an index with one unsigned child or a child whose config contradicts its entry (naming the
platform), and `imagebuild promote` copies the index whole, every child's signature with it, so that
`cosign verify` passes on each child in the target region.
"""
from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest

from imagebuild.oci.client import OCI_MANIFEST, Registry
from imagebuild.oci.platforms import Child, index_document, push_index

from .conftest import COSIGN_PUB, REGIONS, imagebuild, require_registry
from .test_policy_tester import evaluate, generate
from .test_policy_tester import policy_tester as policy_tester  # noqa: F401 (the fixture, shared)
from .tools import Cosign, KeyPair, crane, push_tiny_image

REGION = REGIONS["eu-west"]
RELEASE_TYPE = "https://imagebuild.dev/attestations/release/v1"  # spelled out, as tools.TYPES does


@pytest.fixture(scope="module")
def repository(staging_registry: str) -> str:
    require_registry(REGION, "region registry")
    return f"{staging_registry}/imagebuild-platform-trust/{uuid.uuid4().hex[:12]}/paddle"


def host_path(repository: str) -> tuple[str, str]:
    host, path = repository.split("/", 1)
    return host, path


def platform_image(tmp: Path, repository: str, platform: str) -> str:
    """A tiny image whose config says `platform` (crane's own says none), in `repository`; its digest."""
    digest = push_tiny_image(tmp, f"{repository}:tiny-{uuid.uuid4().hex[:6]}")
    made = crane("mutate", "--set-platform", platform, f"{repository}@{digest}",
                 "-t", f"{repository}:{platform.replace('/', '-')}-{uuid.uuid4().hex[:6]}").strip()
    return made.rsplit("@", 1)[1]


def child_images(tmp: Path, repository: str) -> dict[str, str]:
    """linux/amd64 and linux/arm64 images (by digest) in `repository`."""
    return {platform: platform_image(tmp, repository, platform) for platform in ("linux/amd64", "linux/arm64")}


def attest_child(cosign: Cosign, key: KeyPair, image: str, tmp: Path) -> None:
    digest = image.rsplit("@", 1)[1]
    cosign.sign(image, key)
    cosign.attest(image, key, "smoke", {"digest": digest, "status": "passed"}, tmp)


def trust_file(tmp: Path, repository: str) -> Path:
    path = tmp / "trust.yaml"
    path.write_text(f"schema: 1\nmode: enforce\nkeys:\n  - name: local\n    path: {COSIGN_PUB}\n"
                    f"images:\n  - \"{repository.split('/', 1)[0]}/imagebuild-platform-trust/**\"\n"
                    f"  - \"{REGION}/imagebuild-platform-trust/**\"\n"
                    "require:\n  attestations: [smoke]\n  smoke_passed: true\n")
    return path


def verify(trust: Path, *images: str) -> tuple[int, str]:
    run = imagebuild("verify", "--trust", str(trust), *images, timeout=300)
    return run.returncode, run.stdout + run.stderr


@pytest.fixture(scope="module")
def release(repository: str, cosign_cli: Cosign, our_key: KeyPair,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fully signed two-platform index: its digest under "index", each child's under its platform."""
    tmp = tmp_path_factory.mktemp("release")
    children = child_images(tmp, repository)
    for digest in children.values():
        attest_child(cosign_cli, our_key, f"{repository}@{digest}", tmp)
    host, path = host_path(repository)
    with Registry(host) as registry:
        index = push_index(registry, path, children)
    cosign_cli.sign(f"{repository}@{index}", our_key)
    cosign_cli.attest(f"{repository}@{index}", our_key, RELEASE_TYPE, index_record(index, children), tmp)
    return {"index": index, **children}


def index_record(index: str, children: dict[str, str], *, smoke: str = "passed") -> dict[str, object]:
    """An index's release record in the shape `imagebuild sign` writes (the fields the policies read)."""
    return {"digest": index, "variant": "cpu", "issued_at": "2026-12-01T00:00:00Z",
            "platforms": [{"platform": p, "digest": d, "smoke": smoke, "gate": "passed"} for p, d in children.items()]}


def test_a_fully_signed_index_and_each_child_verify(repository: str, release: dict[str, str], tmp_path: Path):
    trust = trust_file(tmp_path, repository)
    code, output = verify(trust, f"{repository}@{release['index']}")
    assert code == 0, output
    assert "index of 2 platforms, each verified (linux/amd64, linux/arm64)" in output
    code, output = verify(trust, *(f"{repository}@{release[p]}" for p in ("linux/amd64", "linux/arm64")))
    assert code == 0, output


def test_an_index_with_one_unsigned_child_is_refused_naming_its_platform(
        repository: str, cosign_cli: Cosign, our_key: KeyPair, tmp_path: Path):
    children = child_images(tmp_path, repository)
    attest_child(cosign_cli, our_key, f"{repository}@{children['linux/amd64']}", tmp_path)
    host, path = host_path(repository)
    with Registry(host) as registry:
        index = push_index(registry, path, children)
    cosign_cli.sign(f"{repository}@{index}", our_key)
    code, output = verify(trust_file(tmp_path, repository), f"{repository}@{index}")
    assert code == 1, output
    assert f"1 of 2 platforms refused: linux/arm64 {children['linux/arm64']}: refused: not signed" in output


def test_a_child_whose_config_contradicts_its_entry_is_refused(
        repository: str, cosign_cli: Cosign, our_key: KeyPair, tmp_path: Path):
    """An amd64 image listed as linux/arm64 (push_index would refuse it: written by hand), every part signed."""
    amd64 = platform_image(tmp_path, repository, "linux/amd64")
    attest_child(cosign_cli, our_key, f"{repository}@{amd64}", tmp_path)
    host, path = host_path(repository)
    with Registry(host) as registry:
        size = len(registry.get_manifest(path, amd64)[0])
        raw = index_document([Child("linux/arm64", amd64, OCI_MANIFEST, size)])
        index = registry.put_manifest(path, "sha256:" + hashlib.sha256(raw).hexdigest(), raw,
                                      "application/vnd.oci.image.index.v1+json")
    cosign_cli.sign(f"{repository}@{index}", our_key)
    code, output = verify(trust_file(tmp_path, repository), f"{repository}@{index}")
    assert code == 1, output
    assert f"linux/arm64 {amd64}: refused:" in output and "is a linux/amd64 image, not linux/arm64" in output


def test_promote_copies_the_whole_index_and_cosign_verifies_each_child_in_the_target(
        repository: str, release: dict[str, str], cosign_cli: Cosign, tmp_path: Path):
    target = f"{REGION}/{repository.split('/', 1)[1]}"
    run = imagebuild("promote", f"{repository}@{release['index']}", target, "--tag", "3.2.2",
                     "--key", str(COSIGN_PUB), "--workdir", str(tmp_path), "--format", "json", timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for digest in release.values():
        assert cosign_cli.verified(f"{target}@{digest}", COSIGN_PUB)
    code, output = verify(trust_file(tmp_path, repository), f"{target}:3.2.2")
    assert code == 0 and "index of 2 platforms" in output, output
    again = imagebuild("promote", f"{repository}@{release['index']}", target, "--tag", "3.2.2",
                       "--key", str(COSIGN_PUB), "--workdir", str(tmp_path), "--format", "json", timeout=600)
    assert again.returncode == 0 and '"unchanged"' in again.stdout, again.stdout[-3000:]


def test_the_generated_cluster_image_policy_admits_the_index_digest_and_each_child_digest(
        repository: str, release: dict[str, str], policy_tester: str, tmp_path: Path):  # noqa: F811
    """policy-controller verifies the digest a Pod names: the index by its signature and release record,
    a child by its signature and its own attestations. An index without its record is refused."""
    policy = generate(trust_file(tmp_path, repository), tmp_path / "admission")
    for digest in release.values():
        decision = evaluate(policy_tester, policy, f"{repository}@{digest}")
        assert decision.admitted, decision.output[-2000:]


@pytest.mark.parametrize("record", ["none", "no_platforms", "a_failed_platform"])
def test_the_generated_cluster_image_policy_refuses_an_index_without_a_record_of_passed_children(
        repository: str, cosign_cli: Cosign, our_key: KeyPair, policy_tester: str,  # noqa: F811
        tmp_path: Path, record: str):
    """A signed index is admitted only on its own release record naming each platform as passed: none at
    all, a child's kind of record (no platforms) or one naming a failed smoke run is refused."""
    children = child_images(tmp_path, repository)
    for digest in children.values():
        attest_child(cosign_cli, our_key, f"{repository}@{digest}", tmp_path)
    host, path = host_path(repository)
    with Registry(host) as registry:
        index = push_index(registry, path, children)
    cosign_cli.sign(f"{repository}@{index}", our_key)
    if record == "no_platforms":
        cosign_cli.attest(f"{repository}@{index}", our_key, RELEASE_TYPE,
                          {"digest": index, "variant": "cpu", "issued_at": "2026-12-01T00:00:00Z"}, tmp_path)
    elif record == "a_failed_platform":
        cosign_cli.attest(f"{repository}@{index}", our_key, RELEASE_TYPE,
                          index_record(index, children, smoke="failed"), tmp_path)
    policy = generate(trust_file(tmp_path, repository), tmp_path / "admission")
    decision = evaluate(policy_tester, policy, f"{repository}@{index}")
    assert not decision.admitted, decision.output[-2000:]
