"""Benchmark: expand, render and key a synthetic 1,000-variant matrix.

    python bench/bench_plan.py                 # 1,000 variants, 7 runs, target 1.0 s
    python bench/bench_plan.py --runs 15 --target 0.5
    python bench/bench_plan.py --profile       # cProfile of one run, top functions

Each run times what `imagebuild plan` / `render` pay before printing or writing:
`load_matrix` (parse, validate, include/exclude expansion, support checks) plus
`build_plan` (layer chains, Jinja rendering, content keys). The matrix is generated
into a temporary file: 5 OS bases x 5 CUDA entries (cpu + 4 GPU) x 5 Pythons x
8 Paddle releases = 1,000 cells, all inside imagebuild's support table except the
ones waived through `allow_unsupported` (Paddle 3.0.0 on CUDA 12.9, CUDA 13.0 before
Paddle 3.3), so the benchmark exercises the same paths a real matrix does.

Exits 1 when the median run is slower than --target seconds.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

from imagebuild.build.plan import build_plan
from imagebuild.config.matrix import load_matrix

OSES = {  # name: (image, family)
    "debian11": ("docker.io/library/debian:11", "debian"),
    "debian12": ("docker.io/library/debian:12", "debian"),
    "ubuntu20.04": ("docker.io/library/ubuntu:20.04", "ubuntu"),
    "ubuntu22.04": ("docker.io/library/ubuntu:22.04", "ubuntu"),
    "ubuntu24.04": ("docker.io/library/ubuntu:24.04", "ubuntu"),
}
CUDA = {  # name: (version, cudnn, wheels)
    "11.8": ("11.8", "8.9", ["nvidia-cuda-runtime-cu11==11.8.89", "nvidia-cudnn-cu11==8.9.6.50",
                             "nvidia-cublas-cu11==11.11.3.6"]),
    "12.6": ("12.6", "9.5", ["nvidia-cuda-runtime-cu12==12.6.77", "nvidia-cudnn-cu12==9.5.1.17",
                             "nvidia-cublas-cu12==12.6.4.1"]),
    "12.9": ("12.9", "9.9", ["nvidia-cuda-runtime-cu12==12.9.79", "nvidia-cudnn-cu12==9.9.0.52",
                             "nvidia-cublas-cu12==12.9.1.4"]),
    "13.0": ("13.0", "9.13", ["nvidia-cuda-runtime-cu13==13.0.48", "nvidia-cudnn-cu13==9.13.0.50",
                              "nvidia-cublas-cu13==13.0.0.19"]),
}
PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]
PADDLES = ["3.0.0", "3.1.0", "3.1.1", "3.2.0", "3.2.1", "3.2.2", "3.3.0", "3.3.1"]


def synthetic_matrix() -> str:
    """A valid matrix.yaml text whose expansion has len(OSES)*(1+len(CUDA))*len(PYTHONS)*len(PADDLES) cells."""
    lines = [
        "schema: 1",
        "name: bench",
        "registry: registry.example.com:5000",
        "project: bench",
        "repository: paddle",
        "source: https://example.com/bench",
        "labels: {io.example.team: ml-platform}",
        "secrets:",
        "  ca-bundle: {file: /etc/ssl/certs/ca-certificates.crt}",
        "  pip-conf: {env: PIP_CONF}",
        "user: {name: paddle, uid: 1000, gid: 1000}",
        "setuid_allowlist: [/usr/bin/su]",
        "os:",
    ]
    for index, (name, (image, family)) in enumerate(OSES.items()):
        lines += [f"  {name}:", f"    image: {image}", f'    digest: "sha256:{index + 1:064x}"',
                  f"    family: {family}"]
    lines.append("cuda:")
    for name, (version, cudnn, wheels) in CUDA.items():
        lines += [f'  "{name}":', f'    version: "{version}"', f'    cudnn: "{cudnn}"', "    provider: wheels",
                  "    wheels:"] + [f"      - {w}" for w in wheels]
    lines += [
        "layers:",
        "  base: {packages: [tzdata]}",
        "  paddle: {packages: [libgl1], pip: {packages: [numpy<2]}}",
        "extra_layers:",
        "  - {name: tools, pip: {packages: [onnx==1.17.0]}, when: {python: ['3.11', '3.12']}}",
        "tags:",
        '  gpu: ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}-{os}{py_suffix}"]',
        '  cpu: ["{paddle}-{os}{py_suffix}"]',
        "allow_unsupported:",
        '  - {paddle: "3.0.0", cuda: "12.9", reason: "benchmark only: not a shipped combination"}',
    ]
    for paddle in PADDLES:
        if paddle not in ("3.3.0", "3.3.1"):
            lines.append(f'  - {{paddle: "{paddle}", cuda: "13.0", reason: "benchmark only: CUDA 13 before 3.3"}}')
    lines += [
        "matrix:",
        f"  os: [{', '.join(OSES)}]",
        f"  cuda: [cpu, {', '.join(repr(c) for c in CUDA)}]",
        f"  python: [{', '.join(repr(p) for p in PYTHONS)}]",
        f"  paddle: [{', '.join(repr(p) for p in PADDLES)}]",
    ]
    return "\n".join(lines) + "\n"


def one_run(path: Path):
    """(wall seconds, CPU seconds, plan) of load_matrix + build_plan."""
    start, cpu = time.perf_counter(), time.process_time()
    plan = build_plan(load_matrix(path))
    return time.perf_counter() - start, time.process_time() - cpu, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs (default 7)")
    parser.add_argument("--target", type=float, default=1.0, help="median budget in seconds (default 1.0)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run instead")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="imagebuild-bench-") as tmp:
        path = Path(tmp) / "matrix.yaml"
        path.write_text(synthetic_matrix(), encoding="utf-8")
        if args.profile:
            one_run(path)  # warm caches (template compilation) as the timed runs do
            profiler = cProfile.Profile()
            profiler.enable()
            one_run(path)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
            return 0
        *_, plan = one_run(path)  # warm-up: imports, template compilation
        runs = [one_run(path)[:2] for _ in range(args.runs)]

    times = [wall for wall, _ in runs]
    median = statistics.median(times)
    print(f"variants:        {len(plan.variants)}")
    print(f"distinct layers: {len(plan.layers)} (chain total {plan.chain_length_total()})")
    print(f"runs:            {len(times)}")
    print(f"min:             {min(times):.3f} s")
    print(f"median:          {median:.3f} s (target {args.target:.3f} s)")
    print(f"median CPU:      {statistics.median(cpu for _, cpu in runs):.3f} s (wall above CPU: a busy machine)")
    if median > args.target:
        print("SLOWER than the target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
