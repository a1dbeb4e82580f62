"""`imagebuild sign`, for real: the pinned cosign, the local registry, the example's smoke-tested and gated images.

Every signature and attestation is checked with plain `cosign verify` / `cosign verify-attestation`
run on its own, never with imagebuild's own code. Tests that delete or add signatures work on
a copy of an example image in a repository of their own, so the shared example stays signed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from imagebuild.oci.client import ImageRef, Registry
from imagebuild.oci.copy import copy_within
from imagebuild.trust.attest import (
    PREDICATE_GATE,
    PREDICATE_OPENVEX,
    PREDICATE_PROVENANCE,
    PREDICATE_RELEASE,
    PREDICATE_SBOM,
    PREDICATE_SMOKE,
    PREDICATE_VULN,
)

from .conftest import REPO, STAGING, imagebuild, sign_workdir, unique

ATTESTATION_TYPES = {  # cosign --type -> the predicateType it must carry
    "cyclonedx": PREDICATE_SBOM,
    "vuln": PREDICATE_VULN,
    PREDICATE_SMOKE: PREDICATE_SMOKE,
    PREDICATE_GATE: PREDICATE_GATE,
}


def digest_of(image: str) -> str:
    return ImageRef.parse(image).digest or ""


def tag_digest(image: str, suffix: str) -> str | None:
    """The manifest digest of the image's `.sig` / `.att` tag, None when absent."""
    ref = ImageRef.parse(image)
    with Registry(ref.registry) as client:
        return client.head_manifest(ref.repository, f"sha256-{digest_of(image).split(':', 1)[1]}.{suffix}")


def variant_for(report: dict, image: str) -> dict:
    return next(v for v in report["variants"] if v["image"] == image)


# --- the signed example verifies with plain cosign ------------------------------------------------


def single_platform(report: dict) -> list[str]:
    return [v["image"] for v in report["variants"] if len(v["platforms"]) == 1]


def children(report: dict) -> list[str]:
    """repository@digest of every child of every two-platform variant."""
    return [f"{v['image'].split('@', 1)[0]}@{c['digest']}" for v in report["variants"] for c in v.get("children") or []]


def test_both_example_images_are_signed_and_verify_with_plain_cosign(signed_example, cosign_cli):
    assert len(signed_example.images) == 3
    for image in signed_example.images + children(signed_example.report):
        verified = cosign_cli.verified(image, signed_example.public_key)
        assert {v["critical"]["image"]["docker-manifest-digest"] for v in verified} == {digest_of(image)}


@pytest.mark.parametrize("cosign_type", list(ATTESTATION_TYPES))
def test_each_attestation_verifies_with_cosign_verify_attestation_and_names_the_digest(
        signed_example, cosign_cli, cosign_type):
    # A two-platform variant's per-kind attestations are its children's (tests/e2e/test_platform_stages.py).
    for image in single_platform(signed_example.report):
        digest = digest_of(image)
        variant = variant_for(signed_example.report, image)
        statements = cosign_cli.statements(image, signed_example.public_key, cosign_type)
        assert len(statements) == 1, "a rerun or a second attest must replace, not add"
        statement = statements[0]
        assert statement["predicateType"] == ATTESTATION_TYPES[cosign_type]
        assert [s["digest"]["sha256"] for s in statement["subject"]] == [digest.split(":", 1)[1]]
        predicate = statement["predicate"]
        if cosign_type == "vuln":
            assert predicate["invocation"]["parameters"]["digest"] == digest
            assert predicate["scanner"]["uri"] == "https://github.com/aquasecurity/trivy"
            assert predicate["scanner"]["version"] == variant["stages"]["scan"]["trivy_version"]
            found = {v["VulnerabilityID"] for r in predicate["scanner"]["result"]["Results"]
                     for v in r.get("Vulnerabilities") or []}
            assert {"CVE-2023-45853", "CVE-2023-31486"} <= found  # the fixture DB's unfixed ones
            assert predicate["metadata"]["scanStartedOn"] <= predicate["metadata"]["scanFinishedOn"]
        elif cosign_type == "cyclonedx":
            assert predicate["bomFormat"] == "CycloneDX"
            properties = {p["name"]: p["value"] for p in predicate["metadata"]["properties"]}
            assert properties["imagebuild:digest"] == digest
            assert any(c.get("name") == "zlib1g" for c in predicate["components"])
        elif cosign_type == PREDICATE_SMOKE:
            assert (predicate["digest"], predicate["variant"], predicate["status"]) == (digest, variant["id"], "passed")
            smoke = variant["stages"]["smoke"]
            assert predicate["counts"] == {k: smoke[k] for k in ("passed", "failed", "errors", "skipped")}
            assert predicate["counts"]["passed"] > 0 and len(predicate["tests"]) == sum(predicate["counts"].values())
        else:
            assert (predicate["digest"], predicate["variant"], predicate["decision"]) == (digest, variant["id"], "passed")
            applied = {(e["id"], e["package"]): e for e in predicate["exceptions_applied"]}
            zlib = applied[("CVE-2023-45853", "zlib1g")]
            assert zlib["owner"] == "imagebuild-maintainers@example.com"
            assert zlib["expires"] == "2027-06-30" and "minizip" in zlib["reason"]


