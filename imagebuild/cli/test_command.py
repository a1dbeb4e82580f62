"""imagebuild test: smoke tests inside the images (logic in smoke.py and smoke_run.py)."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from imagebuild.checks.smoke import DEFAULT_EMULATION_FACTOR
from imagebuild.cli.common import echo, format_option, only_option, report_at, reports_input_errors
from imagebuild.config.selection import Selection
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError

if TYPE_CHECKING:
    from imagebuild.checks.smoke import SmokeResult


@click.command("test")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".imagebuild"),
              show_default=True, help="Where the build report is (as for build, scan and gate).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Test every built variant of this build report instead, and record the results in it.")
@click.option("--image", "images", multiple=True, metavar="REF",
              help="Test this image instead (expectations from its labels, or --matrix); repeatable.")
@click.option("--matrix", "matrix_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The matrix the images were built from (default: the one the report names).")
@only_option
@click.option("--tier", type=click.Choice(["all", "abi", "gpu"]), default="all", show_default=True,
              help="abi runs anywhere; gpu needs a GPU and is skipped, with its reason, without one.")
@click.option("--gpus", type=click.Choice(["auto", "all", "none"]), default="auto", show_default=True,
              help="Request the host's GPUs for GPU variants: auto = when this host has an NVIDIA GPU.")
@click.option("--timeout", "timeout_s", type=click.IntRange(10, 86400), default=900, show_default=True,
              help="Seconds per image; the container is killed after that.")
@click.option("--emulation-factor", type=click.FloatRange(1, 100), default=DEFAULT_EMULATION_FACTOR, show_default=True,
              help="Scale every time limit (each test's, --timeout) of an image this host runs under emulation "
                   "(qemu-user: another platform's child of an index) by this much.")
@click.option("--memory", default="8g", show_default=True, help="Memory limit per container.")
@click.option("--cpus", type=click.FloatRange(0.1, 1024), default=None,
              help="CPU limit per container (default: 4, or this host's count if fewer).")
@click.option("--pids-limit", type=click.IntRange(64, 1 << 22), default=4096, show_default=True,
              help="Process/thread limit per container.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="JUnit XML, logs and expectations per image (default: smoke/ beside the report).")
@click.option("--harness", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="pytest for the containers, prepared elsewhere, for hosts without PyPI: a copy of the "
                   "OUT/.harness/pytest-* folder a run with PyPI leaves (default: pip installs it there once).")
@click.option("--force", is_flag=True, help="Run again where the same image already passed the same suite.")
@format_option("table", "json")
@reports_input_errors
def test_command(workdir: Path, report_path: Path | None, images: tuple[str, ...], matrix_path: Path | None, only: tuple[str, ...],
                 tier: str, gpus: str, timeout_s: int, emulation_factor: float, memory: str,
                 cpus: float | None, pids_limit: int, out: Path | None, harness: Path | None, force: bool, output_format: str) -> None:
    """Run the smoke tests (smoke_tests/) inside each image: the abi tier anywhere, the gpu tier on GPU hosts.

    Each image runs as its own non-root user with the network off, resource limits, a read-only
    root file system and a timeout. JUnit XML per image goes to OUT/<variant>/results/junit.xml;
    with a report, each variant's result goes into it (stages.smoke), and sign/push refuse
    variants whose smoke tests did not pass. Exit 1 when any image fails.

    \b
    Examples:
      imagebuild test                                   # every variant of .imagebuild/build-report.json
      imagebuild test --workdir out --only device=gpu
      imagebuild test --image 127.0.0.1:5000/imagebuild-example/paddle:3.3.1
      imagebuild test --tier abi --format json
    """
    from imagebuild.checks import smoke_run

    selection = Selection.parse(only)
    report_path = report_path or workdir / "build-report.json"
    if images and only:
        raise InputError("--only", None, "", "selects variants of a report; it does not apply to --image")
    if harness is not None and not (harness / "first" / "pytest").is_dir():
        raise InputError("--harness", None, str(harness), "has no first/pytest: not a folder `imagebuild test` prepared")
    if not re.fullmatch(r"\d+[bkmg]?", memory.lower()):
        raise InputError("--memory", None, "", f"'{memory}' is not a size like 8g or 512m")
    out = out or (Path(".imagebuild/smoke") if images else report_path.parent / "smoke")
    options = smoke_run.RunOptions(timeout_s=timeout_s, memory=memory, cpus=cpus or min(4.0, float(os.cpu_count() or 1)),
                               pids_limit=pids_limit, tier=tier, gpus=gpus, force=force,
                               emulation_factor=emulation_factor)

    def make_runner() -> smoke_run.SmokeRunner:  # called once the input checked out
        runner = smoke_run.SmokeRunner(smoke_run.docker_client(), options, out,
                                   harness or smoke_run.ensure_harness(out / ".harness"))
        echo(f"smoke tests: tier {tier}; GPUs: "
             f"{'requested for GPU variants' if runner.gpu_host else 'none on this host'}", err=True)
        return runner

    def progress(result: SmokeResult) -> None:
        echo(f"  {result.record.status:7} {result.name} ({_smoke_counts(result)})", err=True)

    # An interrupt removes the running container and marks its variant in the report (common.py).
    if images:
        results = smoke_run.run_images(images, matrix_path, make_runner, progress)
    else:
        report_at(report_path)
        results = smoke_run.run_report(report_path, matrix_path, selection, make_runner, progress)
    print_smoke_results(results, None if images else report_path, output_format)
    if any(r.record.status != "passed" for r in results):
        sys.exit(ExitCode.FAILED)


def _smoke_counts(r: SmokeResult) -> str:
    s = r.record
    timing = f", {s.duration_s:.1f} s" if s.duration_s is not None else ""
    return (f"{s.passed} passed, {s.failed + s.errors} failed, {s.skipped} skipped{timing}"
            + (", reused" if r.reused else ""))


def print_smoke_results(results: list[SmokeResult], report_path: Path | None, output_format: str) -> None:
    if output_format == "json":
        click.echo(json.dumps({
            "report": str(report_path) if report_path else None,
            "status": "passed" if all(r.record.status == "passed" for r in results) else "failed",
            "results": [{"name": r.name, "variant": r.variant, "reused": r.reused, **r.record.to_dict()}
                        for r in results],
        }, indent=2))
        return
    for r in results:
        s = r.record
        echo(f"{s.status.upper() if s.status != 'passed' else s.status:8} {r.name}  ({_smoke_counts(r)})")
        for failure in s.failures:
            echo(f"    FAILED {failure['test']}: {failure['message']}")
        if s.status != "passed" and s.reason and not s.failures:
            echo(f"    {s.reason}")
        reasons: dict[str, int] = {}
        for skip in s.skip_reasons:
            reasons[skip["reason"]] = reasons.get(skip["reason"], 0) + 1
        for reason, count in reasons.items():
            echo(f"    skipped ({count}): {reason}")
        if s.junit:
            echo(f"    junit: {s.junit}")
    passed = sum(r.record.status == "passed" for r in results)
    echo(f"{passed} of {len(results)} image(s) passed" + (f"; report: {report_path}" if report_path else ""))
