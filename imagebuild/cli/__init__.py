"""The `imagebuild` command line: parse, call, print. No pipeline logic lives here.

One module per command group; this one only assembles them. Exit codes: 0 success; 1 the work
failed (drift found, a build or gate failed, an unexpected error); 2 bad input (malformed matrix,
policy or release file; bad options); 3 a tool or service is missing; 130 interrupted by SIGINT
(Ctrl-C); 143 stopped by SIGTERM (a CI cancel). See common.reports_input_errors.
"""
from __future__ import annotations

import os

import click

from .admission_command import admission_group
from .build_command import build
from .harbor_command import harbor_group
from .inspect_command import inspect_command
from .matrix_commands import plan, render, support, validate
from .policies_command import policies_group
from .push_command import promote_command, push_command
from .quarantine_command import quarantine_command, rescan_command
from .release_command import release_command
from .rollout_command import rollout_group
from .scan_commands import gate_command, scan
from .sign_command import sign_command
from .test_command import test_command
from .verify_command import verify_command

PIPELINE_ORDER = (
    "validate", "support", "plan", "render", "build", "test", "scan", "gate", "sign", "verify", "inspect", "push",
    "promote", "release", "rollout", "rescan", "quarantine",
)


class PipelineGroup(click.Group):
    """--help lists the commands in the order the pipeline runs them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: (PIPELINE_ORDER.index(n) if n in PIPELINE_ORDER else 99, n))


@click.group(cls=PipelineGroup,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="imagebuild")
@click.option("--debug", is_flag=True, help="Show the traceback of an unexpected error (or IMAGEBUILD_DEBUG=1).")
def cli(debug: bool) -> None:
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
    """
    if debug:
        os.environ["IMAGEBUILD_DEBUG"] = "1"



for command in (validate, support, plan, render, build, test_command, scan, gate_command, sign_command,
                policies_group):
    cli.add_command(command)
cli.add_command(verify_command)
cli.add_command(inspect_command)
cli.add_command(admission_group)
cli.add_command(harbor_group)
cli.add_command(push_command)
cli.add_command(promote_command)
cli.add_command(release_command)
cli.add_command(rollout_group)
cli.add_command(rescan_command)
cli.add_command(quarantine_command)


def main() -> None:
    cli(prog_name="imagebuild")
