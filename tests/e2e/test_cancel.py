"""Cancellation and failure, for real: SIGTERM (a CI cancel) in the middle of a BuildKit build, a
Trivy scan and a smoke container; and an unexpected error inside a stage.

A CPU-only copy of the example matrix keeps these off the 3 GB GPU chain: its base, python and
paddle layers are the example's own (same keys), so they are reused when the registry has them.
Processes are checked with pgrep, containers with the docker SDK, tags with plain registry HEADs:
none of them through imagebuild's own code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .conftest import (
    REPO,
    STAGING,
    copy_matrix,
    imagebuild,
    trivy_cache_with_db,
    unique,
)

CPU_VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
CPU_TAG = "3.3.1"
STARTUP_S = 1500  # a cold machine builds the CPU chain (Paddle from PyPI) before the step under test
STOP_S = 30  # a cancelled command must be gone within this

MANIFESTS = ("application/vnd.docker.distribution.manifest.v2+json, "
             "application/vnd.docker.distribution.manifest.list.v2+json, "
             "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json")


def cpu_only(repository: str, extra_layers: list[dict] | None = None):
    """An edit for copy_matrix: the example's CPU variant alone, in a repository of its own."""

    def edit(data: dict) -> None:
        data["repository"] = repository
        data["matrix"] = {"os": ["debian12"], "cuda": ["cpu"], "python": ["3.11"], "paddle": ["3.3.1"]}
        data.pop("cuda", None)
        if extra_layers:
            data["extra_layers"] = extra_layers

    return edit


def tag_status(repository: str, tag: str) -> tuple[int, str | None]:
    """(HTTP status, digest) of a HEAD on the tag in the staging registry."""
    response = httpx.head(f"http://{STAGING}/v2/imagebuild-example/{repository}/manifests/{tag}",
                          headers={"Accept": MANIFESTS}, timeout=30)
    return response.status_code, response.headers.get("Docker-Content-Digest")


def pids(pattern: str) -> list[str]:
    """Processes whose command line matches `pattern` (a pgrep -f regular expression)."""
    return subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False).stdout.split()


