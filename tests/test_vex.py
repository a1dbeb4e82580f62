"""The policy's exceptions as OpenVEX (checks/vex.py): the document built, a hostile one read back, the use-time
expiry filter, and what `verify` says of a signed document (require.vex_current)."""
from __future__ import annotations

import copy
import datetime as dt
import textwrap

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.admission import policies
from imagebuild.checks import gate, vex
from imagebuild.config.trust import Requirements, load_trust_config
from imagebuild.core.source import InputError, parse_document
from imagebuild.trust.verify import ATTESTATION_TYPES, Attestation, requirement_failures

from .conftest import REPO_ROOT, run_imagebuild
from .test_policies import document, generated, webhook_documents, write_config

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
TODAY = dt.date(2026, 12, 1)
NOW = dt.datetime(2026, 12, 1, 5, 0, tzinfo=dt.timezone.utc)
CPU = "paddle3.3.1-cpu-py3.11-debian12"
SBOM = {"bomFormat": "CycloneDX", "components": [
    {"name": "libexpat1", "purl": "pkg:deb/debian/libexpat1@2.5.0-1+deb12u2?arch=amd64&distro=debian-12.10",
     "properties": [{"name": "aquasecurity:trivy:SrcName", "value": "expat"}]},
    {"name": "PaddlePaddle", "purl": "pkg:pypi/paddlepaddle@3.3.1"},
    {"name": "odd", "purl": "not a purl"},
]}


def policy(text: str) -> gate.Policy:
    return gate.parse_policy(parse_document("schema: 1\n" + textwrap.dedent(text), "policies/vulnerabilities.yaml"))


POLICY = policy("""
    exceptions:
      - id: CVE-2099-41001
        packages: [paddlepaddle]
        owner: ml-platform-security@example.com
        reason: The vulnerable decoder is never called by the serving path.
        expires: 2027-01-31
      - id: CVE-2024-28757
        packages: [expat]
        owner: xml-owners@example.com
        reason: No untrusted XML is parsed in these images.
        expires: 2026-12-01
        status: affected
      - id: CVE-2023-45853
        owner: base-image@example.com
        reason: minizip is not shipped in the images at all.
        expires: 2026-11-30
        justification: component_not_present
      - id: CVE-2023-31486
        variants: [some-other-variant]
        owner: perl@example.com
        reason: No HTTPS fetches with Perl's HTTP::Tiny here.
        expires: 2027-01-31
      - id: DS-0002
        owner: base-image@example.com
        reason: The images run as root by design in this test.
        expires: 2027-01-31
      - id: CVE-2099-1
        packages: [not-in-the-image]
        owner: someone@example.com
        reason: A package this image does not hold at all.
        expires: 2027-01-31
    """)


def build(today: dt.date = TODAY) -> dict:
    return vex.build_document(POLICY.exceptions, variant=CPU, digest=DIGEST, name="paddle", today=today, now=NOW,
                              purls=vex.sbom_purls(SBOM))


def test_the_document_has_openvex_fields_and_one_statement_per_valid_applicable_vulnerability_exception():
    doc = build()
    assert doc["@context"] == "https://openvex.dev/ns/v0.2.0"
    assert doc["@id"].startswith(f"https://imagebuild.dev/vex/{CPU}/{DIGEST}/")
    assert (doc["author"], doc["timestamp"], doc["version"]) == ("imagebuild", "2026-12-01T05:00:00Z", 1)
    # expired (zlib), another variant's (perl), a Dockerfile check and a package not in the image: none.
    assert [s["vulnerability"]["name"] for s in doc["statements"]] == ["CVE-2099-41001", "CVE-2024-28757"]
    paddle, expat = doc["statements"]
    assert paddle["products"] == [{"@id": "pkg:oci/paddle@sha256%3A" + "ab" * 32,
                                   "subcomponents": [{"@id": "pkg:pypi/paddlepaddle"}]}]
    assert paddle["status"] == "not_affected" and paddle["justification"] == "vulnerable_code_not_in_execute_path"
    assert paddle["impact_statement"] == "The vulnerable decoder is never called by the serving path."
    assert paddle["imagebuild:expires"] == "2027-01-31" and paddle["imagebuild:owner"].startswith("ml-platform")
    assert "action_statement" not in paddle
    # A Debian source name reaches the binary package's purl, without version or qualifiers.
    assert expat["products"][0]["subcomponents"] == [{"@id": "pkg:deb/debian/libexpat1"}]
    assert expat["status"] == "affected" and "justification" not in expat
    assert expat["action_statement"].startswith("accepted by xml-owners@example.com until 2026-12-01")


