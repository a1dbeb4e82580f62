"""pytest plugin of the in-image smoke suite: expectations, tiers, and the GPU gate.

Loaded with `-p imagebuild_smoke` (pytest.ini), not from a conftest, so the extra test
folders a matrix adds (mounted elsewhere) get the same fixtures and markers.

Each test runs in a forked process of its own with a time limit (60 s unless
`@pytest.mark.timeout(seconds)` says otherwise): a test stuck in C code, where no Python signal
handler can reach it, is killed and fails with its name, its limit and the Python stacks of the
moment, and the next test runs. The image-level timeout of `imagebuild test` is only a
backstop. Paddle's version, build and GPU count come from one `import paddle` in a child
process per session (the `facts` fixture), so a broken import costs its limit once, not once
per test.

Runs inside the image under test with the image's Python (3.8 or newer), so it imports
nothing from imagebuild and only the standard library besides pytest.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import select
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from _pytest.runner import runtestprotocol
from smoke_lib import Loader, PaddleFacts, paddle_dynload_libraries, paddle_facts

EXPECT_ENV = "IMAGEBUILD_SMOKE_EXPECT"
DEFAULT_EXPECT = "/smoke/expect.json"
SCHEMA = "imagebuild.smoke-expect/v1"  # written by imagebuild/checks/smoke.py
TIERS = ("abi", "gpu")
TIMEOUT_INI = "smoke_test_timeout"
DEFAULT_TIMEOUT_S = 60.0
STACK_DUMP_WAIT_S = 2.0  # for faulthandler to write the stacks before the kill
PADDLE_IMPORT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Expect:
    """What the matrix says this image is; the runner writes it as JSON (see imagebuild/checks/smoke.py)."""

    variant: str
    image: str
    device: str  # cpu or gpu
    paddle: str
    python: str
    cuda: Optional[str]
    cudnn: Optional[str]
    labels_expected: Dict[str, str]
    labels_actual: Dict[str, str]  # the image's labels, read by the runner (not visible inside)
    setuid_allowlist: Tuple[str, ...]
    uid: Optional[int]  # the matrix's user, when known
    gid: Optional[int]
    gpu_requested: bool  # whether the runner asked the engine for GPUs
    extra: Dict[str, Any] = field(default_factory=dict)
    # The platform the image is for and what follows from it (machine, multiarch, elf_machine), and
    # whether it runs under emulation here (time_factor scales every limit); {}: not known.
    platform: Dict[str, Any] = field(default_factory=dict)

    @property
    def time_factor(self) -> float:
        return float(self.platform.get("time_factor") or 1.0)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Expect":
        return cls(
            variant=data["variant"], image=data["image"], device=data["device"],
            paddle=data["paddle"], python=data["python"], cuda=data.get("cuda"),
            cudnn=data.get("cudnn"),
            labels_expected=dict(data["labels"]["expected"]),
            labels_actual=dict(data["labels"]["actual"]),
            setuid_allowlist=tuple(data.get("setuid_allowlist", ())),
            uid=data.get("uid"), gid=data.get("gid"),
            gpu_requested=bool(data.get("gpu_requested")), extra=dict(data.get("extra", {})),
            platform=dict(data.get("platform") or {}),
        )


_EXPECT = pytest.StashKey[Expect]()


def load_expect(path: Path) -> Expect:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(f"smoke expectations {path}: {exc} (set {EXPECT_ENV})") from None
    if data.get("schema") != SCHEMA:
        raise pytest.UsageError(f"smoke expectations {path}: schema {data.get('schema')!r}, expected {SCHEMA}")
    try:
        return Expect.from_json(data)
    except (KeyError, TypeError) as exc:
        raise pytest.UsageError(f"smoke expectations {path}: missing or malformed {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_EXPECT] = load_expect(Path(os.environ.get(EXPECT_ENV, DEFAULT_EXPECT)))


@pytest.hookimpl(tryfirst=True)  # before -m deselects, so an unmarked extra test counts as abi
def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    expect = config.stash[_EXPECT]
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.abi)
        elif item.get_closest_marker("gpu") is not None and expect.platform.get("emulated"):
            # A mark, not a fixture: skipped before any fixture imports Paddle (seconds under emulation).
            # qemu-user passes no GPU through, and its timing means nothing.
            item.add_marker(pytest.mark.skip(reason=f"{expect.platform.get('platform')} runs under emulation on "
                                                    "this host: the gpu tier runs only natively"))


def pytest_report_header(config: pytest.Config) -> str:
    e = config.stash[_EXPECT]
    return (f"imagebuild smoke: {e.variant} ({e.device}; paddle {e.paddle}, python {e.python}, "
            f"cuda {e.cuda or 'none'}, cudnn {e.cudnn or 'none'}; gpus requested: {e.gpu_requested})")


@dataclass(frozen=True)
class LoaderCase:
    """One of Paddle's library loaders to call, or why there is none (one test each)."""

    id: str
    library: Optional[str] = None  # Paddle's shared library that holds the loader
    loader: Optional[Loader] = None
    paddle_dir: Optional[str] = None
    problem: Optional[str] = None  # a GPU image whose Paddle has no loaders to find
    cpu_variant: bool = False


