"""Benchmark: `imagebuild release` on the example, once to prime, then again with nothing to do.

    python bench/bench_release.py                 # 3 reruns after the priming run
    python bench/bench_release.py --runs 5 --target 5.0

The priming run does whatever this checkout's revision still needs (at most its release
layers, their smoke tests, scans and signatures: the example's other layers come from the
registry); each rerun must find every stage done, and what it costs is what a CI job pays for
a variant that did not change: the registry plan, the report, the reuse checks, the signature
and attestation lookups. Uses the example's fixture DB (.imagebuild/trivy-example, made if
missing, as scripts/example.sh does) and bootstrap's key. Prints the priming time, each
rerun's wall time and the median; exits 1 when a rerun did any work or the median exceeds
--target seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KEYS = Path("/var/lib/imagebuild/keys")


def release(workdir: Path, cache_dir: Path, password: str) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "imagebuild", "release", "--matrix", "examples/local/matrix.yaml",
                           "--policy", "examples/local/policy.yaml", "--workdir", str(workdir), "--offline",
                           "--cache-dir", str(cache_dir), "--key", str(KEYS / "cosign.key"), "--format", "json"],
                          cwd=REPO, capture_output=True, text=True, timeout=7200,
                          env={**os.environ, "COSIGN_PASSWORD": password, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"imagebuild release exited {proc.returncode}")
    return seconds, json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="reruns timed after the priming run")
    parser.add_argument("--target", type=float, default=5.0, help="median seconds a rerun may take")
    parser.add_argument("--workdir", type=Path, default=REPO / ".imagebuild" / "bench-release")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".imagebuild" / "trivy-example")
    args = parser.parse_args()
    if not (args.cache_dir / "db" / "metadata.json").is_file():
        from tests.e2e.trivydb import build_fixture_db

        build_fixture_db(args.cache_dir)
    password = (KEYS / "cosign.password").read_text().strip()
    prime_s, prime = release(args.workdir, args.cache_dir, password)
    print(f"priming run: {prime_s:.1f} s (work: {prime['work']})")
    times, busy = [], []
    for _ in range(args.runs):
        seconds, summary = release(args.workdir, args.cache_dir, password)
        times.append(seconds)
        if not summary["nothing_new"] or any(summary["work"].values()):
            busy.append(summary["work"])
    median = statistics.median(times)
    print(f"variants: {len(prime['variants'])}")
    print(f"rerun wall: min {min(times):.2f} s, median {median:.2f} s, max {max(times):.2f} s "
          f"(target {args.target:.1f} s; process start-up included)")
    if busy:
        print(f"a rerun did work: {busy}", file=sys.stderr)
    if median > args.target:
        print("SLOWER than the target", file=sys.stderr)
    return 1 if busy or median > args.target else 0


if __name__ == "__main__":
    sys.exit(main())
