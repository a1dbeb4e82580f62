"""What every command shares: how a command ends (its error line and exit code), consoles and common options."""
from __future__ import annotations

import functools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from imagebuild.config import selection
from imagebuild.core.errors import exit_code_of
from imagebuild.core.runner import ToolMissing, cancel_children, install_signal_handlers, uninterrupted
from imagebuild.core.source import InputError, escape_text
from imagebuild.oci.client import RegistryError

if TYPE_CHECKING:
    from rich.console import Console

    from imagebuild.config.builders import BuildersConfig
    from imagebuild.config.trust import TrustConfig


def _console(**kwargs: Any) -> Console:
    """Rich wraps at 80 columns when not on a terminal; CI logs read better unwrapped."""
    from rich.console import Console

    console = Console(highlight=False, **kwargs)
    if not console.is_terminal:
        console.width = 200
    return console


if TYPE_CHECKING:
    stdout: Console
    stderr: Console
else:
    def __getattr__(name: str) -> Console:
        """`stdout` and `stderr`, made on first use: commands that print no table never import rich.

        (Hidden from mypy, which sees the two names above and still flags any other.)
        """
        if name not in ("stdout", "stderr"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        console = globals()[name] = _console(stderr=name == "stderr")
        return console


def safe(value: object, limit: int | None = None) -> str:
    """A value from untrusted data (a registry, an attestation, a YAML file, an AdmissionReview),
    fit to print: control characters, escape sequences (ESC, CSI), line and paragraph separators,
    bidirectional and invisible formatting characters are written as visible escapes (source.UNSAFE_TEXT),
    so no value can end a line, rewrite one, or move the cursor. `limit` bounds it in characters.

    Every line a command prints from such data goes through here, whole or field by field.
    """
    text = escape_text(str(value))
    return text if limit is None or len(text) <= limit else text[:max(0, limit - 3)] + "..."


def safe_markup(value: object, limit: int | None = None) -> str:
    """`safe`, and rich's markup escaped too: for text that goes into a rich table, tree or print,
    where `[link=...]` or `[/]` from a registry would otherwise be read as markup."""
    from rich.markup import escape

    return escape(safe(value, limit))


def safe_cells(*values: object) -> list[str]:
    """A rich table row from untrusted values: each `safe_markup`."""
    return [safe_markup(value) for value in values]


def safe_lines(text: object) -> str:
    """Several lines (a tool's output tail, a multi-line message): each made safe, the line breaks kept."""
    return "\n".join(safe(line) for line in str(text).splitlines())


def echo(line: object = "", err: bool = False) -> None:
    """click.echo of one line, made safe whole (for lines that hold untrusted values)."""
    click.echo(safe(line), err=err)


_stage_report: dict[str, Path] = {}


def report_at(path: Path) -> None:
    """The report this command records into, named in its last line if it stops early."""
    _stage_report["path"] = path


def debugging() -> bool:
    return os.environ.get("IMAGEBUILD_DEBUG", "") not in ("", "0")


def reports_input_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """How every command ends when it cannot finish, always in one line on stderr; the exit code is
    the error's own (core.errors: every ImagebuildError carries it), the one place codes are chosen.

    Bad input (InputError): `file:line: key: message`, exit 2. A missing tool (ToolMissing) or a
    registry that fails (RegistryError): exit 3. SIGINT/SIGTERM: the children are stopped, the stage
    records what finished, exit 130/143. Any other error: the stage has written its report;
    `error: STAGE: message`, its exit code (1 for an exception imagebuild does not define), and a
    traceback only with IMAGEBUILD_DEBUG=1 (or `imagebuild --debug`).
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stage = click.get_current_context().info_name or "imagebuild"
        install_signal_handlers()
        try:
            return func(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # click's own: usage errors and exits, printed by click
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 -- any error at all ends in one line
            click.echo(_last_line(stage, err), err=True)
            sys.exit(exit_code_of(err))

    return wrapper


def _last_line(stage: str, err: BaseException) -> str:
    """The line a command that ERR stopped ends with; for a signal or an unexpected error, once its
    running tools are stopped."""
    if isinstance(err, InputError):
        return safe(f"error: {err}")
    if isinstance(err, ToolMissing):  # may quote a tool's last lines
        return f"error: {safe_lines(err)}"
    if isinstance(err, RegistryError):  # its text may quote the registry's answer
        return safe(f"error: registry: {err}")
    if isinstance(err, KeyboardInterrupt):  # tools.Cancelled (SIGTERM) included
        cancel_children()
        signum = getattr(err, "signum", signal.SIGINT)
        return (f"interrupted by {signal.Signals(signum).name}: {stage} stopped, its running tools "
                f"with it{_report_note()}")
    try:
        with uninterrupted():
            cancel_children()
    except KeyboardInterrupt:  # a signal during the cleanup: it is done now, and this ends anyway
        pass
    if debugging():
        traceback.print_exc()
    return safe(f"error: {stage}: {_one_line(err)}{_report_note()}")


def _report_note() -> str:
    path = _stage_report.get("path")
    return f" (report: {path})" if path is not None else ""


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(err, OSError):  # OSError's text says what it is; others need their name
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text[:500]


matrix_option = click.option(
    "--matrix", "matrix_path", type=click.Path(dir_okay=False, path_type=Path),
    default=Path("matrix.yaml"), show_default=True, help="The version matrix to read.",
)


def format_option(*choices: str) -> Callable[..., Any]:
    return click.option("--format", "output_format", type=click.Choice(choices), default=choices[0],
                        show_default=True, help="Output for people (table) or machines.")


def dockerfiles_dir(matrix_path: Path, out: Path | None) -> Path:
    """Dockerfiles live beside their matrix unless --out says otherwise."""
    return out if out is not None else matrix_path.parent / "dockerfiles"


PIPELINE_ORDER = ("validate", "support", "plan", "render", "build", "test", "scan", "gate", "sign")


registry_option = click.option(
    "--registry", "use_registry", is_flag=True,
    help="Ask the matrix's registry which layers exist (one HEAD per distinct layer).")
only_option = click.option("--only", multiple=True, metavar="SELECTOR", help=selection.HELP)
revision_option = click.option(
    "--revision", default=None, help="Source revision for the release labels (default: git HEAD).")


def _revision(revision: str | None) -> tuple[str, str]:
    """The checkout this runs in (like CI's), unless --revision / SOURCE_DATE_EPOCH say otherwise."""
    from imagebuild.build import scheduler as building  # the docker SDK and jinja2: only for the commands that build

    commit, created = building.git_revision(Path.cwd())
    return (revision or commit), created


def secret_lane_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--secret-dir / --secret-env: the lane the matrix's build secrets must stay in (the operator's, not the matrix's)."""
    func = click.option(
        "--secret-env", "secret_env", multiple=True, metavar="NAME",
        help="Let a matrix `secrets.<id>.env` read this variable (repeatable; also IMAGEBUILD_SECRET_ENV, "
             "comma-separated). Without it no environment variable reaches a build.")(func)
    return click.option(
        "--secret-dir", "secret_dirs", multiple=True, metavar="DIR",
        help="Let a matrix `secrets.<id>.file` name files under this directory, after resolving links "
             "(repeatable; also IMAGEBUILD_SECRET_DIRS). The system CA bundle is always allowed.")(func)


def builders_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--builders FILE (or IMAGEBUILD_BUILDERS): the BuildKit daemons the layers are built on (config/builders.py)."""
    return click.option(
        "--builders", "builders_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
        envvar="IMAGEBUILD_BUILDERS", metavar="FILE",
        help="Build the layers on the BuildKit daemons this file lists (endpoints, TLS files, platforms, "
             "concurrency; also IMAGEBUILD_BUILDERS). Default: the local Docker engine.")(func)


def builders_and_jobs(builders_path: Path | None, jobs: int | None) -> tuple[BuildersConfig | None, int]:
    """The builders file, read (bad input: exit 2), and the layers built at once: --jobs, else each builder's
    concurrency added up (else 2, the local engine's default)."""
    from imagebuild.config.builders import load_builders

    config = load_builders(builders_path) if builders_path is not None else None
    return config, jobs if jobs is not None else (config.capacity if config is not None else 2)


workdir_option = click.option(
    "--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
    show_default=True, help="Where the build report is; scan/ and gate/ results go beside it.")



DEFAULT_TRUST_CONFIG = Path("policies/trust.yaml")
TRUST_FLAG = "--trust"  # the trust file, in every command; --config is its old spelling, kept hidden


def trust_file_option(help: str, *, required: bool = False,
                      default: Path | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--trust FILE` for a command (its value arrives as `trust_path`), with `--config` as a hidden alias."""
    kind = click.Path(dir_okay=False, path_type=Path)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, trust_path: Path | None, config_alias: Path | None, **kwargs: Any) -> Any:
            if trust_path is not None and config_alias is not None:
                raise click.UsageError("--config is the old name of --trust: give one of them")
            path = trust_path if trust_path is not None else config_alias
            if path is None and required:
                raise click.UsageError(f"Missing option '{TRUST_FLAG}'.")
            return func(*args, trust_path=path if path is not None else default, **kwargs)

        wrapper = click.option("--config", "config_alias", type=kind, default=None, hidden=True)(wrapper)
        shown_default = f" [default: {default}]" if default is not None else ""
        return click.option(TRUST_FLAG, "trust_path", type=kind, default=None, metavar="FILE",
                            required=False, help=help + shown_default)(wrapper)

    return decorate


def trust_config_option(trust_path: Path | None, keys: tuple[Path, ...]) -> TrustConfig:
    """The TrustConfig a command was given: ad hoc from `--key` files, else the trust file (--trust FILE or
    policies/trust.yaml). Shared by verify, inspect, push, promote and release."""
    from imagebuild.config import trust

    if keys and trust_path is not None:
        raise InputError("--key", None, "", f"replaces the trust config; give --key or {TRUST_FLAG}, not both")
    if keys:
        return trust.trust_config_for_keys(list(keys))
    path = trust_path or DEFAULT_TRUST_CONFIG
    if not path.is_file():
        raise InputError(str(path), None, "", f"no such trust config (give {TRUST_FLAG} FILE or --key PUB)")
    return trust.load_trust_config(path)


# --- metrics: what a run tells Prometheus ---------------------------------------------------------------------

Grouping = tuple[tuple[str, str], ...]
_metrics: dict[str, Any] = {"base": (), "groups": {}}  # the running command's figures (one command per process)


def metrics_scope(**grouping: str) -> None:
    """The Pushgateway group (and textfile) this run's figures belong to, e.g. release=<state repository>."""
    _metrics["base"] = tuple(sorted(grouping.items()))


def release_scope(config: Any) -> None:
    """The group of a run over a release file: the release is known by its state repository."""
    metrics_scope(release=f"{config.state_registry}/{config.state_repository}")


def record_figures(families: list[Any], **grouping: str) -> None:
    """Figures (metrics.figures.Family) of this run, for the scope's group, or a group within it (channel=...)."""
    key = tuple(sorted({**dict(_metrics["base"]), **grouping}.items()))
    _metrics["groups"].setdefault(key, []).extend(families)


def exports_figures(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The command's figures, and how it ended (exit code, duration), go where `imagebuild --metrics-*` (or
    IMAGEBUILD_METRICS_TEXTFILE_DIR / IMAGEBUILD_METRICS_PUSHGATEWAY) says, however the command ends. Goes
    inside reports_input_errors, so that it sees the error itself."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.time()
            code = 0
            _metrics.update(base=(), groups={})  # one command per process, but tests invoke many in one
            try:
                return func(*args, **kwargs)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                raise
            except BaseException as err:
                code = exit_code_of(err)
                raise
            finally:
                _export_figures(command, started, code)

        return wrapper

    return decorate


def metrics_wanted() -> bool:
    """Whether this run's figures go anywhere (work done only for them can be skipped otherwise)."""
    options = click.get_current_context().find_root().meta.get("imagebuild.metrics") or {}
    return bool(options.get("textfile_dir") or options.get("pushgateway"))


def _export_figures(command: str, started: float, code: int) -> None:
    options = click.get_current_context().find_root().meta.get("imagebuild.metrics") or {}
    if not metrics_wanted():
        return
    if not _metrics["base"] and not _metrics["groups"]:
        return  # stopped before it knew its release (bad input): no group to tell
    from imagebuild.metrics.export import MetricsTarget, export
    from imagebuild.metrics.figures import Run, run_figures

    target = MetricsTarget(options.get("textfile_dir"), options.get("pushgateway"))
    groups: dict[Grouping, list[Any]] = _metrics["groups"] or {_metrics["base"]: []}
    run = run_figures(Run(command, int(code), started, time.time()))
    for key, figures in groups.items():
        for where in export(target, f"imagebuild_{command}", dict(key), figures, run,
                            warn=lambda line: echo(f"warning: {line}", err=True)):
            echo(f"metrics: {where}", err=True)


def policy_figures(policy: Any) -> list[Any]:
    """When each exception of a vulnerability policy (checks.gate.Policy) stops counting."""
    from imagebuild.metrics.figures import ExceptionFact, exception_figures

    return exception_figures(ExceptionFact(e.id, e.owner, e.expires) for e in policy.exceptions)
