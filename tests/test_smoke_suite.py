"""The in-image smoke suite's own machinery, run on this host: reading Paddle's loaders out of
an ELF file, calling them in a child process, and the per-test time limit.

The libraries are real: a synthetic ELF file written here for the parser, and a stand-in for
Paddle's libphi.so compiled with the host's C compiler, whose loaders dlopen() the way
Paddle's do (by name, aborting on failure like an uncaught C++ exception).
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imagebuild.checks.smoke import parse_junit

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "smoke_tests"
sys.path.insert(0, str(SUITE))
import smoke_lib  # the suite's helpers, importable once its folder is on the path  # noqa: E402

LOADER = "_ZN3phi7dynload{}{}Ev"


def loader_symbol(name: str) -> str:
    function = f"Get{name}DsoHandle"
    return LOADER.format(len(function), function)


# --- reading the loaders out of a library (a synthetic ELF file) ------------------------------------


def write_elf(path: Path, defined: list[str], undefined: list[str] = (), rodata: bytes = b"") -> Path:
    """A minimal little-endian ELF64 shared object: .dynsym, .dynstr, .rodata and .shstrtab."""
    dynstr = b"\0"
    symbols = [bytes(24)]  # entry 0 is always the null symbol
    for name, section in [(n, 3) for n in defined] + [(n, 0) for n in undefined]:
        symbols.append(struct.pack("<IBBHQQ", len(dynstr), 0x12, 0, section, 0, 0))  # GLOBAL FUNC
        dynstr += name.encode() + b"\0"
    dynsym = b"".join(symbols)
    shstrtab = b"\0.dynsym\0.dynstr\0.rodata\0.shstrtab\0"
    blobs = [dynsym, dynstr, rodata, shstrtab]
    offsets, offset = [], 64
    for blob in blobs:
        offsets.append(offset)
        offset += len(blob)
    shoff = offset
    headers = [bytes(64)]
    for (name, kind, link), blob, at in zip([(1, 11, 2), (9, 3, 0), (17, 1, 0), (25, 3, 0)], blobs, offsets):
        headers.append(struct.pack("<IIQQQQIIQQ", name, kind, 0, 0, at, len(blob), link, 1, 1,
                                   24 if kind == 11 else 0))
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), 4)
    path.write_bytes(header + b"".join(blobs) + b"".join(headers))
    return path


def test_the_loaders_come_from_the_dynamic_symbol_table(tmp_path):
    lib = write_elf(tmp_path / "libphi.so", [
        loader_symbol("Curand"), loader_symbol("NCCL"), loader_symbol("TensorRt"),
        "_ZN3phi7dynload14GetOpDsoHandleERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",  # takes a name
        "_ZN3phi7dynload6curandE", "PyInit_libpaddle",
    ], undefined=["dlopen", loader_symbol("Cublas")])
    symbols = smoke_lib.dynamic_symbols(str(lib))
    assert "PyInit_libpaddle" in symbols and "dlopen" not in symbols  # defined here only
    loaders = smoke_lib.dynload_loaders(symbols)
    assert [(loader.name, loader.required) for loader in loaders] == [
        ("Curand", True), ("NCCL", True), ("TensorRt", False)]
    assert loaders[0].symbol == "_ZN3phi7dynload18GetCurandDsoHandleEv"


def test_a_mangled_name_whose_length_does_not_match_is_not_a_loader():
    assert smoke_lib.dynload_loaders(["_ZN3phi7dynload19GetCurandDsoHandleEv"]) == []


def test_paddles_libraries_are_searched_for_the_loaders_libphi_first(tmp_path):
    libs = tmp_path / "paddle" / "libs"
    libs.mkdir(parents=True)
    write_elf(libs / "libcommon.so", ["common_thing"])
    write_elf(libs / "libphi.so", [loader_symbol("Cusolver")])
    (libs / "libbroken.so").write_bytes(b"not an ELF file")
    library, loaders = smoke_lib.paddle_dynload_libraries(str(tmp_path / "paddle"))
    assert library == str(libs / "libphi.so") and [loader.name for loader in loaders] == ["Cusolver"]


def test_a_paddle_without_loaders_finds_none(tmp_path):
    (tmp_path / "paddle" / "libs").mkdir(parents=True)
    write_elf(tmp_path / "paddle" / "libs" / "libphi.so", ["something_else"])
    assert smoke_lib.paddle_dynload_libraries(str(tmp_path / "paddle")) == (None, [])
    assert smoke_lib.paddle_dynload_libraries(str(tmp_path / "nowhere")) == (None, [])


def test_a_file_that_is_not_elf64_is_refused(tmp_path):
    (tmp_path / "x.so").write_bytes(b"\x7fELF\x01\x01" + bytes(60))
    with pytest.raises(ValueError, match="not a little-endian ELF64"):
        smoke_lib.dynamic_symbols(str(tmp_path / "x.so"))


def test_the_sonames_cudnn_opens_are_read_from_its_rodata(tmp_path):
    rodata = (b"\0libcudnn_ops_infer.so.8\0libcudnn_cnn_train.so.8\0cudnn error: libcudnn_x.so.8 missing\0"
              b"libcudnn_adv_infer.so.8\0libcudnn_ops_infer.so.8\0")
    lib = write_elf(tmp_path / "libcudnn.so.8", ["cudnnGetVersion"], rodata=rodata)
    assert smoke_lib.sonames_in(smoke_lib.section_bytes(str(lib), ".rodata"), "libcudnn_") == [
        "libcudnn_adv_infer.so.8", "libcudnn_cnn_train.so.8", "libcudnn_ops_infer.so.8"]


# --- what a loader opens, from glibc's own log ------------------------------------------------------

LD_DEBUG_SAMPLE = """\
      6227:\tfile=libphi.so [0];  dynamically loaded by /usr/lib/python3.11/lib-dynload/_ctypes.so [0]
      6227:\tfile=libcommon.so [0];  needed by /site/paddle/libs/libphi.so [0]
      6227:\tfile=libcudnn.so [0];  dynamically loaded by /site/paddle/libs/libphi.so [0]
      6227:\tfind library=libcudnn.so [0]; searching
      6227:\tfile=/usr/local/cuda/lib64/libcudnn.so [0];  dynamically loaded by /site/paddle/libs/libphi.so [0]
      6227:\tfile=libcudnn.so [0];  dynamically loaded by /site/paddle/libs/libphi.so [0]
