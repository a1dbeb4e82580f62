"""The order of a rollout's steps and of its rollback (rollout_plan, pure)."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from imagebuild.config.release_file import Region, ReleaseConfig, SoakGate, Wave
from imagebuild.rollout.plan import PlanError, RollbackStep, Step, StepKind, plan_rollback, plan_rollout

DIGEST = "sha256:" + "1" * 64
OLD = "sha256:" + "0" * 64


def release(*waves: tuple[str, ...], channels: tuple[str, ...] = ("stable", "2.6-gpu")) -> ReleaseConfig:
    names = [region for wave in waves for region in wave]
    return ReleaseConfig(
        path=Path("release.yaml"), trust_path=Path("trust.yaml"), state_registry="127.0.0.1:5000",
        state_repository="imagebuild/rollouts", lease_ttl_s=600.0,
        regions=tuple(Region(name, f"127.0.0.1:{5001 + i}", "imagebuild/paddle") for i, name in enumerate(names)),
        channels=channels,
        waves=tuple(Wave(f"w{i}", wave, (SoakGate(1.0),)) for i, wave in enumerate(waves)))


def shape(steps: tuple[Step, ...]) -> list[tuple[str, str, str | None, str | None]]:
    return [(s.kind.value, s.wave, s.region, s.tag) for s in steps]


def test_one_region_one_tag_is_copy_verify_record_move_gates():
    steps = plan_rollout(release(("eu",)), DIGEST, ["stable"])
    assert shape(steps) == [("copy", "w0", "eu", None), ("verify", "w0", "eu", None),
                            ("record-previous", "w0", "eu", "stable"), ("move-tag", "w0", "eu", "stable"),
                            ("gates", "w0", None, None)]
    assert [s.index for s in steps] == list(range(5))


def test_waves_run_in_order_and_each_ends_with_its_gates():
    steps = plan_rollout(release(("eu",), ("us", "ap")), DIGEST, ["stable", "2.6-gpu"])
    assert shape(steps) == [
        ("copy", "w0", "eu", None), ("verify", "w0", "eu", None),
        ("record-previous", "w0", "eu", "stable"), ("record-previous", "w0", "eu", "2.6-gpu"),
        ("move-tag", "w0", "eu", "stable"), ("move-tag", "w0", "eu", "2.6-gpu"),
        ("gates", "w0", None, None),
        ("copy", "w1", "us", None), ("verify", "w1", "us", None),
        ("copy", "w1", "ap", None), ("verify", "w1", "ap", None),
        ("record-previous", "w1", "us", "stable"), ("record-previous", "w1", "us", "2.6-gpu"),
        ("record-previous", "w1", "ap", "stable"), ("record-previous", "w1", "ap", "2.6-gpu"),
        ("move-tag", "w1", "us", "stable"), ("move-tag", "w1", "us", "2.6-gpu"),
        ("move-tag", "w1", "ap", "stable"), ("move-tag", "w1", "ap", "2.6-gpu"),
        ("gates", "w1", None, None)]


@pytest.mark.parametrize("waves", [(("a",),), (("a",), ("b", "c")), (("a", "b"), ("c",), ("d", "e", "f"))])
@pytest.mark.parametrize("channels", [("stable",), ("stable", "2.6-gpu")])
def test_invariants_hold_for_every_shape(waves, channels):
    """Within each wave: every region copied and verified before any tag of the wave is recorded; every
    previous digest recorded before any move; every tag moved before the gates; no wave starts before
    the previous one's gates; each (region, tag) recorded and moved exactly once."""
    config = release(*waves)
    steps = plan_rollout(config, DIGEST, channels)
    position = {(s.kind, s.wave, s.region, s.tag): s.index for s in steps}
    assert len(position) == len(steps)  # no step twice
    gates_at = {s.wave: s.index for s in steps if s.kind is StepKind.GATES}
    for number, wave in enumerate(config.waves):
        in_wave = [s for s in steps if s.wave == wave.name]
        assert in_wave[-1].kind is StepKind.GATES
        if number:
            assert min(s.index for s in in_wave) > gates_at[config.waves[number - 1].name]
        last_verify = max(s.index for s in in_wave if s.kind in (StepKind.COPY, StepKind.VERIFY))
        first_record = min(s.index for s in in_wave if s.kind is StepKind.RECORD)
        last_record = max(s.index for s in in_wave if s.kind is StepKind.RECORD)
        first_move = min(s.index for s in in_wave if s.kind is StepKind.MOVE)
        assert last_verify < first_record and last_record < first_move
        for region, tag in itertools.product(wave.regions, channels):
            assert position[(StepKind.COPY, wave.name, region, None)] < position[(StepKind.VERIFY, wave.name, region, None)]
            assert position[(StepKind.RECORD, wave.name, region, tag)] < position[(StepKind.MOVE, wave.name, region, tag)]