def test_a_justification_is_kept_and_the_last_day_is_still_valid():
    doc = build(today=dt.date(2026, 11, 30))
    zlib = next(s for s in doc["statements"] if s["vulnerability"]["name"] == "CVE-2023-45853")
    assert zlib["justification"] == "component_not_present"
    assert "subcomponents" not in zlib["products"][0], "no packages named: the whole image"
    assert "CVE-2023-45853" not in [s["vulnerability"]["name"] for s in build()["statements"]]


@pytest.mark.parametrize(("extra", "message"), [
    ({"status": "fixed"}, "unknown status 'fixed'"),
    ({"justification": "because"}, "unknown justification 'because'"),
    ({"status": "affected", "justification": "component_not_present"}, "an affected exception has none"),
])
def test_the_policy_refuses_other_statuses_and_justifications(extra, message):
    fields = "".join(f"\n    {key}: {value}" for key, value in extra.items())
    with pytest.raises(InputError, match=message):
        policy("exceptions:\n  - id: CVE-2024-28757\n    owner: a@example.com\n"
               "    reason: No untrusted XML is parsed here.\n    expires: 2027-01-31" + fields + "\n")


def test_a_built_document_reads_back_and_only_valid_statements_about_this_digest_reach_trivy():
    doc = build()
    parsed = vex.parse_document(doc, "test")
    assert [s.vulnerability for s in parsed.statements] == ["CVE-2099-41001", "CVE-2024-28757"]
    applied = vex.for_trivy(parsed, digest=DIGEST, name="paddle-eu", today=dt.date(2026, 12, 2))
    assert [s.vulnerability for s in applied.kept] == ["CVE-2099-41001"]
    assert [s.vulnerability for s in applied.expired] == ["CVE-2024-28757"]
    (only,) = applied.document["statements"]
    assert only["products"][0]["@id"] == "pkg:oci/paddle-eu@sha256%3A" + "ab" * 32
    assert "imagebuild:expires" not in only
    other = vex.for_trivy(parsed, digest=OTHER, name="paddle", today=TODAY)
    assert other.document["statements"] == [] and other.other_images == 2


def statement_edit(path: tuple, value) -> dict:
    doc = copy.deepcopy(build())
    target = doc["statements"][0]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@pytest.mark.parametrize(("doc", "message"), [
    ("a string", "expected a mapping"),
    ({**build(), "@context": "https://openvex.dev/ns/v0.0.1"}, "not an OpenVEX v0.2.0 document"),
    ({**build(), "version": "1"}, "version: expected an integer"),
    ({**build(), "statements": [{}] * 1001}, "over the 1000 read"),
    (statement_edit(("status",), "fixed"), "unsupported status 'fixed'"),
    (statement_edit(("justification",), "trust me"), "unknown justification"),
    (statement_edit(("products",), []), "must not be empty"),
    (statement_edit(("products",), [{"@id": "pkg:oci/paddle:latest"}]), "not an image by digest"),
    (statement_edit(("products",), [{"@id": "pkg:oci/a@sha256%3A" + "ab" * 32}] * 2), "exactly one product"),
    (statement_edit(("products", 0, "subcomponents"), []), "a statement about no package"),
    (statement_edit(("products", 0, "subcomponents"), [{"@id": "pkg:pypi/x?arch=amd64"}]), "not a package URL"),
    (statement_edit(("imagebuild:expires",), "someday"), "expected a date"),
    (statement_edit(("vulnerability",), {"name": "x" * 201}), "longer than 200"),
    (statement_edit(("impact_statement",), ["a list"]), "expected a string"),
])
def test_a_hostile_document_is_refused_naming_the_key(doc, message):
    with pytest.raises(InputError, match=message):
        vex.parse_document(doc, "registry")


