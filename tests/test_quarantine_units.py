"""Quarantine marks are keyed by digest: one tag per digest in the state repository, never by a movable tag."""
from __future__ import annotations

import re

import pytest

from imagebuild.rollout.quarantine import parse_digest_of, quarantine_tag
from imagebuild.rollout.rescan import RescanResult

DIGEST = "sha256:" + "ab" * 32


def test_the_mark_of_a_digest_is_one_tag_a_registry_accepts():
    tag = quarantine_tag(DIGEST)
    assert tag == "quarantine-sha256-" + "ab" * 32
    assert len(tag) <= 128


@pytest.mark.parametrize("bad", ["sha256:abc", "md5:" + "0" * 32, "latest", "", "sha256:" + "G" * 64,
                                 "sha256:" + "../" * 21 + "a"])
def test_anything_but_a_sha256_digest_has_no_mark(bad):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(bad))} is not a sha256 digest$"):
        quarantine_tag(bad)


def test_an_image_is_named_by_its_digest_whichever_way_it_is_given():
    assert parse_digest_of(DIGEST) == DIGEST
    assert parse_digest_of(f"127.0.0.1:5001/imagebuild/paddle@{DIGEST}") == DIGEST
    with pytest.raises(ValueError, match="by digest"):
        parse_digest_of("127.0.0.1:5001/imagebuild/paddle:stable")


def test_only_a_passing_image_counts_as_not_failing():
    assert not RescanResult(DIGEST, "i", [], "passed").fails
    for status in ("quarantined", "still-quarantined", "failed"):
        assert RescanResult(DIGEST, "i", [], status).fails
