"""Smoke tests inside built images: the pure core of `imagebuild test` (no I/O).

    expectations (from the build report + matrix, or from an image's labels)
    -> [smoke_run.py: one container per image runs smoke_tests/ with pytest]
    -> JUnit XML -> its record (parse_junit, classify) -> build report `stages["smoke"]` (report.SmokeStage)

Sign and push read that record: `VariantRecord.refusal(SmokeStage, ...)` (report.py) says whether
the smoke tests passed, with the abi tier, on the variant's very digest.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from imagebuild.core.report import SmokeStage, StageStatus, VariantRecord
from imagebuild.core.source import InputError
from imagebuild.oci.platforms import Platform

if TYPE_CHECKING:  # release files (rollout) and sign read this module; they need neither the matrix nor the plan (jinja2)
    from imagebuild.build.plan import Plan, Variant
    from imagebuild.config.matrix import Combination, Matrix

EXPECT_SCHEMA = "imagebuild.smoke-expect/v1"  # read by smoke_tests/imagebuild_smoke.py

# The labels `--image` needs to know what an image claims to be (set by the release layer).
REQUIRED_LABELS = ("io.imagebuild.variant", "io.imagebuild.paddle.version", "io.imagebuild.python.version",
                   "io.imagebuild.cuda.version", "io.imagebuild.cudnn.version")


# --- platforms (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """What an image of one OCI architecture is, as the suite sees it from inside (test_abi.py)."""

    machine: str  # platform.machine(), uname -m
    multiarch: str  # Debian's multiarch triplet: /usr/lib/<multiarch>, sysconfig's MULTIARCH
    elf_machine: int  # e_machine of its ELF files (EM_X86_64, EM_AARCH64)


# The architectures the support table names platforms of; an image of any other is not judged by them.
ARCHITECTURES = {
    "amd64": Architecture("x86_64", "x86_64-linux-gnu", 62),
    "arm64": Architecture("aarch64", "aarch64-linux-gnu", 183),
}
# A foreign platform runs under qemu-user (binfmt), so each of its time limits (each test's, Paddle's
# import, the container's backstop) is scaled by this (--emulation-factor). Measured on a 2-core x86-64
# host, Paddle 3.2.2's linux/arm64 child: the abi tier 26.5 s (container 29.9 s) against 5.4 s (6.9 s)
# natively; its slowest test, the CPU training loop, 12.5 s against 1.0 s (12x), `import paddle` about
# 12 s. The native limits are about 60 times the native times (60 s a test), so 5 leaves each emulated
# test over 20 times its measured time on a loaded machine while a hang still costs at most 5 minutes.
DEFAULT_EMULATION_FACTOR = 5.0


def host_architecture(machine: str) -> str | None:
    """The OCI architecture of a host whose `uname -m` is `machine` (None: one the table does not know)."""
    return next((arch for arch, a in ARCHITECTURES.items() if a.machine == machine), None)


def emulated(platform: str, host_machine: str) -> bool:
    """Does an image of `platform` run under emulation on this host? Every architecture but the host's does."""
    return Platform.parse(platform).architecture != host_architecture(host_machine)


@dataclass(frozen=True)
class PlatformExpect:
    """The platform an image is for, what follows from it inside the image, and how it runs here."""

    platform: str
    emulated: bool = False
    time_factor: float = 1.0  # every time limit of the run, scaled (emulation is slower)

    @property
    def architecture(self) -> Architecture | None:
        return ARCHITECTURES.get(Platform.parse(self.platform).architecture)

    def to_json(self) -> dict[str, Any]:
        arch = self.architecture
        return {"platform": self.platform, "emulated": self.emulated, "time_factor": self.time_factor,
                "machine": arch.machine if arch else None, "multiarch": arch.multiarch if arch else None,
                "elf_machine": arch.elf_machine if arch else None}


def platform_expect(platform: str, host_machine: str, emulation_factor: float) -> PlatformExpect:
    """How an image of `platform` runs on a host of `host_machine`: natively, or emulated with its own time limits."""
    foreign = emulated(platform, host_machine)
    return PlatformExpect(platform, foreign, emulation_factor if foreign else 1.0)


# --- expectations (pure) --------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One image to test and what it claims to be."""

    name: str  # variant id, or the reference given with --image
    image: str  # what the engine runs: repository@digest, or the reference given
    digest: str | None
    device: str
    paddle: str
    python: str
    cuda: str | None
    cudnn: str | None
    tags: tuple[str, ...] = ()
    platform: str | None = None  # the platform this image is for (a multi-platform variant's child's); None: not known


