"""The `imagebuild` command line: parse, call, print. No pipeline logic lives here.

Exit codes: 0 success; 1 the work failed (drift found, a build or gate failed);
2 bad input (malformed matrix, policy or release file; bad options).
"""
from __future__ import annotations

import datetime as dt
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import click
from rich.console import Console
from rich.table import Table

from . import plan as planning
from . import build as building
from . import gate as gating
from . import scan as scanning
from .matrix import load_matrix
from .progress import progress_for
from .registry import RegistryError
from .render import check_tree, write_tree
from .source import InputError, load_document
from .tools import ToolMissing
from .support import load_support_table, version_key

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3  # a tool or service is missing or unreachable
EXIT_INTERRUPTED = 130

def _console(**kwargs: Any) -> Console:
    """Rich wraps at 80 columns when not on a terminal; CI logs read better unwrapped."""
    console = Console(highlight=False, **kwargs)
    if not console.is_terminal:
        console.width = 200
    return console


stdout = _console()
stderr = _console(stderr=True)


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


PIPELINE_ORDER = ("validate", "support", "plan", "render", "build", "test", "scan", "gate")


class PipelineGroup(click.Group):
    """--help lists the commands in the order the pipeline runs them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: (PIPELINE_ORDER.index(n) if n in PIPELINE_ORDER else 99, n))


@click.group(cls=PipelineGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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


def _revision(revision: str | None) -> tuple[str, str]:
    """The checkout this runs in (like CI's), unless --revision / SOURCE_DATE_EPOCH say otherwise."""
    commit, created = building.git_revision(Path.cwd())
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
    rev, created = _revision(revision)
    if use_registry:
        the_plan = building.prepare(matrix, rev, created)
        report = building.registry_plan(the_plan, planning.variant_selector(the_plan, only),
                                        resolve_digests=output_format != "table")
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
    for column in ("layer", "key", "status"):
        table.add_column(column)
    for rec in report.layers:
        table.add_row(rec.path, rec.key[:12], rec.status)
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
    floating = sorted({layer.root.image for layer in the_plan.layers.values()
                       if layer.root is not None and not layer.root.digest})
    if floating:
        stdout.print(f"keys are provisional until `plan --registry` resolves these unpinned bases: "
                     f"{', '.join(floating)}")


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
@click.option("--push-with", type=click.Choice(["imagebuild", "docker"]), default="imagebuild", show_default=True,
              help="imagebuild: new layers gzipped on every core, the parent's blobs reused; "
                   "docker: `docker push` (one core).")
@revision_option
@format_option("table", "json")
@reports_input_errors
def build(matrix_path: Path, only: tuple[str, ...], jobs: int, dry_run: bool, dockerfiles: Path | None,
          workdir: Path, secret_overrides: tuple[str, ...], push_with: str, revision: str | None,
          output_format: str) -> None:
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
    rev, created = _revision(revision)
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
                                    workdir=workdir, secrets=secrets.paths, secret_values=secrets.values,
                                    push=push_with)
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
    timed = [rec for rec in report.layers if rec.steps]
    if timed:
        click.echo("where the time went (s):")
    for rec in timed:
        steps = "  ".join(f"{name.removesuffix('_s')} {value}" for name, value in (rec.steps or {}).items())
        click.echo(f"  {rec.path:60} {steps}  ({rec.pushed_by or 'not pushed'})")
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


# --- scan and gate: Trivy over the built images, the vulnerability policy ------------------------

workdir_option = click.option(
    "--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
    show_default=True, help="Where the build report is; scan/ and gate/ results go beside it.")


