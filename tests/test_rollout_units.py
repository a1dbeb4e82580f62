"""The reconciler's small pure helpers: state tag names and who the audit trail names."""
from __future__ import annotations

from imagebuild.release import TAG_PATTERN
from imagebuild.rollout import short, state_tag, who


def test_state_tags_stay_valid_tags_however_long_the_channel():
    assert state_tag("lease", "stable") == "lease-stable"
    long_a, long_b = state_tag("channel", "a" * 128), state_tag("channel", "a" * 127 + "b")
    assert TAG_PATTERN.fullmatch(long_a) and TAG_PATTERN.fullmatch(long_b)
    assert long_a != long_b  # shortened with the name's hash: distinct names keep distinct tags


def test_who_names_the_user_and_ci_variables_but_nothing_else_from_the_environment(monkeypatch):
    monkeypatch.setenv("GITHUB_ACTOR", "release-bot")
    monkeypatch.setenv("GITHUB_RUN_ID", "4242")
    monkeypatch.setenv("REGISTRY_PASSWORD", "hunter2")
    monkeypatch.setenv("COSIGN_PASSWORD", "hunter3")
    found = who()
    assert found["GITHUB_ACTOR"] == "release-bot" and found["GITHUB_RUN_ID"] == "4242"
    assert found["user"] and found["host"]
    assert "hunter2" not in str(found) and "hunter3" not in str(found)


def test_short_digests_for_tables():
    assert short("sha256:" + "ab" * 32) == "abababababab"
    assert short(None) == "-"
