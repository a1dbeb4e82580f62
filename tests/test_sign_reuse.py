"""Whether `imagebuild sign` may reuse a signature already in the registry instead of signing again.

The decision is pure (signed_by over the `.sig` tag's layers); keys are generated here and signed
with for real. The public key comes from the real `cosign public-key`. The registry side, with a
fresh workdir signing the same digest again, is in tests/e2e/test_sign.py.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.core.report import SignStage, StageStatus, parse_stage
from imagebuild.core.source import InputError
from imagebuild.trust import sign

from .test_verify_units import key, pem
from .test_verify_units import sign as sign_bytes

DIGEST = "sha256:" + "d" * 64
OTHER_DIGEST = "sha256:" + "e" * 64
COSIGN = "/opt/imagebuild-tools/bin/cosign"


def payload(digest: str = DIGEST) -> bytes:
    """cosign's simplesigning document for a digest, as `cosign sign` writes it."""
    return json.dumps({"critical": {"identity": {"docker-reference": "127.0.0.1:5000/imagebuild-example/paddle"},
                                    "image": {"docker-manifest-digest": digest},
                                    "type": "cosign container image signature"},
                       "optional": None}).encode()


def layer(private_key, digest: str = DIGEST, **annotations: str) -> sign.SignatureLayer:
    body = payload(digest)
    signature = base64.b64encode(sign_bytes(private_key, body)).decode()
    return sign.SignatureLayer({sign.SIGNATURE_ANNOTATION: signature, **annotations}, body)


@pytest.fixture(scope="module")
def ours():
    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture(scope="module")
def theirs():
    return ec.generate_private_key(ec.SECP256R1())


def test_this_keys_signature_of_this_digest_is_reused(ours):
    assert sign.signed_by([layer(ours)], key("ours", ours), DIGEST, tlog=False)


def test_another_keys_signature_is_not_ours_to_reuse(ours, theirs):
    assert not sign.signed_by([layer(theirs)], key("ours", ours), DIGEST, tlog=False)
    # beside it, ours is found (a key rotation leaves both in the tag)
    assert sign.signed_by([layer(theirs), layer(ours)], key("ours", ours), DIGEST, tlog=False)


def test_our_signature_of_another_digest_is_not_reused(ours):
    """A layer copied from another image's tag verifies with our key but names another digest."""
    assert not sign.signed_by([layer(ours, OTHER_DIGEST)], key("ours", ours), DIGEST, tlog=False)


def test_a_signature_over_other_bytes_than_its_payload_is_not_reused(ours):
    forged = layer(ours)
    tampered = sign.SignatureLayer(forged.annotations, forged.payload.replace(b'"optional": null', b'"optional": {}'))
    assert sign.names_digest(tampered.payload, DIGEST)  # it still names the digest; only the signature fails
    assert not sign.signed_by([tampered], key("ours", ours), DIGEST, tlog=False)


@pytest.mark.parametrize("annotation", ["", "not base64 !!", "c2lnbmF0dXJl"], ids=["empty", "not-base64", "garbage"])
def test_a_layer_with_a_broken_signature_annotation_is_passed_over(ours, annotation):
    broken = sign.SignatureLayer({sign.SIGNATURE_ANNOTATION: annotation}, payload())
    assert not sign.signed_by([broken], key("ours", ours), DIGEST, tlog=False)
    assert sign.signed_by([broken, layer(ours)], key("ours", ours), DIGEST, tlog=False)


def test_with_the_transparency_log_only_a_signature_carrying_its_rekor_bundle_is_reused(ours):
    offline = layer(ours)
    uploaded = layer(ours, **{sign.BUNDLE_ANNOTATION: '{"SignedEntryTimestamp": "..."}'})
    assert not sign.signed_by([offline], key("ours", ours), DIGEST, tlog=True)
    assert sign.signed_by([offline, uploaded], key("ours", ours), DIGEST, tlog=True)
    assert sign.signed_by([uploaded], key("ours", ours), DIGEST, tlog=False)


def test_only_key_based_signing_reuses_a_signature():
    assert sign.can_reuse_signature(sign.SignOptions(key="/keys/cosign.key"))
    assert sign.can_reuse_signature(sign.SignOptions(key="awskms:///alias/imagebuild"))
    keyless = sign.SignOptions(keyless=sign.Keyless(oidc_provider="github-actions"))
    assert not sign.can_reuse_signature(keyless)
    with pytest.raises(ValueError, match="keyless"):
        sign.public_key_argv(COSIGN, keyless, Path("/tmp/k.pub"))


