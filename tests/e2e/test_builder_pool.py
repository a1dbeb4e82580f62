"""A pool of real BuildKit daemons (tests/e2e/buildkit_harness.py): two `buildkitd` on loopback TCP with
mutual TLS, each with its own root, building one small matrix's layers into the local registry.

The matrix is four independent base layers (four OS entries, each FROM its own copy of the local
Debian base image, with a run step unique to the test so that nothing is in the registry yet):
seconds each, and four of them so that both daemons have work and one has more than it can finish.

- `imagebuild build --builders FILE` spreads them over both daemons; the registry holds each at its
  content key with the layer's label, and the report says which daemon built which layer;
- one daemon is killed the moment its first layer's RUN step starts (the test watches the layer's
  log, no sleeps): that layer, and every layer it would have built next, is built on the other;
- neither the client's TLS key nor a build secret's value appears in any log, the report or output.
"""
from __future__ import annotations

import json
import re
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from imagebuild.build import plan as planning
from imagebuild.build import scheduler as building
from imagebuild.build.plan import Layer
from imagebuild.build.pool import layer_builder_for
from imagebuild.build.render import write_tree
from imagebuild.build.scheduler import Builder, BuildOptions, LayerBuilder, LayerResult
from imagebuild.config.builders import load_builders
from imagebuild.config.matrix import load_matrix
from imagebuild.core.report import BuilderStatus, BuildReport, LayerRecord, LayerStatus

from .buildkit_harness import Daemon, Pool, buildkit_pool
from .conftest import STAGING, imagebuild, require_registry
from .tools import crane

PROJECT = "imagebuild-pooltest"
BASE = f"{STAGING}/imagebuild/debian:12"  # made by scripts/bootstrap.sh
OSES = ("d1", "d2", "d3", "d4")
RUN_STEP_STARTED = re.compile(r"^#\d+ \[(stage-\d+ )?\d+/\d+\] RUN ", re.MULTILINE)  # buildctl --progress=plain
WAIT_S = 240


@pytest.fixture(scope="module")
def base_copies() -> dict[str, str]:
    """One copy of the local base image per OS entry (same blobs, its own name): independent base layers."""
    require_registry(STAGING, "staging registry")
    copies = {name: f"{STAGING}/{PROJECT}/debian-{name}:12" for name in OSES}
    for image in copies.values():
        crane("copy", BASE, image)
    return copies


def small_matrix(directory: Path, base_copies: dict[str, str], canary: Path) -> Path:
    """Four base layers nobody built before, each mounting the `canary` file as its netrc build secret in its apt step."""
    directory.mkdir(parents=True, exist_ok=True)
    oses = "\n".join(f"  {name}: {{image: {image}, family: debian}}" for name, image in base_copies.items())
    path = directory / "matrix.yaml"
    path.write_text(f"""\
schema: 1
registry: {STAGING}
project: {PROJECT}
repository: paddle
cache_repository: layers
secrets:
  netrc: {{file: {canary}}}
os:
{oses}
layers:
  base:
    run: ["echo builder-pool-{uuid.uuid4().hex}"]
matrix:
  os: [{", ".join(OSES)}]
  cuda: [cpu]
  python: ["3.11"]
  paddle: ["3.3.1"]
tags:
  gpu: ["{{paddle}}-gpu-{{os}}{{py_suffix}}"]
  cpu: ["{{paddle}}-{{os}}{{py_suffix}}"]
""")
    return path


