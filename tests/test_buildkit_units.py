"""One layer on a BuildKit daemon (build/buildkit.py), with a stand-in `buildctl` program (no daemon).

The stand-in is a real program on IMAGEBUILD_BUILDCTL: it records its arguments, and answers
`build` and `debug workers` as each test scripts. What is checked is ours: the flags the layer's
inputs become (the very inputs `docker build` gets), the digest read from the metadata file, and
the one distinction that matters to the pool: a layer whose own steps fail (the daemon still
answers) against a daemon that has gone away (BuilderDown).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from imagebuild.build.buildkit import Buildctl, BuilderDown, BuildKitLayerBuilder, parse_workers
from imagebuild.build.plan import build_plan
from imagebuild.build.scheduler import BuildOptions, layer_inputs, planned_report
from imagebuild.config.builders import BUILDKIT, BuilderSpec, TlsFiles
from imagebuild.config.matrix import load_matrix
from imagebuild.core.runner import Runner

from .test_pool import MATRIX

DIGEST = "sha256:" + "ab" * 32
# What `buildctl debug workers --format '{{json .}}'` printed for buildkitd v0.26.2 here (trimmed).
WORKERS = ('[{"id":"8p2a","labels":{"org.mobyproject.buildkit.worker.executor":"oci"},'
           '"platforms":[{"architecture":"amd64","os":"linux"},{"architecture":"amd64","os":"linux","variant":"v2"},'
           '{"architecture":"386","os":"linux"}],"gcPolicy":[],'
           '"buildkitVersion":{"package":"github.com/moby/buildkit","version":"v0.26.2","revision":""}}]')


def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build_exit: int, workers_exit: int) -> Path:
    """A buildctl that appends its argv to calls.jsonl; `build` writes the metadata file when it succeeds."""
    calls = tmp_path / "calls.jsonl"
    script = tmp_path / "buildctl"
    script.write_text(f"""#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
open({str(calls)!r}, "a").write(json.dumps(args) + "\\n")
if "workers" in args:
    print({WORKERS!r}) if {workers_exit} == 0 else print("error: connection refused", file=sys.stderr)
    sys.exit({workers_exit})
if {build_exit} == 0:
    open(args[args.index("--metadata-file") + 1], "w").write(json.dumps({{"containerimage.digest": {DIGEST!r}}}))
else:
    print('ERROR: process "/bin/sh -c false" did not complete successfully: exit code: 1')
