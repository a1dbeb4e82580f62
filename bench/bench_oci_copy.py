"""Benchmark: copy one image by digest with imagebuild's OCI client, crane and skopeo, side by side.

    python bench/bench_oci_copy.py                        # 100 MiB layer + 1 MiB layer, 3 runs
    python bench/bench_oci_copy.py --layer-mib 200 --runs 5 --format json

Each run and tool gets an image of its own (one large random layer, one small one), pushed
by crane to the staging registry (127.0.0.1:5000), then copied by digest:

- new blobs: staging -> a fresh repository of the region registry 127.0.0.1:5001 (every blob
  moves);
- held elsewhere: the same image into a second fresh repository there (imagebuild and skopeo
  remember where they put blobs and mount them; crane moves them again);
- again: into the first repository once more (nothing moves);
- same registry: staging -> a fresh repository of staging (mounts).

imagebuild runs in this process (no start-up), its blob-location cache in a temporary
directory; crane and skopeo are one process per copy, as a script calling them pays.
Medians, and each tool's time over imagebuild's. No signatures (bench_promote adds cosign copy).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from imagebuild.oci.client import Registry  # noqa: E402
from imagebuild.oci.copy import copy_image  # noqa: E402

STAGING, REGION = "127.0.0.1:5000", "127.0.0.1:5001"
TOOLS = Path("/opt/imagebuild-tools/bin")


def _tool(name: str) -> str:
    found = TOOLS / name
    return str(found) if found.exists() else name


def seed(layer_mib: int) -> tuple[str, str]:
    """(repository, digest) of a fresh two-layer image in staging."""
    repository = f"imagebuild-bench/copy-{uuid.uuid4().hex[:8]}"
    ref = f"{STAGING}/{repository}:src"
    with tempfile.TemporaryDirectory() as scratch:
        base = None
        for name, size in (("large", layer_mib * 1024 * 1024), ("small", 1024 * 1024)):
            payload = Path(scratch) / name
            payload.write_bytes(os.urandom(size))
            tar = Path(scratch) / f"{name}.tar"
            with tarfile.open(tar, "w") as archive:
                archive.add(payload, arcname=name)
            argv = [_tool("crane"), "append", "--insecure", "-f", str(tar), "-t", ref]
            subprocess.run([*argv, *(["-b", base] if base else [])], check=True, capture_output=True)
            base = ref
    digest = subprocess.run([_tool("crane"), "digest", "--insecure", ref], check=True, capture_output=True,
                            text=True).stdout.strip()
    return repository, digest


def imagebuild_copy(source_registry: str, repository: str, digest: str, target_registry: str, target: str) -> None:
    with Registry(source_registry) as source:
        if source_registry == target_registry:
            copy_image(source, repository, digest, source, target, tags=["copy"])
            return
        with Registry(target_registry) as destination:
            copy_image(source, repository, digest, destination, target, tags=["copy"])


def crane_copy(source_registry: str, repository: str, digest: str, target_registry: str, target: str) -> None:
    subprocess.run([_tool("crane"), "copy", "--insecure", f"{source_registry}/{repository}@{digest}",
                    f"{target_registry}/{target}:copy"], check=True, capture_output=True)


def skopeo_copy(source_registry: str, repository: str, digest: str, target_registry: str, target: str) -> None:
    subprocess.run(["skopeo", "copy", "--src-tls-verify=false", "--dest-tls-verify=false",
                    f"docker://{source_registry}/{repository}@{digest}", f"docker://{target_registry}/{target}:copy"],
                   check=True, capture_output=True)


COPIERS: dict[str, Callable[[str, str, str, str, str], None]] = {
    "imagebuild": imagebuild_copy, "crane": crane_copy, "skopeo": skopeo_copy}


def timed(copy: Callable[[], None]) -> float:
    started = time.perf_counter()
    copy()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer-mib", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args()

    os.environ["IMAGEBUILD_CACHE_DIR"] = tempfile.mkdtemp(prefix="imagebuild-bench-cache-")
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.runs):
        for tool, copy in COPIERS.items():  # interleaved, so load drifts hit every tool alike
            repository, digest = seed(args.layer_mib)
            first, second, third = (f"imagebuild-bench/copy-{tool}-{uuid.uuid4().hex[:8]}" for _ in range(3))
            cases = times.setdefault(tool, {})
            for case, target_registry, target in (("new blobs", REGION, first), ("held elsewhere", REGION, second),
                                                  ("again", REGION, first), ("same registry", STAGING, third)):
                cases.setdefault(case, []).append(
                    timed(lambda: copy(STAGING, repository, digest, target_registry, target)))  # noqa: B023
    medians = {tool: {case: statistics.median(values) for case, values in cases.items()}
               for tool, cases in times.items()}
    if args.format == "json":
        print(json.dumps({"layer_mib": args.layer_mib, "runs": args.runs, "median_s": medians}, indent=2))
        return 0
    print(f"image: {args.layer_mib} MiB + 1 MiB layers, {args.runs} runs, median seconds (tool / imagebuild)")
    for case in ("new blobs", "held elsewhere", "again", "same registry"):
        ours = medians["imagebuild"][case]
        row = "  ".join(f"{tool} {m[case]:.3f}s ({m[case] / ours:.2f}x)" for tool, m in medians.items())
        print(f"{case:15} {row}")
    print("(new blobs, held elsewhere, again: into the region registry; same registry: within staging)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