def test_channels_are_checked_against_the_release():
    with pytest.raises(PlanError, match="channel 'beta' is not among the release's channels"):
        plan_rollout(release(("eu",)), DIGEST, ["beta"])
    with pytest.raises(PlanError, match="at least one channel"):
        plan_rollout(release(("eu",)), DIGEST, [])


def test_a_channel_given_twice_is_planned_once():
    steps = plan_rollout(release(("eu",)), DIGEST, ["stable", "stable"])
    assert [s.tag for s in steps if s.kind is StepKind.MOVE] == ["stable"]


@pytest.mark.parametrize("digest", ["latest", "sha256:abc", "sha512:" + "1" * 64, "sha256:" + "G" * 64, ""])
def test_only_a_sha256_digest_is_planned(digest):
    with pytest.raises(PlanError, match="not a sha256 digest"):
        plan_rollout(release(("eu",)), digest, ["stable"])


def test_rollback_goes_in_reverse_wave_order_to_the_recorded_digests():
    config = release(("eu",), ("us", "ap"))
    steps = plan_rollout(config, DIGEST, ["stable"])
    previous = {("eu", "stable"): OLD, ("us", "stable"): OLD, ("ap", "stable"): OLD}
    plan = plan_rollback(steps, previous, DIGEST)
    assert [(s.wave, s.region, s.tag, s.restore_to) for s in plan] == [
        ("w1", "ap", "stable", OLD), ("w1", "us", "stable", OLD), ("w0", "eu", "stable", OLD)]
    assert all(s.moved_to == DIGEST for s in plan)
    assert [s.index for s in plan] == [0, 1, 2]


def test_rollback_deletes_tags_that_did_not_exist_after_restoring_the_others_of_the_wave():
    steps = plan_rollout(release(("eu", "us")), DIGEST, ["stable", "2.6-gpu"])
    previous = {("eu", "stable"): None, ("eu", "2.6-gpu"): OLD, ("us", "stable"): OLD, ("us", "2.6-gpu"): None}
    plan = plan_rollback(steps, previous, DIGEST)
    assert [(s.region, s.tag, s.restore_to) for s in plan] == [
        ("us", "stable", OLD), ("eu", "2.6-gpu", OLD), ("us", "2.6-gpu", None), ("eu", "stable", None)]


def test_rollback_leaves_tags_whose_previous_digest_was_never_recorded():
    """A halt before a wave recorded anything: that wave's tags were never moved."""
    steps = plan_rollout(release(("eu",), ("us",)), DIGEST, ["stable"])
    plan = plan_rollback(steps, {("eu", "stable"): OLD}, DIGEST)
    assert plan == (RollbackStep(0, "w0", "eu", "stable", DIGEST, OLD),)
    assert plan_rollback(steps, {}, DIGEST) == ()


def test_descriptions_name_the_step():
    step = plan_rollout(release(("eu",)), DIGEST, ["stable"])[3]
    assert step.describe() == "#3 move-tag w0/eu/stable"
    assert RollbackStep(0, "w0", "eu", "stable", DIGEST, None).describe() == (
        "#0 restore w0/eu/stable -> (delete: it did not exist before)")
