"""policies generate: admission policies and the webhook's manifests from the trust configuration."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from imagebuild.admission import policies as policy_files
from imagebuild.admission.webhook_image import KEEP_TAG_FLAG, UNVERIFIED_FLAG, webhook_image
from imagebuild.cli.common import DEFAULT_TRUST_CONFIG, echo, format_option, reports_input_errors, trust_file_option
from imagebuild.config.trust import load_trust_config
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError


@dataclass(frozen=True)
class Change:
    path: str  # relative to the output folder
    reason: str  # "missing", "changed" or "stale" (ours, no longer generated); "unchanged" when written

    def __str__(self) -> str:
        return f"{self.reason:9} {self.path}"


def _ours(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(policy_files.GENERATED_HEADER)) == policy_files.GENERATED_HEADER.encode()
    except OSError:
        return False


def survey(root: Path, files: tuple[policy_files.GeneratedFile, ...]) -> list[Change]:
    """How root differs from the generated files. Files without the generated header are someone
    else's (a kustomization.yaml, a README) and are neither compared nor removed."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise InputError(str(root), None, "", "is not a real directory; policies are written only into one")
    changes: list[Change] = []
    wanted = {f.name: f.text for f in files}
    for name, text in wanted.items():
        target = root / name
        if target.is_symlink() or target.is_dir() or (target.exists() and not _ours(target)):
            raise InputError(str(target), None, "", "exists and was not written by imagebuild; move it away")
        if not target.exists():
            changes.append(Change(name, "missing"))
        elif target.read_bytes() != text.encode("utf-8"):
            changes.append(Change(name, "changed"))
        else:
            changes.append(Change(name, "unchanged"))
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.name not in wanted and entry.is_file() and not entry.is_symlink() and _ours(entry):
                changes.append(Change(entry.name, "stale"))
    return changes


def write(root: Path, files: tuple[policy_files.GeneratedFile, ...], changes: list[Change]) -> None:
    """Each file replaced whole (temporary file + rename), so an interrupted run leaves old or new
    files, never half of one, and a rerun finishes the set."""
    root.mkdir(parents=True, exist_ok=True)
    texts = {f.name: f.text for f in files}
    for change in changes:
        target = root / change.path
        if change.reason == "stale":
            target.unlink()
        elif change.reason in ("missing", "changed"):
            temporary = target.with_name(f".{target.name}.tmp")
            temporary.write_text(texts[change.path], encoding="utf-8")
            os.replace(temporary, target)


def _source_name(config_path: Path) -> str:
    """How headers name the configuration: relative to the working directory when inside it, so
    checkouts in different places generate the same bytes."""
    try:
        return config_path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return config_path.as_posix()


@click.group("policies")
def policies_group() -> None:
    """Admission policies from the trust configuration (keys, images, requirements)."""


@policies_group.command("generate")
@trust_file_option("The trust configuration to read.", default=DEFAULT_TRUST_CONFIG)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the files go (default: admission/ beside the configuration).")
@click.option("--ca-bundle", "ca_bundle", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              default=None, help="PEM of the CA behind the webhook's certificate, for its caBundle "
                                 "(default: cert-manager injects it).")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 and list the drift if any file differs.")
@click.option(KEEP_TAG_FLAG, "keep_tag", is_flag=True,
              help="For a trust file naming no webhook.image: write the placeholder image as it is (nothing "
                   "to resolve or verify). Refused when webhook.image is set.")
@click.option(UNVERIFIED_FLAG, "unverified", is_flag=True,
              help="INSECURE, for a first install whose webhook image is not signed yet: pin webhook.image "
                   "without verifying it (a warning says so), so the Deployment may run an image nobody "
                   "trusted vouches for, chosen by whoever can push to its repository.")
@format_option("table", "json")
@reports_input_errors
def generate(trust_path: Path, out: Path | None, ca_bundle: Path | None, check: bool, keep_tag: bool,
             unverified: bool, output_format: str) -> None:
    """Write a sigstore ClusterImagePolicy, a Kyverno ClusterPolicy and ImageValidatingPolicy,
    the manifests of `imagebuild admission serve`, and the workload namespaces labelled for Pod
    Security Admission (when the trust file lists `namespaces`), from one trust configuration.

    Every key in the configuration is accepted (any one suffices), so a key rotation lists both
    keys until every image is signed with the new one. The webhook's Deployment names its image
    by digest: a tag in webhook.image is resolved through its registry (exit 2 when the tag does
    not exist, 3 when the registry cannot be asked). Before any file names it, that digest (or
    the one written) is verified as the webhook verifies any image: exit 1 and nothing written
    when it is refused, 3 when its registry cannot be asked. The same configuration (and digest)
    always gives the same bytes.

    \b
    Examples:
      imagebuild policies generate                       # policies/trust.yaml -> policies/admission/
      imagebuild policies generate --check               # CI: exit 1 when committed files drifted
      imagebuild policies generate --trust examples/local/trust.yaml --out /tmp/admission
      imagebuild policies generate --ca-bundle ca.pem    # caBundle inline instead of cert-manager
      imagebuild policies generate --keep-webhook-tag    # no webhook.image: the placeholder, as it is
      imagebuild policies generate --format json | jq '.files[].path'
    """
    config = load_trust_config(trust_path)
    bundle = ca_bundle.read_bytes() if ca_bundle is not None else None
    if bundle is not None and b"-----BEGIN CERTIFICATE-----" not in bundle:
        raise InputError(str(ca_bundle), None, "", "is not a PEM certificate bundle")
    image = webhook_image(config, keep_tag=keep_tag, unverified=unverified, warn=lambda line: echo(line, err=True))
    files = policy_files.generate(config, policy_files.Options(source=_source_name(trust_path), ca_bundle=bundle,
                                                               webhook_image=image))
    root = out if out is not None else trust_path.parent / "admission"
    changes = survey(root, files)
    drift = [c for c in changes if c.reason != "unchanged"]
    if check:
        if output_format == "json":
            click.echo(json.dumps({"config": str(trust_path), "out": str(root),
                                   "drift": [{"path": str(root / c.path), "reason": c.reason} for c in drift]}))
        elif drift:
            echo(f"{root}: {len(drift)} file(s) differ from {trust_path}:", err=True)
            for c in drift:
                echo(f"  {c}", err=True)  # file names read from disk
            echo(f"run `imagebuild policies generate --trust {trust_path}` and commit the result", err=True)
        else:
            echo(f"{root}: {len(files)} files up to date")
        sys.exit(ExitCode.FAILED if drift else ExitCode.OK)
    write(root, files, changes)
    if output_format == "json":
        click.echo(json.dumps({"config": str(trust_path), "out": str(root), "files": [
            {"path": str(root / c.path), "status": c.reason} for c in changes]}, indent=2))
        return
    for c in drift:
        echo(f"  {c}")
    echo(f"{root}: {len(files)} files, {len(drift)} changed")
