"""BuildKit builds in layer order against a registry-aware plan (the report's model is report.py).

Each layer image lives in the cache repository under its content key
(`<registry>/<project>/<cache>:<kind>-<key>`); a child builds FROM its parent by digest.
A variant gets its release tags only once its whole chain is in the registry.

Builder is the scheduling: order, the jobs limit, failures reaching descendants, abandoning on an
interrupt or an error, the report. Building one layer is a LayerBuilder's (DockerLayerBuilder:
`docker build`, then the push) and tagging a Tagger's (RegistryTagger), both handed to Builder.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from docker.errors import DockerException

from imagebuild.build import publish
from imagebuild.build.plan import Layer, Plan, Variant, build_plan, plan_record, with_ancestors
from imagebuild.build.render import check_tree
from imagebuild.config.matrix import CPU, Matrix
from imagebuild.core.report import (
    BuildReport,
    ChildImage,
    LayerRecord,
    LayerStatus,
    ReportStatus,
    VariantRecord,
    VariantStatus,
)
from imagebuild.core.runner import Result, Runner, cancel_requested, docker_cli, uninterrupted
from imagebuild.core.source import InputError
from imagebuild.oci import reference
from imagebuild.oci.client import ImageRef, Registry, RegistryError, head_many
from imagebuild.oci.copy import copy_within
from imagebuild.oci.platforms import platform_digest, push_index

# --- planning against the registry ----------------------------------------------------


@dataclass(frozen=True)
class BuildOptions:
    jobs: int = 2
    dry_run: bool = False
    dockerfiles: Path = Path("dockerfiles")
    workdir: Path = Path(".imagebuild")
    secrets: dict[str, str] = field(default_factory=dict)  # secret id -> file path on this host
    secret_values: tuple[str, ...] = ()  # to redact from logs
    layer_timeout_s: float = 3600  # one layer's `docker build`; then it fails as "timed out after N s"
    push_timeout_s: float = 1800  # one layer's push to the cache repository
    push: str = "imagebuild"  # or "docker": `docker push`, one core, gzip level 6 (see publish.py)
    # layer key -> its build context, for a layer that needs files besides its Dockerfile (the
    # webhook's image: the package source); any other layer's context is its Dockerfile's folder, or the root of
    # dockerfiles/ for a layer that reads a file there (Layer.shared).
    contexts: Mapping[str, Path] = field(default_factory=dict)


def git_revision(cwd: Path) -> tuple[str, str]:
    """(commit, its commit time in UTC) or ('unknown', epoch) outside git.

    SOURCE_DATE_EPOCH, the reproducible-builds convention, overrides the time.
    """
    try:
        done = Runner().run(["git", "log", "-1", "--format=%H %ct"], cwd=cwd, separate_stderr=True, timeout=10)
        if done.returncode != 0:
            raise ValueError(f"git log: exit {done.returncode}")
        out = done.output.split()
        commit, seconds = out[0], int(out[1])
    except (OSError, IndexError, ValueError):
        commit, seconds = "unknown", 0
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        seconds = int(os.environ["SOURCE_DATE_EPOCH"])
    created = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return commit, created


def root_platforms(matrix: Matrix) -> dict[str, set[str]]:
    """Each unpinned base image (a tag) and the platforms the matrix builds FROM it."""
    wanted: dict[str, set[str]] = {}
    for combo in matrix.combinations:
        cuda = None if combo.cuda == CPU else matrix.cuda[combo.cuda]
        spec = (cuda.image, cuda.digest) if cuda is not None and cuda.provider == "image" else \
            (matrix.os[combo.os].image, matrix.os[combo.os].digest)
        if spec[0] and not spec[1]:
            wanted.setdefault(spec[0], set()).update(combo.platforms)
    return wanted


def resolve_roots(matrix: Matrix) -> dict[tuple[str, str], str]:
    """Resolve unpinned base images (tags) to each platform's image digest, so keys and FROM lines are exact.

    A tag naming an index gives each platform its child; a tag naming one image serves only the
    platform its config says (a linux/amd64-only base refuses an arm64 build here, not mid-build).
    """
    resolved = {}
    for image, platforms in sorted(root_platforms(matrix).items()):
        ref = ImageRef.parse(image)
        with Registry(ref.registry) as registry:
            for platform in sorted(platforms):
                digest = platform_digest(registry, ref.repository, ref.reference, platform)
                if digest is None:
                    raise RegistryError(f"base image {image} is not in its registry")
                resolved[(image, platform)] = digest
    return resolved


def registry_plan(plan: Plan, variants: Iterable[Variant], resolve_digests: bool = True,
                  event_hooks: dict[str, Any] | None = None, layer_keys: Iterable[str] = ()) -> BuildReport:
    """Which layer keys does the cache repository hold already?

    A build needs each layer's digest: one HEAD per distinct layer, concurrently. A plan
    needs only existence, which one tags/list request answers for every layer at once.
    `layer_keys` adds those layers and their parents without their variants (`build --layers`).
    """
    variants = list(variants)
    layer_keys = list(layer_keys)
    keys = report_keys(plan, variants, layer_keys)
    cache = ImageRef.parse(plan.cache_ref)
    held: dict[str, str | None] = {}
    if resolve_digests:
        found = head_many(cache.registry, [(cache.repository, plan.layers[k].cache_tag) for k in keys],
                          event_hooks=event_hooks)
        held = {k: found[(cache.repository, plan.layers[k].cache_tag)] for k in keys
                if found.get((cache.repository, plan.layers[k].cache_tag))}
    else:
        with Registry(cache.registry) as registry:
            if event_hooks:
                registry.client.event_hooks = event_hooks
            existing = registry.list_tags(cache.repository)
        held = {k: None for k in keys if plan.layers[k].cache_tag in existing}
    return planned_report(plan, variants, held, layer_keys)


def report_keys(plan: Plan, variants: Iterable[Variant], layer_keys: Iterable[str] = ()) -> list[str]:
    """The layers a build of `variants` (and of `layer_keys` with their parents) needs, parents first."""
    return list(dict.fromkeys([*(k for v in variants for k in v.chain), *with_ancestors(plan, layer_keys)]))


def planned_report(plan: Plan, variants: Iterable[Variant], held: Mapping[str, str | None],
                   layer_keys: Iterable[str] = ()) -> BuildReport:
    """The report before the build starts (pure): each layer the cache repository holds is reused,
    the rest are to build. `held`: layer key -> its digest there (None where only its tag was listed)."""
    variants = list(variants)
    layers = []
    for key in report_keys(plan, variants, layer_keys):
        layer = plan.layers[key]
        layers.append(LayerRecord(key=key, kind=layer.kind, path=layer.path, platform=layer.platform,
                                  image=f"{plan.cache_ref}:{layer.cache_tag}",
                                  status=LayerStatus.REUSED if key in held else LayerStatus.TO_BUILD,
                                  digest=held.get(key)))
    records = [
        VariantRecord(id=v.id, tags=list(v.tags), images=[f"{plan.repository_ref}:{t}" for t in v.tags],
                      chain=list(v.chain), device=v.device, paddle=v.paddle, python=v.python,
                      cuda=v.cuda, cudnn=v.cudnn, os=v.os, platforms=list(v.platforms),
                      compression=v.compression.spec)
        for v in variants
    ]
    return BuildReport(matrix=plan.matrix_file, revision="", registry=plan.registry,
                       repository=plan.repository_ref, cache_repository=plan.cache_ref,
                       created=_now(), variants=records, layers=layers, status=ReportStatus.PLANNED)


def registry_plan_record(plan: Plan, report: BuildReport) -> dict[str, Any]:
    """`plan --registry --format json`: the plan's record, each layer with what the registry holds."""
    record = plan_record(plan)
    status = {rec.key: rec for rec in report.layers}
    for layer in record["layers"]:
        rec = status.get(layer["key"])
        layer["status"] = rec.status.value if rec else "not-selected"
        layer["digest"] = rec.digest if rec else None
    record["summary"] |= {"to_build": sum(r.status == LayerStatus.TO_BUILD for r in report.layers),
                          "reused": sum(r.status == LayerStatus.REUSED for r in report.layers)}
    return record


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- building -------------------------------------------------------------------------

