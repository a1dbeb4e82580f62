"""The webhook's own image, built by `imagebuild admission image` from this checkout into a repository of
this session's own, then checked from outside as a cluster would run it.

Real Docker, registry, Trivy (the fixture DB) and cosign. The build hands the session's canary CA
bundle to the build as its `ca-bundle` secret; BuildKit's cache may serve the download steps from an
earlier build on this machine, in which case that build's host bundle is the one to look for, so the
needles are the canary's marker and every certificate only this host trusts.
"""
from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import httpx
import pytest
import yaml

from .conftest import EXAMPLE_POLICY, STAGING, Run, imagebuild, trivy_cache_with_db
from .layers import pem_blocks, scan_image

UID = 65532


@dataclass
class Built:
    workdir: Path
    trust: Path
    repository: str
    first: Run
    first_s: float
    second: Run
    second_s: float

    @property
    def report(self) -> dict:
        return json.loads((self.workdir / "build-report.json").read_text())

    @property
    def variant(self) -> dict:
        (variant,) = self.report["variants"]
        return variant

    @property
    def image(self) -> str:
        return self.variant["image"]


def webhook_trust(folder: Path, public: Path, image: str) -> Path:
    path = folder / "trust.yaml"
    path.write_text(yaml.safe_dump({
        "schema": 1, "mode": "enforce", "keys": [{"name": "imagebuild-local", "path": str(public)}],
        "images": [f"{STAGING}/admission-image-e2e/**"],
        "require": {"attestations": ["sbom", "vuln", "smoke", "gate"], "smoke_passed": True, "gate_passed": True,
                    "block_severity": "CRITICAL"},
        "webhook": {"image": image}}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def built(engine, staging_registry, trivy_db, cosign_keys, secret_canary, tmp_path_factory) -> Built:
    folder = tmp_path_factory.mktemp("admission-image")
    repository = f"{STAGING}/admission-image-e2e/{uuid.uuid4().hex[:10]}"
    trust = webhook_trust(folder, cosign_keys["pub"], f"{repository}:e2e")
    cache = trivy_cache_with_db(trivy_db, folder / "trivy")
    workdir = folder / "work"
    args = ("admission", "image", "--trust", str(trust), "--workdir", str(workdir), "--policy", str(EXAMPLE_POLICY),
            "--offline", "--cache-dir", str(cache), "--key", str(cosign_keys["key"]),
            "--secret", f"ca-bundle={secret_canary['bundle']}", "--format", "json")
    env = {"COSIGN_PASSWORD": cosign_keys["password"]}
    started = time.monotonic()
    first = imagebuild(*args, env=env, timeout=1800)
    first_s = time.monotonic() - started
    assert first.returncode == 0, f"admission image failed:\n{first.stdout[-3000:]}\n{first.stderr[-3000:]}"
    started = time.monotonic()
    second = imagebuild(*args, env=env, timeout=600)
    second_s = time.monotonic() - started
    assert second.returncode == 0, f"admission image (again) failed:\n{second.stdout[-3000:]}\n{second.stderr[-3000:]}"
    return Built(workdir, trust, repository, first, first_s, second, second_s)


def test_it_went_through_every_stage_on_its_digest(built):
    summary = built.first.json()
    (result,) = summary["variants"]
    assert result["status"] == "released", result
    assert {name: cell["outcome"] for name, cell in result["stages"].items()} == {
        "build": result["stages"]["build"]["outcome"], "smoke": "done", "scan": "done", "gate": "done",
        "sign": "done", "push": "off"}
    variant = built.variant
    digest = variant["digest"]
    assert variant["image"] == f"{built.repository}@{digest}" and variant["images"] == [f"{built.repository}:e2e"]
    for stage in ("smoke", "scan", "gate", "sign"):
        assert variant["stages"][stage]["digest"] == digest, stage
    assert variant["stages"]["smoke"]["passed"] == 8 and variant["stages"]["smoke"]["failed"] == 0
    assert {a["type"] for a in variant["stages"]["sign"]["attestations"]} >= {"sbom", "vuln", "smoke", "gate"}
    repository = built.repository.removeprefix(f"{STAGING}/")
    head = httpx.head(f"http://{STAGING}/v2/{repository}/manifests/e2e",
                      headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=10)
    assert head.headers["Docker-Content-Digest"] == digest


def test_a_rerun_does_nothing(built):
    summary = built.second.json()
    assert summary["nothing_new"] is True
    assert summary["work"] == {"layers_built": 0, "smoke_runs": 0, "scans": 0, "gate_runs": 0, "signed": 0, "pushed": 0}
    assert summary["variants"][0]["digest"] == built.variant["digest"]
    assert built.second_s < 30


def test_it_runs_as_its_non_root_user_on_a_read_only_root_with_no_shell(engine, built):
    image = engine.images.pull(built.image.rsplit("@", 1)[0], tag=built.variant["digest"])
    config = image.attrs["Config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["/opt/venv/bin/imagebuild"]
    out = engine.containers.run(built.image, ["admission", "serve", "--help"], read_only=True, network_disabled=True,
                                cap_drop=["ALL"], security_opt=["no-new-privileges"], remove=True).decode()
    assert "--tls-cert" in out and "--trust" in out
    whoami = engine.containers.run(built.image, ["-c", "import os; print(os.getuid(), os.getgid())"],
                                   entrypoint=["/opt/venv/bin/python"], read_only=True, network_disabled=True,
                                   remove=True).decode()
    assert whoami.split() == [str(UID), str(UID)]
    for shell in ("/bin/sh", "/bin/bash", "/usr/bin/dash"):
        container = engine.containers.create(built.image, ["-c", "true"], entrypoint=[shell], network_disabled=True)
        try:
            with pytest.raises(docker.errors.APIError, match="no such file or directory"):
                container.start()
        finally:
            container.remove(force=True)


def test_it_has_no_setuid_file_and_no_secret_in_any_layer(engine, built, secret_canary):
    setuid = engine.containers.run(built.image, ["/", "-xdev", "-perm", "/6000", "-type", "f"],
                                   entrypoint=["/usr/bin/find"], user="0", read_only=True, network_disabled=True,
                                   remove=True).decode()
    assert setuid.strip() == "", f"setuid/setgid files: {setuid}"
    host_bundle = Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    public = set()
    for shipped in Path("/usr/share/ca-certificates").rglob("*.crt"):
        public |= set(pem_blocks(shipped.read_text()))
    for bundle in ("/etc/ssl/certs/ca-certificates.crt",
                   "/opt/venv/lib/python3.11/site-packages/certifi/cacert.pem"):  # Debian's and certifi's public CAs
        public |= set(pem_blocks(engine.containers.run(built.image, [bundle], entrypoint=["/usr/bin/cat"],
                                                        network_disabled=True, remove=True).decode()))
    host_only = set(pem_blocks(host_bundle)) - public
    needles = [secret_canary["marker"].encode()]
    needles += [block.splitlines()[len(block.splitlines()) // 2].encode() for block in host_only]
    findings = scan_image(engine, built.image, needles)
    assert findings.layers >= 3 and findings.files > 1000, "the image was not really read"
    assert findings.hits == {}, f"secret material in the image: {findings.hits}"
    assert not [p for p in findings.paths if p.startswith("/run/secrets/") and p != "/run/secrets/"]
    for path in built.workdir.rglob("*"):
        if path.is_file():
            assert secret_canary["marker"].encode() not in path.read_bytes(), f"{path} holds the canary"


def test_cosign_and_imagebuild_verify_accept_it_by_its_own_policy(built, cosign_cli, cosign_keys):
    claims = cosign_cli.verified(built.image, cosign_keys["pub"])
    assert {claim["critical"]["image"]["docker-manifest-digest"] for claim in claims} == {built.variant["digest"]}
    (smoke,) = cosign_cli.statements(built.image, cosign_keys["pub"], "smoke")
    assert smoke["predicate"]["status"] == "passed" and smoke["predicate"]["digest"] == built.variant["digest"]
    for ref in (built.image, f"{built.repository}:e2e"):
        run = imagebuild("verify", "--trust", str(built.trust), "--require-provenance", ref)
        assert run.returncode == 0, run.stderr
        assert f"verified: {built.variant['digest']}" in run.stdout


def test_signing_is_refused_once_the_smoke_record_no_longer_passes(built, tmp_path, cosign_keys):
    workdir = tmp_path / "work"
    shutil.copytree(built.workdir, workdir)
    report_path = workdir / "build-report.json"
    report = json.loads(report_path.read_text())
    report["variants"][0]["stages"]["smoke"]["status"] = "failed"
    report["variants"][0]["stages"]["smoke"]["reason"] = "edited by the test"
    report_path.write_text(json.dumps(report))
    run = imagebuild("sign", "--workdir", str(workdir), "--key", str(cosign_keys["key"]),
                     env={"COSIGN_PASSWORD": cosign_keys["password"]})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "smoke tests failed: edited by the test" in run.stdout + run.stderr
