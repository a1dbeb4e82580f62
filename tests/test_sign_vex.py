"""The OpenVEX attestation `imagebuild sign` attaches with the others (trust/sign.py): built from the gate's
policy, dated by the gate's day, about each image (each child of an index) by its own digest and SBOM.

No registry here: the predicates as sign prepares them, and what verify says of them. The real
cosign, registry and `imagebuild vex show` are in tests/e2e/test_sign_vex.py.
"""
from __future__ import annotations

import datetime as dt
import json
import textwrap
from pathlib import Path

import pytest

from imagebuild.checks import vex
from imagebuild.config.trust import Requirements
from imagebuild.core.report import BuildReport, ChildImage
from imagebuild.core.source import InputError
from imagebuild.trust import attest, sign
from imagebuild.trust.verify import ATTESTATION_TYPES, Attestation, requirement_failures

from .conftest import run_imagebuild
from .test_provenance import DIGEST, GATE, REPOSITORY, SCAN, SMOKE, TRIVY, VARIANT, report_data

NOW = dt.datetime(2027, 2, 3, 9, 30, tzinfo=dt.timezone.utc)  # after the gate's day (GATE: 2026-12-01)
SBOM = {"bomFormat": "CycloneDX", "specVersion": "1.6", "components": [
    {"name": "zlib1g", "purl": "pkg:deb/debian/zlib1g@1:1.2.13.dfsg-1?arch=amd64&distro=debian-12",
     "properties": [{"name": "aquasecurity:trivy:SrcName", "value": "zlib"}]},
    {"name": "perl-base", "purl": "pkg:deb/debian/perl-base@5.36.0-7?arch=amd64"}]}
POLICY = """\
    schema: 1
    exceptions:
      - id: CVE-2023-45853
        packages: [zlib]
        owner: imagebuild-maintainers@example.com
        reason: minizip is not shipped
        expires: 2027-01-31
      - id: CVE-2023-31486
        owner: imagebuild-maintainers@example.com
        reason: only for another variant
        expires: 2027-06-30
        variants: [paddle3.3.1-gpu]
      - id: CVE-2020-16156
        owner: imagebuild-maintainers@example.com
        reason: expired before the gate ran
        expires: 2026-11-30
    """


def workdir(tmp_path: Path, gate: dict | None = None, policy: str = POLICY) -> Path:
    """A workdir as scan and gate leave it for the example's CPU variant, its gate naming policy.yaml."""
    work = tmp_path / "work"
    scan_dir = work / "scan" / VARIANT
    scan_dir.mkdir(parents=True)
    (scan_dir / "sbom.cdx.json").write_text(json.dumps(SBOM))
    (scan_dir / "trivy.json").write_text(json.dumps(TRIVY))
    (tmp_path / "policy.yaml").write_text(textwrap.dedent(policy))
    data = report_data()
    scan = {**SCAN, "reports": {"sbom": f"scan/{VARIANT}/sbom.cdx.json", "image": f"scan/{VARIANT}/trivy.json"}}
    data["variants"][0]["stages"] = {"smoke": SMOKE, "scan": scan,
                                     "gate": {**GATE, "policy": str(tmp_path / "policy.yaml"), **(gate or {})}}
    (work / "build-report.json").write_text(json.dumps(data))
    return work


def run_for(work: Path, policy: Path | None = None) -> sign.SignRun:
    return sign.SignRun(work / "build-report.json", sign.SignOptions(key="/k/cosign.key"),
                        sign.Cosign("/nowhere/cosign", sign.COSIGN_VERSION), policy=policy, clock=lambda: NOW)


def prepared(work: Path, policy: Path | None = None) -> dict:
    run = run_for(work, policy)
    report = BuildReport.read(work / "build-report.json")
    return sign.prepare(work, report, report.variants[0], run.exceptions_of, NOW)


def test_sign_attaches_the_openvex_document_on_every_image_and_no_release_record_vouches_for_it():
    assert [k.name for k in sign.IMAGE_KINDS] == ["sbom", "vuln", "smoke", "gate", "openvex", "provenance", "release"]
    assert sign.IMAGE_KINDS[-1] is attest.RELEASE  # last: it names what the others are in the registry
    assert attest.OPENVEX not in attest.KINDS  # `vex attest` replaces it: a vouched digest would go stale
    assert sign.PREDICATE_FILES[attest.OPENVEX.name] == "openvex.json"
    assert attest.OPENVEX not in sign.INDEX_KINDS  # each child carries its own, about its own packages


def test_the_document_holds_the_gate_policys_exceptions_valid_on_the_gates_day_for_this_variant(tmp_path):
    document = prepared(workdir(tmp_path))[None][attest.OPENVEX.name]
    parsed = vex.parse_document(document, "test")
    (statement,) = parsed.statements  # not the other variant's, not the one expired before the gate's day
    assert statement.vulnerability == "CVE-2023-45853" and statement.digest == DIGEST
    assert statement.subcomponents == ("pkg:deb/debian/zlib1g",)  # the SBOM's purl of zlib's binary package
    assert statement.status == vex.NOT_AFFECTED and statement.expires == dt.date(2027, 1, 31)
    # Dated by the gate's day, not the clock's (2027-02-03, when the zlib exception had expired).
    assert document["statements"][0]["products"][0]["@id"] == vex.oci_purl(vex.product_name(REPOSITORY), DIGEST)
    assert document["timestamp"] == "2027-02-03T09:30:00Z" and document["tooling"] == "imagebuild sign"