def gone_within(pattern: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while pids(pattern):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


@dataclass
class Background:
    """`python -m imagebuild ...` running in the background, its output in a file."""

    proc: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, log: Path, *args: str | Path, env: dict[str, str] | None = None) -> Background:
        handle = log.open("w")
        proc = subprocess.Popen([sys.executable, "-m", "imagebuild", *map(str, args)], cwd=REPO,
                                stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        handle.close()
        return cls(proc, log)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, ready, timeout: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                pytest.fail(f"imagebuild ended (exit {self.proc.returncode}) before {what}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"no {what} after {timeout} s:\n{self.output()[-4000:]}")
            time.sleep(0.5)

    def terminate(self) -> float:
        """SIGTERM, as a CI cancel sends it; returns the seconds it took to exit."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_S * 4)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"imagebuild still running {STOP_S * 4} s after SIGTERM:\n{self.output()[-4000:]}")
        return time.monotonic() - started

    def last_line(self) -> str:
        return self.output().strip().splitlines()[-1]


def layers_by_name(report: dict) -> dict[str, dict]:
    return {layer["path"]: layer for layer in report["layers"]}


def slow_step(nonce: str) -> str:
    """A RUN step that sleeps for an hour unless a build secret is mounted (which the key does not see),
    so a rerun of the very same layer is quick. Its shell's command line holds `nonce`."""
    return f"if test -s /run/secrets/netrc; then echo rerun; else sleep 3600; fi; echo {nonce}"


# --- build ------------------------------------------------------------------------------------------


def test_sigterm_stops_the_build_and_buildkit_keeps_what_finished_and_tags_nothing(
        engine, staging_registry, tmp_path, fresh_repository):
    nonce = uuid.uuid4().hex
    matrix = copy_matrix(tmp_path, cpu_only(fresh_repository, [
        {"name": "quick", "run": [f"echo {nonce} > /etc/imagebuild-e2e-quick"]},
        {"name": "slow", "run": [slow_step(nonce)]},
    ]))
    workdir = tmp_path / "w"
    build = Background.start(tmp_path / "build.log", "build", "--matrix", matrix, "--workdir", workdir)
    # The quick layer's RUN holds the nonce too, but only for an instant; the slow one stays.
    build.wait_for("the slow RUN step inside BuildKit", lambda: pids(f"sleep 3600; fi; echo {nonce}"))

    seconds = build.terminate()

    assert build.proc.returncode == 143, build.output()[-3000:]
    assert seconds < STOP_S
    assert "Traceback" not in build.output()
    assert build.last_line() == (f"interrupted by SIGTERM: build stopped, its running tools with it "
                                 f"(report: {workdir / 'build-report.json'})")
    # Killing the docker client cancels the build inside dockerd too: the RUN step's process goes.
    assert gone_within(nonce, 15), "the RUN step of the cancelled build is still running in BuildKit"
    assert gone_within(f"docker build .*{re.escape(str(tmp_path))}", 5), "a docker build client was left"

    report = json.loads((workdir / "build-report.json").read_text())
    assert report["status"] == "interrupted"
    layers = layers_by_name(report)
    quick = layers.pop("extra/debian12-py3.11-paddle3.3.1-quick")
    slow = layers.pop("extra/debian12-py3.11-paddle3.3.1-quick-slow")
    release = layers.pop(f"release/{CPU_VARIANT}")
    assert quick["status"] == "built" and quick["digest"].startswith("sha256:")
    assert (slow["status"], slow["error"]) == ("skipped", "interrupted")
    assert (release["status"], release["error"]) == ("skipped", "interrupted")
    assert {layer["status"] for layer in layers.values()} <= {"built", "reused"}  # base, python, paddle
    variant = report["variants"][0]
    assert variant["status"] != "built" and variant["digest"] is None
    assert tag_status(fresh_repository, CPU_TAG)[0] == 404

    # The rerun finishes the job: what was built is reused, the rest is built, then tagged.
    rerun = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir),
                       env={"IMAGEBUILD_NETRC": f"machine rerun.invalid login e2e password {nonce}",
                            "IMAGEBUILD_SECRET_ENV": "IMAGEBUILD_NETRC"})
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr[-3000:]
    report = json.loads((workdir / "build-report.json").read_text())
    layers = layers_by_name(report)
    assert layers["extra/debian12-py3.11-paddle3.3.1-quick"]["status"] == "reused"
    assert layers["extra/debian12-py3.11-paddle3.3.1-quick"]["digest"] == quick["digest"]
    assert layers["extra/debian12-py3.11-paddle3.3.1-quick-slow"]["status"] == "built"
    variant = report["variants"][0]
    assert variant["status"] == "built"
    assert tag_status(fresh_repository, CPU_TAG) == (200, variant["digest"])


def test_a_layer_that_outlives_its_timeout_fails_with_the_reason(built_cpu, tmp_path, fresh_repository):
    nonce = uuid.uuid4().hex
    matrix = copy_matrix(tmp_path, cpu_only(fresh_repository, [{"name": "slow", "run": [slow_step(nonce)]}]))
    workdir = tmp_path / "w"  # the chain below the slow layer is built_cpu's, so only it meets the limit
    timed = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir), "--layer-timeout", "20",
                       timeout=STARTUP_S)
    assert timed.returncode == 1, timed.stdout + timed.stderr[-3000:]
    report = json.loads((workdir / "build-report.json").read_text())
    slow = layers_by_name(report)["extra/debian12-py3.11-paddle3.3.1-slow"]
    assert (slow["status"], slow["error"]) == ("failed", "timed out after 20 s")
    assert 20 <= slow["duration_s"] < 20 + STOP_S
    assert gone_within(nonce, 15)
    assert tag_status(fresh_repository, CPU_TAG)[0] == 404