@dataclass(frozen=True)
class Expectations:
    variant: str
    image: str
    device: str
    paddle: str
    python: str
    cuda: str | None
    cudnn: str | None
    labels_expected: dict[str, str]
    labels_actual: dict[str, str]
    setuid_allowlist: tuple[str, ...] = ()
    uid: int | None = None
    gid: int | None = None
    gpu_requested: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)  # what a suite of its own needs (the webhook image's)
    platform: PlatformExpect | None = None  # set by the runner for an image whose platform is known

    def to_json(self) -> dict[str, Any]:
        data = {
            "schema": EXPECT_SCHEMA, "variant": self.variant, "image": self.image, "device": self.device,
            "paddle": self.paddle, "python": self.python, "cuda": self.cuda, "cudnn": self.cudnn,
            "labels": {"expected": dict(sorted(self.labels_expected.items())),
                       "actual": dict(sorted(self.labels_actual.items()))},
            "setuid_allowlist": list(self.setuid_allowlist), "uid": self.uid, "gid": self.gid,
            "gpu_requested": self.gpu_requested,
        }
        if self.extra:  # only when set: the expectations (and so the suite digest) of a matrix variant stay as they were
            data["extra"] = dict(self.extra)
        if self.platform is not None:
            data["platform"] = self.platform.to_json()
        return data


def expected_labels(target: Target, os_name: str, matrix: Matrix, combo: Combination,
                    revision: str | None, base_name: str | None = None) -> dict[str, str]:
    """The labels the release layer sets (plan._release), minus the ones only the build knows.

    tests/test_smoke_unit.py compares this with the rendered release Dockerfile, so the two
    cannot drift apart unnoticed.
    """
    labels = {
        "org.opencontainers.image.title": matrix.repository,
        "io.imagebuild.variant": target.name,
        "io.imagebuild.os": os_name,
        "io.imagebuild.paddle.version": target.paddle,
        "io.imagebuild.python.version": target.python,
        "io.imagebuild.cuda.version": target.cuda or "none",
        "io.imagebuild.cudnn.version": target.cudnn or "none",
    }
    if target.tags:
        labels["org.opencontainers.image.version"] = target.tags[0]
    if revision:
        labels["org.opencontainers.image.revision"] = revision
    if base_name:
        labels["org.opencontainers.image.base.name"] = base_name
    if matrix.source:
        labels["org.opencontainers.image.source"] = matrix.source
    labels.update(dict(matrix.labels))
    labels.update(dict(combo.labels))
    return labels


@dataclass(frozen=True)
class MatrixContext:
    """The matrix and its plan, for what a build report does not record."""

    matrix: Matrix
    plan: Plan

    def find(self, variant_id: str) -> tuple[Variant, Combination] | None:
        for variant, combo in zip(self.plan.variants, self.matrix.combinations):
            if variant.id == variant_id:
                return variant, combo
        return None

    def base_name(self, variant: Variant) -> str | None:
        """The image the variant's chain starts FROM (the org.opencontainers.image.base.name label)."""
        root = self.plan.layers[variant.chain[0]].root
        return root.image if root else None

    def extra_tests(self, variant_id: str) -> tuple[str, ...]:
        """The matrix's extra smoke tests for a variant: `all`, each layer kind in its chain, each
        extra layer it has, then its include entry's own `smoke`; in that order, once each."""
        found = self.find(variant_id)
        if found is None:
            return ()
        from imagebuild.config.matrix import LAYER_KINDS, SMOKE_ALL

        variant, combo = found
        kinds = {self.plan.layers[key].kind for key in variant.chain}
        keys = [SMOKE_ALL, *(k for k in LAYER_KINDS if k in kinds),
                *(e.name for e in self.matrix.extra_layers if e.applies_to(combo.axes))]
        paths = [p for k in keys for p in self.matrix.smoke.get(k, ())] + list(combo.smoke)
        return tuple(dict.fromkeys(paths))

    def expectations(self, target: Target, labels_actual: Mapping[str, str], revision: str | None,
                     gpu_requested: bool) -> Expectations:
        found = self.find(target.name)
        if found is None:
            raise InputError(self.matrix.file, None, "", f"has no variant {target.name} (was the matrix "
                                                         "changed since the build? pass the one it was built from)")
        variant, combo = found
        m = self.matrix
        return Expectations(
            variant=target.name, image=target.image, device=target.device, paddle=target.paddle,
            python=target.python, cuda=target.cuda, cudnn=target.cudnn,
            labels_expected=expected_labels(target, variant.os, m, combo, revision, self.base_name(variant)),
            labels_actual=dict(labels_actual), setuid_allowlist=m.setuid_allowlist,
            uid=m.user.uid, gid=m.user.gid, gpu_requested=gpu_requested)


