"""The build scheduler: order, the jobs limit, failure propagation, abandoning, reuse (no docker).

Builder gets a real plan from a small matrix and a layer builder that records its calls and does
what each test scripts for a layer; the tagger records which variant got which digest. The
scheduling is the product's own: which layer starts when, how a result marks the records, what
an error or an interrupt leaves in the report.

    base/debian12 -> python/debian12-py3.10 -> paddle/debian12-py3.10-paddle3.1.0 -> release/...
                  -> python/debian12-py3.11 -> ...
    base/debian11 -> python/debian11-py3.10 -> ...
                  -> python/debian11-py3.11 -> ...

Concurrency is shown with barriers and events, never with sleeps; WAIT_S only bounds how long
a broken scheduler can keep a test waiting.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from imagebuild.build.plan import Layer, Plan, build_plan
from imagebuild.build.render import write_tree
from imagebuild.build.scheduler import Builder, BuildOptions, LayerResult, TagVariant, planned_report
from imagebuild.config.matrix import load_matrix
from imagebuild.core.report import BuildReport, LayerRecord, LayerStatus, ReportStatus, VariantStatus
from imagebuild.core.runner import Cancelled

WAIT_S = 30

DEBIAN12 = "sha256:" + "12" * 32
DEBIAN11 = "sha256:" + "11" * 32
MATRIX = f"""\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle
os:
  debian12: {{image: docker.io/library/debian:12, digest: "{DEBIAN12}", family: debian}}
  debian11: {{image: docker.io/library/debian:11, digest: "{DEBIAN11}", family: debian}}
matrix:
  os: [debian12, debian11]
  cuda: [cpu]
  python: ["3.10", "3.11"]
  paddle: ["3.1.0"]
tags:
  gpu: ["{{paddle}}-gpu-{{os}}{{py_suffix}}"]
  cpu: ["{{paddle}}-{{os}}{{py_suffix}}"]
"""
ROOTS = ("base/debian12", "base/debian11")
PYTHONS = ("python/debian12-py3.10", "python/debian12-py3.11", "python/debian11-py3.10", "python/debian11-py3.11")


def digest_of(key: str) -> str:
    """The digest the recording builder gives a layer: made from its key, so each layer has its own."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Call:
    path: str
    base_digest: str | None
    log: Path


Script = Callable[[Layer, LayerRecord], LayerResult]  # what the builder does for one layer instead of succeeding


class RecordingLayers:
    """The injected layer builder: records each call; a layer succeeds with digest_of(its key)
    unless `scripts` says otherwise for its path."""

    def __init__(self, scripts: dict[str, Script] | None = None):
        self.scripts = scripts or {}
        self.calls: list[Call] = []  # in the order the builds started
        self.in_flight = 0
        self.peak = 0  # the most builds under way at one time
        self.stopped = threading.Event()  # Builder abandoned the build
        self._lock = threading.Lock()

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        assert log.parent.is_dir() and rec.status == LayerStatus.BUILDING
        with self._lock:
            self.calls.append(Call(layer.path, rec.base_digest, log))
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            script = self.scripts.get(layer.path)
            return script(layer, rec) if script else LayerResult(digest_of(layer.key))
        finally:
            with self._lock:
                self.in_flight -= 1

    def stop(self) -> None:
        self.stopped.set()

    @property
    def started(self) -> list[str]:
        return [call.path for call in self.calls]

    def until_stopped(self, layer: Layer, rec: LayerRecord) -> LayerResult:
        """A build that is still running when the build is abandoned: it ends when Builder stops it."""
        assert self.stopped.wait(WAIT_S), "Builder never stopped the running build"
        return LayerResult.failed("docker build: terminated")


class RecordedTags:
    """The injected tagger: which variant got which digest."""

    def __init__(self) -> None:
        self.given: dict[str, str] = {}

    @contextlib.contextmanager
    def session(self) -> Iterator[TagVariant]:
        yield lambda variant, digest: self.given.__setitem__(variant.id, digest)


@pytest.fixture
def plan(tmp_path) -> Plan:
    (tmp_path / "matrix.yaml").write_text(MATRIX, encoding="utf-8")
    the_plan = build_plan(load_matrix(tmp_path / "matrix.yaml"))
    write_tree(tmp_path / "dockerfiles", the_plan.rendered_files())  # Builder checks them first
    return the_plan


def key_of(plan: Plan, path: str) -> str:
    return next(key for key, layer in plan.layers.items() if layer.path == path)


def report_for(plan: Plan, reused: tuple[str, ...] = ()) -> BuildReport:
    """The report of a build of every variant, the layers at `reused` already in the cache repository."""
    held = {key_of(plan, path): digest_of(key_of(plan, path)) for path in reused}
    return planned_report(plan, plan.variants, held)


