"""Benchmark: the worst YAML files the loader's limits let through, or refuse last.

    python bench/bench_yaml_limits.py               # 3 runs each, target 2.0 s
    python bench/bench_yaml_limits.py --runs 5 --target 1.0

Every input file goes through imagebuild.core.source.parse_document, whose `Limits` decide how
long a hostile file can keep it busy. Each case below is built to cost as much as a file
can within those limits: the most bytes, the most values, an alias bomb that expands until
the value limit stops it, the deepest nesting. Prints the median time of each case and the
peak memory Python allocated for it.

Exits 1 when any case's median is slower than --target seconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable

from imagebuild.core.source import LIMITS, InputError, parse_document


def largest_string() -> str:
    return "a: '" + "x" * (LIMITS.max_bytes - 10) + "'\n"


def largest_comment() -> str:
    return "# " + "x" * (LIMITS.max_bytes - 20) + "\na: 1\n"


def most_values_flow() -> str:
    return "[" + ",".join(["a"] * (LIMITS.max_nodes - 1)) + "]\n"


def most_values_block() -> str:
    return "".join(f"k{i}: v\n" for i in range(LIMITS.max_nodes // 2 - 1))


def too_many_values() -> str:
    return "[" + ",".join(["a"] * (LIMITS.max_bytes // 2 - 2)) + "]\n"


def alias_bomb() -> str:
    levels = ["l0: &l0 [lol]"] + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(levels) + "\n"


def merge_bomb() -> str:
    levels = ["g0: &g0 {lol: lol}"]
    levels += [f"g{i}: &g{i} {{<<: [{', '.join([f'*g{i - 1}'] * 9)}], k{i}: v}}" for i in range(1, 10)]
    return "\n".join(levels) + "\n"


def deepest_flow() -> str:
    return "[" * (LIMITS.max_bytes - 1) + "\n"


CASES: dict[str, Callable[[], str]] = {
    "1 MiB quoted string": largest_string,
    "1 MiB comment": largest_comment,
    f"{LIMITS.max_nodes:,} values, flow": most_values_flow,
    f"{LIMITS.max_nodes:,} values, block mapping": most_values_block,
    "1 MiB of values (refused)": too_many_values,
    "alias bomb 9x9 (refused)": alias_bomb,
    "merge bomb 9x9 (refused)": merge_bomb,
    "1 MiB of '[' (refused)": deepest_flow,
}


def timed(text: str) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        parse_document(text, "bench.yaml", merge_keys=True)
        outcome = "accepted"
    except InputError as error:
        outcome = f"refused: {error.message}"
    return time.perf_counter() - start, outcome


def peak_memory(text: str) -> int:
    """Bytes Python allocated at most while parsing; a run of its own, as tracing slows it down."""
    tracemalloc.start()
    try:
        timed(text)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--target", type=float, default=2.0, help="seconds a case may take (median)")
    args = parser.parse_args()
    print(f"limits: {LIMITS}")
    slow = []
    for name, make in CASES.items():
        text = make()
        runs = [timed(text) for _ in range(args.runs)]
        median = statistics.median(seconds for seconds, _ in runs)
        peak = peak_memory(text)
        print(f"{name:36} {len(text):>9,} bytes  {median:6.3f} s  peak {peak / 2**20:6.1f} MiB  {runs[0][1]}")
        if median > args.target:
            slow.append(name)
    if slow:
        print(f"slower than {args.target} s: {', '.join(slow)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
