"""A pool of builders: each layer goes to a builder that serves its platform, at most `concurrency` at once each.

The pool is a LayerBuilder (scheduler.py), so Builder keeps the order, the failures and the report,
and the pool only decides where each due layer is built:

- At the first layer due, every builder is probed at once (`buildctl debug workers`): one that does
  not answer is down from the start, and the platforms its workers report are recorded (a builder
  file's `platforms` is narrowed to what the daemon confirms).
- A layer waits for a free slot on an up builder of its platform, and takes the one with the most
  free slots (the file's order breaks ties).
- A builder that goes away mid-build (BuilderDown) is marked down and gets nothing more; the layer
  is built again on another builder of its platform, and so are the builder's other in-flight
  layers (their builds are stopped, rather than left to hang on a dead connection), while the
  layers waiting for a slot simply go elsewhere. A layer whose
  own steps fail is not retried: it would fail the same way anywhere.
- When no builder of a platform is left, its layers fail saying so and why each builder is down.

The registry stays the shared cache: Builder only hands the pool layers the registry lacks, and
every builder pulls parents from, and pushes to, the same cache repository.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from imagebuild.build.buildkit import Buildctl, BuilderDown, BuildKitLayerBuilder, Workers
from imagebuild.build.plan import Layer
from imagebuild.build.scheduler import BuildOptions, DockerLayerBuilder, LayerBuilder, LayerResult
from imagebuild.config.builders import LOCAL, BuildersConfig, BuilderSpec
from imagebuild.core.report import BuilderRecord, BuilderStatus, BuildReport, LayerRecord
from imagebuild.core.runner import Runner
from imagebuild.oci.platforms import Platform

Probe = Callable[[], Workers | None]  # a daemon's workers (BuilderDown when it does not answer); None: not asked


@dataclass
class Member:
    """One builder of the pool: how to build on it, how to probe it, and what the report says of it."""

    spec: BuilderSpec
    make: Callable[[], LayerBuilder]  # made at its first layer (the local engine's needs the docker CLI)
    probe: Probe
    record: BuilderRecord
    running: int = 0
    _builder: LayerBuilder | None = field(default=None, repr=False)

    @classmethod
    def of(cls, spec: BuilderSpec, make: Callable[[], LayerBuilder], probe: Probe) -> Member:
        record = BuilderRecord(name=spec.name, kind=spec.kind, endpoint=spec.endpoint,
                               platforms=[str(p) for p in spec.platforms], concurrency=spec.concurrency)
        return cls(spec, make, probe, record)

    @property
    def up(self) -> bool:
        return self.record.status == BuilderStatus.UP

    def builder(self) -> LayerBuilder:
        if self._builder is None:
            self._builder = self.make()
        return self._builder

    def serves(self, platform: str) -> bool:
        """Is `platform` among what it was found to build (the local engine without a list: any)?"""
        if self.spec.kind == LOCAL and not self.record.platforms:
            return True
        wanted = Platform.parse(platform).descriptor()
        return any(Platform.parse(p).matches(wanted) for p in self.record.platforms)


def layer_builder_for(builders: BuildersConfig | None, report: BuildReport,
                      options: BuildOptions) -> BuilderPool | None:
    """What `build` and `release` hand Builder: with a builders file its pool, its builders recorded in the
    report; without one None, and Builder builds on the local engine as it always has."""
    if builders is None:
        return None
    pool = BuilderPool.from_config(builders, report.cache_repository, options)
    report.builders = pool.records
    return pool


def member_for(spec: BuilderSpec, cache_ref: str, options: BuildOptions) -> Member:
    """A builder of the file as a pool member: a BuildKit daemon through buildctl, or the local engine."""
    if spec.kind == LOCAL:
        return Member.of(spec, lambda: DockerLayerBuilder(cache_ref, options), lambda: None)
    buildctl = Buildctl(spec, Runner())
    return Member.of(spec, lambda: BuildKitLayerBuilder(buildctl, cache_ref, options), buildctl.workers)


class BuilderPool:
    """A LayerBuilder over several builders (module docstring). `records` are the report's `builders`."""

    def __init__(self, members: Sequence[Member]):
        self.members = list(members)
        self.records = [m.record for m in self.members]
        self._changed = threading.Condition()  # a slot freed, a builder went down, or the build is stopping
        self._probed = threading.Lock()
        self._started = False
        self._stopping = False

    @classmethod
    def from_config(cls, config: BuildersConfig, cache_ref: str, options: BuildOptions) -> BuilderPool:
        return cls([member_for(spec, cache_ref, options) for spec in config.builders])

    # --- the probe ---------------------------------------------------------------------------

    def start(self) -> None:
        """Probe every builder once, all at once (a host that drops packets costs one timeout, not one each)."""
        with self._probed:
            if self._started:
                return
            with ThreadPoolExecutor(max_workers=max(1, len(self.members))) as probes:
                for member, answer in zip(self.members, probes.map(_asked, [m.probe for m in self.members])):
                    self._found(member, answer)
            self._started = True

    def _found(self, member: Member, answer: Workers | BuilderDown | None) -> None:
        record = member.record
        if isinstance(answer, BuilderDown):
            record.status, record.error = BuilderStatus.DOWN, str(answer)
            return
        record.status = BuilderStatus.UP
        if answer is None:  # the local engine: it serves what the file lists, else every platform
            return
        record.version = answer.version
        if not member.spec.platforms:
            record.platforms = list(answer.platforms)
            return
        reported = [Platform.parse(p).descriptor() for p in answer.platforms]
        confirmed = [str(p) for p in member.spec.platforms if any(p.matches(r) for r in reported)]
        missing = [str(p) for p in member.spec.platforms if str(p) not in confirmed]
        record.platforms = confirmed
        if missing:
            note = f"its workers do not build {', '.join(missing)} (they report {', '.join(answer.platforms)})"
            record.error = note
            if not confirmed:
                record.status = BuilderStatus.DOWN

    # --- LayerBuilder ---------------------------------------------------------------------------

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        self.start()
        attempt = 0
        while True:
            member = self._acquire(layer.platform)
            if member is None:
                return LayerResult.failed("the build is stopping" if self._stopping else self._none_left(layer.platform))
            attempt += 1
            rec.builder, rec.attempts = member.spec.name, attempt
            if attempt > 1:
                # Keep the failed attempt's log beside the new one: it says how the builder went away.
                _keep_log(log, attempt - 1)
            try:
                result = member.builder().build(layer, rec, log)
            except BuilderDown as down:
                self._down(member, str(down))
                continue
            finally:
                self._release(member)
            if result.digest:
                with self._changed:
                    member.record.built += 1
            elif not member.up and not self._stopping:
                continue  # stopped because its builder went down during it: not the layer's failure
            return result

    def stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        for member in self.members:
            if member._builder is not None:
                member._builder.stop()

    # --- slots ------------------------------------------------------------------------------------

    def _acquire(self, platform: str) -> Member | None:
        """A slot on the up builder serving `platform` with the most free slots, waiting for one while any is up; None
        when none is left (or the build is stopping)."""
        with self._changed:
            while not self._stopping:
                able = [m for m in self.members if m.up and m.serves(platform)]
                if not able:
                    return None
                free = [m for m in able if m.running < m.spec.concurrency]
                if free:
                    chosen = max(free, key=lambda m: m.spec.concurrency - m.running)  # the first of the freest
                    chosen.running += 1
                    return chosen
                self._changed.wait()
            return None

    def _release(self, member: Member) -> None:
        with self._changed:
            member.running -= 1
            self._changed.notify_all()

    def _down(self, member: Member, why: str) -> None:
        with self._changed:
            first = member.up
            if first:  # the first failure says why; its other builds' failures only repeat it
                member.record.status, member.record.error = BuilderStatus.DOWN, why
            self._changed.notify_all()  # its waiting layers go elsewhere, or learn none is left
        if first and member._builder is not None:
            # Its other builds may hang on a half-open connection until their timeout: stop them now, and
            # build() sends each to another builder.
            member._builder.stop()

    def _none_left(self, platform: str) -> str:
        with self._changed:
            # Those that would have taken it: up ones that build it are none, so these are all down.
            lost = [m for m in self.members if m.serves(platform) or (not m.up and m.spec.serves(platform))]
            if lost:
                why = "; ".join(f"{m.spec.name}: {m.record.error or m.record.status}" for m in lost)
                return f"no builder for {platform} is left (down: {why})"
            builds = "; ".join(f"{m.spec.name} builds {', '.join(m.record.platforms) or 'nothing'}" for m in self.members)
            return f"no builder serves {platform} ({builds})"


def _asked(probe: Probe) -> Workers | BuilderDown | None:
    try:
        return probe()
    except BuilderDown as down:
        return down


def _keep_log(log: Path, attempt: int) -> None:
    if log.exists():
        log.replace(log.with_name(f"{log.stem}.attempt{attempt}{log.suffix}"))
