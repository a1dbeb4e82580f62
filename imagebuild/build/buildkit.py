"""One layer built on a BuildKit daemon with `buildctl`, the way buildx's remote driver does it.

The daemon pulls the parent by digest from the registry, builds the layer's Dockerfile with the
same build arguments, labels and secrets as the local engine (scheduler.layer_inputs), and pushes
the result to the cache repository itself; the pushed manifest's digest comes back in buildctl's
metadata file. So the registry stays the one cache every builder shares: a layer built on one
daemon is the parent another daemon pulls.

A failed build is one of two things, and they must not be confused. The layer's own steps failing
(a RUN that exits 1) fails the layer; building it elsewhere would fail the same way. The daemon
going away (killed, unreachable, its host down) says nothing about the layer: BuilderDown, and the
pool (pool.py) builds the layer on another builder. Which one it was, the daemon's own answer
decides: after a failure the daemon is probed, and a daemon that does not answer is down.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuild.build.plan import Layer
from imagebuild.build.scheduler import BuildOptions, LayerInputs, LayerResult, _tail, layer_inputs, own_context
from imagebuild.config.builders import BuilderSpec
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import LayerRecord
from imagebuild.core.runner import Runner, cancel_requested, find_tool
from imagebuild.oci.platforms import Platform

BUILDCTL_ENV = "IMAGEBUILD_BUILDCTL"
BUILDCTL_HINT = "scripts/build-test-tools.sh builds it (BUILDKIT_VERSION in scripts/versions.env)"
PROBE_TIMEOUT_S = 20.0  # `buildctl debug workers`: a daemon that answers at all answers in well under a second
CONNECT_TIMEOUT_S = 10  # buildctl --timeout: how long it waits for the connection itself


class BuilderDown(ImagebuildError):
    """The builder could not be reached, or went away during a build: not the layer's fault."""


def find_buildctl() -> str:
    return find_tool("buildctl", BUILDCTL_ENV, BUILDCTL_HINT)


@dataclass(frozen=True)
class Workers:
    """What a daemon said about itself (`buildctl debug workers`)."""

    platforms: tuple[str, ...]  # os/arch[/variant], in the order its workers list them
    version: str | None


def parse_workers(output: str) -> Workers:
    """`buildctl debug workers --format '{{json .}}'`: a JSON list of workers, each with its platforms."""
    start = output.find("[")
    try:
        workers = json.loads(output[start:]) if start >= 0 else None
    except ValueError:
        workers = None
    if not isinstance(workers, list) or not workers:
        raise ValueError("no workers in its answer")
    platforms: list[str] = []
    version = None
    for worker in workers:
        if not isinstance(worker, dict):
            continue
        for described in worker.get("platforms") or []:
            if isinstance(described, dict) and described.get("os") and described.get("architecture"):
                text = str(Platform(str(described["os"]), str(described["architecture"]),
                                    str(described["variant"]) if described.get("variant") else None))
                if text not in platforms:
                    platforms.append(text)
        found = (worker.get("buildkitVersion") or {}).get("version")
        version = version or (str(found) if found else None)
    if not platforms:
        raise ValueError("its workers report no platform")
    return Workers(tuple(platforms), version)


class Buildctl:
    """buildctl pointed at one daemon: its address and TLS flags, and the probe."""

    def __init__(self, spec: BuilderSpec, runner: Runner, path: str | None = None):
        assert spec.endpoint is not None
        self.spec = spec
        self.runner = runner
        self._path = path

    @property
    def path(self) -> str:
        """Found at first use (ToolMissing, exit 3, when absent): a build that reuses every layer needs none."""
        if self._path is None:
            self._path = find_buildctl()
        return self._path

    def argv(self, *args: str) -> list[str]:
        cmd = [self.path, "--addr", self.spec.endpoint or "", "--timeout", str(CONNECT_TIMEOUT_S)]
        tls = self.spec.tls
        if tls is not None:
            cmd += ["--tlscacert", str(tls.ca), "--tlscert", str(tls.cert), "--tlskey", str(tls.key)]
            if tls.server_name:
                cmd += ["--tlsservername", tls.server_name]
        return [*cmd, *args]

    def workers(self) -> Workers:
        """The daemon's platforms and version; BuilderDown when it does not answer."""
        result = self.runner.run(self.argv("debug", "workers", "--format", "{{json .}}"), timeout=PROBE_TIMEOUT_S,
                                 inherit=False, separate_stderr=True)
        if result.returncode != 0:
            why = f"no answer within {PROBE_TIMEOUT_S:g} s" if result.timed_out else \
                _tail(result.stderr or result.output, 3).replace("\n", " ")
            raise BuilderDown(f"builder {self.spec.name} ({self.spec.endpoint}) does not answer: {why}")
        try:
            return parse_workers(result.output)
        except ValueError as exc:
            raise BuilderDown(f"builder {self.spec.name} ({self.spec.endpoint}): {exc}") from None


