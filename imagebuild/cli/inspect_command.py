"""imagebuild inspect: an image's release record (provenance + release predicate), verified (logic in verify.py, provenance.py)."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from imagebuild.cli.common import (
    DEFAULT_TRUST_CONFIG,
    echo,
    format_option,
    reports_input_errors,
    safe_markup,
    trust_config_option,
    trust_file_option,
)
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError

if TYPE_CHECKING:
    from rich.tree import Tree


@click.command("inspect")
@click.argument("image", metavar="IMAGE")
@trust_file_option(f"The trust config whose keys must have signed the record "
                   f"[default: {DEFAULT_TRUST_CONFIG}].")
@click.option("--key", "keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Verify with this public key instead of a config; repeat during a key rotation.")
@format_option("table", "json")
@reports_input_errors
def inspect_command(image: str, trust_path: Path | None, keys: tuple[Path, ...], output_format: str) -> None:
    """Show the release record of IMAGE (a tag or a digest), verified.

    The tag is resolved to its digest; the image's signature and its provenance (SLSA v1) and
    release attestations must verify with one of the keys and be about that very digest, and
    the release record must point to that provenance. Then it shows what went into the image
    and what happened to it: the variant and its matrix cell, the base image digest, the layers,
    the source revision, the builder and build run, the smoke results, the scanner and its DB,
    the gate's decision with the exceptions it applied, where the signatures are, and the tags.
    For a multi-platform image (an index) it also lists each platform's image with its own
    verdict (signature and attestations about that child's digest); a refused child is a problem.

    Exit 0 when the record verified; 1 when it is missing, unsigned, signed by another key,
    about another digest or inconsistent (said on stderr); 2 on bad input; 3 when the registry
    cannot be reached.

    \b
    Examples:
      imagebuild inspect --trust examples/local/trust.yaml 127.0.0.1:5000/imagebuild-example/paddle:3.3.1
      imagebuild inspect --key cosign.pub --format json IMAGE@sha256:...
    """
    from imagebuild.trust.attest import PREDICATE_PROVENANCE, PREDICATE_RELEASE
    from imagebuild.trust.provenance import provenance_problems, record_summary, release_problems
    from imagebuild.trust.verify import Verifier, parse_image

    try:
        parse_image(image)
    except ValueError as exc:
        raise InputError(image, None, "", f"not an image reference: {exc}") from None
    config = trust_config_option(trust_path, keys)

    with Verifier(config) as verifier:
        found = verifier.inspect(image)
    problems: list[str] = [found.problem] if found.problem else []
    provenance = found.attestations.get(PREDICATE_PROVENANCE)
    release = found.attestations.get(PREDICATE_RELEASE)
    if found.problem is None:
        for name, attestation in (("provenance", provenance), ("release", release)):
            if attestation is None:
                problems.append(f"no verified {name} attestation")
        if provenance is not None:
            problems += provenance_problems(provenance.predicate)
        if release is not None:
            problems += release_problems(release.predicate, provenance.predicate if provenance else None,
                                         found.digest or "")
    problems += [f"{child.platform} child {child.digest}: {child.reason}" for child in found.children
                 if not child.allowed]
    if problems and found.rejected:
        problems.append(f"rejected: {'; '.join(found.rejected)}")
    record = (record_summary(provenance.predicate, release.predicate if release else None)
              if provenance is not None and isinstance(provenance.predicate, dict) else None)

    if output_format == "json":
        click.echo(json.dumps({
            "image": image, "digest": found.digest, "verified": not problems, "key": found.key,
            "problems": problems, "rejected": list(found.rejected), "record": record,
            "children": [asdict(child) for child in found.children],
            "provenance": provenance.predicate if provenance else None,
            "release": release.predicate if release else None,
        }, indent=2))
    elif record is not None:
        from imagebuild.cli.common import stdout  # rich: for the tree only, not for --format json

        stdout.print(record_tree(image, found.digest, found.key, record, verified=not problems))
    if output_format != "json":
        for child in found.children:  # an index: every platform's image and its own verdict
            echo(f"{image}: platform {child.line()}", err=not child.allowed)
    for problem in problems:  # may quote an unverified attestation (its predicateType) or a registry
        echo(f"{image}: {'refused' if not found.unreachable else 'unreachable'}: {problem}", err=True)
    if found.unreachable:
        sys.exit(ExitCode.ENVIRONMENT)
    if problems:
        sys.exit(ExitCode.FAILED)


def record_tree(image: str, digest: str | None, key: str | None, record: dict[str, Any], *, verified: bool) -> Tree:
    """The record for people: one branch per part, values as recorded (escaped: they come from the registry)."""
    from rich.tree import Tree

    def s(value: object) -> str:
        return safe_markup(value)

    state = f"[green]verified[/] (signed by {s(key)})" if verified else "[red]NOT verified[/]"
    tree = Tree(f"[bold]{s(image)}[/]  {s(digest)}  {state}")
    cell = record["matrix_cell"]
    variant = tree.add(f"variant [bold]{s(record['variant'])}[/]")
    variant.add(s(", ".join(f"{axis} {cell.get(axis)}" for axis in ("os", "device", "cuda", "cudnn", "python", "paddle"))))
    matrix = record["matrix"]
    variant.add(s(f"matrix {matrix.get('path')}  {matrix.get('sha256') or '(sha256 not recorded)'}"))
    build = tree.add("build")
    build.add(s(f"base {record['base']['image']}@{record['base']['digest']}"))
    build.add(s(f"source {record['source']['uri'] or ''} revision {record['source']['revision'] or 'unknown'}"))
    layers = build.add(f"layers ({len(record['layers'])})")
    for layer in record["layers"]:
        layers.add(s(f"{layer['kind']:8} key {str(layer['key'])[:16]}  {layer['digest']}"))
    run = record["build_run"]
    build.add(s(f"builder {record['builder']}  run {run['id']}  {run['started']} .. {run['finished'] or '?'}"))
    smoke = record.get("smoke") or {}
    counts = smoke.get("counts") or {}
    tree.add(s(f"smoke {smoke.get('status')}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
               + (f"  tiers {', '.join(smoke.get('tiers') or [])}" if smoke.get("tiers") else "")))
    scan = record.get("scan") or {}
    scanner, db = scan.get("scanner") or {}, scan.get("db") or {}
    tree.add(s(f"scan {scanner.get('uri')} {scanner.get('version')}  DB {db.get('version')} ({db.get('uri')})"
               f"  at {scan.get('started')}"))
    gate = record.get("gate") or {}
    policy = gate.get("policy") or {}
    gate_node = tree.add(s(f"gate {gate.get('decision')}  policy {policy.get('file')} "
                           f"(severity {policy.get('severity')})  on {gate.get('evaluated_on')}"))
    for exception in gate.get("exceptions_applied") or []:
        gate_node.add(s(f"excepted {exception.get('id')} in {exception.get('package')} until {exception.get('expires')}"
                        f" by {exception.get('owner')}: {exception.get('reason')}"))
    for blocked in gate.get("blocking") or []:
        gate_node.add(f"[red]blocking[/] {s(blocked.get('id'))} in {s(blocked.get('package'))} ({s(blocked.get('severity'))})")
    signature = record.get("signature") or {}
    sig = tree.add(s(f"signature layout {signature.get('layout')}  cosign {signature.get('cosign')}  "
                     f"key {signature.get('key') or 'keyless'}  tlog {signature.get('tlog')}"))
    sig.add(s(f"signatures {signature.get('signature')}"))
    sig.add(s(f"attestations {signature.get('attestations')}"))
    tags = tree.add("tags")
    for tag in record.get("tags") or []:
        tags.add(s(tag))
    return tree
