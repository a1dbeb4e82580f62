"""imagebuild rescan and imagebuild quarantine: what is behind the channel tags, judged again (logic in quarantine.py)."""
from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from imagebuild.checks import scan as scanning
from imagebuild.cli.common import (
    echo,
    exports_figures,
    format_option,
    policy_figures,
    record_figures,
    release_scope,
    reports_input_errors,
    safe_cells,
    stdout,
)
from imagebuild.cli.rollout_command import DEFAULT_STATE_DIR, _load, release_option, state_dir_option
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError

if TYPE_CHECKING:
    from imagebuild.notify.send import Notifier


@click.command("rescan")
@release_option
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("policies/vulnerabilities.yaml"), show_default=True, help="The vulnerability policy.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=scanning.DEFAULT_CACHE,
              show_default=True, help="Trivy's cache; CACHE_DIR/db holds the vulnerability DB.")
@click.option("--offline", is_flag=True, help="Use the DB already in CACHE_DIR/db; download nothing.")
@click.option("--db-repository", metavar="REF", default=None, help="OCI repository of your Trivy DB mirror.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild/rescan"),
              show_default=True, help="Trivy's reports per digest.")
@click.option("--today", type=click.DateTime(formats=["%Y-%m-%d"]), default=None, metavar="YYYY-MM-DD",
              help="Judge as of this day (exceptions and signed VEX statements past their last day stop counting) "
                   "[default: today, UTC].")
@state_dir_option
@format_option("table", "json")
@reports_input_errors
@exports_figures("rescan")
def rescan_command(release_path: Path, policy_path: Path, cache_dir: Path, offline: bool, db_repository: str | None,
                   out: Path, today: dt.datetime | None, state_dir: Path, output_format: str) -> None:
    """Scan every image behind a channel tag again, with today's DB; quarantine those that now fail the gate.

    Each channel tag of each region is resolved to a digest; each digest is scanned once
    (from the first region that has it) and judged with the policy. One that fails is
    quarantined: marked in the release's state repository (`quarantine-sha256-<hex>`), after
    which `imagebuild rollout start` and `resume` refuse it. One line per image on stdout.

    Trivy is given the image's signed OpenVEX statements (`imagebuild vex attest`, verified with
    the release's trust file) that have not expired: a finding one of them says is not_affected
    is not reported.

    Exit 0 when every image passes; 1 when any fails (newly quarantined, or still failing
    while quarantined) or could not be scanned; 2 on bad input; 3 when Trivy is missing or
    a region could not be reached (the others are still judged and quarantined).

    \b
    Examples:
      imagebuild rescan --release release.yaml                      # nightly, fresh DB
      imagebuild rescan --release examples/local/release.yaml --policy examples/local/policy.yaml \\
          --offline --cache-dir .imagebuild/trivy-example --format json
    """
    from imagebuild.checks.gate import parse_policy
    from imagebuild.core.source import load_document
    from imagebuild.metrics.figures import rescan_figures
    from imagebuild.rollout import quarantine, rescan
    from imagebuild.rollout.state import RolloutError

    if offline and db_repository:
        raise InputError("--db-repository", None, "", "--offline uses the DB in --cache-dir and downloads nothing")
    config = _load(release_path)
    release_scope(config)
    policy = parse_policy(load_document(policy_path))
    options = scanning.ScanOptions(workdir=out, dockerfiles=out, cache_dir=cache_dir.resolve(), offline=offline,
                                   db_repository=db_repository)
    unreachable: dict[str, str] = {}
    try:
        results = rescan.rescan(config, policy_path, options, out.resolve(),
                                on_event=lambda line: echo(line, err=True), unreachable=unreachable,
                                today=today.date() if today else None)
    except RolloutError as exc:
        # A region's credentials variable unset (state.region_registry says BAD_INPUT, as `rollout`
        # exits): rescan has always ended such a run with 1, and keeps doing so.
        exc.exit_code = ExitCode.FAILED
        raise
    record_figures([*rescan_figures([r.to_dict() for r in results], unreachable), *policy_figures(policy)])
    notifier = _notifier(config)
    for r in results:
        if r.status in ("quarantined", "still-quarantined"):
            quarantine.audit(state_dir, {"event": "quarantine", "digest": r.digest, "source": "rescan",
                                         "tags": r.tags, "blocking": [b["id"] for b in r.blocking]})
        if r.status == "quarantined":  # newly: a nightly rescan does not repeat what it told before
            _tell_quarantined(notifier, config, state_dir, r.digest, {
                "reason": f"fails the gate ({policy_path})", "source": "rescan", "images": r.tags,
                "blocking": [b["id"] for b in r.blocking], "problems": r.problems or None})
    if output_format == "json":
        click.echo(json.dumps({"release": str(release_path), "policy": str(policy_path),
                               "images": [r.to_dict() for r in results], "unreachable": unreachable,
                               "quarantined": [r.digest for r in results if r.status == "quarantined"]}, indent=2))
    else:
        for r in results:
            what = ", ".join(f"{b['id']} {b['package']} {b['installed']}" for b in r.blocking[:4]) or r.error or ""
            echo(f"{r.status.upper() if r.fails else r.status:18} {r.image}  {', '.join(r.tags)}"
                 + (f"  {what}" if what else ""))
        failing = sum(r.fails for r in results)
        echo(f"{len(results)} image(s) behind the channel tags; {failing} failing"
             + (" (quarantined: `imagebuild rollout start` refuses them)" if failing else ""))
        for region, why in unreachable.items():
            echo(f"{'UNREACHABLE':18} region {region}: {why} (what it serves was not judged)")
    notifier.drain()
    if any(r.fails for r in results):
        sys.exit(ExitCode.FAILED)
    if unreachable:
        sys.exit(ExitCode.ENVIRONMENT)


