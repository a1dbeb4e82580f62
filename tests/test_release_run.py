"""imagebuild release: what a rerun may reuse, the per-variant summary, and bad input (exit 2, nothing written)."""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from imagebuild.core.report import BuildReport, ScanStage, VariantRecord
from imagebuild.release.pipeline import (
    STAGES,
    Cell,
    Outcome,
    ReleaseOptions,
    ReleaseRun,
    VariantRelease,
    carry_forward,
    earlier_stages,
    gate_inputs,
    scan_reusable,
)

from .conftest import run_imagebuild

OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64


def variant(vid: str, digest: str | None, stages: dict | None = None) -> VariantRecord:
    return VariantRecord.from_dict({"id": vid, "tags": [], "images": [], "chain": [], "device": "cpu",
                                    "paddle": "3.3.1", "python": "3.11", "cuda": None, "cudnn": None,
                                    "status": "built", "digest": digest, "image": f"r.example/p@{digest}",
                                    "stages": stages or {}})


def report(*variants: VariantRecord) -> BuildReport:
    return BuildReport(matrix="m.yaml", revision="r", registry="r.example", repository="r.example/p",
                       cache_repository="r.example/c", created="2026-12-01T00:00:00Z", variants=list(variants),
                       layers=[])


def test_a_rebuilt_report_gets_back_the_earlier_results_for_unchanged_digests_only(tmp_path: Path):
    path = tmp_path / "build-report.json"
    stages = {"smoke": {"status": "passed", "digest": OLD}, "sign": {"status": "passed", "digest": OLD}}
    report(variant("same", OLD, stages), variant("rebuilt", OLD, stages)).write(path)
    earlier = earlier_stages(path)
    new = report(variant("same", OLD), variant("rebuilt", NEW))
    new.write(path)  # a new build run: the stages are gone
    assert all(not v["stages"] for v in json.loads(path.read_text())["variants"])

    carried = carry_forward(path, new, earlier)

    by_id = {v.id: v for v in BuildReport.read(path).variants}
    assert carried == 2
    assert set(by_id["same"].stages) == {"smoke", "sign"}
    assert by_id["rebuilt"].stages == {}, "results about another digest must not stand for the new image"


def test_a_record_about_another_digest_is_not_carried_even_when_the_variant_kept_its_digest(tmp_path: Path):
    path = tmp_path / "build-report.json"
    report(variant("v", OLD, {"scan": {"status": "ok", "digest": NEW}})).write(path)
    earlier = earlier_stages(path)
    new = report(variant("v", OLD))
    new.write(path)
    assert carry_forward(path, new, earlier) == 0


def test_no_earlier_report_means_nothing_to_carry(tmp_path: Path):
    assert earlier_stages(tmp_path / "missing.json") == {}
    (tmp_path / "broken.json").write_text("{not json")
    assert earlier_stages(tmp_path / "broken.json") == {}


def scanned(tmp_path: Path, **changes) -> VariantRecord:
    for name in ("scan/v/image.json", "scan/v/sbom.cdx.json", "scan/config.json", "scan/summary.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    record = {"status": "ok", "digest": OLD, "trivy_version": "0.58.0", "db_updated_at": "2026-12-01T05:30:49Z",
              "scanned_at": "2026-12-01T05:40:00Z",
              "reports": {"image": "scan/v/image.json", "sbom": "scan/v/sbom.cdx.json", "config": "scan/config.json"}}
    record.update(changes)
    return variant("v", OLD, {"scan": record})


def test_a_scan_is_reused_only_with_the_same_digest_trivy_and_db(tmp_path: Path):
    assert scan_reusable(scanned(tmp_path), tmp_path, "0.58.0", "2026-12-01T05:30:49Z")
    assert not scan_reusable(scanned(tmp_path), tmp_path, "0.58.0", "2026-12-02T00:00:00Z"), "a new DB rescans"
    assert not scan_reusable(scanned(tmp_path), tmp_path, "0.59.0", "2026-12-01T05:30:49Z"), "a new Trivy rescans"
    assert not scan_reusable(scanned(tmp_path, digest=NEW), tmp_path, "0.58.0", "2026-12-01T05:30:49Z")
    assert not scan_reusable(scanned(tmp_path, status="failed"), tmp_path, "0.58.0", "2026-12-01T05:30:49Z")


