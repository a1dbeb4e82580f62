"""Which attestations count: decided by signed content, never by the order of the `.att` layers.

The `.att` manifest is not signed, so whoever can push to the repository can reorder its layers,
drop some, or re-add an older one that is still validly signed. These are the rules
(`verify.choose_attestations`) that `verify`, `inspect`, the webhook and push's audit share, and the
identity check on a signature's `docker-reference`.
"""
from __future__ import annotations

import itertools
import json

import pytest

from imagebuild.trust.provenance import canonical_sha256
from imagebuild.trust.verify import (
    ATTESTATION_TYPES,
    Attestation,
    Refused,
    check_simple_signing,
    choose_attestations,
    safe_text,
    signed_time,
)

DIGEST = "sha256:" + "a" * 64
VULN, SMOKE, RELEASE = ATTESTATION_TYPES["vuln"], ATTESTATION_TYPES["smoke"], ATTESTATION_TYPES["release"]


def statement(predicate_type: str, predicate: dict) -> Attestation:
    return Attestation(predicate_type, predicate, "ours", canonical_sha256(predicate))


def vuln(finished: str, severity: str) -> Attestation:
    return statement(VULN, {"scanner": {"result": {"Results": [{"Vulnerabilities": [
        {"VulnerabilityID": "CVE-1", "PkgName": "zlib", "Severity": severity}]}]}},
        "metadata": {"scanStartedOn": finished, "scanFinishedOn": finished}})


def release(issued_at: str | None, **vouched: Attestation) -> Attestation:
    predicate: dict = {"digest": DIGEST, "attestations": {name: a.content_sha256 for name, a in vouched.items()}}
    if issued_at is not None:
        predicate["issued_at"] = issued_at
    return statement(RELEASE, predicate)


OLD_CLEAN = vuln("2026-11-01T00:00:00Z", "LOW")
NEW_CRITICAL = vuln("2026-11-20T00:00:00Z", "CRITICAL")
OLD_RECORD = release("2026-11-01T00:05:00Z", vuln=OLD_CLEAN)
NEW_RECORD = release("2026-11-20T00:05:00Z", vuln=NEW_CRITICAL)


@pytest.mark.parametrize("layers", list(itertools.permutations([OLD_CLEAN, OLD_RECORD, NEW_CRITICAL, NEW_RECORD])))
def test_in_any_layer_order_the_newest_release_record_decides_which_vuln_report_counts(layers):
    chosen, ignored = choose_attestations(layers)
    assert chosen[VULN] is NEW_CRITICAL and chosen[RELEASE] is NEW_RECORD
    assert "a vuln attestation the release record does not vouch for (superseded)" in ignored


def test_the_reverse_an_old_critical_report_re_added_after_a_clean_rescan_is_ignored():
    old_critical, new_clean = vuln("2026-11-01T00:00:00Z", "CRITICAL"), vuln("2026-11-20T00:00:00Z", "LOW")
    records = [release("2026-11-01T00:05:00Z", vuln=old_critical), release("2026-11-20T00:05:00Z", vuln=new_clean)]
    chosen, _ = choose_attestations([new_clean, records[1], old_critical, records[0]][::-1])
    assert chosen[VULN] is new_clean


def test_removing_the_newest_release_record_while_its_newer_report_stays_refuses():
    with pytest.raises(Refused, match="made after the newest release record"):
        choose_attestations([NEW_CRITICAL, OLD_CLEAN, OLD_RECORD])


def test_two_different_reports_of_one_kind_without_a_release_record_conflict():
    with pytest.raises(Refused, match="2 different vuln attestations and no release record"):
        choose_attestations([OLD_CLEAN, NEW_CRITICAL])


def test_the_same_statement_twice_is_one_statement():
    chosen, ignored = choose_attestations([OLD_CLEAN, statement(VULN, json.loads(json.dumps(OLD_CLEAN.predicate)))])
    assert chosen[VULN] == OLD_CLEAN and ignored == []


@pytest.mark.parametrize("times", [(None, "2026-11-01T00:00:00Z"), ("2026-11-01T00:00:00Z", "2026-11-01T00:00:00Z")])
def test_release_records_that_cannot_be_ordered_conflict(times):
    records = [release(times[0], vuln=OLD_CLEAN), release(times[1], vuln=NEW_CRITICAL)]
    with pytest.raises(Refused, match="release records"):
        choose_attestations([OLD_CLEAN, NEW_CRITICAL, *records])


def test_a_vouched_for_attestation_that_was_removed_is_missing_not_replaced_by_another():
    chosen, ignored = choose_attestations([OLD_CLEAN, NEW_RECORD])
    assert VULN not in chosen
    assert "the vuln attestation the release record vouches for is absent" in ignored


def test_kinds_a_release_record_does_not_name_follow_the_one_statement_rule():
    smoke = statement(SMOKE, {"digest": DIGEST, "status": "passed"})
    chosen, _ = choose_attestations([NEW_CRITICAL, NEW_RECORD, smoke])
    assert chosen[SMOKE] is smoke


def test_signed_times_are_read_from_the_predicate_in_rfc3339_only():
    assert signed_time(OLD_RECORD) is not None and signed_time(NEW_CRITICAL) > signed_time(OLD_CLEAN)
    assert signed_time(statement(SMOKE, {"issued_at": "yesterday"})) is None
    assert signed_time(statement(SMOKE, {"issued_at": "2026-11-01T00:00:00.123456789Z"})).microsecond == 123456


# --- the signed repository -----------------------------------------------------------------------


def payload(reference: object, digest: str = DIGEST) -> bytes:
    return json.dumps({"critical": {"identity": {"docker-reference": reference},
                                    "image": {"docker-manifest-digest": digest},
                                    "type": "cosign container image signature"}}).encode()


def test_a_signature_for_the_same_path_in_another_registry_counts():
    assert check_simple_signing(payload("127.0.0.1:5000/team/paddle"), DIGEST, "team/paddle") == "team/paddle"


def test_a_signature_naming_another_repository_is_refused():
    with pytest.raises(Refused, match="signature is for repository team/debug-tools, not team/paddle"):
        check_simple_signing(payload("127.0.0.1:5000/team/debug-tools"), DIGEST, "team/paddle")


def test_by_default_the_same_image_name_in_another_project_counts_a_promotion():
    assert check_simple_signing(payload("127.0.0.1:5000/staging/paddle"), DIGEST, "prod/paddle") == "staging/paddle"


def test_with_signed_identity_repository_the_whole_path_must_match():
    with pytest.raises(Refused, match="signature is for repository staging/paddle, not prod/paddle"):
        check_simple_signing(payload("127.0.0.1:5000/staging/paddle"), DIGEST, "prod/paddle", match="repository")


@pytest.mark.parametrize("reference", [None, 7, "", "NOT A REFERENCE", "x" * 2000])
def test_a_signature_naming_no_usable_repository_is_refused(reference):
    with pytest.raises(Refused, match="names no repository"):
        check_simple_signing(payload(reference), DIGEST, "team/paddle")


def test_text_from_a_registry_is_escaped_for_the_terminal():
    assert safe_text("\x1b[2K\r\u2714 verified\u202e") == "\\x1b[2K\\r\u2714 verified\\u202e"
    assert len(safe_text("x" * 1000, 50)) == 50
