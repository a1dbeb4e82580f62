"""Benchmark: the same layers built on one BuildKit builder, on one with two slots, and on two builders.

    python bench/bench_builders.py                  # 4 independent base layers
    python bench/bench_builders.py --chains 6 --python --json-out builders.json

Each configuration gets daemons of its own, started cold (an empty --root each, so no daemon has
a step cached from an earlier run), and layers nobody built before: every chain's base image is
the local Debian base plus a few random bytes (a digest of its own, so no two layers share a
cached step even on one daemon), and the run step in the matrix is new for each configuration.
The build is the product's: `imagebuild build --layers ... --builders FILE` against the staging
registry, through buildkit_harness's daemons on loopback TCP with mutual TLS.

  one          one daemon, concurrency 1: the layers one after another
  one-wide     one daemon, concurrency 2: two builds at once on one daemon
  two          two daemons, concurrency 1 each

Prints each configuration's wall time (and the layers' build times summed, which shows how much
of it overlapped), which builder built how many layers, and the ratios
one/one-wide and one/two, then the same as JSON on the last line. On a shared 2-core machine the
gain is bounded by the cores and by the network (apt downloads): the load average is shown.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.e2e.buildkit_harness import buildkit_pool  # noqa: E402
from tests.e2e.tools import push_tiny_image  # noqa: E402

STAGING = "127.0.0.1:5000"
PROJECT = "imagebuild-bench-builders"
BASE = f"{STAGING}/imagebuild/debian:12"
CONFIGURATIONS = {"one": (("bk-1",), 1), "one-wide": (("bk-1",), 2), "two": (("bk-1", "bk-2"), 1)}


def matrix_for(directory: Path, chains: int) -> tuple[Path, list[str]]:
    """A matrix of `chains` OS entries, each FROM a base image of its own; its base layer paths."""
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"c{i}" for i in range(1, chains + 1)]
    oses = []
    for name in names:
        image = f"{STAGING}/{PROJECT}/debian-{name}:12"
        push_tiny_image(directory / "images", image, base=BASE)
        oses.append(f"  {name}: {{image: {image}, family: debian}}")
    path = directory / "matrix.yaml"
    path.write_text("\n".join([
        "schema: 1", f"registry: {STAGING}", f"project: {PROJECT}", "repository: paddle", "cache_repository: layers",
        "os:", *oses,
        "layers:", "  base:", f'    run: ["echo bench-{uuid.uuid4().hex}"]',
        "matrix:", f"  os: [{', '.join(names)}]", "  cuda: [cpu]", '  python: ["3.11"]', '  paddle: ["3.3.1"]',
        "tags:", '  gpu: ["{paddle}-gpu-{os}{py_suffix}"]', '  cpu: ["{paddle}-{os}{py_suffix}"]', ""]))
    return path, names


def run_configuration(name: str, scratch: Path, chains: int, python: bool) -> dict:
    daemons, concurrency = CONFIGURATIONS[name]
    matrix, names = matrix_for(scratch / name / "matrix", chains)
    layers = ",".join(f"python/{n}-py3.11" if python else f"base/{n}" for n in names)
    workdir = scratch / name / "work"
    subprocess.run([sys.executable, "-m", "imagebuild", "render", "--matrix", str(matrix)], cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    with buildkit_pool(scratch / name / "buildkit", daemons, concurrency) as pool:
        load = os.getloadavg()[0]
        print(f"[{name}] {len(daemons)} daemon(s) x concurrency {concurrency} (load average {load:.1f}) ...",
              file=sys.stderr, flush=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "imagebuild", "build", "--matrix", str(matrix), "--layers", layers,
                               "--builders", str(pool.builders_file), "--workdir", str(workdir)],
                              cwd=REPO, capture_output=True, text=True, timeout=3600)
        total = round(time.monotonic() - started, 1)
    report = json.loads((workdir / "build-report.json").read_text()) if (workdir / "build-report.json").exists() else {}
    built_by: dict[str, int] = {}
    for layer in report.get("layers", []):
        built_by[layer.get("builder") or "-"] = built_by.get(layer.get("builder") or "-", 0) + 1
    # Summed over the layers, against the wall time: how much of the building overlapped.
    layers_s = round(sum(layer.get("duration_s") or 0 for layer in report.get("layers", [])), 1)
    outcome = {"ok": done.returncode == 0, "total_s": total, "layers": len(report.get("layers", [])),
               "layers_s": layers_s, "built_by": built_by, "load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1),
               "error": "" if done.returncode == 0 else (done.stdout + done.stderr)[-2000:]}
    print(f"[{name}] {'ok' if outcome['ok'] else 'FAILED'} in {total} s; layers by builder {built_by}",
          file=sys.stderr, flush=True)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chains", type=int, default=4, help="independent chains (one base layer each)")
    parser.add_argument("--python", action="store_true", help="a python layer on each base too")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS), help="which, in this order")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    result: dict = {"chains": args.chains, "python": args.python, "cores": os.cpu_count(), "configurations": {}}
    with tempfile.TemporaryDirectory(prefix="bench-builders-") as tmp:
        for name in [c for c in args.configurations.split(",") if c]:
            result["configurations"][name] = run_configuration(name, Path(tmp), args.chains, args.python)
    runs = result["configurations"]
    for other in ("one-wide", "two"):
        if runs.get("one", {}).get("ok") and runs.get(other, {}).get("ok"):
            result[f"one/{other}"] = round(runs["one"]["total_s"] / runs[other]["total_s"], 2)
    print()
    for name, run in runs.items():
        print(f"{name:9} {'ok' if run['ok'] else 'FAILED':6} {run['total_s']:7} s  {run['layers']} layers "
              f"({run['layers_s']} s summed over them)  "
              f"by {run['built_by']}  (load {run['load_before']} -> {run['load_after']})")
        if run["error"]:
            print(f"  error: {run['error']}")
    for key in ("one/one-wide", "one/two"):
        if key in result:
            print(f"{key}: {result[key]}x")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0 if all(run["ok"] for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
