"""Benchmark: what imagebuild's webhook adds to a Pod creation, measured at a real Kubernetes API server.

    python bench/bench_admission_apiserver.py                 # 200 Pods per round
    python bench/bench_admission_apiserver.py --count 50 --format json

One run starts etcd and kube-apiserver on loopback (tests/e2e/kubeapi.py: the binaries
scripts/build-test-tools.sh builds) and creates Pods one after another with a POST to the API
server, each Pod naming one of `--count` signed images by digest (bench/bench_verify.py's images,
signed once, reused by later runs). Three rounds, each `--count` Pods:

- floor: no webhook configured (the API server's own admission, validation and etcd write);
- cold: the webhook configurations `imagebuild policies generate` writes (mutating and validating)
  pointed at a freshly started `imagebuild admission serve`; every image is new to it, so each Pod
  costs a verification (the .sig manifest and blob from the registry, the signature checked);
- warm: the same images again, within the webhook's cache TTL.

p50 and p99 of each round, and what the webhook adds over the floor. Target: under 10 ms at p99,
warm. The API server calls both webhooks (mutate, then validate) for every Pod.
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
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_verify import add_image_arguments, signed_images  # noqa: E402
from tests.e2e.admission_harness import start_webhook_process, trust_file  # noqa: E402
from tests.e2e.certs import Authority  # noqa: E402
from tests.e2e.kubeapi import Cluster, host_address, running_cluster  # noqa: E402

NAMESPACE, NAME = "imagebuild-system", "imagebuild-admission"
WORKLOADS = "bench"
TARGET_WARM_P99_MS = 10.0


def percentile(samples: list[float], q: int) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


def create_pods(client: httpx.Client, images: list[str], label: str) -> list[float]:
    """One POST per Pod, one after another; the milliseconds each took. Every Pod must be created."""
    latencies = []
    for image in images:
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{label}-{uuid.uuid4().hex[:10]}", "namespace": WORKLOADS},
                "spec": {"containers": [{"name": "app", "image": image}]}}
        started = time.perf_counter()
        response = client.post(f"/api/v1/namespaces/{WORKLOADS}/pods", json=body)
        latencies.append(1000 * (time.perf_counter() - started))
        if response.status_code != 201:
            raise SystemExit(f"{label}: creating a Pod with {image} answered {response.status_code}: "
                             f"{response.text[:500]}")
    return latencies


def api_client(cluster: Cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.server, verify=str(cluster.ca), timeout=30,
                        headers={"Authorization": f"Bearer {cluster.token}"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_image_arguments(parser)
    args = parser.parse_args()

    tags, _ = signed_images(args)
    images = [f"{args.registry}/{args.repository}@{digest}" for digest in tags.values()]

    directory = Path(tempfile.mkdtemp(prefix="bench-admission-"))
    rounds: dict[str, list[float]] = {}
    try:
        with running_cluster(directory / "kube") as cluster, api_client(cluster) as client:
            cluster.namespace(WORKLOADS)
            cluster.namespace(NAMESPACE)
            create_pods(client, images[:20], "warmup")  # the API server's own first requests are slower
            rounds["floor"] = create_pods(client, images, "floor")

            host = host_address()
            tls = Authority.new("bench webhook CA").issue(directory / "tls", NAME, (f"{NAME}.{NAMESPACE}.svc", host))
            trust = trust_file(directory, ttl=3600, images=(f"{args.registry}/{args.repository}",),
                               extra=f"webhook:\n  namespace: {NAMESPACE}\n  name: {NAME}\n"
                                     f"  image: {images[0]}\n  port: 8443\n")
            out = directory / "admission"
            generate = subprocess.run([sys.executable, "-m", "imagebuild", "policies", "generate", "--trust",
                                       str(trust), "--ca-bundle", str(tls.ca), "--out", str(out)],
                                      cwd=REPO, capture_output=True, text=True, timeout=120)
            if generate.returncode != 0:
                raise SystemExit(f"policies generate failed: {generate.stderr[-1000:]}")
            webhook = start_webhook_process(directory, tls, trust, host=host)
            try:
                cluster.kubectl("apply", "-f", str(out / "webhook.yaml"))
                cluster.route_service(NAMESPACE, NAME, "https", host, webhook.port)
                # Wait until the API server calls the webhook: an image outside the policy is refused.
                deadline = time.monotonic() + 30
                outside = "127.0.0.1:5001/not-covered/app@sha256:" + "0" * 64
                while client.post(f"/api/v1/namespaces/{WORKLOADS}/pods?dryRun=All", json={
                        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
                        "spec": {"containers": [{"name": "app", "image": outside}]}}).status_code != 403:
                    if time.monotonic() > deadline:
                        raise SystemExit("the API server did not call the webhook within 30 s")
                    time.sleep(0.2)
                rounds["cold"] = create_pods(client, images, "cold")
                before_warm = len(webhook.decisions())
                rounds["warm"] = create_pods(client, images, "warm")
            finally:
                webhook.stop()
            # The webhook's own time per review (from reading the body to the encoded answer), from its log.
            own = [d["duration_ms"] for d in webhook.decisions()[before_warm:]]
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    floor = {q: percentile(rounds["floor"], q) for q in (50, 99)}
    rows = []
    for name, samples in rounds.items():
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        rows.append({"round": name, "pods": len(samples), "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
                     "added_p50_ms": round(p50 - floor[50], 2), "added_p99_ms": round(p99 - floor[99], 2)})
    warm_added = next(r for r in rows if r["round"] == "warm")["added_p99_ms"]
    own_ms = {"reviews": len(own), "p50_ms": round(percentile(own, 50), 2), "p99_ms": round(percentile(own, 99), 2)}
    met = warm_added < TARGET_WARM_P99_MS
    if args.format == "json":
        print(json.dumps({"pods_per_round": args.count, "cpus": os.cpu_count(), "rows": rows,
                          "webhook_own_time_warm": own_ms, "target_warm_added_p99_ms": TARGET_WARM_P99_MS, "met": met}, indent=2))
    else:
        print(f"{args.count} Pod creations per round through kube-apiserver; {os.cpu_count()} CPUs")
        print(f"{'round':8} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}")
        for r in rows:
            print(f"{r['round']:8} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['added_p50_ms']:10.2f} "
                  f"{r['added_p99_ms']:10.2f}")
        print(f"webhook's own time per review, warm ({own_ms['reviews']} reviews: mutate and validate): "
              f"p50 {own_ms['p50_ms']:.2f} ms, p99 {own_ms['p99_ms']:.2f} ms")
        print(f"webhook warm adds {warm_added:.2f} ms at p99 (target < {TARGET_WARM_P99_MS:.0f} ms): "
              f"{'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
