"""imagebuild verify: signatures and attestations of images, against the trust config (logic in verify.py)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from imagebuild.cli.common import (
    DEFAULT_TRUST_CONFIG,
    echo,
    format_option,
    reports_input_errors,
    trust_config_option,
    trust_file_option,
)
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError


@click.command("verify")
@click.argument("images", nargs=-1, required=True, metavar="IMAGE...")
@trust_file_option(f"The trust config: keys, covered images, required attestations "
                   f"[default: {DEFAULT_TRUST_CONFIG}].")
@click.option("--key", "keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Verify with this public key instead of a config (signature only, every registry); "
                   "repeat during a key rotation: any one key suffices.")
@click.option("--no-attestations", is_flag=True,
              help="Check the signature only, not the attestations the config requires.")
@click.option("--require-provenance", is_flag=True,
              help="Also require a SLSA v1 provenance attestation of imagebuild's build type, signed by one of "
                   "the keys and about the image's digest (as `require: {attestations: [provenance]}` does).")
@click.option("--concurrency", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Images verified at once.")
@format_option("table", "json")
@reports_input_errors
def verify_command(images: tuple[str, ...], trust_path: Path | None, keys: tuple[Path, ...],
                   no_attestations: bool, require_provenance: bool, concurrency: int, output_format: str) -> None:
    """Verify each IMAGE (a tag or a digest) as the admission webhook does, without running cosign.

    The tag is resolved to its digest; the digest's cosign signature (the sha256-<hex>.sig tag)
    must verify with one of the configured public keys and name that very digest; then the
    attestations (.att) the config requires must be signed by one of the keys, be about that
    digest, and satisfy its policy: smoke tests and gate passed on this digest, no unexcepted
    vulnerability at or above block_severity. Images outside the config's registries and
    repositories are refused.

    A multi-platform image (an OCI index) is verified whole: the index's own signature (and
    release record, when required), then every child: an image manifest whose config says the
    platform the index lists it under, with its own signature and the other required
    attestations about its own digest. One refused child refuses the index, naming its platform.
    A child's digest is verified as an image of its own.

    Exit 0 when every image is allowed; 1 when any is refused (one line each on stderr:
    `IMAGE: refused: reason`); 2 on bad input; 3 when a registry cannot be reached.

    \b
    Examples:
      imagebuild verify --trust examples/local/trust.yaml 127.0.0.1:5000/imagebuild-example/paddle:3.3.1
      imagebuild verify IMAGE@sha256:...                       # with policies/trust.yaml
      imagebuild verify --key cosign.pub --key cosign-next.pub IMAGE   # during a key rotation
      imagebuild verify --no-attestations --format json IMAGE...
      imagebuild verify --key cosign.pub --require-provenance IMAGE    # refuse an image without provenance
    """
    from imagebuild.trust.verify import Verifier, parse_image

    if require_provenance and no_attestations:
        raise InputError("--require-provenance", None, "", "checks an attestation; drop --no-attestations")
    for image in images:
        try:
            parse_image(image)
        except ValueError as exc:
            raise InputError(image, None, "", f"not an image reference: {exc}") from None
    config = trust_config_option(trust_path, keys)
    if require_provenance and "provenance" not in config.require.attestations:
        config = replace(config, require=replace(config.require,
                                                 attestations=(*config.require.attestations, "provenance")))

    with Verifier(config, check_attestations=not no_attestations) as verifier:
        verdicts = verifier.verify_many(images, concurrency=concurrency)

    if output_format == "json":
        click.echo(json.dumps({"allowed": all(v.allowed for v in verdicts),
                               "images": [v.to_dict() for v in verdicts]}, indent=2))
    else:
        # Reasons quote registries and attestations (a predicateType, an error body): escaped, whole lines.
        for verdict in verdicts:
            if verdict.allowed:
                echo(f"{verdict.image}: verified: {verdict.digest}: {verdict.reason}")
            elif verdict.unreachable:
                echo(f"{verdict.image}: {verdict.reason}", err=True)  # "registry unreachable: ..."
            else:
                echo(f"{verdict.image}: refused: {verdict.reason}", err=True)
            for child in verdict.children:  # an index: each platform's image, as it verified itself
                echo(f"  {child.line()}", err=not child.allowed)
    if any(not v.allowed and not v.unreachable for v in verdicts):
        sys.exit(ExitCode.FAILED)
    if any(v.unreachable for v in verdicts):
        sys.exit(ExitCode.ENVIRONMENT)
