"""The builder pool (build/pool.py): where each layer is built, and what happens when a builder goes away.

The pool is driven the way a build drives it: Builder (the product's scheduler) over a real plan of
a small two-platform matrix, the pool as its layer builder. Each builder is a FakeDaemon, an
in-process LayerBuilder of our own protocol that records what it built and can be made unreachable
at the probe or to go away in the middle of a chosen layer (raising BuilderDown, as buildkit.py does
when the daemon stops answering). tests/e2e/test_builder_pool.py does the same with real daemons.

    per platform: base/debian12 -> python/debian12-py3.10 -> paddle/...-paddle3.1.0 -> release/...
                                -> python/debian12-py3.11 -> paddle/...            -> release/...

Concurrency is shown with barriers and events, never with sleeps; WAIT_S only bounds how long a
broken pool can keep a test waiting.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from imagebuild.build.buildkit import BuilderDown, Workers
from imagebuild.build.plan import Layer, Plan, build_plan
from imagebuild.build.pool import BuilderPool, Member
from imagebuild.build.render import write_tree
from imagebuild.build.scheduler import Builder, BuildOptions, LayerResult, TagVariant, planned_report
from imagebuild.config.builders import BUILDKIT, BuilderSpec
from imagebuild.config.matrix import load_matrix
from imagebuild.core.report import BuilderStatus, BuildReport, LayerRecord, LayerStatus, VariantStatus
from imagebuild.oci.platforms import Platform

WAIT_S = 30
AMD64, ARM64 = "linux/amd64", "linux/arm64"
DEBIAN12 = "sha256:" + "12" * 32
MATRIX = f"""\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle
os:
  debian12: {{image: docker.io/library/debian:12, digest: "{DEBIAN12}", family: debian}}
matrix:
  os: [debian12]
  cuda: [cpu]
  python: ["3.10", "3.11"]
  paddle: ["3.1.0"]
platforms:
  cpu: [linux/amd64, linux/arm64]
tags:
  gpu: ["{{paddle}}-gpu-{{os}}{{py_suffix}}"]
  cpu: ["{{paddle}}-{{os}}{{py_suffix}}"]