def run_builder(plan: Plan, report: BuildReport, tmp_path: Path, layers: RecordingLayers, tags: RecordedTags,
                jobs: int = 2, dry_run: bool = False) -> BuildReport:
    options = BuildOptions(jobs=jobs, dry_run=dry_run, dockerfiles=tmp_path / "dockerfiles",
                           workdir=tmp_path / "work")
    return Builder(plan, report, options, lambda event, rec: None, layer_builder=layers, tagger=tags).run()


def statuses(report: BuildReport) -> dict[str, tuple[str, str | None]]:
    return {rec.path: (str(rec.status), rec.error) for rec in report.layers}


def written(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "work" / "build-report.json").read_text())


# --- order ------------------------------------------------------------------------------------------


def test_each_layer_is_built_after_its_parent_from_the_parents_digest(plan, tmp_path):
    layers = RecordingLayers()
    report = run_builder(plan, report_for(plan), tmp_path, layers, RecordedTags())

    assert sorted(layers.started) == sorted(layer.path for layer in plan.layers.values())  # each once
    for call in layers.calls:
        layer = plan.layers[key_of(plan, call.path)]
        if layer.parent is None:
            assert call.base_digest == (DEBIAN12 if "debian12" in call.path else DEBIAN11)
        else:
            parent = plan.layers[layer.parent].path
            assert layers.started.index(parent) < layers.started.index(call.path)
            assert call.base_digest == digest_of(layer.parent)  # only known once the parent was pushed
        assert call.log == tmp_path / "work" / "logs" / f"{layer.kind}-{layer.key[:12]}.log"
    assert all(rec.status == LayerStatus.BUILT and rec.digest == digest_of(rec.key) for rec in report.layers)
    assert report.status == ReportStatus.OK and written(tmp_path)["status"] == "ok"


def test_each_variant_is_tagged_with_its_release_layers_digest(plan, tmp_path):
    tags = RecordedTags()
    report = run_builder(plan, report_for(plan), tmp_path, RecordingLayers(), tags)

    assert tags.given == {v.id: digest_of(v.chain[-1]) for v in plan.variants}
    for v in report.variants:
        assert v.status == VariantStatus.BUILT
        assert v.image == f"registry.example.com/paddle/paddle@{digest_of(v.chain[-1])}"


@pytest.mark.parametrize("jobs", [1, 2, 4])
def test_jobs_layers_build_at_once_and_never_more(plan, tmp_path, jobs):
    # The four python layers are ready together once both roots are built: each waits until `jobs`
    # builds are at the barrier, so the run finishes only if `jobs` of them do run at once.
    barrier = threading.Barrier(jobs, timeout=WAIT_S)

    def meet(layer: Layer, rec: LayerRecord) -> LayerResult:
        barrier.wait()
        return LayerResult(digest_of(layer.key))

    layers = RecordingLayers(dict.fromkeys(PYTHONS, meet))
    report = run_builder(plan, report_for(plan), tmp_path, layers, RecordedTags(), jobs=jobs)

    assert layers.peak == jobs
    assert report.status == ReportStatus.OK and len(layers.calls) == len(plan.layers)


# --- failures ---------------------------------------------------------------------------------------


def test_a_failed_layer_skips_every_descendant_and_the_rest_still_build(plan, tmp_path):
    failing = "python/debian11-py3.10"
    layers = RecordingLayers({failing: lambda layer, rec: LayerResult.failed("pip: no matching distribution")})
    tags = RecordedTags()
    report = run_builder(plan, report_for(plan), tmp_path, layers, tags)

    assert statuses(report) == {
        **{rec.path: ("built", None) for rec in report.layers},
        failing: ("failed", "pip: no matching distribution"),
        "paddle/debian11-py3.10-paddle3.1.0": ("skipped", "parent python/debian11-py3.10 failed"),
        "release/paddle3.1.0-cpu-py3.10-debian11": ("skipped", "parent paddle/debian11-py3.10-paddle3.1.0 failed"),
    }
    assert "paddle/debian11-py3.10-paddle3.1.0" not in layers.started  # the descendants never start
    assert "python/debian11-py3.11" in layers.started  # its sibling does
    variants = {v.id: v.status for v in report.variants}
    assert variants.pop("paddle3.1.0-cpu-py3.10-debian11") == VariantStatus.FAILED
    assert set(variants.values()) == {VariantStatus.BUILT} and sorted(tags.given) == sorted(variants)
    assert report.status == ReportStatus.FAILED and written(tmp_path)["status"] == "failed"