W1201 02:38:37.333009  6227 dynamic_loader.cc:314] The third-party dynamic library (libcudnn.so) that Paddle \
depends on is not configured correctly. (error code is /usr/local/cuda/lib64/libcudnn.so: cannot open shared \
object file: No such file or directory)
"""


def test_the_names_a_loader_hands_to_dlopen_are_read_from_ld_debug():
    assert smoke_lib.dlopened(LD_DEBUG_SAMPLE, "/elsewhere/libphi.so") == [
        "libcudnn.so", "/usr/local/cuda/lib64/libcudnn.so"]  # once each; not what libphi itself needs
    assert smoke_lib.dlopened(LD_DEBUG_SAMPLE, "libpaddle.so") == []


def test_the_reason_is_paddles_error_code_else_its_last_own_line():
    assert smoke_lib.loader_error(LD_DEBUG_SAMPLE, -6) == (
        "/usr/local/cuda/lib64/libcudnn.so: cannot open shared object file: No such file or directory")
    assert smoke_lib.loader_error("      12:\tfile=x\nSegmentation fault\n      12:\tcalling fini\n", -11) == (
        "Segmentation fault (exit status -11)")


# --- calling loaders for real: a stand-in for libphi.so ---------------------------------------------

FAKE_LIBPHI = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *open_or_throw(const char *name) {
    void *handle = dlopen(name, RTLD_LAZY | RTLD_LOCAL);
    if (!handle) {  /* what an uncaught PADDLE_THROW does: a message, then abort() */
        fprintf(stderr, "terminate called after throwing an instance of 'phi::enforce::EnforceNotMet'\n"
                        "  what():  The third-party dynamic library (%s) that Paddle depends on is not configured "
                        "correctly. (error code is %s)\n", name, dlerror());
        abort();
    }
    return handle;
}

/* Found in Paddle's own folder, through this library's RUNPATH ($ORIGIN). */
void *_ZN3phi7dynload16GetNCCLDsoHandleEv(void) { return open_or_throw("libimagebuild-bundled.so"); }
/* Missing: throws. */
void *_ZN3phi7dynload18GetCurandDsoHandleEv(void) { return open_or_throw("libimagebuild-missing.so"); }
/* Found only through LD_LIBRARY_PATH. */
void *_ZN3phi7dynload18GetCublasDsoHandleEv(void) { return open_or_throw("libimagebuild-elsewhere.so"); }
/* Missing by name and by path: warns and returns null, as Paddle's cuDNN loader does. */
void *_ZN3phi7dynload17GetCUDNNDsoHandleEv(void) {
    void *handle = dlopen("libimagebuild-cudnn.so", RTLD_LAZY);
    if (!handle) handle = dlopen("/nonexistent/cuda/libimagebuild-cudnn.so", RTLD_LAZY);
    if (!handle) fprintf(stderr, "W dynamic_loader.cc:314] not configured correctly. (error code is %s)\n", dlerror());
    return handle;
}
/* Not required: never called by the suite. */
void *_ZN3phi7dynload16GetNvtxDsoHandleEv(void) { abort(); }
/* Hangs. */
void *_ZN3phi7dynload17GetCUFFTDsoHandleEv(void) { sleep(600); return 0; }
"""