def test_an_unexpected_error_in_the_build_writes_the_report_and_ends_in_one_line(
        built_cpu, tmp_path, fresh_repository):
    matrix = copy_matrix(tmp_path, cpu_only(fresh_repository, [
        {"name": "marker", "run": [f"echo {uuid.uuid4().hex} > /etc/imagebuild-e2e-marker"]}]))
    workdir = tmp_path / "w"
    dry = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    planned = json.loads((workdir / "build-report.json").read_text())
    to_build = [layer for layer in planned["layers"] if layer["status"] == "to-build"]
    assert [layer["kind"] for layer in to_build] == ["extra", "release"]
    # A directory where the build wants to write a layer's log: an error no input check foresees.
    for layer in to_build:
        (workdir / "logs" / f"{layer['kind']}-{layer['key'][:12]}.log").mkdir(parents=True)

    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir))

    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert errors == [run.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith("error: build: [Errno 21] Is a directory: ")
    assert errors[0].endswith(f"(report: {workdir / 'build-report.json'})")
    report = json.loads((workdir / "build-report.json").read_text())
    assert report["status"] == "failed"
    statuses = {layer["kind"]: (layer["status"], layer["error"] or "") for layer in report["layers"]}
    assert statuses["extra"][0] == "failed" and "IsADirectoryError" in statuses["extra"][1]
    assert statuses["release"][0] == "skipped" and "Is a directory" in statuses["release"][1]
    assert tag_status(fresh_repository, CPU_TAG)[0] == 404

    debug = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir), env={"IMAGEBUILD_DEBUG": "1"})
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "IsADirectoryError" in debug.stderr


# --- scan and smoke tests on one built CPU variant ------------------------------------------------------


@dataclass
class BuiltCpu:
    matrix: Path
    workdir: Path

    def copy(self, target: Path) -> Path:
        target.mkdir(parents=True)
        shutil.copy(self.workdir / "build-report.json", target / "build-report.json")
        return target


@pytest.fixture(scope="module")
def built_cpu(engine, staging_registry, tmp_path_factory) -> BuiltCpu:
    folder = tmp_path_factory.mktemp("cancel-cpu")
    matrix = copy_matrix(folder, cpu_only(unique("e2e-cancel")))
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(folder / "w"))
    assert run.returncode == 0, f"the CPU build failed:\n{run.stdout}\n{run.stderr[-4000:]}"
    return BuiltCpu(matrix, folder / "w")


def scan_args(workdir: Path, cache: Path, built: BuiltCpu) -> list[str | Path]:
    return ["scan", "--workdir", workdir, "--cache-dir", cache, "--offline",
            "--dockerfiles", built.matrix.parent / "dockerfiles"]


def test_sigterm_during_a_scan_stops_trivy_and_claims_no_scan(built_cpu, trivy, trivy_db, tmp_path):
    workdir = built_cpu.copy(tmp_path / "w")
    cache = trivy_cache_with_db(trivy_db, tmp_path / "trivy-cache").resolve()  # cold: the scan takes a while
    trivy_image = f"image --cache-dir {re.escape(str(cache))} "
    scan = Background.start(tmp_path / "scan.log", *scan_args(workdir, cache, built_cpu))
    scan.wait_for("trivy image running", lambda: pids(trivy_image), timeout=300)
    time.sleep(1)

    seconds = scan.terminate()

    assert scan.proc.returncode == 143, scan.output()[-3000:]
    assert seconds < STOP_S
    assert scan.last_line().startswith("interrupted by SIGTERM: scan stopped")
    assert "Traceback" not in scan.output()
    assert gone_within(re.escape(str(cache)), 5), "a trivy process of the cancelled scan is still running"
    record = json.loads((workdir / "build-report.json").read_text())["variants"][0]["stages"]["scan"]
    assert (record["status"], record["error"]) == ("interrupted", "interrupted")
    built = json.loads((built_cpu.workdir / "build-report.json").read_text())["variants"][0]
    assert record["digest"] == built["digest"]


def test_an_unexpected_error_in_the_scan_is_recorded_and_ends_in_one_line(built_cpu, trivy, trivy_db, tmp_path):
    workdir = built_cpu.copy(tmp_path / "w")
    cache = trivy_cache_with_db(trivy_db, tmp_path / "trivy-cache")
    (workdir / "scan").mkdir()
    (workdir / "scan" / CPU_VARIANT).write_text("a file where the scan keeps this image's reports\n")

    run = imagebuild(*map(str, scan_args(workdir, cache, built_cpu)))

    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: scan: [Errno 17] File exists: ")
    assert last.endswith(f"(report: {workdir / 'build-report.json'})")
    record = json.loads((workdir / "build-report.json").read_text())["variants"][0]["stages"]["scan"]
    assert record["status"] == "failed" and "File exists" in record["error"]


