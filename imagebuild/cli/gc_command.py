"""imagebuild gc: retention for the regions and the state repository (logic in retention/)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from imagebuild.cli.common import (
    echo,
    exports_figures,
    format_option,
    matrix_option,
    record_figures,
    release_scope,
    reports_input_errors,
    revision_option,
    safe_cells,
    stdout,
)
from imagebuild.cli.harbor_command import ca_option, password_file_option, retries_option, username_option
from imagebuild.cli.rollout_command import _load, release_option, state_dir_option
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError


def _duration(value: str) -> float:
    from imagebuild.config.release_file import parse_duration

    seconds = int(value[:-1]) * 86400.0 if value.endswith("d") and value[:-1].isdigit() else parse_duration(value)
    if seconds is None or seconds < 0:
        raise InputError("--record-retention", None, value, "give a duration: 90d, 12h, 30m, 0s")
    return float(seconds)


@click.group("gc", invoke_without_command=True)
@release_option
@click.option("--keep-releases", type=click.IntRange(min=1), default=3, show_default=True,
              help="Completed rollouts per channel whose images stay in the regions.")
@click.option("--record-retention", default="90d", show_default=True, metavar="DURATION",
              help="Finished rollout records younger than this stay in the state repository.")
@click.option("--dry-run/--apply", "dry_run", default=True, show_default=True,
              help="Say what would go (the default), or delete it.")
@click.option("--settle-s", type=click.FloatRange(min=0), default=2.0, show_default=True, hidden=True)
@state_dir_option
@format_option("table", "json")
@click.pass_context
@reports_input_errors
@exports_figures("gc")
def gc_group(ctx: click.Context, release_path: Path, keep_releases: int, record_retention: str, dry_run: bool,
             settle_s: float, state_dir: Path, output_format: str) -> None:
    """Delete what no channel, rollback, quarantine or kept release needs, from every region and the state repository.

    Kept in each region: every tag that is not cosign's (channel and release tags, and any a
    person made), the digest and rollback targets of each channel's latest rollout and of every
    running one, the last --keep-releases completed rollouts of each channel, every quarantined
    digest, and everything that hangs off those (index children, signatures, attestations, SBOMs,
    referrers). The rest is deleted by digest, each manifest before what hangs off it. The state
    repository drops finished records older than --record-retention (archived to
    STATE_DIR/gc-archive first) that none of the above needs, their approval and abort markers,
    and expired leases of channels release.yaml no longer names.

    With --apply, gc holds every channel's rollout lease while it deletes: a running rollout makes it
    refuse (exit 4). It never deletes blobs itself: `imagebuild gc sweep` runs the registry's own
    garbage collection afterwards, and frees the bytes the dry run promised.

    Exit 0 when done; 1 when a deletion failed or the state cannot be read (nothing further is
    deleted; a rerun finishes); 2 on bad input; 3 when a registry cannot be reached; 4 when a
    rollout holds a channel.

    \b
    Examples:
      imagebuild gc --release release.yaml                              # what would go, and the bytes
      imagebuild gc --release release.yaml --keep-releases 5 --apply --format json
      imagebuild gc --release release.yaml sweep --config /etc/docker/registry/config.yml
      imagebuild gc cache --matrix matrix.yaml --report work/build-report.json   # the layer cache, staging
      imagebuild gc sweep --harbor https://harbor.example.com --dry-run
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"release_path": release_path, "output_format": output_format, "state_dir": state_dir}
        return
    from imagebuild.metrics.figures import gc_figures
    from imagebuild.retention import gc
    from imagebuild.retention.state import Retention
    from imagebuild.rollout.reconciler import Timing

    config = _load(release_path)
    release_scope(config)
    options = gc.GcOptions(retention=Retention(keep_releases, _duration(record_retention)), apply=not dry_run,
                           state_dir=state_dir, timing=Timing(settle_s=settle_s))
    plan, run = gc.collect_garbage(config, options, on_event=lambda line: echo(line, err=True))
    report = {"release": str(release_path), "mode": "dry-run" if dry_run else "apply", **plan.to_dict(),
              "deleted": run.deleted, "archived": run.archived}
    record_figures(gc_figures(report))
    if output_format == "json":
        click.echo(json.dumps(report, indent=2))
    else:
        _print(report)


