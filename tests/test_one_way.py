"""One way to say each thing: one runner starts processes, one engine retries requests.

Read from the source itself (every module of imagebuild/ parsed with ast), so a new module that
starts a process of its own, or grows a retry loop of its own, fails here, not in review. Each
rule's checker is also run on a snippet that breaks it, so a rule cannot quietly stop seeing.

The second half drives what moved onto core.runner for real: a credential helper, nvidia-smi and
mmdebstrap stand-ins on PATH, the real git and dpkg.
"""
from __future__ import annotations

import ast
import datetime as dt
import json
import os
import re
import signal
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from imagebuild.build.baseimage import AptSource, BaseImageError, dpkg_architecture, mmdebstrap
from imagebuild.build.scheduler import git_revision
from imagebuild.checks.smoke_run import host_has_gpu
from imagebuild.oci import auth
from imagebuild.oci.auth import CredentialError, Credentials, DockerConfig, credentials_for

from .conftest import program_on_path
from .test_runner import gone_within, sigterm_once_running

PACKAGE = Path(__file__).resolve().parents[1] / "imagebuild"
RUNNER = "core/runner.py"
RETRY = "oci/retry.py"


def modules() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
            for path in sorted(PACKAGE.rglob("*.py"))]


# --- one runner --------------------------------------------------------------------------------------

# What starts a process, besides subprocess: os's process functions and asyncio's.
OS_PROCESS = re.compile(r"^(system|popen|fork|forkpty|spawn\w*|exec\w*|posix_spawn\w*)$")
ASYNCIO_PROCESS = re.compile(r"^create_subprocess_\w+$")
PROCESS_MODULES = frozenset({"subprocess", "pty"})


def process_starts(tree: ast.Module) -> list[str]:
    """Every way `tree` could start a process: line and what it says."""
    aliases = {"os": "os", "asyncio": "asyncio"}  # local name -> module, for `import os as o`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROCESS_MODULES:
                    found.append(f"{node.lineno}: import {alias.name}")
                if alias.name in ("os", "asyncio"):
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            top = node.module.split(".")[0]
            for alias in node.names:
                if (top in PROCESS_MODULES or (top == "os" and OS_PROCESS.match(alias.name))
                        or (top == "asyncio" and ASYNCIO_PROCESS.match(alias.name))):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if (module == "os" and OS_PROCESS.match(node.attr)) or (module == "asyncio" and ASYNCIO_PROCESS.match(node.attr)):
                found.append(f"{node.lineno}: {module}.{node.attr}")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in ("__import__", "import_module") and str(node.args[0].value).split(".")[0] in PROCESS_MODULES:
                found.append(f"{node.lineno}: {name}({node.args[0].value!r})")
    return found


def test_only_the_runner_starts_processes() -> None:
    elsewhere = [f"imagebuild/{name}:{line}" for name, tree in modules() if name != RUNNER
                 for line in process_starts(tree)]
    assert elsewhere == [], "start processes through imagebuild.core.runner.Runner (redaction, cancellation)"


def test_the_runner_is_where_processes_start() -> None:
    runner = dict(modules())[RUNNER]
    assert any("import subprocess" in line for line in process_starts(runner))


@pytest.mark.parametrize("snippet", [
    "import subprocess",
    "import subprocess as sp",
    "from subprocess import run",
    "import os\nos.system('ls')",
    "import os as o\no.popen('ls')",
    "from os import execvp",
    "import os\nos.posix_spawnp('ls', ['ls'], {})",
    "import asyncio\nasyncio.create_subprocess_exec('ls')",
    "from asyncio import create_subprocess_shell",
    "import pty",
    "import importlib\nimportlib.import_module('subprocess')",
    "__import__('subprocess')",
])
def test_the_process_rule_sees_every_way_to_start_one(snippet: str) -> None:
    assert process_starts(ast.parse(snippet))


def test_the_process_rule_lets_the_rest_of_os_and_asyncio_be() -> None:
    assert process_starts(ast.parse("import os, asyncio\nos.environ.get('X')\nos.kill(1, 0)\n"
                                    "asyncio.get_event_loop()\nos.path.join('a', 'b')")) == []


# --- one retry engine --------------------------------------------------------------------------------

# Words of a function or class name that say it waits or retries: such a helper lives in oci/retry.py.
RETRY_WORDS = frozenset({"retry", "retries", "retrying", "backoff", "delay", "delays"})
# time.sleep (or asyncio.sleep) may be *named* only here, and only as a default: these waits are injected
# (RetryingTransport(sleep=...), rollout's Timing.sleep), so tests skip them and nothing sleeps on its own.
SLEEP_AS_DEFAULT = frozenset({RETRY, "rollout/reconciler.py"})
# ... and *called* only here: `imagebuild rollout status --watch` redraws every 2 s (a display, not a retry).
SLEEP_CALLED = frozenset({"cli/rollout_command.py"})