"""
PER_PLATFORM = 7  # base, two python, two paddle, two release layers


def digest_of(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


Script = Callable[[Layer, LayerRecord], LayerResult]


class FakeDaemon:
    """One builder: succeeds with digest_of(key) unless `scripts` says otherwise for a layer's path or
    kind (base, python, ...); `reachable = False` makes its probe and every build raise BuilderDown."""

    def __init__(self, name: str, platforms: tuple[str, ...] = (AMD64,), scripts: Mapping[str, Script] | None = None):
        self.name = name
        self.platforms = platforms
        self.scripts = dict(scripts or {})
        self.reachable = True
        self.built: list[tuple[str, str]] = []  # (kind, platform) of each layer it built
        self.started: list[str] = []  # keys, as builds began
        self.in_flight = 0
        self.peak = 0
        self.stopped = threading.Event()
        self._lock = threading.Lock()

    def probe(self) -> Workers:
        if not self.reachable:
            raise BuilderDown(f"builder {self.name} does not answer: connection refused")
        return Workers(self.platforms, "v0.26.2")

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        log.write_text(f"{self.name}: building {layer.path}\n")
        with self._lock:
            self.started.append(layer.key)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            if not self.reachable:
                raise BuilderDown(f"builder {self.name} went away")
            assert layer.platform in self.platforms, f"{self.name} was sent a {layer.platform} layer"
            script = self.scripts.get(layer.path) or self.scripts.get(layer.kind)
            result = script(layer, rec) if script else LayerResult(digest_of(layer.key))
            if result.digest:
                with self._lock:
                    self.built.append((layer.kind, layer.platform))
            return result
        finally:
            with self._lock:
                self.in_flight -= 1

    def stop(self) -> None:
        self.stopped.set()

    def until_stopped(self, layer: Layer, rec: LayerRecord) -> LayerResult:
        """A script: a build that hangs (a half-open connection) until the pool stops this builder."""
        assert self.stopped.wait(WAIT_S), f"the pool never stopped {self.name}"
        return LayerResult.failed("buildctl: terminated")

    def dies(self, layer: Layer, rec: LayerRecord) -> LayerResult:
        """A script: the daemon goes away during this layer (and stays away)."""
        self.reachable = False
        raise BuilderDown(f"builder {self.name} went away: connection reset")


def member(daemon: FakeDaemon, concurrency: int = 1, platforms: tuple[str, ...] = ()) -> Member:
    spec = BuilderSpec(daemon.name, BUILDKIT, f"tcp://127.0.0.1:{1000 + len(daemon.name)}",
                       platforms=tuple(Platform.parse(p) for p in platforms), concurrency=concurrency)
    return Member.of(spec, lambda: daemon, daemon.probe)


class Tags:
    def __init__(self) -> None:
        self.given: dict[str, str] = {}

    @contextlib.contextmanager
    def session(self) -> Iterator[TagVariant]:
        yield lambda variant, digest: self.given.__setitem__(variant.id, digest)

    def index(self, children: Mapping[str, str]) -> str:
        return digest_of(",".join(children.values()))


@pytest.fixture
def plan(tmp_path) -> Plan:
    (tmp_path / "matrix.yaml").write_text(MATRIX, encoding="utf-8")
    the_plan = build_plan(load_matrix(tmp_path / "matrix.yaml"))
    write_tree(tmp_path / "dockerfiles", the_plan.rendered_files())
    return the_plan


def build(plan: Plan, tmp_path: Path, *members: Member, jobs: int | None = None,
          held: tuple[str, ...] = ()) -> tuple[BuildReport, BuilderPool]:
    """Builder over the pool of `members`, every variant; `held`: layer paths the registry has already."""
    pool = BuilderPool(members)
    report = planned_report(plan, plan.variants, {k: digest_of(k) for k, layer in plan.layers.items()
                                                  if layer.path in held})
    report.builders = pool.records
    jobs = jobs if jobs is not None else sum(m.spec.concurrency for m in members)
    options = BuildOptions(jobs=jobs, dockerfiles=tmp_path / "dockerfiles", workdir=tmp_path / "work")
    return Builder(plan, report, options, lambda event, rec: None, layer_builder=pool, tagger=Tags()).run(), pool


def by_platform(report: BuildReport, platform: str) -> list[LayerRecord]:
    return [rec for rec in report.layers if rec.platform == platform]


# --- where layers go --------------------------------------------------------------------------------


def test_each_layer_is_built_on_a_builder_of_its_platform_and_the_report_says_which(plan, tmp_path):
    amd, arm = FakeDaemon("amd", (AMD64,)), FakeDaemon("arm", (ARM64,))
    report, _ = build(plan, tmp_path, member(amd), member(arm))

    assert {p for _, p in amd.built} == {AMD64} and {p for _, p in arm.built} == {ARM64}
    assert all(rec.builder == "amd" and rec.attempts == 1 for rec in by_platform(report, AMD64))
    assert all(rec.builder == "arm" and rec.attempts == 1 for rec in by_platform(report, ARM64))
    assert [(b.name, b.status, b.platforms, b.version, b.built) for b in report.builders] == [
        ("amd", BuilderStatus.UP, [AMD64], "v0.26.2", PER_PLATFORM),
        ("arm", BuilderStatus.UP, [ARM64], "v0.26.2", PER_PLATFORM)]
    assert all(v.status == VariantStatus.BUILT and len(v.children) == 2 for v in report.variants)


def test_a_builder_builds_at_most_its_concurrency_at_once_and_does_use_it(plan, tmp_path):
    # Both platforms' python layers become due together; the two-slot builder must take two at
    # once (the barrier needs both), the one-slot builder never more than one.
    both = threading.Barrier(2, timeout=WAIT_S)

    def meet(layer: Layer, rec: LayerRecord) -> LayerResult:
        both.wait()
        return LayerResult(digest_of(layer.key))

    wide = FakeDaemon("wide", (AMD64,), scripts={"python": meet})
    narrow = FakeDaemon("narrow", (ARM64,))
    report, _ = build(plan, tmp_path, member(wide, concurrency=2), member(narrow, concurrency=1), jobs=8)

    assert (wide.peak, narrow.peak) == (2, 1)
    assert all(rec.status == LayerStatus.BUILT for rec in report.layers)


def test_layers_of_one_platform_spread_over_its_builders(plan, tmp_path):
    both = threading.Barrier(2, timeout=WAIT_S)

    def meet(layer: Layer, rec: LayerRecord) -> LayerResult:
        both.wait()  # each builder has one slot: the two python layers meet only on two builders
        return LayerResult(digest_of(layer.key))

    a = FakeDaemon("a", (AMD64, ARM64), scripts={"python": meet})
    b = FakeDaemon("b", (AMD64, ARM64), scripts={"python": meet})
    report, _ = build(plan, tmp_path, member(a), member(b), jobs=2)

    assert a.built and b.built
    assert len(a.built) + len(b.built) == 2 * PER_PLATFORM
    assert all(rec.status == LayerStatus.BUILT for rec in report.layers)


def test_layers_the_registry_holds_go_to_no_builder(plan, tmp_path):
    a = FakeDaemon("a", (AMD64, ARM64))
    report, _ = build(plan, tmp_path, member(a, concurrency=2), held=("base/debian12",))

    assert [kind for kind, _ in a.built].count("base") == 0
    assert all(rec.builder is None for rec in report.layers if rec.status == LayerStatus.REUSED)
    assert len(a.built) == 2 * (PER_PLATFORM - 1)


# --- builders that go away ----------------------------------------------------------------------------


def test_a_builder_unreachable_at_the_start_gets_no_layer(plan, tmp_path):
    gone, there = FakeDaemon("gone", (AMD64, ARM64)), FakeDaemon("there", (AMD64, ARM64))
    gone.reachable = False
    report, _ = build(plan, tmp_path, member(gone), member(there))

    assert gone.started == [] and len(there.built) == 2 * PER_PLATFORM
    down = report.builders[0]
    assert (down.status, down.error) == (BuilderStatus.DOWN, "builder gone does not answer: connection refused")
    assert all(rec.builder == "there" and rec.attempts == 1 for rec in report.layers)


def test_a_builder_that_dies_mid_build_has_that_layer_built_again_on_another(plan, tmp_path):
    first = FakeDaemon("first", (AMD64,))
    first.scripts["python"] = first.dies
    second = FakeDaemon("second", (AMD64,))
    arm = FakeDaemon("arm", (ARM64,))
    report, _ = build(plan, tmp_path, member(first, concurrency=2), member(second), member(arm))

    assert all(rec.status == LayerStatus.BUILT for rec in report.layers)
    amd = {rec.path: rec for rec in by_platform(report, AMD64)}
    # The base was built on `first` before it went away; the python layer it died in went to `second`.
    base = next(rec for path, rec in amd.items() if path.startswith("base/"))
    assert (base.builder, base.attempts) == ("first", 1)
    moved = [rec for rec in amd.values() if rec.attempts == 2]
    assert moved and all(rec.builder == "second" and rec.path.startswith("python/") for rec in moved)
    assert all(rec.builder == "second" for rec in amd.values() if not rec.path.startswith(("base/", "python/")))
    # The attempt on the builder that went away keeps its log beside the one that built it.
    attempt = Path(moved[0].log or "").with_name(Path(moved[0].log or "").stem + ".attempt1.log")
    assert attempt.read_text() == f"first: building {moved[0].path}\n"
    assert (report.builders[0].status, report.builders[0].error) == (BuilderStatus.DOWN,
                                                                     "builder first went away: connection reset")
    assert [b.built for b in report.builders] == [1, PER_PLATFORM - 1, PER_PLATFORM]


def test_every_in_flight_layer_of_a_dying_builder_finishes_elsewhere(plan, tmp_path):
    # Both amd64 python layers are in flight on `first` (the barrier holds them there) when it
    # goes away; each build then fails as its connection drops, and both go to `second`.
    both = threading.Barrier(2, timeout=WAIT_S)
    first = FakeDaemon("first", (AMD64,))

    def in_flight_then_gone(layer: Layer, rec: LayerRecord) -> LayerResult:
        both.wait()
        return first.dies(layer, rec)

    first.scripts["python"] = in_flight_then_gone
    second = FakeDaemon("second", (AMD64, ARM64))
    report, _ = build(plan, tmp_path, member(first, concurrency=2), member(second, concurrency=1), jobs=3)

    pythons = [rec for rec in by_platform(report, AMD64) if rec.path.startswith("python/")]
    assert [(rec.builder, rec.attempts, rec.status) for rec in pythons] == [("second", 2, LayerStatus.BUILT)] * 2
    assert all(rec.status == LayerStatus.BUILT for rec in report.layers)


def test_a_build_that_hangs_on_a_builder_that_went_down_is_stopped_and_built_elsewhere(plan, tmp_path):
    # Both amd64 python layers run on `first`: py3.10's build hangs, py3.11's loses the daemon. The
    # pool stops the hanging one rather than wait for its timeout, and builds both on `second`.
    both = threading.Barrier(2, timeout=WAIT_S)
    first = FakeDaemon("first", (AMD64,))

    def hangs(layer: Layer, rec: LayerRecord) -> LayerResult:
        both.wait()
        return first.until_stopped(layer, rec)

    def dies(layer: Layer, rec: LayerRecord) -> LayerResult:
        both.wait()
        return first.dies(layer, rec)

    first.scripts.update({"python/debian12-py3.10": hangs, "python/debian12-py3.11": dies})
    second = FakeDaemon("second", (AMD64, ARM64))
    report, _ = build(plan, tmp_path, member(first, concurrency=2), member(second), jobs=3)

    pythons = {rec.path: rec for rec in by_platform(report, AMD64) if rec.kind == "python"}
    assert [(r.builder, r.attempts, r.status) for r in pythons.values()] == [("second", 2, LayerStatus.BUILT)] * 2
    assert first.stopped.is_set() and all(rec.status == LayerStatus.BUILT for rec in report.layers)


def test_a_layer_whose_own_steps_fail_is_not_tried_on_another_builder(plan, tmp_path):
    def run_step_fails(layer: Layer, rec: LayerRecord) -> LayerResult:
        return LayerResult.failed('process "/bin/sh -c pip install" did not complete successfully: exit code: 1')

    a = FakeDaemon("a", (AMD64, ARM64), scripts={"base": run_step_fails})
    b = FakeDaemon("b", (AMD64, ARM64), scripts={"base": run_step_fails})
    report, _ = build(plan, tmp_path, member(a), member(b))

    bases = [rec for rec in report.layers if rec.kind == "base"]
    assert all(rec.status == LayerStatus.FAILED and rec.attempts == 1 for rec in bases)
    assert "exit code: 1" in (bases[0].error or "")
    assert len(a.started) + len(b.started) == 2  # each platform's base, once; nothing retried, nothing after
    assert all(rec.status == LayerStatus.SKIPPED for rec in report.layers if rec.kind != "base")
    assert all(b.status == BuilderStatus.UP for b in report.builders)


def test_when_no_builder_of_a_platform_is_left_its_layers_fail_saying_why(plan, tmp_path):
    amd = FakeDaemon("amd", (AMD64,))
    arm = FakeDaemon("arm", (ARM64,))
    arm.scripts["python"] = arm.dies
    report, _ = build(plan, tmp_path, member(amd), member(arm))

    assert all(rec.status == LayerStatus.BUILT for rec in by_platform(report, AMD64))
    failed = [rec for rec in by_platform(report, ARM64) if rec.status == LayerStatus.FAILED]
    assert failed and all(rec.path.startswith("python/") for rec in failed)
    assert failed[0].error == "no builder for linux/arm64 is left (down: arm: builder arm went away: connection reset)"
    assert all(v.status == VariantStatus.FAILED and "linux/arm64" in (v.error or "") for v in report.variants)


def test_a_platform_no_builder_serves_fails_naming_what_each_builds(plan, tmp_path):
    amd = FakeDaemon("amd", (AMD64,))
    report, _ = build(plan, tmp_path, member(amd))

    base = next(rec for rec in by_platform(report, ARM64) if rec.kind == "base")
    assert (base.status, base.error) == (LayerStatus.FAILED, "no builder serves linux/arm64 (amd builds linux/amd64)")
    assert all(rec.status == LayerStatus.BUILT for rec in by_platform(report, AMD64))


def test_the_files_platforms_are_narrowed_to_what_the_daemon_reports(plan, tmp_path):
    amd_only = FakeDaemon("amd", (AMD64,))
    report, _ = build(plan, tmp_path, member(amd_only, platforms=(AMD64, ARM64)))

    record = report.builders[0]
    assert (record.status, record.platforms) == (BuilderStatus.UP, [AMD64])
    assert record.error == "its workers do not build linux/arm64 (they report linux/amd64)"
    base = next(rec for rec in by_platform(report, ARM64) if rec.kind == "base")
    assert base.error == "no builder serves linux/arm64 (amd builds linux/amd64)"


def test_the_report_keeps_the_builders_and_each_layers_builder_when_read_back(plan, tmp_path):
    report, _ = build(plan, tmp_path, member(FakeDaemon("a", (AMD64, ARM64)), concurrency=2))
    again = BuildReport.read(tmp_path / "work" / "build-report.json")

    assert again.builders == report.builders
    assert [(rec.builder, rec.attempts) for rec in again.layers] == [("a", 1)] * (2 * PER_PLATFORM)


def test_a_build_without_a_builders_file_writes_the_report_as_before(plan, tmp_path):
    record = planned_report(plan, plan.variants, {}).to_dict()
    assert record["builders"] == []
    assert all("builder" not in layer and "attempts" not in layer for layer in record["layers"])
