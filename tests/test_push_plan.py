"""The decisions of `imagebuild push` / `promote` without a registry: where images go, which release tags
may be written, whether the audit in the target passed, and what the audit log says about a forced move."""
from __future__ import annotations

import datetime as dt
import re

import pytest

from imagebuild.core.report import PushStage, StageStatus, VariantRecord
from imagebuild.core.source import InputError
from imagebuild.release import push_plan as plan
from imagebuild.release.push import PUSH_NEEDS

OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64
NOON = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)


# --- where a variant goes ----------------------------------------------------------------------------


def test_a_variant_lands_in_the_project_under_its_image_name():
    assert (plan.target_repository("harbor.example.com/release", "127.0.0.1:5000/imagebuild-example/paddle")
            == "harbor.example.com/release/paddle")
    assert plan.target_repository("127.0.0.1:5001/a/b/", "127.0.0.1:5000/paddle") == "127.0.0.1:5001/a/b/paddle"


NOT_REGISTRY_SLASH_REPOSITORY = "is not REGISTRY/REPOSITORY (e.g. harbor.example.com/paddle)"
NOT_LOWERCASE_SEGMENTS = ": a repository path is lowercase segments separated by single slashes"
NAMES_TAG_OR_DIGEST = "names a tag or digest; give a repository"


@pytest.mark.parametrize(("to", "reason"), [
    ("release", NOT_REGISTRY_SLASH_REPOSITORY), ("harbor.example.com", NOT_REGISTRY_SLASH_REPOSITORY),
    ("harbor.example.com/Release", NOT_LOWERCASE_SEGMENTS), ("harbor.example.com/release:3.3.1", NAMES_TAG_OR_DIGEST),
    ("harbor.example.com/r@sha256:" + "a" * 64, NAMES_TAG_OR_DIGEST), ("harbor.example.com//release", NOT_LOWERCASE_SEGMENTS),
])
def test_a_destination_that_is_not_a_registry_and_repository_is_refused(to, reason):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(to))} ?{re.escape(reason)}$"):
        plan.target_repository(to, "127.0.0.1:5000/paddle")


@pytest.mark.parametrize("tag", ["3.3.1", "2.6.2-gpu-cuda11.8-cudnn8.6", "latest", "_x"])
def test_release_tags_follow_the_distribution_spec(tag):
    assert plan.check_tag(tag) == tag


@pytest.mark.parametrize(("tag", "reason"), [
    *((tag, "is not a valid tag ([A-Za-z0-9_][A-Za-z0-9._-]{0,127})") for tag in ("", "-x", ".x", "a" * 129, "v1/2")),
    ("sha256-" + "a" * 64 + ".sig", ": sha256-* tags are cosign's signature and attestation tags"),
])
def test_a_malformed_tag_or_a_cosign_signature_tag_is_not_a_release_tag(tag, reason):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(tag))} ?{re.escape(reason)}$"):
        plan.check_tag(tag)


# --- release tags are immutable ----------------------------------------------------------------------


def test_an_absent_tag_is_written_and_one_naming_this_digest_is_left_alone():
    decisions = plan.decide_tags(NEW, {"3.3.1": None, "3.3": NEW}, plan.Force())
    assert [(d.tag, d.action) for d in decisions] == [("3.3.1", plan.TagAction.WRITE), ("3.3", plan.TagAction.PRESENT)]
    assert plan.refusals(decisions, "r.example.com/p/paddle") == []


def test_a_tag_naming_another_digest_is_refused_without_force():
    decisions = plan.decide_tags(NEW, {"3.3.1": OLD, "3.3": None}, plan.Force())
    assert decisions[0].action is plan.TagAction.REFUSE
    [why] = plan.refusals(decisions, "r.example.com/p/paddle")
    assert "r.example.com/p/paddle:3.3.1 already names " + OLD in why
    assert "immutable" in why and "--force --reason" in why


def test_force_with_a_reason_moves_the_tag():
    force = plan.Force.parse(True, "rebuilt for CVE-2026-1")
    decisions = plan.decide_tags(NEW, {"3.3.1": OLD}, force)
    assert decisions == [plan.TagDecision("3.3.1", plan.TagAction.MOVE, OLD, NEW)]
    assert force.reason == "rebuilt for CVE-2026-1"


@pytest.mark.parametrize(("force", "reason", "refusal"), [
    (True, None, "--force: needs --reason TEXT (it goes into the audit log)"),
    (True, "  ", "--force: needs --reason TEXT (it goes into the audit log)"),
    (False, "because", "--reason: only goes with --force"),
    (True, "two\nlines", "--reason: one line of at most 1000 characters"),
])
def test_force_needs_one_line_of_reason_and_a_reason_needs_force(force, reason, refusal):
    with pytest.raises(InputError, match=f"^{re.escape(refusal)}$"):
        plan.Force.parse(force, reason)


# --- the audit in the target ---------------------------------------------------------------------------


def facts(**changes) -> plan.AuditFacts:
    base = dict(digest=NEW, signature_verified=True, signature_reason="signed by imagebuild-local", key="cosign.pub",
                attestations=("gate", "sbom", "smoke", "vuln"))
    return plan.AuditFacts(**{**base, **changes})


