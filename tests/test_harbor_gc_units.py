"""imagebuild/release/harbor_gc.py: reading Harbor's GC answers as untrusted input, and `run_gc`'s waits
(start, join a running run, time out) against the Harbor stand-in over real HTTP, on an injected clock."""
from __future__ import annotations

import json

import pytest

from imagebuild.core.source import InputError
from imagebuild.release import harbor, harbor_gc

from .harbor_standin import HarborSpec, HarborStandIn
from .harbor_standin.server import Reply

WHERE = "http://127.0.0.1:1/api/v2.0/system/gc/7"
PASSWORD = "Canary-Gc-Pw-5d1e"


@pytest.fixture(scope="module")
def spec() -> HarborSpec:
    return HarborSpec()


@pytest.fixture
def standin(spec):
    server = HarborStandIn(spec, users={"admin": PASSWORD}).start()
    yield server
    server.stop()


class Clock:
    """An instant clock: each sleep moves it on and returns at once."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def wait(self, poll_s: float = 2.0, timeout_s: float = 60.0) -> harbor_gc.GcWait:
        return harbor_gc.GcWait(sleep=self.sleep, clock=lambda: self.now, poll_s=poll_s, timeout_s=timeout_s)


def client(standin: HarborStandIn) -> harbor.HarborClient:
    return harbor.HarborClient(standin.url, harbor.Credentials("admin", PASSWORD), retries=1, backoff=0.001)


# -- the request -------------------------------------------------------------------------------


def test_the_manual_run_request_is_a_schedule_harbor_accepts(spec):
    body = harbor_gc.manual_gc_request(delete_untagged=True, dry_run=True)
    assert body == {"schedule": {"type": "Manual"}, "parameters": {"delete_untagged": True, "dry_run": True}}
    assert spec.definition_errors("Schedule", body, request=True) == []


# -- reading answers ---------------------------------------------------------------------------


def good(**changes: object) -> dict[str, object]:
    run: dict[str, object] = {"id": 7, "job_name": "GARBAGE_COLLECTION", "job_kind": "MANUAL", "job_status": "Running",
                              "job_parameters": json.dumps({"dry_run": True, "delete_untagged": False,
                                                            "redis_url_reg": "redis://:pw@redis:6379/1"}),
                              "schedule": {"type": "Manual"}, "deleted": False,
                              "creation_time": "2026-12-04T20:00:00Z", "update_time": "2026-12-04T20:00:05Z"}
    run.update(changes)
    return {k: v for k, v in run.items() if v is not None}


def test_reads_a_run_and_keeps_only_the_two_flags_of_its_parameters():
    run = harbor_gc.read_gc_run(good(), WHERE)
    assert run == harbor_gc.GcRunView(7, "Running", "MANUAL", True, False, "2026-12-04T20:00:00Z", "2026-12-04T20:00:05Z")
    assert "redis" not in repr(run)


def test_a_run_with_only_id_and_status_is_enough():
    run = harbor_gc.read_gc_run({"id": 3, "job_status": "Success"}, WHERE)
    assert (run.id, run.status, run.dry_run, run.trigger, run.finished) == (3, "Success", None, None, True)


@pytest.mark.parametrize(("answer", "message"), [
    (["not", "a", "run"], "expected a mapping"),
    (None, "expected a mapping"),
    ({"job_status": "Running"}, "missing required key 'id'"),
    ({"id": 7}, "missing required key 'job_status'"),
    (good(id="7"), r"id: expected an integer"),
    (good(id=True), r"id: expected an integer"),
    (good(id=0), r"id: must be at least 1"),
    (good(id=2**70), r"id: must be at most"),
    (good(job_status="Exploded"), r"job_status: unknown status Exploded"),
    (good(job_status="\x1b[2Jrunning"), r"job_status: unknown status \\x1b\[2Jrunning"),
    (good(job_status=None, id=7) | {"job_status": None}, r"job_status: expected a string"),
    (good(job_status=["Running"]), r"job_status: expected a string"),
    (good(job_kind={"x": 1}), r"job_kind: expected a string"),
    (good(job_parameters={"dry_run": True}), r"job_parameters: expected a string"),
    (good(creation_time="x" * 500), r"creation_time: longer than 64 characters"),
])
def test_refuses_an_odd_run_in_one_line_naming_the_key(answer, message):
    with pytest.raises(InputError, match=message) as caught:
        harbor_gc.read_gc_run(answer, WHERE)
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value)
    assert str(caught.value).startswith(WHERE + ": ")


@pytest.mark.parametrize("parameters", ["not json", "[1, 2]", '{"dry_run": "yes", "delete_untagged": 1}', ""])
def test_parameters_that_do_not_say_leave_the_flags_unknown(parameters):
    run = harbor_gc.read_gc_run(good(job_parameters=parameters), WHERE)
    assert (run.dry_run, run.delete_untagged) == (None, None)


def test_reads_a_history_and_names_the_item_at_fault():
    runs = harbor_gc.read_gc_history([good(id=9, job_status="Pending"), good(id=8, job_status="Error")], WHERE)
    assert [(r.id, r.status, r.finished) for r in runs] == [(9, "Pending", False), (8, "Error", True)]
    with pytest.raises(InputError, match=r"\[1\]\.job_status: unknown status"):
        harbor_gc.read_gc_history([good(), good(job_status="Done")], WHERE)
    with pytest.raises(InputError, match="expected a list"):
        harbor_gc.read_gc_history({"runs": []}, WHERE)


@pytest.mark.parametrize(("location", "expected"), [
    ("/api/v2.0/system/gc/42", 42), ("/api/v2.0/system/gc/42/", 42), ("https://h/api/v2.0/system/gc/5?x=1", 5),
    (None, None), ("", None), ("/api/v2.0/system/gc/schedule", None), ("/api/v2.0/projects/42", None),
    ("/api/v2.0/system/gc/-1", None), ("/api/v2.0/system/gc/0", None), ("/api/v2.0/system/gc/" + "9" * 40, None),
])
def test_the_run_id_comes_from_the_location_only_when_it_names_a_gc_run(location, expected):
    assert harbor_gc.gc_id_from_location(location) == expected


def test_the_log_summary_is_the_tail_in_safe_lines_without_credentials():
    text = "\n".join([f"line {i}" for i in range(20)] + [
        "connecting to redis://:RedisPw@redis:6379/1 and https://user:pw@registry:5000/v2/",
        f"the password {PASSWORD} leaked", "\x1b[31mred\x1b[0m \u202eevil", "", "   "])
    summary = harbor_gc.log_summary(text, hide=(PASSWORD,))
    assert len(summary) == harbor_gc.LOG_LINES and summary[-1].startswith("\\x1b[31mred")
    joined = "\n".join(summary)
    assert "RedisPw" not in joined and "user:pw" not in joined and PASSWORD not in joined
    assert "redis://***@redis:6379/1" in joined and "https://***@registry:5000" in joined
    assert all("\x1b" not in line and "\u202e" not in line for line in summary)
    assert harbor_gc.log_summary("x" * 5000)[0].endswith("...")


# -- run_gc against the stand-in -----------------------------------------------------------------


def test_a_run_goes_pending_running_success_and_each_poll_waits_poll_s(standin):
    clock = Clock()
    with client(standin) as harbor_client:
        result = harbor_gc.run_gc(harbor_client, clock.wait(poll_s=2.0), dry_run=True, hide=(PASSWORD,))
    assert (result.run.status, result.started, result.run.dry_run, result.ok) == ("Success", True, True, True)
    assert result.polls == 4 and clock.slept == [2.0, 2.0, 2.0]  # Running, Running, Running, then Success
    assert any("dry run" in line for line in result.log)
    assert "Redis-Canary" not in json.dumps(result.to_dict())
    posted = [r.body for r in standin.requests if r.operation == "createGCSchedule"]
    assert posted == [{"schedule": {"type": "Manual"}, "parameters": {"delete_untagged": False, "dry_run": True}}]
    assert standin.violations == []


def test_a_run_still_going_after_the_timeout_is_an_error_naming_it(standin):
    standin.gc_running_polls = 1000
    clock = Clock()
    with client(standin) as harbor_client, pytest.raises(harbor_gc.HarborGcTimeout, match=r"still Running after 10 s"):
        harbor_gc.run_gc(harbor_client, clock.wait(poll_s=3.0, timeout_s=10.0))
    assert clock.now - 1000.0 <= 12.0
    assert standin.violations == []


def test_a_412_while_one_runs_joins_the_running_run(standin):
    running = standin.start_gc()
    standin.inject(412, operation="createGCSchedule")  # what a Harbor behind a policy check answers
    with client(standin) as harbor_client:
        result = harbor_gc.run_gc(harbor_client, Clock().wait())
    assert (result.run.id, result.started, result.run.status) == (running, False, "Success")
    assert len(standin.gc_runs) == 1
    assert standin.violations == []


def test_a_conflict_whose_run_ends_before_it_is_listed_starts_a_run_after_all(standin):
    standin.inject(409, operation="createGCSchedule")  # the conflicting run ended before the listing
    with client(standin) as harbor_client:
        result = harbor_gc.run_gc(harbor_client, Clock().wait())
    assert result.started and result.run.status == "Success"
    assert [r.status for r in standin.requests if r.operation == "createGCSchedule"] == [409, 201]


def test_an_answer_about_another_run_is_refused_naming_the_request(standin):
    # A Harbor (or a proxy's cache) answering GET /system/gc/{id} with another run: never reported as ours.
    standin._op_getGC = lambda **_: Reply(200, {"id": 999, "job_status": "Success"})
    with client(standin) as harbor_client, pytest.raises(InputError, match=r"/system/gc/1: id: Harbor answered run 999"):
        harbor_gc.run_gc(harbor_client, Clock().wait())
    assert standin.violations == []
