"""`imagebuild push` / `promote` command lines: bad input is one line and exit 2 before any registry is asked."""
from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_imagebuild

PUB = "/var/lib/imagebuild/keys/cosign.pub"


def one_line_exit_2(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(("args", "message"), [
    (["--to", "release", "--key", PUB], "--to: 'release' is not REGISTRY/REPOSITORY"),
    (["--to", "harbor.example.com/Paddle", "--key", PUB], "lowercase segments"),
    (["--to", "harbor.example.com/paddle:3.3.1", "--key", PUB], "names a tag or digest"),
    (["--to", "r.example.com/p", "--key", PUB, "--force"], "--force: needs --reason TEXT"),
    (["--to", "r.example.com/p", "--key", PUB, "--reason", "x"], "--reason: only goes with --force"),
    (["--to", "r.example.com/p", "--key", PUB, "--trust", "examples/local/trust.yaml"], "give --key or --trust"),
    (["--to", "r.example.com/p", "--trust", "no/such/trust.yaml"], "no such trust config"),
    (["--to", "r.example.com/a/b", "--key", PUB, "--harbor-url", "https://harbor.example.com"],
     "give REGISTRY/PROJECT (one Harbor project)"),
])
def test_push_bad_input_is_one_line_and_exit_2(tmp_path: Path, args, message):
    result = run_imagebuild("push", "--workdir", tmp_path, *args, env={"HARBOR_USERNAME": "", "HARBOR_PASSWORD": ""})
    assert message in one_line_exit_2(result)


def test_push_without_a_build_report_is_bad_input(tmp_path: Path):
    result = run_imagebuild("push", "--workdir", tmp_path, "--to", "r.example.com/p", "--key", PUB)
    assert "build report not found" in one_line_exit_2(result)


def test_harbor_credentials_are_never_taken_from_an_option(tmp_path: Path):
    result = run_imagebuild("push", "--workdir", tmp_path, "--to", "r.example.com/p", "--key", PUB,
                            "--harbor-url", "https://harbor.example.com", env={"HARBOR_USERNAME": "admin",
                                                                                "HARBOR_PASSWORD": ""})
    assert "HARBOR_PASSWORD" in one_line_exit_2(result)


@pytest.mark.parametrize(("args", "message"), [
    (["not a ref", "r.example.com/p"], "SOURCE: not an image reference"),
    (["r.example.com/p/x:1", "r.example.com/q:2"], "TARGET: 'r.example.com/q:2' names a tag or digest"),
    (["r.example.com/p/x:1", "r.example.com/q", "--tag", "sha256-" + "a" * 64 + ".sig"], "cosign's signature"),
    (["r.example.com/p/x:1", "r.example.com/q", "--tag", "-bad"], "is not a valid tag"),
])
def test_promote_bad_input_is_one_line_and_exit_2(tmp_path: Path, args, message):
    result = run_imagebuild("promote", *args, "--key", PUB, "--workdir", tmp_path)
    assert message in one_line_exit_2(result)


def test_help_gives_examples_and_lists_push_and_promote_after_verify():
    for command in ("push", "promote"):
        result = run_imagebuild(command, "--help")
        assert result.returncode == 0 and "Examples:" in result.stdout
    listing = run_imagebuild("--help").stdout
    assert listing.index(" verify ") < listing.index(" push ") < listing.index(" promote ")