def test_without_a_gate_day_the_document_is_of_today(tmp_path):
    document = prepared(workdir(tmp_path, gate={"evaluated_on": None}))[None][attest.OPENVEX.name]
    assert document["statements"] == []  # on 2027-02-03 every exception of the policy has expired


def test_an_image_no_exception_applies_to_still_gets_a_document_a_trust_file_requiring_openvex_accepts(tmp_path):
    document = prepared(workdir(tmp_path, policy="schema: 1\nexceptions: []\n"))[None][attest.OPENVEX.name]
    assert document["statements"] == [] and document["@context"] == vex.OPENVEX_CONTEXT
    require = Requirements(attestations=("openvex",), vex_current=True)
    found = {ATTESTATION_TYPES["openvex"]: Attestation(ATTESTATION_TYPES["openvex"], document, "ours")}
    assert requirement_failures(require, found, DIGEST, dt.date(2027, 2, 3)) == []
    assert requirement_failures(require, {}, DIGEST, dt.date(2027, 2, 3)) == ["attestations missing: openvex"]


def test_the_policy_given_replaces_the_one_the_gate_record_names(tmp_path):
    work = workdir(tmp_path, gate={"policy": str(tmp_path / "gone.yaml")})
    other = tmp_path / "other.yaml"
    other.write_text("schema: 1\nexceptions: []\n")
    assert prepared(work, other)[None][attest.OPENVEX.name]["statements"] == []
    with pytest.raises(InputError, match="gone.yaml: file not found"):
        prepared(work)


def test_a_gate_record_without_a_policy_cannot_make_the_document(tmp_path):
    with pytest.raises(sign.SignError, match="names no policy to make the OpenVEX document from"):
        prepared(workdir(tmp_path, gate={"policy": None}))


def test_a_policy_changed_since_a_release_gate_judged_by_it_is_refused(tmp_path):
    work = workdir(tmp_path, gate={"inputs": {"policy_sha256": "sha256:" + "0" * 64}})
    with pytest.raises(sign.SignError, match="changed since the gate judged this image by it"):
        prepared(work)


def test_a_gate_day_that_is_no_date_fails_the_variant_in_one_line(tmp_path):
    with pytest.raises(sign.SignError, match=r"evaluated_on is not a date: 'yesterday'"):
        prepared(workdir(tmp_path, gate={"evaluated_on": "yesterday"}))


def test_each_child_of_an_index_gets_its_own_document_about_its_own_digest(tmp_path):
    work = workdir(tmp_path)
    data = json.loads((work / "build-report.json").read_text())
    children = {"linux/amd64": "sha256:" + "a1" * 32, "linux/arm64": "sha256:" + "a2" * 32}
    variant = data["variants"][0]
    variant["platforms"] = list(children)
    variant["children"] = [{"platform": p, "digest": d} for p, d in children.items()]
    for name in ("smoke", "scan", "gate"):
        variant["stages"][name]["per_platform"] = {p: {**variant["stages"][name], "digest": d}
                                                   for p, d in children.items()}
    for platform, digest in children.items():  # each child's own scan of its own digest
        own = work / "scan" / VARIANT / platform.replace("/", "-")
        own.mkdir(parents=True)
        (own / "trivy.json").write_text(json.dumps({**TRIVY, "ArtifactName": f"{REPOSITORY}@{digest}"}))
        variant["stages"]["scan"]["per_platform"][platform]["reports"] = {
            "sbom": f"scan/{VARIANT}/sbom.cdx.json", "image": str((own / "trivy.json").relative_to(work))}
    (work / "build-report.json").write_text(json.dumps(data))
    report = BuildReport.read(work / "build-report.json")
    assert report.variants[0].children == [ChildImage(p, d) for p, d in children.items()]
    got = sign.prepare(work, report, report.variants[0], run_for(work).exceptions_of, NOW)
    for platform, digest in children.items():
        (statement,) = vex.parse_document(got[platform][attest.OPENVEX.name], platform).statements
        assert statement.digest == digest and statement.vulnerability == "CVE-2023-45853"


def test_sign_with_a_policy_file_that_is_not_there_exits_2_before_anything_is_signed(tmp_path):
    work = workdir(tmp_path)
    key = tmp_path / "cosign.key"
    key.write_text("not read: bad input stops the run first\n")
    before = (work / "build-report.json").read_text()
    run = run_imagebuild("sign", "--workdir", work, "--key", key, "--policy", tmp_path / "missing.yaml",
                         env={"COSIGN_PASSWORD": ""})
    assert run.returncode == 2, run.stderr
    assert "missing.yaml: file not found" in run.stderr
    assert (work / "build-report.json").read_text() == before and not (work / "sign").exists()