@pytest.fixture(scope="module")
def fake_paddle(tmp_path_factory) -> Path:
    """site/paddle/libs/libphi.so (the stand-in) and a bundled library beside it; elsewhere/ holds
    one more that only LD_LIBRARY_PATH reaches."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("these tests compile a stand-in for Paddle's libphi.so: install a C compiler (gcc)",
                    pytrace=False)
    root = tmp_path_factory.mktemp("fake-paddle")
    libs = root / "site" / "paddle" / "libs"
    libs.mkdir(parents=True)
    (root / "site" / "paddle" / "__init__.py").write_text("__version__ = '2.6.2'\n")
    (root / "elsewhere").mkdir()
    (root / "empty.c").write_text("int imagebuild_test_symbol(void) { return 1; }\n")
    (root / "libphi.c").write_text(FAKE_LIBPHI)

    def compile_(source: str, target: Path, *extra: str) -> None:
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(target), str(root / source), *extra, "-ldl"],
                       check=True, capture_output=True)

    compile_("libphi.c", libs / "libphi.so", "-Wl,-rpath,$ORIGIN", "-Wl,--enable-new-dtags")
    compile_("empty.c", libs / "libimagebuild-bundled.so")
    compile_("empty.c", root / "elsewhere" / "libimagebuild-elsewhere.so")
    return root


def test_a_loader_that_finds_its_library_reports_the_name_and_the_file(fake_paddle):
    libphi = str(fake_paddle / "site/paddle/libs/libphi.so")
    probe = smoke_lib.probe_loader(libphi, loader_symbol("NCCL"), timeout_s=60)
    assert probe.names == ["libimagebuild-bundled.so"] and probe.error is None
    assert probe.opened == str(fake_paddle / "site/paddle/libs/libimagebuild-bundled.so")


def test_a_loader_that_throws_reports_the_name_and_the_dynamic_loaders_reason(fake_paddle):
    libphi = str(fake_paddle / "site/paddle/libs/libphi.so")
    probe = smoke_lib.probe_loader(libphi, loader_symbol("Curand"), timeout_s=60)
    assert probe.opened is None and probe.names == ["libimagebuild-missing.so"]
    assert probe.error == "libimagebuild-missing.so: cannot open shared object file: No such file or directory"


def test_a_loader_that_returns_null_reports_every_name_and_path_it_tried(fake_paddle):
    libphi = str(fake_paddle / "site/paddle/libs/libphi.so")
    probe = smoke_lib.probe_loader(libphi, loader_symbol("CUDNN"), timeout_s=60)
    assert probe.opened is None and not probe.timed_out
    assert probe.tried == ["libimagebuild-cudnn.so", "/nonexistent/cuda/libimagebuild-cudnn.so"]
    assert probe.names == ["libimagebuild-cudnn.so"]
    assert "/nonexistent/cuda/libimagebuild-cudnn.so: cannot open shared object file" in probe.error


def test_a_loader_that_hangs_is_killed_at_its_time_limit(fake_paddle):
    libphi = str(fake_paddle / "site/paddle/libs/libphi.so")
    started = time.monotonic()
    probe = smoke_lib.probe_loader(libphi, loader_symbol("CUFFT"), timeout_s=3)
    assert probe.timed_out and probe.opened is None and probe.error == "did not return within 3 s"
    assert time.monotonic() - started < 30


# --- the suite in a process of its own, as `imagebuild test` runs it --------------------------------


def expect_file(folder: Path, device: str) -> Path:
    gpu = device == "gpu"
    path = folder / "expect.json"
    path.write_text(json.dumps({
        "schema": "imagebuild.smoke-expect/v1", "variant": f"test-{device}", "image": "local", "device": device,
        "paddle": "2.6.2", "python": "{}.{}".format(*sys.version_info[:2]), "cuda": "11.8" if gpu else None,
        "cudnn": "8.6" if gpu else None, "labels": {"expected": {}, "actual": {}}, "gpu_requested": False}))
    return path


def run_suite(folder: Path, expect: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> tuple[subprocess.CompletedProcess[str], dict]:
    """smoke_tests/run.py on this host's Python and pytest; the JUnit summary it wrote."""
    junit = folder / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-B", str(SUITE / "run.py"), "--rootdir", str(folder), "--junitxml", str(junit), *args],
        cwd=folder, capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "IMAGEBUILD_SMOKE_EXPECT": str(expect), "IMAGEBUILD_SMOKE_HARNESS": str(folder / "none"),
             **(env or {})})
    summary = parse_junit(junit.read_text())
    outcomes = {f["test"].split("::")[-1]: f["message"] for f in summary.failures}
    outcomes.update({s["test"].split("::")[-1]: "skipped: " + s["reason"] for s in summary.skip_reasons})
    return proc, {"summary": summary, "failures": outcomes, "junit": junit.read_text()}


