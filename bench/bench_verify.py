"""Benchmark: verify 200 signed digests with imagebuild's Verifier (cold and warm cache) and with cosign.

    python bench/bench_verify.py                         # 200 images in 127.0.0.1:5000/imagebuild-bench/verify
    python bench/bench_verify.py --count 50 --format json

What the admission webhook and `imagebuild verify` pay per image, side by side with
`cosign verify --key` run once per image (what a script calling cosign, or a webhook shelling out
to it, pays), in one run on the same registry:

- imagebuild, cold: a fresh Verifier, one image after another (HEAD-free: by digest; the .sig
  manifest and its payload blob are fetched, the ECDSA signature and the payload's digest checked);
- imagebuild, cold, 8 threads: the same, 8 images at once, as the webhook's threads do;
- imagebuild, warm: the same Verifier again, within the TTL (the by-digest cache);
- imagebuild, warm by tag: tags instead of digests (each one still resolved: one HEAD);
- `imagebuild verify` CLI: one process verifying all of them (start-up included);
- cosign verify --key, one process per image.

The images are tiny (a config blob of their own each, no layers) and signed once with the
bootstrap's key by the first run; reruns reuse them (their digests are deterministic).
Signature checks only (cosign verify checks no attestations either).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from imagebuild.config.trust import trust_config_for_keys  # noqa: E402
from imagebuild.trust.verify import Verifier, signature_tag  # noqa: E402

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
KEYS = Path("/var/lib/imagebuild/keys")
COSIGN = os.environ.get("IMAGEBUILD_COSIGN", "/opt/imagebuild-tools/bin/cosign")


def _upload(client: httpx.Client, repository: str, blob: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    if client.head(f"/v2/{repository}/blobs/{digest}").status_code == 200:
        return digest
    start = client.post(f"/v2/{repository}/blobs/uploads/")
    start.raise_for_status()
    location = start.headers["location"]
    separator = "&" if "?" in location else "?"
    client.put(f"{location}{separator}digest={digest}", content=blob,
               headers={"Content-Type": "application/octet-stream"}).raise_for_status()
    return digest


def seed(registry: str, repository: str, count: int) -> dict[str, str]:
    """Tag `img-<i>` -> digest for `count` distinct tiny images (deterministic: reruns get the same digests)."""
    with httpx.Client(base_url=f"http://{registry}", timeout=30,
                      limits=httpx.Limits(max_connections=8, max_keepalive_connections=8)) as client:
        def push(index: int) -> tuple[str, str]:
            config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": {"bench": str(index)}},
                                 "rootfs": {"type": "layers", "diff_ids": []}}).encode()
            config_digest = _upload(client, repository, config)
            manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "layers": [],
                                   "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                              "digest": config_digest, "size": len(config)}}).encode()
            tag = f"img-{index:04d}"
            response = client.put(f"/v2/{repository}/manifests/{tag}", content=manifest,
                                  headers={"Content-Type": MANIFEST})
            response.raise_for_status()
            return tag, response.headers["docker-content-digest"]

        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(pool.map(push, range(count)))


def sign_missing(registry: str, repository: str, digests: list[str]) -> int:
    """cosign-sign the digests without a .sig yet, 25 per cosign run; how many it signed."""
    with httpx.Client(base_url=f"http://{registry}", timeout=30) as client:
        missing = [d for d in digests
                   if client.head(f"/v2/{repository}/manifests/{signature_tag(d, '.sig')}",
                                  headers={"Accept": MANIFEST}).status_code != 200]
    env = {**os.environ, "COSIGN_PASSWORD": (KEYS / "cosign.password").read_text().strip()}
    for start in range(0, len(missing), 25):
        refs = [f"{registry}/{repository}@{d}" for d in missing[start:start + 25]]
        subprocess.run([COSIGN, "sign", "--key", str(KEYS / "cosign.key"), "--tlog-upload=false",
                        "--allow-http-registry", "--allow-insecure-registry", "--yes", *refs],
                       env=env, check=True, capture_output=True, timeout=600)
    return len(missing)


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the signed benchmark images live and how many; shared with bench_admission_apiserver.py."""
    parser.add_argument("--registry", default="127.0.0.1:5000")
    parser.add_argument("--repository", default="imagebuild-bench/verify")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--format", choices=["table", "json"], default="table")


