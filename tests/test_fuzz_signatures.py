"""Fuzzing the signature parsers of verify.py: DSSE envelopes (open_envelope), cosign's simple-signing
payload (check_simple_signing) and base64 (decode_base64). Their input comes from a registry, so
anyone who can push can hand them anything.

Whatever it is, they return or raise Refused (a verdict's one line) or ValueError, never anything
else; an envelope this test signs with a real key gets as far as the statement, so the statement
parser is fuzzed behind a valid signature too. Bounded to a few seconds each.
"""
from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imagebuild.trust.verify import (
    IN_TOTO_PAYLOAD_TYPE,
    Attestation,
    Key,
    Refused,
    check_simple_signing,
    decode_base64,
    open_envelope,
    pae,
)

# No example database: nothing written into the checkout; each run draws afresh.
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
DIGEST = "sha256:" + "ab" * 32
PRIVATE = ec.generate_private_key(ec.SECP256R1())
KEYS = [Key("fuzz", PRIVATE.public_key())]

json_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
WORDS = ["critical", "image", "docker-manifest-digest", "type", "identity", "docker-reference", "optional",
         "_type", "predicateType", "subject", "digest", "sha256", "predicate", "payloadType", "payload", "signatures",
         "sig", "keyid"]
VALUES = [DIGEST, "ab" * 32, "cosign container image signature", "https://in-toto.io/Statement/v1",
          "https://in-toto.io/Statement/v0.1", "https://slsa.dev/provenance/v1", IN_TOTO_PAYLOAD_TYPE,
          "127.0.0.1:5000/paddle", "127.0.0.1:5000/paddle:tag@" + DIGEST, "\x1b[2K\r", "\ud800", "", "a" * 300]
shaped = st.recursive(st.sampled_from(VALUES) | json_scalar,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(WORDS), inner,
                                                                                  max_size=5), max_leaves=30)


def _dumps(value: object) -> bytes:
    return json.dumps(value).encode("utf-8", "surrogatepass")


def _refused_or_value_error(call):
    try:
        return call()
    except (Refused, ValueError) as err:
        return err


# --- base64 -------------------------------------------------------------------------------------------


@FUZZ
@given(st.text(max_size=80) | st.binary(max_size=40) | json_value)
def test_decode_base64_gives_bytes_or_a_value_error(value):
    result = _refused_or_value_error(lambda: decode_base64(value))
    assert isinstance(result, (bytes, ValueError))


@FUZZ
@given(st.binary(max_size=64), st.booleans())
def test_decode_base64_reads_what_either_alphabet_wrote(data, urlsafe):
    text = (base64.urlsafe_b64encode(data).decode().rstrip("=") if urlsafe else base64.b64encode(data).decode())
    assert decode_base64(text) == data


# --- simple signing ---------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=200) | shaped.map(_dumps) | json_value.map(_dumps), st.sampled_from([None, "paddle"]))
def test_check_simple_signing_returns_or_refuses(payload, repository):
    result = _refused_or_value_error(lambda: check_simple_signing(payload, DIGEST, repository))
    assert result is None or isinstance(result, (str, Refused, ValueError))


@FUZZ
@given(shaped)
def test_only_a_payload_naming_this_digest_and_type_passes(critical):
    payload = _dumps({"critical": critical})
    result = _refused_or_value_error(lambda: check_simple_signing(payload, DIGEST))
    if not isinstance(result, (Refused, ValueError)):
        assert critical["type"] == "cosign container image signature"
        assert critical["image"]["docker-manifest-digest"] == DIGEST


# --- DSSE envelopes ---------------------------------------------------------------------------------------


def _signed(payload_type: str, payload: bytes) -> bytes:
    signature = PRIVATE.sign(pae(payload_type, payload), ec.ECDSA(hashes.SHA256()))
    return _dumps({"payloadType": payload_type, "payload": base64.b64encode(payload).decode(),
                   "signatures": [{"keyid": "", "sig": base64.b64encode(signature).decode()}]})


@FUZZ
@given(st.binary(max_size=300) | shaped.map(_dumps) | json_value.map(_dumps))
def test_any_envelope_blob_is_opened_or_refused(blob):
    result = _refused_or_value_error(lambda: open_envelope(blob, KEYS, DIGEST))
    assert isinstance(result, (Attestation, Refused, ValueError))


@FUZZ
@given(shaped | json_value, st.sampled_from([IN_TOTO_PAYLOAD_TYPE, "application/json", "\x1b[2K"]))
def test_any_statement_behind_a_valid_signature_is_read_or_refused(statement, payload_type):
    result = _refused_or_value_error(lambda: open_envelope(_signed(payload_type, _dumps(statement)), KEYS, DIGEST))
    assert isinstance(result, (Attestation, Refused, ValueError))
    if isinstance(result, Attestation):  # only a statement about this digest, with a predicate type, is read
        assert payload_type == IN_TOTO_PAYLOAD_TYPE
        assert result.predicate_type == statement["predicateType"] and result.key == "fuzz"
        assert any(s.get("sha256") == "ab" * 32 for s in statement["subject"] if isinstance(s.get("digest"), dict)
                   for s in [s["digest"]])
    if isinstance(result, Refused):
        assert "\x1b" not in result.reason  # a refusal quotes the registry's text escaped


@FUZZ
@given(st.binary(max_size=120))
def test_a_payload_of_any_bytes_behind_a_valid_signature_is_read_or_refused(payload):
    result = _refused_or_value_error(lambda: open_envelope(_signed(IN_TOTO_PAYLOAD_TYPE, payload), KEYS, DIGEST))
    assert isinstance(result, (Refused, ValueError))  # random bytes are never an in-toto statement


def test_an_envelope_whose_payload_type_is_a_lone_surrogate_is_refused():
    """JSON may write an unpaired surrogate (\\ud800); the DSSE pre-authentication encoding cannot
    encode it. Found by the fuzzer above (it escaped as UnicodeEncodeError, aborting the whole image's
    verification instead of rejecting one layer); now a refusal like any other malformed envelope."""
    blob = b'{"payloadType": "\\ud800", "payload": "e30=", "signatures": [{"sig": "AAAA"}]}'
    with pytest.raises(Refused, match="not a DSSE envelope"):
        open_envelope(blob, KEYS, DIGEST)