def test_the_report_records_the_signature_layout_and_attestations(signed_example):
    for variant in signed_example.report["variants"]:
        if len(variant["platforms"]) > 1:
            continue  # its children carry the per-kind attestations (tests/e2e/test_platform_stages.py)
        record = variant["stages"]["sign"]
        repository = variant["image"].split("@", 1)[0]
        hex_digest = variant["digest"].split(":", 1)[1]
        assert record["status"] == "passed" and record["digest"] == variant["digest"]
        assert record["key"] == str(signed_example.public_key.with_name("cosign.key"))
        assert record["layout"] == "tag"
        assert record["signature"] == f"{repository}:sha256-{hex_digest}.sig"
        assert record["attestation_ref"] == f"{repository}:sha256-{hex_digest}.att"
        assert [a["type"] for a in record["attestations"]] == ["sbom", "vuln", "smoke", "gate", "openvex", "provenance",
                                                              "release"]
        assert {a["predicate_type"] for a in record["attestations"]} == {
            *ATTESTATION_TYPES.values(), PREDICATE_OPENVEX, PREDICATE_PROVENANCE, PREDICATE_RELEASE}
        assert record["cosign_version"] == "v2.6.5" and record["signed_at"]
        assert record["tlog"] is False


def test_a_rerun_signs_nothing(signed_example, cosign_keys):
    before = {image: (tag_digest(image, "sig"), tag_digest(image, "att")) for image in signed_example.images}
    run = sign_workdir(signed_example.workdir, cosign_keys["key"], cosign_keys["password"], "--format", "json")
    assert run.returncode == 0, run.stderr
    assert {row["action"] for row in run.json()["variants"]} == {"skipped"}
    assert "signing" not in run.stderr
    after = {image: (tag_digest(image, "sig"), tag_digest(image, "att")) for image in signed_example.images}
    assert after == before


# --- refusals: sign reads the report's smoke and gate records ------------------------------------

OTHER_DIGEST = "sha256:" + "a" * 64


def gate_blocked(variant: dict) -> None:
    gate = variant["stages"]["gate"]
    gate["status"] = "failed"
    gate["blocking"] = [{"kind": "vulnerability", "id": "CVE-2099-0001", "package": "zlib1g", "severity": "CRITICAL"}]


def smoke_failed(variant: dict) -> None:
    smoke = variant["stages"]["smoke"]
    smoke.update(status="failed", failed=1, reason="1 test(s) failed, first: test_abi::test_import: ImportError")


def smoke_on_other_digest(variant: dict) -> None:
    variant["stages"]["smoke"]["digest"] = OTHER_DIGEST


def gate_on_other_digest(variant: dict) -> None:
    variant["stages"]["gate"]["digest"] = OTHER_DIGEST