@click.command("quarantine")
@click.argument("image", required=False, metavar="[IMAGE]")
@release_option
@click.option("--reason", default=None, metavar="TEXT", help="Why IMAGE is quarantined (required to quarantine).")
@click.option("--clear", is_flag=True, help="Lift the quarantine of IMAGE.")
@state_dir_option
@format_option("table", "json")
@reports_input_errors
def quarantine_command(image: str | None, release_path: Path, reason: str | None, clear: bool, state_dir: Path,
                       output_format: str) -> None:
    """Quarantine IMAGE by hand, lift it with --clear, or list what is quarantined (no IMAGE).

    IMAGE is REF@sha256:..., a bare sha256:..., or a tag (resolved to its digest now). The
    mark is kept in the release's state repository, keyed by digest; `rollout start` and
    `resume` refuse a quarantined digest. Marks and clears go to STATE_DIR/audit.jsonl.

    \b
    Examples:
      imagebuild quarantine --release release.yaml                  # list
      imagebuild quarantine 127.0.0.1:5001/imagebuild/paddle@sha256:... --reason "CVE-2026-1234 in libfoo"
      imagebuild quarantine sha256:... --clear
    """
    from imagebuild.rollout import quarantine

    config = _load(release_path)
    if image is None:
        if clear or reason:
            raise InputError("IMAGE", None, "", "--clear and --reason need the IMAGE they apply to")
        store = quarantine.open_state(config)
        try:
            marks = quarantine.list_marks(store)
        finally:
            store.registry.close()
        if output_format == "json":
            click.echo(json.dumps({"release": str(release_path), "quarantined": marks}, indent=2))
        else:
            print_marks(marks)
        return
    if clear and reason:
        raise InputError("--reason", None, "", "is for quarantining; --clear lifts a quarantine")
    if not clear and not (reason or "").strip():
        raise InputError("--reason", None, "", "missing: say why IMAGE is quarantined")
    digest = _digest(image)
    store = quarantine.open_state(config)
    result: dict[str, Any]
    try:
        if clear:
            lifted = quarantine.clear(store, digest)
            if lifted:
                quarantine.audit(state_dir, {"event": "quarantine-cleared", "digest": digest, "image": image})
            result = {"digest": digest, "action": "cleared" if lifted else "not-quarantined"}
        else:
            record = quarantine.mark(store, digest, (reason or "").strip(), images=[image], source="manual")
            quarantine.audit(state_dir, {"event": "quarantine", "digest": digest, "source": "manual",
                                         "reason": record["reason"]})
            result = {"digest": digest, "action": "quarantined", "record": record}
    finally:
        store.registry.close()
    notifier = _notifier(config)
    if result["action"] == "quarantined":
        _tell_quarantined(notifier, config, state_dir, digest, {"reason": result["record"]["reason"],
                                                                 "source": "manual", "images": [image]})
    if output_format == "json":
        click.echo(json.dumps(result, indent=2))
    else:
        echo(f"{result['action']}: {digest}")
    notifier.drain()


def _notifier(config: Any) -> Notifier:
    """release.yaml's `notify:` targets (none: every emit is a no-op)."""
    from imagebuild.notify.send import Notifier

    return Notifier(config.notify)


def _tell_quarantined(notifier: Notifier, config: Any, state_dir: Path, digest: str, facts: dict[str, Any]) -> None:
    """image.quarantined to the targets; a send that fails is a `notify-failed` line of the local audit log."""
    from imagebuild.rollout import quarantine

    def failed(host: str, kind: str, why: str) -> None:
        quarantine.audit(state_dir, {"event": "notify-failed", "kind": kind, "digest": digest, "target": host,
                                     "detail": why})

    notifier.emit("image.quarantined", "imagebuild/quarantine", digest,
                  {"digest": digest, "release": str(config.path), **facts}, failed)


def _digest(image: str) -> str:
    from imagebuild.oci.client import ImageRef, Registry
    from imagebuild.rollout import quarantine

    try:
        return quarantine.parse_digest_of(image)
    except ValueError:
        pass
    try:
        ref = ImageRef.parse(image)
    except ValueError as exc:
        raise InputError("IMAGE", None, image, str(exc)) from None
    if ref.digest or not ref.tag:
        raise InputError("IMAGE", None, image, "give REF@sha256:<64 hex>, sha256:<64 hex>, or a tag")
    with Registry(ref.registry) as registry:
        digest = registry.head_manifest(ref.repository, ref.tag)
    if not digest:
        raise InputError("IMAGE", None, image, "no such tag in its registry")
    return digest


def print_marks(marks: list[dict[str, Any]]) -> None:
    if not marks:
        stdout.print("nothing is quarantined")
        return
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("digest", "since", "source", "reason", "images"):
        table.add_column(column, overflow="fold")
    for m in marks:
        table.add_row(*safe_cells(m.get("digest", ""), m.get("since", ""), m.get("source", ""), m.get("reason", ""),
                                  ", ".join(m.get("images") or [])))
    stdout.print(table)


__all__ = ["rescan_command", "quarantine_command", "DEFAULT_STATE_DIR"]