def test_each_library_paddle_opens_is_a_test_named_for_it(fake_paddle, tmp_path):
    proc, out = run_suite(tmp_path, expect_file(tmp_path, "gpu"),
                          "-k", "test_a_library_paddle_opens_resolves and not cufft",  # cufft: the hanging one
                          str(SUITE / "test_abi.py"),
                          env={"PYTHONPATH": str(fake_paddle / "site"), "LD_LIBRARY_PATH": str(fake_paddle / "elsewhere")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got = out["failures"]
    case = "test_a_library_paddle_opens_resolves[{}]".format
    assert "nccl" not in " ".join(got) and out["summary"].passed == 1  # found in Paddle's own folder
    assert got[case("curand")] == (
        "Failed: libimagebuild-missing.so does not resolve inside the image (Paddle's "
        "phi::dynload::GetCurandDsoHandle opens it by name): libimagebuild-missing.so: cannot open shared "
        "object file: No such file or directory")
    assert got[case("cudnn")].startswith(
        "Failed: libimagebuild-cudnn.so does not resolve inside the image (Paddle's phi::dynload::GetCUDNNDsoHandle "
        "opens it by name, then as /nonexistent/cuda/libimagebuild-cudnn.so)")
    assert got[case("cublas")].startswith(
        "AssertionError: libimagebuild-elsewhere.so resolves only through LD_LIBRARY_PATH")
    assert got[case("nvtx")] == "skipped: not required: " + smoke_lib.NOT_REQUIRED["Nvtx"]


def test_a_cpu_variant_skips_the_library_check_and_reads_no_paddle(tmp_path):
    proc, out = run_suite(tmp_path, expect_file(tmp_path, "cpu"), "-k", "test_a_library_paddle_opens_resolves",
                          str(SUITE / "test_abi.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out["failures"] == {"test_a_library_paddle_opens_resolves[cpu]":
                               "skipped: CPU variant (test-cpu): Paddle opens no CUDA library"}


HANGING_TESTS = '''
import ctypes
import os

import pytest


@pytest.mark.timeout(2)
def test_stuck_in_c_holding_the_gil():
    ctypes.PyDLL(None).sleep(600)  # libc's sleep() with the GIL held: no Python signal handler runs


def test_the_next_test_still_runs():
    pass


def test_a_crash():
    os.write(2, b"Could not load library libcudnn_ops_infer.so.8\\n")  # as cuDNN does, before abort()
    os.abort()


def test_a_skip_keeps_its_reason():
    pytest.skip("no GPU visible: the reason survives the trip from the child")


def test_a_failure_keeps_its_message():
    assert False, "libcurand.so does not resolve"
'''


def test_a_test_past_its_time_limit_fails_by_name_and_the_suite_goes_on(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGING_TESTS)
    started = time.monotonic()
    proc, out = run_suite(tmp_path, expect_file(tmp_path, "cpu"), str(tmp_path / "test_hangs.py"), timeout=120)
    assert time.monotonic() - started < 60, "the hung test was not stopped at its 2 s limit"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    got, summary = out["failures"], out["summary"]
    assert got["test_stuck_in_c_holding_the_gil"].startswith("timed out: still running after 2 s, so it was killed")
    assert "in test_stuck_in_c_holding_the_gil" in out["junit"]  # the Python stack at the time
    assert got["test_a_crash"] == ("the test's process ended without a result (killed by signal 6 (SIGABRT)); "
                                   "its last words: Could not load library libcudnn_ops_infer.so.8")
    assert got["test_a_skip_keeps_its_reason"] == "skipped: no GPU visible: the reason survives the trip from the child"
    assert got["test_a_failure_keeps_its_message"].startswith("AssertionError: libcurand.so does not resolve")
    assert (summary.passed, summary.failed, summary.skipped) == (1, 3, 1)
    assert "FAILED" in proc.stdout and "test_stuck_in_c_holding_the_gil" in proc.stdout


# --- which suite runs where: the Paddle images' and the webhook image's (smoke_tests/admission/) ---------


def collected(folder: Path, *paths: Path) -> list[str]:
    proc = subprocess.run([sys.executable, "-B", str(SUITE / "run.py"), "--rootdir", str(folder), "--collect-only",
                           "-q", *map(str, paths)], cwd=folder, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "IMAGEBUILD_SMOKE_EXPECT": str(expect_file(folder, "cpu")),
                               "IMAGEBUILD_SMOKE_HARNESS": str(folder / "none")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_a_paddle_image_never_runs_the_webhook_suite_and_the_webhook_image_runs_only_it(tmp_path):
    paddle = collected(tmp_path, SUITE)
    assert "test_abi.py::test_paddle_imports_at_the_expected_version" in paddle
    assert not [test for test in paddle if "test_webhook.py" in test], "the webhook's tests ran on a Paddle image"
    ids = collected(tmp_path, SUITE / "admission")
    assert {test.split("::")[0] for test in ids} == {"test_webhook.py"}
    webhook = [test.split("::")[-1] for test in ids]
    # Its own checks, and the generic ones of the abi tier collected there too (user, setuid, labels).
    assert sorted(webhook) == sorted([
        "test_labels_match_the_matrix", "test_no_unexpected_setuid_or_setgid_files", "test_runs_as_the_non_root_user",
        "test_the_venv_holds_exactly_imagebuild_and_the_pinned_distributions", "test_there_is_no_shell",
        "test_it_runs_on_a_read_only_root", "test_the_entry_point_is_the_venv_script_run_without_a_shell",
        "test_the_server_answers_healthz_readyz_and_a_review_over_tls"])
