"""imagebuild release: the whole chain per variant in one command (logic in release_run.py)."""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from imagebuild.checks import scan as scanning
from imagebuild.cli.common import (
    _revision,
    builders_and_jobs,
    builders_option,
    echo,
    exports_figures,
    format_option,
    matrix_option,
    metrics_scope,
    metrics_wanted,
    only_option,
    policy_figures,
    record_figures,
    report_at,
    reports_input_errors,
    revision_option,
    safe,
    safe_markup,
    secret_lane_options,
    stdout,
    trust_file_option,
)
from imagebuild.cli.progress import LineProgress
from imagebuild.config.selection import Selection
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.release.pipeline import STAGES, Outcome, ReleaseOptions, ReleaseRun, with_registry

DEFAULT_KEY = Path("/var/lib/imagebuild/keys/cosign.key")  # where scripts/bootstrap.sh makes it
_HOST = r"^[A-Za-z0-9.-]+(?::\d{1,5})?$"


def gate_scan_and_sign_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--policy, --cache-dir, --offline, --db-repository and --key, as `release` and `admission image` take them."""
    options = [
        click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path),
                     default=Path("policies/vulnerabilities.yaml"), show_default=True, help="The vulnerability policy."),
        click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=scanning.DEFAULT_CACHE,
                     show_default=True, help="Trivy's cache; CACHE_DIR/db holds the vulnerability DB."),
        click.option("--offline", is_flag=True, help="Scan with the DB already in CACHE_DIR/db; download nothing."),
        click.option("--db-repository", metavar="REF", default=None, help="OCI repository of your Trivy DB mirror."),
        click.option("--key", metavar="PATH|URI", default=str(DEFAULT_KEY), show_default=True,
                     envvar="IMAGEBUILD_SIGNING_KEY",
                     help="cosign private key file or KMS URI (or IMAGEBUILD_SIGNING_KEY); its password comes from "
                          "COSIGN_PASSWORD."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def checked_scan_source(offline: bool, db_repository: str | None) -> None:
    if offline and db_repository:
        raise InputError("--db-repository", None, "", "--offline uses the DB in --cache-dir and downloads nothing")


@click.command("release")
@matrix_option
@only_option
@click.option("--registry", "registry", default=None, metavar="HOST[:PORT]",
              help="The staging registry to build into, instead of the matrix's `registry` (CI passes its own).")
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=None,
              help="Independent layers built at once [default: 2; with --builders, their concurrency added up].")
@builders_option
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
              show_default=True, help="Where the build report and every stage's results go.")
@click.option("--dockerfiles", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Rendered Dockerfiles (default: dockerfiles/ beside the matrix).")
@click.option("--secret", "secret_overrides", multiple=True, metavar="ID=PATH",
              help="Take a declared build secret from this file instead.")
@secret_lane_options
@revision_option
@click.option("--tier", type=click.Choice(["all", "abi", "gpu"]), default="all", show_default=True,
              help="Smoke test tier (gpu runs on GPU hosts; skipped with its reason elsewhere).")
@gate_scan_and_sign_options
@click.option("--push-to", "push_to", default=None, metavar="REGISTRY/PROJECT",
              help="Then copy each signed image there (as `imagebuild push --to`); without it, no push stage.")
@trust_file_option("With --push-to: the trust config push verifies against [default: policies/trust.yaml].")
@format_option("table", "json")
@reports_input_errors
@exports_figures("release")
def release_command(matrix_path: Path, only: tuple[str, ...], registry: str | None, jobs: int | None,
                    builders_path: Path | None, workdir: Path,
                    dockerfiles: Path | None, secret_overrides: tuple[str, ...], secret_dirs: tuple[str, ...],
                    secret_env: tuple[str, ...], revision: str | None, tier: str,
                    policy_path: Path, cache_dir: Path, offline: bool, db_repository: str | None, key: str,
                    push_to: str | None, trust_path: Path | None, output_format: str) -> None:
    """Build, smoke-test, scan, gate, sign and push each variant: the whole chain in one command.

    \b
    Per variant, in order: build (layers the registry has are reused by content key), smoke
    tests, Trivy scan, the vulnerability gate, cosign signature and attestations, and with
    --push-to the copy to the release registry. A variant stops at its first failing stage;
    the others go on. A rerun does no work that is done: an unchanged variant keeps its
    digest, and its smoke, scan, gate, signature and push results for that digest are reused
    (the summary says so per variant and stage). Everything goes into WORKDIR/build-report.json.

    Exit 0 when every variant went through; 1 when any stopped; 2 on bad input; 3 when a tool
    or service is missing; 130/143 when interrupted (a rerun finishes the job).

    \b
    Examples:
      imagebuild release --matrix examples/local/matrix.yaml --policy examples/local/policy.yaml \\
          --offline --cache-dir .imagebuild/trivy-example
      imagebuild release --only id=$VARIANT --registry "$IMAGEBUILD_REGISTRY"       # one CI job
      imagebuild release --push-to harbor.example.com/paddle --trust policies/trust.yaml --format json
    """
    import re

    from imagebuild.checks.gate import parse_policy
    from imagebuild.cli.push_command import checked_repository, trust_config
    from imagebuild.cli.sign_command import signing_options
    from imagebuild.config.matrix import load_matrix
    from imagebuild.core.source import load_document
    from imagebuild.metrics.figures import release_figures

    selection = Selection.parse(only)
    if registry is not None:
        registry = registry.strip() or None  # an unset CI variable: the matrix's own registry
    if registry is not None and not re.fullmatch(_HOST, registry):
        raise InputError("--registry", None, registry, "is not a registry host[:port]")
    checked_scan_source(offline, db_repository)
    builders, jobs_at_once = builders_and_jobs(builders_path, jobs)
    matrix = with_registry(load_matrix(matrix_path), registry)
    metrics_scope(repository=f"{matrix.registry}/{matrix.repository}")
    from imagebuild.build import scheduler as building

    lane = building.SecretLane.from_settings(secret_dirs, secret_env)
    building.check_secret_lane(matrix, lane, building.parse_secret_overrides(secret_overrides))
    policy = parse_policy(load_document(policy_path))  # bad policy: exit 2 before anything is built
    sign_options = signing_options(key, False, None, None, None, None, None, None, False, (), 300)
    trust = None
    if push_to is not None:
        push_to = checked_repository("--push-to", push_to)
        trust = trust_config(trust_path, ())
    elif trust_path is not None:
        raise InputError("--trust", None, "", "is for the push stage: add --push-to REGISTRY/PROJECT")
    rev, created = _revision(revision)
    dockerfiles = dockerfiles or matrix_path.parent / "dockerfiles"
    options = ReleaseOptions(workdir=workdir, jobs=jobs_at_once, builders=builders, dockerfiles=dockerfiles,
                             secret_overrides=secret_overrides, secret_lane=lane, smoke_tier=tier,
                             policy=policy_path, push_to=push_to)
    scan_options = scanning.ScanOptions(workdir=workdir, dockerfiles=dockerfiles, cache_dir=cache_dir,
                                        offline=offline, db_repository=db_repository)
    run = ReleaseRun(options, scan_options, sign_options, trust, on_event=lambda line: echo(line, err=True),
                     on_layer=LineProgress())
    report_at(workdir / "build-report.json")
    run.run(matrix, selection, rev, created, "sha256:" + hashlib.sha256(matrix_path.read_bytes()).hexdigest())
    summary = run.summary()
    report = _report(workdir)
    record_figures([*release_figures(report, summary, _sizes(report)), *policy_figures(policy)])
    if output_format == "json":
        click.echo(json.dumps(summary, indent=2))
    else:
        print_release(summary)
    if summary["status"] != "released":
        sys.exit(ExitCode.FAILED)


def _report(workdir: Path) -> dict[str, Any]:
    """The build report as the run left it, for its figures (an unreadable one has none)."""
    try:
        data = json.loads((workdir / "build-report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _sizes(report: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Each built variant's compressed bytes per platform, from its manifests (only when figures are asked for)."""
    if not metrics_wanted():
        return {}
    from imagebuild.metrics.sizes import image_sizes
    from imagebuild.oci.client import Registries

    sizes = {}
    with Registries() as registries:
        for variant in report.get("variants") or []:
            if isinstance(variant, dict) and isinstance(variant.get("image"), str) and "@" in variant["image"]:
                sizes[str(variant.get("id"))] = image_sizes(registries, variant["image"], variant.get("platforms") or [])
    return sizes


