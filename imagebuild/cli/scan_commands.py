"""imagebuild scan and gate: Trivy over the built images, then the vulnerability policy."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from imagebuild.checks import gate as gating
from imagebuild.checks import scan as scanning
from imagebuild.checks.gate_run import run_gate
from imagebuild.cli.common import (
    echo,
    format_option,
    only_option,
    report_at,
    reports_input_errors,
    workdir_option,
)
from imagebuild.config.selection import Selection
from imagebuild.core import report as reporting
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError


@click.command()
@workdir_option
@only_option
@click.option("--dockerfiles", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Rendered Dockerfiles for `trivy config` (default: dockerfiles/ beside the report's matrix).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=scanning.DEFAULT_CACHE,
              show_default=True, help="Trivy's cache, shared by every scan so that a layer is analysed once; "
                                      "CACHE_DIR/db holds the vulnerability DB.")
@click.option("--offline", is_flag=True,
              help="Download nothing: use the DB already in CACHE_DIR/db and no network lookups.")
@click.option("--db-repository", metavar="REF", default=None,
              help="OCI repository of your Trivy DB mirror, e.g. registry.example.com/mirror/trivy-db:2.")
@click.option("--insecure-registry", "insecure_registries", multiple=True, metavar="HOST:PORT",
              help="Reach this registry over plain http too (loopback registries always are).")
@click.option("--timeout", default="30m", show_default=True, help="Trivy's time limit per image.")
@format_option("table", "json")
@reports_input_errors
def scan(workdir: Path, only: tuple[str, ...], dockerfiles: Path | None, cache_dir: Path, offline: bool,
         db_repository: str | None, insecure_registries: tuple[str, ...], timeout: str, output_format: str) -> None:
    """Scan every built image of the build report, by digest, with Trivy.

    Vulnerabilities and secrets per image, `trivy config` on the rendered Dockerfiles, and a
    CycloneDX SBOM per image. Reports go to WORKDIR/scan/; each variant's result is recorded in
    the build report. Exit 1 when a scan could not run; findings are the gate's business.

    \b
    Examples:
      imagebuild scan                                    # after imagebuild build
      imagebuild scan --db-repository registry.example.com/mirror/trivy-db:2
      imagebuild scan --offline --cache-dir /srv/trivy   # a DB already in /srv/trivy/db
      imagebuild scan --only device=cpu --format json
    """
    selection = Selection.parse(only)
    if offline and db_repository:
        raise InputError("--db-repository", None, "", "--offline uses the DB in --cache-dir and downloads nothing")
    report_path = workdir / "build-report.json"
    report = reporting.BuildReport.read(report_path)
    variants = selection.choose(report.variants, str(report_path))
    options = scanning.ScanOptions(
        workdir=workdir, dockerfiles=dockerfiles or Path(report.matrix).parent / "dockerfiles",
        cache_dir=cache_dir, offline=offline, db_repository=db_repository, timeout=timeout,
        insecure_registries=insecure_registries)
    trivy = scanning.Trivy.find()

    def progress(event: str, variant: reporting.VariantRecord, record: reporting.ScanStage | None) -> None:
        if record is None:
            echo(f"scanning {variant.id} ({variant.image})", err=True)
        else:
            error = f": {record.error}" if record.error else ""
            echo(f"  {record.status} in {record.duration_s} s{_layers_note(record.layers)}{error}", err=True)

    run = scanning.ScanRun(report, report_path, options, trivy, on_event=progress)
    report_at(report_path)
    summary = run.run(variants)  # an interrupt stops Trivy and marks the image being scanned (common.py)
    if output_format == "json":
        click.echo(json.dumps(summary, indent=2))
    else:
        print_scan_summary(summary, workdir)
    if any(row["status"] == "failed" for row in summary["variants"]):
        sys.exit(ExitCode.FAILED)


def _layers_note(layers: dict[str, Any] | None) -> str:
    if not layers:
        return ""
    if layers.get("reused") is None:
        return f"; {layers['total']} layers (reuse not reported by Trivy)"
    return f"; layers: {layers['reused']} of {layers['total']} from Trivy's cache"


def print_scan_summary(summary: dict[str, Any], workdir: Path) -> None:
    for row in summary["variants"]:
        c = row.get("counts") or {}
        vulns = c.get("vulnerabilities", {})
        misconf = c.get("misconfigurations", {})
        found = (f"vulnerabilities C{vulns.get('CRITICAL', 0)} H{vulns.get('HIGH', 0)} M{vulns.get('MEDIUM', 0)} "
                 f"L{vulns.get('LOW', 0)}, secrets {c.get('secrets', 0)}, Dockerfile checks failed "
                 f"{sum(misconf.values())}") if c else (row.get("error") or "")
        echo(f"  {row['status']:8} {row['id']}  {found}{_layers_note(row.get('layers'))}")
    layers = summary["layers"]
    echo(f"layers: {layers['reused']} of {layers['total']} reused from Trivy's cache, {layers['analysed']} "
         f"analysed ({summary['cache_dir']})")
    db = summary["db"]
    echo(f"vulnerability DB: updated {db['updated_at']} ({db['source']}); reports: {workdir / 'scan'}; "
         f"{summary['duration_s']} s")


@click.command("gate")
@workdir_option
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("policies/vulnerabilities.yaml"), show_default=True, help="The vulnerability policy.")
@only_option
@click.option("--strict", is_flag=True, help="Fail on stale exceptions (that match no finding) too.")
@format_option("table", "json", "sarif")
@reports_input_errors
def gate_command(workdir: Path, policy_path: Path, only: tuple[str, ...], strict: bool, output_format: str) -> None:
    """Judge the scanned images against the vulnerability policy; record the verdict per variant.

    Blocks on findings at or above the policy's severity without a valid exception, expired
    exceptions, secrets, and HIGH/CRITICAL Dockerfile misconfigurations; stale exceptions warn
    (fail with --strict). Writes WORKDIR/gate/result.json and result.sarif. Exit 1 when blocked.

    \b
    Examples:
      imagebuild gate                                   # after imagebuild scan
      imagebuild gate --strict --format sarif > gate.sarif
      imagebuild gate --policy policies/vulnerabilities.yaml --format json
    """
    report_at(workdir / "build-report.json")
    outcome = run_gate(workdir, policy_path, Selection.parse(only), strict=strict)
    if output_format == "json":
        click.echo(json.dumps(outcome.record, indent=2))
    elif output_format == "sarif":
        click.echo(json.dumps(outcome.sarif, indent=2))
    else:
        print_gate(outcome.result)
    if not outcome.passed:
        sys.exit(ExitCode.FAILED)


def print_gate(result: gating.GateResult) -> None:
    for image in result.images:
        echo(f"{'PASSED ' if image.passed else 'BLOCKED'}  {image.variant}  {image.image}")
        rows = []
        for d in image.blocking + image.excepted:
            f = d.finding
            what = (f"{f.package} {f.installed}" if f.kind == "vulnerability" else f.subject())
            fixed = (f"fixed in {f.fixed}" if f.fixed else "no fix") if f.kind == "vulnerability" else f.kind
            rows.append(["blocks" if d.verdict == gating.BLOCKED else "excepted", f.id, f.severity, what, fixed, d.why])
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(5)]
        for r in rows:
            echo("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r[:5])) + f"  {r[5]}")
        for problem in image.problems:
            echo(f"  problem  {problem}")
        for warning in image.warnings:
            echo(f"  warning  {warning}")
        counts = image.counts()
        echo(f"  {counts[gating.BLOCKED]} blocking, {counts[gating.EXCEPTED]} excepted, "
             f"{counts[gating.IGNORED_UNFIXED]} ignored (no fix yet), "
             f"{counts[gating.BELOW_THRESHOLD]} below the threshold")
    blocked = sum(not image.passed for image in result.images)
    verdict = "passed" if result.passed else f"failed: {blocked} of {len(result.images)} image(s) blocked"
    echo(f"gate {verdict} (policy {result.policy.file}: severity {result.policy.severity}, ignore_unfixed "
         f"{'on' if result.policy.ignore_unfixed else 'off'}{', strict' if result.strict else ''})")
