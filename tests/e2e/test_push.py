"""`imagebuild push` and `imagebuild promote` end to end, against real registries.

The example images, smoke-tested, gated and signed once per session (`signed_example`), are
pushed to a release repository on the staging registry and promoted to a second registry.
What lands in the target is checked by tools independent of imagebuild: `cosign verify` and
`skopeo inspect` must agree on the digest and the signature; bytes are counted by a proxy
between imagebuild and the registry and by the registry's own storage.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .conftest import COSIGN_PUB, STAGING, Run, imagebuild, unique
from .oci_servers import Fault, FlakyProxy, TokenIssuer, htpasswd, run, start_distribution
from .tools import Cosign, push_tiny_image, skopeo_digest

REGION = "127.0.0.1:5001"
ROBOT = "robot$imagebuild+ci"  # Harbor's robot naming: `$` and `+` must survive the docker config
COSIGN_CANARY = f"canary-cosign-{uuid.uuid4().hex}"  # in the environment of every push: it must never show up


# --- helpers ------------------------------------------------------------------------------------------


def push(workdir: Path, to: str, *args: str, env: dict | None = None) -> Run:
    return imagebuild("push", "--workdir", str(workdir), "--to", to, "--key", str(COSIGN_PUB), "--format", "json",
                      *args, env={"COSIGN_PASSWORD": COSIGN_CANARY, **(env or {})}, timeout=1800)


def promote(source: str, target: str, workdir: Path, *args: str, env: dict | None = None) -> Run:
    return imagebuild("promote", source, target, "--key", str(COSIGN_PUB), "--workdir", str(workdir),
                      "--format", "json", *args, env={"COSIGN_PASSWORD": COSIGN_CANARY, **(env or {})}, timeout=1800)


def pushed(result: Run) -> dict[str, dict]:
    assert result.returncode == 0, f"push failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return {row["id"]: row for row in result.json()["variants"]}


def no_secret(*texts: str, secrets: tuple[str, ...] = ()) -> None:
    for secret in (COSIGN_CANARY, *secrets):
        for text in texts:
            assert secret not in text


@pytest.fixture(scope="module", autouse=True)
def own_blob_location_cache(tmp_path_factory):
    """An empty blob-location cache (oci_locations) for this module: mounts come only from what these tests
    copied, so the bytes counted depend on nothing another run left behind."""
    before = os.environ.get("IMAGEBUILD_CACHE_DIR")
    os.environ["IMAGEBUILD_CACHE_DIR"] = str(tmp_path_factory.mktemp("push-cache"))
    yield
    if before is None:
        os.environ.pop("IMAGEBUILD_CACHE_DIR", None)
    else:
        os.environ["IMAGEBUILD_CACHE_DIR"] = before


def cosign_verified_digest(cosign_cli: Cosign, ref: str, env: dict | None = None) -> str:
    """The digest the signature names, as cosign itself verifies it with the bootstrap key."""
    [claim] = {c["critical"]["image"]["docker-manifest-digest"] for c in cosign_cli.verified(ref, COSIGN_PUB, env=env)}
    return claim


def tag_digest(host: str, repository: str, tag: str) -> str | None:
    response = httpx.head(f"http://{host}/v2/{repository}/manifests/{tag}", timeout=30, headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"})
    return response.headers.get("docker-content-digest") if response.status_code == 200 else None


def storage_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in (directory / "storage").rglob("*") if p.is_file())


class CountingProxy(FlakyProxy):
    """A pass-through (or faulty) proxy that counts the blob bytes sent to the registry's upload endpoints."""

    def __init__(self, upstream: str, faults: list[Fault] | None = None):
        self.blob_bytes = 0
        self.writes: list[str] = []
        super().__init__(upstream, faults)

    def _handle(self, handler) -> None:
        if handler.command in ("POST", "PUT", "PATCH", "DELETE"):
            self.writes.append(f"{handler.command} {handler.path.split('?')[0]}")
            if "/blobs/uploads/" in handler.path:
                self.blob_bytes += int(handler.headers.get("Content-Length") or 0)
        super()._handle(handler)


