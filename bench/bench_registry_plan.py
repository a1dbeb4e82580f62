"""Benchmark: replan a synthetic 1,000-variant matrix against a registry holding every layer.

    python bench/bench_registry_plan.py                       # staging registry 127.0.0.1:5000
    python bench/bench_registry_plan.py --registry 127.0.0.1:5001 --runs 5 --target 2.0

What `imagebuild plan --registry` and the first step of `imagebuild build` pay: load and
expand the matrix, render and key every layer, then one HEAD per distinct layer key
against the cache repository (concurrently). Before timing, every layer key is pushed as a
tag (one tiny image, one manifest PUT per key), so the answer is "0 to build".
Prints wall times, the number of distinct layers and of registry requests; exits 1 when the
median exceeds --target seconds or when any run sent more than one request per layer.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import synthetic_matrix  # noqa: E402

from imagebuild.build.plan import build_plan  # noqa: E402
from imagebuild.build.scheduler import registry_plan  # noqa: E402
from imagebuild.config.matrix import load_matrix  # noqa: E402

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _upload(client: httpx.Client, repository: str, blob: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    if client.head(f"/v2/{repository}/blobs/{digest}").status_code == 200:
        return digest
    start = client.post(f"/v2/{repository}/blobs/uploads/")
    start.raise_for_status()
    location = start.headers["location"]  # carries its own upload state in the query
    separator = "&" if "?" in location else "?"
    client.put(f"{location}{separator}digest={digest}", content=blob,
               headers={"Content-Type": "application/octet-stream"}).raise_for_status()
    return digest


def seed(registry: str, repository: str, tags: list[str]) -> None:
    """Make every tag exist: one tiny image, many manifest PUTs (concurrently)."""
    with httpx.Client(base_url=f"http://{registry}", timeout=30) as client:
        config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}).encode()
        config_digest = _upload(client, repository, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "layers": [],
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": config_digest, "size": len(config)}}).encode()

    with httpx.Client(base_url=f"http://{registry}", timeout=30,
                      limits=httpx.Limits(max_connections=16, max_keepalive_connections=16)) as client:
        def put(tag: str) -> None:
            client.put(f"/v2/{repository}/manifests/{tag}", content=manifest,
                       headers={"Content-Type": MANIFEST}).raise_for_status()

        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(put, tags))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", default="127.0.0.1:5000")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--target", type=float, default=2.0, help="median seconds allowed")
    args = parser.parse_args()

    text = synthetic_matrix().replace("registry: registry.example.com:5000", f"registry: {args.registry}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "matrix.yaml"
        path.write_text(text)
        plan = build_plan(load_matrix(path))
        cache_repository = plan.cache_ref.split("/", 1)[1]
        t0 = time.perf_counter()
        seed(args.registry, cache_repository, [layer.cache_tag for layer in plan.layers.values()])
        print(f"seeded {len(plan.layers)} layer tags in {time.perf_counter() - t0:.1f}s")

        results = {}
        for label, resolve in (("plan --registry", False), ("build's plan (+ digests)", True)):
            times, requests = [], []
            for _ in range(args.runs):
                count = [0]

                def counted(request: httpx.Request, count: list[int] = count) -> None:
                    count[0] += 1

                start = time.perf_counter()
                replanned = build_plan(load_matrix(path))
                report = registry_plan(replanned, replanned.variants, resolve_digests=resolve,
                                       event_hooks={"request": [counted]})
                times.append(time.perf_counter() - start)
                requests.append(count[0])
                to_build = sum(rec.status == "to-build" for rec in report.layers)
                assert to_build == 0, f"{to_build} layers missing from the seeded registry"
            results[label] = (times, requests)

    print(f"variants: {len(plan.variants)}  distinct layers: {len(plan.layers)}")
    ok = True
    for label, (times, requests) in results.items():
        median = statistics.median(times)
        print(f"{label:26} wall min {min(times):.3f}s  median {median:.3f}s  max {max(times):.3f}s  "
              f"requests {max(requests)}")
        ok &= max(requests) <= len(plan.layers)
    median = statistics.median(results["plan --registry"][0])
    ok &= median <= args.target
    print("OK" if ok else f"FAILED: target {args.target}s for plan --registry, at most one request per layer")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
