"""A rollout record read back from the state repository is checked against release.yaml's plan
(rollout_plan.check_record, pure): it may carry progress and digests, never a tag, region, wave or
step of its own."""
from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from imagebuild.rollout.plan import RecordMismatch, check_record, plan_rollback, plan_rollout, previous_pairs

from .test_rollout_plan import DIGEST, OLD, release

CONFIG = release(("eu",), ("us", "ap"))
ID = "20261201t000000-abcdef"
SIG_TAG = "sha256-" + "e" * 64 + ".sig"


def genuine(next_step: int = 0) -> dict[str, Any]:
    """A record as rollout.new_record writes it, `next_step` steps done (their previous digests recorded)."""
    steps = plan_rollout(CONFIG, DIGEST, ["stable"])
    done = [dict(s.to_dict(), state="done" if s.index < next_step else "pending") for s in steps]
    previous = {f"{s.region}/{s.tag}": OLD for s in steps if s.kind.value == "record-previous" and s.index < next_step}
    return {"schema": 1, "id": ID, "channels": ["stable"], "source": f"127.0.0.1:5000/imagebuild/paddle@{DIGEST}",
            "digest": DIGEST, "status": "halted", "reason": None, "steps": done, "next_step": next_step,
            "previous": previous, "present_before": {"eu": True},
            "waves": {w.name: {"state": "pending", "moved_at": None, "gates": [], "approvals": []}
                      for w in CONFIG.waves},
            "rollback": None, "events": []}


def test_a_genuine_record_gives_release_yamls_steps():
    record = genuine(next_step=4)
    assert check_record(CONFIG, record, ID) == plan_rollout(CONFIG, DIGEST, ["stable"])


def test_a_genuine_rollback_plan_is_accepted():
    record = genuine(next_step=5)
    steps = plan_rollout(CONFIG, DIGEST, ["stable"])
    plan = plan_rollback(steps, previous_pairs(record), DIGEST)
    record["rollback"] = {"steps": [dict(s.to_dict(), state="pending") for s in plan], "next_step": 0}
    assert check_record(CONFIG, record, ID) == steps


def step_tag(tag: str) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        next(s for s in record["steps"] if s["kind"] == "move-tag")["tag"] = tag
    return edit


def set_key(key: str, value: Any) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        record[key] = value
    return edit


def first_step(field: str, value: Any) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        record["steps"][0][field] = value
    return edit


def rollback_restores_to(digest: str) -> Callable[[dict], None]:
    def edit(record: dict) -> None:
        record["rollback"] = {"steps": [{"index": 0, "wave": "w0", "region": "eu", "tag": "stable",
                                         "moved_to": DIGEST, "restore_to": digest, "state": "pending"}],
                              "next_step": 0}
    return edit


FORGERIES: dict[str, tuple[Callable[[dict], None], str]] = {
    "another image's signature tag as a step": (step_tag(SIG_TAG), "release.yaml plans #3 move-tag w0/eu/stable"),
    "a tag release.yaml does not name": (step_tag("latest"), "release.yaml plans #3 move-tag"),
    "a cosign tag as a channel": (set_key("channels", [SIG_TAG]), "is not among the release's channels"),
    "a channel release.yaml does not list": (set_key("channels", ["stable", "beta"]), "channel 'beta'"),
    "a region of its own": (first_step("region", "evil"), "release.yaml plans #0 copy w0/eu"),
    "a wave of its own": (first_step("wave", "w9"), "release.yaml plans #0 copy w0/eu"),
    "a step kind of its own": (first_step("kind", "delete"), "release.yaml plans #0 copy"),
    "a repository of its own": (first_step("repository", "victim/paddle"), "step 0 carries ['repository']"),
    "a step dropped": (lambda r: r["steps"].pop(0), "it has 13 steps; release.yaml plans 14"),
    "a step added": (lambda r: r["steps"].append(dict(r["steps"][-1], index=14)), "it has 15 steps"),
    "a digest with a path in it": (set_key("digest", "sha256:../../other/manifests/x"), "not a sha256 digest"),
    "a previous digest with a path in it": (lambda r: r["previous"].update({"eu/stable": "../x"}),
                                            "previous[eu/stable] is '../x', not a sha256 digest"),
    "a previous digest for a tag never recorded": (lambda r: r["previous"].update({"us/stable": OLD}),
                                                   "previous names 'us/stable'"),
    "a previous digest for another repository's tag": (lambda r: r["previous"].update({"eu/" + SIG_TAG: OLD}),
                                                       "previous names"),
    "a next step past the end": (set_key("next_step", 99), "next_step 99 is not a step number"),
    "another rollout's id": (set_key("id", "20261201t000000-000000"), "its id is"),
    "waves of its own": (set_key("waves", {"w0": {}}), "are not release.yaml's"),
    "a soak time that is not a time": (lambda r: r["waves"]["w0"].update(moved_at="yesterday"), "moved_at"),
    "a rollback plan of its own": (rollback_restores_to("sha256:" + "9" * 64), "rollback step 0 is"),
    "an unknown status": (set_key("status", "done\x1b[2K"), "status 'done\\x1b[2K' is not a rollout status"),
    "present_before of another region": (lambda r: r["present_before"].update({"evil": False}), "present_before"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_record_is_refused_saying_what_disagrees(forgery):
    edit, expected = FORGERIES[forgery]
    record = copy.deepcopy(genuine(next_step=4))
    edit(record)
    with pytest.raises(RecordMismatch, match=re.escape(expected)) as refused:
        check_record(CONFIG, record, ID)
    assert "\x1b" not in str(refused.value)  # untrusted text is escaped before it reaches a terminal


@pytest.mark.parametrize(("record", "reason"), [
    (None, "the record is not a mapping"), ([], "the record is not a mapping"), ("x", "the record is not a mapping"),
    ({"id": ID}, "status None is not a rollout status"),
])
def test_anything_but_a_record_is_refused(record, reason):
    with pytest.raises(RecordMismatch, match=f"^{reason}$"):
        check_record(CONFIG, record, ID)


def test_release_yaml_losing_a_region_since_the_start_halts_rather_than_acting_on_the_old_plan():
    record = genuine(next_step=4)
    smaller = release(("eu",), ("us",))
    with pytest.raises(RecordMismatch, match="release.yaml plans"):
        check_record(smaller, record, ID)