@pytest.mark.parametrize("edit, why", [
    (gate_blocked, "the gate did not pass (CVE-2099-0001 zlib1g)"),
    (smoke_failed, "smoke tests failed: 1 test(s) failed"),
    (smoke_on_other_digest, f"smoke tests ran on {OTHER_DIGEST}, but the variant is now sha256:"),
    (gate_on_other_digest, f"the gate judged {OTHER_DIGEST}, but the image is now sha256:"),
], ids=["gate-blocked", "smoke-failed", "smoke-on-another-digest", "gate-on-another-digest"])
def test_sign_refuses_unless_smoke_and_gate_passed_on_this_digest(signed_example, cosign_keys, tmp_path, edit, why):
    report_path = signed_example.copy(tmp_path / "work")
    report = json.loads(report_path.read_text())
    refused, other = [v for v in report["variants"] if len(v["platforms"]) == 1]
    edit(refused)
    report_path.write_text(json.dumps(report, indent=2))
    before = tag_digest(refused["image"], "sig"), tag_digest(refused["image"], "att")

    run = sign_workdir(report_path.parent, cosign_keys["key"], cosign_keys["password"], "--format", "json")

    assert run.returncode == 1, run.stderr
    rows = {row["id"]: row for row in run.json()["variants"]}
    assert rows[refused["id"]]["action"] == "refused" and why in rows[refused["id"]]["reason"]
    assert rows[other["id"]]["action"] == "skipped"
    record = variant_for(json.loads(report_path.read_text()), refused["image"])["stages"]["sign"]
    assert record["status"] == "refused" and why in record["reason"]
    assert (tag_digest(refused["image"], "sig"), tag_digest(refused["image"], "att")) == before
    assert variant_for(json.loads(report_path.read_text()), other["image"])["stages"]["sign"]["status"] == "passed"


# --- images of a test's own: a copy of the CPU image in a fresh repository ---------------------------


def own_copy(signed_example, tmp_path: Path, image: str | None = None) -> tuple[Path, dict]:
    """A copy of the workdir whose CPU variant points at the same digest in a repository of its own.

    With `image` (an earlier copy's), the new workdir points at that very image: CI's next run,
    in a fresh workdir, signing the same digest again."""
    report_path = signed_example.copy(tmp_path / unique("work"))
    report = json.loads(report_path.read_text())
    variant = next(v for v in report["variants"] if v["device"] == "cpu")
    if image is None:
        source = ImageRef.parse(variant["image"])
        repository = f"imagebuild-e2e/{unique('sign')}"
        with Registry(STAGING) as client:
            copy_within(client, source.repository, source.digest, repository, "signed")
        image = f"{STAGING}/{repository}@{source.digest}"
    variant["image"] = image
    variant["images"] = [f"{image.split('@', 1)[0]}:signed"]
    variant["stages"].pop("sign")
    report_path.write_text(json.dumps(report, indent=2))
    return report_path, variant


def delete_tag_manifest(image: str, suffix: str) -> None:
    ref = ImageRef.parse(image)
    manifest = tag_digest(image, suffix)
    assert manifest
    httpx.delete(f"http://{ref.registry}/v2/{ref.repository}/manifests/{manifest}", timeout=30).raise_for_status()


def test_a_deleted_signature_is_signed_again_on_rerun(signed_example, cosign_cli, cosign_keys, tmp_path):
    report_path, variant = own_copy(signed_example, tmp_path)
    only = ("--only", variant["id"])
    first = sign_workdir(report_path.parent, cosign_keys["key"], cosign_keys["password"], *only, "--format", "json")
    assert first.returncode == 0, first.stderr
    assert [r["action"] for r in first.json()["variants"]] == ["signed"]
    cosign_cli.verified(variant["image"], signed_example.public_key)

    delete_tag_manifest(variant["image"], "sig")
    assert tag_digest(variant["image"], "sig") is None

    again = sign_workdir(report_path.parent, cosign_keys["key"], cosign_keys["password"], *only, "--format", "json")
    assert again.returncode == 0, again.stderr
    assert [r["action"] for r in again.json()["variants"]] == ["signed"]
    cosign_cli.verified(variant["image"], signed_example.public_key)


def signature_layers(image: str) -> list[dict]:
    """The layers of the image's `.sig` manifest: one per signature."""
    ref = ImageRef.parse(image)
    with Registry(ref.registry) as client:
        raw, _, _ = client.get_manifest(ref.repository, f"sha256-{digest_of(image).split(':', 1)[1]}.sig")
    return json.loads(raw)["layers"]


def sign_row(run, variant: dict) -> dict:
    assert run.returncode == 0, run.stderr
    rows = run.json()["variants"]
    assert [r["id"] for r in rows] == [variant["id"]]
    return rows[0]


