"""The attestation predicates sign attaches (imagebuild/trust/attest.py): their shape, their digest, no secrets."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from imagebuild.core.report import GateStage, ScanStage, SmokeStage
from imagebuild.trust import attest

DIGEST = "sha256:" + "b" * 64
OTHER = "sha256:" + "c" * 64
IMAGE = f"127.0.0.1:5000/imagebuild-example/paddle@{DIGEST}"
VARIANT = "paddle3.3.1-cpu-py3.11-debian12"


def trivy_report(digest: str = DIGEST) -> dict:
    return {
        "SchemaVersion": 2,
        "ArtifactName": f"127.0.0.1:5000/imagebuild-example/paddle@{digest}",
        "Metadata": {"RepoDigests": [f"127.0.0.1:5000/imagebuild-example/paddle@{digest}"]},
        "Results": [
            {"Target": "debian 12", "Vulnerabilities": [
                {"VulnerabilityID": "CVE-2023-45853", "PkgName": "zlib1g", "Severity": "CRITICAL"}]},
            {"Target": "/app/.env", "Class": "secret", "Secrets": [
                {"RuleID": "aws-secret-access-key", "Category": "AWS", "Severity": "CRITICAL",
                 "Title": "AWS Secret Access Key", "StartLine": 1, "EndLine": 1,
                 "Match": "AWS_SECRET=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                 "Code": {"Lines": [{"Content": "AWS_SECRET=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}]}}]},
        ],
    }


SCAN = ScanStage(status="ok", digest=DIGEST, trivy_version="0.76.0", db_updated_at="2026-11-30T00:00:00Z",
                 scanned_at="2026-12-01T05:00:00Z", duration_s=22.9)


def test_the_predicate_types_are_the_ones_verifiers_match():
    assert attest.PREDICATE_TYPES == {
        "sbom": "https://cyclonedx.org/bom",
        "vuln": "https://cosign.sigstore.dev/attestation/vuln/v1",
        "smoke": "https://imagebuild.dev/attestations/smoke/v1",
        "gate": "https://imagebuild.dev/attestations/gate/v1",
        "provenance": "https://slsa.dev/provenance/v1",
        "release": "https://imagebuild.dev/attestations/release/v1",
        "openvex": "https://openvex.dev/ns/v0.2.0",
    }
    assert [k.cosign_type for k in attest.KINDS] == ["cyclonedx", "vuln", attest.PREDICATE_SMOKE, attest.PREDICATE_GATE,
                                                     attest.PREDICATE_PROVENANCE, attest.PREDICATE_RELEASE]


# --- vuln ------------------------------------------------------------------------------------------


def test_the_vuln_predicate_has_cosigns_shape_and_names_the_digest():
    predicate = attest.vuln_predicate(trivy_report(), digest=DIGEST, variant=VARIANT, image=IMAGE, scan=SCAN,
                                      db={"source": "offline (as found in the cache)", "updated_at": "2026-11-30"})
    assert set(predicate) == {"invocation", "scanner", "metadata"}
    assert predicate["invocation"]["parameters"]["digest"] == DIGEST
    assert predicate["invocation"]["parameters"]["variant"] == VARIANT
    scanner = predicate["scanner"]
    assert (scanner["uri"], scanner["version"]) == ("https://github.com/aquasecurity/trivy", "0.76.0")
    assert scanner["db"] == {"uri": "offline (as found in the cache)", "version": "2026-11-30"}
    assert scanner["result"]["Results"][0]["Vulnerabilities"][0]["VulnerabilityID"] == "CVE-2023-45853"
    assert predicate["metadata"] == {"scanStartedOn": "2026-12-01T05:00:00Z", "scanFinishedOn": "2026-12-01T05:00:22Z"}


def test_the_vuln_predicate_keeps_where_a_secret_was_found_but_never_its_text():
    predicate = attest.vuln_predicate(trivy_report(), digest=DIGEST, variant=VARIANT, image=IMAGE, scan=SCAN)
    text = json.dumps(predicate)
    assert "wJalrXUtnFEMI" not in text
    secret = predicate["scanner"]["result"]["Results"][1]["Secrets"][0]
    assert secret == {"RuleID": "aws-secret-access-key", "Category": "AWS", "Severity": "CRITICAL",
                      "Title": "AWS Secret Access Key", "StartLine": 1, "EndLine": 1}


def test_the_vuln_predicate_refuses_a_scan_of_another_digest():
    with pytest.raises(attest.PredicateError, match="scan record is about"):
        attest.vuln_predicate(trivy_report(), digest=DIGEST, variant=VARIANT, image=IMAGE, scan=replace(SCAN, digest=OTHER))
    with pytest.raises(attest.PredicateError, match="Trivy report is about"):
        attest.vuln_predicate(trivy_report(OTHER), digest=DIGEST, variant=VARIANT, image=IMAGE, scan=SCAN)


# --- SBOM ------------------------------------------------------------------------------------------


def bom(digest: str = DIGEST) -> dict:
    return {"bomFormat": "CycloneDX", "specVersion": "1.7",
            "metadata": {"component": {"name": f"127.0.0.1:5000/imagebuild-example/paddle@{digest}",
                                       "purl": f"pkg:oci/paddle@{digest}"},
                         "properties": [{"name": "aquasecurity:trivy:DiffID", "value": "sha256:1"}]},
            "components": [{"name": "zlib1g"}]}


def test_the_sbom_gains_the_digest_and_variant_as_properties_and_keeps_the_rest():
    original = bom()
    predicate = attest.sbom_predicate(original, digest=DIGEST, variant=VARIANT)
    assert predicate["metadata"]["properties"] == [
        {"name": "aquasecurity:trivy:DiffID", "value": "sha256:1"},
        {"name": "imagebuild:digest", "value": DIGEST}, {"name": "imagebuild:variant", "value": VARIANT}]
    assert predicate["components"] == [{"name": "zlib1g"}]
    assert original == bom(), "the scan's SBOM is not changed in place"
    again = attest.sbom_predicate(predicate, digest=DIGEST, variant=VARIANT)
    assert again["metadata"]["properties"] == predicate["metadata"]["properties"]


def test_an_sbom_of_another_image_or_not_cyclonedx_is_refused():
    with pytest.raises(attest.PredicateError, match="describes"):
        attest.sbom_predicate(bom(OTHER), digest=DIGEST, variant=VARIANT)
    with pytest.raises(attest.PredicateError, match="CycloneDX"):
        attest.sbom_predicate({"spdxVersion": "SPDX-2.3"}, digest=DIGEST, variant=VARIANT)


# --- smoke -----------------------------------------------------------------------------------------

SMOKE = SmokeStage(status="passed", image=IMAGE, digest=DIGEST, passed=9, failed=0, errors=0, skipped=6,
                   skip_reasons=[{"test": "test_gpu::test_device", "reason": "no GPU visible"}], failures=[],
                   tiers=["abi", "gpu"], suite_digest="sha256:suite", junit="/tmp/x/junit.xml",
                   log="/tmp/x/log.txt", duration_s=11.3, exit_code=0, gpu_requested=False)


def test_the_smoke_predicate_says_status_and_counts_for_the_digest():
    tests = [{"name": "test_abi::test_import", "outcome": "passed"}]
    predicate = attest.smoke_predicate(SMOKE, digest=DIGEST, variant=VARIANT, tests=tests)
    assert (predicate["digest"], predicate["variant"], predicate["status"]) == (DIGEST, VARIANT, "passed")
    assert predicate["counts"] == {"passed": 9, "failed": 0, "errors": 0, "skipped": 6}
    assert predicate["skip_reasons"] == SMOKE.skip_reasons and predicate["tiers"] == ["abi", "gpu"]
    assert predicate["tests"] == tests
    assert "junit" not in predicate and "log" not in predicate, "no paths of the signing machine"


def test_the_smoke_predicate_refuses_a_run_on_another_digest():
    with pytest.raises(attest.PredicateError, match=f"smoke record is about {OTHER}"):
        attest.smoke_predicate(replace(SMOKE, digest=OTHER), digest=DIGEST, variant=VARIANT)


# --- gate ------------------------------------------------------------------------------------------


def excepted(package: str) -> dict:
    return {"kind": "vulnerability", "id": "CVE-2023-31486", "severity": "HIGH", "package": package,
            "exception": {"id": "CVE-2023-31486", "owner": "imagebuild-maintainers@example.com",
                          "reason": "perl is there for dpkg", "expires": "2027-06-30", "line": 14}}


GATE = GateStage(status="passed", digest=DIGEST, image=IMAGE, policy="examples/local/policy.yaml",
                 evaluated_on="2026-12-01", strict=False, severity="HIGH", ignore_unfixed=False,
                 counts={"blocked": 0, "excepted": 3}, blocking=[],
                 excepted=[excepted("perl"), excepted("perl-base"), excepted("perl")], problems=[], warnings=[])


def test_the_gate_predicate_lists_each_exception_applied_with_owner_reason_and_expiry():
    predicate = attest.gate_predicate(GATE, digest=DIGEST, variant=VARIANT)
    assert (predicate["digest"], predicate["variant"], predicate["decision"]) == (DIGEST, VARIANT, "passed")
    assert predicate["policy"] == {"file": "examples/local/policy.yaml", "severity": "HIGH", "ignore_unfixed": False,
                                   "strict": False}
    assert predicate["exceptions_applied"] == [
        {"id": "CVE-2023-31486", "package": package, "severity": "HIGH", "exception": "CVE-2023-31486",
         "owner": "imagebuild-maintainers@example.com", "reason": "perl is there for dpkg", "expires": "2027-06-30"}
        for package in ("perl", "perl-base")]


def test_a_failed_gate_is_a_blocked_decision_naming_what_blocked():
    failed = replace(GATE, status="failed", excepted=[],
                     blocking=[{"kind": "vulnerability", "id": "CVE-2024-28757", "package": "libexpat1",
                                "severity": "HIGH", "why": "fixed in 2.5.0-1+deb12u4"}])
    predicate = attest.gate_predicate(failed, digest=DIGEST, variant=VARIANT)
    assert predicate["decision"] == "blocked"
    assert predicate["blocking"] == [{"id": "CVE-2024-28757", "kind": "vulnerability", "severity": "HIGH",
                                      "package": "libexpat1", "target": None}]


def test_the_gate_predicate_refuses_a_verdict_on_another_digest():
    with pytest.raises(attest.PredicateError, match=f"gate record is about {OTHER}"):
        attest.gate_predicate(replace(GATE, digest=OTHER), digest=DIGEST, variant=VARIANT)