def test_a_statement_without_an_expiry_is_refused():
    doc = copy.deepcopy(build())
    del doc["statements"][0]["imagebuild:expires"]
    with pytest.raises(InputError, match="statements\\[0\\]: missing required key 'imagebuild:expires'"):
        vex.parse_document(doc, "registry")


def test_the_trust_file_takes_vex_current_and_it_needs_the_openvex_attestation(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    (tmp_path / "k.pub").write_bytes(key.public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    (tmp_path / "trust.yaml").write_text('keys: [{name: k, path: k.pub}]\nimages: ["**"]\n'
                                         "require: {vex_current: true}\n")
    require = load_trust_config(tmp_path / "trust.yaml").require
    assert require.attestations == ("openvex",) and require.vex_current


def test_verify_can_require_a_current_vex_document():
    require = Requirements(attestations=("openvex",), vex_current=True)
    openvex = ATTESTATION_TYPES["openvex"]
    found = {openvex: Attestation(openvex, build(), "k")}
    assert requirement_failures(require, found, DIGEST, TODAY) == []
    later = requirement_failures(require, found, DIGEST, dt.date(2026, 12, 2))
    assert later == ["the openvex attestation has expired statements (CVE-2024-28757): attest the image's VEX again"]
    assert "about another image" in requirement_failures(require, found, OTHER, TODAY)[0]
    assert requirement_failures(require, {}, DIGEST, TODAY) == ["attestations missing: openvex"]
    hostile = {openvex: Attestation(openvex, {"@context": "x"}, "k")}
    assert "missing required key" in requirement_failures(require, hostile, DIGEST, TODAY)[0]


def test_the_generated_policies_require_the_openvex_attestation_and_the_webhook_keeps_vex_current(tmp_path):
    files = generated(write_config(tmp_path, require="{attestations: [sbom], vex_current: true}"))
    types = [policies.PREDICATE_TYPES["sbom"], "https://openvex.dev/ns/v0.2.0"]
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    attesting = next(a for a in cip["authorities"] if a["name"].startswith("att-"))
    assert [a["predicateType"] for a in attesting["attestations"]] == types
    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert [a["type"] for a in verify["attestations"]] == types
    cluster = yaml.safe_load(webhook_documents(files)["ConfigMap"]["data"]["trust.yaml"])
    assert cluster["require"]["vex_current"] is True and cluster["require"]["attestations"] == ["sbom", "openvex"]


@pytest.mark.parametrize(("args", "message"), [
    (["attest", "127.0.0.1:5000/a/b:tag", "--variant", "v", "--sbom", "x.json", "--key", "k"], "not addressed by digest"),
    (["attest", f"127.0.0.1:5000/a/b@{DIGEST}", "--variant", "v", "--sbom", "missing.json", "--key", "k",
      "--policy", str(REPO_ROOT / "policies" / "vulnerabilities.yaml")],
     "missing.json: no such file"),
    (["show", "127.0.0.1:5000/a/b:tag", "--trust", "trust.yaml"], "not addressed by digest"),
])
def test_vex_bad_input_is_one_line_exit_2(tmp_path, args, message):
    run = run_imagebuild("vex", *args, cwd=tmp_path, env={"PYTHONPATH": str(REPO_ROOT)})
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and message in lines[0], run.stderr
