"""What one locked read-modify-write of the build report costs (report.update_report).

    python bench/bench_report.py                   # 18 and 1,000 variants, 100 updates each
    python bench/bench_report.py --variants 100 --updates 500

Every stage records each variant's result as soon as it has it, under the report's lock:
the file is read, changed, written to a temp file, fsynced and renamed. This times
`record_stage` (one variant, one stage) and the build's full write, on a report whose every
variant already carries smoke, scan and gate records of realistic size, one process at a
time and with 8 processes recording at once. The report lives in a temp folder (the same
file system as /tmp here; fsync cost depends on the disk).
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from imagebuild.core.report import (  # noqa: E402
    BuildReport,
    GateStage,
    LayerRecord,
    ScanStage,
    SmokeStage,
    VariantRecord,
    record_stage,
)


def report_of(variants: int) -> BuildReport:
    layers = [LayerRecord(key=f"{i:064x}", kind="release", path=f"release/v{i}", image=f"r/c:release-{i}",
                          status="built", digest=f"sha256:{i:064x}", duration_s=12.5, log=f"logs/release-{i}.log")
              for i in range(variants)]
    records = []
    for i in range(variants):
        stages = {
            "smoke": SmokeStage(status="passed", digest=f"sha256:{i:064x}", passed=40, skipped=6, tiers=["abi", "gpu"],
                                skip_reasons=[{"test": f"suite.test_gpu::t{k}", "reason": "no GPU"} for k in range(6)]),
            "scan": ScanStage(status="ok", digest=f"sha256:{i:064x}", dockerfiles=[f"release/v{i}/Dockerfile"] * 5,
                              reports={"image": "scan/x/image.json", "sbom": "scan/x/sbom.cdx.json"},
                              counts={"vulnerabilities": {"LOW": 80, "MEDIUM": 20, "HIGH": 3}, "secrets": 0}),
            "gate": GateStage(status="passed", digest=f"sha256:{i:064x}",
                              excepted=[{"id": f"CVE-2024-{k}", "package": "libx", "why": "accepted"} for k in range(5)]),
        }
        records.append(VariantRecord(id=f"v{i}", tags=[f"t{i}"], images=[f"r/p:t{i}"], chain=[f"{i:064x}"],
                                     device="gpu", paddle="3.3.1", python="3.11", cuda="12.6", cudnn="9.5",
                                     status="built", stages=stages, os="ubuntu22.04"))
    return BuildReport(matrix="matrix.yaml", revision="r", registry="r", repository="r/p", cache_repository="r/c",
                       created="2026-01-01T00:00:00Z", variants=records, layers=layers, status="ok", run_id="bench")


def _record(path: str, worker: int, updates: int, variants: int) -> None:
    for n in range(updates):
        record_stage(Path(path), f"bench{worker}", {f"v{(worker + n) % variants}": {"status": "ok", "n": n}})


def run(variants: int, updates: int) -> None:
    with tempfile.TemporaryDirectory(prefix="imagebuild-bench-report-") as tmp:
        path = Path(tmp) / "build-report.json"
        report = report_of(variants)
        report.write(path)
        size = path.stat().st_size
        times = []
        for n in range(updates):
            started = time.perf_counter()
            record_stage(path, "smoke", {f"v{n % variants}": SmokeStage(status="passed", passed=n)})
            times.append(time.perf_counter() - started)
        writes = []
        for _ in range(max(1, updates // 10)):
            started = time.perf_counter()
            report.write(path)
            writes.append(time.perf_counter() - started)
        workers = 8
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_record, args=(str(path), w, updates // workers, variants)) for w in range(workers)]
        started = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        parallel = time.perf_counter() - started
        print(f"{variants:5} variants, report {size / 1024:7.0f} KiB: record_stage median "
              f"{statistics.median(times) * 1000:6.1f} ms (p95 {sorted(times)[int(len(times) * 0.95)] * 1000:6.1f} ms); "
              f"build's full write median {statistics.median(writes) * 1000:6.1f} ms; "
              f"{workers} processes x {updates // workers} updates: {parallel:5.2f} s "
              f"({updates / parallel:5.0f} updates/s, process start-up included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", type=int, action="append", help="variants in the report (repeatable)")
    parser.add_argument("--updates", type=int, default=100)
    args = parser.parse_args()
    for variants in args.variants or [18, 1000]:
        run(variants, args.updates)


if __name__ == "__main__":
    main()
