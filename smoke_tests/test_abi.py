"""The abi tier: runs on any host, GPU or not, inside the image under test.

Paddle builds, the libraries Paddle opens at run time (as Paddle itself names them), the
versions on the tag, a non-root user, no stray setuid files, the labels, and a tiny CPU
training loop.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from typing import Dict, List

import pytest
from smoke_lib import (
    NOT_REQUIRED,
    assert_learns,
    cudnn_version_string,
    elf_machine,
    major_minor,
    parse_ldconfig,
    probe_loader,
    section_bytes,
    setuid_files,
    sonames_in,
    train,
)

pytestmark = pytest.mark.abi


# --- Paddle itself ------------------------------------------------------------------------


def test_paddle_imports_at_the_expected_version(facts, expect):
    assert facts.version == expect.paddle, f"Paddle is {facts.version}, the matrix says {expect.paddle}"


def test_cuda_build_matches_the_variant_device(facts, expect):
    compiled = facts.compiled_with_cuda
    assert compiled == (expect.device == "gpu"), (
        f"paddle.is_compiled_with_cuda() is {compiled}, but {expect.variant} is a "
        f"{expect.device.upper()} variant")


def _check_built_version(what: str, built, expected: str | None) -> None:
    """Paddle's compile-time CUDA or cuDNN version against the matrix (major.minor, as tags name it)."""
    if expected is None:
        assert built in ("False", "None", None), f"a CPU variant's Paddle reports {what} {built}"
        return
    assert built not in ("False", "None", None), f"Paddle reports no {what}, the matrix says {expected}"
    # The tag names major.minor (cudnn8.6); Paddle reports the full version (8.6.0).
    assert major_minor(built) == major_minor(expected), \
        f"Paddle was built with {what} {built}, the matrix says {what} {expected}"


def test_paddle_was_built_for_the_matrix_cuda(facts, expect):
    _check_built_version("CUDA", facts.cuda, expect.cuda)


def test_paddle_was_built_for_the_matrix_cudnn(facts, expect):
    _check_built_version("cuDNN", facts.cudnn, expect.cudnn)


# --- the libraries Paddle opens, through the dynamic loader -------------------------------------

PROBE_TIMEOUT_S = 40  # one loader call; under the test's own limit, so the message is this one


def loader_cache() -> Dict[str, List[str]]:
    """`ldconfig -p` inside the image: what dlopen() finds without LD_LIBRARY_PATH."""
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None)
    assert ldconfig, "ldconfig is not in the image: cannot tell what the dynamic loader finds"
    out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=60, check=True).stdout
    return parse_ldconfig(out)


@pytest.fixture(scope="session")
def ld_cache() -> Dict[str, List[str]]:
    return loader_cache()


def test_a_library_paddle_opens_resolves(paddle_loader, expect, ld_cache):
    """Paddle's GPU build dlopen()s each library by name on first use: call its loader and see.

    The loaders come from Paddle's own libphi.so (one test each, see imagebuild_smoke.py); each
    runs in a process of its own, as the image's user, and glibc reports the names it asks for.
    """
    case = paddle_loader
    if case.cpu_variant:
        pytest.skip(f"CPU variant ({expect.variant}): Paddle opens no CUDA library")
    if case.problem:
        pytest.fail(case.problem)
    name = case.loader.name
    if not case.loader.required:
        pytest.skip(f"not required: {NOT_REQUIRED[name]}")
    probe = probe_loader(case.library, case.loader.symbol, PROBE_TIMEOUT_S)
    loader = f"Paddle's phi::dynload::Get{name}DsoHandle"
    asked = " or ".join(probe.names) or f"the {name} library"
    if probe.opened is None:
        paths = [entry for entry in probe.tried if "/" in entry]
        how = "opens it by name" + (f", then as {', '.join(paths)}" if paths else "")
        pytest.fail(f"{asked} does not resolve inside the image ({loader} {how}): {probe.error}")
    # Found: through the loader cache, in Paddle's own folder (its RUNPATH), or by a path Paddle
    # itself tries. Found only through LD_LIBRARY_PATH, it breaks for anyone who sets their own.
    by_cache = any(n in ld_cache for n in probe.names)
    by_path = probe.opened in probe.tried or probe.opened.startswith(case.paddle_dir.rstrip("/") + "/")
    assert by_cache or by_path, (
        f"{asked} resolves only through LD_LIBRARY_PATH ({probe.opened}), not the loader cache: its "
        "folder is not in /etc/ld.so.conf.d/, or ldconfig was not rerun")


