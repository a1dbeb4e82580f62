"""imagebuild/release/harbor.py's pure part: input checks, the requests it builds, reading Harbor's answers.

Every request body is also checked against Harbor's OpenAPI definitions, the same check the
stand-in applies, so a builder cannot drift even where no end-to-end test reaches it.
"""
from __future__ import annotations

import re
import time

import pytest

from imagebuild.oci.retry import parse_retry_after
from imagebuild.release import harbor

from .harbor_standin import HarborSpec

DIGEST = "sha256:" + "0f" * 32


@pytest.fixture(scope="module")
def spec() -> HarborSpec:
    return HarborSpec()


def test_release_project_metadata_is_what_a_release_needs(spec):
    body = harbor.project_request("paddle", harbor.ProjectSettings())
    assert body == {"project_name": "paddle", "metadata": {
        "public": "false", "auto_scan": "true", "prevent_vul": "true", "severity": "high",
        "enable_content_trust_cosign": "true", "reuse_sys_cve_allowlist": "true"}}
    assert spec.definition_errors("ProjectReq", body, request=True) == []


def test_project_settings_follow_the_options():
    metadata = harbor.ProjectSettings(public=True, severity="critical").metadata()
    assert metadata["public"] == "true" and metadata["severity"] == "critical"


def test_metadata_drift_names_only_the_keys_that_differ():
    current = {"public": "false", "auto_scan": "false", "retention_id": "7"}
    wanted = {"public": "false", "auto_scan": "true", "prevent_vul": "true"}
    assert harbor.metadata_drift(current, wanted) == {"auto_scan": ("false", "true"), "prevent_vul": (None, "true")}
    assert harbor.metadata_drift(wanted, wanted) == {}


@pytest.mark.parametrize("name", ["paddle", "paddle-release", "a.b_c-1", "9"])
def test_accepts_harbor_project_names(name):
    harbor.check_name("project", name)


@pytest.mark.parametrize("name", ["Paddle", "paddle/gpu", "-paddle", "paddle-", "pad--dle", "", "päddle", "a" * 256])
def test_refuses_names_harbor_refuses(name):
    with pytest.raises(ValueError, match="not a valid Harbor project name"):
        harbor.check_name("project", name)


def test_immutable_rule_selects_release_tags_of_every_repository(spec):
    body = harbor.immutable_rule_body("[0-9]*")
    assert body["tag_selectors"] == [{"kind": "doublestar", "decoration": "matches", "pattern": "[0-9]*"}]
    assert body["scope_selectors"] == {"repository": [{"kind": "doublestar", "decoration": "repoMatches", "pattern": "**"}]}
    assert (body["action"], body["template"], body["disabled"]) == ("immutable", "immutable_template", False)
    assert spec.definition_errors("ImmutableRule", body, request=True) == []
    assert spec.definition_errors("ImmutableRule", harbor.immutable_rule_body("v*", rule_id=3), request=True) == []


@pytest.mark.parametrize("pattern, release_tag", [
    ("[0-9]*", "3.0.0-gpu-cuda12.6-cudnn9.5"), ("v*", "v3.0.0"), ("{v,release-}*", "release-2026.11"),
    ("3.0.?", "3.0.1"), ("[!s]*", "latest-stable"),
])
def test_release_patterns_match_release_tags_and_leave_cosign_tags_writable(pattern, release_tag):
    harbor.check_release_pattern(pattern)
    regex = harbor.doublestar_regex(pattern)
    assert regex.match(release_tag)
    assert not any(regex.match(tag) for tag in harbor.COSIGN_TAG_SAMPLES)


@pytest.mark.parametrize("pattern", ["*", "**", "sha256-*", "s*", "*.sig", "*.att", "*[0-9a-f]", "{v,sha}*", "?*"])
def test_refuses_patterns_that_would_freeze_cosign_signature_tags(pattern):
    with pytest.raises(ValueError, match="cosign's signature and attestation tags"):
        harbor.check_release_pattern(pattern)


@pytest.mark.parametrize(("pattern", "reason"), [
    ("", "is not a tag pattern (no spaces or slashes"), ("v *", "is not a tag pattern (no spaces or slashes"),
    ("a/b", "is not a tag pattern (no spaces or slashes"), ("[0-9", "is not a doublestar pattern: unclosed ["),
    ("{v,w", "is not a doublestar pattern: unclosed {"), ("x" * 129, "is not a tag pattern (no spaces or slashes"),
])
def test_refuses_text_that_is_no_tag_pattern(pattern, reason):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(pattern))} {re.escape(reason)}"):
        harbor.check_release_pattern(pattern)


