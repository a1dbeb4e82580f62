"""No signing password or registry credential is in the environment of a build (real Docker engine).

A tiny image whose RUN step writes its environment into the image, built the way the Builder
builds a layer (build.run_docker_build), with the job's credentials set in this process. The
docker CLI itself is wrapped by a script that records what it was handed and then runs the real
CLI: a RUN step never sees the CLI's environment, but a `--build-arg NAME` (no value), a plugin
or a future frontend would, so neither may hold a credential.
"""
from __future__ import annotations

import uuid

from imagebuild.build import scheduler as building
from imagebuild.core.runner import Runner, docker_cli

BASE = "127.0.0.1:5000/imagebuild/debian:12"  # made and pushed by scripts/bootstrap.sh
CREDENTIALS = ("COSIGN_PASSWORD", "SIGSTORE_ID_TOKEN", "HARBOR_USERNAME", "HARBOR_PASSWORD", "TRIVY_PASSWORD",
               "EU_WEST_AUTH", "GITHUB_TOKEN", "IMAGEBUILD_NETRC")


def test_a_build_step_and_the_docker_cli_see_no_credential_of_the_job(engine, staging_registry, tmp_path,
                                                                      monkeypatch):
    canary = f"canary-{uuid.uuid4().hex}"
    for name in CREDENTIALS:
        monkeypatch.setenv(name, f"{name}={canary}")
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {BASE}\nRUN env | sort > /build-env.txt\n")
    recorded = tmp_path / "cli-env.txt"
    wrapper = tmp_path / "docker"
    wrapper.write_text(f'#!/bin/sh\nenv > "{recorded}"\nexec "{docker_cli()}" "$@"\n')
    wrapper.chmod(0o755)
    tag = f"imagebuild-e2e-env:{uuid.uuid4().hex[:12]}"

    result = building.run_docker_build(Runner(), [str(wrapper), "build", "--progress=plain", "-t", tag, str(context)],
                                       secrets=(), log=tmp_path / "build.log", timeout=600)
    try:
        assert result.returncode == 0, result.output[-3000:]
        inside = engine.containers.run(tag, ["cat", "/build-env.txt"], remove=True, network_disabled=True).decode()
    finally:
        engine.images.remove(tag, force=True)
    handed = recorded.read_text()
    assert "DOCKER_BUILDKIT=1" in handed and "PATH=" in handed  # the wrapper really ran
    assert "PATH=" in inside  # and so did the RUN step
    for text in (handed, inside, result.output):
        assert canary not in text
        assert not [name for name in CREDENTIALS if f"{name}=" in text]
