"""One name per concept on the command line: the trust file is `--trust FILE` in every command.

`--config` was its name in verify, inspect, admission and policies; it still works there and
everywhere else, hidden from --help, so scripts written for it keep running.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from imagebuild.cli import cli

TRUST_COMMANDS = [
    ("verify",), ("inspect",), ("push",), ("promote",), ("release",),
    ("admission", "serve"), ("admission", "review"), ("policies", "generate"),
]


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), prog_name="imagebuild")
    return result.exit_code, result.output


@pytest.mark.parametrize("command", TRUST_COMMANDS, ids=" ".join)
def test_help_names_the_trust_file_trust_and_hides_the_old_spelling(command: tuple[str, ...]) -> None:
    code, text = invoke(*command, "--help")
    assert code == 0, text
    assert "--trust FILE" in text
    assert "--config" not in text.replace("--config ''", "")


@pytest.mark.parametrize("flag", ["--trust", "--config"])
def test_both_spellings_read_the_same_trust_file(flag: str, tmp_path: Path) -> None:
    code, text = invoke("verify", flag, str(tmp_path / "absent.yaml"), "127.0.0.1:5000/x:v1")
    assert code == 2
    assert f"{tmp_path / 'absent.yaml'}: no such trust config (give --trust FILE or --key PUB)" in text


def test_the_old_and_the_new_spelling_together_is_a_usage_error(tmp_path: Path) -> None:
    code, text = invoke("verify", "--trust", "a.yaml", "--config", "b.yaml", "127.0.0.1:5000/x:v1")
    assert code == 2
    assert "--config is the old name of --trust: give one of them" in text


def test_a_required_trust_file_is_asked_for_by_its_new_name(tmp_path: Path) -> None:
    review = tmp_path / "review.json"
    review.write_text("{}", encoding="utf-8")
    code, text = invoke("admission", "review", str(review))
    assert code == 2
    assert "Missing option '--trust'." in text


def test_promote_says_what_its_workdir_holds() -> None:
    code, text = invoke("promote", "--help")
    assert code == 0
    assert "audit log" in text
    assert "scan/ and gate/" not in text
