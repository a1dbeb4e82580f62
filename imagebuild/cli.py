"""The `imagebuild` command line: parse, call, print. No pipeline logic lives here.

Exit codes: 0 success; 1 the work failed (drift found, a build or gate failed);
2 bad input (malformed matrix, policy or release file; bad options).
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console
from rich.table import Table

from . import plan as planning
from . import build as building
from .matrix import load_matrix
from .progress import progress_for
from .registry import RegistryError
from .render import check_tree, write_tree
from .source import InputError
from .tools import ToolMissing
from .support import load_support_table, version_key

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3  # a tool or service is missing or unreachable
EXIT_INTERRUPTED = 130

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


def reports_input_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input: one line on stderr naming file, line and key; exit code 2; no traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except InputError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except ToolMissing as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_ENVIRONMENT)
        except RegistryError as err:
            click.echo(f"error: registry: {err}", err=True)
            sys.exit(EXIT_ENVIRONMENT)

    return wrapper


matrix_option = click.option(
    "--matrix", "matrix_path", type=click.Path(dir_okay=False, path_type=Path),
    default=Path("matrix.yaml"), show_default=True, help="The version matrix to read.",
)


def format_option(*choices: str) -> Callable[..., Any]:
    return click.option("--format", "output_format", type=click.Choice(choices), default=choices[0],
                        show_default=True, help="Output for people (table) or machines.")


def dockerfiles_dir(matrix_path: Path, out: Path | None) -> Path:
    """Dockerfiles live beside their matrix unless --out says otherwise."""
    return out if out is not None else matrix_path.parent / "dockerfiles"


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="imagebuild")
def cli() -> None:
    """Build, test, scan, sign and roll out PaddlePaddle GPU images from one version matrix.

    \b
    Examples:
      imagebuild plan                                  # what matrix.yaml expands to
      imagebuild plan --format github-matrix           # one CI job per variant
      imagebuild render && git diff dockerfiles/       # regenerate the Dockerfiles
      imagebuild render --check                        # CI: fail when they drifted
      imagebuild support                               # the Paddle/CUDA/Python table
    """


registry_option = click.option(
    "--registry", "use_registry", is_flag=True,
    help="Ask the matrix's registry which layers exist (one HEAD per distinct layer).")
only_option = click.option(
    "--only", multiple=True, metavar="SELECTOR",
    help="Variant id, or axis=value (os=, cuda=, python=, paddle=, device=); repeatable.")
revision_option = click.option(
    "--revision", default=None, help="Source revision for the release labels (default: git HEAD).")


def _revision(revision: str | None, matrix_path: Path) -> tuple[str, str]:
    commit, created = building.git_revision(matrix_path.resolve().parent)
    return (revision or commit), created


@cli.command()
@matrix_option
@format_option("table", "json", "github-matrix")
@registry_option
@only_option
@revision_option
@reports_input_errors
def plan(matrix_path: Path, output_format: str, use_registry: bool, only: tuple[str, ...],
         revision: str | None) -> None:
    """Show the variants, their tags and layer chains; shared layers are marked.

    With --registry, also what a build would do: "N to build, M reused" per layer.

    \b
    Examples:
      imagebuild plan --matrix examples/local/matrix.yaml
      imagebuild plan --matrix examples/local/matrix.yaml --registry
      imagebuild plan --format json | jq '.variants[].tags'
      imagebuild plan --format github-matrix   # strategy.matrix for GitHub Actions
    """
    matrix = load_matrix(matrix_path)
    rev, created = _revision(revision, matrix_path)
    if use_registry:
        the_plan = building.prepare(matrix, rev, created)
        report = building.registry_plan(the_plan, planning.variant_selector(the_plan, only))
        if output_format == "table":
            print_registry_plan(the_plan, report)
        else:
            record = plan_record(the_plan)
            status = {rec.key: rec for rec in report.layers}
            for layer in record["layers"]:
                rec = status.get(layer["key"])
                layer["status"] = rec.status if rec else "not-selected"
                layer["digest"] = rec.digest if rec else None
            record["summary"] |= {"to_build": sum(r.status == "to-build" for r in report.layers),
                                  "reused": sum(r.status == "reused" for r in report.layers)}
            click.echo(json.dumps(record, indent=2))
        return
    the_plan = planning.build_plan(matrix, revision=rev, created=created)
    selected = set(v.id for v in planning.variant_selector(the_plan, only))
    if output_format == "json":
        click.echo(json.dumps(plan_record(the_plan, selected), indent=2))
    elif output_format == "github-matrix":
        click.echo(json.dumps(github_matrix(the_plan, selected), separators=(",", ":")))
    else:
        print_plan(the_plan, selected)


def print_registry_plan(the_plan: planning.Plan, report: building.BuildReport) -> None:
    table = Table(title=f"{the_plan.cache_ref}: layers for {len(report.variants)} variant(s)")
    for column in ("layer", "key", "status", "digest"):
        table.add_column(column)
    for rec in report.layers:
        table.add_row(rec.path, rec.key[:12], rec.status, (rec.digest or "")[:19])
    stdout.print(table)
    to_build = sum(r.status == "to-build" for r in report.layers)
    reused = sum(r.status == "reused" for r in report.layers)
    stdout.print(f"{to_build} to build, {reused} reused" + ("" if to_build else ": nothing to build"))


def plan_record(the_plan: planning.Plan, selected: set[str] | None = None) -> dict[str, Any]:
    shared = the_plan.shared_keys()
    return {
        "schema": "imagebuild.plan/v1",
        "matrix": the_plan.matrix_file,
        "repository": the_plan.repository_ref,
        "cache_repository": the_plan.cache_ref,
        "variants": [
            {
                "id": v.id, "os": v.os, "device": v.device, "cuda": v.cuda, "cudnn": v.cudnn,
                "python": v.python, "paddle": v.paddle, "tags": list(v.tags),
                "images": [f"{the_plan.repository_ref}:{t}" for t in v.tags],
                "layers": [the_plan.layers[k].path for k in v.chain],
            }
            for v in the_plan.variants if selected is None or v.id in selected
        ],
        "layers": [
            {
                "key": layer.key, "kind": layer.kind, "path": layer.path, "parent": layer.parent,
                "cache_tag": layer.cache_tag, "shared": layer.key in shared,
                "used_by": the_plan.users(layer.key),
                "from": layer.root.reference if layer.root else None,
                "from_pinned": layer.root.pinned if layer.root else None,
            }
            for layer in the_plan.layers.values()
        ],
        "summary": {
            "variants": len(the_plan.variants),
            "distinct_layers": len(the_plan.layers),
            "chain_layers_total": the_plan.chain_length_total(),
            "shared_layers": len(shared),
        },
    }


def github_matrix(the_plan: planning.Plan, selected: set[str] | None = None) -> dict[str, Any]:
    return {"include": [
        {"variant": v.id, "device": v.device, "paddle": v.paddle, "python": v.python,
         "cuda": v.cuda or "cpu", "tags": ",".join(v.tags)}
        for v in the_plan.variants if selected is None or v.id in selected
    ]}


def print_plan(the_plan: planning.Plan, selected: set[str] | None = None) -> None:
    shared = the_plan.shared_keys()
    table = Table(title=f"{the_plan.matrix_file}: {len(the_plan.variants)} variants -> {the_plan.repository_ref}")
    table.add_column("variant")
    table.add_column("tags")
    table.add_column("layers (root first; * shared)")
    for v in the_plan.variants:
        if selected is not None and v.id not in selected:
            continue
        chain = " > ".join(
            f"{the_plan.layers[k].kind}{'*' if k in shared else ''}:{k[:8]}" for k in v.chain
        )
        table.add_row(v.id, "\n".join(v.tags), chain)
    stdout.print(table)
    stdout.print(f"{len(the_plan.layers)} distinct layers for {the_plan.chain_length_total()} layer uses; "
                 f"{len(shared)} shared.")


@cli.command()
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
            click.echo(f"{root}: {len(drift)} file(s) differ from the matrix and templates:", err=True)
            for d in drift:
                click.echo(f"  {d}", err=True)
            click.echo("run `imagebuild render` and commit the result", err=True)
        else:
            click.echo(f"{root}: {len(files)} files up to date")
        sys.exit(EXIT_FAILED if drift else 0)
    changed = write_tree(root, files)
    if output_format == "json":
        click.echo(json.dumps({"root": str(root), "files": len(files), "changed": changed}))
        return
    for line in changed:
        click.echo(f"  {line}")
    click.echo(f"{root}: {len(files)} files, {len(changed)} changed")


@cli.command()
@matrix_option
@only_option
@click.option("--jobs", "-j", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Independent layers built at once.")
@click.option("--dry-run", is_flag=True, help="Plan against the registry and write the report; build nothing.")
@click.option("--dockerfiles", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Rendered Dockerfiles (default: dockerfiles/ beside the matrix).")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
              show_default=True, help="Where the build report and logs go.")
@click.option("--secret", "secret_overrides", multiple=True, metavar="ID=PATH",
              help="Take a declared build secret from this file instead (e.g. from CI's secret store).")
@revision_option
@format_option("table", "json")
@reports_input_errors
def build(matrix_path: Path, only: tuple[str, ...], jobs: int, dry_run: bool, dockerfiles: Path | None,
          workdir: Path, secret_overrides: tuple[str, ...], revision: str | None, output_format: str) -> None:
    """Build the matrix's layers with BuildKit, parents first, reusing every key the registry has.

    Layer images go to the cache repository under their content keys; each variant gets its
    tags once its whole chain is built. Writes WORKDIR/build-report.json even when builds fail.

    \b
    Examples:
      imagebuild build --matrix examples/local/matrix.yaml
      imagebuild build --only device=cpu --jobs 4
      imagebuild build --dry-run --format json     # what would be built
    """
    matrix = load_matrix(matrix_path)
    rev, created = _revision(revision, matrix_path)
    the_plan = building.prepare(matrix, rev, created)
    variants = planning.variant_selector(the_plan, only)
    if not variants:
        raise InputError(str(matrix_path), None, "--only", f"selects no variant ({', '.join(only)})")
    report = building.registry_plan(the_plan, variants)
    report.revision = rev
    overrides = {}
    for item in secret_overrides:
        sid, sep, path = item.partition("=")
        if not sep or not sid or not path:
            raise InputError("--secret", None, item, "expected ID=PATH")
        overrides[sid] = path
    secrets = building.secret_files(matrix, overrides)
    options = building.BuildOptions(jobs=jobs, dry_run=dry_run,
                                    dockerfiles=dockerfiles_dir(matrix_path, dockerfiles),
                                    workdir=workdir, secrets=secrets.paths, secret_values=secrets.values)
    view = progress_for(stderr)
    for rec in report.layers:
        if rec.status == "to-build":
            view.add(rec)
    try:
        with view:
            report = building.Builder(the_plan, report, options, view).run()
    except KeyboardInterrupt:
        click.echo("interrupted: running builds stopped, no variant was tagged", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        secrets.close()
    print_build_summary(report, workdir / "build-report.json", output_format)
    if report.status == "failed":
        sys.exit(EXIT_FAILED)


def print_build_summary(report: building.BuildReport, path: Path, output_format: str) -> None:
    summary = report.summary()
    if output_format == "json":
        click.echo(json.dumps({"report": str(path), "status": report.status, "layers": summary,
                               "variants": [{"id": v.id, "status": v.status, "image": v.image,
                                             "tags": v.images} for v in report.variants]}, indent=2))
        return
    built, reused = summary.get("built", 0), summary.get("reused", 0)
    if report.status == "planned":
        click.echo(f"{summary.get('to-build', 0)} to build, {reused} reused (dry run; report: {path})")
    elif built == 0 and report.status == "ok":
        click.echo(f"nothing to build: all {reused} layers reused")
    else:
        click.echo(f"{built} built, {reused} reused, {summary.get('failed', 0)} failed, "
                   f"{summary.get('skipped', 0)} skipped")
    for v in report.variants:
        click.echo(f"  {v.status:8} {v.id}  {v.image or ''}")
    for rec in report.layers:
        if rec.status == "failed":
            click.echo(f"\nFAILED {rec.path} (log: {rec.log}):\n{rec.error}", err=True)
    click.echo(f"report: {path}")


@cli.command()
@matrix_option
@format_option("table", "json")
@reports_input_errors
def validate(matrix_path: Path, output_format: str) -> None:
    """Check the matrix against its schema and the support table; write nothing."""
    the_plan = planning.build_plan(load_matrix(matrix_path))
    if output_format == "json":
        click.echo(json.dumps({"matrix": str(matrix_path), "valid": True, "variants": len(the_plan.variants)}))
    else:
        click.echo(f"{matrix_path}: valid, {len(the_plan.variants)} variants")


@cli.command()
@format_option("table", "json")
def support(output_format: str) -> None:
    """Show the support table: CUDA/cuDNN pairs and Pythons per Paddle, driver minimums."""
    table_data = load_support_table()
    if output_format == "json":
        click.echo(json.dumps({
            "paddle": {v: {"python": list(e.python), "cpu": e.cpu,
                           "gpu": [{"cuda": p.cuda, "cudnn": p.cudnn} for p in e.gpu]}
                       for v, e in table_data.paddle.items()},
            "driver_minimum": table_data.driver_minimum,
        }, indent=2))
        return
    table = Table(title="Paddle support table")
    for column in ("paddle", "CUDA/cuDNN", "Python", "CPU"):
        table.add_column(column)
    for version in table_data.paddle_versions():
        e = table_data.paddle[version]
        table.add_row(version, ", ".join(str(p) for p in e.gpu), ", ".join(e.python), "yes" if e.cpu else "no")
    stdout.print(table)
    drivers = Table(title="Minimum NVIDIA driver")
    drivers.add_column("CUDA")
    drivers.add_column("driver >=")
    for cuda in sorted(table_data.driver_minimum, key=version_key):
        drivers.add_row(cuda, table_data.driver_minimum[cuda])
    stdout.print(drivers)


def main() -> None:
    cli(prog_name="imagebuild")


if __name__ == "__main__":
    main()
