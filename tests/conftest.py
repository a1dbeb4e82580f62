"""Shared test plumbing: where the repository is, and running the real CLI."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_imagebuild(*args: str | Path, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None,
                   timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m imagebuild ARGS` in a fresh process, as CI and people run it."""
    return subprocess.run(
        [sys.executable, "-m", "imagebuild", *map(str, args)],
        cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="session")
def imagebuild():
    return run_imagebuild


def program_on_path(tmp_path: Path, name: str, script: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A shell script NAME in tmp_path/bin, first on PATH: a real program standing in for a tool
    (a docker credential helper, nvidia-smi, mmdebstrap). A second one of the same name replaces it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    if os.environ["PATH"].split(os.pathsep)[0] != str(bin_dir):
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return path
