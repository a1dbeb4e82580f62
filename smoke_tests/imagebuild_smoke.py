"""pytest plugin of the in-image smoke suite: expectations, tiers, and the GPU gate.

Loaded with `-p imagebuild_smoke` (pytest.ini), not from a conftest, so the extra test
folders a matrix adds (mounted elsewhere) get the same fixtures and markers.

Runs inside the image under test with the image's Python (3.8 or newer), so it imports
nothing from imagebuild and only the standard library besides pytest.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

EXPECT_ENV = "IMAGEBUILD_SMOKE_EXPECT"
DEFAULT_EXPECT = "/smoke/expect.json"
SCHEMA = "imagebuild.smoke-expect/v1"  # written by imagebuild/smoke.py
TIERS = ("abi", "gpu")


@dataclass(frozen=True)
class Expect:
    """What the matrix says this image is; the runner writes it as JSON (see imagebuild/smoke.py)."""

    variant: str
    image: str
    device: str  # cpu or gpu
    paddle: str
    python: str
    cuda: Optional[str]
    cudnn: Optional[str]
    libraries: Tuple[str, ...]  # sonames Paddle opens at run time on a GPU host
    labels_expected: Dict[str, str]
    labels_actual: Dict[str, str]  # the image's labels, read by the runner (not visible inside)
    setuid_allowlist: Tuple[str, ...]
    uid: Optional[int]  # the matrix's user, when known
    gid: Optional[int]
    gpu_requested: bool  # whether the runner asked the engine for GPUs
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Expect":
        return cls(
            variant=data["variant"], image=data["image"], device=data["device"],
            paddle=data["paddle"], python=data["python"], cuda=data.get("cuda"),
            cudnn=data.get("cudnn"), libraries=tuple(data.get("libraries", ())),
            labels_expected=dict(data["labels"]["expected"]),
            labels_actual=dict(data["labels"]["actual"]),
            setuid_allowlist=tuple(data.get("setuid_allowlist", ())),
            uid=data.get("uid"), gid=data.get("gid"),
            gpu_requested=bool(data.get("gpu_requested")), extra=dict(data.get("extra", {})),
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
def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.abi)


def pytest_report_header(config: pytest.Config) -> str:
    e = config.stash[_EXPECT]
    return (f"imagebuild smoke: {e.variant} ({e.device}; paddle {e.paddle}, python {e.python}, "
            f"cuda {e.cuda or 'none'}, cudnn {e.cudnn or 'none'}; gpus requested: {e.gpu_requested})")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # One test per library, so the JUnit report names the one that is missing.
    if "library" in metafunc.fixturenames:
        libraries = list(metafunc.config.stash[_EXPECT].libraries)
        metafunc.parametrize("library", libraries or [None], ids=libraries or ["none"])


@pytest.fixture(scope="session")
def expect(pytestconfig: pytest.Config) -> Expect:
    return pytestconfig.stash[_EXPECT]


@pytest.fixture(scope="session")
def paddle():
    """Paddle, imported once per session: the import alone takes seconds in a GPU image."""
    import paddle as module

    return module


@pytest.fixture(scope="session")
def gpu_count(paddle, expect: Expect) -> int:
    """How many GPUs Paddle sees; skips the test (with the reason) when it sees none."""
    if not paddle.is_compiled_with_cuda():
        pytest.skip(f"CPU variant ({expect.variant}): the gpu tier needs a CUDA build of Paddle")
    count = paddle.device.cuda.device_count()
    if count == 0:
        why = "" if expect.gpu_requested else " (the runner requested none: no GPU on this host)"
        pytest.skip(f"no GPU visible: paddle.device.cuda.device_count() == 0{why}")
    return count


@pytest.fixture(autouse=True)
def _gpu_tier(request: pytest.FixtureRequest) -> None:
    # Every gpu-marked test, extra ones included, is gated the same way.
    if request.node.get_closest_marker("gpu") is not None:
        request.getfixturevalue("gpu_count")
