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
    record_figures,
    release_scope,
    reports_input_errors,
    safe_cells,
    stdout,
)
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
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"release_path": release_path, "output_format": output_format}
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


@gc_group.command("sweep")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The registry's Distribution config.yml (filesystem storage).")
@click.option("--registry-binary", default="docker-registry", show_default=True,
              help="Distribution's `registry` (Debian names it docker-registry).")
@click.pass_obj
@reports_input_errors
def sweep_command(obj: dict[str, Any], config_path: Path, registry_binary: str) -> None:
    """Run the registry's own garbage collection after `gc --apply`: stopped or read-only registries only.

    Refuses a registry that accepts uploads (probed at its http.addr): a blob pushed during the
    sweep could be deleted under the manifest that names it. Reports the blobs and bytes of its
    storage before and after.

    \b
    Examples:
      imagebuild gc sweep --config /var/lib/imagebuild/registries/eu-west/config.yml
    """
    from imagebuild.core.runner import Runner
    from imagebuild.retention import gc

    if not config_path.is_file():
        raise InputError("--config", None, str(config_path), "no such file")
    try:
        result = gc.sweep(config_path, registry_binary, Runner())
    except FileNotFoundError:
        echo(f"{registry_binary}: not found (Debian: apt install docker-registry)", err=True)
        sys.exit(ExitCode.ENVIRONMENT)
    if obj.get("output_format") == "json":
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        echo(f"{result.registry}: {result.before[0]} blob(s), {result.before[1] / 1e6:.1f} MB before; "
             f"{result.after[0]}, {result.after[1] / 1e6:.1f} MB after; freed {result.freed_bytes / 1e6:.1f} MB")


__all__ = ["gc_group"]