Event = Callable[[str, LayerRecord], None]  # (event name, layer) for progress displays


@dataclass(frozen=True)
class LayerResult:
    """What building one layer came to: its digest in the cache repository, or why there is none."""

    digest: str | None
    error: str = ""  # the log's tail, or "timed out after N s"; a stopped build's is not shown

    @classmethod
    def failed(cls, error: str) -> LayerResult:
        return cls(None, error)


class LayerBuilder(Protocol):
    """Builds one layer and pushes it to the cache repository (DockerLayerBuilder: docker build, then push).

    Builder calls `build` from its worker threads, at most `jobs` at once, each layer after its
    parent is in the registry; the order, the failures and the report are Builder's.
    """

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        """Build `layer` FROM its parent (`rec.base_digest`), push it as `rec.image`, its output to `log`.

        It may note how it went on `rec` (steps, pushed_by, blobs); Builder marks its status.
        """
        ...

    def stop(self) -> None:
        """The build is being abandoned: stop the builds and pushes under way and start none.

        A build stopped returns (any result: the layer becomes skipped with the reason).
        """
        ...


TagVariant = Callable[[VariantRecord, str], None]  # point each of the variant's release tags at the digest


class Tagger(Protocol):
    """Gives a variant whose whole chain is in the registry its release tags (RegistryTagger)."""

    def session(self) -> contextlib.AbstractContextManager[TagVariant]:
        """One tagging pass: after each release layer, and once at the end."""
        ...

    def index(self, children: Mapping[str, str]) -> str:
        """Put the OCI image index of `children` (platform -> its release layer's digest, in the variant's
        order) into the cache repository, untagged; its digest. Only called once every child is there."""
        ...