def words(name: str) -> set[str]:
    """`retry_delay` -> {retry, delay}; `RetryingTransport` -> {retrying, transport}; `SecretRef` -> {secret, ref}."""
    return {word.lower() for part in name.split("_") for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", part)}


def retry_helpers(tree: ast.Module) -> list[str]:
    return [f"{node.lineno}: {node.name}" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and words(node.name) & RETRY_WORDS]


def retry_after_reads(tree: ast.Module) -> list[str]:
    """The Retry-After header named as a string: the one place that reads it is oci/retry.py."""
    return [f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip().lower() == "retry-after"]


def sleeps(tree: ast.Module) -> tuple[list[str], list[str]]:
    """(sleeps named as a default value, sleeps used any other way: called, passed, assigned)."""
    defaults: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defaults.update(id(value) for value in [*node.args.defaults, *node.args.kw_defaults] if value is not None)
        elif isinstance(node, ast.ClassDef):
            defaults.update(id(item.value) for item in node.body if isinstance(item, ast.AnnAssign) and item.value)
    as_default, other = [], []
    sleep_names: set[str] = set()  # what `from time import sleep [as ...]` binds
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
            for alias in node.names:
                if alias.name == "sleep":
                    other.append(f"{node.lineno}: from {node.module} import sleep")
                    sleep_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        named = ((isinstance(node, ast.Attribute) and node.attr == "sleep" and isinstance(node.value, ast.Name)
                  and node.value.id in ("time", "asyncio"))
                 or (isinstance(node, ast.Name) and node.id in sleep_names))
        if named:
            (as_default if id(node) in defaults else other).append(f"{node.lineno}: {ast.unparse(node)}")
    return as_default, other


def test_one_retry_engine_no_retry_or_backoff_helper_outside_oci_retry() -> None:
    elsewhere = [f"imagebuild/{name}:{line}" for name, tree in modules() if name != RETRY
                 for line in retry_helpers(tree) + retry_after_reads(tree)]
    assert elsewhere == [], "retry through imagebuild.oci.retry (RetryPolicy, RetryingTransport)"


def test_nothing_sleeps_but_the_injected_waits_and_the_watch_loop() -> None:
    wrong = []
    for name, tree in modules():
        as_default, other = sleeps(tree)
        if as_default and name not in SLEEP_AS_DEFAULT:
            wrong += [f"imagebuild/{name}:{line} (a default sleep outside {sorted(SLEEP_AS_DEFAULT)})" for line in as_default]
        if other and name not in SLEEP_CALLED:
            wrong += [f"imagebuild/{name}:{line}" for line in other]
    assert wrong == [], "wait through an injected sleep (oci.retry's transport, rollout's Timing), not time.sleep"
    named = {name for name, tree in modules() if any(sleeps(tree))}
    assert named == SLEEP_AS_DEFAULT | SLEEP_CALLED, "the rule's lists name a module that no longer sleeps"


def test_the_retry_rules_see_a_helper_a_header_and_a_sleep() -> None:
    assert retry_helpers(ast.parse("def retry_delay(n): pass\nclass Backoff: pass\ndef _with_retries(): pass"
                                   "\ndef sleep_then(): pass")) == ["1: retry_delay", "2: Backoff", "3: _with_retries"]
    assert retry_helpers(ast.parse("class SecretRef: pass\ndef wait_stopped(): pass\nRETRIES = 3")) == []
    assert retry_after_reads(ast.parse("response.headers.get('Retry-After')")) == ["1: 'Retry-After'"]
    as_default, other = sleeps(ast.parse(textwrap.dedent("""
        import time
        from time import sleep as nap
        class Timing:
            sleep: object = time.sleep
        def run(sleep=time.sleep, *, also=time.sleep):
            time.sleep(1)
            nap(2)
            pause = time.sleep
    """)))
    assert len(as_default) == 3 and len(other) == 4, (as_default, other)


# --- credential helpers, through the runner -----------------------------------------------------------

def helper(tmp_path: Path, name: str, script: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A credential helper program on PATH speaking docker's protocol (stdin: server URL)."""
    return program_on_path(tmp_path, f"docker-credential-{name}", script, monkeypatch)


def config(tmp_path: Path, helpers: dict[str, str]) -> DockerConfig:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"credHelpers": helpers}))
    return DockerConfig.load(path)


def test_a_helper_gets_the_server_on_stdin_and_its_warnings_on_stderr_do_not_spoil_its_answer(tmp_path, monkeypatch):
    asked = tmp_path / "asked"
    helper(tmp_path, "chatty", f'read url; echo "$url" > {asked}; echo "warning: keychain is slow" >&2; '
                               'echo \'{"Username":"robot$ci","Secret":"s3cret-value"}\'', monkeypatch)
    assert credentials_for("harbor.example.com:8443", config(tmp_path, {"harbor.example.com:8443": "chatty"})) == \
        Credentials("robot$ci", "s3cret-value")
    assert asked.read_text() == "harbor.example.com:8443\n"