def test_a_fresh_workdir_reuses_this_keys_signature_and_adds_no_layer(signed_example, cosign, cosign_cli, cosign_keys, tmp_path):
    """CI: every merge signs the same digest again from a workdir with no report; the `.sig` tag must not grow."""
    first_path, variant = own_copy(signed_example, tmp_path)
    image, only = variant["image"], ("--only", variant["id"])
    first = sign_row(sign_workdir(first_path.parent, cosign_keys["key"], cosign_keys["password"], *only,
                                  "--format", "json"), variant)
    assert (first["action"], first["signature_reused"]) == ("signed", False)
    signature, attestations = tag_digest(image, "sig"), tag_digest(image, "att")

    again_path, _ = own_copy(signed_example, tmp_path, image=image)
    run = sign_workdir(again_path.parent, cosign_keys["key"], cosign_keys["password"], *only, "--format", "json")

    again = sign_row(run, variant)
    assert (again["action"], again["signature_reused"]) == ("signed", True)
    assert "signature already present by this key: reused; 7 attestations" in run.stderr
    assert variant_for(json.loads(again_path.read_text()), image)["stages"]["sign"]["signature_reused"] is True
    assert len(signature_layers(image)) == 1
    assert tag_digest(image, "sig") == signature  # not even rewritten
    assert tag_digest(image, "att") != attestations  # the attestations were made again, each replacing its own
    verified = cosign_cli.verified(image, cosign_keys["pub"])
    assert [v["critical"]["image"]["docker-manifest-digest"] for v in verified] == [digest_of(image)]
    for cosign_type in ATTESTATION_TYPES:
        assert len(cosign_cli.statements(image, cosign_keys["pub"], cosign_type)) == 1