def signed_images(args: argparse.Namespace) -> tuple[dict[str, str], int]:
    """The `--count` images (tag -> digest), each signed; and how many this run had to sign."""
    tags = seed(args.registry, args.repository, args.count)
    return tags, sign_missing(args.registry, args.repository, list(tags.values()))


def timed(label: str, refs: list[str], verify_all) -> dict:
    started = time.perf_counter()
    allowed = verify_all(refs)
    seconds = time.perf_counter() - started
    if allowed != len(refs):
        raise SystemExit(f"{label}: only {allowed} of {len(refs)} verified")
    return {"label": label, "images": len(refs), "seconds": seconds, "ms_per_image": 1000 * seconds / len(refs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_image_arguments(parser)
    args = parser.parse_args()

    tags, signed_now = signed_images(args)
    by_digest = [f"{args.registry}/{args.repository}@{d}" for d in tags.values()]
    by_tag = [f"{args.registry}/{args.repository}:{t}" for t in tags]
    config = trust_config_for_keys([KEYS / "cosign.pub"])

    rows = []
    with Verifier(config, cache_ttl_seconds=3600) as verifier:
        rows.append(timed("imagebuild Verifier, cold cache", by_digest,
                          lambda refs: sum(verifier.verify(r).allowed for r in refs)))
        rows.append(timed("imagebuild Verifier, warm cache", by_digest,
                          lambda refs: sum(verifier.verify(r).allowed for r in refs)))
        rows.append(timed("imagebuild Verifier, warm cache, by tag (1 HEAD each)", by_tag,
                          lambda refs: sum(verifier.verify(r).allowed for r in refs)))
    with Verifier(config, cache_ttl_seconds=3600) as verifier:
        rows.append(timed("imagebuild Verifier, cold cache, 8 threads", by_digest,
                          lambda refs: sum(v.allowed for v in verifier.verify_many(refs, concurrency=8))))

    def cli(refs: list[str]) -> int:
        run = subprocess.run([sys.executable, "-m", "imagebuild", "verify", "--key", str(KEYS / "cosign.pub"),
                              "--format", "json", *refs], capture_output=True, text=True, timeout=600,
                             cwd=Path(__file__).resolve().parent.parent)
        return sum(v["allowed"] for v in json.loads(run.stdout)["images"])

    rows.append(timed("imagebuild verify CLI, one process for all", by_digest, cli))

    def cosign_each(refs: list[str]) -> int:
        ok = 0
        for ref in refs:
            run = subprocess.run([COSIGN, "verify", "--key", str(KEYS / "cosign.pub"), "--insecure-ignore-tlog",
                                  "--allow-insecure-registry", "--allow-http-registry", ref],
                                 capture_output=True, timeout=120)
            ok += run.returncode == 0
        return ok

    rows.append(timed("cosign verify --key, one process per image", by_digest, cosign_each))

    cosign_s = rows[-1]["seconds"]
    for row in rows:
        row["cosign_over_this"] = round(cosign_s / row["seconds"], 1)
        row["seconds"], row["ms_per_image"] = round(row["seconds"], 4), round(row["ms_per_image"], 3)
    if args.format == "json":
        print(json.dumps({"images": args.count, "signed_now": signed_now, "rows": rows}, indent=2))
    else:
        print(f"{args.count} signed digests in {args.registry}/{args.repository} ({signed_now} signed by this run); "
              f"{os.cpu_count()} CPUs")
        print(f"{'':58} {'total s':>8} {'ms/image':>9} {'cosign time / this':>19}")
        for row in rows:
            print(f"{row['label']:58} {row['seconds']:8.3f} {row['ms_per_image']:9.3f} {row['cosign_over_this']:18.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