def test_read_rule_understands_what_harbor_lists():
    raw = {"id": 5, "disabled": True, "tag_selectors": [{"kind": "doublestar", "decoration": "matches", "pattern": "v*"}],
           "scope_selectors": {"repository": [{"kind": "doublestar", "decoration": "repoMatches", "pattern": "**"}]}}
    assert harbor.read_rule(raw) == harbor.ImmutableRule(5, "v*", "matches", "**", "repoMatches", True)
    assert harbor.read_rule({"id": 6, "tag_selectors": []}) is None


def test_ci_robot_may_push_pull_and_read_artifacts_of_its_project_only(spec):
    body = harbor.robot_request("paddle", harbor.RobotSpec("ci", duration_days=30))
    assert body["name"] == "ci" and body["level"] == "project" and body["duration"] == 30 and body["disable"] is False
    assert "secret" not in body  # Harbor generates it
    (permission,) = body["permissions"]
    assert (permission["kind"], permission["namespace"]) == ("project", "paddle")
    assert {(a["resource"], a["action"]) for a in permission["access"]} == {
        ("repository", "push"), ("repository", "pull"), ("artifact", "read")}
    assert spec.definition_errors("RobotCreate", body, request=True) == []


def test_robot_update_keeps_existing_access_and_adds_what_ci_needs(spec):
    raw = {"id": 9, "name": "robot$paddle+ci", "level": "project", "duration": 30, "disable": True,
           "description": "old", "permissions": [{"kind": "project", "namespace": "paddle",
                                                  "access": [{"resource": "tag", "action": "list", "effect": "allow"}]}]}
    body = harbor.robot_update_body(raw, "paddle")
    assert body["disable"] is False and body["name"] == "robot$paddle+ci" and body["duration"] == 30
    access = {(a["resource"], a["action"]) for a in body["permissions"][0]["access"]}
    assert access == {("tag", "list"), *harbor.ROBOT_ACCESS}
    assert spec.definition_errors("Robot", body, request=True) == []


def test_read_robot_collects_the_allowed_access_in_its_project():
    raw = {"id": 2, "name": "robot$paddle+ci", "level": "project", "disable": False, "expires_at": 99,
           "permissions": [{"kind": "project", "namespace": "paddle", "access": [
               {"resource": "repository", "action": "push", "effect": "allow"},
               {"resource": "repository", "action": "pull", "effect": "deny"}]},
               {"kind": "project", "namespace": "other", "access": [{"resource": "artifact", "action": "read"}]}]}
    robot = harbor.read_robot(raw, "paddle")
    assert robot.access == {("repository", "push")} and robot.expires_at == 99 and not robot.disabled


@pytest.mark.parametrize("full, expected", [
    ("robot$paddle+ci", True), ("bot_paddle+ci", False), ("custom$paddle+ci", True),
    ("robot$paddle+ci2", False), ("robot$xpaddle+ci", False), ("robot$other+ci", False),
])
def test_robot_names_match_whatever_prefix_harbor_uses(full, expected):
    assert harbor.robot_full_name_matches(full, "paddle", "ci") is expected


def test_repository_names_are_encoded_twice_in_paths():
    assert harbor.repository_segment("paddle/gpu") == "paddle%252Fgpu"
    assert harbor.repository_segment("cpu") == "cpu"


@pytest.mark.parametrize("text, project, repository", [
    (f"paddle/gpu@{DIGEST}", "paddle", "gpu"),
    (f"paddle/paddle/gpu@{DIGEST}", "paddle", "paddle/gpu"),
    (f"harbor.example.com/paddle/gpu@{DIGEST}", "paddle", "gpu"),
    (f"127.0.0.1:8443/paddle/a/b@{DIGEST}", "paddle", "a/b"),
])
def test_parses_images_by_digest(text, project, repository):
    assert harbor.parse_artifact(text) == harbor.ArtifactRef(project, repository, DIGEST)