sys.exit({build_exit})
""")
    script.chmod(0o755)
    monkeypatch.setenv("IMAGEBUILD_BUILDCTL", str(script))
    return calls


@pytest.fixture
def layer_and_options(tmp_path):
    (tmp_path / "matrix.yaml").write_text(MATRIX, encoding="utf-8")
    plan = build_plan(load_matrix(tmp_path / "matrix.yaml"))
    report = planned_report(plan, plan.variants, {})
    layer = next(layer for layer in plan.layers.values() if layer.kind == "python" and layer.platform == "linux/arm64")
    rec = report.layer(layer.key)
    rec.base_digest = "sha256:" + "cd" * 32
    secret = tmp_path / "netrc"
    secret.write_text("machine example.com login me password hunter2\n")
    options = BuildOptions(dockerfiles=tmp_path / "dockerfiles", workdir=tmp_path / "work",
                           secrets={"netrc": str(secret)}, secret_values=("hunter2",))
    (tmp_path / "work").mkdir()
    return plan, layer, rec, options


def builder(tmp_path: Path, plan, options) -> BuildKitLayerBuilder:
    tls = TlsFiles(tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client-key.pem", "buildkitd")
    spec = BuilderSpec("arm", BUILDKIT, "tcp://10.0.0.7:1234", tls)
    return BuildKitLayerBuilder(Buildctl(spec, Runner()), plan.cache_ref, options)


def test_the_layer_is_built_with_the_same_inputs_as_docker_build_and_pushed_by_the_daemon(
        tmp_path, monkeypatch, layer_and_options):
    plan, layer, rec, options = layer_and_options
    calls = stand_in(tmp_path, monkeypatch, build_exit=0, workers_exit=0)
    result = builder(tmp_path, plan, options).build(layer, rec, tmp_path / "work" / "python.log")

    assert (result.digest, rec.pushed_by) == (DIGEST, "buildkit (arm)")
    argv = json.loads(calls.read_text().splitlines()[0])
    assert argv[:12] == ["--addr", "tcp://10.0.0.7:1234", "--timeout", "10", "--tlscacert", str(tmp_path / "ca.pem"),
                         "--tlscert", str(tmp_path / "client.pem"), "--tlskey", str(tmp_path / "client-key.pem"),
                         "--tlsservername", "buildkitd"]
    given = layer_inputs(layer, rec, plan.cache_ref, options)
    opts = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--opt"]
    assert opts == ["platform=linux/arm64", *(f"label:{k}={v}" for k, v in given.labels.items()),
                    *(f"build-arg:{k}={v}" for k, v in given.build_args.items())]
    assert f"build-arg:IMAGEBUILD_PARENT={plan.cache_ref}@{rec.base_digest}" in opts  # the parent, by digest
    assert argv[argv.index("--secret") + 1] == f"id=netrc,src={tmp_path / 'netrc'}"
    assert argv[argv.index("--output") + 1] == f"type=image,name={rec.image},push=true,registry.insecure=true"
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--local"] == [
        f"context={given.context}", f"dockerfile={given.dockerfile}"]


def test_a_layer_whose_steps_fail_on_a_daemon_that_still_answers_is_the_layers_failure(
        tmp_path, monkeypatch, layer_and_options):
    plan, layer, rec, options = layer_and_options
    stand_in(tmp_path, monkeypatch, build_exit=1, workers_exit=0)
    result = builder(tmp_path, plan, options).build(layer, rec, tmp_path / "work" / "python.log")

    assert result.digest is None and "did not complete successfully: exit code: 1" in result.error


def test_a_failed_build_on_a_daemon_that_no_longer_answers_is_builder_down(tmp_path, monkeypatch, layer_and_options):
    plan, layer, rec, options = layer_and_options
    stand_in(tmp_path, monkeypatch, build_exit=1, workers_exit=1)
    with pytest.raises(BuilderDown, match=r"builder arm \(tcp://10.0.0.7:1234\) does not answer: error: connection"):
        builder(tmp_path, plan, options).build(layer, rec, tmp_path / "work" / "python.log")


def test_the_probe_reads_each_workers_platforms_and_the_buildkit_version():
    workers = parse_workers(WORKERS)
    assert workers.platforms == ("linux/amd64", "linux/amd64/v2", "linux/386")
    assert workers.version == "v0.26.2"


@pytest.mark.parametrize("answer", ["", "[]", "not json", '[{"platforms": []}]'])
def test_an_answer_without_workers_or_platforms_is_refused(answer):
    with pytest.raises(ValueError, match="no workers in its answer|report no platform"):
        parse_workers(answer)


def test_a_zstd_release_is_pushed_by_the_daemon_with_every_layer_as_oci_zstd(tmp_path, layer_and_options):
    import dataclasses

    from imagebuild.oci.compression import Compression

    plan, layer, rec, options = layer_and_options
    zstd = dataclasses.replace(layer, compression=Compression("zstd", 5))
    argv = builder(tmp_path, plan, options).command(zstd, rec, tmp_path / "metadata.json")
    assert argv[argv.index("--output") + 1] == (
        f"type=image,name={rec.image},push=true,registry.insecure=true,"
        "compression=zstd,compression-level=5,force-compression=true,oci-mediatypes=true")


def test_an_estargz_release_is_pushed_by_the_daemons_own_estargz_converter(tmp_path, layer_and_options):
    import dataclasses

    from imagebuild.oci.compression import Compression

    plan, layer, rec, options = layer_and_options
    estargz = dataclasses.replace(layer, compression=Compression("estargz"))
    argv = builder(tmp_path, plan, options).command(estargz, rec, tmp_path / "metadata.json")
    assert argv[argv.index("--output") + 1] == (
        f"type=image,name={rec.image},push=true,registry.insecure=true,"
        "compression=estargz,force-compression=true,oci-mediatypes=true")
