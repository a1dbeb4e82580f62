"""What the webhook reads of a quarantine mark (imagebuild/admission/quarantine.py): the pure checks.

The marks themselves are read from a real registry in tests/e2e/test_admission.py.
"""
from __future__ import annotations

import json

import pytest

from imagebuild.admission.quarantine import MarkUnreadable, _describe, _only_layer, with_quarantine
from imagebuild.rollout.quarantine import MEDIA_TYPE

DIGEST = "sha256:" + "d" * 64


def manifest(*layers: dict) -> bytes:
    return json.dumps({"schemaVersion": 2, "layers": list(layers)}).encode()


def layer(**changes) -> dict:
    return {"mediaType": MEDIA_TYPE, "digest": DIGEST, "size": 300, **changes}


def test_the_one_layer_of_a_mark_is_its_digest():
    assert _only_layer(manifest(layer())) == DIGEST


@pytest.mark.parametrize(("raw", "expected"), [
    (b"not json", "no layer"),
    (manifest(), "no layer"),
    (manifest(layer(), layer()), "exactly one layer"),
    (manifest(layer(digest="sha256:../../other/blobs/x")), "not sha256:<64 hex digits>"),
    (manifest(layer(digest="sha512:" + "d" * 128)), "not sha256:<64 hex digits>"),
    (manifest(layer(size=1 << 30)), "size"),
    (manifest(layer(mediaType="application/octet-stream")), MEDIA_TYPE),
])
def test_a_mark_that_is_not_one_small_quarantine_layer_is_unreadable(raw, expected):
    with pytest.raises(MarkUnreadable, match=expected.replace("[", r"\[").replace("+", r"\+")):
        _only_layer(raw)


def test_the_reason_is_escaped_and_a_mark_naming_another_digest_still_refuses():
    record = {"digest": DIGEST, "since": "2026-12-01T00:00:00Z", "source": "rescan", "reason": "CVE\x1b[2J"}
    assert _describe(record, DIGEST, "r/s") == "quarantined since 2026-12-01T00:00:00Z (rescan): CVE\\x1b[2J"
    assert _describe({**record, "digest": "sha256:" + "e" * 64}, DIGEST, "r/s").startswith(
        f"quarantined: the mark for {DIGEST} in r/s names sha256:eee")


def test_without_a_quarantine_source_the_verdict_is_the_verifier_s():
    verify = lambda image: image  # noqa: E731 -- the very function comes back
    assert with_quarantine(verify, None) is verify