def _print(report: dict[str, Any]) -> None:
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("region", "repository", "tags", "manifests", "live", "dead"):
        table.add_column(column, overflow="fold")
    for region in report["regions"]:
        table.add_row(*safe_cells(region["region"], f"{region['registry']}/{region['repository']}", region["tags"],
                                  region["manifests"], region["live"], len(region["dead"])))
    stdout.print(table)
    for registry in report["registries"]:
        echo(f"{registry['registry']}: {registry['manifests']} manifest(s); `gc sweep` then frees at most "
             f"{registry['blobs']} blob(s), {registry['bytes'] / 1e6:.1f} MB")
    state = report["state"]
    echo(f"state {state['registry']}/{state['repository']}: {state['records']} record(s), "
         f"{len(state['compacted_records'])} to compact, {len(state['compacted_markers'])} marker(s) and "
         f"{len(state['compacted_leases'])} lease(s) to drop")
    if report["mode"] == "dry-run":
        echo("dry run: nothing was deleted (--apply deletes)")
    else:
        echo(f"deleted {len(report['deleted'])} manifest(s); archived {len(report['archived'])} record(s)")


# sweep's options that only --harbor reads: parameter -> option
_HARBOR_ONLY = {"harbor_dry_run": "--dry-run", "delete_untagged": "--delete-untagged", "timeout_s": "--timeout-s",
                "ca_bundle": "--ca-bundle", "password_file": "--password-file", "retries": "--retries"}


@gc_group.command("sweep")
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="The registry's Distribution config.yml (filesystem storage).")
@click.option("--registry-binary", default="docker-registry", show_default=True,
              help="Distribution's `registry` (Debian names it docker-registry).")
@click.option("--harbor", "harbor_url", default=None, metavar="URL",
              help="Instead of --config: run Harbor's own GC through its API, e.g. https://harbor.example.com.")
@click.option("--dry-run", "harbor_dry_run", is_flag=True,
              help="(--harbor) Harbor's dry run: it reports what it would free and deletes nothing.")
@click.option("--delete-untagged", is_flag=True, help="(--harbor) Harbor also deletes untagged artifacts.")
@click.option("--timeout-s", type=click.FloatRange(min=1), default=3600.0, show_default=True,
              help="(--harbor) How long to wait for Harbor's GC run to end.")
@click.option("--poll-s", type=click.FloatRange(min=0), default=5.0, show_default=True, hidden=True)
@ca_option
@username_option
@password_file_option
@retries_option
@click.option("--format", "sweep_format", type=click.Choice(("table", "json")), default=None,
              help="Output for people (table) or machines [default: gc's --format].")
