"""The `imagebuild` command line: parse, call, print. No pipeline logic lives here.

One module per command group; this one only names them (COMMANDS), each imported when it runs.
Exit codes: 0 success; 1 the work failed (drift found, a build or gate failed, an unexpected
error); 2 bad input (malformed matrix, policy or release file; bad options); 3 a tool or service
is missing; 130 interrupted by SIGINT (Ctrl-C); 143 stopped by SIGTERM (a CI cancel). See
common.reports_input_errors.

May import: core, oci, config, build, checks, trust, release, rollout, retention, admission, kube, notify,
metrics. Nothing else imports cli.
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import click


def _skip_httpx_command_line() -> None:
    """Keep `import httpx` from importing httpx's own command line (httpx._main), unused here.

    httpx's __init__ imports it whenever its extras (rich, pygments) are installed, as they are
    with imagebuild: some 50-70 ms on every start of a command that talks to a registry. A None
    in sys.modules makes that import raise ImportError, which httpx handles (its `main` becomes
    a stub saying the CLI is not installed). tests/test_cli_startup.py notices when this stops working.
    """
    if "httpx" not in sys.modules:
        sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]


_skip_httpx_command_line()

PIPELINE_ORDER = (
    "validate", "support", "plan", "render", "build", "test", "scan", "gate", "sign", "verify", "inspect", "push",
    "promote", "release", "rollout", "rescan", "quarantine",
)


class LazyCommand(NamedTuple):
    """Where a command lives, and what `imagebuild --help` says of it without importing it."""

    target: str  # "module:attribute", the module within this package
    short_help: str  # the command's own short help; tests/test_cli_startup.py keeps the two in sync


# Each command module pulls in what its command needs (the docker SDK, jinja2, rich, an HTTP
# client...): imported only when that command runs, `imagebuild promote` starts without the rest.
COMMANDS: dict[str, LazyCommand] = {
    "validate": LazyCommand(
        "matrix_commands:validate", "Check the matrix against its schema and the support table; write nothing."),
    "support": LazyCommand(
        "matrix_commands:support",
        "Show the support table: CUDA/cuDNN pairs and Pythons per Paddle, driver minimums."),
    "plan": LazyCommand(
        "matrix_commands:plan", "Show the variants, their tags and layer chains; shared layers are marked."),
    "render": LazyCommand(
        "matrix_commands:render", "Render the layer Dockerfiles from the matrix into dockerfiles/<kind>/<name>/."),
    "build": LazyCommand(
        "build_command:build",
        "Build the matrix's layers with BuildKit, parents first, reusing every key the registry has."),
    "test": LazyCommand(
        "test_command:test_command",
        "Run the smoke tests (smoke_tests/) inside each image: the abi tier anywhere, the gpu tier on GPU hosts."),
    "scan": LazyCommand("scan_commands:scan", "Scan every built image of the build report, by digest, with Trivy."),
    "gate": LazyCommand(
        "scan_commands:gate_command",
        "Judge the scanned images against the vulnerability policy; record the verdict per variant."),
    "sign": LazyCommand(
        "sign_command:sign_command",
        "Sign each image of the build report by digest with cosign, and attach its attestations."),
    "verify": LazyCommand(
        "verify_command:verify_command",
        "Verify each IMAGE (a tag or a digest) as the admission webhook does, without running cosign."),
    "inspect": LazyCommand(
        "inspect_command:inspect_command", "Show the release record of IMAGE (a tag or a digest), verified."),
    "push": LazyCommand(
        "push_command:push_command",
        "Copy each signed image of the build report to its release repository, audit it there, then tag it."),
    "promote": LazyCommand(
        "push_command:promote_command",
        "Copy SOURCE (an image by tag or digest) to the repository TARGET, audit it there, then tag it."),
    "release": LazyCommand(
        "release_command:release_command",
        "Build, smoke-test, scan, gate, sign and push each variant: the whole chain in one command."),
    "rollout": LazyCommand(
        "rollout_command:rollout_group",
        "Staged rollout of an image to channel tags, region by region in waves, with gates."),
    "rescan": LazyCommand(
        "quarantine_command:rescan_command",
        "Scan every image behind a channel tag again, with today's DB; quarantine those that now fail the gate."),
    "vex": LazyCommand(
        "vex_command:vex_group", "The policy's exceptions as a signed OpenVEX attestation, which `rescan` hands to Trivy."),
    "quarantine": LazyCommand(
        "quarantine_command:quarantine_command",
        "Quarantine IMAGE by hand, lift it with --clear, or list what is quarantined (no IMAGE)."),
    "gc": LazyCommand(
        "gc_command:gc_group",
        "Delete what no channel, rollback, quarantine or kept release needs, from every region and the state "
        "repository."),
    "admission": LazyCommand(
        "admission_command:admission_group",
        "The validating admission webhook: Kubernetes asks it about every Pod and Pod template."),
    "harbor": LazyCommand(
        "harbor_command:harbor_group",
        "Harbor: the release project, its immutable tag rules and CI robot; scan results."),
    "policies": LazyCommand(
        "policies_command:policies_group",
        "Admission policies from the trust configuration (keys, images, requirements)."),
}


def in_pipeline_order(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: (PIPELINE_ORDER.index(n) if n in PIPELINE_ORDER else 99, n))


class PipelineGroup(click.Group):
    """--help lists the commands in the order the pipeline runs them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return in_pipeline_order(super().list_commands(ctx))