def test_the_audit_passes_when_digest_signature_and_attestations_all_hold_in_the_target():
    result = plan.judge_audit(NEW, {"sbom", "vuln", "smoke", "gate"}, facts(), NOON)
    assert result.passed and result.problems == ()
    assert result.key == "cosign.pub"
    assert result.audited_at == "2026-12-01T12:00:00Z"


@pytest.mark.parametrize(("changes", "problem"), [
    ({"digest": None}, "the target holds nothing"),
    ({"digest": OLD}, f"the target holds {OLD}"),
    ({"signature_verified": False, "signature_reason": "not signed: no signature"}, "signature: not signed"),
    ({"attestations": ("sbom", "vuln")}, "attestations missing or not verifying in the target: gate, smoke"),
])
def test_the_audit_fails_on_any_missing_piece(changes, problem):
    result = plan.judge_audit(NEW, {"sbom", "vuln", "smoke", "gate"}, facts(**changes), NOON)
    assert not result.passed
    assert any(problem in p for p in result.problems), result.problems


def test_an_unverified_signature_names_no_key():
    result = plan.judge_audit(NEW, (), facts(signature_verified=False, key="cosign.pub"), NOON)
    assert result.key is None


# --- who moved a tag -------------------------------------------------------------------------------------


def test_the_audit_entry_says_who_what_when_from_to_and_why_and_no_secret():
    env = {"USER": "runner", "GITHUB_ACTOR": "octocat", "GITHUB_RUN_ID": "42", "GITHUB_REPOSITORY": "org/images",
           "COSIGN_PASSWORD": "canary-pw", "HARBOR_PASSWORD": "canary-harbor", "GITHUB_TOKEN": "canary-token"}
    decision = plan.TagDecision("3.3.1", plan.TagAction.MOVE, OLD, NEW)
    entry = plan.audit_entry(action="move-tag", repository="r.example.com/p/paddle", decision=decision,
                             reason="rebuilt", who=plan.actor(env), source=f"127.0.0.1:5000/x@{NEW}", now=NOON)
    assert entry == {"at": "2026-12-01T12:00:00Z", "action": "move-tag",
                     "who": {"user": "runner", "ci": {"GITHUB_ACTOR": "octocat", "GITHUB_REPOSITORY": "org/images",
                                                      "GITHUB_RUN_ID": "42"}},
                     "repository": "r.example.com/p/paddle", "tag": "3.3.1", "from_digest": OLD, "to_digest": NEW,
                     "source": f"127.0.0.1:5000/x@{NEW}", "reason": "rebuilt"}
    assert "canary" not in repr(entry)


# --- push refuses what was not signed for this very digest ---------------------------------------------


def variant(**stages) -> VariantRecord:
    passed = {
        "smoke": {"status": "passed", "digest": NEW, "tiers": ["import", "abi"]},
        "gate": {"status": "passed", "digest": NEW},
        "sign": {"status": "passed", "digest": NEW, "attestations": [{"type": "sbom"}]},
    }
    passed.update(stages)
    return VariantRecord.from_dict({
        "id": "paddle3.3.1-cpu", "tags": ["3.3.1"], "images": ["127.0.0.1:5000/x/paddle:3.3.1"], "chain": [],
        "device": "cpu", "paddle": "3.3.1", "python": "3.11", "cuda": None, "cudnn": None, "status": "built",
        "digest": NEW, "image": f"127.0.0.1:5000/x/paddle@{NEW}",
        "stages": {k: v for k, v in passed.items() if v is not None}})


def test_a_variant_signed_for_its_digest_may_be_pushed():
    assert variant().refusal(*PUSH_NEEDS) is None


@pytest.mark.parametrize(("sign", "why"), [
    (None, "not signed (run `imagebuild sign` first)"),
    ({"status": "failed", "digest": NEW, "reason": "cosign exited 1"}, "signing failed: cosign exited 1"),
    ({"status": "refused", "digest": NEW, "reason": "gate"}, "signing refused: gate"),
    ({"status": "interrupted", "digest": NEW}, "signing interrupted: no reason recorded"),
    ({"status": "passed", "digest": OLD}, f"signed {OLD}, but the variant is now {NEW} (rebuilt since; sign it again)"),
], ids=["no-record", "failed", "refused", "interrupted", "another-digest"])
def test_a_variant_not_signed_for_this_very_digest_is_refused(sign, why):
    assert variant(sign=sign).refusal(*PUSH_NEEDS) == f"paddle3.3.1-cpu: {why}"


def test_a_report_edited_to_skip_the_gate_is_still_refused():
    reason = variant(gate={"status": "failed", "digest": NEW, "blocking": []}).refusal(*PUSH_NEEDS)
    assert reason == "paddle3.3.1-cpu: the gate did not pass (failed)"


def test_the_push_record_round_trips_through_the_report():
    record = PushStage(status=StageStatus.PASSED, digest=NEW, target="r.example.com/p/paddle", tags=["3.3.1"],
                       bytes_uploaded=10, audit={"passed": True}, audited_at="2026-12-01T12:00:00Z",
                       extra={"from_a_newer_imagebuild": 1})
    again = PushStage.from_dict(record.to_dict())
    assert again == record
    assert variant(push=record.to_dict()).stage(PushStage) == record