@click.pass_obj
@click.pass_context
@reports_input_errors
def sweep_command(ctx: click.Context, obj: dict[str, Any], config_path: Path | None, registry_binary: str,
                  harbor_url: str | None, harbor_dry_run: bool, delete_untagged: bool, timeout_s: float,
                  poll_s: float, ca_bundle: Path | None, username: str | None, password_file: Path | None,
                  retries: int, sweep_format: str | None) -> None:
    """Run the registry's own garbage collection after `gc --apply`: Distribution's, or Harbor's.

    With --config: Distribution's `garbage-collect`, for stopped or read-only registries only.
    Refuses a registry that accepts uploads (probed at its http.addr): a blob pushed during the
    sweep could be deleted under the manifest that names it. Reports the blobs and bytes of its
    storage before and after.

    With --harbor: Harbor's GC through its API (a Harbor system administrator; HARBOR_USERNAME,
    and HARBOR_PASSWORD or --password-file, as for `imagebuild harbor`). Harbor keeps serving
    while it collects. A GC already running in Harbor is waited on and reported instead of a new
    one. Reports the run's ID, its status and the tail of its log. Exit 1 when the run ends in
    Error or Stopped, or is still running after --timeout-s; 3 when Harbor cannot be reached or
    refuses the credentials.

    \b
    Examples:
      imagebuild gc sweep --config /var/lib/imagebuild/registries/eu-west/config.yml
      export HARBOR_USERNAME=admin HARBOR_PASSWORD=...
      imagebuild gc sweep --harbor https://harbor.example.com --dry-run
      imagebuild gc sweep --harbor https://harbor.example.com --delete-untagged --format json
    """
    from imagebuild.core.runner import Runner
    from imagebuild.retention import gc

    output_format = sweep_format or obj.get("output_format")
    given = {name for name in ctx.params if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    harbor_only = [option for name, option in _HARBOR_ONLY.items() if name in given]
    if (config_path is None) == (harbor_url is None):
        raise InputError("--config", None, "", "give exactly one of --config CONFIG (Distribution) or --harbor URL")
    if harbor_url is not None:
        if "registry_binary" in given:
            raise InputError("--registry-binary", None, "", "is for --config (Distribution), not --harbor")
        _harbor_sweep(harbor_url, harbor_dry_run, delete_untagged, timeout_s, poll_s, ca_bundle, username,
                      password_file, retries, output_format)
        return
    assert config_path is not None
    if harbor_only:
        raise InputError(harbor_only[0], None, "", "is for --harbor, not --config")
    if not config_path.is_file():
        raise InputError("--config", None, str(config_path), "no such file")
    try:
        result = gc.sweep(config_path, registry_binary, Runner())
    except FileNotFoundError:
        echo(f"{registry_binary}: not found (Debian: apt install docker-registry)", err=True)
        sys.exit(ExitCode.ENVIRONMENT)
    if output_format == "json":
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        echo(f"{result.registry}: {result.before[0]} blob(s), {result.before[1] / 1e6:.1f} MB before; "
             f"{result.after[0]}, {result.after[1] / 1e6:.1f} MB after; freed {result.freed_bytes / 1e6:.1f} MB")


def _harbor_sweep(url: str, dry_run: bool, delete_untagged: bool, timeout_s: float, poll_s: float,
                  ca_bundle: Path | None, username: str | None, password_file: Path | None, retries: int,
                  output_format: str | None) -> None:
    from imagebuild.cli.harbor_command import _ca, _checked_url, _harbor_failures, credentials_from
    from imagebuild.release import harbor, harbor_gc
    from imagebuild.rollout.reconciler import Timing

    try:
        base_url = _checked_url(url)
    except InputError as err:
        raise InputError("--harbor", None, "", err.message) from None
    credentials = credentials_from(username, password_file)
    timing = Timing()
    wait = harbor_gc.GcWait(sleep=timing.sleep, clock=timing.clock, poll_s=poll_s, timeout_s=timeout_s)
    with _harbor_failures(), harbor.HarborClient(base_url, credentials, ca_bundle=_ca(ca_bundle),
                                                 retries=retries) as client:
        result = harbor_gc.run_gc(client, wait, delete_untagged=delete_untagged, dry_run=dry_run,
                                  hide=(credentials.password,), on_event=lambda line: echo(line, err=True))
    if output_format == "json":
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        run = result.run
        mode = " (dry run)" if run.dry_run else ""
        how = "started" if result.started else "was already running; waited on it"
        echo(f"Harbor {result.harbor_version} at {result.url}: GC run {run.id}{mode} {how}: {run.status}")
        for line in result.log:
            echo(f"  {line}")
    if not result.ok:
        sys.exit(ExitCode.FAILED)


@gc_group.command("cache")
@matrix_option
@click.option("--report", "report_paths", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              metavar="WORKDIR/build-report.json",
              help="A build report whose variants and layers stay too (repeatable): a build still in use.")
@revision_option
@click.option("--dry-run/--apply", "dry_run", default=True, show_default=True,
              help="Say what would go (the default), or delete it.")
@click.option("--format", "cache_format", type=click.Choice(("table", "json")), default=None,
              help="Output for people (table) or machines [default: gc's --format].")
@click.pass_obj
@reports_input_errors
def cache_command(obj: dict[str, Any], matrix_path: Path, report_paths: tuple[Path, ...], revision: str | None,
                  dry_run: bool, cache_format: str | None) -> None:
    """Delete the layer images and staging images no current variant and no given build report needs.

    The matrix's layer-cache repository (cache_repository) keeps every layer whose content key
    the current plan computes (`imagebuild plan` lists them; base images named by tag are
    resolved, as a build does, and --revision gives the release layers' keys as for `build`),
    every layer and chain a --report names, and every tag that is not a content key
    (`<kind>-<32 hex>`) nor cosign's: a person's. Its other content-key tags go. The staging
    release repository (repository) keeps every tag but cosign's, and the digests a --report's
    variants name; what no tag or report names goes. Both keep what hangs off what stays
    (index children, signatures, attestations, SBOMs, referrers); the rest is deleted by
    digest, each manifest before what hangs off it. Run it while no build of an older revision
    pushes: a layer it pushes meanwhile to a dead digest goes with it. Blobs stay until
    `imagebuild gc sweep --config` runs the registry's own garbage collection.

    Exit 0 when done; 1 when a deletion failed (a rerun finishes); 2 on bad input; 3 when the
    registry cannot be reached.

    \b
    Examples:
      imagebuild gc cache --matrix matrix.yaml                           # what would go, and the bytes
      imagebuild gc cache --matrix matrix.yaml --report work/build-report.json --apply --format json
    """
    from imagebuild.build import scheduler as building
    from imagebuild.cli.common import _revision
    from imagebuild.config.matrix import load_matrix
    from imagebuild.core.report import BuildReport
    from imagebuild.oci.client import ImageRef
    from imagebuild.retention import gc
    from imagebuild.retention.cache import cache_live

    output_format = cache_format or obj.get("output_format")
    rev, created = _revision(revision)
    the_plan = building.prepare(load_matrix(matrix_path), rev, created)
    plan_tags = {layer.cache_tag: f"layer {layer.path} ({layer.platform}) of the current plan"
                 for layer in the_plan.layers.values()}
    live = cache_live(plan_tags, [(str(path), BuildReport.read(path)) for path in report_paths])
    cache, release = ImageRef.parse(the_plan.cache_ref), ImageRef.parse(the_plan.repository_ref)
    options = gc.GcOptions(apply=not dry_run, state_dir=obj.get("state_dir") or Path(".imagebuild/rollouts"))
    plan, run = gc.collect_cache_garbage(cache.registry, {"cache": cache.repository, "release": release.repository},
                                         live, options, on_event=lambda line: echo(line, err=True))
    report = {"matrix": str(matrix_path), "revision": rev, "reports": [str(p) for p in report_paths],
              "mode": "dry-run" if dry_run else "apply", **plan.to_dict(), "deleted": run.deleted}
    if output_format == "json":
        click.echo(json.dumps(report, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("role", "repository", "tags", "manifests", "live", "dead"):
        table.add_column(column, overflow="fold")
    for repository in report["repositories"]:
        table.add_row(*safe_cells(repository["role"], f"{repository['registry']}/{repository['repository']}",
                                  repository["tags"], repository["manifests"], repository["live"],
                                  len(repository["dead"])))
    stdout.print(table)
    for registry in report["registries"]:
        echo(f"{registry['registry']}: {registry['manifests']} manifest(s); `gc sweep` then frees at most "
             f"{registry['blobs']} blob(s), {registry['bytes'] / 1e6:.1f} MB")
    echo("dry run: nothing was deleted (--apply deletes)" if dry_run else f"deleted {len(run.deleted)} manifest(s)")


__all__ = ["gc_group"]