class Builder:
    """Builds the report's to-build layers, parents first, `options.jobs` at once, then tags each
    complete variant. A failed layer skips its descendants; an interrupt or an error abandons the
    rest. How one layer is built is `layer_builder`'s (default: DockerLayerBuilder, made when the
    first layer is due); how a variant is tagged, `tagger`'s (default: RegistryTagger)."""

    def __init__(self, plan: Plan, report: BuildReport, options: BuildOptions, on_event: Event, *,
                 layer_builder: LayerBuilder | None = None, tagger: Tagger | None = None):
        self.plan = plan
        self.report = report
        self.options = options
        self.on_event = on_event
        self.layer_builder = layer_builder
        self.tagger = tagger if tagger is not None else RegistryTagger(plan)
        self.cancelled = threading.Event()  # set when the build is being abandoned; workers start nothing new
        self._stop_reason = "interrupted"
        self._pool: ThreadPoolExecutor | None = None

    def check_dockerfiles(self) -> None:
        """Build exactly what the keys describe: the committed files must be current."""
        wanted = {path: text for rec in self.report.layers
                  for path, text in self.plan.layers[rec.key].tree_files().items()}
        drift = [d for d in check_tree(self.options.dockerfiles, wanted) if d.path in wanted]
        if drift:
            raise InputError(str(self.options.dockerfiles / drift[0].path), None, "",
                             f"{len(drift)} Dockerfile(s) differ from the matrix ({drift[0].reason}); "
                             "run `imagebuild render` and commit")

    def run(self) -> BuildReport:
        """Build what is missing, then tag each complete variant.

        On an interrupt (Ctrl-C, SIGTERM) or an unexpected error the running builds are stopped,
        the report is written (layers finished so far stay built, the rest are skipped with the
        reason) and the exception goes on to the caller; no variant is tagged on the way out.
        """
        self.check_dockerfiles()
        todo = {rec.key for rec in self.report.layers if rec.status == "to-build"}
        if self.options.dry_run:
            return self._finish()
        try:
            if todo:
                self._build(todo)
            self._tag_variants()
        except KeyboardInterrupt:
            with uninterrupted():
                self._abandon("interrupted")
                self.report.status = ReportStatus.INTERRUPTED
                self._write()
            raise
        except Exception as exc:
            with uninterrupted():  # a signal now waits until the report is written
                self._abandon(f"not built: the build stopped on an error ({_first_line(exc)})")
                self.report.status = ReportStatus.FAILED
                with contextlib.suppress(OSError):  # the error may be this very disk; the error itself goes on
                    self._write()
            raise
        return self._finish()

    def _build(self, todo: set[str]) -> None:
        if self.layer_builder is None:
            self.layer_builder = DockerLayerBuilder(self.plan.cache_ref, self.options)
        self.options.workdir.joinpath("logs").mkdir(parents=True, exist_ok=True)
        done: set[str] = {rec.key for rec in self.report.layers if rec.status == "reused"}
        failed: set[str] = set()
        running: dict[Future[Any], str] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.options.jobs))
        while todo or running:
            # Parents before children (the plan's order), so a failure reaches every
            # descendant in one pass.
            for key in [k for k in self.plan.layers if k in todo]:
                parent = self.plan.layers[key].parent
                if parent in failed:
                    todo.discard(key)
                    failed.add(key)
                    self._mark(key, "skipped", error=f"parent {self.plan.layers[parent].path} failed")
                elif (parent is None or parent in done) and len(running) < self.options.jobs:
                    todo.discard(key)
                    running[self._pool.submit(self._build_layer, self.layer_builder, key)] = key
            if not running:
                if todo:  # nothing could start: a parent outside the plan (a bug, not input)
                    raise RuntimeError(f"unschedulable layers: {sorted(todo)}")
                continue
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                key = running.pop(future)
                try:
                    ok = future.result()
                except Exception as exc:
                    self._mark(key, "failed", error=f"{type(exc).__name__}: {exc}")
                    raise
                (done if ok else failed).add(key)
                if self.plan.layers[key].kind == "release":
                    self._tag_variants()  # this variant's chain is complete: tag it now
        self._pool.shutdown(wait=True)

    @property
    def stopping(self) -> bool:
        return self.cancelled.is_set() or cancel_requested()

    def _abandon(self, reason: str) -> None:
        """Stop the running builds; every layer that did not finish becomes skipped with `reason`."""
        self._stop_reason = reason
        self.cancelled.set()
        if self.layer_builder is not None:
            self.layer_builder.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for rec in self.report.layers:
            if rec.status in ("to-build", "building"):
                self._mark(rec.key, "skipped", error=reason)

    def _mark(self, key: str, status: LayerStatus | str, **fields: Any) -> None:
        rec = self.report.layer(key)
        rec.status = LayerStatus(status)
        for name, value in fields.items():
            setattr(rec, name, value)
        self.on_event(status, rec)

    def _build_layer(self, layer_builder: LayerBuilder, key: str) -> bool:
        """One worker's layer: True once it is built and pushed."""
        layer = self.plan.layers[key]
        rec = self.report.layer(key)
        log = self.options.workdir / "logs" / f"{layer.kind}-{key[:12]}.log"
        rec.log = str(log)
        if layer.parent is not None:
            rec.base_digest = self.report.layer(layer.parent).digest
        elif layer.root is not None:
            rec.base_digest = layer.root.digest
        self._mark(key, "building")
        started = time.monotonic()
        result = layer_builder.build(layer, rec, log)
        duration = round(time.monotonic() - started, 1)
        if result.digest:
            self._mark(key, "built", digest=result.digest, duration_s=duration)
            return True
        if self.stopping:  # stopped by us, not failed: the report says why it did not finish
            self._mark(key, "skipped", duration_s=duration, error=self._stop_reason)
        else:
            self._mark(key, "failed", duration_s=duration, error=result.error)
        return False

    def _tag_variants(self) -> None:
        """Release tags only for variants whose whole chain is in the registry."""
        with self.tagger.session() as tag:
            for variant in self.report.variants:
                if variant.status != VariantStatus.BUILT:
                    with uninterrupted():  # all of a variant's tags, or none: a signal waits for them
                        self._tag_variant(tag, variant)

    def _tag_variant(self, tag: TagVariant, variant: VariantRecord) -> None:
        """A variant's tags once every platform's chain is in the registry; none while any is missing, so
        no tag names a partial index. A failed platform fails the whole variant, and the report says which."""
        chains = self._platform_chains(variant)
        failed = [platform for platform, chain in chains.items()
                  if any(self.report.layer(k).status in (LayerStatus.FAILED, LayerStatus.SKIPPED) for k in chain)]
        if failed:
            variant.status = VariantStatus.FAILED
            variant.error = f"{', '.join(failed)}: a layer failed or was skipped; no platform of it is tagged"
            return
        if any(self.report.layer(k).status not in (LayerStatus.BUILT, LayerStatus.REUSED)
               for chain in chains.values() for k in chain):
            return
        releases = {platform: self.report.layer(chain[-1]).digest or "" for platform, chain in chains.items()}
        if len(releases) > 1:
            digest = self.tagger.index(releases)
            variant.children = [ChildImage(platform, child) for platform, child in releases.items()]
        else:
            digest = next(iter(releases.values()))
        tag(variant, digest)
        variant.digest = digest
        variant.image = f"{self.plan.repository_ref}@{digest}"
        variant.status = VariantStatus.BUILT
        self.on_event("tagged", self.report.layer(variant.chain[-1]))

    def _platform_chains(self, variant: VariantRecord) -> dict[str, list[str]]:
        """Each platform's layer keys, release last: from the plan's variant (the report's chain is every
        platform's in one list)."""
        planned = next((v for v in self.plan.variants if v.id == variant.id), None)
        if planned is None:
            return {variant.platforms[0]: list(variant.chain)}
        return {c.platform: list(c.chain) for c in planned.platform_chains}

    def _finish(self) -> BuildReport:
        failed = any(v.status == VariantStatus.FAILED for v in self.report.variants)
        self.report.status = (ReportStatus.FAILED if failed else
                              ReportStatus.PLANNED if self.options.dry_run else ReportStatus.OK)
        self.report.finished = _now()
        self._write()
        return self.report

    def _write(self) -> None:
        # Under the report's lock, keeping the stages other processes recorded meanwhile.
        self.report.write(self.options.workdir / "build-report.json")


