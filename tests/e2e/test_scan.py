"""`imagebuild scan` and `imagebuild gate`, for real: the pinned Trivy, the example's real images
in the local registry, and a vulnerability DB built with Trivy's own Go package.

The fixture DB's advisories are real (real CVE ids, Debian's real bookworm-security fixed
versions); the example's base image is made from bookworm's main archive without the
security suite, so its packages are genuinely below those fixed versions. The first test
checks that with dpkg, so a base image that starts carrying the fixes fails loudly here
instead of quietly making the gate tests pointless.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import os
import secrets
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from imagebuild.tools import docker_cli

from .conftest import EXAMPLE, STAGING, imagebuild, scan_workdir, trivy_cache_with_db
from .trivydb import EXPAT, PIP, ZLIB, push_db_artifact

CPU_VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
GPU_VARIANT = "paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12"
TODAY = dt.datetime.now(dt.timezone.utc).date()


def image_report(workdir: Path, variant: str) -> dict:
    return json.loads((workdir / "scan" / variant / "image.json").read_text())


def installed(report: dict, package: str) -> str:
    for result in report["Results"]:
        for pkg in result.get("Packages") or []:
            if pkg["Name"] == package:
                return pkg["Version"] + (f"-{pkg['Release']}" if pkg.get("Release") else "")
    raise AssertionError(f"{package} is not in the image")


def write_policy(path: Path, exceptions: str = "", ignore_unfixed: bool = True) -> Path:
    path.write_text(f"schema: 1\nseverity: HIGH\nignore_unfixed: {str(ignore_unfixed).lower()}\n"
                    f"misconfiguration_severity: HIGH\n{exceptions}")
    return path


def expat_exception(expires: dt.date) -> str:
    return (f"exceptions:\n  - id: {EXPAT['id']}\n    packages: [{EXPAT['package']}]\n"
            f"    owner: ml-platform-security@example.com\n"
            f"    reason: No untrusted XML is parsed in these images; fixed with the next base image.\n"
            f"    expires: {expires.isoformat()}\n")


def gate(workdir: Path, policy: Path, *args: str):
    return imagebuild("gate", "--workdir", str(workdir), "--policy", str(policy), *args, timeout=300)


# --- the scan -------------------------------------------------------------------------------------------


def test_the_images_really_carry_the_vulnerable_versions(scanned_example):
    """Precondition of the gate tests, asked of dpkg itself: installed < fixed."""
    for variant in (CPU_VARIANT, GPU_VARIANT):
        version = installed(image_report(scanned_example.workdir, variant), EXPAT["package"])
        check = subprocess.run(["dpkg", "--compare-versions", version, "lt", EXPAT["fixed"]])
        assert check.returncode == 0, (f"{variant} has {EXPAT['package']} {version}, not below {EXPAT['fixed']}: "
                                       "the base image now carries the fix; pick another advisory in "
                                       "tests/fixtures/trivydb/main.go")


def test_every_image_is_scanned_by_digest_and_its_reports_lie_beside_the_build_report(scanned_example):
    report = scanned_example.report
    assert {v["id"] for v in report["variants"]} == {CPU_VARIANT, GPU_VARIANT}
    for variant in report["variants"]:
        stage = variant["stages"]["scan"]
        assert stage["status"] == "ok" and stage["digest"] == variant["digest"]
        assert stage["trivy_version"] == "0.76.0"
        trivy_json = image_report(scanned_example.workdir, variant["id"])
        assert trivy_json["SchemaVersion"] == 2
        assert trivy_json["ArtifactName"] == variant["image"]  # repository@sha256:…, never a tag
        assert "@sha256:" in variant["image"]
        for name in stage["reports"].values():
            assert (scanned_example.workdir / name).is_file(), name
    summary = scanned_example.summary
    assert summary["schema"] == "imagebuild.scan-summary/v1"
    assert summary["db"]["source"].startswith("offline")


def test_each_image_gets_a_cyclonedx_sbom_of_its_packages(scanned_example):
    for variant, paddle in ((CPU_VARIANT, "paddlepaddle"), (GPU_VARIANT, "paddlepaddle-gpu")):
        sbom = json.loads((scanned_example.workdir / "scan" / variant / "sbom.cdx.json").read_text())
        assert sbom["bomFormat"] == "CycloneDX"
        names = {c["name"] for c in sbom["components"]}
        assert {"libexpat1", "zlib1g", "pip", paddle} <= names, sorted(names)[:20]


def test_the_fixture_advisories_are_found_with_their_fixed_versions(scanned_example):
    for variant in (CPU_VARIANT, GPU_VARIANT):
        found = {(v["VulnerabilityID"], v["PkgName"]): v for r in image_report(scanned_example.workdir, variant)["Results"]
                 for v in r.get("Vulnerabilities") or []}
        assert found[(EXPAT["id"], EXPAT["package"])]["FixedVersion"] == EXPAT["fixed"]
        assert found[(PIP["id"], PIP["package"])]["FixedVersion"] == PIP["fixed"]
        assert found[(ZLIB["id"], ZLIB["package"])]["Status"] == "will_not_fix"


def test_the_rendered_dockerfiles_are_checked_per_variant(scanned_example):
    config = json.loads((scanned_example.workdir / "scan" / "config.json").read_text())
    targets = {r["Target"] for r in config["Results"]}
    for variant in scanned_example.report["variants"]:
        stage = variant["stages"]["scan"]
        assert stage["dockerfiles"][0] == "base/debian12/Dockerfile"
        assert stage["dockerfiles"][-1] == f"release/{variant['id']}/Dockerfile"
        assert set(stage["dockerfiles"]) <= targets


# --- the gate on the real scans ----------------------------------------------------------------------


def test_the_gate_blocks_the_vulnerable_images_naming_cve_package_and_fixed_version(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    run = gate(workdir, write_policy(tmp_path / "policy.yaml"))
    assert run.returncode == 1, run.stdout + run.stderr
    for variant in (CPU_VARIANT, GPU_VARIANT):
        assert f"BLOCKED  {variant}" in run.stdout
    lines = [line for line in run.stdout.splitlines() if EXPAT["id"] in line]
    assert len(lines) == 2 and all(EXPAT["package"] in line and f"fixed in {EXPAT['fixed']}" in line for line in lines)
    report = json.loads((workdir / "build-report.json").read_text())
    for variant in report["variants"]:
        assert variant["stages"]["gate"]["status"] == "failed"
        assert [b["id"] for b in variant["stages"]["gate"]["blocking"]] == [EXPAT["id"]]


def test_a_valid_exception_lets_them_pass(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    policy = write_policy(tmp_path / "policy.yaml", expat_exception(TODAY + dt.timedelta(days=30)))
    run = gate(workdir, policy)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"excepted until {(TODAY + dt.timedelta(days=30)).isoformat()}" in run.stdout
    report = json.loads((workdir / "build-report.json").read_text())
    assert {v["stages"]["gate"]["status"] for v in report["variants"]} == {"passed"}


def test_the_same_exception_once_expired_blocks_them_again(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    yesterday = TODAY - dt.timedelta(days=1)
    run = gate(workdir, write_policy(tmp_path / "policy.yaml", expat_exception(yesterday)))
    assert run.returncode == 1
    assert f"expired on {yesterday.isoformat()}" in run.stdout
    assert run.stdout.count(f"blocks  {EXPAT['id']}") == 2


def test_without_ignore_unfixed_the_unfixed_critical_blocks_too(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    policy = write_policy(tmp_path / "policy.yaml", expat_exception(TODAY + dt.timedelta(days=30)),
                          ignore_unfixed=False)
    run = gate(workdir, policy, "--format", "json")
    assert run.returncode == 1
    for image in json.loads(run.stdout)["images"]:
        assert [(b["id"], b["package"], b["fixed"]) for b in image["blocking"]] == [(ZLIB["id"], ZLIB["package"], "")]


def test_the_sarif_of_a_real_gate_names_the_cve(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    run = gate(workdir, write_policy(tmp_path / "policy.yaml"), "--format", "sarif")
    sarif = json.loads(run.stdout)
    assert sarif["version"] == "2.1.0"
    assert {r["ruleId"] for r in sarif["runs"][0]["results"]} == {EXPAT["id"]}


# --- secrets -------------------------------------------------------------------------------------------


def fake_credentials() -> tuple[str, str, str]:
    """Realistic-looking, freshly random, never real: an AWS key pair and an OpenSSH private key."""
    key_id = "AKIA" + "".join(secrets.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(16))
    secret_key = base64.b64encode(secrets.token_bytes(30)).decode()
    body = base64.b64encode(secrets.token_bytes(300)).decode()
    private_key = ("-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(body[i:i + 70] for i in range(0, len(body), 70))
                   + "\n-----END OPENSSH PRIVATE KEY-----\n")
    return key_id, secret_key, private_key


@pytest.fixture(scope="module")
def secret_image(scanned_example, tmp_path_factory) -> dict:
    """An image FROM the example's CPU image (by digest) with credentials in one more layer,
    pushed to a test-only repository; and a build report that names it for the CPU variant."""
    cpu = next(v for v in scanned_example.report["variants"] if v["id"] == CPU_VARIANT)
    context = tmp_path_factory.mktemp("secret-image")
    key_id, secret_key, private_key = fake_credentials()
    (context / "credentials").write_text(f"[default]\naws_access_key_id = {key_id}\n"
                                         f"aws_secret_access_key = {secret_key}\nregion = eu-west-1\n")
    (context / "id_ed25519").write_text(private_key)
    (context / "Dockerfile").write_text(
        f"FROM {cpu['image']}\n"
        "COPY --chown=1000:1000 credentials /home/paddle/.aws/credentials\n"
        "COPY --chown=1000:1000 id_ed25519 /home/paddle/.ssh/id_ed25519\n")
    ref = f"{STAGING}/imagebuild-e2e/secret-probe:{uuid.uuid4().hex[:12]}"
    docker = docker_cli()
    built = subprocess.run([docker, "build", "-t", ref, str(context)], capture_output=True, text=True,
                           env={**os.environ, "DOCKER_BUILDKIT": "1"}, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    pushed = subprocess.run([docker, "push", ref], capture_output=True, text=True, timeout=600)
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    digest = "sha256:" + pushed.stdout.split("digest: sha256:", 1)[1].split()[0]
    subprocess.run([docker, "rmi", ref], capture_output=True)

    workdir = tmp_path_factory.mktemp("secret-scan")
    report = scanned_example.report
    probe = dict(cpu, image=f"{ref.rsplit(':', 1)[0]}@{digest}", digest=digest, stages={})
    report["variants"] = [probe]
    (workdir / "build-report.json").write_text(json.dumps(report, indent=2))
    run = scan_workdir(workdir, scanned_example.cache_dir)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return {"workdir": workdir, "values": (key_id, secret_key, private_key.splitlines()[1]), "scan": run}


def test_a_planted_secret_is_found_and_blocks(secret_image, tmp_path):
    policy = write_policy(tmp_path / "policy.yaml", expat_exception(TODAY + dt.timedelta(days=30)))
    run = gate(secret_image["workdir"], policy, "--format", "json")
    assert run.returncode == 1
    (image,) = json.loads(run.stdout)["images"]
    blocking = {(b["id"], b["target"]) for b in image["blocking"]}
    assert blocking == {("aws-access-key-id", "/home/paddle/.aws/credentials"),
                        ("aws-secret-access-key", "/home/paddle/.aws/credentials"),
                        ("private-key", "/home/paddle/.ssh/id_ed25519")}


def test_no_report_repeats_the_secret_it_found(secret_image, tmp_path):
    gate(secret_image["workdir"], write_policy(tmp_path / "policy.yaml"))
    for path in secret_image["workdir"].rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            for value in secret_image["values"]:
                assert value not in text, f"{path} repeats a planted secret"


def test_the_secret_image_reuses_the_layers_it_shares_with_the_example(secret_image):
    layers = json.loads(secret_image["scan"].stdout)["layers"]
    assert layers["analysed"] == 2 and layers["reused"] == layers["total"] - 2  # the two COPY layers


# --- layer reuse ------------------------------------------------------------------------------------------


def test_scanning_again_reuses_every_analysed_layer_and_takes_a_fraction_of_the_time(scanned_example, tmp_path):
    first = scanned_example.summary["layers"]
    assert first["analysed"] > 0
    assert first["reused"] > 0  # the layers the CPU and GPU images share were analysed once
    workdir = tmp_path / "again"
    workdir.mkdir()
    shutil.copy(scanned_example.workdir / "build-report.json", workdir / "build-report.json")
    started = time.monotonic()
    run = scan_workdir(workdir, scanned_example.cache_dir)
    seconds = time.monotonic() - started
    assert run.returncode == 0, run.stderr[-2000:]
    again = json.loads(run.stdout)["layers"]
    assert again["analysed"] == 0 and again["reused"] == again["total"] == first["total"]
    table = imagebuild("scan", "--workdir", str(workdir), "--cache-dir", str(scanned_example.cache_dir), "--offline",
                       "--dockerfiles", str(EXAMPLE.parent / "dockerfiles"))
    assert f"layers: {first['total']} of {first['total']} reused from Trivy's cache, 0 analysed" in table.stdout
    assert seconds < scanned_example.seconds / 2, (seconds, scanned_example.seconds)


def test_a_fresh_cache_analyses_everything_again(scanned_example, trivy_db, tmp_path):
    """The reuse above is the cache's doing: the same scan with an empty cache reuses only what the
    two images share within the run."""
    workdir = tmp_path / "cold"
    workdir.mkdir()
    report = scanned_example.report
    report["variants"] = [v for v in report["variants"] if v["id"] == CPU_VARIANT]
    (workdir / "build-report.json").write_text(json.dumps(report))
    run = scan_workdir(workdir, trivy_cache_with_db(trivy_db, tmp_path / "cache"))
    assert run.returncode == 0, run.stderr[-2000:]
    layers = json.loads(run.stdout)["layers"]
    assert layers["reused"] == 0 and layers["analysed"] == layers["total"] > 0


# --- the DB from a mirror ---------------------------------------------------------------------------------


def test_the_db_comes_from_the_mirror_named_with_db_repository(scanned_example, trivy_db, tmp_path):
    """Production names its DB mirror; here the mirror is a repository in the local registry."""
    mirror = push_db_artifact(trivy_db, STAGING, f"imagebuild-e2e/trivy-db-{uuid.uuid4().hex[:8]}")
    cache = tmp_path / "cache"
    shutil.copytree(scanned_example.cache_dir, cache, ignore=shutil.ignore_patterns("db"))  # layers warm, no DB
    workdir = tmp_path / "work"
    workdir.mkdir()
    report = scanned_example.report
    report["variants"] = [v for v in report["variants"] if v["id"] == CPU_VARIANT]
    (workdir / "build-report.json").write_text(json.dumps(report))
    run = imagebuild("scan", "--workdir", str(workdir), "--cache-dir", str(cache), "--db-repository", mirror,
                     "--dockerfiles", str(EXAMPLE.parent / "dockerfiles"), "--format", "json")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["db"]["source"] == mirror and summary["offline"] is False
    assert (cache / "db" / "trivy.db").is_file()
    assert any(v["VulnerabilityID"] == EXPAT["id"] for r in image_report(workdir, CPU_VARIANT)["Results"]
               for v in r.get("Vulnerabilities") or [])


def test_offline_without_a_db_says_where_it_looked(tmp_path, scanned_example):
    workdir = scanned_example.copy(tmp_path / "work")
    run = imagebuild("scan", "--workdir", str(workdir), "--cache-dir", str(tmp_path / "empty"), "--offline",
                     "--dockerfiles", str(EXAMPLE.parent / "dockerfiles"))
    assert run.returncode == 3
    assert f"no vulnerability DB in {tmp_path / 'empty' / 'db'}" in run.stderr