@pytest.fixture
def canary(tmp_path) -> Path:
    """A build secret whose value must reach no log, report or output."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    path = secrets / "canary"
    path.write_text(f"canary-{uuid.uuid4().hex}\n")
    return path


@pytest.fixture
def pool(tmp_path):
    with buildkit_pool(tmp_path / "buildkit") as started:
        yield started


def bases() -> str:
    return ",".join(f"base/{name}" for name in OSES)


def label_of(image: str) -> str | None:
    config = json.loads(crane("config", image))
    return (config.get("config") or {}).get("Labels", {}).get("io.imagebuild.layer.key")


def test_build_spreads_the_layers_over_both_daemons_and_the_report_says_which_built_what(
        tmp_path, pool: Pool, base_copies, canary):
    matrix = small_matrix(tmp_path / "m", base_copies, canary)
    assert imagebuild("render", "--matrix", matrix).returncode == 0
    workdir = tmp_path / "work"
    run = imagebuild("build", "--matrix", matrix, "--layers", bases(), "--builders", pool.builders_file,
                     "--secret-dir", canary.parent, "--workdir", workdir, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr

    report = BuildReport.read(workdir / "build-report.json")
    assert [rec.status for rec in report.layers] == [LayerStatus.BUILT] * len(OSES)
    assert {rec.builder for rec in report.layers} == {"bk-a", "bk-b"}  # two slots, two daemons: both used
    assert all(rec.attempts == 1 and rec.pushed_by == f"buildkit ({rec.builder})" for rec in report.layers)
    assert [(b.name, b.kind, b.status, b.platforms[0], b.version) for b in report.builders] == [
        (d.name, "buildkit", BuilderStatus.UP, "linux/amd64", "v0.26.2") for d in pool.daemons]
    assert sum(b.built for b in report.builders) == len(OSES)
    assert [b.endpoint for b in report.builders] == [d.endpoint for d in pool.daemons]
    for rec in report.layers:  # in the registry at its content key, by the digest the report names
        assert crane("digest", rec.image).strip() == rec.digest
        assert label_of(rec.image) == rec.key

    # What was never to be written down: the client's key, and the build secret's value.
    key_body = "".join(pool.certs.client.key.read_text().splitlines()[1:-1])
    written = [run.stdout, run.stderr, *(p.read_text(errors="replace") for p in workdir.rglob("*") if p.is_file())]
    for text in written:
        assert key_body not in text
        assert canary.read_text().strip() not in text
    assert str(pool.certs.client.key) not in (workdir / "build-report.json").read_text()


class KillWhenItsFirstLayerRuns:
    """Fault injection: wraps one daemon's layer builder, and kills that daemon the moment the first layer
    sent to it starts a RUN step (seen in the layer's log, which buildctl writes as it goes)."""

    def __init__(self, inner: LayerBuilder, daemon: Daemon):
        self.inner = inner
        self.daemon = daemon
        self.killed_in: str | None = None
        self.killed = threading.Event()

    def build(self, layer: Layer, rec: LayerRecord, log: Path) -> LayerResult:
        if self.killed_in is None:
            self.killed_in = layer.path
            threading.Thread(target=self._kill_when_running, args=(log,), daemon=True).start()
        return self.inner.build(layer, rec, log)

    def stop(self) -> None:
        self.inner.stop()

    def _kill_when_running(self, log: Path) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if log.exists() and RUN_STEP_STARTED.search(log.read_text(errors="replace")):
                self.daemon.kill()
                self.killed.set()
                return
            time.sleep(0.1)


def test_a_daemon_killed_mid_build_has_its_layers_finish_on_the_other(tmp_path, pool: Pool, base_copies, canary):
    matrix_path = small_matrix(tmp_path / "m", base_copies, canary)
    matrix = load_matrix(matrix_path)
    # The build as `imagebuild build --layers ... --builders FILE` makes it, with a fault in one daemon.
    the_plan = building.prepare(matrix, "test", "2025-05-20T00:00:00Z")
    write_tree(matrix_path.parent / "dockerfiles", the_plan.rendered_files())
    report = building.registry_plan(the_plan, [], layer_keys=planning.find_layers(the_plan, bases().split(",")))
    lane = building.SecretLane.from_settings([str(canary.parent)], [])
    secrets = building.secret_files(matrix, {}, lane)
    config = load_builders(pool.builders_file)
    options = BuildOptions(jobs=config.capacity, dockerfiles=matrix_path.parent / "dockerfiles",
                           workdir=tmp_path / "work", secrets=secrets.paths, secret_values=secrets.values,
                           layer_timeout_s=WAIT_S)
    pool_builder = layer_builder_for(config, report, options)
    assert pool_builder is not None
    victim = next(m for m in pool_builder.members if m.spec.name == "bk-a")
    make = victim.make
    fault = KillWhenItsFirstLayerRuns(make(), pool.daemon("bk-a"))
    victim.make = lambda: fault
    try:
        report = Builder(the_plan, report, options, lambda event, rec: None, layer_builder=pool_builder).run()
    finally:
        secrets.close()

    assert fault.killed.is_set() and not pool.daemon("bk-a").alive, "bk-a was never killed mid-build"
    layers = {rec.path: rec for rec in report.layers}
    assert [rec.status for rec in layers.values()] == [LayerStatus.BUILT] * len(OSES), \
        [(rec.path, rec.error) for rec in layers.values()]
    moved = layers[fault.killed_in or ""]
    assert (moved.builder, moved.attempts) == ("bk-b", 2)
    assert all(rec.builder == "bk-b" for rec in layers.values())  # bk-a finished none of them
    # The attempt on bk-a kept its log: it got as far as a RUN step.
    first_try = Path(moved.log or "").with_name(Path(moved.log or "").stem + ".attempt1.log")
    assert RUN_STEP_STARTED.search(first_try.read_text())
    down, up = report.builders
    assert (down.name, down.status, down.built) == ("bk-a", BuilderStatus.DOWN, 0)
    assert "does not answer" in (down.error or "")
    assert (up.name, up.status, up.built) == ("bk-b", BuilderStatus.UP, len(OSES))
    for rec in layers.values():  # each one really is in the registry by that digest
        head = httpx.head(f"http://{STAGING}/v2/{PROJECT}/layers/manifests/{rec.digest}", timeout=30,
                          headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json, "
                                             "application/vnd.oci.image.manifest.v1+json"})
        assert head.status_code == 200, rec.path