@dataclass(frozen=True)
class LayerInputs:
    """What building one layer takes, whoever builds it (DockerLayerBuilder here, buildkit.BuildKitLayerBuilder
    on a remote daemon): the same arguments, labels and secrets, so a layer's image does not depend on where
    it was built. Each builder only spells them as its own tool's flags."""

    platform: str
    build_args: dict[str, str]  # sorted: the layer's own, and IMAGEBUILD_PARENT (its parent, by digest)
    labels: dict[str, str]
    secrets: dict[str, str]  # sorted: secret id -> file on this host
    context: Path  # the build context
    dockerfile: Path  # the folder holding the layer's Dockerfile (the context, unless options.contexts says)


LAYER_KEY_LABEL = "io.imagebuild.layer.key"


def layer_inputs(layer: Layer, rec: LayerRecord, cache_ref: str, options: BuildOptions) -> LayerInputs:
    args = dict(layer.build_args)
    if layer.parent is not None:
        args["IMAGEBUILD_PARENT"] = f"{cache_ref}@{rec.base_digest}"
    folder = options.dockerfiles / layer.path
    # A layer that reads a file shared by several (Layer.shared) builds from the root of dockerfiles/.
    context = options.dockerfiles if layer.shared else folder
    return LayerInputs(platform=layer.platform, build_args=dict(sorted(args.items())),
                       labels={LAYER_KEY_LABEL: layer.key}, secrets=dict(sorted(options.secrets.items())),
                       context=options.contexts.get(layer.key, context), dockerfile=folder)


