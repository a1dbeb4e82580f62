"""The pure parts of `imagebuild test`: expectations, JUnit parsing, classification, the gate,
and the report update. The in-image helpers (smoke_tests/smoke_lib.py) are tested here too,
on this host, where they can be given known inputs.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.checks.smoke import (
    EXPECT_SCHEMA,
    REQUIRED_LABELS,
    JunitSummary,
    MatrixContext,
    SmokeResult,
    classify,
    expectations_from_labels,
    parse_junit,
    target_for_record,
    target_from_labels,
)
from imagebuild.checks.smoke_run import record_results
from imagebuild.config.matrix import load_matrix
from imagebuild.core.report import SmokeStage, StageStatus, VariantRecord
from imagebuild.core.source import InputError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "smoke_tests"))
import smoke_lib  # noqa: E402  (the suite's helpers, importable once its folder is on the path)

DIGEST = "sha256:" + "a" * 64


# --- expectations from the matrix --------------------------------------------------------------


def release_labels(dockerfile: str) -> dict[str, str]:
    """LABEL key="value" pairs of a rendered release Dockerfile."""
    text = dockerfile.split("LABEL ", 1)[1].split("\nHEALTHCHECK", 1)[0]
    return {k: v.replace('\\"', '"') for k, v in re.findall(r'([a-z0-9._-]+)="((?:[^"\\]|\\.)*)"', text)}


@pytest.mark.parametrize("matrix_file", ["matrix.yaml", "examples/local/matrix.yaml"])
def test_expected_labels_are_what_the_release_layer_sets(matrix_file):
    """smoke.py mirrors plan._release; this is what keeps the two from drifting apart."""
    matrix = load_matrix(REPO / matrix_file)
    plan = build_plan(matrix, revision="abc123")
    ctx = MatrixContext(matrix, plan)
    for variant in plan.variants:
        rendered = release_labels(plan.layers[variant.chain[-1]].dockerfile)
        static = {k: v for k, v in rendered.items() if "${" not in v}
        record = VariantRecord(id=variant.id, tags=list(variant.tags), images=[], chain=list(variant.chain),
                               device=variant.device, paddle=variant.paddle, python=variant.python,
                               cuda=variant.cuda, cudnn=variant.cudnn, status="built", digest=DIGEST,
                               image=f"r/p@{DIGEST}")
        got = ctx.expectations(target_for_record(record), {}, None, gpu_requested=False)
        assert got.labels_expected == static, variant.id
        with_revision = ctx.expectations(target_for_record(record), {}, "abc123", gpu_requested=False)
        assert with_revision.labels_expected["org.opencontainers.image.revision"] == "abc123"


def example_context() -> MatrixContext:
    matrix = load_matrix(REPO / "examples/local/matrix.yaml")
    return MatrixContext(matrix, build_plan(matrix))


def gpu_record(**changes) -> VariantRecord:
    rec = VariantRecord(id="paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12", tags=["2.6.2-gpu-cuda11.8-cudnn8.6"],
                        images=[], chain=[], device="gpu", paddle="2.6.2", python="3.11", cuda="11.8",
                        cudnn="8.6", status="built", digest=DIGEST, image=f"127.0.0.1:5000/x/paddle@{DIGEST}")
    return replace(rec, **changes)


def test_expectations_carry_the_matrix_user_and_allowlist():
    ctx = example_context()
    labels = {"io.imagebuild.variant": "x"}
    e = ctx.expectations(target_for_record(gpu_record()), labels, "rev1", gpu_requested=True)
    data = e.to_json()
    assert data["schema"] == EXPECT_SCHEMA
    assert (data["device"], data["paddle"], data["python"], data["cuda"], data["cudnn"]) == \
        ("gpu", "2.6.2", "3.11", "11.8", "8.6")
    assert (data["uid"], data["gid"], data["setuid_allowlist"]) == (1000, 1000, [])
    assert "libraries" not in data  # the suite asks the image's Paddle which libraries it opens
    assert data["labels"]["actual"] == labels
    assert data["labels"]["expected"]["io.imagebuild.cudnn.version"] == "8.6"
    assert data["labels"]["expected"]["io.imagebuild.example"] == "true"  # the matrix's own labels
    assert data["gpu_requested"] is True
    json.dumps(data)  # what the container reads


def test_a_report_that_says_cudnn_8_9_expects_8_9():
    ctx = example_context()
    e = ctx.expectations(target_for_record(gpu_record(cudnn="8.9")), {}, None, gpu_requested=False)
    assert e.cudnn == "8.9" and e.labels_expected["io.imagebuild.cudnn.version"] == "8.9"


def test_a_variant_the_matrix_does_not_have_is_bad_input():
    with pytest.raises(InputError, match="has no variant paddle9"):
        example_context().expectations(target_for_record(gpu_record(id="paddle9")), {}, None, False)


GPU_LABELS = {"io.imagebuild.variant": "v1", "io.imagebuild.paddle.version": "2.6.2",
              "io.imagebuild.python.version": "3.11", "io.imagebuild.cuda.version": "11.8",
              "io.imagebuild.cudnn.version": "8.6", "org.opencontainers.image.version": "2.6.2-gpu",
              "maintainer": "someone"}


def test_an_image_without_a_matrix_is_judged_by_its_own_labels():
    target = target_from_labels("r/p:t", GPU_LABELS)
    assert (target.name, target.device, target.cuda, target.cudnn, target.tags) == \
        ("v1", "gpu", "11.8", "8.6", ("2.6.2-gpu",))
    e = expectations_from_labels(target, GPU_LABELS, gpu_requested=False)
    assert set(e.labels_expected) == set(REQUIRED_LABELS)
    assert e.uid is None and e.setuid_allowlist == ()


def test_none_labels_mean_a_cpu_image():
    labels = GPU_LABELS | {"io.imagebuild.cuda.version": "none", "io.imagebuild.cudnn.version": "none"}
    target = target_from_labels("r/p:t", labels)
    assert (target.device, target.cuda, target.cudnn) == ("cpu", None, None)


def test_an_image_without_imagebuild_labels_is_refused():
    with pytest.raises(InputError, match="has no io.imagebuild.cudnn.version label"):
        target_from_labels("r/p:t", {k: v for k, v in GPU_LABELS.items() if k != "io.imagebuild.cudnn.version"})


# --- JUnit XML, from a real pytest run --------------------------------------------------------

SAMPLE_TESTS = '''
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "libcudnn.so.8 does not resolve inside the image: dlopen: not found"

def test_skips():
    pytest.skip("no GPU visible: paddle.device.cuda.device_count() == 0")

@pytest.fixture
def broken():
    raise RuntimeError("fixture exploded")

def test_errors(broken):
    pass

@pytest.mark.parametrize("lib", ["a.so.1", "b.so.2"])
def test_param(lib):
    pass
'''


@pytest.fixture(scope="module")
def junit_text(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("junit")
    (folder / "test_sample.py").write_text(SAMPLE_TESTS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(folder),
                           "-c", os.devnull, "--junitxml", str(folder / "junit.xml"), str(folder / "test_sample.py")],
                          capture_output=True, text=True, cwd=folder)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return (folder / "junit.xml").read_text()


def test_junit_counts_each_outcome(junit_text):
    s = parse_junit(junit_text)
    assert (s.passed, s.failed, s.errors, s.skipped) == (3, 1, 1, 1)


def test_junit_keeps_failure_messages_and_skip_reasons(junit_text):
    s = parse_junit(junit_text)
    failures = {f["test"].split("::")[-1]: f["message"] for f in s.failures}
    assert "libcudnn.so.8 does not resolve inside the image" in failures["test_fails"]
    assert "fixture exploded" in failures["test_errors"]
    assert s.skip_reasons == [{"test": "test_sample::test_skips",
                               "reason": "no GPU visible: paddle.device.cuda.device_count() == 0"}]


def test_malformed_junit_raises():
    with pytest.raises(SyntaxError, match="unclosed token: line 1"):  # xml.etree's ParseError
        parse_junit("<testsuites><testcase")


# --- classification --------------------------------------------------------------------------


def summary(passed=5, failed=0, errors=0, skipped=2) -> JunitSummary:
    failures = [{"test": "t::x", "message": "boom"}] * (failed + errors)
    return JunitSummary(passed=passed, failed=failed, errors=errors, skipped=skipped, failures=failures)


@pytest.mark.parametrize("exit_code, junit, kwargs, status, reason", [
    (0, summary(), {}, "passed", None),
    (1, summary(failed=1), {}, "failed", "1 test(s) failed, first: t::x: boom"),
    (1, summary(errors=2), {}, "failed", "2 test(s) failed"),
    (None, None, {"timed_out": True, "timeout_s": 30}, "error", "timed out after 30 s"),
    (137, None, {"oom": True}, "error", "memory limit"),
    (127, None, {}, "error", "no JUnit report (exit code 127)"),
    (5, summary(passed=0, skipped=0), {}, "error", "no tests collected"),
    (4, summary(passed=0, skipped=0), {}, "error", "usage error"),
    (0, summary(passed=0, skipped=4), {}, "error", "every test was skipped"),
    (1, summary(), {}, "error", "pytest exited with code 1"),
])
def test_classify(exit_code, junit, kwargs, status, reason):
    got_status, got_reason = classify(exit_code, junit, **kwargs)
    assert got_status == status
    if reason is None:
        assert got_reason is None
    else:
        assert reason in got_reason


# --- the record sign and push read ------------------------------------------------------------

GPU = "paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12"


def stage(status="passed", digest=DIGEST, tiers=("abi", "gpu"), reason=None) -> SmokeStage:
    record = SmokeStage(status=status, image="img", digest=digest, reason=reason, tiers=list(tiers))
    summary().into(record)
    return record


def test_a_junit_summary_goes_into_the_record_under_the_same_names():
    record = SmokeStage(status="failed", digest=DIGEST)
    summary(passed=3, failed=1, skipped=2).into(record)
    assert (record.passed, record.failed, record.errors, record.skipped) == (3, 1, 0, 2)
    assert record.failures == [{"test": "t::x", "message": "boom"}] and record.skip_reasons == []


def test_the_smoke_record_lets_a_variant_through_that_passed_on_its_digest():
    assert gpu_record(stages={"smoke": stage()}).stage_refusal(SmokeStage) is None
    assert gpu_record(stages={"smoke": stage(tiers=("abi",))}).stage_refusal(SmokeStage) is None


@pytest.mark.parametrize("stages, digest, why", [
    ({}, DIGEST, "no smoke test result (run `imagebuild test` first)"),
    ({"smoke": stage("failed", reason="1 test(s) failed, first: libcudnn.so.8")}, DIGEST,
     "smoke tests failed: 1 test(s) failed, first: libcudnn.so.8"),
    ({"smoke": stage("error", reason="timed out after 900 s")}, DIGEST, "smoke tests error: timed out after 900 s"),
    ({"smoke": stage("interrupted")}, DIGEST, "smoke tests interrupted: no reason recorded"),
    ({"smoke": stage(tiers=("gpu",))}, DIGEST, "the smoke tests that passed did not include the abi tier"),
    ({"smoke": stage()}, "sha256:" + "b" * 64,
     f"smoke tests ran on {DIGEST}, but the variant is now sha256:{'b' * 64} (rebuilt since; run `imagebuild test` again)"),
    ({"smoke": stage()}, None,
     f"smoke tests ran on {DIGEST}, but the variant is now None (rebuilt since; run `imagebuild test` again)"),
], ids=["no-record", "failed", "error", "interrupted", "no-abi-tier", "another-digest", "no-digest"])
def test_the_smoke_record_refuses_and_says_why(stages, digest, why):
    assert gpu_record(stages=stages, digest=digest).stage_refusal(SmokeStage) == f"{GPU}: {why}"


# --- the report update ------------------------------------------------------------------------


def test_results_go_into_the_report_keeping_other_stages(tmp_path):
    report = tmp_path / "build-report.json"
    data = {"schema": "imagebuild.build-report/v1", "extra": 1, "variants": [
        {"id": "a", "stages": {"scan": {"status": "ok"}}},
        {"id": "b", "stages": {}},
    ]}
    report.write_text(json.dumps(data))
    report.chmod(0o640)
    record_results(report, [SmokeResult(name="a", variant="a", record=stage())])
    after = json.loads(report.read_text())
    assert after["extra"] == 1
    assert after["variants"][0]["stages"]["scan"] == {"status": "ok"}
    assert after["variants"][0]["stages"]["smoke"] == stage().to_dict()
    assert after["variants"][0]["stages"]["smoke"]["status"] == "passed"
    assert after["variants"][0]["stages"]["smoke"]["digest"] == DIGEST
    assert after["variants"][1]["stages"] == {}
    assert stat.S_IMODE(report.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build-report.json", "build-report.json.lock"]


def test_the_record_reads_back_from_the_report_as_it_was_written():
    original = stage()
    original.duration_s, original.suite_digest = 3.5, "abc"
    back = SmokeStage.from_dict(json.loads(json.dumps(original.to_dict())))
    assert back == original and back.status is StageStatus.PASSED


# --- the in-image helpers (smoke_tests/smoke_lib.py) -----------------------------------------


def test_setuid_walk_finds_setuid_and_setgid_files_only(tmp_path):
    (tmp_path / "bin").mkdir()
    for name, mode in (("su", 0o4755), ("wall", 0o2755), ("ls", 0o755)):
        (tmp_path / "bin" / name).write_text("")
        (tmp_path / "bin" / name).chmod(mode)
    (tmp_path / "bin" / "link").symlink_to(tmp_path / "bin" / "su")
    (tmp_path / "sticky").mkdir()
    (tmp_path / "sticky").chmod(0o3777)  # setgid directories are not files
    found, unreadable = smoke_lib.setuid_files(str(tmp_path))
    assert found == [str(tmp_path / "bin" / "su"), str(tmp_path / "bin" / "wall")]
    assert unreadable == []


def test_ldconfig_output_parses_to_sonames_and_paths():
    text = ("3 libs found in cache `/etc/ld.so.cache'\n"
            "\tlibcudnn.so.8 (libc6,x86-64) => /usr/local/nvidia-wheels/cudnn/lib/libcudnn.so.8\n"
            "\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6\n"
            "\tlibc.so.6 (libc6) => /lib32/libc.so.6\n")
    assert smoke_lib.parse_ldconfig(text) == {
        "libcudnn.so.8": ["/usr/local/nvidia-wheels/cudnn/lib/libcudnn.so.8"],
        "libc.so.6": ["/lib/x86_64-linux-gnu/libc.so.6", "/lib32/libc.so.6"],
    }


def test_this_hosts_ldconfig_parses():
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    assert any(name.startswith("libc.so.") for name in smoke_lib.parse_ldconfig(out))


@pytest.mark.parametrize("value, version", [(8600, "8.6.0"), (8907, "8.9.7"), (7605, "7.6.5"), (90100, "9.1.0"),
                                            (91300, "9.13.0")])
def test_cudnn_version_numbers_decode(value, version):
    assert smoke_lib.cudnn_version_string(value) == version


def test_major_minor():
    assert smoke_lib.major_minor("8.6.0") == (8, 6) == smoke_lib.major_minor("8.6")
    assert smoke_lib.major_minor("11.8") < smoke_lib.major_minor("12.0")


def test_extra_expectations_are_written_only_when_a_suite_of_its_own_asks_for_them():
    labels = {key: "x" for key in REQUIRED_LABELS}
    plain = expectations_from_labels(target_from_labels("img", labels), labels, False)
    assert "extra" not in plain.to_json()  # a matrix variant's suite digest stays what it was
    webhook = replace(plain, extra={"distributions": {"click": "8.5.1"}})
    assert webhook.to_json()["extra"] == {"distributions": {"click": "8.5.1"}}