def test_a_signature_cosign_would_not_take_for_a_duplicate_is_reused_too(signed_example, cosign, cosign_cli, cosign_keys,
                                                                          tmp_path):
    """cosign skips a signature only when its annotations match one already there (with --tlog, each run's
    Rekor bundle differs): here one made with an annotation. The key and the digest decide, not the bytes."""
    report_path, variant = own_copy(signed_example, tmp_path)
    image = variant["image"]
    made = subprocess.run([cosign, "sign", "--key", str(cosign_keys["key"]), "-a", "pipeline=an-older-one",
                           "--tlog-upload=false", "--allow-http-registry", "--allow-insecure-registry", "--yes", image],
                          env={**os.environ, "COSIGN_PASSWORD": cosign_keys["password"]},
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr

    row = sign_row(sign_workdir(report_path.parent, cosign_keys["key"], cosign_keys["password"],
                                "--only", variant["id"], "--format", "json"), variant)

    assert row["signature_reused"] is True
    assert len(signature_layers(image)) == 1
    cosign_cli.verified(image, cosign_keys["pub"])


def test_another_key_adds_its_own_signature_beside_the_first(signed_example, cosign, cosign_cli, cosign_keys, tmp_path):
    first_path, variant = own_copy(signed_example, tmp_path)
    image, only = variant["image"], ("--only", variant["id"])
    sign_row(sign_workdir(first_path.parent, cosign_keys["key"], cosign_keys["password"], *only, "--format", "json"),
             variant)
    keys, password = tmp_path / "other-key", "other-key-password"
    keys.mkdir()
    made = subprocess.run([cosign, "generate-key-pair"], cwd=keys, env={**os.environ, "COSIGN_PASSWORD": password},
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr

    again_path, _ = own_copy(signed_example, tmp_path, image=image)
    row = sign_row(sign_workdir(again_path.parent, keys / "cosign.key", password, *only, "--format", "json"), variant)

    assert (row["action"], row["signature_reused"]) == ("signed", False)
    assert len(signature_layers(image)) == 2
    for public_key in (cosign_keys["pub"], keys / "cosign.pub"):
        verified = cosign_cli.verified(image, public_key)
        assert [v["critical"]["image"]["docker-manifest-digest"] for v in verified] == [digest_of(image)]


def test_an_interrupted_sign_leaves_a_state_a_rerun_finishes(signed_example, cosign, cosign_cli, cosign_keys, tmp_path):
    """SIGTERM while cosign attests: exit 143, the variant recorded as interrupted, and a rerun completes it."""
    report_path, variant = own_copy(signed_example, tmp_path)
    slow = tmp_path / "slow-cosign"  # the real cosign, made to pause before each attest so the signal lands there
    slow.write_text(f'#!/bin/sh\n[ "$1" = attest ] && sleep 30\nexec {cosign} "$@"\n')
    slow.chmod(0o755)
    env = {**os.environ, "COSIGN_PASSWORD": cosign_keys["password"], "IMAGEBUILD_COSIGN": str(slow)}
    proc = subprocess.Popen([sys.executable, "-m", "imagebuild", "sign", "--workdir", str(report_path.parent),
                             "--key", str(cosign_keys["key"]), "--only", variant["id"]],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while tag_digest(variant["image"], "sig") is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1)  # signed; now in the first attest's pause
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "interrupted by SIGTERM" in stderr
    record = variant_for(json.loads(report_path.read_text()), variant["image"])["stages"]["sign"]
    assert record["status"] == "interrupted"
    assert tag_digest(variant["image"], "att") is None

    rerun = sign_workdir(report_path.parent, cosign_keys["key"], cosign_keys["password"], "--only", variant["id"])
    assert rerun.returncode == 0, rerun.stderr
    assert variant_for(json.loads(report_path.read_text()), variant["image"])["stages"]["sign"]["status"] == "passed"
    for cosign_type in ATTESTATION_TYPES:
        assert len(cosign_cli.statements(variant["image"], signed_example.public_key, cosign_type)) == 1


# --- secrets ---------------------------------------------------------------------------------------


def test_the_key_password_appears_in_no_log_report_or_attestation(signed_example, cosign_cli, secret_canary, tmp_path):
    """A key pair of the test's own whose password is a canary; everything sign leaves behind is searched."""
    password = f"{secret_canary['marker']}-cosign-password"
    keys = tmp_path / "keys"
    keys.mkdir()
    key = cosign_cli.generate_key_pair(keys, password)
    report_path, variant = own_copy(signed_example, tmp_path)

    # First a failing run, whose cosign output is logged and printed: the wrong password for this key.
    wrong = sign_workdir(report_path.parent, key.private, password + "-wrong", "--only", variant["id"])
    run = sign_workdir(report_path.parent, key.private, password, "--only", variant["id"], "--format", "json")
    assert run.returncode == 0, run.stderr

    texts = {"sign stdout": run.stdout, "sign stderr": run.stderr, "failed stdout": wrong.stdout,
             "failed stderr": wrong.stderr}
    for path in report_path.parent.rglob("*"):
        if path.is_file():
            texts[str(path)] = path.read_text(encoding="utf-8", errors="replace")
    for cosign_type in ATTESTATION_TYPES:
        statements = cosign_cli.statements(variant["image"], key.public, cosign_type)
        texts[f"attestation {cosign_type}"] = json.dumps(statements)
    texts["signature"] = json.dumps(cosign_cli.verified(variant["image"], key.public))
    assert len(texts) > 15
    for canary in (password, secret_canary["password"], secret_canary["marker"]):
        leaked = [name for name, text in texts.items() if canary in text]
        assert not leaked, f"a secret reached {leaked}"
    assert wrong.returncode == 1  # it did run, and failed on the password


def test_the_project_key_password_is_nowhere_in_the_signed_workdir(signed_example, cosign_keys):
    password = cosign_keys["password"]
    assert len(password) >= 8
    assert signed_example.run is not None
    assert password not in signed_example.run.stdout + signed_example.run.stderr
    for path in signed_example.workdir.rglob("*"):
        if path.is_file():
            assert password not in path.read_text(encoding="utf-8", errors="replace"), path


# --- bad input and missing tools -----------------------------------------------------------------------


def test_a_missing_cosign_exits_3(signed_example, cosign_keys, tmp_path):
    report_path = signed_example.copy(tmp_path / "work")
    run = imagebuild("sign", "--workdir", str(report_path.parent), "--key", str(cosign_keys["key"]),
                     env={"COSIGN_PASSWORD": cosign_keys["password"], "IMAGEBUILD_COSIGN": str(tmp_path / "nope")})
    assert run.returncode == 3, run.stderr
    assert run.stderr.startswith("error: ") and len(run.stderr.strip().splitlines()) == 1


def test_an_unreachable_registry_exits_3_and_records_nothing(signed_example, cosign_keys, tmp_path):
    report_path = signed_example.copy(tmp_path / "work")
    report = json.loads(report_path.read_text())
    for variant in report["variants"]:
        variant["image"] = variant["image"].replace(STAGING, "127.0.0.1:5999")  # nothing listens there
    report_path.write_text(json.dumps(report, indent=2))
    before = report_path.read_text()
    run = sign_workdir(report_path.parent, cosign_keys["key"], cosign_keys["password"])
    assert run.returncode == 3, run.stderr
    assert "127.0.0.1:5999" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert report_path.read_text() == before
