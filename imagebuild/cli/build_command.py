"""imagebuild build: BuildKit builds in layer order, the build report."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import click

from imagebuild.build import plan as planning
from imagebuild.build import scheduler as building
from imagebuild.build.pool import layer_builder_for
from imagebuild.cli.common import (
    _revision,
    builders_and_jobs,
    builders_option,
    dockerfiles_dir,
    echo,
    format_option,
    matrix_option,
    only_option,
    report_at,
    reports_input_errors,
    revision_option,
    safe_lines,
    secret_lane_options,
    stderr,
)
from imagebuild.cli.progress import progress_for
from imagebuild.config.matrix import load_matrix
from imagebuild.config.selection import Selection
from imagebuild.core import report as reporting
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError


@click.command()
@matrix_option
@only_option
@click.option("--layers", "layer_refs", multiple=True, metavar="LAYER[,LAYER...]",
              help="Build these layers (content key, 8+ digit prefix, or path like base/debian12) and "
                   "the parents they need, tagging no variant; alone, no variant is selected.")
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=None,
              help="Independent layers built at once [default: 2; with --builders, their concurrency added up].")
@builders_option
@click.option("--dry-run", is_flag=True, help="Plan against the registry and write the report; build nothing.")
@click.option("--dockerfiles", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Rendered Dockerfiles (default: dockerfiles/ beside the matrix).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
              show_default=True, help="Where the build report and logs go.")
@click.option("--layer-timeout", "layer_timeout_s", type=click.IntRange(1, 7 * 86400), default=3600,
              show_default=True, metavar="SECONDS",
              help="Stop a layer's build after this long; it fails as 'timed out after N s'.")
@click.option("--secret", "secret_overrides", multiple=True, metavar="ID=PATH",
              help="Take a declared build secret from this file instead (e.g. from CI's secret store).")
@secret_lane_options
@click.option("--push-with", type=click.Choice(["imagebuild", "docker"]), default="imagebuild", show_default=True,
              help="imagebuild: new layers gzipped on every core, the parent's blobs reused; "
                   "docker: `docker push` (one core).")
@revision_option
@format_option("table", "json")
@reports_input_errors
def build(matrix_path: Path, only: tuple[str, ...], layer_refs: tuple[str, ...], jobs: int | None,
          builders_path: Path | None, dry_run: bool, dockerfiles: Path | None,
          workdir: Path, layer_timeout_s: int, secret_overrides: tuple[str, ...], secret_dirs: tuple[str, ...],
          secret_env: tuple[str, ...], push_with: str, revision: str | None, output_format: str) -> None:
    """Build the matrix's layers with BuildKit, parents first, reusing every key the registry has.

    Layer images go to the cache repository under their content keys; each variant gets its
    tags once its whole chain is built. Writes WORKDIR/build-report.json even when builds fail
    or the build is interrupted (SIGINT: exit 130, SIGTERM: exit 143); a rerun finishes the job.

    \b
    Examples:
      imagebuild build --matrix examples/local/matrix.yaml
      imagebuild build --only device=cpu --jobs 4
      imagebuild build --dry-run --format json     # what would be built
      imagebuild build --layers base/debian12      # one shared layer (CI's first fan-out level)
      imagebuild build --secret-dir /run/ci-secrets --secret-env PIP_CONF   # the secrets' lane
      imagebuild build --builders builders.yaml    # on a pool of BuildKit daemons
    """
    selection = Selection.parse(only)
    builders, jobs_at_once = builders_and_jobs(builders_path, jobs)
    matrix = load_matrix(matrix_path)
    overrides = building.parse_secret_overrides(secret_overrides)
    lane = building.SecretLane.from_settings(secret_dirs, secret_env)
    building.check_secret_lane(matrix, lane, overrides)  # before any registry request or build
    rev, created = _revision(revision)
    the_plan = building.prepare(matrix, rev, created)
    refs = [ref.strip() for refs in layer_refs for ref in refs.split(",") if ref.strip()]
    if layer_refs and not refs:
        raise InputError("--layers", None, "", "names no layer")
    layers = planning.find_layers(the_plan, refs)
    # --layers alone builds layers, no variant; with --only, both.
    variants = selection.choose(the_plan.variants, str(matrix_path)) if selection or not layers else []
    report = building.registry_plan(the_plan, variants, layer_keys=layers)
    report.revision = rev
    report.matrix_sha256 = "sha256:" + hashlib.sha256(matrix_path.read_bytes()).hexdigest()  # for the provenance
    secrets = building.secret_files(matrix, overrides, lane)
    options = building.BuildOptions(jobs=jobs_at_once, dry_run=dry_run,
                                    dockerfiles=dockerfiles_dir(matrix_path, dockerfiles),
                                    workdir=workdir, secrets=secrets.paths, secret_values=secrets.values,
                                    layer_timeout_s=layer_timeout_s, push=push_with)
    view = progress_for(stderr)
    for rec in report.layers:
        if rec.status == "to-build":
            view.add(rec)
    report_at(workdir / "build-report.json")
    try:
        with view:
            pool = layer_builder_for(builders, report, options)
            report = building.Builder(the_plan, report, options, view, layer_builder=pool).run()
    finally:
        secrets.close()
    print_build_summary(report, workdir / "build-report.json", output_format)
    if report.status == "failed":
        sys.exit(ExitCode.FAILED)


def print_build_summary(report: reporting.BuildReport, path: Path, output_format: str) -> None:
    summary = report.summary()
    if output_format == "json":
        click.echo(json.dumps({"report": str(path), "status": report.status, "layers": summary,
                               "variants": [{"id": v.id, "status": v.status, "image": v.image,
                                             "tags": v.images} for v in report.variants]}, indent=2))
        return
    built, reused = summary.get("built", 0), summary.get("reused", 0)
    if report.status == "planned":
        echo(f"{summary.get('to-build', 0)} to build, {reused} reused (dry run; report: {path})")
    elif built == 0 and report.status == "ok":
        click.echo(f"nothing to build: all {reused} layers reused")
    else:
        click.echo(f"{built} built, {reused} reused, {summary.get('failed', 0)} failed, "
                   f"{summary.get('skipped', 0)} skipped")
    for v in report.variants:
        echo(f"  {v.status:8} {v.id}  {v.image or ''}")
    timed = [rec for rec in report.layers if rec.steps]
    if timed:
        click.echo("where the time went (s):")
    for rec in timed:
        steps = "  ".join(f"{name.removesuffix('_s')} {value}" for name, value in (rec.steps or {}).items())
        echo(f"  {rec.path:60} {steps}  ({rec.pushed_by or 'not pushed'})")
    for rec in report.layers:
        if rec.status == "failed":  # the log's tail: what the matrix's run steps printed, escaped
            click.echo(err=True)
            echo(f"FAILED {rec.path} (log: {rec.log}):", err=True)
            click.echo(safe_lines(rec.error), err=True)
    echo(f"report: {path}")
