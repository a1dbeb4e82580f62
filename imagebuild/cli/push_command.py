"""imagebuild push / promote: signed images copied by digest, audited in the target, then tagged (logic in push.py)."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from imagebuild.cli.common import (
    DEFAULT_TRUST_CONFIG,
    echo,
    format_option,
    only_option,
    report_at,
    reports_input_errors,
    safe_cells,
    trust_config_option,
    trust_file_option,
    workdir_option,
)
from imagebuild.config.selection import Selection
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.oci.client import RegistryError
from imagebuild.release import push_plan as plan
from imagebuild.release.push import AUDIT_LOG, PromoteOutcome, Promoter, PushError, PushOutcome, PushRun, environmental

if TYPE_CHECKING:
    from imagebuild.config.trust import TrustConfig

audit_workdir_option = click.option(
    "--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"), show_default=True,
    help=f"Where promote appends to its audit log ({AUDIT_LOG}); nothing else is read or written there.")
trust_option = trust_file_option(
    f"Trust config whose keys (and required attestations) the source and the target must satisfy "
    f"[default: {DEFAULT_TRUST_CONFIG}].")
key_option = click.option(
    "--key", "keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path), metavar="PUB",
    help="Verify with this cosign public key instead of a trust config; repeat during a key rotation.")
force_option = click.option("--force", is_flag=True,
                            help="Move a release tag that names another digest (needs --reason; audit-logged).")
reason_option = click.option("--reason", default=None, metavar="TEXT",
                             help="Why a release tag is moved; goes into WORKDIR/audit.jsonl with who and when.")
insecure_option = click.option(
    "--insecure-registry", "insecure_registries", multiple=True, metavar="HOST:PORT",
    help="Reach this registry over plain http (loopback registries always are).")


def trust_config(trust_path: Path | None, keys: tuple[Path, ...]) -> TrustConfig:
    return trust_config_option(trust_path, keys)


def checked_repository(option: str, text: str) -> str:
    try:
        plan.split_repository(text)
    except ValueError as err:
        raise InputError(option, None, "", str(err)) from None
    return text.rstrip("/")


def progress(message: str) -> None:
    echo(message, err=True)


@click.command("push")
@workdir_option
@click.option("--to", "to", required=True, metavar="REGISTRY/PROJECT",
              help="Where releases go; each image lands in REGISTRY/PROJECT/<image name> "
                   "(the last segment of its staging repository).")
@only_option
@trust_option
@key_option
@force_option
@reason_option
@click.option("--harbor-url", default=None, metavar="URL",
              help="Harbor's address: first ensure the project (PROJECT of --to) and its immutable release-tag "
                   "rule, and report Harbor's scan overview of each pushed image. Credentials: HARBOR_USERNAME "
                   "and HARBOR_PASSWORD (or --harbor-password-file).")
@click.option("--harbor-password-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Read Harbor's password from this file instead of HARBOR_PASSWORD.")
@click.option("--harbor-ca-bundle", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PEM CA bundle for Harbor's API certificate.")
@insecure_option
@format_option("table", "json")
@reports_input_errors
def push_command(workdir: Path, to: str, only: tuple[str, ...], trust_path: Path | None, keys: tuple[Path, ...],
                 force: bool, reason: str | None, harbor_url: str | None, harbor_password_file: Path | None,
                 harbor_ca_bundle: Path | None, insecure_registries: tuple[str, ...], output_format: str) -> None:
    """Copy each signed image of the build report to its release repository, audit it there, then tag it.

    \b
    For each selected variant:
      1. refuse it unless `imagebuild sign` passed for its very digest (and smoke and gate did);
      2. verify its signature in the source with the trust config's keys (the report may lie);
      3. refuse when a release tag already names another digest (tags are immutable), unless
         --force --reason TEXT: then the move is appended to WORKDIR/audit.jsonl;
      4. copy it by digest with its cosign signature and attestations (only missing blobs move);
      5. audit in the target: same digest, signature and attestations verify with the keys;
      6. only then write its release tags; record stages.push in the build report.
    A rerun copies and writes nothing; a run stopped midway leaves no tag on an unaudited
    image, and the next run finishes. Registry credentials come from the Docker config
    (DOCKER_CONFIG, credential helpers), never from the command line.

    Exit 0 when every image is pushed (or already was); 1 when any was refused or failed;
    2 on bad input; 3 when a registry or Harbor cannot be reached or refuses the credentials.

    \b
    Examples:
      imagebuild push --to harbor.example.com/paddle --trust policies/trust.yaml
      imagebuild push --to 127.0.0.1:5000/release --key cosign.pub --only device=cpu
      HARBOR_USERNAME=admin HARBOR_PASSWORD=... imagebuild push --to harbor.example.com/paddle \\
          --harbor-url https://harbor.example.com --key cosign.pub --format json
      imagebuild push --to harbor.example.com/paddle --key cosign.pub --force --reason "CVE-2026-1234 rebuild"
    """
    from imagebuild.trust import sign as signing

    to = checked_repository("--to", to)
    selection = Selection.parse(only)
    force_move = plan.Force.parse(force, reason)
    config = trust_config(trust_path, keys)
    harbor_setup = _harbor(harbor_url, to, harbor_password_file, harbor_ca_bundle) if harbor_url else None
    report_path, report = signing.select_report(workdir)
    variants = selection.choose(report.variants, str(report_path))
    report_at(report_path)

    scan_reader = None
    harbor_report = None
    with Promoter(config, force_move, workdir / AUDIT_LOG, insecure_registries=insecure_registries,
                  on_event=progress) as promoter:
        if harbor_setup is not None:
            harbor_report, scan_reader = harbor_setup()
        outcomes = PushRun(report_path, to, promoter, scan_overview=scan_reader, on_event=progress).run(variants)
    if output_format == "json":
        click.echo(json.dumps({"report": str(report_path), "to": to,
                               "harbor": harbor_report, "variants": [o.row() for o in outcomes]}, indent=2))
    else:
        print_push(outcomes)
    if any(o.action in ("refused", "failed") for o in outcomes):
        sys.exit(ExitCode.FAILED)


ScanReader = Callable[[str, str], dict[str, Any]]


def _harbor(url: str, to: str, password_file: Path | None,
            ca_bundle: Path | None) -> Callable[[], tuple[dict[str, Any], ScanReader]]:
    """Check the Harbor options now (bad input: exit 2); return what ensures the project and reads scans."""
    import os

    from imagebuild.cli.harbor_command import _ca, _checked_url, _harbor_failures, credentials_from
    from imagebuild.release import harbor

    base_url = _checked_url(url)
    _, path = plan.split_repository(to)
    if "/" in path:
        raise InputError("--to", None, "", f"with --harbor-url, give REGISTRY/PROJECT (one Harbor project), not {to}")
    try:
        harbor.check_name("project", path)
    except ValueError as err:
        raise InputError("--to", None, "", str(err)) from None
    credentials = credentials_from(os.environ.get("HARBOR_USERNAME"), password_file)
    ca = _ca(ca_bundle)

    def setup() -> tuple[dict[str, Any], ScanReader]:
        client = harbor.HarborClient(base_url, credentials, ca_bundle=ca)
        with _harbor_failures():
            ensured = harbor.ensure(client, harbor.HarborSetup(project=path))

        def scan(target: str, digest: str) -> dict[str, Any]:
            """Harbor's scan overview; a failure to read it is reported, not fatal (the image is pushed)."""
            try:
                return client.scan_overview(harbor.parse_artifact(f"{target}@{digest}")).to_dict()
            except harbor.HarborError as err:
                return {"artifact": f"{target}@{digest}", "found": False, "status": "error", "error": str(err)}

        return ensured.to_dict(), scan

    return setup


