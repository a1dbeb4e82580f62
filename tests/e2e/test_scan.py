"""`imagebuild scan` and `imagebuild gate`, for real: the pinned Trivy, the example's real images
in the local registry, and a vulnerability DB built with Trivy's own Go package.

The fixture DB's advisories are real (real CVE ids, Debian's real bookworm-security fixed
versions). The example's base image carries bookworm's security and point-release updates, so
its scans show only what Debian has not fixed (perl's HTTP::Tiny, zlib's minizip) and the
example's gate passes with exceptions for those alone. A finding with a fixed version comes
from a test image that installs bookworm's older point-release libexpat1 on purpose; the gate
tests judge that one. The first tests check both halves with dpkg, so a base image without
the security updates fails loudly here.
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

from imagebuild.core.runner import docker_cli

from .conftest import (
    EXAMPLE,
    STAGING,
    Run,
    imagebuild,
    scan_workdir,
    trivy_cache_with_db,
)
from .trivydb import DEBIAN_FIXED, EXPAT, PERL, PIP, ZLIB, push_db_artifact

CPU_VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
REPO = EXAMPLE.parents[2]
MULTI_VARIANT = "paddle3.2.2-cpu-py3.11-debian12"
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


def vulnerabilities(report: dict) -> list[dict]:
    return [v for r in report["Results"] for v in r.get("Vulnerabilities") or []]


def test_the_example_images_carry_every_fix_bookworm_security_had(scanned_example):
    """Asked of dpkg itself: installed >= fixed for every fixture advisory Debian has fixed."""
    for variant in (CPU_VARIANT, GPU_VARIANT):
        report = image_report(scanned_example.workdir, variant)
        for advisory in DEBIAN_FIXED:
            version = installed(report, advisory["package"])
            check = subprocess.run(["dpkg", "--compare-versions", version, "ge", advisory["fixed"]], check=False)
            assert check.returncode == 0, (
                f"{variant} has {advisory['package']} {version}, below {advisory['fixed']} from bookworm-security: "
                "its base image lacks the security updates; rebuild it with scripts/bootstrap.sh")


def test_no_debian_package_in_the_example_has_a_fix_it_lacks(scanned_example):
    for variant in (CPU_VARIANT, GPU_VARIANT):
        report = image_report(scanned_example.workdir, variant)
        fixable = [(v["VulnerabilityID"], v["PkgName"], v["FixedVersion"]) for r in report["Results"]
                   if r.get("Class") == "os-pkgs" for v in r.get("Vulnerabilities") or [] if v.get("FixedVersion")]
        assert fixable == [], f"{variant}: {fixable}"


def test_every_image_is_scanned_by_digest_and_its_reports_lie_beside_the_build_report(scanned_example):
    report = scanned_example.report
    assert {v["id"] for v in report["variants"]} == {CPU_VARIANT, GPU_VARIANT, MULTI_VARIANT}
    for variant in report["variants"]:
        if len(variant["platforms"]) > 1:
            continue  # each child is scanned by its own digest (tests/e2e/test_platform_stages.py)
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


def test_the_unfixed_advisories_are_found_in_every_image_without_a_fixed_version(scanned_example):
    for variant in (CPU_VARIANT, GPU_VARIANT):
        found = {(v["VulnerabilityID"], v["PkgName"]): v for v in vulnerabilities(image_report(scanned_example.workdir,
                                                                                               variant))}
        for package in PERL["packages"]:
            perl = found[(PERL["id"], package)]
            assert (perl["Status"], perl.get("FixedVersion", ""), perl["Severity"]) == ("affected", "", "HIGH")
        assert found[(ZLIB["id"], ZLIB["package"])]["Status"] == "will_not_fix"
        assert found[(PIP["id"], PIP["package"])]["FixedVersion"] == PIP["fixed"]  # PyPI's fix, not Debian's
        assert not any(key[0] in (EXPAT["id"], "CVE-2024-22365") for key in found)


def test_the_rendered_dockerfiles_are_checked_per_variant(scanned_example):
    config = json.loads((scanned_example.workdir / "scan" / "config.json").read_text())
    targets = {r["Target"] for r in config["Results"]}
    for variant in scanned_example.report["variants"]:
        stage = variant["stages"]["scan"]
        assert stage["dockerfiles"][0] == "base/debian12/Dockerfile"
        assert stage["dockerfiles"][-1] == f"release/{variant['id']}/Dockerfile"
        assert set(stage["dockerfiles"]) <= targets


# --- the gate on the real scans ----------------------------------------------------------------------


def test_the_examples_own_policy_passes_strictly_with_exceptions_for_unfixed_cves_only(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    run = gate(workdir, EXAMPLE.parent / "policy.yaml", "--strict", "--format", "json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    result = json.loads(run.stdout)
    assert {e["state"] for e in result["exceptions"]} == {"active"}  # none stale: each names a real finding
    for image in result["images"]:
        assert image["blocking"] == []
        excepted = {(f["id"], f["fixed"]) for f in image["excepted"]}
        assert excepted == {(PERL["id"], ""), (ZLIB["id"], "")}


def test_the_default_policy_passes_the_example_listing_unfixed_findings_as_ignored(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    run = gate(workdir, REPO / "policies" / "vulnerabilities.yaml", "--strict")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr


def test_without_ignore_unfixed_the_unfixed_high_and_critical_block(scanned_example, tmp_path):
    workdir = scanned_example.copy(tmp_path / "work")
    run = gate(workdir, write_policy(tmp_path / "policy.yaml", ignore_unfixed=False), "--format", "json")
    assert run.returncode == 1
    expected = {(PERL["id"], p, "") for p in PERL["packages"]} | {(ZLIB["id"], ZLIB["package"], "")}
    for image in json.loads(run.stdout)["images"]:
        assert {(b["id"], b["package"], b["fixed"]) for b in image["blocking"]} == expected


def derived_image(base: dict, tmp_path_factory, name: str, dockerfile: str, files: dict[str, str]) -> tuple[str, str]:
    """Builds `FROM <base image by digest>` + dockerfile into a test-only repository; (reference by digest, digest)."""
    context = tmp_path_factory.mktemp(name)
    for file, text in files.items():
        (context / file).write_text(text)
    (context / "Dockerfile").write_text(f"FROM {base['image']}\n{dockerfile}")
    ref = f"{STAGING}/imagebuild-e2e/{name}:{uuid.uuid4().hex[:12]}"
    docker = docker_cli()
    built = subprocess.run([docker, "build", "-t", ref, str(context)], check=False, capture_output=True, text=True,
                           env={**os.environ, "DOCKER_BUILDKIT": "1"}, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    pushed = subprocess.run([docker, "push", ref], check=False, capture_output=True, text=True, timeout=600)
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    digest = "sha256:" + pushed.stdout.split("digest: sha256:", 1)[1].split()[0]
    subprocess.run([docker, "rmi", ref], check=False, capture_output=True)
    return f"{ref.rsplit(':', 1)[0]}@{digest}", digest


def scanned_in_place_of_cpu(scanned_example, tmp_path_factory, image: str, digest: str) -> tuple[Path, Run]:
    """A build report naming `image` as the CPU variant, scanned with the example's warm cache."""
    workdir = tmp_path_factory.mktemp("derived-scan")
    report = scanned_example.report
    cpu = next(v for v in report["variants"] if v["id"] == CPU_VARIANT)
    report["variants"] = [dict(cpu, image=image, digest=digest, stages={})]
    (workdir / "build-report.json").write_text(json.dumps(report, indent=2))
    run = scan_workdir(workdir, scanned_example.cache_dir)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return workdir, run


