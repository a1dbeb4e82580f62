"""monitoring/: the alerting rules (real promtool: checked, and unit-tested by their own test file), the
Grafana dashboard (Grafana's Foundation SDK models: it loads as Grafana provisions it) and its provisioning
file, and that every metric they name is one imagebuild exports."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from imagebuild.admission.metrics import WebhookMetrics
from imagebuild.metrics import figures
from imagebuild.trust.verify import CacheStats

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "monitoring"
RULES = MONITORING / "prometheus" / "imagebuild-alerts.yaml"
RULE_TESTS = MONITORING / "prometheus" / "imagebuild-alerts.test.yaml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "imagebuild.json"
PROVISIONING = MONITORING / "grafana" / "provisioning" / "dashboards.yaml"
NAME = re.compile(r"\bimagebuild_[a-z0-9_]+")


def promtool() -> str:
    found = shutil.which("promtool") or "/usr/bin/promtool"
    assert Path(found).exists(), "promtool is missing (Debian's prometheus package; scripts/bootstrap.sh installs it)"
    return found


def exported_names() -> set[str]:
    """Every series name imagebuild writes: the pipeline's figures (from records that give every family a
    sample) and the webhook's exposition (with the _total, _bucket ... suffixes the client adds)."""
    record = {"id": "r", "digest": "sha256:" + "a" * 64, "status": "running", "created_at": "2026-12-01T00:00:00+00:00",
              "steps": [{"kind": figures.MOVE_STEP, "wave": "canary", "region": "eu", "tag": "stable", "state": "done",
                         "done_at": "2026-12-01T00:01:00+00:00"}], "waves": {"canary": {"state": "passed"}}}
    families = [
        *figures.rollout_figures(record, "stable", ["canary"]),
        *figures.release_figures({"variants": [], "layers": []}, {}),
        *figures.rescan_figures([], {}),
        *figures.exception_figures([]),
        *figures.gc_figures({}),
        *figures.run_figures(figures.Run("gc", 0, 0.0, 1.0)),
    ]
    names = figures.names_of(families)
    text = WebhookMetrics(cache_stats=lambda: CacheStats(1, 1)).exposition().decode()
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
    return names


def test_the_alerting_rules_pass_promtools_check():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerting_rules_pass_their_promtool_unit_tests():
    result = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_quiet():
    """Quiet: a case expecting no alert, or a firing case given more series than the alerts it expects."""
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    firing, quiet = set(), set()
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            if case["exp_alerts"]:
                firing.add(case["alertname"])
            if len(case["exp_alerts"]) < len(test["input_series"]):
                quiet.add(case["alertname"])
    assert alerts == firing
    assert alerts == quiet


def test_the_issue_asks_for_these_alerts():
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    assert {"ImagebuildRolloutHalted", "ImagebuildImageQuarantined", "ImagebuildWebhookErrors",
            "ImagebuildWebhookSlow", "ImagebuildRegionLaggingCanary", "ImagebuildExceptionExpiringSoon"} <= alerts


def test_every_metric_the_rules_and_the_dashboard_name_is_one_imagebuild_exports():
    exported = exported_names()
    named = set(NAME.findall(RULES.read_text())) | set(NAME.findall(DASHBOARD.read_text()))
    assert named, "no imagebuild metric named at all"
    assert named - exported == set()


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_committed_dashboard_is_what_its_builder_writes():
    result = subprocess.run([sys.executable, str(MONITORING / "grafana" / "build_dashboard.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _contained(small: object, big: object, where: str = "") -> list[str]:
    """Where `small` has something `big` lacks or holds otherwise (big may have more keys: the SDK's defaults)."""
    if isinstance(small, dict):
        if not isinstance(big, dict):
            return [f"{where}: not an object after the round trip"]
        return [miss for key, value in small.items()
                for miss in ([f"{where}/{key}: dropped"] if key not in big else _contained(value, big[key],
                                                                                         f"{where}/{key}"))]
    if isinstance(small, list):
        if not isinstance(big, list) or len(big) != len(small):
            return [f"{where}: list changed"]
        return [miss for i, (a, b) in enumerate(zip(small, big)) for miss in _contained(a, b, f"{where}/{i}")]
    return [] if small == big else [f"{where}: {small!r} became {big!r}"]


def test_the_dashboard_loads_through_grafanas_schema_models_losing_nothing():
    """Decoded by the SDK's generated models of Grafana's dashboard schema (panels by their plugin's own
    options and field config), then encoded again: a key the schema does not know would be dropped."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    original = dashboard()
    again = json.loads(json.dumps(Dashboard.from_json(original), cls=JSONEncoder))
    assert _contained(original, again) == []


def test_the_dashboard_is_one_grafana_provisions_with_unique_panel_ids_and_prometheus_queries():
    board = dashboard()
    assert board["uid"] == "imagebuild" and board["title"] == "imagebuild"
    panels = board["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    queried = [panel for panel in panels if panel["type"] != "row"]
    assert queried and all(panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for panel in queried)
    assert all(panel["targets"] and all(t["expr"] for t in panel["targets"]) for panel in queried)
    refs = [[t["refId"] for t in panel["targets"]] for panel in queried]
    assert all(len(r) == len(set(r)) and all(r) for r in refs)


def test_the_provisioning_file_loads_the_dashboards_folder():
    provisioning = yaml.safe_load(PROVISIONING.read_text())
    assert provisioning["apiVersion"] == 1
    [provider] = provisioning["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].endswith("/dashboards/imagebuild")


@pytest.mark.parametrize("expr", sorted({t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
                                         for t in p.get("targets", [])}))
def test_each_dashboard_query_is_promql_that_prometheus_parses(expr, tmp_path):
    """promtool checks an expression only inside a rule: each query goes into a recording rule of its own."""
    rules = tmp_path / "q.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": [{"record": "q:check", "expr": expr}]}]}))
    result = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
