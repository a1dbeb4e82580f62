"""The Paddle / CUDA / cuDNN / Python / driver support table (data in data/support.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from imagebuild.core.source import parse_document

DEFAULT_PLATFORM = "linux/amd64"  # a release without a `platforms` entry, and a matrix without one
PLATFORMS = ("linux/amd64", "linux/arm64")  # what imagebuild builds; BuildKit's names


@dataclass(frozen=True)
class CudaPair:
    cuda: str
    cudnn: str

    def __str__(self) -> str:
        return f"{self.cuda}/{self.cudnn}"


@dataclass(frozen=True)
class PaddleSupport:
    version: str
    python: tuple[str, ...]
    cpu: bool
    gpu: tuple[CudaPair, ...]
    # device ("cpu", "gpu") -> the platforms this release ships wheels for
    platforms: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def platforms_for(self, device: str) -> tuple[str, ...]:
        return self.platforms.get(device, (DEFAULT_PLATFORM,))


@dataclass(frozen=True)
class SupportTable:
    paddle: dict[str, PaddleSupport]
    driver_minimum: dict[str, str]

    def paddle_versions(self) -> list[str]:
        return sorted(self.paddle, key=version_key)

    def minimum_driver(self, cuda: str) -> str | None:
        """Most specific entry wins: '10.2' before '10'."""
        if cuda in self.driver_minimum:
            return self.driver_minimum[cuda]
        return self.driver_minimum.get(cuda.split(".")[0])

    def problem(self, paddle: str, python: str, cuda: CudaPair | None,
                platform: str = DEFAULT_PLATFORM) -> str | None:
        """Why this combination is outside the table, or None when it is supported."""
        entry = self.paddle.get(paddle)
        if entry is None:
            return (f"paddle '{paddle}' is not in the support table "
                    f"(known: {', '.join(self.paddle_versions())})")
        if python not in entry.python:
            return (f"paddle {paddle} does not support Python {python} "
                    f"(supported: {', '.join(entry.python)})")
        if cuda is None and not entry.cpu:
            return f"paddle {paddle} has no CPU build"
        if cuda is not None and cuda not in entry.gpu:
            pairs = ", ".join(str(p) for p in entry.gpu) or "none"
            return (f"paddle {paddle} does not support CUDA {cuda.cuda} with cuDNN {cuda.cudnn} "
                    f"(supported CUDA/cuDNN: {pairs})")
        device = "cpu" if cuda is None else "gpu"
        shipped = entry.platforms_for(device)
        if platform not in shipped:
            return (f"paddle {paddle} has no {device.upper()} build for {platform} "
                    f"(platforms: {', '.join(shipped)})")
        return None


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


@lru_cache(maxsize=1)
def load_support_table() -> SupportTable:
    text = resources.files("imagebuild").joinpath("data/support.yaml").read_text("utf-8")
    raw = parse_document(text, "imagebuild/data/support.yaml").data  # our own file, read like every other
    paddle = {
        str(version): PaddleSupport(
            version=str(version),
            python=tuple(str(p) for p in entry["python"]),
            cpu=bool(entry.get("cpu", False)),
            gpu=tuple(CudaPair(str(g["cuda"]), str(g["cudnn"])) for g in entry.get("gpu", [])),
            platforms={str(device): tuple(str(p) for p in listed)
                       for device, listed in (entry.get("platforms") or {}).items()},
        )
        for version, entry in raw["paddle"].items()
    }
    drivers = {str(k): str(v) for k, v in raw["driver_minimum"].items()}
    return SupportTable(paddle=paddle, driver_minimum=drivers)