_LOADERS = pytest.StashKey[List[LoaderCase]]()


def loader_cases(config: pytest.Config) -> List[LoaderCase]:
    """The loaders in the installed Paddle, read from its libraries without importing it."""
    if _LOADERS in config.stash:
        return config.stash[_LOADERS]
    expect = config.stash[_EXPECT]
    if expect.device != "gpu":
        cases = [LoaderCase("cpu", cpu_variant=True)]
    else:
        spec = importlib.util.find_spec("paddle")  # finds the package; runs none of it
        folders = list(spec.submodule_search_locations or ()) if spec else []
        if not folders:
            cases = [LoaderCase("paddle", problem="Paddle is not installed for this image's `python`")]
        else:
            library, loaders = paddle_dynload_libraries(folders[0])
            cases = [LoaderCase(loader.name.lower(), library, loader, folders[0]) for loader in loaders] or [
                LoaderCase("paddle", problem=f"no phi::dynload loader in any library under {folders[0]}/libs: "
                                             "cannot tell which libraries this Paddle opens")]
    config.stash[_LOADERS] = cases
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # One test per loader, so the JUnit report names the library that is missing.
    if "paddle_loader" in metafunc.fixturenames:
        cases = loader_cases(metafunc.config)
        metafunc.parametrize("paddle_loader", cases, ids=[case.id for case in cases])


# --- one process and one time limit per test --------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(TIMEOUT_INI, "seconds a smoke test may take, setup to teardown, before it is killed "
                               "(@pytest.mark.timeout(seconds) sets one test's own)", default=str(DEFAULT_TIMEOUT_S))


