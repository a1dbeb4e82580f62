"""imagebuild admission image: the webhook's own image through build, smoke, scan, gate and sign
(logic in release/admission_image.py; the stages are `imagebuild release`'s)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from imagebuild.checks import scan as scanning
from imagebuild.cli.common import echo, format_option, report_at, reports_input_errors, safe, stdout, trust_file_option
from imagebuild.cli.progress import LineProgress
from imagebuild.cli.release_command import checked_scan_source, gate_scan_and_sign_options, print_release
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import load_document
from imagebuild.release import admission_image as webhook
from imagebuild.release.pipeline import ReleaseOptions


@click.command("image")
@trust_file_option("The trust file: its webhook.image is where the image goes, and its images must cover it.",
                   required=True)
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild/admission"),
              show_default=True, help="Where its build report and every stage's results go (not a matrix's workdir).")
@click.option("--source", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The checkout whose pyproject.toml and imagebuild/ go in [default: the one this imagebuild runs from].")
@click.option("--base", default=webhook.DEFAULT_BASE, show_default=True, metavar="IMAGE",
              help="The Debian image both stages start from; a tag is resolved to its digest at build time.")
@click.option("--secret", "secret_overrides", multiple=True, metavar="ID=PATH",
              help="ca-bundle=PATH: the CA bundle pip trusts during the build [default: the system's].")
@click.option("--revision", default=None, help="Source revision for the provenance (default: the checkout's git HEAD).")
@gate_scan_and_sign_options
@format_option("table", "json")
@reports_input_errors
def image_command(trust_path: Path, workdir: Path, source: Path | None, base: str, secret_overrides: tuple[str, ...],
                  revision: str | None, policy_path: Path, cache_dir: Path, offline: bool, db_repository: str | None,
                  key: str, output_format: str) -> None:
    """Build the webhook's image with imagebuild, then smoke-test, scan, gate and sign it, by digest.

    \b
    The image is the trust file's webhook.image: Debian's python3 and a venv with this imagebuild
    and exactly the webhook's pinned dependencies, uid 65532, no shell, no setuid file, read-only
    root. It goes through the stages `imagebuild release` runs (its own smoke suite,
    smoke_tests/admission/), into WORKDIR/build-report.json; a later stage refuses it unless the
    earlier ones passed on its digest. A rerun with the same source does nothing.

    Exit 0 when it went through; 1 when a stage failed; 2 on bad input; 3 when a tool or service
    is missing.

    \b
    Examples:
      imagebuild admission image --trust examples/local/trust.yaml --policy examples/local/policy.yaml \\
          --offline --cache-dir .imagebuild/trivy-example
      imagebuild admission image --trust policies/trust.yaml --base registry.example.com/debian:12
    """
    from imagebuild.build import scheduler as building
    from imagebuild.checks.gate import parse_policy
    from imagebuild.cli.sign_command import signing_options
    from imagebuild.config.trust import parse_trust_config

    document = load_document(trust_path)
    config = parse_trust_config(document, trust_path)
    image = webhook.webhook_image(config, str(trust_path), document.line(("webhook", "image")))
    checked_scan_source(offline, db_repository)
    source = (source or Path(webhook.__file__).resolve().parents[2]).resolve()
    webhook.source_files(source)  # not a checkout: exit 2 before anything is built
    parse_policy(load_document(policy_path))
    secrets = webhook.build_secrets(building.parse_secret_overrides(secret_overrides))
    sign_options = signing_options(key, False, None, None, None, None, None, None, False, (), 300)
    commit, _ = building.git_revision(source)
    options = ReleaseOptions(workdir=workdir, jobs=1, policy=policy_path)
    scan_options = scanning.ScanOptions(workdir=workdir, dockerfiles=workdir / "dockerfiles", cache_dir=cache_dir,
                                        offline=offline, db_repository=db_repository)
    run = webhook.AdmissionImageRun(options, scan_options, sign_options, on_event=lambda line: echo(line, err=True),
                                    on_layer=LineProgress())
    report_at(workdir / "build-report.json")
    root = webhook.resolve_base(base)
    echo(safe(f"webhook image: {image.reference} from {root.reference}"), err=True)
    try:
        results = run.run_image(image, root, source, secrets, revision or commit)
    finally:
        secrets.close()
    summary = run.summary()
    if output_format == "json":
        click.echo(json.dumps(summary, indent=2))
    else:
        print_release(summary)
        for result in results:
            if result.image:
                stdout.print(safe(f"image: {result.image}"), markup=False)
    if summary["status"] != "released":
        sys.exit(ExitCode.FAILED)
