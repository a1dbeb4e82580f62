"""The build report: status words, typed stage records, and one locked read-modify-write.

The concurrency test runs real processes against one file, as a build, `imagebuild test`,
`scan` and `gate` on one workdir do.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from imagebuild.core.report import (
    REPORT_SCHEMA,
    BuildReport,
    GateStage,
    LayerRecord,
    LayerStatus,
    ReportStatus,
    ScanStage,
    SignStage,
    SmokeStage,
    StageRecord,
    StageStatus,
    VariantRecord,
    VariantStatus,
    record_stage,
    update_report,
)
from imagebuild.core.source import InputError

VARIANTS = ["v-cpu", "v-gpu", "v-gpu-py310", "v-cpu-py310"]


def sample_report(run_id: str = "run-1") -> BuildReport:
    layers = [LayerRecord(key=f"k{i}", kind="base", path=f"base/l{i}", image=f"r/c:base-k{i}") for i in range(6)]
    variants = [VariantRecord(id=vid, tags=[vid], images=[f"r/p:{vid}"], chain=["k0"], device="cpu",
                              paddle="3.3.1", python="3.11", cuda=None, cudnn=None, os="debian12")
                for vid in VARIANTS]
    return BuildReport(matrix="matrix.yaml", revision="r", registry="r", repository="r/p", cache_repository="r/c",
                       created="2026-01-01T00:00:00Z", variants=variants, layers=layers, run_id=run_id)


# --- status words --------------------------------------------------------------------------------


def test_status_words_serialise_as_the_strings_reports_always_held():
    assert [s.value for s in LayerStatus] == ["pending", "to-build", "reused", "building", "built", "failed", "skipped"]
    assert [s.value for s in VariantStatus] == ["pending", "built", "failed"]
    assert [s.value for s in ReportStatus] == ["pending", "planned", "ok", "failed", "interrupted"]
    assert {s.value for s in StageStatus} == {"ok", "passed", "failed", "error", "skipped", "interrupted", "refused"}
    assert json.dumps([LayerStatus.TO_BUILD, StageStatus.PASSED]) == '["to-build", "passed"]'
    assert f"{VariantStatus.BUILT:8}|{ReportStatus.OK}" == "built   |ok"


def test_a_status_assigned_as_a_string_becomes_its_word_and_an_unknown_word_is_refused():
    layer = LayerRecord(key="k", kind="base", path="base/x", image="i", status="to-build")
    assert layer.status is LayerStatus.TO_BUILD
    layer.status = "built"
    assert layer.status is LayerStatus.BUILT
    with pytest.raises(ValueError, match="^'bulit' is not a valid LayerStatus$"):
        layer.status = "bulit"
    with pytest.raises(ValueError, match="^'fine' is not a valid StageStatus$"):
        SmokeStage(status="fine")
    smoke = SmokeStage(status="error")
    assert smoke.status is StageStatus.ERROR
    smoke.status = "passed"  # as the smoke run sets it once the suite has run
    assert smoke.status is StageStatus.PASSED
    with pytest.raises(ValueError, match="'fine' is not a valid StageStatus"):
        smoke.status = "fine"


def test_a_report_written_before_this_module_reads_and_keeps_its_values(tmp_path):
    old = {"schema": REPORT_SCHEMA, "matrix": "m.yaml", "revision": "abc", "registry": "r", "repository": "r/p",
           "cache_repository": "r/c", "created": "2026-01-01T00:00:00Z", "status": "ok",
           "layers": [{"key": "k", "kind": "base", "path": "base/x", "image": "r/c:base-k", "status": "reused",
                       "digest": "sha256:1", "base_digest": None, "duration_s": None, "log": None, "error": None}],
           "variants": [{"id": "v", "tags": ["t"], "images": ["r/p:t"], "chain": ["k"], "device": "cpu",
                         "paddle": "3.3.1", "python": "3.11", "cuda": None, "cudnn": None, "status": "built",
                         "digest": "sha256:1", "image": "r/p@sha256:1",
                         "stages": {"smoke": {"status": "passed", "digest": "sha256:1", "tiers": ["abi"]}}}],
           "summary": {"reused": 1}}
    path = tmp_path / "build-report.json"
    path.write_text(json.dumps(old))
    report = BuildReport.read(path)
    assert report.status is ReportStatus.OK and report.layers[0].status is LayerStatus.REUSED
    assert report.variants[0].os is None  # not recorded then
    smoke = report.variants[0].stage(SmokeStage)
    assert smoke is not None and smoke.status is StageStatus.PASSED and smoke.tiers == ["abi"]
    again = report.to_dict()
    assert again["layers"] == [old["layers"][0] | {"platform": "linux/amd64"}]  # as every layer was then
    assert again["variants"][0]["stages"]["smoke"]["status"] == "passed"
    assert again["summary"] == {"reused": 1}


def test_a_stage_this_imagebuild_does_not_know_is_kept_as_written(tmp_path):
    path = tmp_path / "build-report.json"
    sample_report().write(path)
    release = {"status": "released", "channel": "stable", "at": "2027-01-01"}
    record_stage(path, "release", {"v-cpu": release})
    record_stage(path, "scan", {"v-cpu": {"status": "ok", "digest": "sha256:1", "attestation": "new-field"}})
    variant = BuildReport.read(path).variants[0]
    assert variant.stages["release"] == release
    scan = variant.stage(ScanStage)
    assert scan is not None and scan.extra == {"attestation": "new-field"}
    assert variant.to_dict()["stages"]["scan"]["attestation"] == "new-field"  # written back unchanged


def test_a_typed_record_goes_only_under_its_own_stage(tmp_path):
    path = tmp_path / "build-report.json"
    sample_report().write(path)
    with pytest.raises(ValueError, match="gate"):
        record_stage(path, "scan", {"v-cpu": GateStage(status="passed")})
    with pytest.raises(ValueError, match="fine"):
        record_stage(path, "smoke", {"v-cpu": {"status": "fine"}})  # would not read back
    assert all(not v.stages for v in BuildReport.read(path).variants)


# --- the one read-modify-write ------------------------------------------------------------------------


def test_record_stage_changes_one_stage_and_keeps_the_reports_permissions(tmp_path):
    path = tmp_path / "build-report.json"
    sample_report().write(path)
    path.chmod(0o640)
    record_stage(path, "gate", {"v-gpu": GateStage(status="failed", digest="sha256:2", problems=["no scan"])})
    record_stage(path, "smoke", {"v-gpu": SmokeStage(status="passed", digest="sha256:2")})
    assert path.stat().st_mode & 0o777 == 0o640
    data = json.loads(path.read_text())
    gpu = next(v for v in data["variants"] if v["id"] == "v-gpu")
    assert gpu["stages"]["gate"]["status"] == "failed" and gpu["stages"]["gate"]["problems"] == ["no scan"]
    assert gpu["stages"]["smoke"]["status"] == "passed"
    assert all(not v["stages"] for v in data["variants"] if v["id"] != "v-gpu")
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".build-report.json-*"))


def test_an_error_inside_an_update_writes_nothing(tmp_path):
    path = tmp_path / "build-report.json"
    sample_report().write(path)
    before = path.read_text()
    with pytest.raises(RuntimeError, match="^stage crashed half-way$"), update_report(path) as data:
        data["status"] = "failed"
        raise RuntimeError("stage crashed half-way")
    assert path.read_text() == before


def test_recording_into_a_missing_report_is_bad_input_and_creates_nothing(tmp_path):
    with pytest.raises(InputError, match="build report not found"):
        record_stage(tmp_path / "w" / "build-report.json", "scan", {"v": {"status": "ok"}})
    assert not (tmp_path / "w").exists()


def test_the_builds_write_keeps_stages_recorded_meanwhile_by_other_processes(tmp_path):
    path = tmp_path / "build-report.json"
    build = sample_report(run_id="run-A")
    build.write(path)
    record_stage(path, "smoke", {"v-cpu": SmokeStage(status="passed", digest="sha256:1")})
    build.layers[0].status = LayerStatus.BUILT  # the build carries on with its own, stage-less copy
    build.status = ReportStatus.OK
    build.write(path)
    data = json.loads(path.read_text())
    assert data["status"] == "ok" and data["layers"][0]["status"] == "built"
    assert data["variants"][0]["stages"]["smoke"]["status"] == "passed"


def test_a_new_build_run_replaces_the_last_runs_stages(tmp_path):
    path = tmp_path / "build-report.json"
    sample_report(run_id="run-A").write(path)
    record_stage(path, "smoke", {"v-cpu": SmokeStage(status="passed", digest="sha256:old")})
    sample_report(run_id="run-B").write(path)
    assert all(not v["stages"] for v in json.loads(path.read_text())["variants"])


# --- passed on this digest: the one question sign, push and release ask -------------------------------

NOW = "sha256:" + "d1" * 32  # the variant's digest
OLD = "sha256:" + "0d" * 32  # an earlier build's


def built(*records: StageRecord, **changes) -> VariantRecord:
    fields = dict(id="v", tags=["v"], images=["r/p:v"], chain=["k0"], device="cpu", paddle="3.3.1", python="3.11",
                  cuda=None, cudnn=None, os="debian12", status="built", digest=NOW, image=f"r/p@{NOW}")
    return VariantRecord(**{**fields, **changes}, stages={r.STAGE: r for r in records})


# Each stage a later one waits on, in the four cases: no record, not passed, passed on another digest, passed.
CONTRACT = [
    (SmokeStage, None, "v: no smoke test result (run `imagebuild test` first)"),
    (SmokeStage, SmokeStage(status="failed", digest=NOW, tiers=["abi"], reason="1 test(s) failed, first: t::x: boom"),
     "v: smoke tests failed: 1 test(s) failed, first: t::x: boom"),
    (SmokeStage, SmokeStage(status="passed", digest=OLD, tiers=["abi"]),
     f"v: smoke tests ran on {OLD}, but the variant is now {NOW} (rebuilt since; run `imagebuild test` again)"),
    (SmokeStage, SmokeStage(status="passed", digest=NOW, tiers=["abi"]), None),
    (ScanStage, None, "v: no scan result (run imagebuild scan)"),
    (ScanStage, ScanStage(status="failed", digest=NOW, error="trivy exited 1"), "v: scan failed: trivy exited 1"),
    (ScanStage, ScanStage(status="ok", digest=OLD), f"v: the scan was of {OLD}, the image is now {NOW}"),
    (ScanStage, ScanStage(status="ok", digest=NOW), None),
    (GateStage, None, "v: no gate result; run `imagebuild scan` and `imagebuild gate` first"),
    (GateStage, GateStage(status="failed", digest=NOW, blocking=[{"id": "CVE-2024-28757", "package": "libexpat1"}]),
     "v: the gate did not pass (CVE-2024-28757 libexpat1)"),
    (GateStage, GateStage(status="passed", digest=OLD),
     f"v: the gate judged {OLD}, but the image is now {NOW}; scan and gate it again"),
    (GateStage, GateStage(status="passed", digest=NOW), None),
    (SignStage, None, "v: not signed (run `imagebuild sign` first)"),
    (SignStage, SignStage(status="failed", digest=NOW, reason="cosign exited 1"), "v: signing failed: cosign exited 1"),
    (SignStage, SignStage(status="passed", digest=OLD),
     f"v: signed {OLD}, but the variant is now {NOW} (rebuilt since; sign it again)"),
    (SignStage, SignStage(status="passed", digest=NOW), None),
]


@pytest.mark.parametrize("kind, record, why", CONTRACT, ids=[
    f"{kind.STAGE}-{case}" for kind in (SmokeStage, ScanStage, GateStage, SignStage)
    for case in ("no-record", "not-passed", "passed-on-another-digest", "passed")])
def test_each_stage_says_whether_its_variant_may_go_on_with_this_digest(kind, record, why):
    variant = built(*([record] if record else []))
    assert variant.stage_refusal(kind) == why
    assert variant.refusal(kind) == why
    if record is not None:  # the record's own answer is the same, without the variant's name
        assert record.refusal(NOW) == (why.removeprefix("v: ") if why else None)


def test_a_record_read_from_a_report_answers_as_the_one_recorded():
    written = built(GateStage(status="passed", digest=OLD)).to_dict()
    assert VariantRecord.from_dict(json.loads(json.dumps(written))).refusal(GateStage) == (
        f"v: the gate judged {OLD}, but the image is now {NOW}; scan and gate it again")


def test_a_variant_passes_when_every_stage_it_needs_passed_on_its_digest_and_the_first_refusal_is_the_answer():
    smoke = SmokeStage(status="passed", digest=NOW, tiers=["abi", "gpu"])
    gate = GateStage(status="passed", digest=NOW)
    sign = SignStage(status="passed", digest=NOW)
    assert built(smoke, gate, sign).refusal(SmokeStage, GateStage, SignStage) is None
    assert built(smoke, gate).refusal(SmokeStage, GateStage) is None
    assert built(smoke, gate).refusal(SmokeStage, GateStage, SignStage) == "v: not signed (run `imagebuild sign` first)"
    failed = SmokeStage(status="error", digest=NOW, reason="timed out after 900 s")
    assert built(failed).refusal(SmokeStage, GateStage) == "v: smoke tests error: timed out after 900 s"
    assert built(smoke).refusal(GateStage, SmokeStage) == (
        "v: no gate result; run `imagebuild scan` and `imagebuild gate` first")


@pytest.mark.parametrize("changes, why", [
    ({"status": "failed"}, "v: not built (status failed)"),
    ({"status": "pending"}, "v: not built (status pending)"),
    ({"digest": None}, "v: not built (status built)"),
    ({"image": None}, "v: not built (status built)"),
], ids=["failed", "pending", "no-digest", "no-image"])
def test_a_variant_that_is_not_built_goes_nowhere_whatever_its_records_say(changes, why):
    records = (SmokeStage(status="passed", digest=NOW, tiers=["abi"]), GateStage(status="passed", digest=NOW))
    assert built(*records, **changes).refusal(SmokeStage, GateStage) == why


# --- concurrent writers in separate processes -------------------------------------------------------------

WRITERS = 8
UPDATES = 50


def _stage_writer(path: str, writer: int, start) -> None:
    start.wait()
    for n in range(UPDATES):
        variant = VARIANTS[(writer + n) % len(VARIANTS)]
        record_stage(Path(path), f"probe{writer}", {variant: {"status": "ok", "writer": writer, "n": n}})


def _build_writer(path: str, start) -> None:
    """What Builder does: its own copy, status changes, a full write after each."""
    report = sample_report(run_id="run-concurrent")
    start.wait()
    for n in range(UPDATES):
        layer = report.layers[n % len(report.layers)]
        layer.status = LayerStatus.BUILT if n % 2 else LayerStatus.BUILDING
        layer.duration_s = float(n)
        report.write(Path(path))
    report.status = ReportStatus.OK
    report.write(Path(path))


def _reader(path: str, start, stop, out) -> None:
    start.wait()
    reads, problems = 0, []
    while not stop.is_set():
        try:
            data = json.loads(Path(path).read_text())
            if data.get("schema") != REPORT_SCHEMA or len(data["variants"]) != len(VARIANTS):
                problems.append(f"incomplete report: {sorted(data)}")
        except (OSError, ValueError) as exc:
            problems.append(repr(exc))
        reads += 1
    out.put((reads, problems[:3]))


def test_concurrent_writers_in_separate_processes_lose_no_stage_and_readers_see_whole_files(tmp_path):
    path = tmp_path / "build-report.json"
    sample_report(run_id="run-concurrent").write(path)
    ctx = multiprocessing.get_context("spawn")
    start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=_stage_writer, args=(str(path), w, start)) for w in range(WRITERS)]
    writers.append(ctx.Process(target=_build_writer, args=(str(path), start)))
    reader = ctx.Process(target=_reader, args=(str(path), start, stop, out))
    for proc in [*writers, reader]:
        proc.start()
    time.sleep(0.5)  # every process imported and waiting: they start together
    start.set()
    for proc in writers:
        proc.join(timeout=120)
        assert proc.exitcode == 0, f"writer {proc.name} exited with {proc.exitcode}"
    stop.set()
    reads, problems = out.get(timeout=60)
    reader.join(timeout=60)

    assert problems == [] and reads > 0
    data = json.loads(path.read_text())
    stages = {v["id"]: v["stages"] for v in data["variants"]}
    for writer in range(WRITERS):
        for variant in VARIANTS:
            last = max(n for n in range(UPDATES) if VARIANTS[(writer + n) % len(VARIANTS)] == variant)
            assert stages[variant][f"probe{writer}"] == {"status": "ok", "writer": writer, "n": last}
    assert data["status"] == "ok"  # the build's last write is there too
    assert [layer["duration_s"] for layer in data["layers"]] == [48.0, 49.0, 44.0, 45.0, 46.0, 47.0]
    assert os.stat(path).st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_build_writes_over_a_report_it_cannot_read_and_a_stage_refuses_it(tmp_path):
    path = tmp_path / "build-report.json"
    path.write_text("{half a report")
    with pytest.raises(InputError, match="not a build report"):
        record_stage(path, "scan", {"v-cpu": {"status": "ok"}})
    assert path.read_text() == "{half a report"
    sample_report().write(path)
    assert BuildReport.read(path).variants[0].id == "v-cpu"
