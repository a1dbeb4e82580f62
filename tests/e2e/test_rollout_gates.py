"""Rollout gates against real services: Prometheus (Debian's), a health endpoint, the regional
registries with cosign signatures, and the smoke suite in Docker."""
from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild.config.release_file import (
    ApprovalGate,
    HttpGate,
    PrometheusGate,
    Region,
    SignatureGate,
    SmokeGate,
    SoakGate,
)
from imagebuild.config.trust import Mode, Requirements, TrustConfig, trust_config_for_keys
from imagebuild.rollout.gates import GateContext, GateOutcome, evaluate

from .rollout_harness import HANG, HealthServer, closed_port_url, self_signed_tls, unique_metric
from .tools import crane, push_tiny_image

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


def test_health_endpoint_with_a_certificate_no_system_ca_trusts_fails_for_good(tmp_path):
    server = HealthServer(tls=self_signed_tls(tmp_path / "tls"))
    server.set("eu-west", 200)
    try:
        result = evaluate(HttpGate(url=server.url, expect_status=200, timeout_s=2), context())
    finally:
        server.stop()
    assert result.outcome is GateOutcome.FAILED and not result.transient, result.detail
    assert "certificate not trusted" in result.detail and server.requests == []


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


# --- signatures in the regional registries ---------------------------------------------------------------

@dataclass
class SignedImages:
    repository: str  # the same repository name in every regional registry
    signed: str  # digest signed in eu-west (and copied without its signature to us-east)
    unsigned: str  # digest never signed
    trust: TrustConfig


@pytest.fixture(scope="module")
def signed_images(tmp_path_factory, cosign_cli, our_key) -> SignedImages:
    tmp = tmp_path_factory.mktemp("gates-images")
    repository = f"imagebuild-e2e/gates-{uuid.uuid4().hex[:10]}"
    signed = push_tiny_image(tmp, f"{EU_WEST.registry}/{repository}:signed")
    unsigned = push_tiny_image(tmp, f"{EU_WEST.registry}/{repository}:unsigned")
    cosign_cli.sign(f"{EU_WEST.registry}/{repository}@{signed}", our_key)
    # us-east gets the image but not its signature (a copy by digest of the manifest alone).
    crane("copy", f"{EU_WEST.registry}/{repository}@{signed}", f"{US_EAST.registry}/{repository}:signed")
    trust = trust_config_for_keys([our_key.public], images=["127.0.0.1:*/imagebuild-e2e/**"])
    return SignedImages(repository, signed, unsigned, trust)


def in_region(images: SignedImages, region: Region, digest: str) -> GateContext:
    placed = Region(region.name, region.registry, images.repository)
    return context(placed, image=placed.image(digest), digest=digest, trust=images.trust)


def test_signature_gate_passes_a_signed_image_in_the_region(signed_images):
    result = evaluate(SignatureGate(), in_region(signed_images, EU_WEST, signed_images.signed))
    assert result.outcome is GateOutcome.PASSED, result.detail
    assert "region eu-west (127.0.0.1:5001)" in result.detail and "signed by cosign.pub" in result.detail


def test_signature_gate_fails_an_unsigned_image(signed_images):
    result = evaluate(SignatureGate(), in_region(signed_images, EU_WEST, signed_images.unsigned))
    assert result.outcome is GateOutcome.FAILED and not result.transient
    assert "region eu-west" in result.detail and "signature" in result.detail.lower()


def test_signature_gate_fails_the_region_where_the_signature_was_not_copied(signed_images):
    result = evaluate(SignatureGate(), in_region(signed_images, US_EAST, signed_images.signed))
    assert result.outcome is GateOutcome.FAILED and not result.transient, result.detail
    assert "region us-east (127.0.0.1:5002)" in result.detail


def test_signature_gate_with_the_registry_down_fails_naming_the_region_and_may_be_retried(signed_images):
    down = Region("ap-south", closed_port_url().removeprefix("http://"), signed_images.repository)
    result = evaluate(SignatureGate(), context(down, digest=signed_images.signed, trust=signed_images.trust))
    assert result.outcome is GateOutcome.FAILED and result.transient
    assert "region ap-south" in result.detail and "unreachable" in result.detail