@pytest.mark.parametrize(("text", "reason"), [
    ("paddle/gpu:3.0.0", "give the image by digest, PROJECT/REPOSITORY@sha256:<64 hex digits>"),
    ("paddle/gpu@sha256:abc", "digest 'sha256:abc' is not sha256:<64 hex>"),
    ("gpu@" + DIGEST, "expected PROJECT/REPOSITORY@DIGEST (a Harbor repository is inside a project)"),
    ("Paddle/gpu@" + DIGEST, "registry host 'Paddle' has no dot or port"),
    ("paddle//gpu@" + DIGEST, "repository 'paddle//gpu' is not lowercase path components"),
    ("paddle/GPU@" + DIGEST, "repository 'paddle/GPU' is not lowercase path components"),
])
def test_refuses_images_that_are_not_project_repository_at_digest(text, reason):
    with pytest.raises(ValueError, match=f"^{re.escape(repr(text))}: {re.escape(reason)}"):
        harbor.parse_artifact(text)


def test_reads_the_scan_overview_harbor_returns(spec):
    artifact = {"digest": DIGEST, "scan_overview": {harbor.VULN_REPORT_MIMES[0]: {
        "scan_status": "Success", "severity": "High", "end_time": "2026-11-30T10:00:00Z",
        "summary": {"total": 7, "fixable": 2, "summary": {"High": 2, "Medium": 5}},
        "scanner": {"name": "Trivy", "vendor": "Aqua Security", "version": "v0.50.1"}}}}
    assert spec.definition_errors("Artifact", artifact, request=False) == []
    ref = harbor.ArtifactRef("paddle", "gpu", DIGEST)
    overview = harbor.read_scan_overview(ref, artifact)
    assert (overview.status, overview.severity, overview.total, overview.fixable) == ("Success", "High", 7, 2)
    assert overview.counts == {"High": 2, "Medium": 5} and overview.scanner == "Trivy v0.50.1"
    assert harbor.read_scan_overview(ref, {"digest": DIGEST}).status == "not scanned"


@pytest.mark.parametrize("url, expected", [
    ("https://harbor.example.com", "https://harbor.example.com"),
    ("https://harbor.example.com:8443/", "https://harbor.example.com:8443"),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"), ("http://localhost", "http://localhost"),
])
def test_accepts_harbor_addresses(url, expected):
    assert harbor.check_base_url(url) == expected


@pytest.mark.parametrize("url, words", [
    ("harbor.example.com", "not an http(s) URL"), ("ftp://harbor.example.com", "not an http(s) URL"),
    ("http://harbor.example.com", "plain http"), ("https://admin:pw@harbor.example.com", "credentials"),
    ("https://harbor.example.com/api/v2.0", "without a path"), ("https://harbor.example.com:99999", "(?i)port out of range"),
])
def test_refuses_addresses_that_are_not_harbor_or_unsafe(url, words):
    with pytest.raises(ValueError, match=words if words.startswith("(?i)") else re.escape(words)):
        harbor.check_base_url(url)


def test_harbors_retry_policy_honours_retry_after_up_to_30s_and_backs_off_exponentially_with_jitter():
    policy = harbor.HARBOR_RETRIES  # HarborClient's defaults: --retries 4, from 0.5 s
    assert policy.attempts == 5 and policy.max_elapsed_s == float("inf")
    assert policy.delay(0, parse_retry_after("3")) == 3.0
    assert policy.delay(0, parse_retry_after("3600")) == 30.0  # capped, then tried again
    http_date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 5))
    assert 3.0 <= policy.delay(0, parse_retry_after(http_date)) <= 5.0
    ceilings = [policy.delay(n, None, rng=lambda: 1.0) for n in range(8)]
    assert ceilings == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert all(0.0 <= policy.delay(n, None) <= ceiling for n, ceiling in enumerate(ceilings))
    assert policy.delay(0, parse_retry_after("soon"), rng=lambda: 1.0) == 0.5  # unreadable: as if absent
    # Every method may be retried on an answer; a POST is not sent again once it may have reached Harbor.
    assert policy.send_once == frozenset() and policy.resend_unsent_only == {"POST"}


def test_secrets_stay_out_of_reprs_and_reports():
    credentials = harbor.Credentials("admin", "canary-password-41")
    result = harbor.RobotResult("robot$paddle+ci", 3, "created", -1, secret="canary-secret-42")
    assert "canary" not in repr(credentials) and "canary" not in repr(result)
    assert "canary" not in str(result.to_dict()) and result.to_dict()["secret_issued"] is True
