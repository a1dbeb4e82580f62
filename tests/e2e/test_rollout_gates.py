"""Rollout gates against real services: Prometheus (Debian's), a health endpoint, the regional
registries with cosign signatures, and the smoke suite in Docker."""
from __future__ import annotations

import time
from pathlib import Path

from imagebuild.release import ApprovalGate, HttpGate, PrometheusGate, Region, SoakGate
from imagebuild.rollout_gates import GateContext, GateOutcome, evaluate
from imagebuild.trust import Mode, Requirements, TrustConfig

from .rollout_harness import HANG, closed_port_url, unique_metric

EU_WEST = Region("eu-west", "127.0.0.1:5001", "imagebuild/paddle")
US_EAST = Region("us-east", "127.0.0.1:5002", "imagebuild/paddle")
NO_KEYS = TrustConfig(path=Path("trust.yaml"), mode=Mode.ENFORCE, keys=(), images=("**",), require=Requirements())
DIGEST = "sha256:" + "0" * 64


def context(region: Region = EU_WEST, *, moved_at: float | None = None, image: str | None = None,
            digest: str = DIGEST, trust: TrustConfig = NO_KEYS, approvals: tuple[str, ...] = (),
            **changes) -> GateContext:
    now = time.time()
    return GateContext(wave="canary", region=region, image=image or f"{region.registry}/{region.repository}@{digest}",
                       digest=digest, channels=("stable",), moved_at=now if moved_at is None else moved_at,
                       approvals=approvals, trust=trust, now=now, **changes)


def error_ratio_gate(url: str, metric: str, *, maximum: float = 0.05, for_seconds: float = 0.0) -> PrometheusGate:
    return PrometheusGate(url=url, query=f'{metric}{{region="{{region}}"}}', max=maximum, min=None,
                          for_seconds=for_seconds)


# --- Prometheus -------------------------------------------------------------------------------------


def test_error_ratio_under_the_threshold_passes_and_over_it_fails_per_region(rollout_services):
    metric = unique_metric()
    rollout_services.exporter.set(metric, 0.01, region="eu-west")
    rollout_services.exporter.set(metric, 0.2, region="us-east")
    rollout_services.prometheus.wait_until(metric, lambda samples: len(samples) == 2)
    spec = error_ratio_gate(rollout_services.prometheus.url, metric)

    passed = evaluate(spec, context(EU_WEST))
    assert passed.outcome is GateOutcome.PASSED, passed.detail
    assert passed.region == "eu-west" and "= 0.01 within max 0.05" in passed.detail

    failed = evaluate(spec, context(US_EAST))
    assert failed.outcome is GateOutcome.FAILED and not failed.transient, failed.detail
    assert 'region="us-east"' in failed.detail and "= 0.2 at" in failed.detail and "breaks max 0.05" in failed.detail


def test_a_query_without_series_waits_then_fails_once_the_grace_is_over(rollout_services):
    spec = error_ratio_gate(rollout_services.prometheus.url, unique_metric())
    waiting = evaluate(spec, context())
    assert waiting.outcome is GateOutcome.WAITING and "no data" in waiting.detail and waiting.retry_in_s
    failed = evaluate(spec, context(moved_at=time.time() - 3600))
    assert failed.outcome is GateOutcome.FAILED and "no data" in failed.detail


def test_for_waits_until_the_ratio_held_that_long_then_fails_on_a_spike(rollout_services):
    metric = unique_metric()
    prometheus = rollout_services.prometheus
    rollout_services.exporter.set(metric, 0.01, region="eu-west")
    prometheus.wait_for_value(metric, 0.01)
    moved_at = time.time()
    spec = error_ratio_gate(prometheus.url, metric, for_seconds=3)

    early = evaluate(spec, context(moved_at=moved_at))
    assert early.outcome is GateOutcome.WAITING, early.detail
    assert "held 0s of 3s" in early.detail and early.retry_in_s

    time.sleep(max(0.0, moved_at + 3.5 - time.time()))
    held = evaluate(spec, context(moved_at=moved_at))
    assert held.outcome is GateOutcome.PASSED and "for 3s" in held.detail, held.detail

    rollout_services.exporter.set(metric, 0.5, region="eu-west")
    prometheus.wait_for_value(metric, 0.5)
    spiked = evaluate(spec, context(moved_at=moved_at))
    assert spiked.outcome is GateOutcome.FAILED and "= 0.5 at" in spiked.detail

    # A spike that is over still fails the window it happened in.
    rollout_services.exporter.set(metric, 0.01, region="eu-west")
    prometheus.wait_for_value(metric, 0.01)
    assert evaluate(spec, context(moved_at=moved_at)).outcome is GateOutcome.FAILED


