"""Every stage after the build, per platform, on the example's two-platform variant (Paddle 3.2.2 CPU).

The signed example (conftest: built, smoke-tested, scanned, gated and signed once per session) shows
each child judged on its own digest: the smoke suite in each, the arm64 one under qemu; Trivy and the
gate over each; a signature for the index and for each child that `cosign verify` accepts. Then a copy
of the matrix whose variant gets one extra smoke test that fails only on aarch64: `imagebuild release`
blocks the whole variant, names the platform, and signs nothing for it (its layers are all reused: the
extra test is not image content).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .conftest import EXAMPLE_POLICY, copy_matrix, imagebuild, trivy_cache_with_db

VARIANT = "paddle3.2.2-cpu-py3.11-debian12"
PLATFORMS = ["linux/amd64", "linux/arm64"]


def the_variant(report: dict) -> dict:
    return next(v for v in report["variants"] if v["id"] == VARIANT)


def junit_outcomes(path: str) -> dict[str, str]:
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        word = next((w for tag, w in (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
                     if case.find(tag) is not None), "passed")
        outcomes[case.get("name", "")] = word
    return outcomes


def test_smoke_runs_in_each_child_and_the_arm64_one_imports_paddle_as_aarch64(signed_example):
    v = the_variant(signed_example.report)
    smoke = v["stages"]["smoke"]
    assert smoke["status"] == "passed" and smoke["digest"] == v["digest"]
    children = {c["platform"]: c["digest"] for c in v["children"]}
    assert list(smoke["per_platform"]) == PLATFORMS
    for platform, record in smoke["per_platform"].items():
        assert record["status"] == "passed" and record["digest"] == children[platform]
        outcomes = junit_outcomes(record["junit"])
        assert outcomes["test_paddle_imports_at_the_expected_version"] == "passed"
        assert outcomes["test_runs_as_the_platform_machine"] == "passed", f"{platform} is not its own machine"
    arm = smoke["per_platform"]["linux/arm64"]
    assert arm["emulated"] is True and arm["time_factor"] > 1
    expect = json.loads((Path(arm["junit"]).parents[1] / "expect.json").read_text())
    assert expect["platform"]["machine"] == "aarch64"
    assert any("runs under emulation" in s["reason"] for s in arm["skip_reasons"]), "the gpu tier must skip, saying why"


def test_scan_and_gate_judge_each_child_with_its_own_sbom(signed_example):
    v = the_variant(signed_example.report)
    children = {c["platform"]: c["digest"] for c in v["children"]}
    for stage, passing in (("scan", "ok"), ("gate", "passed")):
        record = v["stages"][stage]
        assert record["status"] == passing and list(record["per_platform"]) == PLATFORMS
        assert {p: r["digest"] for p, r in record["per_platform"].items()} == children
        assert all(r["status"] == passing for r in record["per_platform"].values())
    sboms = {p: signed_example.workdir / r["reports"]["sbom"] for p, r in v["stages"]["scan"]["per_platform"].items()}
    assert len(set(sboms.values())) == 2 and all(path.is_file() for path in sboms.values())


def test_the_index_and_each_child_carry_a_signature_cosign_verifies(signed_example, cosign):
    v = the_variant(signed_example.report)
    repository = v["image"].partition("@")[0]
    sign = v["stages"]["sign"]
    assert sign["status"] == "passed" and list(sign["per_platform"]) == PLATFORMS
    for digest in [v["digest"], *(c["digest"] for c in v["children"])]:
        proc = subprocess.run([cosign, "verify", "--key", str(signed_example.public_key), "--insecure-ignore-tlog",
                               "--allow-http-registry", f"{repository}@{digest}"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, f"{repository}@{digest}: {proc.stderr[-2000:]}"
        assert digest in proc.stdout, "the signature must be over this very digest"
    for platform, record in sign["per_platform"].items():
        kinds = {a["type"] for a in record["attestations"]}
        assert {"smoke", "vuln", "gate", "sbom"} <= kinds, f"{platform} lacks its own predicates"
    assert {a["type"] for a in sign["attestations"]} >= {"release"}


def fails_on_aarch64(tmp_path: Path) -> Path:
    """A copy of the example whose 3.2.2 variant runs one more smoke test, which fails only on aarch64."""
    extra = tmp_path / "smoke_extra"
    extra.mkdir()
    (extra / "test_not_aarch64.py").write_text(
        "import platform\n\n\ndef test_this_is_not_aarch64():\n"
        "    assert platform.machine() != 'aarch64', 'an expectation only the arm64 child fails'\n")

    def edit(data: dict) -> None:
        entry = next(e for e in data["matrix"]["include"] if e.get("paddle") == "3.2.2")
        entry["smoke"] = ["smoke_extra/"]

    return copy_matrix(tmp_path, edit)


def test_a_child_that_fails_its_smoke_tests_blocks_the_whole_variant(built_example, trivy_db, cosign_keys, tmp_path):
    matrix = fails_on_aarch64(tmp_path)
    workdir = tmp_path / "work"
    cache_dir = trivy_cache_with_db(trivy_db, tmp_path / "trivy")
    run = imagebuild("release", "--matrix", str(matrix), "--workdir", str(workdir), "--offline", "--cache-dir",
                     str(cache_dir), "--policy", str(EXAMPLE_POLICY), "--key", str(cosign_keys["key"]),
                     "--only", f"id={VARIANT}", "--tier", "abi", "--format", "json",
                     env={"COSIGN_PASSWORD": cosign_keys["password"]}, timeout=900)
    assert run.returncode == 1, f"the release must fail:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    summary = json.loads(run.stdout)
    released = next(v for v in summary["variants"] if v["id"] == VARIANT)
    assert released["status"] == "failed" and released["failed_stage"] == "smoke"
    assert released["stages"]["smoke"]["detail"].startswith("linux/arm64: ")
    assert all(released["stages"][s]["outcome"] == "not reached" for s in ("scan", "gate", "sign", "push"))
    v = the_variant(json.loads((workdir / "build-report.json").read_text()))
    assert v["status"] == "failed" and v["error"].startswith("linux/arm64: smoke tests failed")
    assert "test_this_is_not_aarch64" in v["error"]
    assert v["stages"]["smoke"]["per_platform"]["linux/amd64"]["status"] == "passed"
    assert "sign" not in v["stages"], "nothing is signed for a blocked variant"
    assert not (workdir / "sign" / VARIANT).exists()
