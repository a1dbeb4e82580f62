"""`imagebuild test`, for real: the smoke suite inside the example's images, and broken ones.

Every container here is a real one on the real engine; the broken images are real images,
built FROM the example's and pushed to the staging registry under a test-only repository.
Only the gpu tier may skip (no GPU here), and the tests check that it does, with its reason.
"""
from __future__ import annotations

import io
import json
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild.checks.smoke_run import host_has_gpu
from imagebuild.core.report import SmokeStage, VariantRecord

from .conftest import EXAMPLE, STAGING, Run, copy_matrix, imagebuild, unique

CPU_VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
GPU_VARIANT = "paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12"
TEST_REPOSITORY = f"{STAGING}/imagebuild-e2e/smoke"  # test-only: never the example's repository
NO_GPU_REASON = "no GPU visible: paddle.device.cuda.device_count() == 0"


def copy_report(built_example, folder: Path, edit=None) -> Path:
    """A copy of the example's build report, so each test records its own results."""
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads(json.dumps(built_example.report))
    if edit:
        edit(data)
    path = folder / "build-report.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def junit_cases(path: str | Path) -> dict[str, str]:
    """test name -> passed | failed | error | skipped, read straight from the JUnit XML."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        out[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return out


@dataclass
class Smoked:
    run: Run
    report_path: Path
    results: dict[str, dict]  # by variant id
    report: dict


@pytest.fixture(scope="module")
def smoked(built_example, tmp_path_factory) -> Smoked:
    """The whole suite, both tiers, in both example images, from a copy of the build report."""
    report_path = copy_report(built_example, tmp_path_factory.mktemp("smoke"))
    run = imagebuild("test", "--report", str(report_path), "--format", "json", timeout=1800)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr[-4000:]}"
    results = {r["name"]: r for r in run.json()["results"]}
    return Smoked(run, report_path, results, json.loads(report_path.read_text()))


@pytest.fixture(scope="module")
def harness(smoked) -> Path:
    """The pytest folder the first run installed; later runs reuse it instead of pip again."""
    found = sorted((smoked.report_path.parent / "smoke" / ".harness").glob("pytest-*"))
    assert len(found) == 1 and (found[0] / "first" / "pytest").is_dir(), found
    return found[0]


# --- the example images pass ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", [CPU_VARIANT, GPU_VARIANT])
def test_the_abi_tier_passes_in_both_example_images(smoked, variant):
    result = smoked.results[variant]
    assert result["status"] == "passed", result
    cases = junit_cases(result["junit"])
    abi = {name: outcome for name, outcome in cases.items() if name.startswith("suite.test_abi::")}
    for test in ("test_paddle_imports_at_the_expected_version", "test_cuda_build_matches_the_variant_device",
                 "test_paddle_was_built_for_the_matrix_cuda", "test_paddle_was_built_for_the_matrix_cudnn",
                 "test_python_is_the_matrix_python", "test_runs_as_the_non_root_user",
                 "test_no_unexpected_setuid_or_setgid_files", "test_labels_match_the_matrix",
                 "test_cpu_forward_backward_learns"):
        assert abi[f"suite.test_abi::{test}"] == "passed", (test, abi)
    assert "failed" not in cases.values() and "error" not in cases.values()


# What Paddle 2.6.2's libphi.so opens (phi::dynload), by the id of its test: the ones training needs,
# Paddle's own (in paddle/libs), and the ones left out on purpose (skipped, each with its reason).
REQUIRED_LOADERS = ("cublas", "cublaslt", "cudnn", "cufft", "curand", "cusolver", "cusparse", "nccl", "nvrtc")
BUNDLED_LOADERS = ("flashattn", "lapack", "mklml", "warpctc", "warprnnt")
LEFT_OUT_LOADERS = ("cuda", "cupti", "cusparselt", "mklrt", "nvjpeg", "nvtx", "tensorrt", "xpti")


def library_case(loader: str) -> str:
    return f"suite.test_abi::test_a_library_paddle_opens_resolves[{loader}]"


def test_every_library_paddle_opens_resolves_in_the_gpu_image(smoked):
    cases = junit_cases(smoked.results[GPU_VARIANT]["junit"])
    checked = {name for name in cases if "test_a_library_paddle_opens_resolves[" in name}
    assert checked == {library_case(x) for x in REQUIRED_LOADERS + BUNDLED_LOADERS + LEFT_OUT_LOADERS}, checked
    for loader in REQUIRED_LOADERS + BUNDLED_LOADERS:
        assert cases[library_case(loader)] == "passed", loader
    reasons = {s["test"]: s["reason"] for s in smoked.results[GPU_VARIANT]["skip_reasons"]}
    for loader in LEFT_OUT_LOADERS:
        assert reasons[library_case(loader)].startswith("not required: "), loader
    assert cases["suite.test_abi::test_the_libraries_cudnn_opens_resolve"] == "passed"
    assert cases["suite.test_abi::test_cudnn_library_is_the_matrix_cudnn"] == "passed"


def test_the_gpu_tier_skips_with_its_reason_here_and_would_run_on_a_gpu_host(smoked):
    gpu = smoked.results[GPU_VARIANT]
    cases = junit_cases(gpu["junit"])
    gpu_tests = {n: o for n, o in cases.items() if n.startswith("suite.test_gpu::")}
    assert set(gpu_tests) == {"suite.test_gpu::test_paddle_run_check",
                              "suite.test_gpu::test_training_steps_on_the_gpu_learn",
                              "suite.test_gpu::test_an_all_reduce_over_nccl_across_two_gpus_sums"}
    if host_has_gpu():  # the same suite on a GPU host: requested, and run for real (two GPUs or more
        # for the all-reduce; with one, it says so)
        assert gpu["gpu_requested"] and set(gpu_tests.values()) <= {"passed", "skipped"}
        return
    assert not gpu["gpu_requested"]
    assert set(gpu_tests.values()) == {"skipped"}
    reasons = {s["test"]: s["reason"] for s in gpu["skip_reasons"]}
    # The other skips in the GPU image are the libraries left out on purpose, each saying why.
    assert {t for t in reasons if not t.startswith("suite.test_abi::test_a_library_paddle_opens")} == set(gpu_tests)
    assert all(reasons[t].startswith(NO_GPU_REASON) for t in gpu_tests), reasons
    log = Path(gpu["log"]).read_text()
    assert NO_GPU_REASON in log  # and pytest's own output shows it


def test_the_cpu_image_skips_the_gpu_tier_as_a_cpu_variant(smoked):
    reasons = {s["test"]: s["reason"] for s in smoked.results[CPU_VARIANT]["skip_reasons"]}
    assert reasons["suite.test_gpu::test_paddle_run_check"].startswith("CPU variant")
    assert all(r.startswith("CPU variant") for r in reasons.values()), reasons


def test_results_are_recorded_in_the_report_and_the_gate_lets_them_through(smoked):
    variants = {v["id"]: v for v in smoked.report["variants"]}
    for variant_id in (CPU_VARIANT, GPU_VARIANT):
        variant = variants[variant_id]
        stage = variant["stages"]["smoke"]
        assert stage["status"] == "passed" and stage["digest"] == variant["digest"]
        assert stage["image"] == variant["image"]
        assert stage["passed"] > 5 and stage["failed"] == 0 and stage["errors"] == 0
        assert stage["tiers"] == ["abi", "gpu"]
        assert stage["duration_s"] > 0
        junit = Path(stage["junit"])
        assert junit == smoked.report_path.parent / "smoke" / variant_id / "results" / "junit.xml"
        assert junit.is_file()
        assert VariantRecord.from_dict(variant).refusal(SmokeStage) is None
    assert json.loads(smoked.report_path.read_text())["schema"] == "imagebuild.build-report/v1"
    assert not list(smoked.report_path.parent.glob("*.tmp"))


def test_running_again_reuses_the_results_and_runs_nothing(smoked, harness):
    junits = {v: Path(r["junit"]) for v, r in smoked.results.items() if r.get("junit")}  # an index: per child
    written = {v: path.stat().st_mtime_ns for v, path in junits.items()}
    again = imagebuild("test", "--report", str(smoked.report_path), "--harness", str(harness))
    assert again.returncode == 0, again.stderr
    assert len(smoked.results) == 3  # the two amd64 images and the two-platform index (one line each)
    assert again.stdout.count(", reused)") == len(smoked.results), again.stdout
    assert {v: path.stat().st_mtime_ns for v, path in junits.items()} == written  # no container ran
    forced = imagebuild("test", "--report", str(smoked.report_path), "--harness", str(harness),
                        "--only", "device=cpu", "--force", "--tier", "abi")
    assert forced.returncode == 0, forced.stderr
    assert "reused" not in forced.stdout and CPU_VARIANT in forced.stdout and GPU_VARIANT not in forced.stdout


# --- broken images are caught -------------------------------------------------------------------


def derive_and_push(engine, base: str, dockerfile_body: str) -> str:
    """A tiny image FROM `base`, built by the real engine and pushed to the test-only repository."""
    tag = unique("broken")
    ref = f"{TEST_REPOSITORY}:{tag}"
    dockerfile = f"FROM {base}\n{dockerfile_body}\n"
    engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=ref, rm=True, forcerm=True)
    for line in engine.images.push(TEST_REPOSITORY, tag=tag, stream=True, decode=True):
        assert "error" not in line, line
    return ref


@pytest.fixture(scope="module")
def example_images(built_example) -> dict[str, str]:
    return {v["id"]: v["image"] for v in built_example.report["variants"]}


def test_a_gpu_image_without_its_cudnn_library_fails_naming_it(engine, example_images, harness, tmp_path):
    ref = derive_and_push(engine, example_images[GPU_VARIANT], (
        "USER root\n"
        "RUN rm -f /usr/local/nvidia-wheels/cudnn/lib/libcudnn.so* && ldconfig\n"
        "USER 1000:1000"))
    try:
        run = imagebuild("test", "--image", ref, "--tier", "abi", "--out", str(tmp_path), "--harness", str(harness))
        assert run.returncode == 1, run.stdout + run.stderr
        assert "FAILED" in run.stdout
        assert "libcudnn.so does not resolve inside the image" in run.stdout, run.stdout
        junit = next(tmp_path.glob("*/results/junit.xml"))
        cases = junit_cases(junit)
        assert cases[library_case("cudnn")] == "failed"
        assert cases["suite.test_abi::test_cudnn_library_is_the_matrix_cudnn"] == "failed"
        # Only what was removed: the other libraries, cuDNN's own and Paddle itself still pass.
        assert cases[library_case("cublas")] == cases[library_case("nccl")] == "passed"
        assert cases["suite.test_abi::test_paddle_imports_at_the_expected_version"] == "passed"
    finally:
        engine.images.remove(ref, force=True)


@pytest.mark.parametrize("removed, loader, soname", [
    ("nccl/lib/libnccl.so*", "nccl", "libnccl.so"),  # what paddle.distributed needs
    ("cublas/lib/libcublasLt.so*", "cublaslt", "libcublasLt.so"),  # once left the suite asleep until 900 s
])
def test_a_gpu_image_missing_a_library_paddle_opens_fails_within_a_minute_naming_it(
        engine, example_images, harness, tmp_path, removed, loader, soname):
    ref = derive_and_push(engine, example_images[GPU_VARIANT], (
        "USER root\n"
        f"RUN rm -f /usr/local/nvidia-wheels/{removed} && ldconfig\n"
        "USER 1000:1000"))
    try:
        run = imagebuild("test", "--image", ref, "--tier", "abi", "--out", str(tmp_path), "--harness", str(harness),
                         "--format", "json")
        assert run.returncode == 1, run.stdout + run.stderr
        (result,) = run.json()["results"]
        assert result["status"] == "failed", result
        failed = {f["test"]: f["message"] for f in result["failures"]}
        assert failed[library_case(loader)].startswith(f"Failed: {soname} does not resolve inside the image"), failed
        # Nothing hung: the whole tier, container and all, ran well inside the image-level timeout.
        assert result["duration_s"] < 90, result["duration_s"]
        assert not any("timed out" in message for message in failed.values()), failed
        print(f"abi tier without {soname}: {result['duration_s']} s, failed: {sorted(failed)}")
    finally:
        engine.images.remove(ref, force=True)


def test_a_matrix_that_says_cudnn_8_9_fails_naming_both_versions(built_example, harness, tmp_path):
    def says_cudnn_8_9(data):
        for variant in data["variants"]:
            if variant["id"] == GPU_VARIANT:
                variant["cudnn"] = "8.9"

    report_path = copy_report(built_example, tmp_path, says_cudnn_8_9)
    run = imagebuild("test", "--report", str(report_path), "--only", GPU_VARIANT, "--tier", "abi",
                     "--harness", str(harness))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Paddle was built with cuDNN 8.6.0, the matrix says cuDNN 8.9" in run.stdout, run.stdout
    assert "the image's cuDNN library (libcudnn.so.8) is 8.6.0, the matrix says cuDNN 8.9" in run.stdout
    variants = {v["id"]: v for v in json.loads(report_path.read_text())["variants"]}
    stage = variants[GPU_VARIANT]["stages"]["smoke"]
    assert stage["status"] == "failed"
    failed = {f["test"] for f in stage["failures"]}
    assert failed == {"suite.test_abi::test_paddle_was_built_for_the_matrix_cudnn",
                      "suite.test_abi::test_cudnn_library_is_the_matrix_cudnn",
                      "suite.test_abi::test_labels_match_the_matrix"}  # the label says 8.6 as well
    # Sign and push ask the smoke record, which refuses this variant and says why.
    reason = VariantRecord.from_dict(variants[GPU_VARIANT]).refusal(SmokeStage)
    assert reason is not None and reason.startswith(f"{GPU_VARIANT}: smoke tests failed: 3 test(s) failed, first: ")
    assert "cuDNN" in reason
    assert "smoke" not in variants[CPU_VARIANT]["stages"]  # --only: the other variant is untouched
    assert VariantRecord.from_dict(variants[CPU_VARIANT]).refusal(SmokeStage) == (
        f"{CPU_VARIANT}: no smoke test result (run `imagebuild test` first)")


def test_an_image_running_as_root_fails(engine, example_images, harness, tmp_path):
    ref = derive_and_push(engine, example_images[CPU_VARIANT], "USER root")
    try:
        run = imagebuild("test", "--image", ref, "--matrix", str(EXAMPLE), "--tier", "abi", "--out", str(tmp_path),
                         "--harness", str(harness), "--format", "json")
        assert run.returncode == 1, run.stdout + run.stderr
        (result,) = run.json()["results"]
        assert result["status"] == "failed"
        assert [f["test"] for f in result["failures"]] == ["suite.test_abi::test_runs_as_the_non_root_user"]
        assert "the image runs as root (uid 0" in result["failures"][0]["message"]
    finally:
        engine.images.remove(ref, force=True)


# --- extra smoke tests from the matrix, and the sandbox they run in --------------------------------

SANDBOX_TEST = '''
import os


def cgroup_value(*paths):
    for path in paths:
        if os.path.exists(path):
            with open(path) as handle:
                return handle.read().strip()
    raise AssertionError(f"none of {paths} exists")


def test_the_runner_sandbox(expect):
    assert expect.variant  # the plugin's fixtures reach extra tests too
    assert sorted(os.listdir("/sys/class/net")) == ["lo"], "network is not off"
    try:
        open("/etc/imagebuild-write-probe", "w")
    except OSError:
        pass
    else:
        raise AssertionError("the root file system is writable")
    with open("/tmp/probe", "w") as handle:  # /tmp is a tmpfs
        handle.write("ok")
    status = open("/proc/self/status").read()
    assert "CapEff:\\t0000000000000000" in status and "NoNewPrivs:\\t1" in status, status
    assert cgroup_value("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes") == str(8 << 30)
    assert cgroup_value("/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/pids/pids.max") == "4096"
'''


@pytest.fixture
def extras_matrix(tmp_path) -> Path:
    extra = tmp_path / "extra"
    (extra / "cuda").mkdir(parents=True)
    (extra / "test_sandbox.py").write_text(SANDBOX_TEST)
    (extra / "cuda" / "test_cuda_extra.py").write_text(
        "def test_cuda_extra(expect):\n    assert expect.device == 'gpu'\n")
    (extra / "test_cpu_only.py").write_text(
        "def test_cpu_only(paddle):\n    assert not paddle.is_compiled_with_cuda()\n")
    (extra / "test_sleeps.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(600)\n")

    def add_smoke(data):
        data["smoke"] = {"all": ["extra/test_sandbox.py"], "cuda": ["extra/cuda"]}
        data["matrix"]["include"] = [{"cuda": "cpu", "paddle": "3.3.1", "smoke": ["extra/test_cpu_only.py"]}]

    return copy_matrix(tmp_path, add_smoke)


def test_extra_smoke_tests_run_where_the_matrix_says(built_example, extras_matrix, harness, tmp_path):
    report_path = copy_report(built_example, tmp_path / "work")
    run = imagebuild("test", "--report", str(report_path), "--matrix", str(extras_matrix), "--tier", "abi",
                     "--harness", str(harness), "--format", "json")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    results = {r["name"]: r for r in run.json()["results"]}
    cpu = {n.split("::")[-1]: o for n, o in junit_cases(results[CPU_VARIANT]["junit"]).items()}
    gpu = {n.split("::")[-1]: o for n, o in junit_cases(results[GPU_VARIANT]["junit"]).items()}
    assert cpu["test_the_runner_sandbox"] == gpu["test_the_runner_sandbox"] == "passed"
    assert cpu["test_cpu_only"] == "passed" and "test_cpu_only" not in gpu
    assert gpu["test_cuda_extra"] == "passed" and "test_cuda_extra" not in cpu
    # Unmarked extra tests count as abi: they ran with --tier abi, the gpu tier did not.
    assert not any(name.startswith("test_paddle_run_check") for name in gpu)


def test_an_image_that_runs_past_the_timeout_is_killed(engine, example_images, extras_matrix, harness, tmp_path):
    text = extras_matrix.read_text().replace("extra/test_sandbox.py", "extra/test_sleeps.py")
    extras_matrix.write_text(text)
    started = time.monotonic()
    run = imagebuild("test", "--image", example_images[CPU_VARIANT], "--matrix", str(extras_matrix),
                     "--timeout", "10", "--out", str(tmp_path / "out"), "--harness", str(harness))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "timed out after 10 s; the container was killed" in run.stdout
    assert time.monotonic() - started < 120
    # This run's containers are the ones with its --out folder mounted (other smoke runs may be going on).
    ours = str(tmp_path / "out")
    leftover = [c for c in engine.containers.list(all=True, filters={"label": "io.imagebuild.smoke"})
                if any((m.get("Source") or "").startswith(ours) for m in c.attrs.get("Mounts") or [])]
    assert leftover == [], [c.name for c in leftover]


# --- bad input -----------------------------------------------------------------------------------


def test_a_report_whose_variant_the_matrix_lacks_is_bad_input(built_example, tmp_path, harness):
    def rename(data):
        data["variants"][0]["id"] = "paddle9.9.9-cpu-py3.11-debian12"

    report_path = copy_report(built_example, tmp_path, rename)
    run = imagebuild("test", "--report", str(report_path), "--harness", str(harness))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "error: examples/local/matrix.yaml: has no variant paddle9.9.9-cpu-py3.11-debian12 (was the matrix "
        "changed since the build? pass the one it was built from)")
    assert "smoke" not in json.loads(report_path.read_text())["variants"][1]["stages"]  # nothing ran


def test_a_missing_report_is_bad_input(tmp_path):
    run = imagebuild("test", "--report", str(tmp_path / "nope.json"))
    assert run.returncode == 2
    assert "build report not found" in run.stderr