def test_a_series_that_appeared_late_must_hold_for_the_whole_window(rollout_services):
    metric = unique_metric()
    rollout_services.exporter.set(metric, 0.01, region="eu-west")
    rollout_services.prometheus.wait_for_value(metric, 0.01)
    spec = error_ratio_gate(rollout_services.prometheus.url, metric, for_seconds=30)
    result = evaluate(spec, context(moved_at=time.time() - 600))  # moved long ago; data only since now
    assert result.outcome is GateOutcome.WAITING and "held" in result.detail and "of 30s" in result.detail


def test_an_invalid_query_fails_with_prometheus_own_error(rollout_services):
    spec = PrometheusGate(url=rollout_services.prometheus.url, query='sum(rate(x{region="{region}"}[5m]',
                          max=1.0, min=None, for_seconds=0)
    result = evaluate(spec, context())
    assert result.outcome is GateOutcome.FAILED and not result.transient
    assert "bad_data" in result.detail


def test_prometheus_down_fails_naming_the_region_and_may_be_retried_without_leaking_credentials():
    url = closed_port_url().replace("http://", "http://gate-user:hunter2-secret@")
    started = time.monotonic()
    result = evaluate(error_ratio_gate(url, "job_error_ratio"), context())
    assert time.monotonic() - started < 10
    assert result.outcome is GateOutcome.FAILED and result.transient
    assert "region eu-west" in result.detail and "unreachable" in result.detail
    assert "hunter2" not in result.detail and "gate-user" not in result.detail and "***@127.0.0.1" in result.detail


# --- the health endpoint ------------------------------------------------------------------------------


def test_health_endpoint_200_passes_500_fails(rollout_services):
    health = rollout_services.health
    health.set("eu-west", 200)
    health.set("us-east", 500)
    spec = HttpGate(url=health.url, expect_status=200, timeout_s=2)

    ok = evaluate(spec, context(EU_WEST))
    assert ok.outcome is GateOutcome.PASSED and ok.detail.endswith(": 200")
    bad = evaluate(spec, context(US_EAST))
    assert bad.outcome is GateOutcome.FAILED and not bad.transient and "500 (expected 200)" in bad.detail
    assert health.requests == ["eu-west", "us-east"]  # {region} went into the query string


def test_health_endpoint_down_or_hanging_fails_within_the_timeout_and_may_be_retried(rollout_services):
    down = evaluate(HttpGate(url=closed_port_url("/healthz?region={region}"), expect_status=200, timeout_s=2),
                    context())
    assert down.outcome is GateOutcome.FAILED and down.transient and "region eu-west" in down.detail

    rollout_services.health.set("eu-west", HANG)
    started = time.monotonic()
    hung = evaluate(HttpGate(url=rollout_services.health.url, expect_status=200, timeout_s=1), context())
    assert time.monotonic() - started < 5
    assert hung.outcome is GateOutcome.FAILED and hung.transient and "Timeout" in hung.detail


# --- soak and approval in real time ------------------------------------------------------------------------


def test_soak_waits_with_progress_until_its_time_is_up():
    moved_at = time.time()
    waiting = evaluate(SoakGate(seconds=2), context(moved_at=moved_at))
    assert waiting.outcome is GateOutcome.WAITING and waiting.detail == "soak 0s of 2s"
    assert 0 < waiting.retry_in_s <= 2
    time.sleep(waiting.retry_in_s + 0.1)
    assert evaluate(SoakGate(seconds=2), context(moved_at=moved_at)).outcome is GateOutcome.PASSED


def test_approval_is_per_wave():
    assert evaluate(ApprovalGate(), context(approvals=("rest",))).outcome is GateOutcome.WAITING
    assert evaluate(ApprovalGate(), context(approvals=("canary",))).outcome is GateOutcome.PASSED
