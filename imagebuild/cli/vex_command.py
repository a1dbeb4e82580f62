"""imagebuild vex: the policy's exceptions as a signed OpenVEX attestation (logic in checks/vex.py, trust/vex_attest.py)."""
from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from imagebuild.cli.common import echo, format_option, reports_input_errors, trust_file_option
from imagebuild.core.source import InputError


@click.group("vex")
def vex_group() -> None:
    """The policy's exceptions as a signed OpenVEX attestation, which `rescan` hands to Trivy."""


def _day(value: dt.datetime | None) -> dt.date:
    return value.date() if value else dt.datetime.now(dt.timezone.utc).date()


_today_option = click.option("--today", type=click.DateTime(formats=["%Y-%m-%d"]), default=None, metavar="YYYY-MM-DD",
                             help="As of this day: exceptions past their last day are left out [default: today, UTC].")


@vex_group.command("attest")
@click.argument("image", metavar="IMAGE@DIGEST")
@click.option("--variant", required=True, help="The variant IMAGE is of (exceptions may name variants).")
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("policies/vulnerabilities.yaml"), show_default=True, help="The vulnerability policy.")
@click.option("--sbom", "sbom_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The image's CycloneDX SBOM (`imagebuild scan` writes scan/<variant>/sbom.cdx.json): the purls "
                   "of the packages an exception names.")
@click.option("--key", metavar="PATH|URI", required=True,
              help="cosign private key file or KMS URI; the password comes from COSIGN_PASSWORD.")
@click.option("--insecure-registry", "insecure_registries", multiple=True, metavar="HOST:PORT",
              help="Reach this registry over plain http too (loopback registries always are).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild/vex"),
              show_default=True, help="Where the document attested is written.")
@_today_option
@format_option("table", "json")
@reports_input_errors
def attest_command(image: str, variant: str, policy_path: Path, sbom_path: Path, key: str,
                   insecure_registries: tuple[str, ...], out: Path, today: dt.datetime | None,
                   output_format: str) -> None:
    """Attest IMAGE@DIGEST's OpenVEX document: one statement per exception valid today.

    Each exception becomes not_affected (with its justification) or affected (with the owner's
    action), about the image by digest and the packages it names; its last valid day goes with
    it, and readers drop a statement after that day. Replaces the image's earlier document.

    \b
    Examples:
      imagebuild vex attest 127.0.0.1:5000/imagebuild/paddle@sha256:... --variant paddle3.3.1-cpu-py3.11-debian12 \\
          --sbom .imagebuild/work/scan/paddle3.3.1-cpu-py3.11-debian12/sbom.cdx.json --key cosign.key
    """
    from imagebuild.checks.gate import parse_policy
    from imagebuild.cli.sign_command import signing_options
    from imagebuild.core.source import load_document
    from imagebuild.oci.client import ImageRef
    from imagebuild.trust.sign import Cosign
    from imagebuild.trust.vex_attest import attest_image

    if ImageRef.parse(image).digest is None:
        raise InputError(image, None, "", "not addressed by digest (REF@sha256:...): only digests are attested")
    policy = parse_policy(load_document(policy_path))
    sbom = _read_sbom(sbom_path)
    options = signing_options(key, False, None, None, None, None, None, None, False, insecure_registries, 300)
    digest = ImageRef.parse(image).digest or ""
    done = attest_image(Cosign.find(), image, variant=variant, policy=policy, sbom=sbom, options=options,
                        out=out.resolve() / digest.replace(":", "-"), today=_day(today),
                        now=dt.datetime.now(dt.timezone.utc))
    if output_format == "json":
        click.echo(json.dumps({"image": done.image, "document": str(done.path), "statements": list(done.statements)},
                              indent=2))
    else:
        echo(f"attested openvex to {done.image}: {len(done.statements)} statement(s)"
             + (f" ({', '.join(done.statements)})" if done.statements else "") + f"; document {done.path}")


def _read_sbom(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(str(path), None, "", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(str(path), None, "", f"unreadable: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(str(path), exc.lineno, "", f"not JSON: {exc.msg}") from None
    if not isinstance(data, dict) or data.get("bomFormat") != "CycloneDX":
        raise InputError(str(path), None, "bomFormat", "not a CycloneDX SBOM")
    return data


@vex_group.command("show")
@click.argument("image", metavar="IMAGE@DIGEST")
@trust_file_option("The trust file whose keys must have signed the image and its VEX.", required=True)
@_today_option
@format_option("table", "json")
@reports_input_errors
def show_command(image: str, trust_path: Path, today: dt.datetime | None, output_format: str) -> None:
    """Show IMAGE@DIGEST's signed OpenVEX statements: those a scan would use today, and those expired.

    Exit 0 when a verified document was found, 1 when there is none (unsigned, not verified,
    malformed or absent), 2 on bad input.
    """
    from imagebuild.config.trust import load_trust_config
    from imagebuild.core.errors import ExitCode
    from imagebuild.oci.client import ImageRef
    from imagebuild.trust.verify import Verifier
    from imagebuild.trust.vex_attest import signed_for_scan

    if ImageRef.parse(image).digest is None:
        raise InputError(image, None, "", "not addressed by digest (REF@sha256:...): VEX is about one digest")
    config = load_trust_config(trust_path)
    with Verifier(config, cache_ttl_seconds=0) as verifier, tempfile.TemporaryDirectory() as folder:
        found = signed_for_scan(verifier, image, Path(folder), _day(today))
        document = json.loads(found.path.read_text(encoding="utf-8")) if found.path else None
    if output_format == "json":
        click.echo(json.dumps({"image": image, **found.record(), "file": None, "document": document}, indent=2))
    elif found.problem:
        echo(f"no VEX for {image}: {found.problem}")
    else:
        echo(f"{image}: {len(found.statements)} statement(s) in use" +
             (f" ({', '.join(found.statements)})" if found.statements else ""))
        for line in found.expired:
            echo(f"  expired: {line}")
    if found.problem:
        sys.exit(ExitCode.FAILED)


__all__ = ["vex_group"]
