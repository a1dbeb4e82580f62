"""The pipeline's figures (metrics.figures: from each command's record) and where they go (metrics.export),
and what the webhook counts (admission.metrics), without a network."""
from __future__ import annotations

import datetime as dt
import http.server
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from imagebuild.admission.metrics import WebhookMetrics, decision_reason
from imagebuild.cli import cli
from imagebuild.metrics import export
from imagebuild.metrics.figures import (
    MOVE_STEP,
    ExceptionFact,
    Family,
    Run,
    exception_figures,
    gc_figures,
    release_figures,
    rescan_figures,
    rollout_figures,
    run_figures,
)
from imagebuild.metrics.sizes import platform_of, pulled_bytes
from imagebuild.oci.names import BadName
from imagebuild.trust.verify import CacheStats

DIGEST = "sha256:" + "a" * 64


def samples(families: list[Family], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one family (by its name without the prefix), by their labels."""
    found = [f for f in families if f.name == name]
    assert len(found) == 1, f"{name}: {[f.name for f in families]}"
    return {s.labels: s.value for s in found[0].samples}


def labels(**pairs: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(pairs.items()))


def step(index, kind, wave, region, tag, state="pending", done_at=None):
    return {"index": index, "kind": kind, "wave": wave, "region": region, "tag": tag, "state": state,
            "done_at": done_at}


def rollout_record(status="running", **overrides):
    record = {
        "id": "20261204t200000-abcdef", "digest": DIGEST, "status": status, "channels": ["stable", "beta"],
        "created_at": "2026-12-04T20:00:00+00:00",
        "steps": [
            step(0, "copy", "canary", "eu-west", None, "done", "2026-12-04T20:00:05+00:00"),
            step(1, "move-tag", "canary", "eu-west", "stable", "done", "2026-12-04T20:01:00+00:00"),
            step(2, "move-tag", "canary", "eu-west", "beta", "done", "2026-12-04T20:01:01+00:00"),
            step(3, "move-tag", "rest", "us-east", "stable"),
            step(4, "move-tag", "rest", "us-east", "beta"),
        ],
        "waves": {"canary": {"state": "passed"}, "rest": {"state": "copying"}},
    }
    record.update(overrides)
    return record


# --- rollout ---------------------------------------------------------------------------------------------------


def test_a_rollout_tells_each_channel_its_status_waves_and_which_regions_moved():
    figures = rollout_figures(rollout_record(), "stable", ["canary", "rest"])
    status = samples(figures, "rollout_status")
    assert status[labels(channel="stable", status="running")] == 1
    assert sum(status.values()) == 1  # one status at a time, the others 0
    assert samples(figures, "rollout_region_moved") == {
        labels(channel="stable", region="eu-west", wave="canary"): 1,
        labels(channel="stable", region="us-east", wave="rest"): 0}
    waves = samples(figures, "rollout_wave_state")
    assert waves[labels(channel="stable", wave="rest", state="copying")] == 1
    assert waves[labels(channel="stable", wave="rest", state="pending")] == 0
    canary = dt.datetime(2026, 12, 4, 20, 1, tzinfo=dt.timezone.utc).timestamp()
    assert samples(figures, "rollout_canary_moved_timestamp_seconds") == {labels(channel="stable"): canary}
    assert samples(figures, "rollout_info") == {labels(channel="stable", rollout="20261204t200000-abcdef",
                                                       digest=DIGEST): 1}
    assert samples(figures, "rollout_steps_done") == {labels(channel="stable"): 3}


def test_the_move_step_is_named_as_the_rollout_plan_names_it():
    from imagebuild.rollout.plan import StepKind

    assert MOVE_STEP == StepKind.MOVE.value


def test_a_rolled_back_rollout_has_no_region_at_its_digest():
    figures = rollout_figures(rollout_record("rolled-back"), "stable", ["canary", "rest"])
    assert set(samples(figures, "rollout_region_moved").values()) == {0}
    assert samples(figures, "rollout_status")[labels(channel="stable", status="rolled-back")] == 1


def test_before_the_canary_moves_there_is_no_canary_time():
    record = rollout_record(steps=[step(1, "move-tag", "canary", "eu-west", "stable")])
    names = {f.name for f in rollout_figures(record, "stable", ["canary", "rest"])}
    assert "rollout_canary_moved_timestamp_seconds" not in names


def test_a_record_with_odd_fields_gives_fewer_samples_not_an_error():
    record = {"id": 7, "status": ["x"], "steps": "none", "waves": [1], "created_at": "yesterday"}
    figures = rollout_figures(record, "stable", [])
    assert set(samples(figures, "rollout_status").values()) == {0}
    assert samples(figures, "rollout_region_moved") == {}
    assert "rollout_started_timestamp_seconds" not in {f.name for f in figures}


# --- release, rescan, exceptions, gc, runs ---------------------------------------------------------------------


def test_a_release_tells_per_variant_its_stage_seconds_layers_and_findings():
    report = {
        "layers": [{"key": "k1", "status": "built", "duration_s": 30.5}, {"key": "k2", "status": "reused"},
                   {"key": "k3", "status": "built", "duration_s": 4.5}],
        "variants": [{"id": "cpu", "chain": ["k2", "k3"], "stages": {
            "smoke": {"duration_s": 12.0},
            "scan": {"duration_s": 40.0, "counts": {"vulnerabilities": {"CRITICAL": 1, "HIGH": 2},
                                                    "misconfigurations": {"HIGH": 0}, "secrets": 0}},
            "gate": {"counts": {"blocked": 0, "excepted": 1, "ignored-unfixed": 2, "below-threshold": 5}}}}],
    }
    summary = {"variants": [{"id": "cpu", "status": "released"}, {"id": "gpu", "status": "failed"}]}
    figures = release_figures(report, summary, {"cpu": {"linux/amd64": 123456}})
    assert samples(figures, "variant_released") == {labels(variant="cpu"): 1, labels(variant="gpu"): 0}
    assert samples(figures, "stage_duration_seconds") == {
        labels(variant="cpu", stage="build"): 4.5,  # its chain's built layer only
        labels(variant="cpu", stage="smoke"): 12.0, labels(variant="cpu", stage="scan"): 40.0}
    assert samples(figures, "variant_layers") == {labels(variant="cpu", status="built"): 1,
                                                  labels(variant="cpu", status="reused"): 1}
    findings = samples(figures, "image_findings")
    assert findings[labels(variant="cpu", kind="vulnerability", severity="CRITICAL")] == 1
    assert findings[labels(variant="cpu", kind="secret", severity="CRITICAL")] == 0
    assert samples(figures, "image_gate_findings")[labels(variant="cpu", verdict="excepted")] == 1
    assert samples(figures, "image_size_bytes") == {labels(variant="cpu", platform="linux/amd64"): 123456}


def test_a_rescan_counts_images_by_status_and_blocking_findings_by_severity():
    results = [
        {"digest": DIGEST, "status": "quarantined", "blocking": [{"severity": "CRITICAL"}, {"severity": "HIGH"},
                                                                 {"severity": "HIGH"}]},
        {"digest": "sha256:" + "b" * 64, "status": "passed", "blocking": []},
        {"digest": "sha256:" + "c" * 64, "status": "still-quarantined", "blocking": [{"severity": "HIGH"}]},
    ]
    figures = rescan_figures(results, {"ap-south": "connection refused"})
    assert samples(figures, "rescan_images") == {labels(status="passed"): 1, labels(status="quarantined"): 1,
                                                 labels(status="still-quarantined"): 1, labels(status="failed"): 0}
    assert samples(figures, "rescan_blocking_findings")[labels(digest=DIGEST, severity="HIGH")] == 2
    assert samples(figures, "quarantined_images") == {(): 2}
    assert samples(figures, "rescan_unreachable_regions") == {(): 1}


def test_an_exception_stops_counting_at_the_end_of_its_last_valid_day():
    figures = exception_figures([ExceptionFact("CVE-2026-0001", "team-a", dt.date(2026, 12, 31))])
    end = dt.datetime(2027, 1, 1, tzinfo=dt.timezone.utc).timestamp()
    assert samples(figures, "policy_exception_expiry_timestamp_seconds") == {
        labels(id="CVE-2026-0001", owner="team-a"): end}


def test_gc_tells_per_region_what_is_live_and_dead_and_per_registry_the_bytes_a_sweep_frees():
    report = {"regions": [{"region": "eu-west", "live": 4, "dead": [{"digest": DIGEST}]}],
              "registries": [{"registry": "127.0.0.1:5001", "bytes": 2048}],
              "deleted": [DIGEST], "state": {"records": 9, "compacted_records": ["a", "b"]}}
    figures = gc_figures(report)
    assert samples(figures, "gc_manifests") == {labels(region="eu-west", judged="live"): 4,
                                                labels(region="eu-west", judged="dead"): 1}
    assert samples(figures, "gc_reclaimable_bytes") == {labels(registry="127.0.0.1:5001"): 2048}
    assert samples(figures, "gc_deleted_manifests") == {(): 1}
    assert samples(figures, "gc_compacted_records") == {(): 2}


def test_a_run_says_how_it_ended():
    figures = run_figures(Run("rescan", 3, 100.0, 160.5))
    assert samples(figures, "run_exit_code") == {labels(command="rescan"): 3}
    assert samples(figures, "run_success") == {labels(command="rescan"): 0}
    assert samples(figures, "run_duration_seconds") == {labels(command="rescan"): 60.5}


# --- the text format, textfiles, the Pushgateway ---------------------------------------------------------------


def parsed(data: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {family.name: [(dict(s.labels), s.value) for s in family.samples]
            for family in text_string_to_metric_families(data.decode())}


def test_the_text_format_carries_the_groups_labels_on_every_sample():
    families = [Family("a", "A.").add(1, region="eu-west"), Family("b", "B.").add(2), Family("empty", "None.")]
    found = parsed(export.exposition(families, {"release": "reg/state"}))
    assert found == {"imagebuild_a": [({"region": "eu-west", "release": "reg/state"}, 1.0)],
                     "imagebuild_b": [({"release": "reg/state"}, 2.0)]}


def test_a_label_value_with_quotes_and_newlines_stays_one_sample():
    families = [Family("a", "A.").add(1, owner='team "a"\nline two')]
    assert parsed(export.exposition(families))["imagebuild_a"] == [({"owner": 'team "a"\nline two'}, 1.0)]


def test_a_textfile_replaces_the_last_one_whole_and_leaves_no_temporary_file(tmp_path):
    first = export.write_textfile(tmp_path, "imagebuild_gc", {"release": "r/s"}, [Family("a", "A.").add(1)])
    second = export.write_textfile(tmp_path, "imagebuild_gc", {"release": "r/s"}, [Family("a", "A.").add(2)])
    assert first == second and first.name == "imagebuild_gc_release-r_s.prom"
    assert parsed(second.read_bytes())["imagebuild_a"] == [({"release": "r/s"}, 2.0)]
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_a_textfile_that_cannot_be_written_is_a_metrics_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(export.MetricsExportError, match="cannot write"):
        export.write_textfile(blocker, "imagebuild_gc", {}, [Family("a", "A.").add(1)])


def test_a_group_value_that_is_not_plain_goes_base64_in_the_pushgateway_url():
    url = export.group_url("http://pg:9091/", "imagebuild_rollout", {"release": "127.0.0.1:5000/x/y",
                                                                     "channel": "stable"})
    assert url == ("http://pg:9091/metrics/job/imagebuild_rollout/channel/stable/"
                   "release@base64/MTI3LjAuMC4xOjUwMDAveC95")
    assert export.group_url("http://pg", "j", {"empty": ""}).endswith("/empty@base64/=")
    with pytest.raises(export.MetricsExportError, match="not a Prometheus label name"):
        export.group_url("http://pg", "j", {"bad-name": "v"})


class Gateway:
    """A loopback HTTP server of the test's own, answering pushes with the statuses it is given, in turn."""

    def __init__(self, *statuses: int, body: bytes = b"") -> None:
        self.statuses = list(statuses)
        self.seen: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        gateway = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                gateway.seen.append((self.command, self.path, self.headers.get("Authorization")))
                self.send_response(gateway.statuses.pop(0) if gateway.statuses else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_PUT = do_POST = answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gateway():
    started: list[Gateway] = []

    def start(*statuses: int, body: bytes = b"") -> Gateway:
        started.append(Gateway(*statuses, body=body))
        return started[-1]

    yield start
    for one in started:
        one.close()


def test_a_push_is_retried_through_the_one_retry_policy_and_replaces_the_group(gateway):
    pg = gateway(503)
    export.push(pg.url, "imagebuild_gc", {"release": "r"}, [Family("a", "A.").add(1)])
    assert [(method, path) for method, path, _ in pg.seen] == [("PUT", "/metrics/job/imagebuild_gc/release/r")] * 2


def test_a_push_of_the_run_alone_does_not_replace_the_groups_other_figures(gateway):
    pg = gateway()
    export.push(pg.url, "j", {}, [Family("a", "A.").add(1)], replace=False)
    assert [method for method, _, _ in pg.seen] == ["POST"]


def test_a_refused_push_names_the_pushgateway_without_its_credentials(gateway):
    pg = gateway(400, body=b"pushed metrics are invalid")
    with_credentials = pg.url.replace("http://", "http://user:s3cret@")
    with pytest.raises(export.MetricsExportError, match=r"http://127\.0\.0\.1:\d+ refused the push: HTTP 400 "
                                                        r"pushed metrics are invalid") as caught:
        export.push(with_credentials, "j", {}, [Family("a", "A.").add(1)])
    assert "s3cret" not in str(caught.value)
    assert pg.seen[0][2] is not None and pg.seen[0][2].startswith("Basic ")  # the credentials went as basic auth


def test_a_pushgateway_that_is_down_warns_and_the_textfile_is_still_written(tmp_path):
    warnings: list[str] = []
    target = export.MetricsTarget(tmp_path, "http://127.0.0.1:9", timeout_s=1.0)
    started = time.monotonic()
    done = export.export(target, "imagebuild_gc", {"release": "r"}, [Family("a", "A.").add(1)],
                         run_figures(Run("gc", 0, 1.0, 2.0)), warnings.append)
    assert time.monotonic() - started < 10  # a refused connection: three quick tries, never the run's time
    assert [Path(p).name for p in done] == ["imagebuild_gc_release-r.prom", "imagebuild_gc_release-r.run.prom"]
    assert len(warnings) == 1 and warnings[0].startswith("metrics: cannot push to http://127.0.0.1:9")


def test_a_run_without_figures_writes_only_its_own_file(tmp_path):
    export.export(export.MetricsTarget(tmp_path), "imagebuild_rescan", {"release": "r"}, [],
                  run_figures(Run("rescan", 3, 1.0, 2.0)), lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == ["imagebuild_rescan_release-r.run.prom"]


# --- the command line -----------------------------------------------------------------------------------------


def test_a_pushgateway_that_is_not_an_http_url_is_bad_input():
    result = CliRunner().invoke(cli, ["--metrics-pushgateway", "ftp://pg:21", "support"])
    assert result.exit_code == 2
    assert "is not an http(s) URL of a Pushgateway" in result.output


def test_a_command_that_stops_on_bad_input_writes_no_figures(tmp_path):
    release = tmp_path / "release.yaml"
    release.write_text("schema: 1\nregions: [\n")
    result = CliRunner().invoke(cli, ["--metrics-textfile-dir", str(tmp_path / "tf"), "gc", "--release",
                                      str(release)])
    assert result.exit_code == 2
    assert not (tmp_path / "tf").exists()


# --- the webhook -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("log", "reason"), [
    ({"decision": "allowed", "images": [{"allowed": True}]}, "verified"),
    ({"decision": "denied", "images": [{"allowed": True}, {"allowed": False}]}, "refused"),
    ({"decision": "denied", "images": [{"allowed": False, "unreachable": True}]}, "registry_unreachable"),
    ({"decision": "warned", "images": [{"allowed": False, "unreachable": True}]}, "registry_unreachable"),
    ({"decision": "allowed", "skipped": "not a Pod", "images": []}, "not_covered"),
    ({"decision": "allowed", "images": []}, "no_images"),
    ({"decision": "malformed", "error": "not JSON"}, "malformed"),
    ({"decision": "denied", "uid": "u", "error": "kind: expected AdmissionReview"}, "malformed"),
])
def test_each_decision_has_one_reason_from_a_bounded_set(log, reason):
    assert decision_reason(log) == reason


def test_the_webhook_counts_decisions_latency_images_and_its_verdict_cache():
    metrics = WebhookMetrics(cache_stats=lambda: CacheStats(hits=5, misses=2))
    metrics.decided("validate", {"decision": "allowed", "images": [{"allowed": True}, {"allowed": True}]}, 0.002)
    metrics.decided("mutate", {"decision": "denied", "images": [{"allowed": False, "unreachable": True}]}, 1.5)
    found = parsed(metrics.exposition())
    decisions = {(s["endpoint"], s["decision"], s["reason"]): v for s, v in found["imagebuild_webhook_decisions"]
                 if v}
    assert decisions == {("validate", "allowed", "verified"): 1, ("mutate", "denied", "registry_unreachable"): 1}
    images = {s["verdict"]: v for s, v in found["imagebuild_webhook_images"] if "verdict" in s and s.get("verdict")}
    assert images == {"allowed": 2, "refused": 0, "unreachable": 1}
    latency = {s["le"]: v for s, v in found["imagebuild_webhook_review_duration_seconds"]
               if s.get("endpoint") == "mutate" and "le" in s}
    assert latency["1.0"] == 0 and latency["2.5"] == 1
    assert [v for _, v in found["imagebuild_webhook_verify_cache_hits"]] == [5]
    assert [v for _, v in found["imagebuild_webhook_verify_cache_misses"]] == [2]


def test_the_webhooks_metrics_name_no_image_and_no_namespace():
    metrics = WebhookMetrics()
    metrics.decided("validate", {"decision": "denied", "object": "secret-ns/pod-x",
                                 "images": [{"allowed": False, "image": "reg/secret-image:1", "reason": "unsigned"}]},
                    0.01)
    text = metrics.exposition().decode()
    assert "secret" not in text and "unsigned" not in text


# --- image sizes from manifests --------------------------------------------------------------------------------


def descriptor(size: object, digest: str = DIGEST) -> dict:
    return {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": size}


def test_an_image_pulls_its_config_and_its_layers():
    assert pulled_bytes({"config": descriptor(100), "layers": [descriptor(2000), descriptor(30000)]}) == 32100


@pytest.mark.parametrize("manifest", [
    {"config": descriptor(-1), "layers": []},
    {"config": descriptor(True), "layers": []},
    {"config": descriptor(None), "layers": []},
    {"config": descriptor(1, digest="sha256:../../etc"), "layers": []},
    {"layers": [descriptor(1)]},
])
def test_a_manifest_whose_sizes_cannot_be_trusted_is_refused(manifest):
    with pytest.raises(BadName, match="size|digest|not an object|no size"):
        pulled_bytes(manifest)


@pytest.mark.parametrize(("entry", "platform"), [
    ({"platform": {"os": "linux", "architecture": "amd64"}}, "linux/amd64"),
    ({"platform": {"os": "linux", "architecture": "arm64", "variant": "v8"}}, "linux/arm64/v8"),
    ({"platform": {"os": "unknown", "architecture": "unknown"}}, None),  # BuildKit's attestation manifest
    ({"platform": "linux/amd64"}, None),
    ({}, None),
])
def test_an_index_entry_names_its_platform_or_is_no_runnable_image(entry, platform):
    assert platform_of(entry) == platform