def test_a_helper_that_says_not_found_on_stderr_means_no_credentials(tmp_path, monkeypatch):
    helper(tmp_path, "none", 'echo "credentials not found in native keychain" >&2; exit 1', monkeypatch)
    assert credentials_for("r.example.com", config(tmp_path, {"r.example.com": "none"})).empty


def test_a_helper_that_hangs_is_stopped_and_said_to_be_slow(tmp_path, monkeypatch):
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    helper(tmp_path, "stuck", f"sleep {marker}\n", monkeypatch)
    monkeypatch.setattr(auth, "HELPER_TIMEOUT_S", 1.0)  # the real 60 s, shortened
    started = time.monotonic()
    with pytest.raises(CredentialError, match="docker-credential-stuck did not answer in time"):
        credentials_for("r.example.com", config(tmp_path, {"r.example.com": "stuck"}))
    assert time.monotonic() - started < 15
    assert gone_within(f"sleep {marker}", 5)


def test_sigterm_stops_a_credential_helper_and_its_secret_reaches_no_output(tmp_path, monkeypatch):
    marker = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    canary = f"canary-{uuid.uuid4().hex}"
    helper(tmp_path, "slow", f'echo \'{{"Username":"u","Secret":"{canary}"}}\'; sleep {marker}\n', monkeypatch)
    (tmp_path / "config.json").write_text('{"credsStore": "slow"}')
    program = textwrap.dedent("""
        import sys
        from pathlib import Path
        from imagebuild.core.runner import Cancelled, install_signal_handlers
        from imagebuild.oci.auth import DockerConfig, credentials_for
        install_signal_handlers()
        try:
            credentials_for("r.example.com", DockerConfig.load(Path(sys.argv[1])))
        except Cancelled as exc:
            print("cancelled", exc.signum, flush=True)
            sys.exit(143)
    """)
    returncode, out = sigterm_once_running(program, [str(tmp_path / "config.json")], f"sleep {marker}")
    assert (returncode, out.split()) == (143, ["cancelled", str(int(signal.SIGTERM))])
    assert gone_within(f"sleep {marker}", 5), "the credential helper outlived the cancel"
    assert canary not in out


# --- git, nvidia-smi, dpkg, mmdebstrap ---------------------------------------------------------------

def _git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          check=True, capture_output=True, text=True, env={**os.environ, **(env or {})}).stdout


def test_git_revision_is_the_last_commit_and_its_time_and_unknown_outside_git(tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "f").write_text("x")
    _git(repo, "add", "f")
    _git(repo, "commit", "-q", "-m", "one", env={"GIT_COMMITTER_DATE": "2024-05-20T00:00:00Z"})
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert git_revision(repo) == (head, "2024-05-20T00:00:00Z")
    outside = tmp_path / "plain"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git says "not a repository" on stderr
    assert git_revision(outside) == ("unknown", "1970-01-01T00:00:00Z")
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1747699200")
    assert git_revision(repo) == (head, dt.datetime.fromtimestamp(1747699200, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))


@pytest.mark.skipif(any(Path("/dev").glob("nvidia[0-9]*")), reason="a GPU host: its device nodes answer first")
def test_a_gpu_is_what_nvidia_smi_lists_on_stdout(tmp_path, monkeypatch):
    program_on_path(tmp_path, "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"\n', monkeypatch)
    assert host_has_gpu()
    program_on_path(tmp_path, "nvidia-smi", 'echo "GPU? NVIDIA-SMI has failed" >&2; exit 9\n', monkeypatch)
    assert not host_has_gpu()
    program_on_path(tmp_path, "nvidia-smi", 'echo "No devices were found"; echo "GPU driver warning" >&2\n', monkeypatch)
    assert not host_has_gpu()


def test_dpkg_architecture_is_what_dpkg_prints():
    expected = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    assert dpkg_architecture() == expected and re.fullmatch(r"[a-z0-9]+", expected)


def test_a_failing_mmdebstrap_leaves_its_log_and_no_partial_rootfs(tmp_path, monkeypatch):
    program_on_path(tmp_path, "mmdebstrap", 'echo "epoch=$SOURCE_DATE_EPOCH"; echo "E: cannot reach the mirror" >&2\n'
                                     'touch "$(dirname "$0")/../rootfs.tar.partial"; exit 25\n', monkeypatch)
    target, log = tmp_path / "rootfs.tar", tmp_path / "mmdebstrap.log"
    source = AptSource("http://deb.example.org/debian", "bookworm", ("main",), "test")
    failed = f"mmdebstrap failed (log: {log}):\nepoch=1747699200\nE: cannot reach the mirror"
    with pytest.raises(BaseImageError, match=f"^{re.escape(failed)}\\Z"):
        mmdebstrap([source], "bookworm", "ca-certificates", 1747699200, target, log)
    assert log.read_text() == "epoch=1747699200\nE: cannot reach the mirror\n"
    assert not target.exists() and not target.with_name("rootfs.tar.partial").exists()