class BuildKitLayerBuilder:
    """A LayerBuilder (scheduler.py) for one BuildKit daemon. `build` raises BuilderDown when the daemon
    is gone; any other failure is the layer's and comes back as a failed LayerResult."""

    def __init__(self, buildctl: Buildctl, cache_ref: str, options: BuildOptions):
        self.buildctl = buildctl
        self.cache_ref = cache_ref
        self.options = options
        self.cancelled = threading.Event()

    @property
    def name(self) -> str:
        return self.buildctl.spec.name

    def stop(self) -> None:
        self.cancelled.set()
        self.buildctl.runner.stop_all()

    @property
    def stopping(self) -> bool:
        return self.cancelled.is_set() or cancel_requested()

    def command(self, layer: Layer, rec: LayerRecord, metadata: Path, given: LayerInputs | None = None) -> list[str]:
        """`buildctl build` of the layer's Dockerfile frontend: the same inputs as `docker build` gets."""
        given = given or layer_inputs(layer, rec, self.cache_ref, self.options)
        args = ["build", "--progress=plain", "--frontend", "dockerfile.v0",
                "--local", f"context={given.context}", "--local", f"dockerfile={given.dockerfile}",
                "--opt", f"platform={given.platform}"]
        for name, value in given.labels.items():
            args += ["--opt", f"label:{name}={value}"]
        for name, value in given.build_args.items():
            args += ["--opt", f"build-arg:{name}={value}"]
        for sid, path in given.secrets.items():
            args += ["--secret", f"id={sid},src={path}"]
        # The daemon pushes: the cache registries here are plain HTTP on loopback (a remote daemon
        # reaches its own registry mirror the same way, configured in its buildkitd.toml).
        output = f"type=image,name={rec.image},push=true,registry.insecure=true"
        if layer.compression.is_estargz:
            # BuildKit's own eStargz converter (every layer, TOC digests annotated). It knows no start-up to
            # record, so its layers carry the no-prefetch landmark: everything is fetched on first read.
            output += ",compression=estargz,force-compression=true,oci-mediatypes=true"
        elif not layer.compression.is_gzip:
            # The daemon pushes a zstd release itself: every layer, the parent's too, as OCI zstd blobs.
            output += (f",compression=zstd,compression-level={layer.compression.level},force-compression=true,"
                       "oci-mediatypes=true")
        args += ["--output", output, "--metadata-file", str(metadata)]
        return self.buildctl.argv(*args)

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        metadata = log.with_name(log.stem + ".metadata.json")
        metadata.unlink(missing_ok=True)
        started = time.monotonic()
        # The allowlisted environment only (inherit=False): the matrix's run steps are its author's shell.
        with own_context(layer, layer_inputs(layer, rec, self.cache_ref, self.options), self.options) as given:
            result = self.buildctl.runner.run(self.command(layer, rec, metadata, given),
                                              secrets=self.options.secret_values, log=log,
                                              timeout=self.options.layer_timeout_s, inherit=False)
        rec.steps = {"build_s": round(time.monotonic() - started, 1)}  # the push is the daemon's, inside it
        rec.pushed_by = f"buildkit ({self.name})"
        if self.stopping:
            return LayerResult.failed(_tail(result.output))
        if result.returncode == 0:
            digest = _digest(metadata)
            if digest:
                return LayerResult(digest)
            return LayerResult.failed(f"buildctl succeeded but its metadata file has no containerimage.digest "
                                      f"({metadata.name})")
        self.buildctl.workers()  # BuilderDown when the daemon itself is gone: the pool builds it elsewhere
        if result.timed_out:
            return LayerResult.failed(f"timed out after {self.options.layer_timeout_s:g} s")
        return LayerResult.failed(_tail(result.output))


def _digest(metadata: Path) -> str | None:
    try:
        data: Any = json.loads(metadata.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digest = data.get("containerimage.digest") if isinstance(data, dict) else None
    return digest if isinstance(digest, str) and digest.startswith("sha256:") else None