@pytest.fixture(scope="module")
def stale_image(scanned_example, tmp_path_factory) -> Path:
    """The example's CPU image with libexpat1 taken back on purpose to the newest version below its
    bookworm-security fix that the mirror still serves (bookworm's own point-release version),
    scanned: the one image here that lacks a fix Debian has. Returns its scan workdir."""
    cpu = next(v for v in scanned_example.report["variants"] if v["id"] == CPU_VARIANT)
    package, fixed = EXPAT["package"], EXPAT["fixed"]
    dockerfile = (
        "USER root\n"
        "RUN set -eu; apt-get update -qq; old=; \\\n"
        f"    for v in $(apt-cache madison {package} | awk '{{print $3}}'); do \\\n"  # newest first
        f"        if dpkg --compare-versions \"$v\" lt '{fixed}'; then old=$v; break; fi; \\\n"
        "    done; \\\n"
        f"    if [ -z \"$old\" ]; then echo 'the mirror serves no {package} below {fixed}' >&2; exit 1; fi; \\\n"
        f"    apt-get install -y -qq --no-install-recommends --allow-downgrades \"{package}=$old\"; \\\n"
        "    apt-get clean; rm -rf /var/lib/apt/lists/*\n"
        "USER 1000:1000\n")
    image, digest = derived_image(cpu, tmp_path_factory, "stale-expat", dockerfile, {})
    workdir, _ = scanned_in_place_of_cpu(scanned_example, tmp_path_factory, image, digest)
    return workdir