class LazyPipelineGroup(PipelineGroup):
    """A PipelineGroup whose commands are imported on first use, from a table of LazyCommand.

    Listing the commands (--help, completion of their names) imports none of them: --help shows
    the table's short help. Resolving one imports its module only, and keeps the command.
    """

    def __init__(self, *args: Any, lazy_commands: Mapping[str, LazyCommand] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return in_pipeline_order({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.add_command(self.load(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as err:
            # click >= 8.4 suggests close names ("Did you mean 'promote'?") from the commands imported
            # so far, which is none of them here: suggest from every name instead.
            no_such_command = getattr(click.exceptions, "NoSuchCommand", None)
            if no_such_command is None or not isinstance(err, no_such_command):
                raise
            raise no_such_command(err.command_name, possibilities=self.list_commands(ctx), ctx=ctx) from None

    def load(self, cmd_name: str) -> click.Command:
        """Import the command the table names for CMD_NAME."""
        target = self.lazy_commands[cmd_name].target
        module_name, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(f".{module_name}", __name__), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The Commands section as click writes it, from the table's short help where not yet imported."""
        listed = [(name, command) for name in self.list_commands(ctx)
                  if (command := self._listed(ctx, name)) is not None]
        if not listed:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in listed)  # click's own spacing
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.get_short_help_str(limit)) for name, command in listed])

    def _listed(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands and name not in self.commands:
            # A stand-in: click shortens its help to the width exactly as it would the real one's.
            return click.Command(name, help=self.lazy_commands[name].short_help)
        command = self.get_command(ctx, name)
        return None if command is None or command.hidden else command


@click.group(cls=LazyPipelineGroup, lazy_commands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="imagebuild")
@click.option("--debug", is_flag=True, help="Show the traceback of an unexpected error (or IMAGEBUILD_DEBUG=1).")
@click.option("--metrics-textfile-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              envvar="IMAGEBUILD_METRICS_TEXTFILE_DIR", metavar="DIR",
              help="release, rollout, rescan and gc write their figures here as *.prom files, for "
                   "node-exporter's textfile collector (or IMAGEBUILD_METRICS_TEXTFILE_DIR).")
@click.option("--metrics-pushgateway", default=None, envvar="IMAGEBUILD_METRICS_PUSHGATEWAY", metavar="URL",
              callback=lambda _ctx, _param, value: _pushgateway(value),
              help="... or push them to this Prometheus Pushgateway (or IMAGEBUILD_METRICS_PUSHGATEWAY).")
@click.pass_context
def cli(ctx: click.Context, debug: bool, metrics_textfile_dir: Path | None, metrics_pushgateway: str | None) -> None:
    """Build, test, scan, sign and roll out PaddlePaddle GPU images from one version matrix.

    \b
    Examples:
      imagebuild plan                                  # what matrix.yaml expands to
      imagebuild plan --format github-matrix           # one CI job per variant
      imagebuild render && git diff dockerfiles/       # regenerate the Dockerfiles
      imagebuild render --check                        # CI: fail when they drifted
      imagebuild support                               # the Paddle/CUDA/Python table
      imagebuild release --only device=cpu             # build, smoke, scan, gate, sign, push
      imagebuild verify IMAGE@sha256:...               # as the admission webhook checks it
      imagebuild rollout start --release release.yaml --image REF --channel stable
      imagebuild --metrics-pushgateway http://pushgateway:9091 rescan --release release.yaml
    """
    if debug:
        os.environ["IMAGEBUILD_DEBUG"] = "1"
    ctx.meta["imagebuild.metrics"] = {"textfile_dir": metrics_textfile_dir, "pushgateway": metrics_pushgateway}


def _pushgateway(value: str | None) -> str | None:
    """An http(s) URL with a host, nothing after its path (a query or fragment would not reach the Pushgateway)."""
    if not value:
        return None
    url = urlsplit(value)
    if url.scheme not in ("http", "https") or not url.hostname or url.query or url.fragment:
        raise click.BadParameter(f"'{value[:100]}' is not an http(s) URL of a Pushgateway (http://host:9091)")
    return value


def main() -> None:
    cli(prog_name="imagebuild")