def test_the_libraries_cudnn_opens_resolve(paddle_loader_cudnn, ld_cache):
    """cuDNN 8 and 9 dlopen() their sub-libraries (libcudnn_cnn_infer.so.8 ...) on first use; the
    names are strings in the cuDNN library Paddle opens."""
    cudnn = paddle_loader_cudnn
    names = sonames_in(section_bytes(cudnn, ".rodata"), "libcudnn_")
    assert names, f"no libcudnn_*.so name in {cudnn}: cannot tell which sub-libraries it opens"
    problems = []
    for soname in names:
        try:
            ctypes.CDLL(soname)
        except OSError as exc:
            problems.append(f"{soname} (dlopen: {exc})")
            continue
        if soname not in ld_cache:
            problems.append(f"{soname} (not listed by `ldconfig -p`)")
    assert not problems, f"cuDNN ({cudnn}) cannot open: " + "; ".join(problems)


@pytest.fixture
def paddle_loader_cudnn(expect, pytestconfig):
    """The cuDNN library file Paddle's own cuDNN loader opens in this image."""
    if expect.device != "gpu":
        pytest.skip(f"CPU variant ({expect.variant}): no cuDNN")
    # The suite's plugin, beside this file on sys.path.
    from imagebuild_smoke import loader_cases

    case = next((c for c in loader_cases(pytestconfig) if c.loader and c.loader.name == "CUDNN"), None)
    if case is None:
        pytest.fail("Paddle has no cuDNN loader (phi::dynload::GetCUDNNDsoHandle)")
    probe = probe_loader(case.library, case.loader.symbol, PROBE_TIMEOUT_S)
    if probe.opened is None:
        pytest.fail(f"Paddle's cuDNN library does not resolve ({probe.error}); see test_a_library_paddle_opens_resolves")
    return os.path.realpath(probe.opened)


def cudnn_library_version(soname: str) -> str:
    """cudnnGetVersion() needs no GPU, so this works on any host."""
    lib = ctypes.CDLL(soname)
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    return cudnn_version_string(int(lib.cudnnGetVersion()))


def test_cudnn_library_is_the_matrix_cudnn(expect):
    if expect.cudnn is None:
        pytest.skip(f"CPU variant ({expect.variant}): no cuDNN")
    soname = f"libcudnn.so.{expect.cudnn.split('.')[0]}"
    try:
        found = cudnn_library_version(soname)
    except OSError as exc:
        pytest.fail(f"{soname} does not resolve inside the image: {exc}")
    # cuDNN is compatible within a major version going up: an image may carry a newer 8.x than
    # the 8.6 Paddle was built with, never an older one, and never another major version.
    want = major_minor(expect.cudnn)
    ok = major_minor(found)[0] == want[0] and major_minor(found) >= want
    assert ok, f"the image's cuDNN library ({soname}) is {found}, the matrix says cuDNN {expect.cudnn}"


# --- the platform ---------------------------------------------------------------------------


@pytest.fixture
def arch(expect):
    """What the image's platform means inside it; skips where the runner did not know the platform."""
    if not expect.platform.get("machine"):
        pytest.skip("the image's platform is not known to the runner (an image by reference without a matrix)")
    return expect.platform


def test_runs_as_the_platform_machine(arch):
    found = platform.machine()
    assert found == arch["machine"], f"uname -m is {found}, but the image is for {arch['platform']} ({arch['machine']})"


