"""Benchmark: `imagebuild promote` against skopeo copy and crane copy (+ cosign copy for the signatures).

    python bench/bench_promote.py --workdir W                  # every signed variant of W's build report
    python bench/bench_promote.py --image 127.0.0.1:5000/r/paddle@sha256:... --runs 3 --format json

Each run promotes each signed image, by digest, into a fresh repository:

- same registry: staging (127.0.0.1:5000) -> staging;
- cross-registry: staging -> the region registry 127.0.0.1:5001.

imagebuild promote (in this process, as `imagebuild push` runs one per image; and as a process,
`imagebuild-cli`) does everything in one step: verify the source's signature, copy the image
with its signature and attestations, audit them in the target, tag. skopeo and crane copy the
image only, so their time is theirs plus `cosign copy --only=sig,att` of the signatures and
attestations (cosign copy never re-copies the image then). Each tool runs as a process, as a
release script calls it, interleaved per run so load drifts hit every tool alike. Medians,
and each peer's time over imagebuild's (above 1: imagebuild is faster).

On two cores the registry's own CPU caps these ratios, so `--count` also promotes every image
once more per tool and case through a counting reverse proxy in front of each registry
(bench/counting_proxy.py: every request and body byte, by method and kind), untimed, and
prints the requests and bytes each tool needs per image. Across registries the target is then
an empty throw-away registry per tool, so every tool copies every blob.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from counting_proxy import CountingProxy  # noqa: E402

STAGING, REGION = "127.0.0.1:5000", "127.0.0.1:5001"
TOOLS = Path("/opt/imagebuild-tools/bin")
KEY = Path("/var/lib/imagebuild/keys/cosign.pub")
AUDIT_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "bench-promote"  # promote's workdir: no tag is forced here
sys.path.insert(0, str(REPO))


def _tool(name: str) -> str:
    found = TOOLS / name
    return str(found) if found.exists() else name


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} ... failed ({done.returncode}): {done.stderr.strip()[-800:]}")


def signed_images(workdir: Path) -> list[str]:
    report = json.loads((workdir / "build-report.json").read_text())
    return [v["image"] for v in report["variants"] if (v.get("stages") or {}).get("sign", {}).get("status") == "passed"]


_PROMOTER: list[Any] = []  # one per run of all the images, as one `imagebuild push` keeps one for its variants


def fresh_promoter() -> None:
    """A new run starts with a new Promoter: nothing learnt (connections, checks by content digest)
    carries over from the run before, as nothing carries over between two `imagebuild push`."""
    while _PROMOTER:
        _PROMOTER.pop().close()


def imagebuild_promote(source: str, target: str, tag: str) -> None:
    """In this process (no interpreter start-up): what `imagebuild push` pays per image, with one
    Promoter (its registry connections kept) for every image, as push has."""
    from imagebuild.config import trust
    from imagebuild.release import push_plan
    from imagebuild.release.push import Promoter

    if not _PROMOTER:
        _PROMOTER.append(Promoter(trust.trust_config_for_keys([KEY]), push_plan.Force(), AUDIT_DIR / "audit.jsonl"))
    outcome = _PROMOTER[0].promote(source, target, [tag])
    if outcome.action not in ("pushed", "unchanged"):
        raise SystemExit(f"imagebuild promote {source}: {outcome.action}: {outcome.reason}")


def imagebuild_cli(source: str, target: str, tag: str) -> None:
    """`imagebuild promote` as a process: Python's start-up and the CLI's imports included."""
    _run([sys.executable, "-m", "imagebuild", "promote", source, target, "--tag", tag, "--key", str(KEY),
          "--workdir", str(AUDIT_DIR)])


def cosign_copy_signatures(source: str, target: str) -> None:
    _run([_tool("cosign"), "copy", "--only=sig,att", "--allow-http-registry", "--allow-insecure-registry", "--force",
          source, target])


def skopeo_then_cosign(source: str, target: str, tag: str) -> None:
    _run(["skopeo", "copy", "--src-tls-verify=false", "--dest-tls-verify=false", f"docker://{source}",
          f"docker://{target}:{tag}"])
    cosign_copy_signatures(source, target)


def crane_then_cosign(source: str, target: str, tag: str) -> None:
    _run([_tool("crane"), "copy", "--insecure", source, f"{target}:{tag}"])
    cosign_copy_signatures(source, target)


PROMOTERS: dict[str, Callable[[str, str, str], None]] = {
    "imagebuild": imagebuild_promote, "imagebuild-cli": imagebuild_cli, "skopeo+cosign": skopeo_then_cosign,
    "crane+cosign": crane_then_cosign}
PEERS = ("skopeo+cosign", "crane+cosign")


def timed(step: Callable[[], None]) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def count_requests(images: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each tool, each case, once through counting proxies: tool -> case -> counts for all images."""
    from bench_cold_build import ThrowAwayRegistry  # docker, httpx, yaml: only when counting

    counted: dict[str, dict[str, dict[str, Any]]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-promote-count-"))
    try:
        with CountingProxy(STAGING) as source:
            for tool, promote in PROMOTERS.items():
                if tool == "imagebuild-cli":
                    continue  # the same requests as in-process imagebuild
                # Across registries, an empty one per tool: the region registries already hold the
                # example's blobs under the same repository name, which lets a client mount, not copy.
                empty = ThrowAwayRegistry(scratch, tool.replace("+", "-"))
                try:
                    with CountingProxy(empty.host) as region:
                        for case, target in (("same registry", source), ("cross-registry", region)):
                            counted.setdefault(tool, {})[case] = promote_counted(promote, images, source, target, region)
                finally:
                    empty.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return counted


def promote_counted(promote: Callable[[str, str, str], None], images: list[str], source: CountingProxy,
                    target: CountingProxy, region: CountingProxy) -> dict[str, Any]:
    """Every image promoted from `source` into a fresh project behind `target`; what both proxies saw."""
    fresh_promoter()
    source.reset()
    region.reset()
    project = f"imagebuild-bench/count-{uuid.uuid4().hex[:8]}"
    for index, image in enumerate(images):
        via = image.replace(STAGING, source.host, 1)
        promote(via, f"{target.host}/{project}/{image.split('@')[0].rsplit('/', 1)[-1]}", f"promoted-{index}")
    fresh_promoter()
    total: dict[str, Any] = {"requests": 0, "bytes_sent": 0, "bytes_received": 0, "by_kind": {}}
    for counts in [source.counts()] + ([region.counts()] if target is region else []):
        for key in ("requests", "bytes_sent", "bytes_received"):
            total[key] += counts[key]
        for kind, n in counts["by_kind"].items():
            total["by_kind"][kind] = total["by_kind"].get(kind, 0) + n
    return total


def print_counts(counted: dict[str, dict[str, dict[str, Any]]], images: int) -> None:
    print(f"\nrequests per image ({images} images, each tool once, through a counting proxy)")
    for case in ("same registry", "cross-registry"):
        for tool, cases in counted.items():
            c = cases[case]
            kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(c["by_kind"].items()))
            print(f"{case:15} {tool:14} {c['requests'] / images:6.1f} requests  "
                  f"{(c['bytes_sent'] + c['bytes_received']) / images / 1e6:8.2f} MB  ({kinds})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path(".imagebuild/example"))
    parser.add_argument("--image", action="append", default=[], help="a signed image by digest (repeatable)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--format", choices=["text", "json"], default="text")
    parser.add_argument("--count", action="store_true", help="also count each tool's requests through a proxy")
    args = parser.parse_args()
    images = args.image or signed_images(args.workdir)
    if not images:
        raise SystemExit("no signed image: give --image REF@DIGEST or a --workdir whose report has signed variants")

    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.runs):
        for tool, promote in PROMOTERS.items():
            for case, registry in (("same registry", STAGING), ("cross-registry", REGION)):
                fresh_promoter()
                project = f"imagebuild-bench/promote-{tool.split('+')[0]}-{uuid.uuid4().hex[:8]}"
                # One tag per image: the example's variants share a repository, and release tags are immutable.
                total = sum(timed(lambda: promote(image, f"{registry}/{project}/{image.split('@')[0].rsplit('/', 1)[-1]}",  # noqa: B023
                                                  f"promoted-{index}"))  # noqa: B023
                            for index, image in enumerate(images))
                times.setdefault(tool, {}).setdefault(case, []).append(total)
    medians = {tool: {case: statistics.median(values) for case, values in cases.items()}
               for tool, cases in times.items()}
    ratios = {case: {tool: medians[tool][case] / medians["imagebuild"][case] for tool in medians if tool != "imagebuild"}
              for case in ("same registry", "cross-registry")}
    fastest = {case: min(ratios[case][peer] for peer in PEERS) for case in ratios}
    counted = count_requests(images) if args.count else None
    if args.format == "json":
        print(json.dumps({"images": images, "runs": args.runs, "median_s": medians,
                          "peer_over_imagebuild": ratios, "fastest_peer_over_imagebuild": fastest,
                          "requests": counted}, indent=2))
        return 0
    print(f"{len(images)} images, {args.runs} runs, median seconds for all images (peer / imagebuild)")
    for case in ("same registry", "cross-registry"):
        ours = medians["imagebuild"][case]
        row = "  ".join(f"{tool} {m[case]:.2f}s ({m[case] / ours:.2f}x)" for tool, m in medians.items())
        print(f"{case:15} {row}   fastest peer / imagebuild: {fastest[case]:.2f}x")
    if counted:
        print_counts(counted, len(images))
    return 0


if __name__ == "__main__":
    sys.exit(main())
