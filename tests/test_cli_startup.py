"""Start-up of the CLI: a command imports only what it needs; the lazy command table stays true."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import click
import pytest

from imagebuild.cli import COMMANDS, PIPELINE_ORDER, cli

from .conftest import REPO_ROOT, run_imagebuild

# What no registry command needs: the docker SDK (and its requests/urllib3), jinja2 and the plan,
# XML, the Harbor client, the webhook server, and httpx's own command line (rich, pygments).
NOT_FOR_REGISTRY_COMMANDS = (
    "docker", "requests", "urllib3", "jinja2", "xml.etree.ElementTree", "rich", "pygments", "httpx._main",
    "imagebuild.build.scheduler", "imagebuild.build.publish", "imagebuild.build.plan", "imagebuild.build.render", "imagebuild.config.matrix",
    "imagebuild.release.harbor", "imagebuild.admission.server", "imagebuild.checks.gate", "imagebuild.checks.scan",
)


def modules_after(code: str) -> set[str]:
    """The modules imported once CODE ran in a fresh interpreter (this checkout's package first).

    A None entry in sys.modules is an import that was blocked, not made (httpx._main)."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import json, sys
        print(json.dumps(sorted(name for name, module in sys.modules.items() if module is not None)), file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("command", ["promote", "push", "verify", "inspect", "rollout"])
def test_resolving_a_registry_command_imports_none_of_the_heavy_modules(command: str) -> None:
    loaded = modules_after(f"""
        import click
        from imagebuild.cli import cli
        assert cli.get_command(click.Context(cli), {command!r}) is not None
    """)
    assert f"imagebuild.cli.{COMMANDS[command].target.partition(':')[0]}" in loaded  # it did import
    assert sorted(loaded.intersection(NOT_FOR_REGISTRY_COMMANDS)) == []


def test_top_level_help_imports_no_command_module() -> None:
    loaded = modules_after("""
        from imagebuild.cli import cli
        assert cli.main(["--help"], prog_name="imagebuild", standalone_mode=False) == 0
    """)
    assert sorted(m for m in loaded if m.startswith("imagebuild.cli.")) == []
    assert "imagebuild.oci.client" not in loaded


def test_every_table_entry_resolves_to_its_command() -> None:
    assert set(PIPELINE_ORDER) <= set(COMMANDS)
    for name, entry in COMMANDS.items():
        command = cli.load(name)
        assert isinstance(command, click.Command), entry.target
        assert command.name == name, entry.target
        assert entry.short_help == command.get_short_help_str(limit=10_000), (
            f"COMMANDS[{name!r}].short_help differs from {entry.target}'s docstring")


@pytest.mark.parametrize("width", [60, 100])
def test_help_lists_what_the_commands_themselves_would(width: int) -> None:
    """`imagebuild --help` from the table is the listing the loaded commands give, in pipeline order."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import click
        from click.testing import CliRunner
        from imagebuild.cli import cli
        def help_text():
            return CliRunner().invoke(cli, ["--help"], prog_name="imagebuild", terminal_width={width}).output
        lazy = help_text()
        ctx = click.Context(cli)
        for name in cli.list_commands(ctx):
            cli.get_command(ctx, name)
        print(lazy == help_text())
        print(lazy)
    """)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    same, _, listing = proc.stdout.partition("\n")
    assert same == "True", listing
    names = [line.split()[0] for line in listing.split("Commands:\n", 1)[1].splitlines() if line.strip()]
    assert names == list(PIPELINE_ORDER) + sorted(set(COMMANDS) - set(PIPELINE_ORDER))


def test_completion_and_suggestions_know_every_command() -> None:
    completed = run_imagebuild(env={"_IMAGEBUILD_COMPLETE": "bash_complete", "COMP_WORDS": "imagebuild pro",
                                    "COMP_CWORD": "1"})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["plain,promote"]
    typo = run_imagebuild("promot")
    assert typo.returncode == 2
    assert "No such command 'promot'" in typo.stderr
    if hasattr(click.exceptions, "NoSuchCommand"):  # click >= 8.4 suggests close names
        assert "'promote'" in typo.stderr.split("No such command", 1)[1]