def target_for_record(record: VariantRecord) -> Target:
    """A single-platform variant's image (its digest is that platform's image); see `targets_for_children`."""
    return Target(name=record.id, image=record.image or "", digest=record.digest, device=record.device,
                  paddle=record.paddle, python=record.python, cuda=record.cuda, cudnn=record.cudnn,
                  tags=tuple(record.tags), platform=record.platforms[0] if record.platforms else None)


def targets_for_children(record: VariantRecord) -> list[Target]:
    """A multi-platform variant's images to test: each child by its own digest, in platform order."""
    base = target_for_record(record)
    return [replace(base, image=record.child_image(c), digest=c.digest, platform=c.platform) for c in record.children]


def target_from_labels(ref: str, labels: Mapping[str, str]) -> Target:
    """--image: what the image says it is. The release layer sets these labels on every variant."""
    missing = [key for key in REQUIRED_LABELS if key not in labels]
    if missing:
        raise InputError("--image", None, ref, f"has no {missing[0]} label: not an imagebuild release image")
    cuda = labels["io.imagebuild.cuda.version"]
    cudnn = labels["io.imagebuild.cudnn.version"]
    version = labels.get("org.opencontainers.image.version")
    return Target(name=labels["io.imagebuild.variant"], image=ref, digest=None,
                  device="cpu" if cuda == "none" else "gpu", paddle=labels["io.imagebuild.paddle.version"],
                  python=labels["io.imagebuild.python.version"], cuda=None if cuda == "none" else cuda,
                  cudnn=None if cudnn == "none" else cudnn, tags=(version,) if version else ())


def expectations_from_labels(target: Target, labels: Mapping[str, str], gpu_requested: bool) -> Expectations:
    """Without a matrix: the image must at least carry its own labels consistently."""
    return Expectations(
        variant=target.name, image=target.image, device=target.device, paddle=target.paddle,
        python=target.python, cuda=target.cuda, cudnn=target.cudnn,
        labels_expected={key: labels[key] for key in REQUIRED_LABELS}, labels_actual=dict(labels),
        gpu_requested=gpu_requested)


# --- results (pure) -------------------------------------------------------------------------


@dataclass
class JunitSummary:
    """What a JUnit report says; its fields are the smoke record's of the same names (`into`)."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)  # {test, message}
    skip_reasons: list[dict[str, str]] = field(default_factory=list)  # {test, reason}

    def into(self, record: SmokeStage) -> None:
        """Put these counts, failures and skip reasons into a smoke record."""
        for f in fields(self):
            setattr(record, f.name, getattr(self, f.name))


def first_line(text: str, limit: int = 400) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def parse_junit(text: str) -> JunitSummary:
    """pytest's JUnit XML -> counts, failure messages and skip reasons, per test case."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(text)
    summary = JunitSummary()
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            assert node is not None
            message = first_line(node.get("message") or node.text or "")
            if failure is not None:
                summary.failed += 1
            else:
                summary.errors += 1
            summary.failures.append({"test": name, "message": message})
        elif skipped is not None:
            summary.skipped += 1
            reason = skipped.get("message") or skipped.text or ""
            summary.skip_reasons.append({"test": name, "reason": first_line(reason)})
        else:
            summary.passed += 1
    return summary


def classify(exit_code: int | None, summary: JunitSummary | None, *, timed_out: bool = False,
             timeout_s: float | None = None, oom: bool = False) -> tuple[StageStatus, str | None]:
    """(passed | failed | error, why). pytest exits 0 (passed), 1 (tests failed), 2-5 (trouble)."""
    if timed_out:
        return StageStatus.ERROR, f"timed out after {timeout_s:g} s; the container was killed"
    if oom:
        return StageStatus.ERROR, "killed by the memory limit (raise --memory)"
    if summary is None:
        return StageStatus.ERROR, f"no JUnit report (exit code {exit_code}); see the log"
    if summary.failed or summary.errors:
        first = summary.failures[0] if summary.failures else {"test": "?", "message": ""}
        return (StageStatus.FAILED,
                f"{summary.failed + summary.errors} test(s) failed, first: {first['test']}: {first['message']}")
    if exit_code != 0:
        meaning = {2: "interrupted", 3: "pytest internal error", 4: "pytest usage error",
                   5: "no tests collected"}.get(exit_code or -1, "unexpected exit")
        return StageStatus.ERROR, f"pytest exited with code {exit_code} ({meaning}); see the log"
    if summary.passed == 0:
        return StageStatus.ERROR, "every test was skipped: nothing was verified"
    return StageStatus.PASSED, None


@dataclass
class SmokeResult:
    """One image's smoke run: which image it was, and the record it made (build report `stages["smoke"]`)."""

    name: str  # the variant id; with --image, the reference given
    variant: str  # the variant id ("" when an --image could not be read)
    record: SmokeStage
    reused: bool = False  # an earlier identical run's record, not run again