def docker_config(directory: Path, host: str, username: str, password: str) -> dict[str, str]:
    """A Docker config file holding the credentials (as `docker login` writes it): DOCKER_CONFIG for imagebuild."""
    directory.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{username}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return {"DOCKER_CONFIG": str(directory)}


def cpu_variant(report: dict) -> dict:
    return next(v for v in report["variants"] if v["device"] == "cpu" and v["paddle"] == "3.3.1")


# --- the release push, shared by the tests that read it ------------------------------------------------


@dataclass
class Release:
    workdir: Path
    to: str  # 127.0.0.1:5000/imagebuild-release-<unique>
    repository: str  # its path on the registry, with the image name
    result: Run

    @property
    def report(self) -> dict:
        return json.loads((self.workdir / "build-report.json").read_text())


@pytest.fixture(scope="module")
def release(signed_example, tmp_path_factory) -> Release:
    workdir = tmp_path_factory.mktemp("push") / "work"
    signed_example.copy(workdir)
    project = unique("imagebuild-release")
    to = f"{STAGING}/{project}"
    return Release(workdir, to, f"{project}/paddle", push(workdir, to))


def test_push_tags_each_signed_image_in_its_release_repository_after_auditing_it_there(release, tools, cosign_cli):
    rows = pushed(release.result)
    report = release.report
    assert set(rows) == {v["id"] for v in report["variants"]}
    for variant in report["variants"]:
        row, record = rows[variant["id"]], variant["stages"]["push"]
        assert row["action"] == "pushed" and record["status"] == "passed"
        assert record["target"] == f"{release.to}/paddle" and record["digest"] == variant["digest"]
        assert record["tags"] == record["tags_written"] == variant["tags"]
        assert record["audit"]["passed"] and record["audit"]["digest"] == variant["digest"]
        signed_kinds = sorted(a["type"] for a in variant["stages"]["sign"]["attestations"])
        # An index carries its provenance and release record; its children carry the per-kind ones.
        own = {"provenance", "release"} if len(variant["platforms"]) > 1 else {"gate", "sbom", "smoke", "vuln"}
        assert own <= set(signed_kinds)
        if len(variant["platforms"]) > 1:  # the audit of an index names its own kinds and its children's
            assert set(signed_kinds) <= set(record["audit"]["attestations"])
        else:
            assert record["audit"]["attestations"] == signed_kinds
        assert record["audited_at"]
        # Same registry: blobs are mounted from staging (or already there, shared with the other variant), none uploaded.
        assert record["bytes_uploaded"] == 0 and record["blobs_uploaded"] == 0
        assert record["blobs_reused"] >= record["blobs_mounted"] > 0
        assert {t.rsplit(".", 1)[1] for t in record["signature_tags"]} == {"sig", "att"}
        for tag in variant["tags"]:
            ref = f"{release.to}/paddle:{tag}"
            assert skopeo_digest(tools["skopeo"], ref) == cosign_verified_digest(cosign_cli, ref) == variant["digest"]
    no_secret(release.result.stdout, release.result.stderr, json.dumps(report))
    assert not (release.workdir / "audit.jsonl").exists()


def test_a_rerun_copies_nothing_and_writes_no_tag(release):
    again = push(release.workdir, release.to)
    for row in pushed(again).values():
        assert row["action"] == "unchanged"
        assert row["tags_written"] == [] and row["bytes_uploaded"] == 0 and row["blobs_uploaded"] == 0
        assert row["audit"]["passed"]


def image_blobs(tools, ref: str) -> dict[str, int]:
    """The image's config and layers (digest -> size), as skopeo reads its manifest; an index's are
    its children's (its children's manifests are no blobs)."""
    manifest = json.loads(run([tools["skopeo"], "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"]).stdout)
    if "manifests" in manifest:
        repository = ref.split("@", 1)[0]
        return {d: size for child in manifest["manifests"]
                for d, size in image_blobs(tools, f"{repository}@{child['digest']}").items()}
    return {d["digest"]: d["size"] for d in [manifest["config"], *manifest["layers"]]}


