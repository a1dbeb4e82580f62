"""imagebuild harbor: set up a Harbor project for releases, and read Harbor's scan results.

The logic is in imagebuild/release/harbor.py (push calls the same `ensure`). Credentials come from the
environment (HARBOR_USERNAME, HARBOR_PASSWORD) or a file (--password-file), never from an
option value, which would show in `ps` and in shell histories. A robot's secret is printed once
on stdout, or written to a 0600 file with --secret-file; never to stderr or in --format json.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import ssl
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from imagebuild.cli.common import echo, format_option, reports_input_errors
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.release import harbor

url_option = click.option("--url", required=True, metavar="URL",
                          help="Harbor's address, e.g. https://harbor.example.com (http only for loopback).")
ca_option = click.option("--ca-bundle", type=click.Path(dir_okay=False, path_type=Path), default=None,
                         help="PEM file of the CA(s) that signed Harbor's certificate (default: the system's).")
username_option = click.option("--username", envvar="HARBOR_USERNAME", default=None, show_envvar=True,
                               help="Harbor user (an administrator of the project, or of Harbor to create it).")
password_file_option = click.option(
    "--password-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Read the password from this file (its first line) instead of HARBOR_PASSWORD.")
retries_option = click.option("--retries", type=click.IntRange(0, 10), default=4, show_default=True,
                              help="Retries of a request that Harbor answers 429 or 5xx, or that cannot connect.")


@click.group("harbor")
def harbor_group() -> None:
    """Harbor: the release project, its immutable tag rules and CI robot; scan results.

    Credentials: HARBOR_USERNAME, and HARBOR_PASSWORD or --password-file.
    """


@harbor_group.command("ensure")
@url_option
@click.option("--project", required=True, help="The project to create or bring up to date.")
@click.option("--public/--private", default=False, show_default=True, help="Whether anyone may pull.")
@click.option("--severity", type=click.Choice(harbor.SEVERITIES), default="high", show_default=True,
              help="Harbor refuses pulls of images with a finding at or above this severity.")
@click.option("--immutable-tag", "immutable_tags", multiple=True, metavar="PATTERN",
              help="Release tags Harbor must never overwrite (doublestar pattern; repeatable) "
                   f"[default: {' '.join(harbor.DEFAULT_IMMUTABLE_TAGS)}]. cosign's sha256-* tags stay writable.")
@click.option("--robot", "robot_name", default=None, metavar="NAME",
              help="Ensure a robot account robot$PROJECT+NAME that may push, pull and read artifacts.")
@click.option("--robot-duration", type=int, default=90, show_default=True,
              help="Days until a new robot account expires; -1: never.")
@click.option("--rotate-secret", is_flag=True, help="Give an existing robot a new secret (shown once).")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a new robot secret to this file (mode 0600) instead of stdout.")
@ca_option
@username_option
@password_file_option
@retries_option
@format_option("table", "json")
@reports_input_errors
def ensure_command(url: str, project: str, public: bool, severity: str, immutable_tags: tuple[str, ...],
                   robot_name: str | None, robot_duration: int, rotate_secret: bool, secret_file: Path | None,
                   ca_bundle: Path | None, username: str | None, password_file: Path | None, retries: int,
                   output_format: str) -> None:
    """Create or update a Harbor project for releases; a second run changes nothing.

    \b
    The project gets: private unless --public; auto-scan on push; pulls refused for images
    with findings at or above --severity and for images without a cosign signature; the
    system CVE allowlist. One immutable tag rule per --immutable-tag pattern, for every
    repository, that leaves cosign's signature and attestation tags (sha256-*) writable.
    With --robot, a project robot account for CI (push, pull, read artifacts): its secret
    is shown once, when it is created (or with --rotate-secret), on stdout or in
    --secret-file, and never again. Exit 3 when Harbor cannot be reached or refuses the
    credentials.

    \b
    Examples:
      export HARBOR_USERNAME=admin HARBOR_PASSWORD=...
      imagebuild harbor ensure --url https://harbor.example.com --project paddle
      imagebuild harbor ensure --url https://harbor.example.com --project paddle \\
          --robot ci --secret-file ci-robot.secret --immutable-tag '[0-9]*' --immutable-tag 'v*'
      imagebuild harbor ensure --url https://harbor.internal --ca-bundle corp-ca.pem \\
          --project paddle --password-file /run/secrets/harbor --format json
    """
    base_url = _checked_url(url)
    patterns = immutable_tags or harbor.DEFAULT_IMMUTABLE_TAGS
    try:
        harbor.check_name("project", project)
    except ValueError as err:
        raise InputError("--project", None, "", str(err)) from None
    for pattern in patterns:
        try:
            harbor.check_release_pattern(pattern)
        except ValueError as err:
            raise InputError("--immutable-tag", None, "", str(err)) from None
    robot = None
    if robot_name is not None:
        try:
            harbor.check_name("robot", robot_name)
        except ValueError as err:
            raise InputError("--robot", None, "", str(err)) from None
        if robot_duration != -1 and robot_duration <= 0:
            raise InputError("--robot-duration", None, "", "a number of days, or -1 for never")
        robot = harbor.RobotSpec(robot_name, robot_duration)
        if output_format == "json" and secret_file is None:
            raise InputError("--secret-file", None, "", "--format json never prints a robot secret; "
                                                        "give --secret-file FILE for it")
    elif rotate_secret or secret_file is not None:
        raise InputError("--robot", None, "", "--rotate-secret and --secret-file need --robot NAME")
    if secret_file is not None and (secret_file.is_dir() or not os.access(secret_file.parent, os.W_OK)):
        raise InputError("--secret-file", None, "", f"{secret_file}: not a file that can be written")
    credentials = credentials_from(username, password_file)
    setup = harbor.HarborSetup(
        project=project, settings=harbor.ProjectSettings(public=public, severity=severity),
        immutable_tags=tuple(patterns), robot=robot, rotate_secret=rotate_secret)
    with _harbor_failures(), harbor.HarborClient(base_url, credentials, ca_bundle=_ca(ca_bundle),
                                                 retries=retries) as client:
        report = harbor.ensure(client, setup)
    secret = report.robot.secret if report.robot is not None else None
    if secret is not None and secret_file is not None:
        try:
            write_secret(secret_file, secret)
        except OSError as err:
            echo(f"error: harbor: {report.robot.name if report.robot else 'the robot'} has a new secret, but "
                 f"{secret_file} could not be written ({err.strerror or type(err).__name__}); run again with "
                 f"--rotate-secret to issue another", err=True)
            sys.exit(ExitCode.FAILED)
    if output_format == "json":
        click.echo(json.dumps({**report.to_dict(), "secret_file": str(secret_file) if secret and secret_file else None},
                              indent=2))
        return
    _print_report(report)
    if secret is not None and report.robot is not None:
        if secret_file is not None:
            echo(f"secret of {report.robot.name} written to {secret_file} (mode 0600)")
        else:
            echo(f"The secret of {report.robot.name} is shown once; store it now (next time use --secret-file):",
                 err=True)
            echo(secret)


@harbor_group.command("scan-overview")
@url_option
@click.argument("images", nargs=-1, required=True, metavar="IMAGE@DIGEST...")
@ca_option
@username_option
@password_file_option
@retries_option
@format_option("table", "json")
@reports_input_errors
def scan_overview_command(url: str, images: tuple[str, ...], ca_bundle: Path | None, username: str | None,
                          password_file: Path | None, retries: int, output_format: str) -> None:
    """Harbor's vulnerability scan summary of each image, by digest.

    IMAGE is PROJECT/REPOSITORY or HOST/PROJECT/REPOSITORY. Exit 1 when an image is not in
    Harbor; an image Harbor has not scanned (yet) is reported as such.

    \b
    Examples:
      imagebuild harbor scan-overview --url https://harbor.example.com \\
          paddle/paddle@sha256:6f1c...  harbor.example.com/paddle/paddle-cpu@sha256:09ab...
      imagebuild harbor scan-overview --url https://harbor.example.com --format json paddle/paddle@sha256:6f1c...
    """
    base_url = _checked_url(url)
    refs = []
    for text in images:
        try:
            refs.append(harbor.parse_artifact(text))
        except ValueError as err:
            raise InputError("IMAGE", None, "", str(err)) from None
    credentials = credentials_from(username, password_file)
    with _harbor_failures(), harbor.HarborClient(base_url, credentials, ca_bundle=_ca(ca_bundle),
                                                 retries=retries) as client:
        overviews = [client.scan_overview(ref) for ref in refs]
    if output_format == "json":
        click.echo(json.dumps({"url": base_url, "artifacts": [o.to_dict() for o in overviews]}, indent=2))
    else:
        for overview in overviews:
            echo(_overview_line(overview))
    if not all(o.found for o in overviews):
        sys.exit(ExitCode.FAILED)


def write_secret(path: Path, secret: str) -> None:
    """SECRET into PATH, readable by its owner only, replacing it whole (never half-written)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, (secret + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _checked_url(url: str) -> str:
    try:
        return harbor.check_base_url(url)
    except ValueError as err:
        raise InputError("--url", None, "", str(err)) from None


def _ca(ca_bundle: Path | None) -> Path | None:
    if ca_bundle is None:
        return None
    try:
        ssl.create_default_context(cafile=str(ca_bundle))
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
        raise InputError("--ca-bundle", None, "", f"{ca_bundle}: not a readable PEM CA bundle "
                                                  f"({type(err).__name__})") from None
    return ca_bundle


def credentials_from(username: str | None, password_file: Path | None) -> harbor.Credentials:
    """The Harbor user's credentials from the options and the environment (push uses it too)."""
    if not username:
        raise InputError("HARBOR_USERNAME", None, "", "set HARBOR_USERNAME (or --username) to the Harbor user")
    if password_file is not None:
        try:
            lines = password_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise InputError("--password-file", None, "", f"cannot read it: {type(err).__name__}") from None
        password = lines[0] if lines else ""
    else:
        password = os.environ.get("HARBOR_PASSWORD", "")
    if not password:
        raise InputError("HARBOR_PASSWORD", None, "", "set HARBOR_PASSWORD or give --password-file "
                                                      "(never the password itself on the command line)")
    return harbor.Credentials(username, password)


@contextlib.contextmanager
def _harbor_failures() -> Iterator[None]:
    """A Harbor error in one line, with its exit code: 3 when Harbor is unreachable or refuses the
    credentials (HarborUnavailable, HarborAuthError), 1 for any other refusal."""
    try:
        yield
    except harbor.HarborError as err:
        echo(f"error: harbor: {err}", err=True)
        sys.exit(err.exit_code)


def _print_report(report: harbor.EnsureReport) -> None:
    project = report.project
    if project.action == "unchanged":
        echo(f"project {project.name}: unchanged")
    else:
        changes = ", ".join(f"{k} {b or 'unset'} -> {a}" if b is not None or project.action != "created" else f"{k}={a}"
                            for k, (b, a) in project.changes.items())
        echo(f"project {project.name}: {project.action} ({changes})")
    for rule in report.rules:
        echo(f"immutable tags {rule.pattern}: {rule.action} (rule {rule.id}; sha256-* tags stay writable)")
    if report.robot is not None:
        robot = report.robot
        expires = ("never expires" if robot.expires_at == -1 else
                   f"expires {dt.datetime.fromtimestamp(robot.expires_at, dt.timezone.utc):%Y-%m-%d %H:%M} UTC")
        hint = "; its secret is not shown again (--rotate-secret issues a new one)" if robot.secret is None else ""
        echo(f"robot {robot.name}: {robot.action}, {expires}{hint}")
    echo(f"Harbor {report.harbor_version} at {report.url}: {'changed' if report.changed else 'nothing changed'}")


def _overview_line(overview: harbor.ScanOverview) -> str:
    if not overview.found or overview.status == "not scanned":
        return f"{overview.artifact}  {overview.status}"
    counts = " ".join(f"{key[0]}{overview.counts.get(key, 0)}" for key in ("Critical", "High", "Medium", "Low", "Unknown"))
    scanner = f"  ({overview.scanner})" if overview.scanner else ""
    return (f"{overview.artifact}  {overview.status}  severity {overview.severity or '-'}  {counts}  "
            f"total {overview.total} fixable {overview.fixable}{scanner}")