_STYLE = {Outcome.DONE.value: "green", Outcome.REUSED.value: "cyan", Outcome.FAILED.value: "bold red",
          Outcome.NOT_REACHED.value: "dim", Outcome.OFF.value: "dim"}


def print_release(summary: dict[str, Any]) -> None:
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("variant", *STAGES, "result"):
        table.add_column(column, overflow="fold")
    for v in summary["variants"]:
        cells = []
        for name in STAGES:
            cell = v["stages"].get(name) or {"outcome": "not reached", "result": "-"}
            cells.append(f"[{_STYLE.get(cell['outcome'], '')}]{safe_markup(cell['result'])}[/]")
        table.add_row(safe_markup(v["id"]), *cells,
                      safe_markup(v["status"] if v["status"] == "released" else f"failed at {v['failed_stage']}"))
    stdout.print(table)
    for v in summary["variants"]:
        for name in STAGES:
            cell = v["stages"].get(name)
            if cell and cell["outcome"] == "failed":
                stdout.print(safe(f"{v['id']}: {name} failed: {cell['detail']}"), markup=False)
    work = summary["work"]
    if summary["nothing_new"]:
        pushed = any(v["stages"].get("push", {}).get("outcome") == "reused" for v in summary["variants"])
        stdout.print("nothing new: every variant was already built, tested, scanned, gated"
                     + (", signed and pushed" if pushed else " and signed") + " at these digests")
    else:
        stdout.print(f"work done: {work['layers_built']} layers built, {work['smoke_runs']} smoke runs, "
                     f"{work['scans']} scans, {work['gate_runs']} gate verdicts, {work['signed']} signed, "
                     f"{work['pushed']} pushed")
    released = sum(v["status"] == "released" for v in summary["variants"])
    stdout.print(safe(f"{released} of {len(summary['variants'])} variant(s) released in {summary['duration_s']} s; "
                      f"report: {summary['report']}"), markup=False)
