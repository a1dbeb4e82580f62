"""Benchmark: scan the built example twice, with a cold Trivy cache and then with the warm one.

    python bench/bench_scan.py                            # needs a build: imagebuild build --matrix examples/local/matrix.yaml
    python bench/bench_scan.py --workdir .imagebuild --runs 3

What `imagebuild scan` pays per release: the first scan of a new image analyses every layer
(downloads it from the registry, reads every file for packages and secrets); a later scan
of an image whose layers Trivy has seen reads its cache instead. Both runs use a fresh copy
of the build report, the real images in the local registry (by digest), the pinned Trivy,
and the fixture vulnerability DB (built with Go from tests/fixtures/trivydb, as the tests do).
Prints both wall times, the ratio, and the layers each run analysed and reused; exits 1 when
the warm scan reused fewer layers than the cold one analysed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.e2e.trivydb import build_fixture_db  # noqa: E402


def scan(report: Path, cache: Path, dockerfiles: Path, scratch: Path) -> tuple[float, dict]:
    workdir = Path(tempfile.mkdtemp(dir=scratch))
    shutil.copy(report, workdir / "build-report.json")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "imagebuild", "scan", "--workdir", str(workdir), "--cache-dir",
                           str(cache), "--offline", "--dockerfiles", str(dockerfiles), "--format", "json"],
                          capture_output=True, text=True, cwd=REPO)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        sys.exit(f"imagebuild scan failed:\n{proc.stderr[-3000:]}")
    return seconds, json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=REPO / ".imagebuild",
                        help="where the example's build-report.json is (default: .imagebuild)")
    parser.add_argument("--dockerfiles", type=Path, default=REPO / "examples" / "local" / "dockerfiles")
    parser.add_argument("--runs", type=int, default=1, help="cold+warm pairs (each cold run starts a new cache)")
    args = parser.parse_args()
    report = args.workdir / "build-report.json"
    if not report.is_file():
        sys.exit(f"{report} not found: build the example first (imagebuild build --matrix examples/local/matrix.yaml)")
    built = [v for v in json.loads(report.read_text())["variants"] if v.get("status") == "built"]
    with tempfile.TemporaryDirectory(prefix="bench-scan-") as tmp:
        scratch = Path(tmp)
        db = build_fixture_db(scratch / "db-source")
        colds, warms, ok = [], [], True
        for run in range(args.runs):
            cache = scratch / f"cache-{run}"
            shutil.copytree(db / "db", cache / "db")  # the DB only: no layer analysed yet
            cold, cold_summary = scan(report, cache, args.dockerfiles, scratch)
            warm, warm_summary = scan(report, cache, args.dockerfiles, scratch)
            colds.append(cold)
            warms.append(warm)
            c, w = cold_summary["layers"], warm_summary["layers"]
            print(f"run {run + 1}: cold {cold:6.1f} s (layers analysed {c['analysed']}, reused {c['reused']} of "
                  f"{c['total']})   warm {warm:5.1f} s (analysed {w['analysed']}, reused {w['reused']} of {w['total']})")
            ok &= w["analysed"] == 0 and w["reused"] == c["total"]
    cold, warm = statistics.median(colds), statistics.median(warms)
    print(f"{len(built)} images ({', '.join(v['id'] for v in built)})")
    print(f"cold scan {cold:.1f} s, warm scan {warm:.1f} s: warm takes {warm / cold:.1%} of cold "
          f"({cold / warm:.0f}x faster)")
    if not ok:
        sys.exit("the warm scan analysed layers again: Trivy's cache was not reused")


if __name__ == "__main__":
    main()
