"""Finding external binaries, and the one subprocess runner, which redacts secrets.

Every external command (docker build, trivy, cosign) goes through `run`, so a secret value
handed to a tool can never reach a log file or a report verbatim.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TOOLS_DIR = Path(os.environ.get("IMAGEBUILD_TOOLS_DIR", "/opt/imagebuild-tools/bin"))
REDACTED = "***"


class ToolMissing(Exception):
    """A required external tool or service is absent; the message says how to get it."""


def redact(text: str, secrets: Iterable[str]) -> str:
    for value in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def _candidates(name: str) -> list[str]:
    found = []
    for directory in [str(TOOLS_DIR), *os.environ.get("PATH", "").split(os.pathsep), "/usr/bin"]:
        path = Path(directory) / name
        if path.is_file() and os.access(path, os.X_OK) and str(path) not in found:
            found.append(str(path))
    return found


def find_tool(name: str, env_var: str, hint: str) -> str:
    configured = os.environ.get(env_var)
    if configured:
        if not shutil.which(configured):
            raise ToolMissing(f"{env_var}={configured} is not an executable")
        return configured
    candidates = _candidates(name)
    if not candidates:
        raise ToolMissing(f"{name} not found on PATH or in {TOOLS_DIR}: {hint}")
    return candidates[0]


@lru_cache(maxsize=1)
def docker_cli() -> str:
    """A docker CLI whose `build` runs on BuildKit (DOCKER_BUILDKIT=1) with --secret.

    A newer CLI without the buildx plugin refuses BuildKit, so each candidate is asked.
    """
    configured = os.environ.get("IMAGEBUILD_DOCKER")
    candidates = [configured] if configured else _candidates("docker")
    for cli in candidates:
        try:
            probe = subprocess.run([cli, "build", "--help"], capture_output=True, text=True, timeout=30,
                                   env={**os.environ, "DOCKER_BUILDKIT": "1"})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0 and "--secret" in probe.stdout:
            return cli
    raise ToolMissing(
        "no docker CLI that can build with BuildKit was found "
        f"(tried: {', '.join(candidates) or 'none'}). Install Debian's docker.io, whose /usr/bin/docker "
        "builds with DOCKER_BUILDKIT=1, or the docker buildx plugin; or set IMAGEBUILD_DOCKER. "
        "scripts/bootstrap.sh does this."
    )


@dataclass
class Result:
    returncode: int
    output: str  # stdout and stderr, redacted


class Runner:
    """Runs commands in their own process group so an interrupt can stop all of them."""

    def __init__(self) -> None:
        self._running: set[subprocess.Popen] = set()

    def run(self, cmd: Sequence[str], *, secrets: Iterable[str] = (), log: Path | None = None,
            env: dict[str, str | None] | None = None, timeout: float | None = None, cwd: Path | None = None,
            keep: Callable[[str], bool] | None = None) -> Result:
        """Run `cmd`; its output, redacted, goes to `log` and the Result.

        `env` adds to this process's environment; a None value removes that variable.
        `keep` drops lines from both (a tool whose debug output we need a few lines of, like
        Trivy's, would otherwise fill memory and disk with millions we do not).
        """
        secrets = list(secrets)
        environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        process = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace", env=environment, cwd=cwd,
                                   start_new_session=True)
        self._running.add(process)
        chunks: list[str] = []
        handle = log.open("w", encoding="utf-8") if log else None
        try:
            assert process.stdout is not None
            for line in process.stdout:
                if keep is not None and not keep(line):
                    continue
                clean = redact(line, secrets)
                chunks.append(clean)
                if handle:
                    handle.write(clean)
                    handle.flush()
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._stop(process)
            chunks.append(f"\nimagebuild: timed out after {timeout} s\n")
            return Result(124, "".join(chunks))
        finally:
            if handle:
                handle.close()
            self._running.discard(process)
        return Result(process.returncode, "".join(chunks))

    def stop_all(self) -> None:
        for process in list(self._running):
            self._stop(process)

    @staticmethod
    def _stop(process: subprocess.Popen) -> None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
