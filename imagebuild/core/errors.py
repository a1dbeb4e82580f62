"""The error root and the exit codes: every exception imagebuild defines is an ImagebuildError and
carries the exit code it means; the CLI (cli/common.reports_input_errors) ends a command with it.

An error that means something other than "the work failed" says so once, on its class
(`exit_code = ExitCode.BAD_INPUT`), or, where one class means several things, on the instance
(`RolloutError(message, exit_code=ExitCode.ENVIRONMENT)`). Signals are not errors: a Ctrl-C or a
CI cancel (core.runner.Cancelled, a KeyboardInterrupt) ends a command with INTERRUPTED or TERMINATED.
"""
from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    """How an imagebuild command ends (README.md, "Exit codes")."""

    OK = 0
    FAILED = 1  # the work failed: drift, a failed build, a refused image, an unexpected error
    BAD_INPUT = 2  # a file, option or argument is malformed; nothing was written
    ENVIRONMENT = 3  # a tool or service is missing, unreachable, or refuses the credentials
    LEASE_HELD = 4  # (rollout) the channel's lease is held by another rollout
    INTERRUPTED = 130  # SIGINT (Ctrl-C): 128 + 2, as shells report it
    TERMINATED = 143  # SIGTERM (a CI cancel): 128 + 15


class ImagebuildError(Exception):
    """The root of every exception imagebuild defines. `exit_code` is what it means for a command:
    the class's (FAILED unless a subclass says otherwise), or the one this instance was given."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, *args: object, exit_code: ExitCode | None = None) -> None:
        super().__init__(*args)
        if exit_code is not None:
            self.exit_code = exit_code


def exit_code_of(error: BaseException) -> ExitCode:
    """The code a command ends with when ERROR stops it: an ImagebuildError's own; for a signal
    (a KeyboardInterrupt, core.runner.Cancelled with its `signum`) INTERRUPTED or TERMINATED;
    FAILED for any other exception."""
    if isinstance(error, ImagebuildError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return ExitCode.TERMINATED if getattr(error, "signum", signal.SIGINT) == signal.SIGTERM else ExitCode.INTERRUPTED
    return ExitCode.FAILED