def test_a_scan_whose_reports_are_gone_is_done_again(tmp_path: Path):
    v = scanned(tmp_path)
    (tmp_path / "scan/v/sbom.cdx.json").unlink()
    assert not scan_reusable(v, tmp_path, "0.58.0", "2026-12-01T05:30:49Z")


def test_the_gate_inputs_change_with_the_policy_the_scan_and_the_day(tmp_path: Path):
    v = scanned(tmp_path)
    today = dt.date(2026, 12, 1)
    base = gate_inputs(v, "sha256:p1", today)
    assert base == gate_inputs(scanned(tmp_path), "sha256:p1", today)
    assert base != gate_inputs(v, "sha256:p2", today)
    assert base != gate_inputs(v, "sha256:p1", today + dt.timedelta(days=1)), "exceptions expire by date"
    rescanned = scanned(tmp_path, scanned_at="2026-12-01T06:00:00Z")
    assert base != gate_inputs(rescanned, "sha256:p1", today)
    assert isinstance(v.stage(ScanStage), ScanStage)


def test_a_failing_stage_stops_its_variant_and_marks_the_later_stages_not_reached(tmp_path: Path):
    run = ReleaseRun(ReleaseOptions(workdir=tmp_path), scan_options=None, sign_options=None)
    run.results = {"a": VariantRelease("a"), "b": VariantRelease("b")}
    for vid in ("a", "b"):
        run._set(vid, "build", Cell(Outcome.REUSED, "reused"))
    run._set("a", "smoke", Cell(Outcome.FAILED, "failed", "test_import"))
    run._set("b", "smoke", Cell(Outcome.DONE, "passed"))

    assert run._going() == ["b"]
    a = run.results["a"]
    assert a.failed_stage == "smoke" and a.status == "failed"
    assert [a.stages[s].outcome for s in STAGES[2:]] == [Outcome.NOT_REACHED] * 4
    assert run.results["b"].failed_stage is None


def test_the_summary_says_nothing_new_only_when_every_stage_of_every_variant_was_reused(tmp_path: Path):
    run = ReleaseRun(ReleaseOptions(workdir=tmp_path), scan_options=None, sign_options=None)
    run.results = {"a": VariantRelease("a")}
    for name in STAGES[:-1]:
        run._set("a", name, Cell(Outcome.REUSED, "reused"))
    run._set("a", "push", Cell(Outcome.OFF, "not asked"))
    summary = run.summary()
    assert summary["nothing_new"] and summary["status"] == "released"
    run._set("a", "sign", Cell(Outcome.DONE, "signed"))
    assert not run.summary()["nothing_new"]
    assert run.summary()["variants"][0]["stages"]["sign"] == {"outcome": "done", "result": "signed", "detail": ""}


# --- bad input: one line on stderr, exit 2, nothing written ------------------------------------------

