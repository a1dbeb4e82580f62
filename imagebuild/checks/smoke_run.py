"""Running the smoke suite inside images: the effects behind `imagebuild test`.

One container per image, through the docker SDK: the image's own non-root user, network off,
memory/CPU/pid limits, a read-only root file system (tmpfs /tmp), no capabilities, a timeout;
GPUs requested (the SDK's `--gpus all`) only where this host has them. The suite, pytest and
the expectations are mounted read-only; pytest writes JUnit XML to the one writable mount.

The images carry no pytest and the container has no network, so pytest comes in as a
read-only mount: pure-Python wheels (pinned, hash-checked) installed once on the host with
`pip install --target`, cached under the output folder. Pure-Python wheels run on any Python
3.8+, so one harness serves every image; smoke_tests/run.py puts pytest in front of the
image's sys.path and its dependencies behind it, so the image's own packages win.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform as host_platform
import re
import shutil
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from imagebuild.checks.engine_load import EngineLoadError, engine_reads_zstd, load_from_registry
from imagebuild.checks.smoke import (
    DEFAULT_EMULATION_FACTOR,
    Expectations,
    JunitSummary,
    MatrixContext,
    PlatformExpect,
    SmokeResult,
    Target,
    classify,
    expectations_from_labels,
    first_line,
    parse_junit,
    platform_expect,
    target_for_record,
    target_from_labels,
    targets_for_children,
)
from imagebuild.config.selection import Selection
from imagebuild.config.tiers import TIERS
from imagebuild.core.report import BuildReport, SmokeStage, StageStatus, VariantRecord, record_stage
from imagebuild.core.runner import Runner, ToolMissing, uninterrupted
from imagebuild.core.source import InputError
from imagebuild.oci import reference
from imagebuild.oci.client import ImageRef

SUITE_DIR = Path(__file__).resolve().parents[2] / "smoke_tests"

# Every container this process creates carries this label, so an interrupt can find and remove
# the one it was starting even before the SDK handed it back.
RUN_LABEL = "io.imagebuild.run"
RUN_ID = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"

# Where things appear inside the container.
MOUNT_ROOT = "/smoke"
SUITE_MOUNT = f"{MOUNT_ROOT}/suite"
HARNESS_MOUNT = f"{MOUNT_ROOT}/pytest"
EXPECT_MOUNT = f"{MOUNT_ROOT}/expect.json"
OUT_MOUNT = f"{MOUNT_ROOT}/out"
EXTRA_MOUNT = f"{MOUNT_ROOT}/extra"
# A smoke container's whole environment besides the image's own: fixed, nothing from this
# process (which may hold COSIGN_PASSWORD or registry credentials) and nothing from the matrix.
CONTAINER_ENV = {"IMAGEBUILD_SMOKE_EXPECT": EXPECT_MOUNT, "IMAGEBUILD_SMOKE_HARNESS": HARNESS_MOUNT,
                 "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp"}

# pytest and what it needs, as (name, version, sha256 of the py3-none-any wheel). Installed for
# Python 3.8 so that tomli and exceptiongroup (needed below 3.11) are always there; 8.3.x is the
# newest pytest that still runs on 3.8.
HARNESS_WHEELS = (
    ("pytest", "8.3.5", "c69214aa47deac29fad6c2a4f590b9c4a9fdb16a403176fe154b79c0b4d4d820"),
    ("pluggy", "1.5.0", "44e1ad92c8ca002de6377e165f3e0f1be63266ab4d554740532335b9d75ea669"),
    ("iniconfig", "2.0.0", "b6a85871a79d2e3b22d2d1b94ac2824226a63c6b741c88f7ae975f18b6778374"),
    ("packaging", "24.2", "09abb1bccd265c01f4a3aa3f7a7db064b36514d2cba19a2f694fe6150451a759"),
    ("exceptiongroup", "1.2.2", "3111b9d131c238bec2f8f516e123e14ba243563fb135d3fe885990585aa7795b"),
    ("tomli", "2.2.1", "cb55c73c5f4408779d0cf3eef9f762b9c9f147a77de7b258bef0a5628adc85cc"),
)
# These go in front of the image's sys.path (the test runner must be the pinned one); the rest
# go behind it, so an image's own packaging/tomli stays the one its Paddle imports.
HARNESS_FIRST = {"pytest", "_pytest", "py.py", "pluggy", "iniconfig"}

# --- the host -------------------------------------------------------------------------------


def host_has_gpu() -> bool:
    """An NVIDIA GPU on this host: a device node, or nvidia-smi listing one."""
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        out = Runner().run([smi, "-L"], separate_stderr=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and "GPU" in out.output


def harness_key() -> str:
    text = "\n".join(f"{n}=={v} {h}" for n, v, h in HARNESS_WHEELS)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_harness(cache: Path) -> Path:
    """pytest for the containers: `cache/pytest-<key>/{first,last}`, installed once with pip.

    `--require-hashes` with every wheel pinned: the one thing these tests run that does not come
    from the image is checked byte for byte.
    """
    target = cache / f"pytest-{harness_key()}"
    if (target / "first" / "pytest").is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".harness-", dir=cache))
    try:
        requirements = tmp / "requirements.txt"
        requirements.write_text("".join(f"{n}=={v} --hash=sha256:{h}\n" for n, v, h in HARNESS_WHEELS))
        cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
               "--require-hashes", "--only-binary=:all:", "--no-deps", "--no-compile",
               "--python-version", "3.8", "--target", str(tmp / "all"), "-r", str(requirements)]
        proc = Runner().run(cmd, timeout=600)  # stopped with everything else on an interrupt
        if proc.returncode != 0:
            tail = "\n".join(proc.output.strip().splitlines()[-5:])
            raise ToolMissing(f"could not install pytest for the smoke tests with pip:\n{tail}\n"
                              "On a host without PyPI, pass --harness with a folder prepared elsewhere.")
        for part in ("first", "last"):
            (tmp / part).mkdir()
        for entry in (tmp / "all").iterdir():
            if entry.name == "bin":
                continue
            part = "first" if entry.name.split("-")[0] in HARNESS_FIRST else "last"
            entry.rename(tmp / part / entry.name)
        shutil.rmtree(tmp / "all")
        requirements.unlink()
        _world_readable(tmp)  # the container's user is not this one
        try:
            tmp.rename(target)
        except OSError:  # another run got there first; theirs is as good
            if not (target / "first" / "pytest").is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _world_readable(root: Path) -> None:
    root.chmod(0o755)
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            Path(folder, d).chmod(0o755)
        for f in files:
            Path(folder, f).chmod(0o644)


def suite_digest(paths: Iterable[Path], expectations: Expectations, tiers: tuple[str, ...]) -> str:
    """What a run depends on besides the image: every test file, the harness, the expectations."""
    h = hashlib.sha256()
    h.update(harness_key().encode())
    h.update(json.dumps(expectations.to_json(), sort_keys=True).encode())
    h.update(",".join(tiers).encode())
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*")
                                                     if p.is_file() and "__pycache__" not in p.parts)
        for f in files:
            h.update(str(f.relative_to(root.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


# --- running ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    timeout_s: float = 900
    memory: str = "8g"
    cpus: float = 4.0
    pids_limit: int = 4096
    tier: str = "all"  # all, abi, gpu
    gpus: str = "auto"  # auto (request them where this host has them), all, none
    read_only: bool = True
    force: bool = False  # run again even where an identical run already passed
    emulation_factor: float = DEFAULT_EMULATION_FACTOR  # time limits of an image this host runs under emulation

    @property
    def tiers(self) -> tuple[str, ...]:
        return TIERS if self.tier == "all" else (self.tier,)


def docker_client() -> Any:  # docker.DockerClient (the SDK ships no types)
    import docker  # only the runner needs it

    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:  # any failure to reach the engine is the same answer
        raise ToolMissing(f"the Docker engine is not reachable ({exc}); run scripts/bootstrap.sh") from None
    return client


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:200] or "image"


class SmokeRunner:
    """Runs the suite in one image at a time; `run` never raises for a broken image."""

    def __init__(self, client: Any, options: RunOptions, out: Path, harness: Path, suite: Path = SUITE_DIR,
                 tests: tuple[str, ...] = ()):
        """`tests`: folders of the suite to run, relative to it (the webhook image's: `admission`); default all of it."""
        if not (suite / "run.py").is_file():
            raise ToolMissing(f"the smoke suite is not at {suite} (pass --suite)")
        missing = [t for t in tests if not (suite / t).is_dir()]
        if missing:
            raise ToolMissing(f"the smoke suite at {suite} has no {missing[0]}/")
        self.tests = tests
        self.client = client
        self.options = options
        # Bind mounts need absolute paths.
        self.out = out.resolve()
        self.harness = harness.resolve()
        self.suite = suite.resolve()
        self.gpu_host = options.gpus == "all" or (options.gpus == "auto" and host_has_gpu())
        self.host_machine = host_platform.machine()
        self._reads_zstd: bool | None = None

    def platform_of(self, target: Target) -> PlatformExpect | None:
        """How `target` runs here: natively, or under emulation with its time limits scaled."""
        if target.platform is None:
            return None
        return platform_expect(target.platform, self.host_machine, self.options.emulation_factor)

    def wants_gpu(self, device: str, platform: PlatformExpect | None = None) -> bool:
        """GPUs for a GPU variant on a GPU host, never under emulation (the plugin skips the gpu tier, saying so)."""
        return self.gpu_host and device == "gpu" and not (platform is not None and platform.emulated)

    def remove_containers(self) -> None:
        """Remove every container this process started (after an interrupt); never raises."""
        import docker.errors
        import requests

        # The engine may be what failed; the caller's error says more than this would.
        with contextlib.suppress(docker.errors.DockerException, requests.RequestException):
            for container in self.client.containers.list(all=True, filters={"label": f"{RUN_LABEL}={RUN_ID}"}):
                container.remove(force=True)

    def pull(self, ref: str, platform: str | None = None) -> tuple[Any, float]:
        """The image and the seconds spent pulling it (a child of an index: by its digest, for its `platform`).

        By digest, the engine's copy is the same bytes, so it is used when there; a zstd image an
        engine cannot decompress is loaded from the registry's blobs first (engine_load). By tag,
        the registry is asked first (a local tag may be stale); an image only this engine has
        (never pushed) is used as it is.
        """
        import docker.errors

        started = time.monotonic()
        try:
            parts = reference.split(ref)  # the one grammar, before the engine is asked
        except reference.ReferenceError as exc:
            # A DockerException, as the engine's own refusal was: callers record "cannot get the image".
            raise docker.errors.InvalidArgument(f"not an image reference: {exc}") from None
        if parts.digest is not None:
            try:
                return self.client.images.get(ref), 0.0
            except docker.errors.ImageNotFound:
                self.pull_from_registry(ref, platform)
        else:
            try:
                self._pull(parts.name, parts.tag or "latest", None)
            except docker.errors.DockerException as exc:
                try:
                    return self.client.images.get(ref), 0.0
                except docker.errors.ImageNotFound:
                    raise exc from None
        return self.client.images.get(ref), round(time.monotonic() - started, 1)

    def pull_from_registry(self, ref: str, platform: str | None = None) -> None:
        """The image `ref` (by digest) names, from its registry even where the engine has it (layers
        it has are not fetched again); a zstd image an engine cannot decompress is loaded first."""
        parts = reference.split(ref)
        assert parts.digest is not None
        if not self.engine_reads_zstd():
            self.load_zstd(ref)
        # The name as written (the engine applies Docker's defaults itself), without the tag.
        self._pull(parts.name, parts.digest, platform)

    def _pull(self, name: str, tag: str, platform: str | None) -> None:
        """The engine's pull, its own error raised: the SDK's images.pull reads past an error in the
        progress stream, and the image it then asks for is "not found", which says nothing."""
        import docker.errors

        for event in self.client.api.pull(name, tag=tag, platform=platform, stream=True, decode=True):
            if "error" in event or "errorDetail" in event:
                detail = (event.get("errorDetail") or {}).get("message") or event.get("error")
                raise docker.errors.APIError(f"pull of {name}{'@' if ':' in tag else ':'}{tag}: {detail}")

    def engine_reads_zstd(self) -> bool:
        if self._reads_zstd is None:
            self._reads_zstd = engine_reads_zstd(str(self.client.version().get("Version", "")))
        return self._reads_zstd

    def load_zstd(self, ref: str) -> None:
        """An image with zstd layers into this engine from the registry (engine_load); as a
        DockerException, so that callers record "cannot get the image" with the reason."""
        import docker.errors

        try:
            load_from_registry(self.client, ImageRef.parse(ref))
        except EngineLoadError as exc:
            raise docker.errors.DockerException(str(exc)) from None

    def execute(self, name: str, image: Any, target: Target, expectations: Expectations,
                extras: tuple[str, ...] = (), previous: SmokeStage | None = None,
                pull_s: float | None = None) -> SmokeResult:
        """Run the suite (and `extras`) in `image`; `name` keys the output folder and the report.

        Where `previous` (this stage's last record) passed on the same digest with the same
        suite, the run is skipped and that record reused: rerunning a finished stage does nothing.
        """
        import docker.errors

        runs_as = self.platform_of(target)
        if runs_as is not None:
            expectations = replace(expectations, platform=runs_as)
        record = SmokeStage(status=StageStatus.ERROR, image=target.image, digest=target.digest, pull_s=pull_s,
                            gpu_requested=expectations.gpu_requested, tiers=list(self.options.tiers),
                            emulated=bool(runs_as and runs_as.emulated),
                            time_factor=runs_as.time_factor if runs_as else 1.0)
        result = SmokeResult(name=name, variant=target.name, record=record)
        if record.digest is None:  # --image by tag: the digest the engine knows it by
            record.digest = next((reference.split(d).digest for d in image.attrs.get("RepoDigests") or []), image.id)
        extra_paths = [Path(p).resolve() for p in extras]
        missing = [str(p) for p in extra_paths if not p.exists()]
        if missing:
            record.reason = f"extra smoke tests not found: {', '.join(missing)}"
            return result
        record.suite_digest = suite_digest([self.suite, *extra_paths], expectations, self.options.tiers)
        if (previous is not None and not self.options.force and previous.status == StageStatus.PASSED
                and previous.digest == record.digest and previous.suite_digest == record.suite_digest):
            return SmokeResult(name=name, variant=target.name, record=previous, reused=True)
        folder = self.out / _safe_name(name)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / "expect.json").write_text(json.dumps(expectations.to_json(), indent=2) + "\n")
        (folder / "expect.json").chmod(0o644)
        results = folder / "results"
        results.mkdir()
        results.chmod(0o777)  # written by the image's own (non-root, unknown) user
        record.log = str(folder / "output.log")
        try:
            self._run_container(image.id, target, extra_paths, folder, record)
        except docker.errors.DockerException as exc:
            record.status, record.reason = StageStatus.ERROR, f"docker: {_short(exc)}"
        finally:
            results.chmod(0o755)
        return result

    def _run_container(self, image_id: str, target: Target, extras: list[Path], folder: Path,
                       record: SmokeStage) -> None:
        import docker.types
        import requests

        mounts = [
            docker.types.Mount(SUITE_MOUNT, str(self.suite), type="bind", read_only=True),
            docker.types.Mount(HARNESS_MOUNT, str(self.harness), type="bind", read_only=True),
            docker.types.Mount(EXPECT_MOUNT, str(folder / "expect.json"), type="bind", read_only=True),
            docker.types.Mount(OUT_MOUNT, str(folder / "results"), type="bind", read_only=False),
        ]
        args = ["--rootdir", MOUNT_ROOT, "--junitxml", f"{OUT_MOUNT}/junit.xml",
                "-o", f"junit_suite_name={target.name}"]
        if self.options.tier != "all":
            args += ["-m", self.options.tier]
        args += [f"{SUITE_MOUNT}/{test}" for test in self.tests] or [SUITE_MOUNT]
        for i, path in enumerate(extras):
            inside = f"{EXTRA_MOUNT}/{i}/{path.name}"
            mounts.append(docker.types.Mount(inside, str(path), type="bind", read_only=True))
            args.append(inside)
        gpu = record.gpu_requested
        container = self.client.containers.create(
            image_id, entrypoint=["python", "-B", f"{SUITE_MOUNT}/run.py"], command=args,
            platform=target.platform,
            working_dir=MOUNT_ROOT, mounts=mounts,
            environment=dict(CONTAINER_ENV),
            # An init as PID 1: the suite's Python as PID 1 ignores the signals it has no handler
            # for, so a library that abort()s could leave it hanging instead of dead.
            init=True, network_disabled=True, read_only=self.options.read_only,
            tmpfs={"/tmp": "rw,nosuid,nodev,size=2g"},
            mem_limit=self.options.memory, memswap_limit=self.options.memory,
            nano_cpus=int(self.options.cpus * 1e9), pids_limit=self.options.pids_limit,
            cap_drop=["ALL"], security_opt=["no-new-privileges"],
            shm_size="1g" if gpu else None,
            device_requests=[docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if gpu else None,
            labels={"io.imagebuild.smoke": target.name, RUN_LABEL: RUN_ID},
        )
        started = time.monotonic()
        timed_out = False
        timeout_s = self.options.timeout_s * record.time_factor  # the backstop scales with each test's limit
        try:
            container.start()
            try:
                exit_code = container.wait(timeout=timeout_s)["StatusCode"]
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                timed_out, exit_code = True, None
                container.kill()
            record.duration_s = round(time.monotonic() - started, 1)
            container.reload()
            oom = bool(container.attrs.get("State", {}).get("OOMKilled"))
            Path(record.log or folder / "output.log").write_bytes(container.logs(stdout=True, stderr=True))
        finally:
            container.remove(force=True)  # also stops it, when an interrupt got here first
        junit = folder / "results" / "junit.xml"
        summary = None
        if junit.is_file():
            try:
                summary = parse_junit(junit.read_text(encoding="utf-8"))
                record.junit = str(junit)
            except ET.ParseError:
                summary = None
        record.exit_code = exit_code
        (summary or JunitSummary()).into(record)
        record.status, record.reason = classify(exit_code, summary, timed_out=timed_out,
                                                timeout_s=timeout_s, oom=oom)


def _short(exc: BaseException) -> str:
    return first_line(str(exc), 300)


# --- the build report -------------------------------------------------------------------------


def record_results(report_path: Path, results: Iterable[SmokeResult]) -> None:
    """Put each result's record into its variant's `stages["smoke"]` (see report.record_stage)."""
    record_stage(report_path, SmokeStage.STAGE, {r.name: r.record for r in results})


def report_matrix_path(report: BuildReport, report_path: Path, override: Path | None) -> Path:
    """The matrix a report was built from: --matrix, else the report's path (relative to where
    the build ran, usually the repository root, which is where CI runs this too)."""
    if override is not None:
        return override
    path = Path(report.matrix)
    if not path.is_file():
        raise InputError(str(report_path), None, "matrix",
                         f"'{report.matrix}' is not found from here; pass --matrix with the matrix it was built from")
    return path


# --- the two ways in: a build report, or images by reference ------------------------------------


def load_context(matrix_path: Path) -> MatrixContext:
    from imagebuild.build.plan import build_plan
    from imagebuild.config.matrix import load_matrix

    matrix = load_matrix(matrix_path)
    return MatrixContext(matrix, build_plan(matrix))


def _error(name: str, variant: str, image: str, digest: str | None, reason: str, runner: SmokeRunner,
           status: StageStatus = StageStatus.ERROR) -> SmokeResult:
    """A run that did not get to the suite (or was cut short): its record says why."""
    record = SmokeStage(status=status, image=image, digest=digest, reason=reason, tiers=list(runner.options.tiers))
    return SmokeResult(name=name, variant=variant, record=record)


def run_report(report_path: Path, matrix_path: Path | None, selection: Selection,
               make_runner: Callable[[], SmokeRunner],
               on_result: Callable[[SmokeResult], None] = lambda r: None) -> list[SmokeResult]:
    """Every (selected) variant of a build report; each result goes into the report at once.

    The report and the matrix are checked before `make_runner` sets anything up, so bad
    input fails fast and leaves nothing behind.
    """
    report = BuildReport.read(report_path)
    records = selection.choose(report.variants, str(report_path))
    ctx = load_context(report_matrix_path(report, report_path, matrix_path))
    for rec in records:  # all of them before the first container: bad input costs nothing
        if ctx.find(rec.id) is None:
            raise InputError(ctx.matrix.file, None, "", f"has no variant {rec.id} (was the matrix changed "
                                                        "since the build? pass the one it was built from)")
    revision = report.revision or None

    def expect(target: Target, labels: Mapping[str, str], gpu_requested: bool) -> Expectations:
        return ctx.expectations(target, labels, revision, gpu_requested)

    return run_records(report_path, records, make_runner(), expect, ctx.extra_tests, on_result)


# What a variant's image should be: (its target, the image's labels, whether GPUs were requested) -> expectations.
ExpectationsFor = Callable[[Target, Mapping[str, str], bool], Expectations]


def run_records(report_path: Path, records: Iterable[VariantRecord], runner: SmokeRunner, expect: ExpectationsFor,
                extra_tests: Callable[[str], tuple[str, ...]] = lambda _: (),
                on_result: Callable[[SmokeResult], None] = lambda r: None) -> list[SmokeResult]:
    """Each built variant of a report in turn, its result recorded at once; a matrix's (run_report) or
    the webhook image's, which says what it should be without one (`expect`)."""
    results = []
    for rec in records:
        with _unfinished_recorded(report_path, rec.id, rec.image or "", rec.digest, runner):
            result = _run_record(rec, runner, expect, extra_tests(rec.id))
        record_results(report_path, [result])
        results.append(result)
        on_result(result)
    return results


@contextlib.contextmanager
def _unfinished_recorded(report_path: Path, name: str, image: str, digest: str | None,
                         runner: SmokeRunner) -> Iterator[None]:
    """An interrupt or an unexpected error: the container goes, the report says this run did not finish."""
    try:
        yield
    except BaseException as exc:
        with uninterrupted():  # a signal now waits until the container is gone and the report says so
            runner.remove_containers()
            interrupted = isinstance(exc, KeyboardInterrupt)
            reason = "interrupted" if interrupted else f"stopped on an error: {_short(exc)}"
            result = _error(name, name, image, digest, reason, runner,
                            StageStatus.INTERRUPTED if interrupted else StageStatus.ERROR)
            with contextlib.suppress(OSError, ValueError):  # the report may be what failed; the error says more
                record_results(report_path, [result])
        raise


def _run_record(rec: VariantRecord, runner: SmokeRunner, expect: ExpectationsFor,
                extra_tests: tuple[str, ...]) -> SmokeResult:
    if rec.status != "built" or not rec.image:
        return _error(rec.id, rec.id, rec.image or "", rec.digest, f"not built (build status: {rec.status})", runner)
    previous = rec.stage(SmokeStage)
    if not rec.multi_platform:
        return _run_target(rec.id, target_for_record(rec), runner, expect, extra_tests, previous)
    # Each child by its own digest, the foreign ones under emulation; each one's earlier record is
    # its own, so a rerun reuses exactly the children that passed on the same digest and suite.
    children = []
    for child, target in zip(rec.children, targets_for_children(rec)):
        earlier = previous.for_platform(child.platform) if previous is not None else None
        name = f"{rec.id}/{child.platform}"
        children.append((child, _run_target(name, target, runner, expect, extra_tests, earlier)))
    record = SmokeStage.of_children(rec.digest, rec.image, [(c, r.record) for c, r in children])
    record.pull_s = _total([r.record.pull_s for _, r in children])
    record.duration_s = _total([r.record.duration_s for _, r in children])
    return SmokeResult(name=rec.id, variant=rec.id, record=record, reused=all(r.reused for _, r in children))


def _total(seconds: list[float | None]) -> float | None:
    return round(sum(s for s in seconds if s is not None), 1) if any(s is not None for s in seconds) else None


def _run_target(name: str, target: Target, runner: SmokeRunner, expect: ExpectationsFor,
                extra_tests: tuple[str, ...], previous: SmokeStage | None) -> SmokeResult:
    """One image of a variant (the variant's own, or one child of its index); `name` keys its output folder."""
    import docker.errors

    try:
        image, pull_s = runner.pull(target.image, target.platform)
    except docker.errors.DockerException as exc:
        return _error(name, target.name, target.image, target.digest, f"cannot get the image: {_short(exc)}", runner)
    gpu = runner.wants_gpu(target.device, runner.platform_of(target))
    expectations = expect(target, image.labels or {}, gpu)
    return runner.execute(name, image, target, expectations, extra_tests, previous=previous, pull_s=pull_s)


def run_images(refs: tuple[str, ...], matrix_path: Path | None, make_runner: Callable[[], SmokeRunner],
               on_result: Callable[[SmokeResult], None] = lambda r: None) -> list[SmokeResult]:
    """Images by reference. What each should be comes from its labels; with a matrix, from the
    matrix's variant of that name (versions, labels, user, setuid allowlist, extra tests)."""
    import docker.errors

    ctx = load_context(matrix_path) if matrix_path is not None else None
    runner = make_runner()
    results = []
    for ref in refs:
        try:
            image, pull_s = runner.pull(ref)
            target, expectations, extras = _image_expectations(ref, dict(image.labels or {}), ctx, runner)
        except docker.errors.DockerException as exc:
            result = _error(ref, "", ref, None, f"cannot get the image: {_short(exc)}", runner)
        except InputError as exc:
            result = _error(ref, "", ref, None, str(exc), runner)
        else:
            try:
                result = runner.execute(ref, image, target, expectations, extras, pull_s=pull_s)
            except BaseException:
                with uninterrupted():
                    runner.remove_containers()
                raise
        results.append(result)
        on_result(result)
    return results


def _image_expectations(ref: str, labels: dict[str, str], ctx: MatrixContext | None,
                        runner: SmokeRunner) -> tuple[Target, Expectations, tuple[str, ...]]:
    target = target_from_labels(ref, labels)
    if ctx is None:
        return target, expectations_from_labels(target, labels, runner.wants_gpu(target.device)), ()
    found = ctx.find(target.name)
    if found is None:
        raise InputError(ctx.matrix.file, None, "", f"has no variant {target.name} (the io.imagebuild.variant "
                                                    f"label of {ref})")
    v = found[0]
    target = Target(name=v.id, image=ref, digest=None, device=v.device, paddle=v.paddle, python=v.python,
                    cuda=v.cuda, cudnn=v.cudnn, tags=v.tags)
    expectations = ctx.expectations(target, labels, None, runner.wants_gpu(target.device))
    return target, expectations, ctx.extra_tests(target.name)