def test_the_stale_image_really_carries_the_vulnerable_version(stale_image):
    version = installed(image_report(stale_image, CPU_VARIANT), EXPAT["package"])
    older = subprocess.run(["dpkg", "--compare-versions", version, "lt", EXPAT["fixed"]], check=False)
    assert older.returncode == 0, version


def test_the_gate_blocks_an_image_lacking_a_debian_fix_naming_cve_package_and_fixed_version(stale_image, tmp_path):
    workdir = shutil.copytree(stale_image, tmp_path / "work")
    run = gate(workdir, write_policy(tmp_path / "policy.yaml"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"BLOCKED  {CPU_VARIANT}" in run.stdout
    (line,) = [line for line in run.stdout.splitlines() if EXPAT["id"] in line]
    assert EXPAT["package"] in line and f"fixed in {EXPAT['fixed']}" in line
    (variant,) = json.loads((workdir / "build-report.json").read_text())["variants"]
    assert variant["stages"]["gate"]["status"] == "failed"
    assert [b["id"] for b in variant["stages"]["gate"]["blocking"]] == [EXPAT["id"]]


def test_a_valid_exception_lets_it_pass(stale_image, tmp_path):
    workdir = shutil.copytree(stale_image, tmp_path / "work")
    policy = write_policy(tmp_path / "policy.yaml", expat_exception(TODAY + dt.timedelta(days=30)))
    run = gate(workdir, policy)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"excepted until {(TODAY + dt.timedelta(days=30)).isoformat()}" in run.stdout
    (variant,) = json.loads((workdir / "build-report.json").read_text())["variants"]
    assert variant["stages"]["gate"]["status"] == "passed"


def test_the_same_exception_once_expired_blocks_it_again(stale_image, tmp_path):
    workdir = shutil.copytree(stale_image, tmp_path / "work")
    yesterday = TODAY - dt.timedelta(days=1)
    run = gate(workdir, write_policy(tmp_path / "policy.yaml", expat_exception(yesterday)))
    assert run.returncode == 1
    assert f"expired on {yesterday.isoformat()}" in run.stdout
    assert run.stdout.count(f"blocks  {EXPAT['id']}") == 1


def test_the_sarif_of_a_real_gate_names_the_cve(stale_image, tmp_path):
    workdir = shutil.copytree(stale_image, tmp_path / "work")
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
    key_id, secret_key, private_key = fake_credentials()
    files = {"credentials": f"[default]\naws_access_key_id = {key_id}\n"
                            f"aws_secret_access_key = {secret_key}\nregion = eu-west-1\n",
             "id_ed25519": private_key}
    dockerfile = ("COPY --chown=1000:1000 credentials /home/paddle/.aws/credentials\n"
                  "COPY --chown=1000:1000 id_ed25519 /home/paddle/.ssh/id_ed25519\n")
    image, digest = derived_image(cpu, tmp_path_factory, "secret-probe", dockerfile, files)
    workdir, run = scanned_in_place_of_cpu(scanned_example, tmp_path_factory, image, digest)
    return {"workdir": workdir, "values": (key_id, secret_key, private_key.splitlines()[1]), "scan": run}


def test_a_planted_secret_is_found_and_blocks(secret_image, tmp_path):
    run = gate(secret_image["workdir"], write_policy(tmp_path / "policy.yaml"), "--format", "json")
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
    assert any(v["VulnerabilityID"] == PERL["id"] for v in vulnerabilities(image_report(workdir, CPU_VARIANT)))


def test_offline_without_a_db_says_where_it_looked(tmp_path, scanned_example):
    workdir = scanned_example.copy(tmp_path / "work")
    run = imagebuild("scan", "--workdir", str(workdir), "--cache-dir", str(tmp_path / "empty"), "--offline",
                     "--dockerfiles", str(EXAMPLE.parent / "dockerfiles"))
    assert run.returncode == 3
    assert f"no vulnerability DB in {tmp_path / 'empty' / 'db'}" in run.stderr