def time_limit(item: pytest.Item) -> float:
    """The test's own limit, scaled for an image that runs under emulation (everything takes longer there)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        limit = float(marker.args[0])
    else:
        limit = float(item.config.getini(TIMEOUT_INI))
    return limit * item.config.stash[_EXPECT].time_factor


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Optional[bool]:
    if not hasattr(os, "fork"):
        return None  # pytest runs it in this process, without a time limit
    if "facts" in item.fixturenames or item.get_closest_marker("gpu") is not None:
        session_paddle_facts(item.config)  # here, once: every test's process inherits the answer
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in run_forked(item, time_limit(item)):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def run_forked(item: pytest.Item, timeout_s: float) -> List[pytest.TestReport]:
    """Run one test (setup, call, teardown) in a child process; its reports, or a failure that says why.

    The child gets a process group of its own, so a kill also ends what the test started.
    """
    config = item.config
    with tempfile.TemporaryFile() as stacks:
        read_end, write_end = os.pipe()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(item, read_end, write_end, stacks)
        os.close(write_end)
        data, finished = _read_until(read_end, started + timeout_s)
        os.close(read_end)
        if not finished:
            os.kill(pid, signal.SIGUSR1)  # faulthandler: the Python stacks of every thread
            time.sleep(STACK_DUMP_WAIT_S)
            _kill_group(pid)
        status = os.waitpid(pid, 0)[1]
        duration = time.monotonic() - started
        stacks.seek(0)
        dump = stacks.read().decode(errors="replace").strip()
    if not finished:
        return _failed(item, f"timed out: still running after {timeout_s:g} s, so it was killed "
                             f"(this test's limit; the whole suite goes on)\n\n"
                             f"Python stacks at the time:\n{dump or '(none written)'}", duration)
    _kill_group(pid)  # anything the test left running
    try:
        return [config.hook.pytest_report_from_serializable(config=config, data=_tuples(d)) for d in json.loads(data)]
    except ValueError:
        out, err = _left_behind(config)
        last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()), "")
        return _failed(item, f"the test's process ended without a result ({_describe(status)})"
                             + (f"; its last words: {last}" if last else ""), duration, out, err)


def _tuples(data: Dict[str, Any]) -> Dict[str, Any]:
    # A skip's reason travels as a (file, line, message) tuple; JSON turns it into a list.
    if isinstance(data.get("longrepr"), list):
        data["longrepr"] = tuple(data["longrepr"])
    return data


def _child(item: pytest.Item, read_end: int, write_end: int, stacks) -> None:
    status = 1
    try:
        os.setpgid(0, 0)
        os.close(read_end)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        config = item.config
        reports = runtestprotocol(item, log=False, nextitem=None)
        data = json.dumps([config.hook.pytest_report_to_serializable(config=config, report=r) for r in reports])
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data.encode())
        status = 0
    except BaseException:  # noqa: BLE001  (whatever happens, the child must not return into pytest)
        traceback.print_exc()
    finally:
        os._exit(status)


def _read_until(fd: int, deadline: float) -> Tuple[bytes, bool]:
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), False
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks), True
            chunks.append(chunk)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # already gone
        pass


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"killed by signal {number} ({signal.Signals(number).name})"
        except ValueError:
            return f"killed by signal {number}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _left_behind(config: pytest.Config) -> Tuple[str, str]:
    """What a test's process wrote before it died: pytest's capture file is shared with the fork."""
    capman = config.pluginmanager.getplugin("capturemanager")
    try:
        out, err = capman.read_global_capture()
    except (AttributeError, AssertionError, OSError, ValueError):  # capturing off (-s)
        return "", ""
    return out, err


def _failed(item: pytest.Item, message: str, duration: float, out: str = "", err: str = "") -> List[pytest.TestReport]:
    """Reports for a test whose process gave none: it failed, with `message` as the reason."""
    common: Dict[str, Any] = {"nodeid": item.nodeid, "location": item.location,
                              "keywords": {k: 1 for k in item.keywords}}
    sections = [(f"Captured {name} call", text) for name, text in (("stdout", out), ("stderr", err)) if text]
    return [pytest.TestReport(outcome="passed", longrepr=None, when="setup", **common),
            pytest.TestReport(outcome="failed", longrepr=message, when="call", duration=duration,
                              sections=sections, **common),
            pytest.TestReport(outcome="passed", longrepr=None, when="teardown", **common)]


@pytest.fixture(scope="session")
def expect(pytestconfig: pytest.Config) -> Expect:
    return pytestconfig.stash[_EXPECT]


_FACTS = pytest.StashKey[PaddleFacts]()


def session_paddle_facts(config: pytest.Config) -> PaddleFacts:
    """What Paddle says about itself, asked once per session in a process of its own."""
    if _FACTS not in config.stash:
        config.stash[_FACTS] = paddle_facts(PADDLE_IMPORT_TIMEOUT_S * config.stash[_EXPECT].time_factor)
    return config.stash[_FACTS]


@pytest.fixture(scope="session")
def facts(pytestconfig: pytest.Config) -> PaddleFacts:
    """Paddle's version, build and GPUs, without importing Paddle into the test's process."""
    found = session_paddle_facts(pytestconfig)
    if found.error:
        pytest.fail(f"`import paddle` fails in this image: {found.error}")
    return found


@pytest.fixture(scope="session")
def paddle(facts: PaddleFacts):
    """Paddle itself, imported in the test's process (where the import has already worked once)."""
    import paddle as module

    return module


@pytest.fixture(scope="session")
def gpu_count(facts: PaddleFacts, expect: Expect) -> int:
    """How many GPUs Paddle sees; skips the test (with the reason) when it sees none."""
    if not facts.compiled_with_cuda:
        pytest.skip(f"CPU variant ({expect.variant}): the gpu tier needs a CUDA build of Paddle")
    if facts.gpus == 0:
        why = "" if expect.gpu_requested else " (the runner requested none: no GPU on this host)"
        pytest.skip(f"no GPU visible: paddle.device.cuda.device_count() == 0{why}")
    return facts.gpus


@pytest.fixture(autouse=True)
def _gpu_tier(request: pytest.FixtureRequest) -> None:
    # Every gpu-marked test, extra ones included, is gated the same way.
    if request.node.get_closest_marker("gpu") is not None:
        request.getfixturevalue("gpu_count")
