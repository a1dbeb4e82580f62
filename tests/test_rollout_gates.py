"""Rollout gates without services: Prometheus answers, `for` windows, substitution, soak, approval."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from imagebuild.config.release_file import ApprovalGate, PrometheusGate, Region, SoakGate
from imagebuild.config.trust import Mode, Requirements, TrustConfig
from imagebuild.rollout.gates import (
    NO_DATA_GRACE_S,
    GateContext,
    GateOutcome,
    GateResult,
    PrometheusAnswerError,
    Window,
    evaluate,
    judge,
    parse_answer,
    redact,
    redact_url,
    substitute_region,
)

NOW = 1_800_000_000.0
TRUST = TrustConfig(path=Path("trust.yaml"), mode=Mode.ENFORCE, keys=(), images=("**",), require=Requirements())


def context(**changes) -> GateContext:
    values = dict(wave="canary", region=Region("eu-west", "127.0.0.1:5001", "imagebuild/paddle"),
                  image="127.0.0.1:5001/imagebuild/paddle@sha256:" + "a" * 64, digest="sha256:" + "a" * 64,
                  channels=("stable",), moved_at=NOW - 12, approvals=(), trust=TRUST, now=NOW)
    values.update(changes)
    return GateContext(**values)


def gate(maximum=0.05, minimum=None, for_seconds=0.0) -> PrometheusGate:
    return PrometheusGate(url="http://127.0.0.1:9090", query='job_error_ratio{region="{region}"}',
                          max=maximum, min=minimum, for_seconds=for_seconds)


def vector(*values: tuple[dict, str]) -> dict:
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": m, "value": [NOW, v]} for m, v in values]}}


def matrix(window: Window, values: list[str | None], metric: dict | None = None) -> dict:
    """One series with a value (or none) at each point of the window."""
    points = [[window.start + i * window.step, v] for i, v in enumerate(values) if v is not None]
    return {"status": "success", "data": {"resultType": "matrix",
                                          "result": [{"metric": metric or {"region": "eu-west"}, "values": points}]}}


# --- {region} substitution ----------------------------------------------------------------------


def test_region_replaces_only_the_placeholder_and_keeps_promql_braces():
    query = 'sum(rate(errors{region="{region}",job=~"train.*"}[5m]))'
    assert substitute_region(query, "eu-west") == 'sum(rate(errors{region="eu-west",job=~"train.*"}[5m]))'


@pytest.mark.parametrize("name", ['eu"} or vector(1) #', "EU-West", "eu west", "", "-eu", "eu\nwest", "eu/../x",
                                  "a" * 64])
def test_region_names_that_could_break_out_of_a_matcher_are_refused(name):
    with pytest.raises(ValueError, match="region name"):
        substitute_region('x{region="{region}"}', name)


def test_region_in_a_url_is_percent_encoded_in_the_query_string():
    assert substitute_region("http://h/healthz?region={region}", "ap-south", in_url=True) == \
        "http://h/healthz?region=ap-south"


def test_unsafe_region_fails_the_prometheus_gate_without_a_request():
    ctx = context(region=Region('x"}', "127.0.0.1:5001", "imagebuild/paddle"))
    result = evaluate(gate(), ctx)
    assert result.outcome is GateOutcome.FAILED and "region name" in result.detail
    assert not result.transient


# --- redaction ------------------------------------------------------------------------------------


def test_userinfo_is_redacted_from_urls_and_messages():
    url = "https://admin:s3cret-pw@prom.example.com:9090/api"
    assert redact_url(url) == "https://***@prom.example.com:9090/api"
    message = f"error for {url}: login admin:s3cret-pw refused (s3cret-pw)"
    assert "s3cret-pw" not in redact(message, url)
    assert redact_url("http://127.0.0.1:9090") == "http://127.0.0.1:9090"


# --- Prometheus answers ------------------------------------------------------------------------------


def test_vector_scalar_and_matrix_answers_become_series():
    [s] = parse_answer(vector(({"__name__": "job_error_ratio", "region": "eu-west"}, "0.01")))
    assert s.labels["region"] == "eu-west" and s.points == ((NOW, 0.01),)
    [scalar] = parse_answer({"status": "success", "data": {"resultType": "scalar", "result": [NOW, "2.5"]}})
    assert scalar.labels == {} and scalar.points == ((NOW, 2.5),)
    window = Window(NOW - 2, NOW, 1.0)
    [ranged] = parse_answer(matrix(window, ["0.1", "0.2", "NaN"]))
    assert [v for _, v in ranged.points][:2] == [0.1, 0.2] and math.isnan(ranged.points[2][1])


@pytest.mark.parametrize("body, message", [
    ({"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}, "bad_data: parse error"),
    ({"status": "success", "data": {"resultType": "string", "result": [NOW, "x"]}}, "string"),
    ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [NOW, 1]}]}},
     "not a string"),
    ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [NOW, "lots"]}]}},
     "not a number"),
    ("<html>login</html>", "not a JSON object"),
    ({"status": "success"}, "no data object"),
])
def test_answers_that_cannot_be_judged_say_why(body, message):
    with pytest.raises(PrometheusAnswerError, match=message):
        parse_answer(body)


# --- judging: instant queries ------------------------------------------------------------------------


def test_value_under_max_passes_and_shows_the_value():
    outcome, detail, _ = judge(parse_answer(vector(({"region": "eu-west"}, "0.01"))), gate(), None, 12)
    assert outcome is GateOutcome.PASSED
    assert detail == '{region="eu-west"} = 0.01 within max 0.05'


def test_value_over_max_fails_naming_the_series_and_the_threshold():
    answer = vector(({"region": "eu-west", "job": "a"}, "0.01"), ({"region": "eu-west", "job": "b"}, "0.2"))
    outcome, detail, retry = judge(parse_answer(answer), gate(), None, 12)
    assert outcome is GateOutcome.FAILED and retry is None
    assert '{job="b",region="eu-west"} = 0.2' in detail and "breaks max 0.05" in detail


def test_thresholds_are_inclusive_and_min_works_too():
    assert judge(parse_answer(vector(({}, "0.05"))), gate(), None, 1)[0] is GateOutcome.PASSED
    assert judge(parse_answer(vector(({}, "0.5"))), gate(maximum=None, minimum=0.9), None, 1)[0] is GateOutcome.FAILED
    assert judge(parse_answer(vector(({}, "0.95"))), gate(maximum=None, minimum=0.9), None, 1)[0] is GateOutcome.PASSED


def test_no_series_waits_then_fails_after_the_grace():
    outcome, detail, retry = judge([], gate(), None, since_move_s=10)
    assert outcome is GateOutcome.WAITING and retry and "no data" in detail
    outcome, detail, retry = judge([], gate(), None, since_move_s=NO_DATA_GRACE_S + 1)
    assert outcome is GateOutcome.FAILED and retry is None and "no data" in detail


def test_nan_counts_as_no_data_not_as_passing():
    outcome, _, _ = judge(parse_answer(vector(({}, "NaN"))), gate(), None, 10)
    assert outcome is GateOutcome.WAITING


# --- judging: `for` windows ------------------------------------------------------------------------------


def test_window_starts_at_the_move_when_that_is_less_than_for_ago():
    window = Window.for_check(NOW, NOW - 4, 10)
    assert (window.start, window.end, window.step, window.count) == (NOW - 4, NOW, 1.0, 5)
    assert Window.for_check(NOW, NOW - 100, 10).start == NOW - 10
    assert Window.for_check(NOW, NOW - 10_000, 3600).step == 15.0


def test_for_waits_while_the_window_since_the_move_is_shorter():
    spec = gate(for_seconds=10)
    window = Window.for_check(NOW, NOW - 4, 10)
    outcome, detail, retry = judge(parse_answer(matrix(window, ["0.01"] * 5)), spec, window, 4)
    assert outcome is GateOutcome.WAITING and "held 4s of 10s" in detail and 1 <= retry <= 6


def test_for_passes_once_every_point_of_a_full_window_holds():
    spec = gate(for_seconds=10)
    window = Window.for_check(NOW, NOW - 60, 10)
    outcome, detail, _ = judge(parse_answer(matrix(window, ["0.01"] * 11)), spec, window, 60)
    assert outcome is GateOutcome.PASSED and "for 10s" in detail


def test_for_fails_on_any_breach_in_the_window_even_after_recovery():
    spec = gate(for_seconds=10)
    window = Window.for_check(NOW, NOW - 60, 10)
    values = ["0.01"] * 11
    values[3] = "0.3"
    outcome, detail, _ = judge(parse_answer(matrix(window, values)), spec, window, 60)
    assert outcome is GateOutcome.FAILED and "= 0.3 at" in detail


def test_for_counts_only_the_run_after_a_gap():
    spec = gate(for_seconds=10)
    window = Window.for_check(NOW, NOW - 60, 10)
    values: list[str | None] = ["0.01"] * 11
    values[4] = None  # missing at t-6: the run since then spans t-5 .. t
    outcome, detail, _ = judge(parse_answer(matrix(window, values)), spec, window, 60)
    assert outcome is GateOutcome.WAITING and "held 5s of 10s" in detail


def test_for_waits_when_the_latest_point_has_no_data():
    spec = gate(for_seconds=10)
    window = Window.for_check(NOW, NOW - 60, 10)
    outcome, detail, _ = judge(parse_answer(matrix(window, ["0.01"] * 10 + [None])), spec, window, 60)
    assert outcome is GateOutcome.WAITING and "latest point" in detail


# --- soak and approval --------------------------------------------------------------------------------------


def test_soak_waits_with_progress_then_passes():
    result = evaluate(SoakGate(seconds=30), context(moved_at=NOW - 12))
    assert result.outcome is GateOutcome.WAITING and result.detail == "soak 12s of 30s"
    assert result.retry_in_s == pytest.approx(18) and result.region == "eu-west"
    assert evaluate(SoakGate(seconds=30), context(moved_at=NOW - 30)).outcome is GateOutcome.PASSED


def test_approval_waits_naming_the_command_then_passes_for_this_wave_only():
    waiting = evaluate(ApprovalGate(), context(rollout_id="r-42", approvals=("rest",)))
    assert waiting.outcome is GateOutcome.WAITING and waiting.region is None
    assert "`imagebuild rollout approve r-42 --wave canary`" in waiting.detail
    assert evaluate(ApprovalGate(), context(approvals=("canary",))).outcome is GateOutcome.PASSED


def test_results_serialise_and_say_when_a_failure_is_worth_a_retry():
    result = GateResult("http", "eu-west", GateOutcome.FAILED, "GET x unreachable", "2027-01-15T08:00:00Z", 5.0)
    assert result.transient and result.to_dict()["outcome"] == "failed"
    assert not GateResult("http", "eu-west", GateOutcome.FAILED, "500", "t").transient
    assert evaluate(SoakGate(seconds=1), context()).checked_at == "2027-01-15T08:00:00Z"