def print_push(outcomes: list[PushOutcome]) -> None:
    from rich.table import Table  # push's table only: promote prints lines and starts without rich

    from imagebuild.cli.common import stdout

    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("variant", "result", "digest", "tags", "uploaded", "reused", "audit / reason"):
        table.add_column(column, overflow="fold")
    for o in outcomes:
        r = o.record
        ok = o.action in ("pushed", "unchanged")
        audit = (f"passed ({(r.audit or {}).get('key')}; {len((r.audit or {}).get('attestations') or [])} attestations)"
                 if ok else (r.reason or ""))
        table.add_row(*safe_cells(o.variant, o.action, (r.digest or "")[:19], ", ".join(r.tags) if ok else "-",
                                  _size(r.bytes_uploaded) if ok else "-", str(r.blobs_reused) if ok else "-", audit))
        if r.harbor:  # what Harbor says
            h = r.harbor
            table.add_row(*safe_cells("", "harbor scan", "", h.get("status") or "", "", "",
                                      f"severity {h.get('severity') or '-'}, total {h.get('total', 0)}"))
    stdout.print(table)
    counts = {a: sum(o.action == a for o in outcomes) for a in ("pushed", "unchanged", "refused", "failed")}
    stdout.print(f"{counts['pushed']} pushed, {counts['unchanged']} already there, {counts['refused']} refused, "
                 f"{counts['failed']} failed")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@click.command("promote")
