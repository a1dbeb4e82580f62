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
