"""Prometheus sees imagebuild: a real Prometheus, started here, scrapes the admission webhook's GET /metrics
over HTTPS and a real Pushgateway that `imagebuild gc` pushed its figures to, and loads the alerting rules; a
real rollout that halts and is rolled back writes the figures the rollout alerts read. Nothing is mocked: the
webhook judges images pushed to the local registries and signed with cosign."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .admission_harness import Registry, start_webhook_process, trust_file, unique_repository
from .certs import Authority
from .conftest import REGIONS, STAGING, require_registry
from .rollout_harness import HealthServer, Prometheus, Pushgateway, free_port
from .test_rollout import Setup, rollout_id_of
from .tools import bootstrap_key, crane

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_RELEASE = REPO / "examples" / "local" / "release.yaml"
EXAMPLE_STATE = "127.0.0.1:5000/imagebuild-example/rollouts"  # its state repository: the release's label
RULES = REPO / "monitoring" / "prometheus" / "imagebuild-alerts.yaml"


def imagebuild(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "imagebuild", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def pod(*images: str) -> dict:
    containers = [{"name": f"c{i}", "image": image} for i, image in enumerate(images)]
    request = {"uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
               "resource": {"group": "", "version": "v1", "resource": "pods"},
               "name": "web", "namespace": "team-a", "operation": "CREATE",
               "userInfo": {"username": "system:serviceaccount:team-a:deployer"},
               "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "team-a"},
                          "spec": {"containers": containers}}}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@pytest.fixture(scope="module")
def observed(tmp_path_factory, staging_registry, cosign_cli, our_key):
    """A webhook, a Pushgateway and a Prometheus scraping both (and loading the alerting rules)."""
    workdir = tmp_path_factory.mktemp("metrics")
    tls = Authority.new().issue(workdir / "tls", "imagebuild-admission", ("localhost", "127.0.0.1"))
    registry = Registry(workdir / "images", cosign_cli, our_key)
    signed = registry.push(unique_repository())
    registry.sign(signed)
    unsigned = registry.push(unique_repository())
    webhook = start_webhook_process(workdir, tls, trust_file(workdir))
    gateway = Pushgateway(workdir / "pushgateway").start()
    prometheus = Prometheus(workdir / "prometheus", [gateway.address], rule_files=[RULES], scrape_configs=[{
        "job_name": "imagebuild-webhook", "scheme": "https", "tls_config": {"ca_file": str(tls.ca)},
        "static_configs": [{"targets": [f"127.0.0.1:{webhook.port}"]}]}])
    try:
        prometheus.start()
        yield {"webhook": webhook, "gateway": gateway, "prometheus": prometheus, "signed": signed,
               "unsigned": unsigned, "workdir": workdir}
    finally:
        prometheus.stop()
        gateway.stop()
        webhook.stop()


def test_prometheus_scrapes_the_webhooks_decisions_latency_and_cache_over_https(observed):
    webhook, prometheus = observed["webhook"], observed["prometheus"]
    for _ in range(3):  # the first verifies at the registry, the next two come from the cache
        assert webhook.review(pod(observed["signed"]))["allowed"] is True
    assert webhook.review(pod(observed["unsigned"]))["allowed"] is False
    prometheus.wait_for_value('sum(imagebuild_webhook_decisions_total{job="imagebuild-webhook", '
                              'decision="allowed", reason="verified"})', 3)
    prometheus.wait_for_value('sum(imagebuild_webhook_decisions_total{job="imagebuild-webhook", '
                              'decision="denied", reason="refused"})', 1)
    prometheus.wait_for_value('sum(imagebuild_webhook_review_duration_seconds_count{job="imagebuild-webhook"})', 4)
    prometheus.wait_for_value('imagebuild_webhook_verify_cache_hits_total{job="imagebuild-webhook"}', 2)
    prometheus.wait_for_value('imagebuild_webhook_verify_cache_misses_total{job="imagebuild-webhook"}', 2)
    prometheus.wait_for_value('sum(imagebuild_webhook_images_total{verdict="refused"})', 1)
    prometheus.wait_for_value('imagebuild_webhook_ready{job="imagebuild-webhook"}', 1)


def test_the_webhooks_metrics_are_served_in_prometheus_text_format_and_name_no_image(observed):
    webhook = observed["webhook"]
    answer = webhook.client.get(f"{webhook.url}/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=")
    names = {family.name for family in text_string_to_metric_families(answer.text)}
    assert {"imagebuild_webhook_decisions", "imagebuild_webhook_review_duration_seconds",
            "imagebuild_webhook_in_flight_requests", "imagebuild_webhook_registry_errors"} <= names
    assert "admission-e2e" not in answer.text  # no repository, so no image, as a label


def test_gc_pushes_its_figures_to_the_pushgateway_and_prometheus_scrapes_them(observed):
    gateway, prometheus = observed["gateway"], observed["prometheus"]
    result = imagebuild("--metrics-pushgateway", gateway.url, "gc", "--release", str(EXAMPLE_RELEASE),
                        "--format", "json")
    assert result.returncode == 0, result.stderr
    regions = [region["region"] for region in json.loads(result.stdout)["regions"]]
    assert "metrics: " + gateway.url + "/metrics/job/imagebuild_gc/release@base64/" in result.stderr
    samples = prometheus.wait_until(f'imagebuild_gc_manifests{{release="{EXAMPLE_STATE}", judged="live"}}',
                                    lambda s: len(s) == len(regions))
    assert sorted(labels["region"] for labels, _ in samples) == sorted(regions)
    prometheus.wait_for_value(f'imagebuild_run_success{{command="gc", release="{EXAMPLE_STATE}"}}', 1)
    prometheus.wait_for_value(f'imagebuild_run_exit_code{{command="gc", release="{EXAMPLE_STATE}"}}', 0)


def test_the_alerting_rules_load_into_the_real_prometheus(observed):
    status, body = observed["prometheus"]._get("/api/v1/rules")
    assert status == 200
    loaded = {rule["name"] for group in json.loads(body)["data"]["groups"] for rule in group["rules"]}
    assert {"ImagebuildRolloutHalted", "ImagebuildImageQuarantined", "ImagebuildWebhookSlow"} <= loaded
    assert all(group["rules"] and all(rule["health"] != "err" for rule in group["rules"])
               for group in json.loads(body)["data"]["groups"])


def test_a_pushgateway_that_is_down_costs_a_warning_not_the_run(observed, tmp_path):
    textfiles = tmp_path / "textfile"
    result = imagebuild("gc", "--release", str(EXAMPLE_RELEASE), env={
        "IMAGEBUILD_METRICS_PUSHGATEWAY": f"http://metrics:s3cret@127.0.0.1:{free_port()}",
        "IMAGEBUILD_METRICS_TEXTFILE_DIR": str(textfiles)})
    assert result.returncode == 0, result.stderr
    assert "warning: metrics: cannot push to http://127.0.0.1:" in result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    written = sorted(path.name for path in textfiles.iterdir())
    assert len(written) == 2 and all(name.startswith("imagebuild_gc_release-") for name in written)
    for path in textfiles.iterdir():  # what node-exporter's textfile collector reads, as promtool lints it
        lint = subprocess.run(["promtool", "check", "metrics"], input=path.read_text(), capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr


def rollout_figures_in(directory: Path, channel: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The figures a rollout wrote for `channel` (its own textfile), by metric name."""
    [path] = [p for p in directory.iterdir() if p.name.startswith("imagebuild_rollout_") and
              f"channel-{channel}_" in p.name and not p.name.endswith(".run.prom")]
    return {family.name: [(dict(s.labels), s.value) for s in family.samples]
            for family in text_string_to_metric_families(path.read_text())}