# --- abandoning: an error or an interrupt in the middle -----------------------------------------------
#
# Both roots are reused, jobs=2: the debian12 python layers start first (the plan's order). py3.10
# builds; its paddle layer takes the free slot and stops the build (an error, an interrupt) while
# py3.11 is still running, until Builder stops it.

STOPPER = "paddle/debian12-py3.10-paddle3.1.0"
RUNNING = "python/debian12-py3.11"


def stopped_midway(stop: BaseException) -> RecordingLayers:
    def raise_it(layer: Layer, rec: LayerRecord) -> LayerResult:
        raise stop

    layers = RecordingLayers({STOPPER: raise_it})
    layers.scripts[RUNNING] = layers.until_stopped
    return layers


def test_an_error_in_a_layer_builder_abandons_the_rest_and_the_report_says_why(plan, tmp_path):
    layers, tags = stopped_midway(OSError(28, "No space left on device")), RecordedTags()
    report = report_for(plan, reused=ROOTS)
    with pytest.raises(OSError, match=r"No space left on device"):
        run_builder(plan, report, tmp_path, layers, tags)

    why = "not built: the build stopped on an error ([Errno 28] No space left on device)"
    assert layers.stopped.is_set()
    assert statuses(report) == {
        **{rec.path: ("skipped", why) for rec in report.layers},
        **{root: ("reused", None) for root in ROOTS},
        "python/debian12-py3.10": ("built", None),
        STOPPER: ("failed", "OSError: [Errno 28] No space left on device"),
        RUNNING: ("skipped", why),
    }
    assert tags.given == {} and {v.status for v in report.variants} == {VariantStatus.PENDING}
    on_disk = written(tmp_path)
    assert on_disk["status"] == "failed"
    assert {rec["path"]: (rec["status"], rec["error"]) for rec in on_disk["layers"]} == statuses(report)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), Cancelled(signal.SIGTERM)], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_keeps_what_was_built_skips_the_rest_as_interrupted_and_goes_on(plan, tmp_path, interrupt):
    layers, tags = stopped_midway(interrupt), RecordedTags()
    report = report_for(plan, reused=ROOTS)
    with pytest.raises(KeyboardInterrupt, match=f"^{re.escape(str(interrupt))}$") as raised:
        run_builder(plan, report, tmp_path, layers, tags)

    assert raised.value is interrupt
    assert layers.stopped.is_set()
    assert statuses(report) == {
        **{rec.path: ("skipped", "interrupted") for rec in report.layers},
        **{root: ("reused", None) for root in ROOTS},
        "python/debian12-py3.10": ("built", None),
    }
    assert report.layer(key_of(plan, "python/debian12-py3.10")).digest == digest_of(key_of(plan, "python/debian12-py3.10"))
    assert tags.given == {}
    assert written(tmp_path)["status"] == "interrupted"


# --- reuse ------------------------------------------------------------------------------------------


def test_reused_layers_are_not_rebuilt_and_their_children_build_from_their_digests(plan, tmp_path):
    reused = (*ROOTS, "python/debian12-py3.10")
    layers = RecordingLayers()
    report = run_builder(plan, report_for(plan, reused=reused), tmp_path, layers, RecordedTags())

    assert not set(reused) & set(layers.started)
    assert len(layers.started) == len(plan.layers) - len(reused)
    by_path = {call.path: call.base_digest for call in layers.calls}
    assert by_path["paddle/debian12-py3.10-paddle3.1.0"] == digest_of(key_of(plan, "python/debian12-py3.10"))
    assert by_path["python/debian11-py3.11"] == digest_of(key_of(plan, "base/debian11"))
    assert {str(rec.status) for rec in report.layers if rec.path in reused} == {"reused"}
    assert report.status == ReportStatus.OK


def test_when_every_layer_is_reused_nothing_builds_and_every_variant_is_tagged(plan, tmp_path):
    layers, tags = RecordingLayers(), RecordedTags()
    report = run_builder(plan, report_for(plan, reused=tuple(layer.path for layer in plan.layers.values())),
                         tmp_path, layers, tags)

    assert layers.calls == []
    assert tags.given == {v.id: digest_of(v.chain[-1]) for v in plan.variants}
    assert report.status == ReportStatus.OK


def test_a_dry_run_builds_and_tags_nothing_and_writes_the_planned_report(plan, tmp_path):
    layers, tags = RecordingLayers(), RecordedTags()
    report = run_builder(plan, report_for(plan, reused=ROOTS), tmp_path, layers, tags, dry_run=True)

    assert layers.calls == [] and tags.given == {}
    assert report.status == ReportStatus.PLANNED and written(tmp_path)["status"] == "planned"
    assert {str(rec.status) for rec in report.layers} == {"reused", "to-build"}