@cli.command()
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
    if offline and db_repository:
        raise InputError("--db-repository", None, "", "--offline uses the DB in --cache-dir and downloads nothing")
    report_path = workdir / "build-report.json"
    report = building.BuildReport.read(report_path)
    variants = scanning.select(report, only)
    if not variants:
        raise InputError(str(report_path), None, "--only", f"selects no variant ({', '.join(only)})")
    options = scanning.ScanOptions(
        workdir=workdir, dockerfiles=dockerfiles or Path(report.matrix).parent / "dockerfiles",
        cache_dir=cache_dir, offline=offline, db_repository=db_repository, timeout=timeout,
        insecure_registries=insecure_registries)
    trivy = scanning.Trivy.find()

    def progress(event: str, variant: building.VariantRecord, record: dict) -> None:
        if event == "start":
            click.echo(f"scanning {variant.id} ({variant.image})", err=True)
        else:
            error = f": {record['error']}" if record.get("error") else ""
            click.echo(f"  {record['status']} in {record.get('duration_s')} s{_layers_note(record.get('layers'))}"
                       f"{error}", err=True)

    run = scanning.ScanRun(report, report_path, options, trivy, on_event=progress)
    try:
        summary = run.run(variants)
    except KeyboardInterrupt:
        trivy.runner.stop_all()
        click.echo("interrupted: running scans stopped", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if output_format == "json":
        click.echo(json.dumps(summary, indent=2))
    else:
        print_scan_summary(summary, workdir)
    if any(row["status"] == "failed" for row in summary["variants"]):
        sys.exit(EXIT_FAILED)


def _layers_note(layers: dict | None) -> str:
    if not layers:
        return ""
    if layers.get("reused") is None:
        return f"; {layers['total']} layers (reuse not reported by Trivy)"
    return f"; layers: {layers['reused']} of {layers['total']} from Trivy's cache"


def print_scan_summary(summary: dict, workdir: Path) -> None:
    for row in summary["variants"]:
        c = row.get("counts") or {}
        vulns = c.get("vulnerabilities", {})
        misconf = c.get("misconfigurations", {})
        found = (f"vulnerabilities C{vulns.get('CRITICAL', 0)} H{vulns.get('HIGH', 0)} M{vulns.get('MEDIUM', 0)} "
                 f"L{vulns.get('LOW', 0)}, secrets {c.get('secrets', 0)}, Dockerfile checks failed "
                 f"{sum(misconf.values())}") if c else (row.get("error") or "")
        click.echo(f"  {row['status']:8} {row['id']}  {found}{_layers_note(row.get('layers'))}")
    layers = summary["layers"]
    click.echo(f"layers: {layers['reused']} of {layers['total']} reused from Trivy's cache, {layers['analysed']} "
               f"analysed ({summary['cache_dir']})")
    db = summary["db"]
    click.echo(f"vulnerability DB: updated {db['updated_at']} ({db['source']}); reports: {workdir / 'scan'}; "
               f"{summary['duration_s']} s")


@cli.command("gate")
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
    policy = gating.parse_policy(load_document(policy_path))  # malformed: one line, exit 2, nothing written
    report_path = workdir / "build-report.json"
    report = building.BuildReport.read(report_path)
    variants = scanning.select(report, only)
    if not variants:
        raise InputError(str(report_path), None, "--only", f"selects no variant ({', '.join(only)})")
    scans = scanning.image_scans(report, report_path, variants)
    result = gating.evaluate(policy, scans, dt.datetime.now(dt.timezone.utc).date(), strict=strict)
    records = {}
    for variant, verdict in zip(variants, result.images):
        variant.stages["gate"] = records[variant.id] = gating.stage_record(verdict, result)
    building.record_stage(report_path, "gate", records)
    locations, root = _sarif_locations(variants)
    sarif = gating.to_sarif(result, tool_version=_version(), locations=locations, dockerfiles_root=root)
    record = gating.to_json(result)
    out = workdir / "gate"
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (out / "result.sarif").write_text(json.dumps(sarif, indent=2) + "\n", encoding="utf-8")
    if output_format == "json":
        click.echo(json.dumps(record, indent=2))
    elif output_format == "sarif":
        click.echo(json.dumps(sarif, indent=2))
    else:
        print_gate(result)
    if not result.passed:
        sys.exit(EXIT_FAILED)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("imagebuild")
    except PackageNotFoundError:
        return "0"


def _sarif_locations(variants: list[building.VariantRecord]) -> tuple[dict[str, str], str]:
    """Each variant's release Dockerfile, relative to here when it can be: code scanning wants repository paths."""
    locations, root = {}, ""
    for v in variants:
        record = v.stages.get("scan") or {}
        if not record.get("dockerfiles"):
            continue
        base = Path(record.get("dockerfiles_root", ""))
        try:
            base = base.resolve().relative_to(Path.cwd())
        except ValueError:
            pass
        root = str(base)
        locations[v.id] = f"{base}/{record['dockerfiles'][-1]}"
    return locations, root


def print_gate(result: gating.GateResult) -> None:
    for image in result.images:
        click.echo(f"{'PASSED ' if image.passed else 'BLOCKED'}  {image.variant}  {image.image}")
        rows = []
        for d in image.blocking + image.excepted:
            f = d.finding
            what = (f"{f.package} {f.installed}" if f.kind == "vulnerability" else f.subject())
            fixed = (f"fixed in {f.fixed}" if f.fixed else "no fix") if f.kind == "vulnerability" else f.kind
            rows.append(["blocks" if d.verdict == gating.BLOCKED else "excepted", f.id, f.severity, what, fixed, d.why])
        widths = [max((len(r[i]) for r in rows), default=0) for i in range(5)]
        for r in rows:
            click.echo("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r[:5])) + f"  {r[5]}")
        for problem in image.problems:
            click.echo(f"  problem  {problem}")
        for warning in image.warnings:
            click.echo(f"  warning  {warning}")
        counts = image.counts()
        click.echo(f"  {counts[gating.BLOCKED]} blocking, {counts[gating.EXCEPTED]} excepted, "
                   f"{counts[gating.IGNORED_UNFIXED]} ignored (no fix yet), "
                   f"{counts[gating.BELOW_THRESHOLD]} below the threshold")
    blocked = sum(not image.passed for image in result.images)
    verdict = "passed" if result.passed else f"failed: {blocked} of {len(result.images)} image(s) blocked"
    click.echo(f"gate {verdict} (policy {result.policy.file}: severity {result.policy.severity}, ignore_unfixed "
               f"{'on' if result.policy.ignore_unfixed else 'off'}{', strict' if result.strict else ''})")



# --- imagebuild test: smoke tests inside the images (imagebuild/smoke.py) -------------------------
# Kept in one block on purpose: the logic lives in smoke.py (pure) and smoke_run.py (containers);
# this only parses and prints.


@cli.command("test")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
              show_default=True, help="Where the build report is (as for build, scan and gate).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Test every built variant of this build report instead, and record the results in it.")
@click.option("--image", "images", multiple=True, metavar="REF",
              help="Test this image instead (expectations from its labels, or --matrix); repeatable.")
@click.option("--matrix", "matrix_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The matrix the images were built from (default: the one the report names).")
@click.option("--only", multiple=True, metavar="SELECTOR",
              help="Variant id, or device=, paddle=, python=, cuda=, cudnn=; repeatable.")
@click.option("--tier", type=click.Choice(["all", "abi", "gpu"]), default="all", show_default=True,
              help="abi runs anywhere; gpu needs a GPU and is skipped, with its reason, without one.")
@click.option("--gpus", type=click.Choice(["auto", "all", "none"]), default="auto", show_default=True,
              help="Request the host's GPUs for GPU variants: auto = when this host has an NVIDIA GPU.")
@click.option("--timeout", "timeout_s", type=click.IntRange(10, 86400), default=900, show_default=True,
              help="Seconds per image; the container is killed after that.")
@click.option("--memory", default="8g", show_default=True, help="Memory limit per container.")
@click.option("--cpus", type=click.FloatRange(0.1, 1024), default=None,
              help="CPU limit per container (default: 4, or this host's count if fewer).")
@click.option("--pids-limit", type=click.IntRange(64, 1 << 22), default=4096, show_default=True,
              help="Process/thread limit per container.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="JUnit XML, logs and expectations per image (default: smoke/ beside the report).")
@click.option("--harness", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="pytest for the containers, prepared elsewhere, for hosts without PyPI: a copy of the "
                   "OUT/.harness/pytest-* folder a run with PyPI leaves (default: pip installs it there once).")
@click.option("--force", is_flag=True, help="Run again where the same image already passed the same suite.")
@format_option("table", "json")
@reports_input_errors
def test_command(workdir: Path, report_path: Path | None, images: tuple[str, ...], matrix_path: Path | None, only: tuple[str, ...],
                 tier: str, gpus: str, timeout_s: int, memory: str, cpus: float | None, pids_limit: int,
                 out: Path | None, harness: Path | None, force: bool, output_format: str) -> None:
    """Run the smoke tests (smoke_tests/) inside each image: the abi tier anywhere, the gpu tier on GPU hosts.

    Each image runs as its own non-root user with the network off, resource limits, a read-only
    root file system and a timeout. JUnit XML per image goes to OUT/<variant>/results/junit.xml;
    with a report, each variant's result goes into it (stages.smoke), and sign/push refuse
    variants whose smoke tests did not pass. Exit 1 when any image fails.

    \b
    Examples:
      imagebuild test                                   # every variant of .imagebuild/build-report.json
      imagebuild test --workdir out --only device=gpu
      imagebuild test --image 127.0.0.1:5000/imagebuild-example/paddle:3.3.1
      imagebuild test --tier abi --format json
    """
    from . import smoke_run

    report_path = report_path or workdir / "build-report.json"
    if images and only:
        raise InputError("--only", None, "", "selects variants of a report; it does not apply to --image")
    if harness is not None and not (harness / "first" / "pytest").is_dir():
        raise InputError("--harness", None, str(harness), "has no first/pytest: not a folder `imagebuild test` prepared")
    if not re.fullmatch(r"\d+[bkmg]?", memory.lower()):
        raise InputError("--memory", None, "", f"'{memory}' is not a size like 8g or 512m")
    out = out or (Path(".imagebuild/smoke") if images else report_path.parent / "smoke")
    options = smoke_run.RunOptions(timeout_s=timeout_s, memory=memory, cpus=cpus or min(4.0, float(os.cpu_count() or 1)),
                               pids_limit=pids_limit, tier=tier, gpus=gpus, force=force)

    def make_runner() -> smoke_run.SmokeRunner:  # called once the input checked out
        runner = smoke_run.SmokeRunner(smoke_run.docker_client(), options, out,
                                   harness or smoke_run.ensure_harness(out / ".harness"))
        click.echo(f"smoke tests: tier {tier}; GPUs: "
                   f"{'requested for GPU variants' if runner.gpu_host else 'none on this host'}", err=True)
        return runner

    def progress(result: Any) -> None:
        click.echo(f"  {result.status:7} {result.name} ({_smoke_counts(result)})", err=True)

    try:
        if images:
            results = smoke_run.run_images(images, matrix_path, make_runner, progress)
        else:
            results = smoke_run.run_report(report_path, matrix_path, only, make_runner, progress)
    except KeyboardInterrupt:
        click.echo("interrupted: the running container was removed", err=True)
        sys.exit(EXIT_INTERRUPTED)
    print_smoke_results(results, None if images else report_path, output_format)
    if any(r.status != "passed" for r in results):
        sys.exit(EXIT_FAILED)


def _smoke_counts(r: Any) -> str:
    s = r.summary
    timing = f", {r.duration_s:.1f} s" if r.duration_s is not None else ""
    return (f"{s.passed} passed, {s.failed + s.errors} failed, {s.skipped} skipped{timing}"
            + (", reused" if r.reused else ""))


def print_smoke_results(results: list[Any], report_path: Path | None, output_format: str) -> None:
    if output_format == "json":
        click.echo(json.dumps({
            "report": str(report_path) if report_path else None,
            "status": "passed" if all(r.status == "passed" for r in results) else "failed",
            "results": [{"name": r.name, "variant": r.variant, "reused": r.reused, **r.stage()} for r in results],
        }, indent=2))
        return
    for r in results:
        click.echo(f"{r.status.upper() if r.status != 'passed' else r.status:8} {r.name}  ({_smoke_counts(r)})")
        for failure in r.summary.failures:
            click.echo(f"    FAILED {failure['test']}: {failure['message']}")
        if r.status != "passed" and r.reason and not r.summary.failures:
            click.echo(f"    {r.reason}")
        reasons: dict[str, int] = {}
        for skip in r.summary.skip_reasons:
            reasons[skip["reason"]] = reasons.get(skip["reason"], 0) + 1
        for reason, count in reasons.items():
            click.echo(f"    skipped ({count}): {reason}")
        if r.junit:
            click.echo(f"    junit: {r.junit}")
    passed = sum(r.status == "passed" for r in results)
    click.echo(f"{passed} of {len(results)} image(s) passed" + (f"; report: {report_path}" if report_path else ""))

# --- end of imagebuild test ------------------------------------------------------------------------


def main() -> None:
    cli(prog_name="imagebuild")


if __name__ == "__main__":
    main()
