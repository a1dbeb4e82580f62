"""What every command shares: exit codes, consoles, the input-error wrapper and common options."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from .. import build as building
from .. import selection
from ..registry import RegistryError
from ..source import InputError
from ..tools import ToolMissing

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3  # a tool or service is missing or unreachable
EXIT_INTERRUPTED = 130


def _console(**kwargs: Any) -> Console:
    """Rich wraps at 80 columns when not on a terminal; CI logs read better unwrapped."""
    console = Console(highlight=False, **kwargs)
    if not console.is_terminal:
        console.width = 200
    return console


stdout = _console()
stderr = _console(stderr=True)


def reports_input_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input: one line on stderr naming file, line and key; exit code 2; no traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except InputError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except ToolMissing as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(EXIT_ENVIRONMENT)
        except RegistryError as err:
            click.echo(f"error: registry: {err}", err=True)
            sys.exit(EXIT_ENVIRONMENT)

    return wrapper


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


PIPELINE_ORDER = ("validate", "support", "plan", "render", "build", "test", "scan", "gate")


registry_option = click.option(
    "--registry", "use_registry", is_flag=True,
    help="Ask the matrix's registry which layers exist (one HEAD per distinct layer).")
only_option = click.option("--only", multiple=True, metavar="SELECTOR", help=selection.HELP)
revision_option = click.option(
    "--revision", default=None, help="Source revision for the release labels (default: git HEAD).")


def _revision(revision: str | None) -> tuple[str, str]:
    """The checkout this runs in (like CI's), unless --revision / SOURCE_DATE_EPOCH say otherwise."""
    commit, created = building.git_revision(Path.cwd())
    return (revision or commit), created


workdir_option = click.option(
    "--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
    show_default=True, help="Where the build report is; scan/ and gate/ results go beside it.")