@click.argument("source", metavar="SOURCE")
@click.argument("target", metavar="TARGET")
@click.option("--tag", "tags", multiple=True, metavar="T",
              help="Tag to write in TARGET (repeatable) [default: SOURCE's tag; none for a digest].")
@trust_option
@key_option
@force_option
@reason_option
@audit_workdir_option
@insecure_option
@format_option("table", "json")
@reports_input_errors
def promote_command(source: str, target: str, tags: tuple[str, ...], trust_path: Path | None,
                    keys: tuple[Path, ...], force: bool, reason: str | None, workdir: Path,
                    insecure_registries: tuple[str, ...], output_format: str) -> None:
    """Copy SOURCE (an image by tag or digest) to the repository TARGET, audit it there, then tag it.

    The same steps as push for any signed image, within one registry or to another: SOURCE's
    signature must verify with the keys; only the blobs TARGET lacks move (mounted within one
    registry); the signature and attestations travel with it; the audit in TARGET must pass
    before any --tag is written; a tag naming another digest is refused unless --force
    --reason (appended to WORKDIR/audit.jsonl). Prints what moved: bytes uploaded, blobs
    already present, blobs mounted.

    Exit 0 when promoted (or already there); 1 when refused or failed; 2 on bad input; 3 when
    a registry cannot be reached or refuses the credentials.

    \b
    Examples:
      imagebuild promote 127.0.0.1:5000/release/paddle:3.3.1 registry.eu.example.com/paddle --key cosign.pub
      imagebuild promote harbor.example.com/paddle/paddle@sha256:... harbor.example.com/paddle-lts/paddle \\
          --tag 3.3.1 --tag 3.3 --trust policies/trust.yaml
      imagebuild promote SRC:3.3.1 DST --key cosign.pub --force --reason "re-promote the fixed build"
    """
    from imagebuild.trust.verify import parse_image

    try:
        ref = parse_image(source)
    except ValueError as err:
        raise InputError("SOURCE", None, "", f"not an image reference: {err}") from None
    target = checked_repository("TARGET", target)
    wanted = list(tags) if tags else ([ref.tag] if ref.tag and not ref.digest else [])
    for tag in wanted:
        try:
            plan.check_tag(tag)
        except ValueError as err:
            raise InputError("--tag", None, "", str(err)) from None
    force_move = plan.Force.parse(force, reason)
    config = trust_config(trust_path, keys)
    with Promoter(config, force_move, workdir / AUDIT_LOG, insecure_registries=insecure_registries,
                  on_event=progress) as promoter:
        try:
            outcome = promoter.promote(source, target, wanted)
        except (PushError, RegistryError) as exc:
            if isinstance(exc, RegistryError) and environmental(exc):
                raise  # exit 3, one line
            outcome = PromoteOutcome(source, target, ref.digest, "failed", reason=str(exc).splitlines()[0][:500])
    if output_format == "json":
        click.echo(json.dumps(outcome.row(), indent=2))
    else:
        print_promote(outcome)
    if outcome.action not in ("pushed", "unchanged"):
        sys.exit(ExitCode.FAILED)


def print_promote(o: PromoteOutcome) -> None:
    if o.action not in ("pushed", "unchanged"):
        echo(f"{o.source}: {o.action}: {o.reason}", err=True)
        return
    moved = o.moved()
    echo(f"{o.source} -> {o.target}@{o.digest}: {o.action}")
    echo(f"  moved: {moved['bytes_uploaded']} bytes uploaded in {moved['blobs_uploaded']} blobs; "
         f"{moved['blobs_present']} blobs already present, {moved['blobs_mounted']} mounted")
    if o.stats and o.stats.signature_tags:
        echo(f"  signatures: {', '.join(o.stats.signature_tags)}")
    if o.audit:
        echo(f"  audit: passed (signed by {o.audit.key}; attestations: "
             f"{', '.join(o.audit.attestations) or 'none'})")
    echo(f"  tags: {', '.join(o.tags) or '(none; by digest)'}"
         + (f" (written: {', '.join(o.tags_written)})" if o.tags_written else ""))
    for move in o.tags_moved:
        echo(f"  moved tag {move['tag']}: {move['from']} -> {move['to']} ({move['reason']})")