def test_the_public_key_is_asked_by_reference_and_never_with_the_password(monkeypatch):
    monkeypatch.setenv("COSIGN_PASSWORD", "canary-password-0123")
    argv = sign.public_key_argv(COSIGN, sign.SignOptions(key="awskms:///alias/imagebuild"), Path("/s/k.pub"))
    assert argv == [COSIGN, "public-key", "--key", "awskms:///alias/imagebuild", "--outfile", "/s/k.pub"]


def test_the_signing_key_is_read_as_verify_reads_keys(ours):
    loaded = sign.signing_key(pem(ours), "/keys/cosign.key")
    assert loaded.name == "/keys/cosign.key"
    assert sign.signed_by([layer(ours)], loaded, DIGEST, tlog=False)
    with pytest.raises(InputError, match="not a PEM public key"):
        sign.signing_key("-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n", "/keys/cosign.key")


def test_the_line_says_whether_the_signature_was_reused():
    record = SignStage(status=StageStatus.PASSED, digest=DIGEST, signature_reused=True,
                       attestations=[{"type": "sbom"}] * 6)
    assert sign.done_message(record, sign.SignerKey()) == "signature already present by this key: reused; 6 attestations"
    record.signature_reused = False
    problem = sign.SignerKey(problem="cosign public-key failed (exit 1)")
    assert sign.done_message(record, problem) == (
        "signed; 6 attestations (not checked for an earlier signature: cosign public-key failed (exit 1))")


def test_the_reuse_is_recorded_and_an_older_record_reads_as_signed_now():
    record = parse_stage("sign", {"status": "passed", "digest": DIGEST, "signature_reused": True})
    assert isinstance(record, SignStage) and record.signature_reused is True and record.extra == {}
    assert record.to_dict()["signature_reused"] is True
    older = parse_stage("sign", {"status": "passed", "digest": DIGEST})
    assert isinstance(older, SignStage) and older.signature_reused is False


# --- the real `cosign public-key`: asked once per run, the password only in the environment -----------


@pytest.fixture
def key_pair(tmp_path) -> tuple[Path, str]:
    """A key pair of the test's own, made by the real cosign, and its password."""
    password = "reuse-test-password-4711"
    made = subprocess.run([sign.Cosign.find().path, "generate-key-pair"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "COSIGN_PASSWORD": password}, timeout=60)
    assert made.returncode == 0, made.stderr
    return tmp_path / "cosign.key", password


def counting_cosign(tmp_path: Path) -> tuple[sign.Cosign, Path]:
    """The real cosign behind a wrapper that notes each command it is given (one line per run)."""
    real = sign.Cosign.find()
    calls = tmp_path / "calls"
    wrapper = tmp_path / "cosign-counting"
    wrapper.write_text(f'#!/bin/sh\necho "$1" >> {calls}\nexec {real.path} "$@"\n')
    wrapper.chmod(0o755)
    return sign.Cosign(str(wrapper), real.version), calls


def test_the_public_key_is_cosigns_and_asked_once_per_run(tmp_path, monkeypatch, key_pair):
    key_file, password = key_pair
    monkeypatch.setenv("COSIGN_PASSWORD", password)
    cosign, calls = counting_cosign(tmp_path)
    run = sign.SignRun(tmp_path / "work" / "build-report.json", sign.SignOptions(key=str(key_file)), cosign)

    first, second = run.signer_key(), run.signer_key()

    assert first is second and first.problem is None and first.key is not None
    assert calls.read_text().split() == ["public-key"]
    expected = sign.signing_key(key_file.with_name("cosign.pub").read_text(), str(key_file))
    assert first.key.public_key.public_numbers() == expected.public_key.public_numbers()  # type: ignore[union-attr]
    log = (tmp_path / "work" / "sign" / "cosign-public-key.log").read_text()
    assert password not in log


def test_a_wrong_password_leaves_the_run_signing_as_before_and_says_why(tmp_path, monkeypatch, key_pair):
    key_file, password = key_pair
    monkeypatch.setenv("COSIGN_PASSWORD", password + "-wrong")
    cosign, _ = counting_cosign(tmp_path)
    signer = sign.SignRun(tmp_path / "work" / "build-report.json", sign.SignOptions(key=str(key_file)),
                          cosign).signer_key()
    assert signer.key is None and signer.problem is not None
    assert signer.problem.startswith("cosign public-key failed (exit 1)")
    assert password not in signer.problem


def test_keyless_asks_cosign_for_nothing(tmp_path):
    cosign, calls = counting_cosign(tmp_path)
    options = sign.SignOptions(keyless=sign.Keyless(oidc_provider="github-actions"))
    assert sign.SignRun(tmp_path / "build-report.json", options, cosign).signer_key() == sign.SignerKey()
    assert not calls.exists()
