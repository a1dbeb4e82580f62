"""Writes dashboards/imagebuild.json, the Grafana dashboard of imagebuild, from Grafana's Foundation SDK.

    python monitoring/grafana/build_dashboard.py           # write it
    python monitoring/grafana/build_dashboard.py --check   # exit 1 when the committed file differs

The SDK (grafana-foundation-sdk, the project's test extra) is Grafana's own typed builders of the dashboard
schema, so the file is what Grafana provisions (provisioning/dashboards.yaml points at its folder). Every
metric a panel queries is one imagebuild exports (tests/test_monitoring.py checks that).
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).parent / "dashboards" / "imagebuild.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
_ids = itertools.count(1)  # panel ids, unique in the dashboard (links to a panel name it by id)


def query(expr: str, legend: str = "", instant: bool = False, ref: str = "A") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref)
    return q.instant() if instant else q


def series(title: str, unit: str, *queries: prometheus.Dataquery, width: int = 12) -> timeseries.Panel:
    panel = (timeseries.Panel().id(next(_ids)).title(title).unit(unit).datasource(DATASOURCE).height(8).span(width)
             .legend(common.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                     .placement(LegendPlacement.BOTTOM)))
    for q in queries:
        panel = panel.with_target(q)
    return panel


def number(title: str, expr: str, unit: str = "none", width: int = 6) -> stat.Panel:
    return (stat.Panel().id(next(_ids)).title(title).unit(unit).datasource(DATASOURCE).height(4).span(width)
            .color_mode(BigValueColorMode.VALUE).graph_mode(BigValueGraphMode.NONE)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
            .with_target(query(expr, instant=True)))


def rows_of(title: str, expr: str, width: int = 12) -> table.Panel:
    return (table.Panel().id(next(_ids)).title(title).datasource(DATASOURCE).height(8).span(width).show_header(True)
            .with_target(query(expr, instant=True).format("table")))


def row(title: str) -> dashboard.Row:
    return dashboard.Row(title).id(next(_ids))


def build() -> dict[str, object]:
    board = (
        dashboard.Dashboard("imagebuild").uid("imagebuild").tags(["imagebuild", "paddlepaddle"])
        .description("Rollouts, quarantines, policy exceptions, the admission webhook and the pipeline's runs.")
        .refresh("1m").time("now-24h", "now").timezone("utc")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_row(row("Rollouts"))
        .with_panel(number("Halted rollouts", 'sum(imagebuild_rollout_status{status="halted"})'))
        .with_panel(number("Running rollouts", 'sum(imagebuild_rollout_status{status="running"})'))
        .with_panel(number("Quarantined images", "max(imagebuild_quarantined_images)"))
        .with_panel(number("Exceptions expiring within 14 days",
                           "count(imagebuild_policy_exception_expiry_timestamp_seconds - time() < 14 * 86400)"))
        .with_panel(rows_of("Latest rollout per channel",
                            "max by (release, channel, status) (imagebuild_rollout_status) == 1"))
        .with_panel(rows_of("Regions at the rollout's digest",
                            "max by (release, channel, wave, region) (imagebuild_rollout_region_moved)"))
        .with_panel(rows_of("Wave states", "max by (release, channel, wave, state) (imagebuild_rollout_wave_state) == 1"))
        .with_panel(series("Hours since the canary moved", "h",
                           query("(time() - imagebuild_rollout_canary_moved_timestamp_seconds) / 3600",
                                 "{{channel}}")))
        .with_row(row("Images and vulnerabilities"))
        .with_panel(series("Images behind channel tags, by rescan status", "none",
                           query("sum by (status) (imagebuild_rescan_images)", "{{status}}")))
        .with_panel(series("Blocking findings behind channel tags", "none",
                           query("sum by (severity) (imagebuild_rescan_blocking_findings)", "{{severity}}")))
        .with_panel(rows_of("Days until each exception stops counting",
                            "(imagebuild_policy_exception_expiry_timestamp_seconds - time()) / 86400"))
        .with_panel(series("Vulnerabilities per variant (last release run)", "none",
                           query('sum by (variant, severity) (imagebuild_image_findings{kind="vulnerability"})',
                                 "{{variant}} {{severity}}")))
        .with_panel(series("Image size per variant and platform", "bytes",
                           query("imagebuild_image_size_bytes", "{{variant}} {{platform}}")))
        .with_panel(series("Seconds per stage and variant", "s",
                           query("imagebuild_stage_duration_seconds", "{{variant}} {{stage}}")))
        .with_row(row("Admission webhook"))
        .with_panel(series("Reviews per second, by decision and reason", "reqps",
                           query("sum by (decision, reason) (rate(imagebuild_webhook_decisions_total[5m]))",
                                 "{{decision}} {{reason}}")))
        .with_panel(series("Review latency", "s",
                           query("histogram_quantile(0.5, sum by (le) "
                                 "(rate(imagebuild_webhook_review_duration_seconds_bucket[5m])))", "p50"),
                           query("histogram_quantile(0.99, sum by (le) "
                                 "(rate(imagebuild_webhook_review_duration_seconds_bucket[5m])))", "p99", ref="B")))
        .with_panel(series("Verdict cache hit ratio", "percentunit",
                           query("sum(rate(imagebuild_webhook_verify_cache_hits_total[5m])) / "
                                 "(sum(rate(imagebuild_webhook_verify_cache_hits_total[5m])) + "
                                 "sum(rate(imagebuild_webhook_verify_cache_misses_total[5m])))", "hits"), width=8))
        .with_panel(series("Registry errors per second", "reqps",
                           query("sum(rate(imagebuild_webhook_registry_errors_total[5m]))", "errors"), width=8))
        .with_panel(series("Reviews in flight", "none",
                           query("sum(imagebuild_webhook_in_flight_requests)", "in flight"), width=8))
        .with_row(row("Pipeline runs"))
        .with_panel(rows_of("Last run of each command",
                            "max by (release, repository, command) (imagebuild_run_exit_code)"))
        .with_panel(series("Run duration", "s", query("imagebuild_run_duration_seconds", "{{command}}")))
        .with_panel(series("Bytes gc would free (sweep)", "bytes",
                           query("imagebuild_gc_reclaimable_bytes", "{{registry}}")))
        .with_panel(series("Manifests by gc's judgement", "none",
                           query("sum by (region, judged) (imagebuild_gc_manifests)", "{{region}} {{judged}}")))
    )
    data: dict[str, object] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    return data


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is not what {Path(__file__).name} writes: run it again", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