def test_sigterm_during_the_smoke_tests_removes_the_container(engine, built_cpu, tmp_path):
    workdir = built_cpu.copy(tmp_path / "w")
    smoke = Background.start(tmp_path / "test.log", "test", "--workdir", workdir, "--tier", "abi")

    def ours(all_states: bool) -> list:
        # The run label's value starts with the pid of the imagebuild process that made the container.
        found = engine.containers.list(all=all_states, filters={"label": "io.imagebuild.run"})
        return [c for c in found if c.labels["io.imagebuild.run"].startswith(f"{smoke.proc.pid}-")]

    smoke.wait_for("a smoke container running", lambda: ours(all_states=False), timeout=600)
    time.sleep(1)

    seconds = smoke.terminate()

    assert smoke.proc.returncode == 143, smoke.output()[-3000:]
    assert seconds < STOP_S
    assert smoke.last_line().startswith("interrupted by SIGTERM: test stopped")
    assert ours(all_states=True) == [], "a container of the cancelled smoke run is left"
    record = json.loads((workdir / "build-report.json").read_text())["variants"][0]["stages"]["smoke"]
    assert (record["status"], record["reason"]) == ("interrupted", "interrupted")


def test_the_scan_timeout_stops_a_scan_that_takes_longer(built_cpu, trivy, trivy_db, tmp_path):
    workdir = built_cpu.copy(tmp_path / "w")
    cache = trivy_cache_with_db(trivy_db, tmp_path / "trivy-cache")  # cold: analysing the image takes long
    started = time.monotonic()
    run = imagebuild(*map(str, scan_args(workdir, cache, built_cpu)), "--timeout", "3s")
    assert run.returncode == 1, run.stdout + run.stderr
    assert time.monotonic() - started < 120
    record = json.loads((workdir / "build-report.json").read_text())["variants"][0]["stages"]["scan"]
    assert record["status"] == "failed"
    assert "context deadline exceeded" in record["error"] or "timed out after" in record["error"]
    assert record["duration_s"] < 3 + 60 + STOP_S  # Trivy's own limit, or ours a minute later
    assert not pids(re.escape(str(cache.resolve())))


def test_an_unexpected_error_in_the_smoke_tests_is_recorded_and_ends_in_one_line(engine, built_cpu, tmp_path):
    workdir = built_cpu.copy(tmp_path / "w")
    (workdir / "smoke").mkdir()
    (workdir / "smoke" / CPU_VARIANT).write_text("a file where the run keeps this image's results\n")

    run = imagebuild("test", "--workdir", str(workdir), "--tier", "abi")

    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: test: [Errno 20] Not a directory: ")
    assert last.endswith(f"(report: {workdir / 'build-report.json'})")
    record = json.loads((workdir / "build-report.json").read_text())["variants"][0]["stages"]["smoke"]
    assert record["status"] == "error" and "Not a directory" in record["reason"]


def test_an_unexpected_error_in_the_gate_keeps_its_verdict_and_ends_in_one_line(built_cpu, trivy, trivy_db, tmp_path):
    workdir = built_cpu.copy(tmp_path / "w")
    scan = imagebuild(*map(str, scan_args(workdir, trivy_cache_with_db(trivy_db, tmp_path / "trivy-cache"),
                                          built_cpu)), timeout=900)
    assert scan.returncode == 0, scan.stdout + scan.stderr[-3000:]
    (workdir / "gate" / "result.json").mkdir(parents=True)  # where the gate writes its result file

    run = imagebuild("gate", "--workdir", str(workdir), "--policy", str(REPO / "examples/local/policy.yaml"))

    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: gate: [Errno 21] Is a directory: ")
    assert last.endswith(f"(report: {workdir / 'build-report.json'})")
    variant = json.loads((workdir / "build-report.json").read_text())["variants"][0]
    assert variant["stages"]["gate"]["digest"] == variant["digest"]  # the verdict was recorded before the error
    assert variant["stages"]["gate"]["status"] in ("passed", "failed")
