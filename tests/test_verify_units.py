"""The pure checks of imagebuild verify: signatures, payload claims, DSSE envelopes and the attestation policy.

Keys are generated here with `cryptography` (real signatures, nothing stubbed); the e2e tests in
tests/e2e/test_verify.py check the same code against cosign's own output.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import re

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from imagebuild.config.trust import PublicKey, Requirements
from imagebuild.core.source import InputError
from imagebuild.trust.verify import (
    ATTESTATION_TYPES,
    Attestation,
    Key,
    Refused,
    blocking_findings,
    check_blob,
    check_simple_signing,
    key_that_signed,
    load_key,
    open_envelope,
    pae,
    parse_image,
    requirement_failures,
)

DIGEST = "sha256:" + "a" * 64
OTHER_DIGEST = "sha256:" + "b" * 64
TODAY = dt.date(2026, 12, 1)


def pem(private_key) -> str:
    return private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def sign(private_key, message: bytes) -> bytes:
    if isinstance(private_key, ec.EllipticCurvePrivateKey):
        return private_key.sign(message, ec.ECDSA(hashes.SHA256()))
    if isinstance(private_key, rsa.RSAPrivateKey):
        return private_key.sign(message, padding.PKCS1v15(), hashes.SHA256())
    return private_key.sign(message)


def key(name: str, private_key) -> Key:
    return load_key(PublicKey(name, pem(private_key), "test"))


@pytest.fixture(scope="module")
def p256():
    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture(scope="module")
def other_p256():
    return ec.generate_private_key(ec.SECP256R1())


def simple_signing(digest: str) -> bytes:
    return json.dumps({"critical": {"identity": {"docker-reference": "127.0.0.1:5000/x"},
                                    "image": {"docker-manifest-digest": digest},
                                    "type": "cosign container image signature"},
                       "optional": None}, separators=(",", ":")).encode()


def envelope(private_key, predicate_type: str, predicate, subject_digest: str = DIGEST,
             payload_type: str = "application/vnd.in-toto+json") -> bytes:
    statement = {"_type": "https://in-toto.io/Statement/v0.1", "predicateType": predicate_type,
                 "subject": [{"name": "127.0.0.1:5000/x", "digest": {"sha256": subject_digest.split(":")[1]}}],
                 "predicate": predicate}
    payload = json.dumps(statement).encode()
    signature = sign(private_key, pae(payload_type, payload))
    return json.dumps({"payloadType": payload_type, "payload": base64.b64encode(payload).decode(),
                       "signatures": [{"keyid": "", "sig": base64.b64encode(signature).decode()}]}).encode()


# --- signatures -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: ec.generate_private_key(ec.SECP256R1()),
    lambda: ec.generate_private_key(ec.SECP384R1()),
    lambda: ed25519.Ed25519PrivateKey.generate(),
    lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
], ids=["ecdsa-p256", "ecdsa-p384", "ed25519", "rsa"])
def test_each_supported_key_type_verifies_its_own_signature_and_no_tampered_payload(make):
    private_key = make()
    payload = simple_signing(DIGEST)
    signature = sign(private_key, payload)
    keys = [key("k", private_key)]
    assert key_that_signed(keys, signature, payload) == keys[0]
    assert key_that_signed(keys, signature, payload.replace(b"a", b"b", 1)) is None


def test_during_a_key_rotation_either_key_verifies_and_the_verdict_can_name_which(p256, other_p256):
    keys = [key("old", p256), key("new", other_p256)]
    payload = simple_signing(DIGEST)
    assert key_that_signed(keys, sign(p256, payload), payload).name == "old"
    assert key_that_signed(keys, sign(other_p256, payload), payload).name == "new"


def test_a_signature_by_an_unconfigured_key_verifies_with_none(p256, other_p256):
    payload = simple_signing(DIGEST)
    assert key_that_signed([key("ours", p256)], sign(other_p256, payload), payload) is None


def test_garbage_signature_bytes_are_a_failed_check_not_an_error(p256):
    assert key_that_signed([key("ours", p256)], b"\x00not-der", b"payload") is None


def test_a_key_that_is_not_pem_is_bad_input_naming_its_source():
    with pytest.raises(InputError, match="^/keys/x.pub: keys: broken: not a PEM public key"):
        load_key(PublicKey("broken", "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "/keys/x.pub"))


def test_a_curve_cosign_does_not_sign_with_is_refused_as_unsupported():
    secp256k1 = ec.generate_private_key(ec.SECP256K1())
    with pytest.raises(InputError, match="unsupported key type"):
        load_key(PublicKey("k1", pem(secp256k1), "inline"))


# --- the simplesigning payload and the blob ---------------------------------------------------


def test_a_payload_naming_this_digest_passes():
    check_simple_signing(simple_signing(DIGEST), DIGEST)


def test_a_payload_naming_another_digest_is_refused_as_copied_or_moved():
    with pytest.raises(Refused, match=f"the signature is for {OTHER_DIGEST}, not this image's digest {DIGEST}") as refused:
        check_simple_signing(simple_signing(OTHER_DIGEST), DIGEST)
    assert OTHER_DIGEST in refused.value.reason and "not this image's digest" in refused.value.reason


@pytest.mark.parametrize("payload", [b"not json", b"{}", b'{"critical": {"image": {}}}', b"[]"])
def test_a_payload_that_is_not_simplesigning_is_refused(payload):
    with pytest.raises(Refused, match="not a cosign simplesigning document"):
        check_simple_signing(payload, DIGEST)


def test_a_payload_of_another_type_is_refused():
    payload = simple_signing(DIGEST).replace(b"cosign container image signature", b"something else")
    with pytest.raises(Refused, match="type 'something else'"):
        check_simple_signing(payload, DIGEST)


def test_a_blob_must_match_its_descriptor_digest_and_size():
    blob = b"signed payload"
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    check_blob({"digest": digest, "size": len(blob)}, blob)
    with pytest.raises(Refused, match="does not match its content"):
        check_blob({"digest": digest, "size": len(blob)}, blob + b"!")
    with pytest.raises(Refused, match="its descriptor says"):
        check_blob({"digest": digest, "size": len(blob) + 1}, blob)


# --- DSSE ---------------------------------------------------------------------------------------


def test_pae_is_dsse_v1_with_byte_lengths():
    assert pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    assert pae("t", "é".encode()) == "DSSEv1 1 t 2 é".encode()


def test_a_signed_statement_about_this_digest_opens_with_its_predicate_and_key(p256):
    smoke = ATTESTATION_TYPES["smoke"]
    attestation = open_envelope(envelope(p256, smoke, {"status": "passed"}), [key("ours", p256)], DIGEST)
    assert attestation == Attestation(smoke, {"status": "passed"}, "ours")


def test_an_envelope_signed_by_another_key_is_refused(p256, other_p256):
    with pytest.raises(Refused, match="not signed by any configured key"):
        open_envelope(envelope(other_p256, ATTESTATION_TYPES["smoke"], {}), [key("ours", p256)], DIGEST)


def test_an_envelope_whose_signature_covers_the_payload_but_not_the_type_is_refused(p256):
    """The signature is over PAE(type, payload): a payload re-labelled with another type fails."""
    document = json.loads(envelope(p256, ATTESTATION_TYPES["smoke"], {}))
    document["payloadType"] = "application/vnd.in-toto+json; evil"
    with pytest.raises(Refused, match="not signed by any configured key"):
        open_envelope(json.dumps(document).encode(), [key("ours", p256)], DIGEST)


def test_a_statement_about_another_digest_is_refused(p256):
    blob = envelope(p256, ATTESTATION_TYPES["vuln"], {}, subject_digest=OTHER_DIGEST)
    with pytest.raises(Refused, match=f"vuln attestation is about {OTHER_DIGEST}, not {DIGEST}"):
        open_envelope(blob, [key("ours", p256)], DIGEST)


def test_a_signed_payload_that_is_not_in_toto_is_refused(p256):
    with pytest.raises(Refused, match="not in-toto"):
        open_envelope(envelope(p256, "x", {}, payload_type="text/plain"), [key("ours", p256)], DIGEST)


NOT_DSSE = "an attestation layer is not a DSSE envelope"


@pytest.mark.parametrize(("blob", "reason"), [
    (b"", NOT_DSSE), (b"[]", NOT_DSSE), (b'{"payloadType": "x"}', NOT_DSSE),
    (b'{"payloadType": 1, "payload": "", "signatures": []}', NOT_DSSE),
    (b'{"payloadType": "x", "payload": "!!", "signatures": [{"sig": ""}]}',
     "an attestation is not signed by any configured key"),
])
def test_malformed_envelopes_are_refused_not_crashed_on(blob, reason, p256):
    with pytest.raises(Refused, match=f"^{reason}$"):
        open_envelope(blob, [key("ours", p256)], DIGEST)


# --- the policy over the attestations -----------------------------------------------------------

STRICT = Requirements(("sbom", "vuln", "smoke", "gate"), True, True, "CRITICAL")


def vuln_report(*findings: tuple[str, str, str]) -> dict:
    return {"invocation": {}, "scanner": {"uri": "trivy", "version": "0.76.0", "db": {},
                                          "result": {"Results": [
                                              {"Target": "debian", "Vulnerabilities": [
                                                  {"VulnerabilityID": v, "PkgName": p, "Severity": s}
                                                  for v, p, s in findings]},
                                              {"Target": "python", "Vulnerabilities": None}]}},
            "metadata": {}}


def attestations(smoke=None, gate=None, vuln=None, sbom=True) -> dict[str, Attestation]:
    found = {}
    if sbom:
        found[ATTESTATION_TYPES["sbom"]] = Attestation(ATTESTATION_TYPES["sbom"], {"bomFormat": "CycloneDX"}, "k")
    for kind, predicate in (("smoke", smoke), ("gate", gate), ("vuln", vuln)):
        if predicate is not None:
            found[ATTESTATION_TYPES[kind]] = Attestation(ATTESTATION_TYPES[kind], predicate, "k")
    return found


def passing(**changes) -> dict[str, Attestation]:
    parts = {"smoke": {"digest": DIGEST, "status": "passed"},
             "gate": {"digest": DIGEST, "decision": "passed", "exceptions_applied": []},
             "vuln": vuln_report(("CVE-2026-1", "zlib", "HIGH"))}
    parts.update(changes)
    return attestations(**parts)


def test_all_four_attestations_passing_for_this_digest_satisfy_the_strict_policy():
    assert requirement_failures(STRICT, passing(), DIGEST, TODAY) == []


def test_missing_attestations_are_named():
    failures = requirement_failures(STRICT, attestations(sbom=False, smoke={"digest": DIGEST, "status": "passed"}),
                                    DIGEST, TODAY)
    assert failures == ["attestations missing: sbom, vuln, gate"]


def test_smoke_results_for_another_digest_do_not_count():
    failures = requirement_failures(STRICT, passing(smoke={"digest": OTHER_DIGEST, "status": "passed"}), DIGEST, TODAY)
    assert failures == [f"the smoke attestation's results are for {OTHER_DIGEST}, not {DIGEST}"]


def test_failed_smoke_tests_and_a_blocked_gate_are_refused():
    failures = requirement_failures(STRICT, passing(smoke={"digest": DIGEST, "status": "failed"},
                                                    gate={"digest": DIGEST, "decision": "blocked"}), DIGEST, TODAY)
    assert failures == ["the smoke attestation says status failed", "the gate attestation says decision blocked"]


def test_an_unexcepted_critical_is_refused_and_named():
    failures = requirement_failures(STRICT, passing(vuln=vuln_report(("CVE-2026-9", "openssl", "CRITICAL"),
                                                                     ("CVE-2026-1", "zlib", "HIGH"))), DIGEST, TODAY)
    assert failures == ["unexcepted vulnerabilities at or above CRITICAL in the vuln attestation: "
                        "CVE-2026-9 (openssl, CRITICAL)"]


def test_a_critical_the_gate_excepted_for_this_digest_is_allowed():
    gate = {"digest": DIGEST, "decision": "passed",
            "exceptions_applied": [{"id": "CVE-2026-9", "package": "openssl", "expires": "2027-01-01"}]}
    assert requirement_failures(STRICT, passing(vuln=vuln_report(("CVE-2026-9", "openssl", "CRITICAL")), gate=gate),
                                DIGEST, TODAY) == []


def test_exceptions_of_a_gate_decision_for_another_digest_do_not_apply():
    vuln = vuln_report(("CVE-2026-9", "openssl", "CRITICAL"))
    gate = {"digest": OTHER_DIGEST, "decision": "passed", "exceptions_applied": [{"id": "CVE-2026-9"}]}
    failures = requirement_failures(Requirements((), False, False, "CRITICAL"), passing(vuln=vuln, gate=gate),
                                    DIGEST, TODAY)
    assert failures and "CVE-2026-9" in failures[0]


@pytest.mark.parametrize("exception, excepted", [
    ({"id": "CVE-2026-9"}, True),
    ({"id": "CVE-2026-9", "package": "openssl"}, True),
    ({"id": "CVE-2026-9", "package": "libssl3"}, False),
    ({"id": "CVE-2026-8"}, False),
    ({"id": "CVE-2026-9", "expires": "2026-12-01"}, True),
    ({"id": "CVE-2026-9", "expires": "2026-11-30"}, False),
    ({"id": "CVE-2026-9", "expires": "soon"}, False),
    ("CVE-2026-9", False),
])
def test_which_exceptions_excuse_a_finding(exception, excepted):
    vuln = vuln_report(("CVE-2026-9", "openssl", "CRITICAL"))
    assert (blocking_findings(vuln, [exception], "CRITICAL", TODAY) == []) is excepted


@pytest.mark.parametrize("threshold, blocked", [("CRITICAL", []), ("high", ["CVE-H"]), ("LOW", ["CVE-H", "CVE-L"]),
                                                ("UNKNOWN", ["CVE-H", "CVE-L", "CVE-U"])])
def test_block_severity_blocks_at_or_above_it(threshold, blocked):
    vuln = vuln_report(("CVE-H", "a", "HIGH"), ("CVE-L", "b", "LOW"), ("CVE-U", "c", "UNKNOWN"))
    assert [f.vulnerability for f in blocking_findings(vuln, [], threshold, TODAY)] == blocked


def test_block_severity_without_a_vuln_attestation_is_refused_even_when_not_required_by_name():
    failures = requirement_failures(Requirements((), False, False, "CRITICAL"), attestations(), DIGEST, TODAY)
    assert failures == ["no vuln attestation to check block_severity CRITICAL against"]


def test_a_vuln_predicate_without_a_trivy_report_is_refused():
    failures = requirement_failures(Requirements((), False, False, "HIGH"), passing(vuln={"scanner": {}}), DIGEST, TODAY)
    assert failures == ["the vuln attestation's predicate is not cosign's vuln shape with a Trivy report"]


def test_many_blocking_findings_are_summarised_in_one_line():
    vuln = vuln_report(*[(f"CVE-{i}", "p", "CRITICAL") for i in range(5)])
    [failure] = requirement_failures(Requirements((), False, False, "CRITICAL"), passing(vuln=vuln), DIGEST, TODAY)
    assert failure.endswith("CVE-2 (p, CRITICAL) and 2 more") and "\n" not in failure


# --- image references -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["127.0.0.1:5000/imagebuild/paddle:3.3.1", f"127.0.0.1:5000/a/b@{DIGEST}",
                                  "debian:12", f"registry.example.com/x/y:tag@{DIGEST}"])
def test_tag_and_digest_references_parse(text):
    parse_image(text)


@pytest.mark.parametrize(("text", "reason"), [
    ("", "the image reference is empty"),
    (" 127.0.0.1:5000/x:1", "' 127.0.0.1:5000/x:1' has a space, control or non-ASCII character"),
    ("127.0.0.1:5000/X:1", "repository 'X' is not lowercase path components"),
    ("127.0.0.1:5000/x:-bad", "tag '-bad' is not 1-128 of A-Z a-z 0-9 _ . -"),
    ("127.0.0.1:5000/x@sha256:abc", "digest 'sha256:abc' is not sha256:<64 hex> or sha512:<128 hex>"),
    ("127.0.0.1:5000/x@md5:" + "a" * 32, f"digest 'md5:{'a' * 32}' is not sha256:<64 hex>"),
    ("127.0.0.1:5000/x\n:1", "'127.0.0.1:5000/x\\n:1' has a space, control or non-ASCII character"),
])
def test_malformed_references_are_refused_with_a_reason(text, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_image(text)


def test_json_nested_past_the_parser_is_a_refusal_not_a_crash(p256):
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(Refused, match=f"^{NOT_DSSE}$"):
        open_envelope(deep, [key("ours", p256)], DIGEST)
    with pytest.raises(Refused, match="^signature payload is not a cosign simplesigning document$"):
        check_simple_signing(deep, DIGEST)