def test_a_halted_rollout_and_its_rollback_write_the_figures_the_alerts_read(tmp_path, monkeypatch):
    for host in [STAGING, *REGIONS.values()]:
        require_registry(host)
    bootstrap_key()
    textfiles = tmp_path / "textfile"
    monkeypatch.setenv("IMAGEBUILD_METRICS_TEXTFILE_DIR", str(textfiles))
    health = HealthServer()
    health.set("eu-west", 500)  # the canary moves, then its http gate fails: the rollout halts
    try:
        setup = Setup(tmp_path)
        setup.write(f"""\
            - name: canary
              regions: [eu-west]
              gates:
                http: {{url: "{health.url}", expect_status: 200, timeout: 2s}}
            - name: rest
              regions: [us-east, ap-south]
            """)
        setup.seed("stable")
        image = setup.source()
        run = setup.start(image)
        assert run.returncode == 1, run.stderr
        halted = rollout_figures_in(textfiles, "stable")
        back = setup.cli("rollback", rollout_id_of(run))
        assert back.returncode == 0, back.stderr
        rolled_back = rollout_figures_in(textfiles, "stable")
    finally:
        health.stop()
    status = {labels["status"]: value for labels, value in halted["imagebuild_rollout_status"]}
    assert status["halted"] == 1 and sum(status.values()) == 1
    moved = {labels["region"]: value for labels, value in halted["imagebuild_rollout_region_moved"]}
    assert moved == {"eu-west": 1, "us-east": 0, "ap-south": 0}
    assert [labels["channel"] for labels, _ in halted["imagebuild_rollout_canary_moved_timestamp_seconds"]] == \
        ["stable"]
    waves = {labels["wave"]: labels["state"] for labels, value in halted["imagebuild_rollout_wave_state"] if value}
    assert waves == {"canary": "failed", "rest": "pending"}
    assert {labels["release"] for labels, _ in halted["imagebuild_rollout_status"]} == \
        {f"{STAGING}/{setup.name}/rollouts"}
    status = {labels["status"]: value for labels, value in rolled_back["imagebuild_rollout_status"]}
    assert status["rolled-back"] == 1
    assert {value for _, value in rolled_back["imagebuild_rollout_region_moved"]} == {0}


def test_an_images_size_is_what_its_manifest_says_a_node_pulls(observed):
    from imagebuild.metrics.sizes import image_sizes
    from imagebuild.oci.client import Registries

    image = observed["signed"]
    manifest = json.loads(crane("manifest", image))
    expected = manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])
    with Registries() as registries:
        assert image_sizes(registries, image, ["linux/amd64"]) == {"linux/amd64": expected}
        assert image_sizes(registries, image.split("@")[0] + "@sha256:" + "0" * 64, ["linux/amd64"]) == {}