# --- pull and smoke from the region's registry ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_workdir(tmp_path_factory, engine) -> Path:
    """One workdir for the module's smoke gates, so pytest for the containers is installed once."""
    return tmp_path_factory.mktemp("gates-smoke")


def test_smoke_gate_fails_an_image_that_is_not_a_paddle_image(tmp_path, smoke_workdir):
    repository = f"imagebuild-e2e/gates-smoke-{uuid.uuid4().hex[:10]}"
    digest = push_tiny_image(tmp_path, f"{EU_WEST.registry}/{repository}:plain", base="127.0.0.1:5000/imagebuild/debian:12")
    region = Region(EU_WEST.name, EU_WEST.registry, repository)
    result = evaluate(SmokeGate(tier="abi"), context(region, image=region.image(digest), digest=digest,
                                                     workdir=smoke_workdir))
    assert result.outcome is GateOutcome.FAILED and not result.transient, result.detail
    assert "region eu-west" in result.detail and "io.imagebuild.variant" in result.detail


def test_smoke_gate_fails_when_the_region_does_not_have_the_image(smoke_workdir):
    region = Region(EU_WEST.name, EU_WEST.registry, f"imagebuild-e2e/gates-missing-{uuid.uuid4().hex[:10]}")
    result = evaluate(SmokeGate(tier="abi"), context(region, digest=DIGEST, workdir=smoke_workdir))
    assert result.outcome is GateOutcome.FAILED and not result.transient, result.detail
    assert "region eu-west" in result.detail and "not found" in result.detail


CPU_VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
PADDLE_IN_REGION = "imagebuild-e2e/gates-paddle"  # fixed: a rerun finds the layers already there


@pytest.fixture(scope="module")
def paddle_in_eu_west(built_example) -> tuple[Region, str]:
    """The example's CPU image copied by digest to the eu-west registry."""
    [image] = [v["image"] for v in built_example.report["variants"] if v["id"] == CPU_VARIANT]
    digest = image.split("@", 1)[1]
    crane("copy", image, f"{EU_WEST.registry}/{PADDLE_IN_REGION}:cpu", timeout=1800)
    return Region(EU_WEST.name, EU_WEST.registry, PADDLE_IN_REGION), digest


def test_smoke_gate_passes_the_example_paddle_image_pulled_from_the_region(paddle_in_eu_west, smoke_workdir):
    region, digest = paddle_in_eu_west
    result = evaluate(SmokeGate(tier="abi"), context(region, image=region.image(digest), digest=digest,
                                                     workdir=smoke_workdir))
    assert result.outcome is GateOutcome.PASSED, result.detail
    assert "0 failed" in result.detail and "tier abi" in result.detail
    # Asked again while the wave's other gates wait: the passed run is not repeated.
    shutil.rmtree(smoke_workdir / "smoke" / "eu-west")
    again = evaluate(SmokeGate(tier="abi"), context(region, image=region.image(digest), digest=digest,
                                                    workdir=smoke_workdir))
    assert again.outcome is GateOutcome.PASSED and again.detail == result.detail
    assert not (smoke_workdir / "smoke" / "eu-west").exists()


def test_smoke_gate_fails_naming_the_tests_when_the_image_is_not_what_its_labels_say(paddle_in_eu_west,
                                                                                     smoke_workdir):
    region, digest = paddle_in_eu_west
    mislabelled = crane("mutate", "--label", "io.imagebuild.paddle.version=0.0.1",
                        "-t", f"{region.registry}/{PADDLE_IN_REGION}:mislabelled", region.image(digest)).strip()
    digest = mislabelled.rsplit("@", 1)[1]
    result = evaluate(SmokeGate(tier="abi"), context(region, image=region.image(digest), digest=digest,
                                                     workdir=smoke_workdir))
    assert result.outcome is GateOutcome.FAILED and not result.transient, result.detail
    assert "smoke tests failed: " in result.detail and "test_paddle_imports_at_the_expected_version" in result.detail
