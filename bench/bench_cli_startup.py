"""Benchmark: start-up time of the `imagebuild` CLI (a fresh interpreter per run).

    python bench/bench_cli_startup.py                  # 10 runs of each command
    python bench/bench_cli_startup.py --runs 30 --format json

What a CI step pays before `imagebuild promote` (or `verify`) does any work: the interpreter, the
imports of the CLI and of the command's modules, click parsing `--help`. `python -c pass` is the
floor (the interpreter alone). Each command runs once first (a warm page cache and .pyc files),
then --runs times; the median wall time is reported.

Bytecode is cached as an installed package has it, even where PYTHONDONTWRITEBYTECODE is set: the
runs write and read their .pyc files under a temporary PYTHONPYCACHEPREFIX (not in the checkout).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "imagebuild --help": ["-m", "imagebuild", "--help"],
    "imagebuild promote --help": ["-m", "imagebuild", "promote", "--help"],
    "imagebuild verify --help": ["-m", "imagebuild", "verify", "--help"],
}


def wall_seconds(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


@dataclass(frozen=True)
class Row:
    command: str
    runs: int
    median_s: float
    min_s: float


def child_env(pycache: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    # This checkout's package, not whichever one the interpreter has installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def measure(runs: int) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="imagebuild-bench-pycache-") as pycache:
        env = child_env(pycache)
        for label, args in COMMANDS.items():
            wall_seconds(args, env)  # warm-up: .pyc files written, files in the page cache
            times = [wall_seconds(args, env) for _ in range(runs)]
            rows.append(Row(label, runs, statistics.median(times), min(times)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs per command (default 10)")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    rows = measure(args.runs)
    if args.format == "json":
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return 0
    floor = rows[0].median_s  # python -c pass
    width = max(len(row.command) for row in rows)
    for row in rows:
        above = "" if row is rows[0] else f"  (+{1000 * (row.median_s - floor):.0f} ms above the floor)"
        print(f"{row.command:<{width}}  median {1000 * row.median_s:6.0f} ms  min {1000 * row.min_s:6.0f} ms"
              f"  ({row.runs} runs){above}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
