"""Every stage after the build, per platform: a multi-platform variant's index is judged by each child.

Pure parts only (records, expectations, the gate over children, the blocking rule); the e2e side is
tests/e2e/test_platform_stages.py.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from imagebuild.checks import gate
from imagebuild.checks.gate_run import variant_record
from imagebuild.checks.smoke import (
    ARCHITECTURES,
    Expectations,
    platform_expect,
    targets_for_children,
)
from imagebuild.core.report import (
    BuildReport,
    ChildImage,
    GateStage,
    LayerRecord,
    ScanStage,
    SmokeStage,
    StageStatus,
    VariantRecord,
    record_blocked,
)
from imagebuild.core.source import parse_document
from imagebuild.trust import provenance
from imagebuild.trust.attest import PredicateError

from .trivy_reports import TODAY, os_pkgs, report, vuln

REPO = "127.0.0.1:5000/e/paddle"
INDEX = "sha256:" + "1" * 64
AMD64 = "sha256:" + "a" * 64
ARM64 = "sha256:" + "b" * 64
CHILDREN = [ChildImage("linux/amd64", AMD64), ChildImage("linux/arm64", ARM64)]


def variant(**stages) -> VariantRecord:
    return VariantRecord(id="paddle3.2.2-cpu", tags=["3.2.2"], images=[f"{REPO}:3.2.2"], chain=["k-amd", "k-arm"],
                         device="cpu", paddle="3.2.2", python="3.11", cuda=None, cudnn=None, status="built",
                         digest=INDEX, image=f"{REPO}@{INDEX}", platforms=["linux/amd64", "linux/arm64"],
                         children=list(CHILDREN), stages=dict(stages))


def smoke(digest: str, status: str = "passed", reason: str | None = None) -> SmokeStage:
    return SmokeStage(status=status, image=f"{REPO}@{digest}", digest=digest, reason=reason, passed=9,
                      tiers=["abi", "gpu"])


# --- the variant's record of a per-platform stage ----------------------------------------------------


def test_an_index_passes_a_stage_only_when_every_child_passed_on_its_own_digest():
    record = SmokeStage.of_children(INDEX, f"{REPO}@{INDEX}", [(CHILDREN[0], smoke(AMD64)), (CHILDREN[1], smoke(ARM64))])
    assert record.status == StageStatus.PASSED and record.digest == INDEX and record.passed == 18
    assert variant(smoke=record).refusal(SmokeStage) is None
    assert record.for_platform("linux/arm64") == smoke(ARM64)


def test_the_first_child_that_failed_names_the_variants_failure_by_platform():
    failing = smoke(ARM64, "failed", "1 test(s) failed, first: test_abi.py::test_runs_as_the_platform_machine")
    record = SmokeStage.of_children(INDEX, f"{REPO}@{INDEX}", [(CHILDREN[0], smoke(AMD64)), (CHILDREN[1], failing)])
    assert record.status == StageStatus.FAILED
    assert record.reason == "linux/arm64: smoke tests failed: 1 test(s) failed, first: " \
                            "test_abi.py::test_runs_as_the_platform_machine"
    assert variant(smoke=record).stage_problem(SmokeStage) == record.reason


def test_a_child_record_about_another_digest_refuses_the_variant_naming_that_platform():
    stale = SmokeStage.of_children(INDEX, None, [(CHILDREN[0], smoke(AMD64)),
                                                 (ChildImage("linux/arm64", "sha256:" + "c" * 64),
                                                  smoke("sha256:" + "c" * 64))])
    why = variant(smoke=stale).refusal(SmokeStage)
    assert why is not None and why.startswith("paddle3.2.2-cpu: linux/arm64: smoke tests ran on sha256:ccc")


def test_a_record_without_children_does_not_pass_an_index():
    # Written by a run that never reached the children (an error, an older imagebuild): it says nothing of them.
    flat = GateStage(status="passed", digest=INDEX, image=f"{REPO}@{INDEX}")
    assert "no per-platform result" in (variant(gate=flat).stage_problem(GateStage) or "")


def test_a_single_platform_record_keeps_its_shape():
    data = smoke(AMD64).to_dict()
    assert "per_platform" not in data and "emulated" not in data and "time_factor" not in data
    assert SmokeStage.from_dict(data) == smoke(AMD64)


def test_per_platform_records_survive_the_report_round_trip():
    record = ScanStage.of_children(INDEX, None, [(c, ScanStage(status="ok", digest=c.digest)) for c in CHILDREN])
    again = VariantRecord.from_dict(json.loads(json.dumps(variant(scan=record).to_dict())))
    assert [i.record for i in again.platform_images(ScanStage)] == [ScanStage(status="ok", digest=AMD64),
                                                                    ScanStage(status="ok", digest=ARM64)]
    assert [i.image for i in again.platform_images(ScanStage)] == [f"{REPO}@{AMD64}", f"{REPO}@{ARM64}"]


# --- smoke expectations per architecture, and emulation ---------------------------------------------


def test_each_child_is_a_target_by_its_own_digest_and_platform():
    targets = targets_for_children(variant())
    assert [(t.image, t.digest, t.platform) for t in targets] == [
        (f"{REPO}@{AMD64}", AMD64, "linux/amd64"), (f"{REPO}@{ARM64}", ARM64, "linux/arm64")]


@pytest.mark.parametrize(("platform", "machine", "multiarch", "elf"), [
    ("linux/amd64", "x86_64", "x86_64-linux-gnu", 62), ("linux/arm64", "aarch64", "aarch64-linux-gnu", 183)])
def test_the_expectations_say_what_the_platform_is_inside_the_image(platform, machine, multiarch, elf):
    expect = Expectations(variant="v", image="i", device="cpu", paddle="3.2.2", python="3.11", cuda=None, cudnn=None,
                          labels_expected={}, labels_actual={}, platform=platform_expect(platform, "x86_64", 5.0))
    found = expect.to_json()["platform"]
    assert (found["platform"], found["machine"], found["multiarch"], found["elf_machine"]) == (platform, machine,
                                                                                                 multiarch, elf)


def test_the_foreign_platform_runs_emulated_with_its_time_limits_scaled():
    assert platform_expect("linux/amd64", "x86_64", 5.0) == platform_expect("linux/amd64", "x86_64", 1.0)
    assert platform_expect("linux/amd64", "x86_64", 5.0).time_factor == 1.0
    arm = platform_expect("linux/arm64", "x86_64", 5.0)
    assert arm.emulated and arm.time_factor == 5.0
    native_arm = platform_expect("linux/arm64", "aarch64", 5.0)
    assert not native_arm.emulated and native_arm.time_factor == 1.0
    assert platform_expect("linux/amd64", "aarch64", 3.0).time_factor == 3.0


def test_without_a_known_platform_the_expectations_stay_as_they_were():
    plain = Expectations(variant="v", image="i", device="cpu", paddle="3.2.2", python="3.11", cuda=None, cudnn=None,
                         labels_expected={}, labels_actual={})
    assert "platform" not in plain.to_json()
    assert set(ARCHITECTURES) == {"amd64", "arm64"}


# --- the gate over children ------------------------------------------------------------------------------


def scans(arm_findings: tuple[gate.Finding, ...]) -> list[gate.ImageScan]:
    return [gate.ImageScan("paddle3.2.2-cpu", f"{REPO}@{AMD64}", AMD64, (), platform="linux/amd64"),
            gate.ImageScan("paddle3.2.2-cpu", f"{REPO}@{ARM64}", ARM64, arm_findings, platform="linux/arm64")]


POLICY = gate.parse_policy(parse_document("schema: 1\n" + textwrap.dedent("""
    severity: HIGH
    """), "policies/vulnerabilities.yaml"))
EXPAT = vuln("CVE-2024-28757", "libexpat1", "2.5.0-1+deb12u2", fixed="2.5.0-1+deb12u4")


def test_the_gate_judges_each_child_and_the_variant_passes_only_if_all_do():
    arm_only = tuple(gate.findings(report(os_pkgs(EXPAT))))
    result = gate.evaluate(POLICY, scans(arm_only), TODAY)
    assert [(v.platform, v.passed) for v in result.images] == [("linux/amd64", True), ("linux/arm64", False)]
    record = variant_record(variant(), result)
    assert record.status == StageStatus.FAILED
    assert record.for_platform("linux/amd64").status == StageStatus.PASSED
    assert variant(gate=record).stage_problem(GateStage) == "linux/arm64: the gate did not pass (CVE-2024-28757 libexpat1)"


def test_two_clean_children_pass_the_gate():
    record = variant_record(variant(), gate.evaluate(POLICY, scans(()), TODAY))
    assert record.status == StageStatus.PASSED and variant(gate=record).stage_problem(GateStage) is None


# --- signing a child, and the index's release record --------------------------------------------------


def test_a_child_is_signed_as_a_variant_of_its_own_platform():
    report = BuildReport(matrix="m", revision="r", registry="127.0.0.1:5000", repository="e/paddle",
                         cache_repository="e/cache", created="2026-12-02T00:00:00Z", variants=[],
                         layers=[LayerRecord("k-amd", "release", "p", "i", platform="linux/amd64"),
                                 LayerRecord("k-arm", "release", "p", "i", platform="linux/arm64")])
    smoke_record = SmokeStage.of_children(INDEX, None, [(CHILDREN[0], smoke(AMD64)), (CHILDREN[1], smoke(ARM64))])
    child = report.child_variant(variant(smoke=smoke_record), CHILDREN[1])
    assert (child.digest, child.image, child.platforms, child.chain) == (ARM64, f"{REPO}@{ARM64}", ["linux/arm64"],
                                                                         ["k-arm"])
    assert child.stage(SmokeStage) == smoke(ARM64) and not child.multi_platform


def layout() -> provenance.SignatureLayout:
    return provenance.SignatureLayout(layout="tag", signature="s", attestations="a", key="k", keyless=False,
                                      tlog=False, cosign_version="v2.6.5")


def test_the_index_release_record_names_each_childs_release():
    children = [provenance.ChildRelease(c.platform, c.digest, {"digest": c.digest, "smoke": {"status": "passed"},
                                                               "gate": {"decision": "passed"}}) for c in CHILDREN]
    release = provenance.index_release_predicate(variant(), provenance={"p": 1}, children=children, signature=layout())
    assert release["digest"] == INDEX
    assert [(p["platform"], p["digest"], p["smoke"], p["gate"]) for p in release["platforms"]] == [
        ("linux/amd64", AMD64, "passed", "passed"), ("linux/arm64", ARM64, "passed", "passed")]


def test_an_index_release_record_missing_a_child_is_refused():
    one = [provenance.ChildRelease("linux/amd64", AMD64, {"digest": AMD64})]
    with pytest.raises(PredicateError, match="each child"):
        provenance.index_release_predicate(variant(), provenance={}, children=one, signature=layout())


# --- the blocking rule -----------------------------------------------------------------------------------


def test_a_blocked_variant_is_failed_in_the_report_with_its_platform_named(tmp_path: Path):
    report = BuildReport(matrix="m", revision="r", registry="127.0.0.1:5000", repository="e/paddle",
                         cache_repository="e/cache", created="2026-12-02T00:00:00Z", variants=[variant()], layers=[])
    path = tmp_path / "build-report.json"
    report.write(path)
    record_blocked(path, "paddle3.2.2-cpu", "linux/arm64: smoke tests failed: ...")
    again = BuildReport.read(path).variants[0]
    assert again.status == "failed" and again.error == "linux/arm64: smoke tests failed: ..."
    assert again.refusal(SmokeStage) == "paddle3.2.2-cpu: not built (status failed)"