def blob_present(host: str, repository: str, digest: str) -> bool:
    return httpx.head(f"http://{host}/v2/{repository}/blobs/{digest}", timeout=30).status_code == 200


def test_the_release_promoted_to_a_second_registry_verifies_there_with_cosign_and_skopeo(
        release, tools, cosign_cli, tmp_path):
    target = f"{REGION}/{release.repository}"
    for variant in release.report["variants"]:
        [tag] = variant["tags"]
        blobs = image_blobs(tools, variant["image"])
        lacking = {d: size for d, size in blobs.items() if not blob_present(REGION, release.repository, d)}
        result = promote(f"{release.to}/paddle:{tag}", target, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        moved = result.json()
        assert moved["action"] == "pushed" and moved["tags_written"] == [tag]
        assert moved["digest"] == variant["digest"] and moved["audit"]["passed"]
        # Every blob the target lacked went (the signature's and attestations' blobs too, hence at least);
        # the ones it held (shared with the variant promoted before) did not.
        # This module's blob-location cache knows no repository of that registry: nothing could be mounted.
        assert moved["blobs_mounted"] == 0
        assert moved["blobs_uploaded"] >= len(lacking) and moved["bytes_uploaded"] >= sum(lacking.values()) > 0
        assert moved["blobs_present"] >= len(blobs) - len(lacking)
        ref = f"{target}:{tag}"
        assert skopeo_digest(tools["skopeo"], ref) == cosign_verified_digest(cosign_cli, ref) == variant["digest"]
        no_secret(result.stdout, result.stderr)


# --- refusals -------------------------------------------------------------------------------------------


def test_push_refuses_a_variant_the_report_does_not_show_signed(signed_example, tmp_path):
    report_path = signed_example.copy(tmp_path / "work")
    data = json.loads(report_path.read_text())
    unsigned = cpu_variant(data)
    del unsigned["stages"]["sign"]
    report_path.write_text(json.dumps(data))
    to = f"{STAGING}/{unique('imagebuild-release')}"
    result = push(tmp_path / "work", to, "--only", "paddle=3.3.1")
    assert result.returncode == 1
    [row] = result.json()["variants"]
    assert row["action"] == "refused" and "not signed" in row["reason"]
    assert cpu_variant(json.loads(report_path.read_text()))["stages"]["push"]["status"] == "refused"
    assert tag_digest(STAGING, f"{to.split('/', 1)[1]}/paddle", unsigned["tags"][0]) is None


def test_push_verifies_the_signature_in_the_source_because_a_report_can_lie(signed_example, tmp_path):
    """A report edited to name an unsigned image, with every stage claiming it passed for it, is refused."""
    repository = f"{unique('e2e-push-unsigned')}/paddle"
    digest = push_tiny_image(tmp_path, f"{STAGING}/{repository}:unsigned")
    report_path = signed_example.copy(tmp_path / "work")
    data = json.loads(report_path.read_text())
    variant = cpu_variant(data)
    variant["digest"], variant["image"] = digest, f"{STAGING}/{repository}@{digest}"
    for stage in ("smoke", "gate", "sign"):
        variant["stages"][stage]["digest"] = digest
    report_path.write_text(json.dumps(data))
    to = f"{STAGING}/{unique('imagebuild-release')}"
    result = push(tmp_path / "work", to, "--only", "paddle=3.3.1")
    assert result.returncode == 1
    [row] = result.json()["variants"]
    assert row["action"] == "refused" and "the source does not verify: not signed" in row["reason"]
    assert tag_digest(STAGING, f"{to.split('/', 1)[1]}/paddle", variant["tags"][0]) is None
    assert httpx.head(f"http://{STAGING}/v2/{to.split('/', 1)[1]}/paddle/manifests/{digest}").status_code == 404


def test_a_release_tag_is_immutable_unless_forced_with_a_reason_which_is_audit_logged(signed_example, tools, tmp_path):
    workdir = tmp_path / "work"
    signed_example.copy(workdir)
    report = json.loads((workdir / "build-report.json").read_text())
    cpu, gpu = cpu_variant(report), next(v for v in report["variants"] if v["device"] != "cpu")
    [tag] = cpu["tags"]
    project = unique("imagebuild-release")
    repository = f"{project}/paddle"
    # The release tag already names another image (the GPU one, copied there by crane).
    run([tools["crane"], "copy", "--insecure", gpu["image"], f"{STAGING}/{repository}:{tag}"], timeout=600)
    assert tag_digest(STAGING, repository, tag) == gpu["digest"]

    refused = push(workdir, f"{STAGING}/{project}", "--only", "paddle=3.3.1")
    assert refused.returncode == 1
    [row] = refused.json()["variants"]
    assert row["action"] == "refused" and "immutable" in row["reason"] and row["tags_refused"] == [tag]
    assert tag_digest(STAGING, repository, tag) == gpu["digest"]
    assert not (workdir / "audit.jsonl").exists()

    ci = {"GITHUB_ACTOR": "release-bot", "GITHUB_RUN_ID": "4242", "GITHUB_REPOSITORY": "org/images"}
    forced = push(workdir, f"{STAGING}/{project}", "--only", "paddle=3.3.1", "--force", "--reason",
                  "wrong image tagged by hand", env=ci)
    [row] = pushed(forced).values()
    assert row["tags_moved"] == [{"tag": tag, "from": gpu["digest"], "to": cpu["digest"],
                                  "reason": "wrong image tagged by hand"}]
    assert tag_digest(STAGING, repository, tag) == cpu["digest"]
    [entry] = [json.loads(line) for line in (workdir / "audit.jsonl").read_text().splitlines()]
    assert entry["from_digest"] == gpu["digest"] and entry["to_digest"] == cpu["digest"]
    assert entry["tag"] == tag and entry["repository"] == f"{STAGING}/{repository}"
    assert entry["reason"] == "wrong image tagged by hand" and entry["at"]
    assert entry["who"]["ci"] == ci and entry["who"]["user"]
    no_secret((workdir / "audit.jsonl").read_text(), forced.stdout, forced.stderr)


def test_force_without_a_reason_is_bad_input(signed_example, tmp_path):
    result = imagebuild("push", "--workdir", str(signed_example.workdir), "--to", f"{STAGING}/x", "--key",
                        str(COSIGN_PUB), "--force")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --force: needs --reason TEXT (it goes into the audit log)"


# --- a private registry: bytes counted, faults injected --------------------------------------------------


@pytest.fixture(scope="module")
def private_registry(tmp_path_factory):
    directory = tmp_path_factory.mktemp("push-private-registry")
    registry = start_distribution(directory)
    yield registry.host, directory
    registry.stop()


def test_promoting_what_the_target_already_holds_uploads_no_blob_bytes(release, private_registry, tmp_path):
    host, directory = private_registry
    proxy = CountingProxy(host)
    try:
        cpu = cpu_variant(release.report)
        [tag] = cpu["tags"]
        source = f"{release.to}/paddle:{tag}"
        first = promote(source, f"{proxy.host}/counted/a/paddle", tmp_path)
        assert first.returncode == 0, first.stderr[-2000:]
        assert first.json()["bytes_uploaded"] == proxy.blob_bytes > 0

        # The same image again, under another tag: its manifest and blobs are there.
        before_bytes, before_storage = proxy.blob_bytes, storage_bytes(directory)
        again = promote(source, f"{proxy.host}/counted/a/paddle", tmp_path, "--tag", "again")
        assert again.returncode == 0, again.stderr[-2000:]
        assert again.json()["bytes_uploaded"] == 0 and again.json()["tags_written"] == ["again"]
        assert proxy.blob_bytes == before_bytes

        # To another repository of that registry: mounted, not uploaded.
        mounted = promote(f"{proxy.host}/counted/a/paddle:{tag}", f"{proxy.host}/counted/b/paddle", tmp_path)
        assert mounted.returncode == 0, mounted.stderr[-2000:]
        moved = mounted.json()
        assert moved["bytes_uploaded"] == 0 and moved["blobs_uploaded"] == 0 and moved["blobs_mounted"] > 0
        assert proxy.blob_bytes == before_bytes
        # What the registry stores grew by manifests, links and tags only, not by a blob (the smallest is > 1 KiB).
        assert storage_bytes(directory) - before_storage < 64 * 1024
    finally:
        proxy.stop()


def test_promoting_under_another_image_name_writes_no_tag_there(release, private_registry, tmp_path):
    """The signature names the image it was made for: a copy under another name would not verify
    there, so the audit refuses it before any tag is written (README: threat model, T2)."""
    host, _ = private_registry
    cpu = cpu_variant(release.report)
    [tag] = cpu["tags"]
    failed = promote(f"{release.to}/paddle:{tag}", f"{host}/renamed/debug-tools", tmp_path)
    assert failed.returncode == 1
    row = failed.json()
    assert row["tags_written"] == [] and "the signature is for repository" in row["reason"], row
    assert tag_digest(host, "renamed/debug-tools", tag) is None


def test_an_audit_failing_in_the_target_writes_no_tag_and_a_rerun_finishes(release, private_registry, tmp_path):
    """A target that accepts the signature and drops it: the audit finds no signature, so no tag is written."""
    host, _ = private_registry
    lying = CountingProxy(host, [Fault("PUT", r"/manifests/sha256-[0-9a-f]{64}\.sig$", "status", times=100,
                                       status=201)])
    try:
        cpu = cpu_variant(release.report)
        [tag] = cpu["tags"]
        target = f"{lying.host}/audited/paddle"
        failed = promote(f"{release.to}/paddle:{tag}", target, tmp_path)
        assert failed.returncode == 1
        row = failed.json()
        assert row["action"] == "failed" and row["tags_written"] == []
        assert "the audit in the target failed" in row["reason"] and "not signed" in row["reason"]
        assert tag_digest(host, "audited/paddle", tag) is None  # no tag on the unaudited copy
        assert tag_digest(host, "audited/paddle", cpu["digest"]) == cpu["digest"]  # the copy itself is there
    finally:
        lying.stop()
    rerun = promote(f"{release.to}/paddle:{tag}", f"{host}/audited/paddle", tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert rerun.json()["tags_written"] == [tag] and rerun.json()["bytes_uploaded"] == 0
    assert tag_digest(host, "audited/paddle", tag) == cpu["digest"]


# --- authenticated registries, credentials from a Docker config file ------------------------------------


@pytest.fixture(scope="module")
def robot_password() -> str:
    return f"canary-robot-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def basic_auth_registry(tmp_path_factory, robot_password):
    directory = tmp_path_factory.mktemp("push-basic-registry")
    users = htpasswd(directory / "htpasswd", {ROBOT: robot_password})
    registry = start_distribution(directory, auth={"htpasswd": {"realm": "imagebuild-test", "path": str(users)}})
    yield registry.host
    registry.stop()


@pytest.fixture(scope="module")
def token_auth_registry(tmp_path_factory, robot_password):
    issuer = TokenIssuer(tmp_path_factory.mktemp("push-token-issuer"), {ROBOT: (robot_password, ("pull", "push"))})
    registry = start_distribution(tmp_path_factory.mktemp("push-token-registry"), auth=issuer.registry_auth())
    yield registry.host
    registry.stop()
    issuer.stop()


@pytest.mark.parametrize("kind", ["htpasswd", "token"])
def test_push_to_an_authenticated_registry_with_credentials_from_the_docker_config(
        kind, release, request, robot_password, tools, cosign_cli, tmp_path):
    host = request.getfixturevalue("basic_auth_registry" if kind == "htpasswd" else "token_auth_registry")
    cpu = cpu_variant(release.report)
    workdir = tmp_path / "work"
    import shutil

    shutil.copytree(release.workdir, workdir)

    wrong = push(workdir, f"{host}/release", "--only", "paddle=3.3.1",
                 env=docker_config(tmp_path / "wrong", host, ROBOT, "not-the-password-canary"))
    assert wrong.returncode == 3
    [line] = wrong.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: ") and host in line
    no_secret(wrong.stdout, wrong.stderr, secrets=("not-the-password-canary", robot_password))

    env = docker_config(tmp_path / "right", host, ROBOT, robot_password)
    right = push(workdir, f"{host}/release", "--only", "paddle=3.3.1", env=env)
    [row] = pushed(right).values()
    assert row["action"] == "pushed" and row["bytes_uploaded"] > 0 and row["audit"]["passed"]
    [tag] = cpu["tags"]
    creds = {"REGISTRY_AUTH_FILE": str(tmp_path / "right" / "config.json"), **env}
    assert skopeo_digest(tools["skopeo"], f"{host}/release/paddle:{tag}", env=creds) == cpu["digest"]
    assert cosign_verified_digest(cosign_cli, f"{host}/release/paddle:{tag}", env=creds) == cpu["digest"]
    no_secret(right.stdout, right.stderr, (workdir / "build-report.json").read_text(), secrets=(robot_password,))


# --- Harbor: the project and its immutable rule first, the scan overview after ---------------------------


def test_push_with_harbor_ensures_the_project_and_reports_the_scan_overview(release, tmp_path):
    from tests.harbor_standin import HarborSpec, HarborStandIn

    password = f"canary-harbor-{uuid.uuid4().hex}"
    standin = HarborStandIn(HarborSpec(), users={"admin": password}).start()
    try:
        project = unique("imagebuild-harbor")
        workdir = tmp_path / "work"
        import shutil

        shutil.copytree(release.workdir, workdir)
        env = {"HARBOR_USERNAME": "admin", "HARBOR_PASSWORD": password}
        first = push(workdir, f"{STAGING}/{project}", "--only", "paddle=3.3.1", "--harbor-url", standin.url, env=env)
        assert first.returncode == 0, first.stderr[-2000:]
        body = first.json()
        assert body["harbor"]["project"]["action"] == "created"
        assert [r["action"] for r in body["harbor"]["immutable_rules"]] == ["created"]
        assert standin.project(project) is not None
        [row] = body["variants"]
        [tag] = row["tags"]
        assert standin.is_immutable(project, "paddle", tag)
        assert not standin.is_immutable(project, "paddle", f"sha256-{'a' * 64}.sig")
        assert row["harbor"]["status"] == "not found"  # this stand-in is no registry: Harbor never saw the push

        # Harbor has scanned the artifact since: a rerun pushes nothing and reports the overview.
        scanned = {"report_id": "r1", "scan_status": "Success", "severity": "High", "duration": 12,
                   "summary": {"total": 3, "fixable": 2, "summary": {"High": 1, "Medium": 2}},
                   "start_time": "2026-12-01T10:00:00Z", "end_time": "2026-12-01T10:00:12Z", "complete_percent": 100,
                   "scanner": {"name": "Trivy", "vendor": "Aqua Security", "version": "v0.50.1"}}
        standin.add_artifact(project, "paddle", row["digest"], tags=(tag,), scan=scanned)
        again = push(workdir, f"{STAGING}/{project}", "--only", "paddle=3.3.1", "--harbor-url", standin.url, env=env)
        assert again.returncode == 0, again.stderr[-2000:]
        [row] = again.json()["variants"]
        assert row["action"] == "unchanged"
        assert row["harbor"]["status"] == "Success" and row["harbor"]["severity"] == "High"
        assert row["harbor"]["total"] == 3
        report = json.loads((workdir / "build-report.json").read_text())
        assert cpu_variant(report)["stages"]["push"]["harbor"]["status"] == "Success"
        assert standin.violations == []
        no_secret(first.stdout, first.stderr, again.stdout, again.stderr, json.dumps(report), secrets=(password,))
    finally:
        standin.stop()


# --- faults between imagebuild and the target -------------------------------------------------------------


def test_promote_through_500s_429s_resets_and_cut_answers_retries_and_succeeds(release, private_registry, tmp_path):
    host, _ = private_registry
    faults = [Fault("POST", r"/blobs/uploads/$", "status", times=2, status=503),
              Fault("PATCH", r"/blobs/uploads/", "status", times=1, status=429, retry_after="1"),
              Fault("PUT", r"/blobs/uploads/", "forward-drop", times=1),
              Fault("HEAD", r"/blobs/sha256:", "drop", times=2),
              Fault("PUT", r"/manifests/sha256-[0-9a-f]{64}\.sig$", "status", times=1, status=500),
              Fault("GET", r"/manifests/sha256-[0-9a-f]{64}\.att$", "cut", times=1)]
    proxy = CountingProxy(host, faults)
    try:
        cpu = cpu_variant(release.report)
        [tag] = cpu["tags"]
        result = promote(f"{release.to}/paddle:{tag}", f"{proxy.host}/faults/paddle", tmp_path)
        assert result.returncode == 0, (result.stdout[-3000:], proxy.log[-30:])
        assert result.json()["audit"]["passed"] and result.json()["tags_written"] == [tag]
        assert all(f.served == f.times for f in faults), [(f.method, f.path, f.served) for f in faults]
    finally:
        proxy.stop()
    assert tag_digest(host, "faults/paddle", tag) == cpu["digest"]


def test_a_target_that_keeps_failing_fails_cleanly_and_leaves_no_release_tag(release, private_registry, tmp_path):
    host, _ = private_registry
    cpu = cpu_variant(release.report)
    [tag] = cpu["tags"]
    broken = CountingProxy(host, [Fault("PUT", rf"/manifests/{tag}$", "status", times=1000, status=500)])
    try:
        result = promote(f"{release.to}/paddle:{tag}", f"{broken.host}/failing/paddle", tmp_path)
    finally:
        broken.stop()
    assert result.returncode == 3
    [line] = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: registry: ") and "500" in line
    assert tag_digest(host, "failing/paddle", tag) is None
    rerun = promote(f"{release.to}/paddle:{tag}", f"{host}/failing/paddle", tmp_path)
    assert rerun.returncode == 0 and rerun.json()["tags_written"] == [tag]
    assert tag_digest(host, "failing/paddle", tag) == cpu["digest"]


def test_a_push_stopped_mid_copy_leaves_no_tag_and_the_rerun_finishes(release, private_registry, tmp_path):
    import shutil
    import signal
    import sys
    import time

    host, _ = private_registry
    proxy = CountingProxy(host)
    workdir = tmp_path / "work"
    shutil.copytree(release.workdir, workdir)
    cpu = cpu_variant(release.report)
    [tag] = cpu["tags"]
    argv = [sys.executable, "-m", "imagebuild", "push", "--workdir", str(workdir), "--to", f"{proxy.host}/stopped",
            "--key", str(COSIGN_PUB), "--only", "paddle=3.3.1"]
    try:
        process = subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not any("/blobs/uploads/" in w for w in proxy.writes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, "the push ended before its copy started"
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 143, stderr
    finally:
        proxy.stop()
    assert tag_digest(host, "stopped/paddle", tag) is None
    record = cpu_variant(json.loads((workdir / "build-report.json").read_text()))["stages"]["push"]
    assert record["status"] == "interrupted"
    rerun = push(workdir, f"{host}/stopped", "--only", "paddle=3.3.1")
    [row] = pushed(rerun).values()
    assert row["action"] == "pushed" and row["tags_written"] == [tag] and row["audit"]["passed"]
    assert tag_digest(host, "stopped/paddle", tag) == cpu["digest"]
