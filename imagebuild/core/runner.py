"""Finding external binaries, and the one subprocess runner, which redacts secrets.

Every external command (docker build, trivy, cosign, credential helpers, git, mmdebstrap) goes
through `Runner.run`, so a secret value handed to a tool can never reach a log file or a report
verbatim, and a cancel stops every child. This is the one module that imports subprocess
(tests/test_one_way.py).
"""
from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO

from imagebuild.core.errors import ExitCode, ImagebuildError

TOOLS_DIR = Path(os.environ.get("IMAGEBUILD_TOOLS_DIR", "/opt/imagebuild-tools/bin"))
REDACTED = "***"


class ToolMissing(ImagebuildError):
    """A required external tool or service is absent; the message says how to get it (exit 3)."""

    exit_code = ExitCode.ENVIRONMENT


def redact(text: str, secrets: Iterable[str]) -> str:
    for value in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


# What a child that runs untrusted steps (`docker build` of a matrix's `run:` lines) inherits:
# an allowlist, so the signing password, registry credentials and whatever else the CI job holds
# (COSIGN_PASSWORD, HARBOR_PASSWORD, a region's USER:PASSWORD variable, ...) stay in this process.
# The docker CLI needs only how to reach the engine and its own config.
CHILD_ENV_KEEP = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "NO_COLOR", "TMPDIR",
    "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "SOURCE_DATE_EPOCH", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY",
    "DOCKER_API_VERSION", "DOCKER_BUILDKIT", "DOCKER_DEFAULT_PLATFORM", "BUILDKIT_PROGRESS", "BUILDKIT_COLORS",
})
CHILD_ENV_PREFIXES = ("LC_",)
# Belt and braces: a kept name that looks like a credential is dropped all the same.
_CREDENTIAL_NAME = re.compile(r"(?i)pass(word|wd)?|token|secret|credential|auth|api_?key|private")


def child_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowlisted part of `environ` (default: this process's), for a child that runs untrusted steps."""
    source = os.environ if environ is None else environ
    return {name: value for name, value in source.items()
            if (name in CHILD_ENV_KEEP or name.startswith(CHILD_ENV_PREFIXES))
            and not _CREDENTIAL_NAME.search(name)}


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


@dataclass(frozen=True)
class PinnedTool:
    """A tool imagebuild runs at one version only, and how to ask it which it is (JSON on stdout)."""

    name: str
    env_var: str  # points at another binary of the tool
    version: str  # the pin, as scripts/versions.env says it
    version_argv: tuple[str, ...]  # arguments that print the version as JSON
    version_key: str  # the JSON key holding it
    install: str  # how to get it (the hint when it is missing)
    why: str  # what depends on this very version (said when another one is found)


def find_pinned(tool: PinnedTool, runner: Runner, env: dict[str, str | None] | None = None) -> tuple[str, str]:
    """(path, version) of the tool; ToolMissing when absent, mute, or another version than the pin."""
    path = find_tool(tool.name, tool.env_var, tool.install)
    result = runner.run([path, *tool.version_argv], env=env, timeout=60)
    try:
        version = json.loads(result.output[result.output.index("{"):])[tool.version_key]
    except (ValueError, KeyError, TypeError):
        raise ToolMissing(f"{path} does not answer `{tool.name} version` ({result.output.strip()[:200]})") from None
    if version != tool.version:
        raise ToolMissing(f"{path} is {tool.name} {version}, but imagebuild is pinned to {tool.name} {tool.version} "
                          f"(scripts/versions.env): {tool.why}. Install the pinned one (scripts/bootstrap.sh) "
                          f"or point {tool.env_var} at it.")
    return path, str(version)


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
                                   env={**child_environment(), "DOCKER_BUILDKIT": "1"})
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
    output: str  # stdout and stderr, redacted (stdout only when run with separate_stderr)
    timed_out: bool = False  # the deadline passed; the process group was stopped (returncode 124)
    cancelled: bool = False  # a cancel stopped it, or came before it could start
    stderr: str = ""  # with separate_stderr: stderr, redacted