@contextlib.contextmanager
def own_context(layer: Layer, given: LayerInputs, options: BuildOptions) -> Iterator[LayerInputs]:
    """A layer that reads files at the root of dockerfiles/ (Layer.shared) is built from a folder of its own,
    made for this build: its Dockerfile folder's files beside those shared files. Docker's CLI keys the context
    it syncs into the daemon by the context folder and the Dockerfile's name, so two layers built side by side
    from the one root folder (each `--file .../Dockerfile`) could each read the other's Dockerfile."""
    if not layer.shared or given.context != options.dockerfiles:
        yield given
        return
    root = options.workdir / "contexts"
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{layer.kind}-{layer.key[:12]}-", dir=root))
    try:
        shutil.copytree(given.dockerfile, folder, dirs_exist_ok=True, symlinks=True)
        for name, _ in layer.shared:
            if (folder / name).exists():
                raise InputError(str(given.dockerfile / name), None, name,
                                 f"the layer's folder holds a file named like the shared {options.dockerfiles / name}")
            shutil.copy2(options.dockerfiles / name, folder / name)
        yield replace(given, context=folder, dockerfile=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class DockerLayerBuilder:
    """`docker build` on BuildKit FROM the parent's digest, then the push to the cache repository
    (publish.Pusher). Made when the first layer is due: it needs the docker CLI."""

    def __init__(self, cache_ref: str, options: BuildOptions):
        self.cache_ref = cache_ref
        self.options = options
        self.runner = Runner()
        self.cancelled = threading.Event()  # set by stop(): nothing new is pushed
        self.docker = docker_cli()
        self.pusher = publish.Pusher(self.docker, self.runner, options.workdir / "spool", self.cancelled,
                                     options.push, options.secret_values, options.push_timeout_s)

    def stop(self) -> None:
        self.cancelled.set()
        self.runner.stop_all()

    @property
    def stopping(self) -> bool:
        return self.cancelled.is_set() or cancel_requested()

    def command(self, given: LayerInputs, rec: LayerRecord) -> list[str]:
        cmd = [self.docker, "build", "--progress=plain", "--platform", given.platform, "-t", rec.image]
        for name, value in given.labels.items():
            cmd += ["--label", f"{name}={value}"]
        for name, value in given.build_args.items():
            cmd += ["--build-arg", f"{name}={value}"]
        for sid, path in given.secrets.items():
            cmd += ["--secret", f"id={sid},src={path}"]
        if given.context != given.dockerfile:
            cmd += ["--file", str(given.dockerfile / "Dockerfile")]
        cmd.append(str(given.context))
        return cmd

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        started = time.monotonic()
        with own_context(layer, layer_inputs(layer, rec, self.cache_ref, self.options), self.options) as given:
            result = run_docker_build(self.runner, self.command(given, rec), secrets=self.options.secret_values,
                                      log=log, timeout=self.options.layer_timeout_s)
        rec.steps = {"build_s": round(time.monotonic() - started, 1)}
        if result.timed_out:
            return LayerResult.failed(f"timed out after {self.options.layer_timeout_s:g} s")
        if result.returncode != 0 or self.stopping:
            return LayerResult.failed(_tail(result.output))
        pushed = time.monotonic()
        digest, push = self._push(layer, rec, log)
        rec.steps["push_s"] = round(time.monotonic() - pushed, 1)
        if digest:
            return LayerResult(digest)
        if push.timed_out:
            return LayerResult.failed(f"push timed out after {self.options.push_timeout_s:g} s")
        return LayerResult.failed(_tail(push.output))

    def _push(self, layer: Layer, rec: LayerRecord, log: Path) -> tuple[str | None, Result]:
        """Push the built image (publish.Pusher); any failure fails the layer, with the reason in its log."""
        # The image it was built FROM, whose blobs the registry has: a layer image, or the root.
        base = self.cache_ref if layer.parent is not None else (layer.root.image if layer.root else "")
        parent = ImageRef.parse(f"{reference.split(base).name}@{rec.base_digest}") if base and rec.base_digest else None
        try:
            # A zstd release is still built FROM the gzip parent (BuildKit's cache follows its blobs);
            # only this push differs.
            pushed = self.pusher.push(rec.image, parent, layer.compression)
        except (publish.PublishError, RegistryError, OSError, DockerException) as exc:
            pushed = publish.Pushed(None, "imagebuild",
                                    f"imagebuild: push of {rec.image} failed: {exc.__class__.__name__}: {exc}\n")
        with log.open("a", encoding="utf-8") as handle:
            handle.write(pushed.output)
        rec.pushed_by = pushed.by
        assert rec.steps is not None
        rec.steps.update(pushed.steps)
        rec.blobs = pushed.blobs
        return pushed.digest, Result(0 if pushed.digest else 1, pushed.output, timed_out=pushed.timed_out)


class RegistryTagger:
    """Tags within the registry: a tag that does not yet name the digest gets it by copy_within
    (blobs mounted from the cache repository; an index's children go before it); one connection per
    tagging pass."""

    def __init__(self, plan: Plan):
        self.repository = ImageRef.parse(plan.repository_ref)
        self.cache = ImageRef.parse(plan.cache_ref)

    def index(self, children: Mapping[str, str]) -> str:
        with Registry(self.cache.registry) as registry:
            return push_index(registry, self.cache.repository, children)

    @contextlib.contextmanager
    def session(self) -> Iterator[TagVariant]:
        with Registry(self.repository.registry) as registry:
            def tag(variant: VariantRecord, digest: str) -> None:
                for name in variant.tags:
                    if registry.head_manifest(self.repository.repository, name) != digest:
                        copy_within(registry, self.cache.repository, digest, self.repository.repository, name)
            yield tag


def run_docker_build(runner: Runner, cmd: list[str], *, secrets: Iterable[str], log: Path | None,
                     timeout: float | None) -> Result:
    """`docker build` on BuildKit, with only the allowlisted environment (tools.child_environment):
    a matrix's `run:` steps are its author's shell, and no signing password or registry
    credential of this job may be within their reach, not even through the CLI."""
    return runner.run(cmd, secrets=secrets, log=log, env={"DOCKER_BUILDKIT": "1"}, timeout=timeout, inherit=False)


def _tail(output: str, lines: int = 15) -> str:
    return "\n".join(output.strip().splitlines()[-lines:])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@dataclass
class SecretFiles:
    """Build secrets as files for `--secret src=`: env-var secrets go to a private temp file."""

    paths: dict[str, str]
    values: tuple[str, ...]
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        if self._tmp:
            self._tmp.cleanup()


# --- the secret lane: what the operator lets a matrix mount -------------------------------

SECRET_DIRS_ENV = "IMAGEBUILD_SECRET_DIRS"  # os.pathsep-separated directories
SECRET_ENV_ENV = "IMAGEBUILD_SECRET_ENV"  # comma-separated variable names
# Always in the lane: the host's public CA bundle (Debian/Ubuntu, RHEL/Fedora, Alpine), which a
# build behind a TLS-intercepting proxy needs and which holds nothing secret.
SYSTEM_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
# Signing and registry credentials never reach a build, whoever asks: `run:` steps are the
# matrix author's shell, and a pull request may be the author.
NEVER_BUILD_SECRETS = frozenset({"COSIGN_PASSWORD", "COSIGN_KEY", "SIGSTORE_ID_TOKEN", "HARBOR_USERNAME",
                                 "HARBOR_PASSWORD", "TRIVY_USERNAME", "TRIVY_PASSWORD", "TRIVY_REGISTRY_TOKEN",
                                 "DOCKER_AUTH_CONFIG", "REGISTRY_AUTH"})
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class SecretLane:
    """Where a matrix's `secrets.<id>.file` / `.env` may point: set by the operator (flags or
    environment settings), never by the matrix, which may come from a pull request."""

    dirs: tuple[Path, ...] = ()  # resolved: a file must resolve to a path under one of them
    env: frozenset[str] = frozenset()  # variable names an `env:` secret may read

    @classmethod
    def from_settings(cls, dirs: Iterable[str] = (), env: Iterable[str] = (),
                      environ: Mapping[str, str] | None = None) -> SecretLane:
        """--secret-dir / --secret-env values plus IMAGEBUILD_SECRET_DIRS / IMAGEBUILD_SECRET_ENV."""
        environ = os.environ if environ is None else environ
        given = [("--secret-dir", d) for d in dirs]
        given += [(SECRET_DIRS_ENV, d) for d in environ.get(SECRET_DIRS_ENV, "").split(os.pathsep) if d.strip()]
        resolved = []
        for where, directory in given:
            path = Path(os.path.expanduser(directory)).resolve()
            if not path.is_dir():
                raise InputError(where, None, "", f"'{directory}' is not a directory")
            if path == Path(path.anchor):
                raise InputError(where, None, "", f"'{directory}' is the whole file system; name the directory "
                                                  "that holds the build secrets")
            resolved.append(path)
        names = [("--secret-env", n.strip()) for n in env]
        names += [(SECRET_ENV_ENV, n.strip()) for n in environ.get(SECRET_ENV_ENV, "").split(",") if n.strip()]
        for where, name in names:
            if not _ENV_NAME.fullmatch(name):
                raise InputError(where, None, "", f"'{name}' is not an environment variable name")
            if name in NEVER_BUILD_SECRETS:
                raise InputError(where, None, "", f"{name} is a signing or registry credential; "
                                                  "it never reaches a build")
        return cls(tuple(dict.fromkeys(resolved)), frozenset(n for _, n in names))

    def allows_file(self, path: Path) -> bool:
        """After resolving links: the system CA bundle, or a file under an allowed directory."""
        real = path.resolve()
        if any(real == Path(bundle).resolve() for bundle in SYSTEM_CA_BUNDLES):
            return True
        return any(real.is_relative_to(d) and real != d for d in self.dirs)

    def describe(self) -> str:
        dirs = ", ".join(str(d) for d in self.dirs) or "none"
        return f"allowed: the system CA bundle and directories {dirs}"


def parse_secret_overrides(items: Iterable[str]) -> dict[str, str]:
    """--secret ID=PATH options -> {id: path}."""
    overrides = {}
    for item in items:
        sid, sep, path = item.partition("=")
        if not sep or not sid or not path:
            raise InputError("--secret", None, item, "expected ID=PATH")
        overrides[sid] = path
    return overrides


def check_secret_lane(matrix: Matrix, lane: SecretLane, overrides: Mapping[str, str] | None = None) -> None:
    """Refuse a matrix secret outside the operator's lane, before anything is read or built.

    A `--secret ID=PATH` override is the operator's own choice and replaces the matrix's source.
    An optional secret this host lacks is skipped later, so it is not checked: it reaches nothing.
    """
    for ref in matrix.secrets:
        if ref.id in (overrides or {}):
            continue
        if ref.file is not None:
            path = Path(os.path.expanduser(ref.file))
            if ref.optional and not path.exists():
                continue
            if not lane.allows_file(path):
                raise InputError(matrix.file, matrix.line_of(("secrets", ref.id, "file")), f"secrets.{ref.id}.file",
                                 f"'{ref.file}' is outside the lane for build secrets after resolving links "
                                 f"({lane.describe()}); the operator allows a directory with --secret-dir DIR "
                                 f"or {SECRET_DIRS_ENV}, or passes --secret {ref.id}=PATH")
        elif ref.env is not None:
            if ref.optional and ref.env not in os.environ:
                continue
            if ref.env not in lane.env or ref.env in NEVER_BUILD_SECRETS:
                raise InputError(matrix.file, matrix.line_of(("secrets", ref.id, "env")), f"secrets.{ref.id}.env",
                                 f"environment variable {ref.env} is not allowed as a build secret; the operator "
                                 f"allows it with --secret-env {ref.env} or {SECRET_ENV_ENV}")


def secret_files(matrix: Matrix, overrides: dict[str, str] | None = None,
                 lane: SecretLane | None = None) -> SecretFiles:
    """Secret files for the build; `overrides` (id -> path, from --secret) replace the matrix's sources.

    `lane` (default: the environment settings alone) bounds what the matrix's own `file:` and
    `env:` may name; commands pass the one their flags give.
    """
    overrides = dict(overrides or {})
    for sid in overrides:
        if sid not in matrix.secret_ids:
            raise InputError(matrix.file, matrix.line_of(("secrets",)), f"secrets.{sid}",
                             "--secret names a secret the matrix does not declare (its Dockerfiles would not mount it)")
    check_secret_lane(matrix, lane or SecretLane.from_settings(), overrides)
    paths, values = {}, []
    tmp = None
    for ref in matrix.secrets:
        if ref.id in overrides or ref.file:
            path = Path(os.path.expanduser(overrides.get(ref.id) or ref.file or ""))
            if not path.is_file():
                if ref.optional and ref.id not in overrides:
                    continue
                raise InputError(matrix.file, matrix.line_of(("secrets", ref.id, "file")),
                                 f"secrets.{ref.id}.file", f"'{path}' does not exist on this host")
            # The resolved path goes to docker: the file checked is the file mounted.
            path = path.resolve()
            values.extend(_secret_strings(path.read_text(errors="replace")))
            paths[ref.id] = str(path)
        else:
            value = os.environ.get(ref.env or "")
            if value is None and ref.optional:
                continue
            if value is None:
                raise InputError(matrix.file, matrix.line_of(("secrets", ref.id, "env")),
                                 f"secrets.{ref.id}.env", f"environment variable {ref.env} is not set")
            if tmp is None:
                tmp = tempfile.TemporaryDirectory(prefix="imagebuild-secrets-")
                os.chmod(tmp.name, 0o700)
            path = Path(tmp.name) / ref.id
            path.write_text(value)
            path.chmod(0o600)
            paths[ref.id] = str(path)
            values.extend(_secret_strings(value))
    return SecretFiles(paths, tuple(values), tmp)


def _secret_strings(text: str) -> list[str]:
    """The value itself plus the credentials inside it: URL user-info, netrc logins and passwords."""
    found = [text.strip()]
    words = text.replace("=", " ").split()
    for i, word in enumerate(words):
        if "@" in word and "://" in word:
            found += [word, word.split("://", 1)[1].rsplit("@", 1)[0]]
        if i and words[i - 1] in ("password", "login"):
            found.append(word)
    return [f for f in found if f]


def prepare(matrix: Matrix, revision: str, created: str) -> Plan:
    return build_plan(matrix, revision=revision, created=created, resolved=resolve_roots(matrix))
