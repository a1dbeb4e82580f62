"""BuildKit builds in layer order against a registry-aware plan; the build report.

Each layer image lives in the cache repository under its content key
(`<registry>/<project>/<cache>:<kind>-<key>`); a child builds FROM its parent by digest.
A variant gets its release tags only once its whole chain is in the registry.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import subprocess
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from docker.errors import DockerException

from . import publish
from .matrix import Matrix
from .plan import Plan, Variant, build_plan
from .registry import ImageRef, Registry, RegistryError, head_many
from .render import check_tree
from .source import InputError
from .tools import Result, Runner, docker_cli

REPORT_SCHEMA = "imagebuild.build-report/v1"


# --- the record ---------------------------------------------------------------------


@dataclass
class LayerRecord:
    key: str
    kind: str
    path: str
    image: str  # cache repository reference with tag
    status: str = "pending"  # to-build, reused, built, failed, skipped
    digest: str | None = None
    base_digest: str | None = None  # the image it was built FROM
    duration_s: float | None = None
    log: str | None = None
    error: str | None = None
    steps: dict[str, float] | None = None  # seconds per step: build_s, export_s, compress_s, upload_s, push_s
    pushed_by: str | None = None  # "imagebuild (engine storage)", "imagebuild (docker save)" or "docker push"
    blobs: dict[str, int] | None = None  # uploaded, uploaded_bytes, present (already in the registry)


@dataclass
class VariantRecord:
    id: str
    tags: list[str]
    images: list[str]
    chain: list[str]
    device: str
    paddle: str
    python: str
    cuda: str | None
    cudnn: str | None
    status: str = "pending"  # built, failed, skipped
    digest: str | None = None
    image: str | None = None  # repository@digest
    stages: dict[str, dict] = field(default_factory=dict)  # later stages add their results here


@dataclass
class BuildReport:
    matrix: str
    revision: str
    registry: str
    repository: str
    cache_repository: str
    created: str
    variants: list[VariantRecord]
    layers: list[LayerRecord]
    status: str = "pending"  # ok, failed, interrupted, planned
    schema: str = REPORT_SCHEMA

    def layer(self, key: str) -> LayerRecord:
        return next(rec for rec in self.layers if rec.key == key)

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for rec in self.layers:
            counts[rec.status] = counts.get(rec.status, 0) + 1
        return counts

    def to_json(self) -> str:
        data = asdict(self)
        data["summary"] = self.summary()
        return json.dumps(data, indent=2)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json() + "\n", encoding="utf-8")
        tmp.replace(path)  # a reader never sees half a report

    @classmethod
    def read(cls, path: Path) -> "BuildReport":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(str(path), None, "", "build report not found (run imagebuild build first)") from None
        except json.JSONDecodeError as exc:
            raise InputError(str(path), exc.lineno, "", f"not JSON: {exc.msg}") from None
        if data.get("schema") != REPORT_SCHEMA:
            raise InputError(str(path), None, "schema", f"expected {REPORT_SCHEMA}, got {data.get('schema')!r}")
        data.pop("summary", None)
        data["variants"] = [VariantRecord(**v) for v in data["variants"]]
        data["layers"] = [LayerRecord(**rec) for rec in data["layers"]]
        return cls(**data)


def record_stage(report_path: Path, stage: str, by_variant: dict[str, dict[str, Any]]) -> None:
    """Put each variant's result for one stage into the report, atomically and under a lock.

    The file is read again and only this stage is changed, so what another stage (smoke,
    scan, gate) wrote in the meantime stays; a reader never sees half a file.
    """
    with _report_lock(report_path):
        data = json.loads(report_path.read_text(encoding="utf-8"))
        for variant in data.get("variants", []):
            if variant.get("id") in by_variant:
                variant.setdefault("stages", {})[stage] = by_variant[variant["id"]]
        mode = report_path.stat().st_mode & 0o777  # keep whatever permissions the report had
        fd, tmp = tempfile.mkstemp(prefix=".build-report-", suffix=".tmp", dir=report_path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(data, indent=2) + "\n")
            os.chmod(tmp, mode)
            os.replace(tmp, report_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def _report_lock(report_path: Path) -> Iterator[None]:
    with open(report_path.with_name(report_path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- planning against the registry ----------------------------------------------------


@dataclass(frozen=True)
class BuildOptions:
    jobs: int = 2
    dry_run: bool = False
    dockerfiles: Path = Path("dockerfiles")
    workdir: Path = Path(".imagebuild")
    secrets: dict[str, str] = field(default_factory=dict)  # secret id -> file path on this host
    secret_values: tuple[str, ...] = ()  # to redact from logs
    push: str = "imagebuild"  # or "docker": `docker push`, one core, gzip level 6 (see publish.py)


def git_revision(cwd: Path) -> tuple[str, str]:
    """(commit, its commit time in UTC) or ('unknown', epoch) outside git.

    SOURCE_DATE_EPOCH, the reproducible-builds convention, overrides the time.
    """
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%H %ct"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        commit, seconds = out[0], int(out[1])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        commit, seconds = "unknown", 0
    if os.environ.get("SOURCE_DATE_EPOCH", "").isdigit():
        seconds = int(os.environ["SOURCE_DATE_EPOCH"])
    created = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return commit, created


def resolve_roots(matrix: Matrix) -> dict[str, str]:
    """Resolve unpinned base images (tags) to digests, so keys and FROM lines are exact."""
    images = {spec.image for spec in matrix.os.values() if not spec.digest}
    images |= {spec.image for spec in matrix.cuda.values() if spec.image and not spec.digest}
    resolved = {}
    for image in sorted(images):
        ref = ImageRef.parse(image)
        with Registry(ref.registry) as registry:
            digest = registry.head_manifest(ref.repository, ref.reference)
        if digest is None:
            raise RegistryError(f"base image {image} is not in its registry")
        resolved[image] = digest
    return resolved


def registry_plan(plan: Plan, variants: Iterable[Variant], resolve_digests: bool = True,
                  event_hooks: dict | None = None) -> BuildReport:
    """Which layer keys does the cache repository hold already?

    A build needs each layer's digest: one HEAD per distinct layer, concurrently. A plan
    needs only existence, which one tags/list request answers for every layer at once.
    """
    variants = list(variants)
    keys = list(dict.fromkeys(k for v in variants for k in v.chain))
    cache = ImageRef.parse(plan.cache_ref)
    found: dict[tuple[str, str], str | None] = {}
    if resolve_digests:
        found = head_many(cache.registry, [(cache.repository, plan.layers[k].cache_tag) for k in keys],
                          event_hooks=event_hooks)
        existing = {tag for (_, tag), digest in found.items() if digest}
    else:
        with Registry(cache.registry) as registry:
            if event_hooks:
                registry.client.event_hooks = event_hooks
            existing = registry.list_tags(cache.repository)
    layers = []
    for key in keys:
        layer = plan.layers[key]
        exists = layer.cache_tag in existing
        digest = found.get((cache.repository, layer.cache_tag))
        layers.append(LayerRecord(key=key, kind=layer.kind, path=layer.path,
                                  image=f"{plan.cache_ref}:{layer.cache_tag}",
                                  status="reused" if exists else "to-build", digest=digest))
    records = [
        VariantRecord(id=v.id, tags=list(v.tags), images=[f"{plan.repository_ref}:{t}" for t in v.tags],
                      chain=list(v.chain), device=v.device, paddle=v.paddle, python=v.python,
                      cuda=v.cuda, cudnn=v.cudnn)
        for v in variants
    ]
    return BuildReport(matrix=plan.matrix_file, revision="", registry=plan.registry,
                       repository=plan.repository_ref, cache_repository=plan.cache_ref,
                       created=_now(), variants=records, layers=layers, status="planned")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- building -------------------------------------------------------------------------

Event = Callable[[str, LayerRecord], None]  # (event name, layer) for progress displays


class Builder:
    def __init__(self, plan: Plan, report: BuildReport, options: BuildOptions, on_event: Event):
        self.plan = plan
        self.report = report
        self.options = options
        self.on_event = on_event
        self.runner = Runner()
        self.cancelled = threading.Event()

    def check_dockerfiles(self) -> None:
        """Build exactly what the keys describe: the committed files must be current."""
        wanted = {f"{self.plan.layers[rec.key].path}/{name}": text
                  for rec in self.report.layers for name, text in self.plan.layers[rec.key].files}
        drift = [d for d in check_tree(self.options.dockerfiles, wanted) if d.reason != "stale"]
        if drift:
            raise InputError(str(self.options.dockerfiles / drift[0].path), None, "",
                             f"{len(drift)} Dockerfile(s) differ from the matrix ({drift[0].reason}); "
                             "run `imagebuild render` and commit")

    def run(self) -> BuildReport:
        self.check_dockerfiles()
        todo = {rec.key for rec in self.report.layers if rec.status == "to-build"}
        if self.options.dry_run:
            return self._finish()
        if not todo:
            self._tag_variants()
            return self._finish()
        docker = docker_cli()
        self.pusher = publish.Pusher(docker, self.runner, self.options.workdir / "spool", self.cancelled,
                                     self.options.push, self.options.secret_values)
        self.options.workdir.joinpath("logs").mkdir(parents=True, exist_ok=True)
        done: set[str] = {rec.key for rec in self.report.layers if rec.status == "reused"}
        failed: set[str] = set()
        running: dict[Future, str] = {}
        pool = ThreadPoolExecutor(max_workers=max(1, self.options.jobs))
        try:
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
                        running[pool.submit(self._build_layer, docker, key)] = key
                if not running:
                    if todo:  # nothing could start: a parent outside the plan (a bug, not input)
                        raise RuntimeError(f"unschedulable layers: {sorted(todo)}")
                    continue
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    key = running.pop(future)
                    (done if future.result() else failed).add(key)
                    if self.plan.layers[key].kind == "release":
                        self._tag_variants()  # this variant's chain is complete: tag it now
        except KeyboardInterrupt:
            self.cancelled.set()
            self.runner.stop_all()
            pool.shutdown(wait=True, cancel_futures=True)
            for rec in self.report.layers:
                if rec.status in ("to-build", "building"):
                    rec.status, rec.error = "skipped", "interrupted"
            self.report.status = "interrupted"
            self._write()
            raise
        pool.shutdown(wait=True)
        self._tag_variants()
        return self._finish()

    def _mark(self, key: str, status: str, **fields) -> None:
        rec = self.report.layer(key)
        rec.status = status
        for name, value in fields.items():
            setattr(rec, name, value)
        self.on_event(status, rec)

    def _build_layer(self, docker: str, key: str) -> bool:
        layer = self.plan.layers[key]
        rec = self.report.layer(key)
        log = self.options.workdir / "logs" / f"{layer.kind}-{key[:12]}.log"
        rec.log = str(log)
        args = dict(layer.build_args)
        if layer.parent is not None:
            args["IMAGEBUILD_PARENT"] = f"{self.plan.cache_ref}@{self.report.layer(layer.parent).digest}"
            rec.base_digest = self.report.layer(layer.parent).digest
        elif layer.root is not None:
            rec.base_digest = layer.root.digest
        self._mark(key, "building")
        started = time.monotonic()
        cmd = [docker, "build", "--progress=plain", "--label", f"io.imagebuild.layer.key={key}",
               "-t", rec.image]
        for name, value in sorted(args.items()):
            cmd += ["--build-arg", f"{name}={value}"]
        for sid, path in sorted(self.options.secrets.items()):
            cmd += ["--secret", f"id={sid},src={path}"]
        cmd.append(str(self.options.dockerfiles / layer.path))
        result = self.runner.run(cmd, secrets=self.options.secret_values, log=log,
                                 env={"DOCKER_BUILDKIT": "1"})
        rec.steps = {"build_s": round(time.monotonic() - started, 1)}
        if result.returncode == 0 and not self.cancelled.is_set():
            pushed = time.monotonic()
            digest, result = self._push(key, log)
            rec.steps["push_s"] = round(time.monotonic() - pushed, 1)
            if digest:
                self._mark(key, "built", digest=digest, duration_s=round(time.monotonic() - started, 1))
                return True
        tail = "\n".join(result.output.strip().splitlines()[-15:])
        self._mark(key, "failed", duration_s=round(time.monotonic() - started, 1), error=tail)
        return False

    def _push(self, key: str, log: Path) -> tuple[str | None, Result]:
        """Push the built image (publish.Pusher); any failure fails the layer, with the reason in its log."""
        rec = self.report.layer(key)
        layer = self.plan.layers[key]
        # The image it was built FROM, whose blobs the registry has: a layer image, or the root.
        base = self.plan.cache_ref if layer.parent is not None else (layer.root.image if layer.root else "")
        parent = ImageRef.parse(f"{base.split('@')[0]}@{rec.base_digest}") if base and rec.base_digest else None
        try:
            pushed = self.pusher.push(rec.image, parent)
        except (publish.PublishError, RegistryError, OSError, DockerException) as exc:
            pushed = publish.Pushed(None, "imagebuild",
                                    f"imagebuild: push of {rec.image} failed: {exc.__class__.__name__}: {exc}\n")
        with log.open("a", encoding="utf-8") as handle:
            handle.write(pushed.output)
        rec.pushed_by = pushed.by
        assert rec.steps is not None
        rec.steps.update(pushed.steps)
        rec.blobs = pushed.blobs
        return pushed.digest, Result(0 if pushed.digest else 1, pushed.output)

    def _tag_variants(self) -> None:
        """Release tags only for variants whose whole chain is in the registry."""
        with Registry(ImageRef.parse(self.plan.repository_ref).registry) as registry:
            for variant in self.report.variants:
                if variant.status != "built":
                    self._tag_variant(registry, variant)

    def _tag_variant(self, registry: Registry, variant: VariantRecord) -> None:
        statuses = [self.report.layer(k).status for k in variant.chain]
        if any(s in ("failed", "skipped") for s in statuses):
            variant.status = "failed"
            return
        if any(s not in ("built", "reused") for s in statuses):
            return
        repo = ImageRef.parse(self.plan.repository_ref)
        cache = ImageRef.parse(self.plan.cache_ref)
        digest = self.report.layer(variant.chain[-1]).digest or ""
        for tag in variant.tags:
            if registry.head_manifest(repo.repository, tag) != digest:
                registry.copy_within(cache.repository, digest, repo.repository, tag)
        variant.digest = digest
        variant.image = f"{self.plan.repository_ref}@{digest}"
        variant.status = "built"
        self.on_event("tagged", self.report.layer(variant.chain[-1]))

    def _finish(self) -> BuildReport:
        failed = any(v.status == "failed" for v in self.report.variants)
        self.report.status = "failed" if failed else ("planned" if self.options.dry_run else "ok")
        self._write()
        return self.report

    def _write(self) -> None:
        self.report.write(self.options.workdir / "build-report.json")


@dataclass
class SecretFiles:
    """Build secrets as files for `--secret src=`: env-var secrets go to a private temp file."""

    paths: dict[str, str]
    values: tuple[str, ...]
    _tmp: tempfile.TemporaryDirectory | None = None

    def close(self) -> None:
        if self._tmp:
            self._tmp.cleanup()


def secret_files(matrix: Matrix, overrides: dict[str, str] | None = None) -> SecretFiles:
    """Secret files for the build; `overrides` (id -> path, from --secret) replace the matrix's sources."""
    overrides = dict(overrides or {})
    for sid in overrides:
        if sid not in matrix.secret_ids:
            raise InputError(matrix.file, matrix.line_of(("secrets",)), f"secrets.{sid}",
                             "--secret names a secret the matrix does not declare (its Dockerfiles would not mount it)")
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