EXIT_TIMED_OUT = 124  # as coreutils' timeout(1) says it
EXIT_CANCELLED = 130  # the code of a command a cancel kept from starting
_STOP_GRACE_S = 10.0  # SIGTERM first; SIGKILL for what is still there after this


class Cancelled(KeyboardInterrupt):
    """SIGTERM (a CI cancel) or SIGINT asked this process to stop.

    A KeyboardInterrupt, so every path that cleans up after Ctrl-C cleans up after a CI cancel too.
    """

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Every child process group of this process, whichever Runner started it, so that one cancel
# stops all of them; and the cancel itself, which worker threads poll between steps.
_children_lock = threading.Lock()
_children: set[subprocess.Popen[bytes]] = set()
_cancel = threading.Event()
_signal_state = {"shield": 0, "pending": 0, "received": 0}


def cancel_requested() -> bool:
    """True once a signal came or cancel_children ran: workers start nothing new."""
    return _cancel.is_set() or bool(_signal_state["received"])


def cancel_children() -> None:
    """Refuse new child processes from now on and stop every running one (with its process group)."""
    with _children_lock:
        _cancel.set()
        running = list(_children)
    _stop(running)


def _on_signal(signum: int, frame: object) -> None:
    # Only the first signal raises: a second Ctrl-C or SIGTERM must not break the cleanup of the first.
    if _signal_state["received"]:
        return
    # Worker threads see this at once (cancel_requested), before the main thread unwinds. No lock
    # is taken here: the main thread may hold it at the moment the signal interrupts it.
    _signal_state["received"] = signum
    if _signal_state["shield"]:
        _signal_state["pending"] = signum
        return
    raise Cancelled(signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGINT raise Cancelled in the main thread (Python runs handlers only there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A short step that must not stop half-way (tagging one variant): a signal waits until it ends.

    Signals reach only the main thread, so elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _signal_state["shield"] += 1
    try:
        yield
    finally:
        _signal_state["shield"] -= 1
        pending = _signal_state["pending"]
        if pending and not _signal_state["shield"]:
            _signal_state["pending"] = 0
            raise Cancelled(pending)


class Runner:
    """Runs commands in their own process group so that a timeout or a cancel stops all of them.

    The deadline is kept by polling the output pipe, not by reading it to the end: a tool that
    prints forever, or hangs with its output open, is stopped on time all the same.
    """

    def __init__(self) -> None:
        self._running: set[subprocess.Popen[bytes]] = set()
        self._stopped = False  # after stop_all this runner starts nothing new

    def run(self, cmd: Sequence[str], *, secrets: Iterable[str] = (), log: Path | None = None,
            env: dict[str, str | None] | None = None, timeout: float | None = None, cwd: Path | None = None,
            keep: Callable[[str], bool] | None = None, inherit: bool = True, input: str | None = None,
            separate_stderr: bool = False) -> Result:
        """Run `cmd`; its output, redacted, goes to `log` and the Result.

        `env` adds to this process's environment; a None value removes that variable. With
        `inherit=False` it adds to `child_environment()` instead: for children that run untrusted steps.
        `keep` drops lines from both (a tool whose debug output we need a few lines of, like
        Trivy's, would otherwise fill memory and disk with millions we do not).
        `timeout` (seconds): then the process group is stopped and the Result says timed_out (124).
        `input` is written to the child's stdin, which is then closed; without it stdin is /dev/null.
        `separate_stderr`: Result.output holds stdout only and Result.stderr holds stderr, for a tool
        whose answer on stdout is parsed (JSON, a commit) while it may warn on stderr. A tool whose
        answer is a secret (a credential helper) is run without `log`: the Result alone holds it.
        An absent program raises FileNotFoundError (an OSError), as it did when the tool was started.
        """
        secrets = list(secrets)
        base = os.environ if inherit else child_environment()
        environment = {k: v for k, v in {**base, **(env or {})}.items() if v is not None}
        chunks: list[str] = []
        errors: list[str] = []
        handle = log.open("w", encoding="utf-8") if log else None

        def taker(into: list[str]) -> Callable[[str], None]:
            def take(line: str) -> None:
                if keep is not None and not keep(line):
                    return
                clean = redact(line, secrets)
                into.append(clean)
                if handle:
                    handle.write(clean)
                    handle.flush()
            return take

        take = taker(chunks)

        process: subprocess.Popen[bytes] | None = None
        try:
            with uninterrupted(), _children_lock:  # started and on record, or not started at all
                if self._stopped or cancel_requested():
                    take("imagebuild: cancelled before it started\n")
                    return Result(EXIT_CANCELLED, "".join(chunks), cancelled=True)
                process = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                                           stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE if separate_stderr else subprocess.STDOUT,
                                           env=environment, cwd=cwd, start_new_session=True)
                _children.add(process)
                self._running.add(process)
            deadline = None if timeout is None else time.monotonic() + timeout
            assert process.stdout is not None
            readers = {process.stdout: take}
            if process.stderr is not None:
                readers[process.stderr] = taker(errors)
            timed_out = not _pump(process, deadline, readers, None if input is None else input.encode())
            if not timed_out:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    process.wait(timeout=left)
                except subprocess.TimeoutExpired:  # closed its output, kept running
                    timed_out = True
            if timed_out:
                _stop([process])
                take(f"\nimagebuild: timed out after {timeout:g} s\n")
                return Result(EXIT_TIMED_OUT, "".join(chunks), timed_out=True, stderr="".join(errors))
            return Result(process.returncode, "".join(chunks), cancelled=self._stopped or cancel_requested(),
                          stderr="".join(errors))
        finally:
            if process is not None:
                with _children_lock:
                    _children.discard(process)
                    self._running.discard(process)
                if process.poll() is None:  # an exception (a cancel) on the way out: leave nothing behind
                    _stop([process])
                for pipe in (process.stdin, process.stdout, process.stderr):
                    if pipe is not None:
                        with contextlib.suppress(OSError):  # stdin: a child gone before reading it all
                            pipe.close()
            if handle:
                handle.close()

    def stop_all(self) -> None:
        """Stop this runner's processes; from now on it starts no new ones."""
        with _children_lock:
            self._stopped = True
            running = list(self._running)
        _stop(running)


class _Lines:
    """One output pipe, decoded and cut into lines for its `take`."""

    def __init__(self, take: Callable[[str], None]) -> None:
        self.take = take
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending = ""

    def feed(self, data: bytes) -> None:
        """Bytes as they came; b"" at the end of the output."""
        self.pending += self.decoder.decode(data, final=not data)
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.take(line + "\n")
        if not data and self.pending:
            self.take(self.pending)
            self.pending = ""


def _pump(process: subprocess.Popen[bytes], deadline: float | None,
          readers: Mapping[IO[bytes], Callable[[str], None]], feed: bytes | None = None) -> bool:
    """Hand each line of each output pipe to its reader until all of them close, writing `feed` to the
    child's stdin meanwhile (then closing it); False when the deadline came first.

    One loop for both directions, so a child that does not read its input, or fills one pipe while
    this process writes to it, cannot hold past the deadline."""
    written = 0
    with selectors.DefaultSelector() as selector:
        for pipe, take in readers.items():
            selector.register(pipe.fileno(), selectors.EVENT_READ, (pipe, _Lines(take)))
        if process.stdin is not None:
            if feed:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin.fileno(), selectors.EVENT_WRITE, None)
            else:
                process.stdin.close()
        reading = len(readers)
        while reading:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return False
            for key, _ in selector.select(wait):
                if key.data is None:  # stdin has room
                    assert process.stdin is not None and feed is not None
                    try:
                        written += os.write(key.fd, feed[written:written + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # BrokenPipeError: the child closed its input; it has what it read
                        written = len(feed)
                    if written >= len(feed):
                        selector.unregister(key.fd)
                        process.stdin.close()
                    continue
                pipe, lines = key.data
                data = os.read(key.fd, 65536)
                lines.feed(data)
                if not data:
                    selector.unregister(key.fd)
                    pipe.close()
                    reading -= 1
        return True


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each process group, then SIGKILL to the groups still there after the grace period."""
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        # The leader may be gone while its group is not (a grandchild that ignored SIGTERM).
        _signal_group(process, signal.SIGKILL)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