def test_libraries_live_in_the_platform_multiarch_folder(arch):
    found = sysconfig.get_config_var("MULTIARCH")
    assert found == arch["multiarch"], f"Python's MULTIARCH is {found!r}, {arch['platform']} has {arch['multiarch']!r}"
    assert os.path.isdir(f"/usr/lib/{arch['multiarch']}"), f"/usr/lib/{arch['multiarch']} is missing"


def test_paddle_is_built_for_the_platform(arch, facts):
    """Paddle's own libraries (libpaddle, libphi) are ELF files of the platform's machine.

    Only Paddle's own: PyPI's aarch64 wheels of 3.2.2 carry x86-64 copies of libblas, liblapack,
    libgfortran and libquadmath in paddle/libs that nothing on aarch64 opens; they are noted, not failed.
    """
    spec = importlib.util.find_spec("paddle")
    folder = list(spec.submodule_search_locations or ())[0] if spec else None
    assert folder, "Paddle is not installed for this image's `python`"
    own = sorted(glob.glob(os.path.join(folder, "*", "libpaddle*.so")) + glob.glob(os.path.join(folder, "libs", "libphi*.so*")))
    assert own, f"no libpaddle*.so under {folder}/*/ and no libphi*.so under {folder}/libs"
    wrong = [f"{path} ({elf_machine(path)})" for path in own if elf_machine(path) != arch["elf_machine"]]
    assert not wrong, f"not {arch['platform']} (e_machine {arch['elf_machine']}): " + ", ".join(wrong)
    foreign = [path for path in sorted(glob.glob(os.path.join(folder, "libs", "*.so*")))
               if path not in own and elf_machine(path) not in (None, arch["elf_machine"])]
    if foreign:
        print(f"note: {len(foreign)} library file(s) in paddle/libs of another machine: " + ", ".join(foreign))


# --- the interpreter, the user, the files ------------------------------------------------


def test_python_is_the_matrix_python(expect):
    found = "%d.%d" % sys.version_info[:2]
    assert found == expect.python, f"`python` in the image is {found} ({sys.executable}), the matrix says {expect.python}"


def test_runs_as_the_non_root_user(expect):
    uid, euid, gid = os.getuid(), os.geteuid(), os.getgid()
    assert uid != 0 and euid != 0, (
        f"the image runs as root (uid {uid}, euid {euid}); its USER must be the matrix's non-root user"
        + (f" (uid {expect.uid})" if expect.uid is not None else ""))
    if expect.uid is not None:
        assert uid == expect.uid, f"the image runs as uid {uid}, the matrix's user is uid {expect.uid}"
    if expect.gid is not None:
        assert gid == expect.gid, f"the image runs as gid {gid}, the matrix's user is gid {expect.gid}"


def test_no_unexpected_setuid_or_setgid_files(expect):
    found, unreadable = setuid_files("/")
    unexpected = [path for path in found if path not in expect.setuid_allowlist]
    assert not unexpected, (
        f"setuid/setgid files not in the matrix's setuid_allowlist: {', '.join(unexpected)}")
    if unreadable:
        # Not a failure: the build strips them as root in every layer; worth seeing in the log.
        print(f"note: {len(unreadable)} folder(s) unreadable by uid {os.getuid()}, not searched: "
              + ", ".join(unreadable[:10]))


def test_labels_match_the_matrix(expect):
    wrong = []
    for key, value in sorted(expect.labels_expected.items()):
        actual = expect.labels_actual.get(key)
        if actual != value:
            shown = "missing" if actual is None else repr(actual)
            wrong.append(f"{key}: image has {shown}, matrix says {value!r}")
    assert not wrong, f"{len(wrong)} label(s) differ: " + "; ".join(wrong)


# --- a tiny training loop on the CPU --------------------------------------------------------


def test_cpu_forward_backward_learns(paddle):
    assert_learns(train(paddle, "cpu", steps=8))
