"""Benchmark: copy one image by digest with imagebuild's OCI client, crane and skopeo, side by side.

    python bench/bench_oci_copy.py                        # 200 MiB layer + 1 MiB layer, 3 runs
    python bench/bench_oci_copy.py --layer-mib 64 --runs 5 --format json

The image (one large random layer, one small one) is pushed once by crane to the staging
registry (127.0.0.1:5000). Each run copies it, by digest, into a fresh repository:

- cross-registry: staging -> the region registry 127.0.0.1:5001 (every blob moves);
- same registry: staging -> staging (blobs are mounted where the tool can);
- again: the cross-registry copy repeated into a repository that holds it (nothing moves).

imagebuild runs in this process (no start-up); crane and skopeo are one process per copy, as
a script calling them pays. Medians, and each tool's time over imagebuild's. Signatures are
not copied by any of them here (bench_promote covers that with cosign copy).
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
from imagebuild.oci_copy import copy_image  # noqa: E402
from imagebuild.registry import Registry  # noqa: E402

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
    parser.add_argument("--layer-mib", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args()

    repository, digest = seed(args.layer_mib)
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.runs):
        for tool, copy in COPIERS.items():  # interleaved, so load drifts hit every tool alike
            target = f"imagebuild-bench/copy-{tool}-{uuid.uuid4().hex[:8]}"
            cases = times.setdefault(tool, {})
            cases.setdefault("cross-registry", []).append(
                timed(lambda: copy(STAGING, repository, digest, REGION, target)))  # noqa: B023
            cases.setdefault("again", []).append(
                timed(lambda: copy(STAGING, repository, digest, REGION, target)))  # noqa: B023
            cases.setdefault("same registry", []).append(
                timed(lambda: copy(STAGING, repository, digest, STAGING, target)))  # noqa: B023
    medians = {tool: {case: statistics.median(values) for case, values in cases.items()}
               for tool, cases in times.items()}
    if args.format == "json":
        print(json.dumps({"layer_mib": args.layer_mib, "runs": args.runs, "median_s": medians}, indent=2))
        return 0
    print(f"image: {args.layer_mib} MiB + 1 MiB layers, {args.runs} runs, median seconds (tool / imagebuild)")
    for case in ("cross-registry", "same registry", "again"):
        ours = medians["imagebuild"][case]
        row = "  ".join(f"{tool} {m[case]:.3f}s ({m[case] / ours:.2f}x)" for tool, m in medians.items())
        print(f"{case:15} {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
