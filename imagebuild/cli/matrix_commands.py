"""validate, support, plan, render: the matrix and what it expands to (no engine needed)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.table import Table

from imagebuild.build import fanout as fanning
from imagebuild.build import plan as planning
from imagebuild.build import scheduler as building
from imagebuild.build.render import check_tree, write_tree
from imagebuild.cli.common import (
    _revision,
    dockerfiles_dir,
    echo,
    format_option,
    matrix_option,
    only_option,
    registry_option,
    reports_input_errors,
    revision_option,
    safe_markup,
    stdout,
)
from imagebuild.config.matrix import Matrix, load_matrix
from imagebuild.config.selection import Selection
from imagebuild.config.support import load_support_table, version_key
from imagebuild.core import report as reporting
from imagebuild.core.errors import ExitCode
from imagebuild.oci.client import ImageRef, Registry


@click.command()
@matrix_option
@format_option("table", "json", "github-matrix", "github-fanout", "github-output")
@registry_option
@only_option
@revision_option
@click.option("--layer-levels", type=click.IntRange(1, 16), default=fanning.LAYER_LEVELS, show_default=True,
              help="github-fanout/-output: levels of shared-layer jobs before the variant jobs.")
@click.option("--shards", type=click.IntRange(1, 64), default=fanning.VARIANT_SHARDS, show_default=True,
              help="github-fanout/-output: matrices of variant jobs (256 jobs each at most).")
@reports_input_errors
def plan(matrix_path: Path, output_format: str, use_registry: bool, only: tuple[str, ...],
         revision: str | None, layer_levels: int, shards: int) -> None:
    """Show the variants, their tags and layer chains; shared layers are marked.

    With --registry, also what a build would do: "N to build, M reused" per layer.

    \b
    Examples:
      imagebuild plan --matrix examples/local/matrix.yaml
      imagebuild plan --matrix examples/local/matrix.yaml --registry
      imagebuild plan --format json | jq '.variants[].tags'
      imagebuild plan --format github-matrix   # strategy.matrix for GitHub Actions
      imagebuild plan --format github-fanout   # shared layers once, then variant jobs, 256 per matrix
      imagebuild plan --registry --format github-output >> "$GITHUB_OUTPUT"   # only what changed

    github-fanout and github-output: levels of CI jobs. Each layer several variants need is
    built by one job of a layer level, before the jobs that need it; then the variant jobs
    (`imagebuild release --only id=...`). With --registry, only the changed variants (a tag or a
    layer below the release layer missing) and the layers the cache lacks.
    """
    selection = Selection.parse(only)
    matrix = load_matrix(matrix_path)
    rev, created = _revision(revision)
    if output_format in ("github-fanout", "github-output"):
        print_fanout(matrix, selection, str(matrix_path), rev, created, use_registry, output_format,
                     layer_levels, shards)
        return
    if use_registry:
        the_plan = building.prepare(matrix, rev, created)
        report = building.registry_plan(the_plan, selection.choose(the_plan.variants, str(matrix_path)),
                                        resolve_digests=output_format != "table")
        if output_format == "table":
            print_registry_plan(the_plan, report)
        else:
            click.echo(json.dumps(building.registry_plan_record(the_plan, report), indent=2))
        return
    the_plan = planning.build_plan(matrix, revision=rev, created=created)
    selected = {v.id for v in selection.choose(the_plan.variants, str(matrix_path))}
    if output_format == "json":
        click.echo(json.dumps(planning.plan_record(the_plan, selected), indent=2))
    elif output_format == "github-matrix":
        click.echo(json.dumps(planning.github_matrix(the_plan, selected), separators=(",", ":")))
    else:
        print_plan(the_plan, selected)


def print_fanout(matrix: Matrix, selection: Selection, where: str, rev: str, created: str, use_registry: bool,
                 output_format: str, layer_levels: int, shards: int) -> None:
    if use_registry:
        the_plan = building.prepare(matrix, rev, created)
        variants = selection.choose(the_plan.variants, where)
        report = building.registry_plan(the_plan, variants, resolve_digests=False)
        cached = {rec.key for rec in report.layers if rec.status == "reused"}
        repository = ImageRef.parse(the_plan.repository_ref)
        with Registry(repository.registry) as registry:
            tags = registry.list_tags(repository.repository)
        variants = fanning.changed_variants(the_plan, variants, cached, tags)
    else:
        the_plan = planning.build_plan(matrix, revision=rev, created=created)
        variants = selection.choose(the_plan.variants, where)
        cached = set()
    fanout = fanning.plan_fanout(the_plan, variants, cached, layer_levels=layer_levels, variant_shards=shards)
    if output_format == "github-output":
        click.echo("\n".join(fanning.github_outputs(fanout)))
    else:
        click.echo(json.dumps(fanning.fanout_record(the_plan, fanout), indent=2))


def print_registry_plan(the_plan: planning.Plan, report: reporting.BuildReport) -> None:
    table = Table(title=f"{safe_markup(the_plan.cache_ref)}: layers for {len(report.variants)} variant(s)")
    for column in ("layer", "platform", "key", "status"):
        table.add_column(column)
    for rec in report.layers:
        table.add_row(safe_markup(rec.path), safe_markup(the_plan.layers[rec.key].platform if rec.key in the_plan.layers
                                                         else "?"),
                      safe_markup(rec.key[:12]), safe_markup(rec.status))
    stdout.print(table)
    to_build = sum(r.status == "to-build" for r in report.layers)
    reused = sum(r.status == "reused" for r in report.layers)
    stdout.print(f"{to_build} to build, {reused} reused" + ("" if to_build else ": nothing to build"))


def print_plan(the_plan: planning.Plan, selected: set[str] | None = None) -> None:
    shared = the_plan.shared_keys()
    table = Table(title=f"{safe_markup(the_plan.matrix_file)}: {len(the_plan.variants)} variants -> "
                        f"{safe_markup(the_plan.repository_ref)}")
    table.add_column("variant")
    table.add_column("tags")
    table.add_column("platforms")
    table.add_column("layers (root first; * shared)")
    for v in the_plan.variants:
        if selected is not None and v.id not in selected:
            continue
        chains = "\n".join(safe_markup(" > ".join(
            f"{the_plan.layers[k].kind}{'*' if k in shared else ''}:{k[:8]}" for k in platform.chain
        )) for platform in v.platform_chains)
        platforms = "\n".join(v.platforms) + ("\n(one index)" if v.multi_platform else "")
        if not v.compression.is_gzip:  # gzip, what every engine reads, goes without saying
            platforms += f"\n{v.compression.spec} layers"
        table.add_row(safe_markup(v.id), "\n".join(safe_markup(t) for t in v.tags), platforms, chains)
    stdout.print(table)
    stdout.print(f"{len(the_plan.layers)} distinct layers for {the_plan.chain_length_total()} layer uses; "
                 f"{len(shared)} shared.")
    floating = sorted({layer.root.image for layer in the_plan.layers.values()
                       if layer.root is not None and not layer.root.digest})
    if floating:
        stdout.print(f"keys are provisional until `plan --registry` resolves these unpinned bases: "
                     f"{', '.join(floating)}", markup=False)


@click.command()
@matrix_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the Dockerfiles go (default: dockerfiles/ beside the matrix).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 and list the drift if any file differs.")
@format_option("table", "json")
@reports_input_errors
def render(matrix_path: Path, out: Path | None, check: bool, output_format: str) -> None:
    """Render the layer Dockerfiles from the matrix into dockerfiles/<kind>/<name>/.

    \b
    Examples:
      imagebuild render                         # write dockerfiles/ beside matrix.yaml
      imagebuild render --check                 # CI: non-zero when committed files drifted
      imagebuild render --matrix examples/local/matrix.yaml
    """
    the_plan = planning.build_plan(load_matrix(matrix_path))
    files = the_plan.rendered_files()
    root = dockerfiles_dir(matrix_path, out)
    if check:
        drift = check_tree(root, files)
        if output_format == "json":
            click.echo(json.dumps({"root": str(root), "drift": [{"path": d.path, "reason": d.reason} for d in drift]}))
        elif drift:
            echo(f"{root}: {len(drift)} file(s) differ from the matrix and templates:", err=True)
            for d in drift:  # names of files found on disk: anything at all
                echo(f"  {d}", err=True)
            if any(d.reason == "foreign" for d in drift):
                click.echo("foreign files were not written by imagebuild: move them out; render will not "
                           "replace or remove them", err=True)
            click.echo("run `imagebuild render` and commit the result", err=True)
        else:
            echo(f"{root}: {len(files)} files up to date")
        sys.exit(ExitCode.FAILED if drift else ExitCode.OK)
    changed = write_tree(root, files)
    if output_format == "json":
        click.echo(json.dumps({"root": str(root), "files": len(files), "changed": changed}))
        return
    for line in changed:
        echo(f"  {line}")
    echo(f"{root}: {len(files)} files, {len(changed)} changed")



@click.command()
@matrix_option
@format_option("table", "json")
@reports_input_errors
def validate(matrix_path: Path, output_format: str) -> None:
    """Check the matrix against its schema and the support table; write nothing."""
    the_plan = planning.build_plan(load_matrix(matrix_path))
    if output_format == "json":
        click.echo(json.dumps({"matrix": str(matrix_path), "valid": True, "variants": len(the_plan.variants)}))
    else:
        echo(f"{matrix_path}: valid, {len(the_plan.variants)} variants")


@click.command()
@format_option("table", "json")
def support(output_format: str) -> None:
    """Show the support table: CUDA/cuDNN pairs and Pythons per Paddle, driver minimums."""
    table_data = load_support_table()
    if output_format == "json":
        click.echo(json.dumps({
            "paddle": {v: {"python": list(e.python), "cpu": e.cpu,
                           "gpu": [{"cuda": p.cuda, "cudnn": p.cudnn} for p in e.gpu],
                           "platforms": {d: list(e.platforms_for(d)) for d in ("cpu", "gpu")}}
                       for v, e in table_data.paddle.items()},
            "driver_minimum": table_data.driver_minimum,
        }, indent=2))
        return
    table = Table(title="Paddle support table")
    for column in ("paddle", "CUDA/cuDNN", "Python", "CPU", "platforms (CPU / GPU)"):
        table.add_column(column)
    for version in table_data.paddle_versions():
        e = table_data.paddle[version]
        platforms = f"{', '.join(e.platforms_for('cpu'))} / {', '.join(e.platforms_for('gpu'))}"
        table.add_row(version, ", ".join(str(p) for p in e.gpu), ", ".join(e.python), "yes" if e.cpu else "no",
                      platforms)
    stdout.print(table)
    drivers = Table(title="Minimum NVIDIA driver")
    drivers.add_column("CUDA")
    drivers.add_column("driver >=")
    for cuda in sorted(table_data.driver_minimum, key=version_key):
        drivers.add_row(cuda, table_data.driver_minimum[cuda])
    stdout.print(drivers)
