"""imagebuild sign: cosign signatures and attestations for the built, smoke-tested and gated images (logic in sign.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.table import Table

from imagebuild.cli.common import (
    echo,
    format_option,
    only_option,
    report_at,
    reports_input_errors,
    safe_cells,
    stdout,
    workdir_option,
)
from imagebuild.config.selection import Selection
from imagebuild.core.errors import ExitCode
from imagebuild.core.report import VariantRecord
from imagebuild.core.source import InputError
from imagebuild.trust import sign as signing


@click.command("sign")
@workdir_option
@only_option
@click.option("--key", metavar="PATH|URI", default=None,
              help="cosign private key file, or a KMS URI (awskms://, gcpkms://, azurekms://, hashivault://, "
                   "k8s://), passed to cosign as is. The key's password comes from COSIGN_PASSWORD.")
@click.option("--keyless", is_flag=True,
              help="Sign with a short-lived Fulcio certificate from an OIDC identity instead of a key "
                   "(needs Fulcio and Rekor; uploads to the transparency log).")
@click.option("--oidc-issuer", metavar="URL", default=None, help="Keyless: cosign's --oidc-issuer.")
@click.option("--oidc-client-id", metavar="ID", default=None, help="Keyless: cosign's --oidc-client-id.")
@click.option("--oidc-provider", metavar="NAME", default=None,
              help="Keyless: cosign's --oidc-provider (github-actions, google, spiffe, filesystem, buildkite-agent).")
@click.option("--identity-token", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Keyless: a file holding the OIDC token (or set SIGSTORE_ID_TOKEN); never the token itself.")
@click.option("--fulcio-url", metavar="URL", default=None, help="Keyless: cosign's --fulcio-url.")
@click.option("--rekor-url", metavar="URL", default=None, help="cosign's --rekor-url (with --tlog or --keyless).")
@click.option("--tlog/--no-tlog", default=False, show_default=True,
              help="Upload signatures and attestations to the transparency log (Rekor). Keyless always does.")
@click.option("--insecure-registry", "insecure_registries", multiple=True, metavar="HOST:PORT",
              help="Reach this registry over plain http too (loopback registries always are).")
@click.option("--timeout", "timeout_s", type=click.IntRange(10, 3600), default=300, show_default=True,
              help="Seconds per cosign command.")
@click.option("--policy", "policy_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The vulnerability policy whose exceptions make each image's OpenVEX attestation "
                   "[default: the one the gate judged by, as its record names it].")
@click.option("--resign", is_flag=True,
              help="Key rotation: sign again, with --key, every live digest of --release's regions (what `gc` keeps) "
                   "that verifies now under the trust file, with its attestations.")
@click.option("--release", "release_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --resign: the release file whose regions are re-signed.")
@click.option("--trust", "trust_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --resign: the trust file that must accept each image first [default: the release's].")
@click.option("--image", "extra_images", multiple=True, metavar="REF@DIGEST",
              help="With --resign: another image to re-sign (a staging candidate), by digest.")
@format_option("table", "json")
@reports_input_errors
def sign_command(workdir: Path, only: tuple[str, ...], key: str | None, keyless: bool, oidc_issuer: str | None,
                 oidc_client_id: str | None, oidc_provider: str | None, identity_token: Path | None,
                 fulcio_url: str | None, rekor_url: str | None, tlog: bool, insecure_registries: tuple[str, ...],
                 timeout_s: int, policy_path: Path | None, resign: bool, release_path: Path | None,
                 trust_path: Path | None,
                 extra_images: tuple[str, ...], output_format: str) -> None:
    """Sign each image of the build report by digest with cosign, and attach its attestations.

    Only an image whose smoke tests and gate passed on that very digest is signed; any other
    is refused, saying why. Seven attestations go with each signature: the CycloneDX SBOM, the
    vulnerability report (cosign's vuln predicate), the smoke results, the gate decision
    with the exceptions it applied, the policy's exceptions as OpenVEX (no statements when
    none applies; `imagebuild vex attest` replaces it after a policy change), and the release
    record: SLSA v1 provenance of the build and imagebuild's release predicate (see
    `imagebuild inspect`). The signature is checked in the registry (the
    `sha256-<hex>.sig` tag) and recorded in the build report (stages.sign); a rerun skips what
    is still signed, and a signature this key already made for the digest (an earlier run's, in
    another workdir) is reused rather than added again. Exit 1 when any image was refused or failed.

    \b
    Examples:
      COSIGN_PASSWORD=... imagebuild sign --key cosign.key          # after test, scan and gate
      imagebuild sign --key awskms:///alias/imagebuild-release      # a KMS key, passed to cosign as is
      imagebuild sign --key cosign.key --only device=cpu --format json
      imagebuild sign --keyless --oidc-provider github-actions      # CI with Fulcio and Rekor
      COSIGN_PASSWORD=... imagebuild sign --resign --release release.yaml --key new.key   # key rotation
    """
    selection = Selection.parse(only)
    options = signing_options(key, keyless, oidc_issuer, oidc_client_id, oidc_provider, identity_token,
                              fulcio_url, rekor_url, tlog, insecure_registries, timeout_s)
    if resign or release_path or trust_path or extra_images:
        _resign(resign, options, release_path, trust_path, extra_images, workdir, output_format)
        return
    report_path, report = signing.select_report(workdir)
    variants = selection.choose(report.variants, str(report_path))
    cosign = signing.Cosign.find()

    def progress(event: str, variant: VariantRecord, message: str) -> None:
        echo(f"signing {variant.id} ({message})" if event == "start" else f"  {message}", err=True)

    report_at(report_path)
    outcomes = signing.SignRun(report_path, options, cosign, on_event=progress, policy=policy_path).run(variants)
    if output_format == "json":
        click.echo(json.dumps({"report": str(report_path), "cosign": cosign.version,
                               "variants": [o.row() for o in outcomes]}, indent=2))
    else:
        print_outcomes(outcomes)
    if any(o.action in ("refused", "failed") for o in outcomes):
        sys.exit(ExitCode.FAILED)


def _resign(resign: bool, options: signing.SignOptions, release_path: Path | None, trust_path: Path | None,
            extra_images: tuple[str, ...], workdir: Path, output_format: str) -> None:
    from imagebuild.config.release_file import load_release
    from imagebuild.config.trust import load_trust_config
    from imagebuild.oci.client import ImageRef
    from imagebuild.retention import rotation
    from imagebuild.retention.gc import GcOptions

    if not resign:
        raise InputError("--resign", None, "", "--release, --trust and --image are for re-signing: add --resign")
    if release_path is None:
        raise InputError("--release", None, "", "missing: --resign re-signs the live images of a release's regions")
    if options.keyless is not None:
        raise InputError("--keyless", None, "", "a rotation re-signs with a key (--key); keyless has no key to rotate")
    for image in extra_images:
        try:
            if ImageRef.parse(image).digest is None:
                raise ValueError("give it by digest (REF@sha256:...)")
        except ValueError as exc:
            raise InputError("--image", None, image, str(exc)) from None
    config = load_release(release_path)
    trust = load_trust_config(trust_path or config.trust_path)
    resigner = rotation.Resigner(trust, options, signing.Cosign.find(), workdir / "resign",
                                 on_event=lambda line: echo(line, err=True))
    results = rotation.resign_release(config, resigner, GcOptions(), extra_images)
    if output_format == "json":
        click.echo(json.dumps({"release": str(release_path), "trust": str(trust.path),
                               "images": [r.to_dict() for r in results]}, indent=2))
    else:
        table = Table(show_edge=False, pad_edge=False, box=None)
        for column in ("image", "signature", "attested again", "refused"):
            table.add_column(column, overflow="fold")
        for r in results:
            table.add_row(*safe_cells(r.image, "added" if r.signed else ("-" if r.refused else "already"),
                                      ", ".join(r.attested) or "-", r.refused or ""))
        stdout.print(table)
    if any(r.refused for r in results):
        sys.exit(ExitCode.FAILED)


def signing_options(key: str | None, keyless: bool, oidc_issuer: str | None, oidc_client_id: str | None,
                    oidc_provider: str | None, identity_token: Path | None, fulcio_url: str | None,
                    rekor_url: str | None, tlog: bool, insecure_registries: tuple[str, ...],
                    timeout_s: int) -> signing.SignOptions:
    """Check the key options (bad input: exit 2) and gather them."""
    oidc = {"--oidc-issuer": oidc_issuer, "--oidc-client-id": oidc_client_id, "--oidc-provider": oidc_provider,
            "--identity-token": identity_token, "--fulcio-url": fulcio_url}
    if keyless and key:
        raise InputError("--keyless", None, "", "sign with --key or --keyless, not both")
    if not keyless and not key:
        raise InputError("--key", None, "", "missing: a key file or KMS URI (or --keyless)")
    if not keyless:
        given = [name for name, value in oidc.items() if value]
        if given:
            raise InputError(given[0], None, "", "is a keyless option (add --keyless, or drop it)")
        checked = signing.check_key(key or "")
        if not signing.is_kms_uri(checked) and signing.PASSWORD_ENV not in os.environ:
            raise InputError("--key", None, key or "",
                             f"set {signing.PASSWORD_ENV} to the key's password (empty for an unencrypted key); "
                             "it is never taken on the command line")
        return signing.SignOptions(key=checked, tlog=tlog, insecure_registries=insecure_registries,
                                   timeout_s=timeout_s, rekor_url=rekor_url)
    if identity_token is not None and not identity_token.is_file():
        raise InputError("--identity-token", None, str(identity_token), "no such file (pass a file holding the token)")
    return signing.SignOptions(
        keyless=signing.Keyless(oidc_issuer=oidc_issuer, oidc_client_id=oidc_client_id, oidc_provider=oidc_provider,
                                identity_token=str(identity_token) if identity_token else None,
                                fulcio_url=fulcio_url),
        tlog=True, insecure_registries=insecure_registries, timeout_s=timeout_s, rekor_url=rekor_url)


def print_outcomes(outcomes: list[signing.SignOutcome]) -> None:
    table = Table(show_edge=False, pad_edge=False, box=None)
    for column in ("variant", "result", "digest", "attestations", "signature / reason"):
        table.add_column(column, overflow="fold")
    for o in outcomes:
        signed = o.action in ("signed", "skipped")
        result = "signed (signature reused)" if o.action == "signed" and o.record.signature_reused else o.action
        table.add_row(*safe_cells(o.variant, {"skipped": "already signed"}.get(o.action, result), (o.digest or "")[:19],
                                  str(len(o.record.attestations)) if signed else "-",
                                  (o.record.signature if signed else o.record.reason) or ""))
    stdout.print(table)
    counts = {a: sum(o.action == a for o in outcomes) for a in ("signed", "skipped", "refused", "failed")}
    stdout.print(f"{counts['signed']} signed, {counts['skipped']} already signed, {counts['refused']} refused, "
                 f"{counts['failed']} failed")