EXAMPLE = "examples/local/matrix.yaml"
KEY = "/var/lib/imagebuild/keys/cosign.key"


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--registry", "not a host"], {}, "--registry: not a host: is not a registry host[:port]"),
    (["--offline", "--db-repository", "r.example/db:2"], {}, "--offline uses the DB"),
    (["--trust", "examples/local/trust.yaml"], {}, "--trust: is for the push stage"),
    (["--push-to", "release"], {}, "--push-to: 'release' is not REGISTRY/REPOSITORY"),
    (["--push-to", "r.example.com/p", "--trust", "no/such.yaml"], {}, "no such trust config"),
    (["--key", "/no/such/key"], {}, "--key"),
    ([], {"COSIGN_PASSWORD": None}, "COSIGN_PASSWORD"),
    (["--only", "device=tpu"], {}, "selects no variant"),
])
def test_release_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, args, env, message):
    import os

    environ = {**os.environ, "COSIGN_PASSWORD": "x", **{k: v for k, v in env.items() if v is not None}}
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
    import subprocess
    import sys

    from .conftest import REPO_ROOT

    workdir = tmp_path / "work"
    result = subprocess.run([sys.executable, "-m", "imagebuild", "release", "--matrix", EXAMPLE, "--policy",
                             "examples/local/policy.yaml", "--workdir", str(workdir), "--key", KEY, *args],
                            cwd=REPO_ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not workdir.exists()


def test_a_bad_policy_is_named_with_its_line_before_anything_is_built(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("schema: 1\nseverity: SEVERE\n")
    result = run_imagebuild("release", "--matrix", EXAMPLE, "--policy", policy, "--workdir", tmp_path / "work",
                            env={"COSIGN_PASSWORD": "x"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {policy}:2: severity"), result.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("command", ["release", "rescan"])
def test_every_option_the_workflows_pass_is_one_the_command_takes(command):
    import re

    from .conftest import REPO_ROOT

    used: set[str] = set()
    for workflow in (REPO_ROOT / ".github" / "workflows").glob("*.yml"):
        for line in workflow.read_text().splitlines():
            match = re.search(rf"\bimagebuild {command}\b(.*)", line)
            if match:
                used |= set(re.findall(r"(--[a-z][a-z-]*)", match.group(1)))
    assert used, f"no workflow calls imagebuild {command}"
    shown = run_imagebuild(command, "--help")
    assert shown.returncode == 0
    for option in used:
        assert option in shown.stdout, f"a workflow passes {option} to imagebuild {command}"


def test_the_benchmark_runner_knows_every_benchmark_in_bench():
    import importlib.util
    import sys

    from .conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("run_all", REPO_ROOT / "bench" / "run_all.py")
    assert spec and spec.loader
    run_all = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = run_all  # dataclasses look their module up there
    spec.loader.exec_module(run_all)
    scripts = {path.name for path in (REPO_ROOT / "bench").glob("bench_*.py")}
    assert {b.script for b in run_all.BENCHES} == scripts


class ScriptedRun(ReleaseRun):
    """The orchestration alone: each stage answers from a script instead of doing the work."""

    script: dict[str, dict[str, Cell]] = {}

    def build(self, *_args) -> None:
        for vid in ("a", "b"):
            self.results[vid] = VariantRelease(vid)
            self._set(vid, "build", Cell(Outcome.REUSED, "reused"))

    def _stage(self, name: str, ids: list[str]) -> list[str]:
        self.calls.append((name, list(ids)))
        for vid, cell in self.script.get(name, {}).items():
            if vid in ids:
                self._set(vid, name, cell)
        return self._going()

    def smoke(self, ids):
        return self._stage("smoke", ids)

    def scan(self, ids):
        return self._stage("scan", ids)

    def gate(self, ids):
        return self._stage("gate", ids)

    def sign(self, ids):
        return self._stage("sign", ids)


def test_each_stage_gets_only_the_variants_still_going_and_a_missing_result_is_a_failure(tmp_path: Path):
    done = Cell(Outcome.DONE, "ok")
    run = ScriptedRun(ReleaseOptions(workdir=tmp_path), scan_options=None, sign_options=None)
    run.calls = []
    run.script = {"smoke": {"a": done, "b": done}, "scan": {"a": Cell(Outcome.FAILED, "failed", "trivy"), "b": done},
                  "gate": {"b": done}, "sign": {}}  # sign says nothing about b: cut short
    run.run(None, None, "rev", "created", "sha256:m")
    assert run.calls == [("smoke", ["a", "b"]), ("scan", ["a", "b"]), ("gate", ["b"]), ("sign", ["b"])]
    a, b = run.results["a"], run.results["b"]
    assert a.failed_stage == "scan" and a.stages["push"].outcome is Outcome.NOT_REACHED
    assert b.failed_stage == "sign" and b.stages["sign"].word == "no result"
    assert run.summary()["status"] == "failed"
