"""Run every benchmark in bench/ and print each one's headline figures in one table.

    python bench/run_all.py                  # every benchmark that is safe on a shared machine
    python bench/run_all.py --quick          # their smaller modes (fewer runs, fewer images)
    python bench/run_all.py --only plan,verify --json-out bench.json
    sudo python3 bench/run_all.py --include bootstrap,cold_build   # the slow ones, which need root
                                                                  # or prune the BuildKit cache

Each benchmark runs in a process of its own, as its docstring shows, one after another (they
would skew each other's figures). Skipped, and said so: `bootstrap` unless root and named with
--include (it reinstalls every tool from nothing: many minutes); `cold_build` unless named with
--include (it empties the BuildKit cache, which other builds on the machine rely on); `scan`,
`promote` and `time_to_ready` when there is no built example (scripts/example.sh makes one). Exits 1 when any benchmark that ran failed (missed its
target, or broke).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    args: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()  # the smaller mode's arguments
    headline: str = ""  # regex: the output lines that carry the figures
    needs_root: bool = False
    opt_in: bool = False  # only with --include NAME
    why_opt_in: str = ""


BENCHES = (
    Bench("plan", "bench_plan.py", quick=("--runs", "3"), headline=r"^(variants|distinct layers|median):"),
    Bench("cli_startup", "bench_cli_startup.py", quick=("--runs", "3"), headline=r" median "),
    Bench("registry_plan", "bench_registry_plan.py", quick=("--runs", "2"), headline=r"median|^variants"),
    Bench("report", "bench_report.py", quick=("--variants", "100", "--updates", "20"), headline=r"median"),
    Bench("yaml_limits", "bench_yaml_limits.py", quick=("--runs", "1"), headline=r" s  peak "),
    Bench("verify", "bench_verify.py", quick=("--count", "20"), headline=r"ms/image|x$|per image"),
    Bench("admission_apiserver", "bench_admission_apiserver.py", quick=("--count", "50"),
          headline=r"^(floor|cold|warm) |adds"),
    Bench("scan", "bench_scan.py", headline=r"^cold scan|images \("),
    Bench("release", "bench_release.py", quick=("--runs", "2"), headline=r"^priming run|^rerun wall"),
    Bench("oci_copy", "bench_oci_copy.py", quick=("--layer-mib", "20", "--runs", "1"),
          headline=r"^image:|^(new blobs|held elsewhere|again|same registry) "),
    Bench("promote", "bench_promote.py", quick=("--runs", "1"), headline=r"images, .* runs|fastest peer"),
    Bench("builders", "bench_builders.py", quick=("--chains", "2"), headline=r"^(one|one-wide|two) |^one/",
          needs_root=True),
    Bench("time_to_ready", "bench_time_to_ready.py", quick=("--channels", "cpu", "--no-peer"),
          headline=r"^(gpu|cpu|multiarch) ", needs_root=True),
    Bench("cold_build", "bench_cold_build.py", quick=("--only", "device=cpu"), headline=r"ratio|imagebuild .* s|peer .* s",
          opt_in=True, why_opt_in="empties the BuildKit cache other builds rely on"),
    Bench("bootstrap", "bench_bootstrap.py", headline=r"built in|bootstrap from nothing", needs_root=True,
          opt_in=True, why_opt_in="reinstalls every tool from nothing (many minutes)"),
)


@dataclass
class Outcome:
    name: str
    status: str  # ok | failed | skipped
    seconds: float | None = None
    figures: list[str] = field(default_factory=list)
    note: str = ""


def scan_workdir() -> Path | None:
    """A workdir holding a build report of the example (scripts/example.sh or a build leaves one)."""
    for candidate in (REPO / ".imagebuild" / "example", REPO / ".imagebuild"):
        if (candidate / "build-report.json").is_file():
            return candidate
    return None


def run_one(bench: Bench, quick: bool, timeout: float) -> Outcome:
    args = list(bench.quick if quick else bench.args)
    if bench.name in ("scan", "promote", "time_to_ready"):
        workdir = scan_workdir()
        if workdir is None:
            return Outcome(bench.name, "skipped", note="no built example (run scripts/example.sh first)")
        args += ["--report", str(workdir / "build-report.json")] if bench.name == "time_to_ready" else ["--workdir", str(workdir)]
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(BENCH / bench.script), *args], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        return Outcome(bench.name, "failed", round(time.monotonic() - started, 1), note=f"timed out after {timeout:.0f} s")
    seconds = round(time.monotonic() - started, 1)
    pattern = re.compile(bench.headline)
    figures = [line.strip() for line in proc.stdout.splitlines() if line.strip() and pattern.search(line)]
    if not figures:  # no line matched: the last few say what happened
        figures = [line.strip() for line in proc.stdout.strip().splitlines()[-3:]]
    note = "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200]
    return Outcome(bench.name, "ok" if proc.returncode == 0 else "failed", seconds, figures, note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's smaller mode, where it has one")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--include", default="", help="comma-separated opt-in benchmarks to run as well")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    parser.add_argument("--json-out", type=Path, help="write the outcomes as JSON here too")
    args = parser.parse_args()
    only = {n for n in args.only.split(",") if n}
    include = {n for n in args.include.split(",") if n}
    known = {b.name for b in BENCHES}
    unknown = (only | include) - known
    if unknown:
        print(f"unknown benchmark(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    outcomes = []
    for bench in BENCHES:
        if only and bench.name not in only:
            continue
        if bench.opt_in and bench.name not in include:
            outcomes.append(Outcome(bench.name, "skipped", note=f"opt-in (--include {bench.name}): {bench.why_opt_in}"))
            continue
        if bench.needs_root and os.geteuid() != 0:
            outcomes.append(Outcome(bench.name, "skipped", note="needs root (sudo)"))
            continue
        print(f"running {bench.script} {'(quick)' if args.quick and bench.quick else ''}...", file=sys.stderr, flush=True)
        outcomes.append(run_one(bench, args.quick, args.timeout))
    print_table(outcomes)
    if args.json_out:
        args.json_out.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


def print_table(outcomes: list[Outcome]) -> None:
    width = max((len(o.name) for o in outcomes), default=10)
    print(f"{'benchmark':<{width}}  {'result':<7}  {'wall s':>7}  figures")
    for o in outcomes:
        seconds = f"{o.seconds:7.1f}" if o.seconds is not None else f"{'-':>7}"
        lines = o.figures or [o.note]
        print(f"{o.name:<{width}}  {o.status:<7}  {seconds}  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':<{width}}  {'':<7}  {'':>7}  {line}")
        if o.figures and o.note:
            print(f"{'':<{width}}  {'':<7}  {'':>7}  {o.note}")


if __name__ == "__main__":
    sys.exit(main())
