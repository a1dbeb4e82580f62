"""The reconciler's small pure helpers: state tag names, who the audit trail names, what the CLI injects."""
from __future__ import annotations

import time
from pathlib import Path

import click

from imagebuild.cli.rollout_command import _runtime
from imagebuild.oci.names import TAG
from imagebuild.rollout.reconciler import Runtime, Timing
from imagebuild.rollout.state import short, state_tag, who


def test_state_tags_stay_valid_tags_however_long_the_channel():
    assert state_tag("lease", "stable") == "lease-stable"
    long_a, long_b = state_tag("channel", "a" * 128), state_tag("channel", "a" * 127 + "b")
    assert TAG.fullmatch(long_a) and TAG.fullmatch(long_b)
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


def test_the_cli_waits_the_products_two_second_settle_unless_a_caller_injects_a_runtime():
    with click.Context(click.Command("rollout")):
        runtime = _runtime()
    assert runtime == Runtime(Timing(settle_s=2.0, retry_base_s=1.0, clock=time.time, sleep=time.sleep), None)
    injected = Runtime(Timing(settle_s=0.5, retry_base_s=0.2))
    with click.Context(click.Command("rollout"), obj=injected):
        assert _runtime() is injected


def test_no_test_hook_is_read_from_the_environment_by_the_product():
    package = Path(__file__).resolve().parents[1] / "imagebuild"
    readers = [str(path) for path in package.rglob("*.py") if "IMAGEBUILD_ROLLOUT_" in path.read_text()]
    assert readers == []
