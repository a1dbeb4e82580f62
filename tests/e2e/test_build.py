"""`imagebuild build`, for real: BuildKit, the local staging registry, the example matrix."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .conftest import EXAMPLE, REPO, STAGING, copy_matrix, imagebuild
from .layers import pem_blocks, scan_image

CPU_VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
GPU_VARIANT = "paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12"
MULTI_VARIANT = "paddle3.2.2-cpu-py3.11-debian12"  # linux/amd64 and linux/arm64: one index


def registry_digest(repository: str, tag: str) -> str | None:
    """Asked with skopeo, a checker independent of imagebuild's own registry client."""
    proc = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}",
                           f"docker://{STAGING}/{repository}:{tag}"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def layer_status(report: dict) -> dict[str, str]:
    return {layer["path"]: layer["status"] for layer in report["layers"]}


def test_the_example_builds_every_variant_and_tags_it(built_example):
    variants = {v["id"]: v for v in built_example.report["variants"]}
    assert set(variants) == {CPU_VARIANT, GPU_VARIANT, MULTI_VARIANT}
    for variant in variants.values():
        assert variant["status"] == "built"
        assert variant["digest"].startswith("sha256:")
        for tag in variant["tags"]:
            assert registry_digest("imagebuild-example/paddle", tag) == variant["digest"]
    assert built_example.report["status"] == "ok"


def test_each_layer_is_built_from_its_parent_by_digest(built_example):
    layers = {layer["key"]: layer for layer in built_example.report["layers"]}
    for layer in layers.values():
        assert layer["digest"].startswith("sha256:"), layer
        kind, key = layer["kind"], layer["key"]
        assert layer["image"].endswith(f"/imagebuild-example/layers:{kind}-{key[:32]}")
        assert registry_digest("imagebuild-example/layers", f"{kind}-{key[:32]}") == layer["digest"]
    for variant in built_example.report["variants"]:
        for platform in variant["platforms"]:  # the chain lists each platform's layers in turn
            chain = [key for key in variant["chain"] if layers[key]["platform"] == platform]
            assert layers[chain[0]]["kind"] == "base" and layers[chain[-1]]["kind"] == "release"
            for parent, child in zip(chain, chain[1:]):
                if layers[child]["status"] == "built":
                    assert layers[child]["base_digest"] == layers[parent]["digest"]


def test_the_images_hold_real_paddle(engine, built_example):
    variants = {v["id"]: v for v in built_example.report["variants"]}
    probe = ("import paddle, json; print(json.dumps([paddle.__version__, paddle.is_compiled_with_cuda(), "
             "paddle.version.cuda(), paddle.version.cudnn()]))")
    cpu = engine.containers.run(variants[CPU_VARIANT]["image"], ["python", "-c", probe], remove=True,
                                network_disabled=True).decode()
    gpu = engine.containers.run(variants[GPU_VARIANT]["image"], ["python", "-c", probe], remove=True,
                                network_disabled=True).decode()
    assert json.loads(cpu.strip().splitlines()[-1])[:2] == ["3.3.1", False]
    assert json.loads(gpu.strip().splitlines()[-1]) == ["2.6.2", True, "11.8", "8.6.0"]


def test_building_again_builds_nothing(built_example, tmp_path, secret_canary):
    run = imagebuild("build", "--matrix", str(EXAMPLE), "--workdir", str(tmp_path), "--format", "json",
                     env={"IMAGEBUILD_NETRC": secret_canary["netrc"], "IMAGEBUILD_SECRET_ENV": "IMAGEBUILD_NETRC"})
    assert run.returncode == 0, run.stderr
    summary = run.json()["layers"]
    assert summary == {"reused": len(built_example.report["layers"])}
    table = imagebuild("build", "--matrix", str(EXAMPLE), "--workdir", str(tmp_path))
    assert "nothing to build" in table.stdout


def test_changing_one_variants_python_rebuilds_exactly_its_python_paddle_and_release(built_example, tmp_path):
    def move_cpu_variant_to_python_312(data):
        data["matrix"]["python"] = ["3.11", "3.12"]
        data["matrix"]["exclude"] += [{"cuda": "cpu", "python": "3.11"}, {"cuda": "11.8", "python": "3.12"}]

    matrix = copy_matrix(tmp_path, move_cpu_variant_to_python_312)
    run = imagebuild("plan", "--matrix", str(matrix), "--registry", "--format", "json")
    assert run.returncode == 0, run.stderr
    statuses = {(layer["path"], layer["platform"]): layer["status"] for layer in run.json()["layers"]}
    to_build = {where for where, status in statuses.items() if status == "to-build"}
    both = ("linux/amd64", "linux/arm64")  # the 3.2.2 variant is built for both
    assert to_build == {
        *(("python/debian12-py3.12", platform) for platform in both),
        ("paddle/debian12-py3.12-paddle3.3.1", "linux/amd64"),
        ("release/paddle3.3.1-cpu-py3.12-debian12", "linux/amd64"),
        *(("paddle/debian12-py3.12-paddle3.2.2", platform) for platform in both),
        *(("release/paddle3.2.2-cpu-py3.12-debian12", platform) for platform in both),
    }
    assert {p for p, s in statuses.items() if s == "reused"} == set(statuses) - to_build
    dry = imagebuild("build", "--matrix", str(matrix), "--dry-run", "--workdir", str(tmp_path / "w"),
                     "--format", "json")
    assert dry.returncode == 0, dry.stderr
    assert dry.json()["layers"] == {"to-build": len(to_build), "reused": len(statuses) - len(to_build)}


def test_an_extra_layer_on_one_variant_builds_only_what_depends_on_it(built_example, tmp_path, fresh_repository):
    nonce = uuid.uuid4().hex

    def add_layer_to_cpu_variant(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "marker", "run": [f"echo {nonce} > /etc/imagebuild-e2e-marker"],
                                 "when": {"paddle": "3.3.1"}}]

    matrix = copy_matrix(tmp_path, add_layer_to_cpu_variant)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    built = {path for path, status in layer_status(report).items() if status == "built"}
    # The repository name is in the release labels, so every release layer changes too.
    assert built == {
        "extra/debian12-py3.11-paddle3.3.1-marker",
        f"release/{CPU_VARIANT}",
        f"release/{GPU_VARIANT}",
        f"release/{MULTI_VARIANT}",
    }
    assert registry_digest(f"imagebuild-example/{fresh_repository}", "3.3.1") == \
        next(v["digest"] for v in report["variants"] if v["id"] == CPU_VARIANT)


def test_a_pip_requirement_with_operators_and_a_marker_installs_as_written(engine, tmp_path, fresh_repository):
    # Unquoted, `>=1.16,` would redirect pip's output into a file and `<2` read its input
    # from one that does not exist: the layer would fail, or install the wrong thing.
    requirement = 'six>=1.16,<2; python_version >= "3.8"'
    check = ("import six; v = tuple(int(p) for p in six.__version__.split('.')[:2]); "
             "assert (1, 16) <= v < (2, 0), v")

    def add_a_layer_with_an_operator_requirement(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "operators", "when": {"paddle": "3.3.1"},
                                 "pip": {"packages": [requirement]},
                                 # The repository name makes the layer's key this test's own: it must build.
                                 "run": [f": {fresh_repository}; python -c \"{check}\"; "
                                         "test ! -e '=1.16,' && test ! -e /workspace/=1.16,"]}]

    matrix = copy_matrix(tmp_path, add_a_layer_with_an_operator_requirement)
    dockerfile = next((matrix.parent / "dockerfiles" / "extra").glob("*/Dockerfile")).read_text()
    assert f"'{requirement}'" in dockerfile  # one quoted word on the pip line
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"), "--only", "device=cpu")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    assert layer_status(report)["extra/debian12-py3.11-paddle3.3.1-operators"] == "built"
    [variant] = [v for v in report["variants"] if v["id"] == CPU_VARIANT]
    out = engine.containers.run(variant["image"], ["python", "-c", f"{check}; print(six.__version__)"],
                                remove=True, network_disabled=True).decode()
    assert out.strip().splitlines()[-1].startswith("1.")


def test_a_failed_layer_stops_only_its_descendants(built_example, tmp_path, fresh_repository):
    def break_the_gpu_variant(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [
            {"name": "broken", "run": ["echo 'deliberate failure for the e2e test' >&2; exit 3"],
             "when": {"paddle": "2.6.2"}},
        ]

    matrix = copy_matrix(tmp_path, break_the_gpu_variant)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"))
    assert run.returncode == 1
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    statuses = layer_status(report)
    assert statuses["extra/debian12-cuda11.8-cudnn8.6-wheels-py3.11-paddle2.6.2-broken"] == "failed"
    assert statuses[f"release/{GPU_VARIANT}"] == "skipped"
    assert statuses[f"release/{CPU_VARIANT}"] == "built"
    variants = {v["id"]: v for v in report["variants"]}
    assert variants[GPU_VARIANT]["status"] == "failed"
    assert variants[CPU_VARIANT]["status"] == "built"
    assert "FAILED extra/debian12-cuda11.8-cudnn8.6-wheels-py3.11-paddle2.6.2-broken" in run.stderr
    assert "deliberate failure for the e2e test" in run.stderr  # the log's tail
    assert registry_digest(f"imagebuild-example/{fresh_repository}", "2.6.2-gpu-cuda11.8-cudnn8.6") is None
    assert registry_digest(f"imagebuild-example/{fresh_repository}", "3.3.1") is not None


def test_a_failed_root_layer_skips_every_layer_built_on_it(tmp_path, fresh_repository):
    def break_the_base_layer(data):
        data["repository"] = fresh_repository
        data["layers"] = {"base": {"run": [f"echo 'base fails on purpose {uuid.uuid4().hex}' >&2; exit 3"]}}

    matrix = copy_matrix(tmp_path, break_the_base_layer)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    statuses = layer_status(report)
    assert statuses.pop("base/debian12") == "failed"
    assert set(statuses.values()) == {"skipped"}, statuses  # grandchildren too, whatever their keys
    assert {v["status"] for v in report["variants"]} == {"failed"}


def test_interrupting_a_build_stops_it_and_tags_nothing(built_example, tmp_path, fresh_repository):
    nonce = uuid.uuid4().hex

    def add_a_slow_layer(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "slow", "run": [f"sleep 300 && echo {nonce}"],
                                 "when": {"paddle": "3.3.1"}}]

    matrix = copy_matrix(tmp_path, add_a_slow_layer)
    proc = subprocess.Popen([sys.executable, "-m", "imagebuild", "build", "--matrix", str(matrix),
                             "--workdir", str(tmp_path / "w")], cwd=REPO, stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "building extra/" in line:
            break
    time.sleep(3)  # let BuildKit start the RUN step
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "interrupted" in err
    report = json.loads((tmp_path / "w" / "build-report.json").read_text())
    assert report["status"] == "interrupted"
    assert registry_digest(f"imagebuild-example/{fresh_repository}", "3.3.1") is None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-f", nonce], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(1)
    assert not left, "the RUN step of the interrupted build is still running"


def test_build_secrets_are_in_no_layer_config_log_or_report(engine, built_example, tmp_path,
                                                          fresh_repository, secret_canary):
    # A fresh layer whose RUN step needs the CA bundle (pip through the TLS proxy) and gets
    # the netrc, so the secrets really are mounted during this build.
    def add_a_layer_that_uses_the_secrets(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "uses-secrets", "when": {"paddle": "3.3.1"}, "run": [
            "test -s /run/secrets/netrc && pip download --no-deps --dest /tmp/dl six==1.16.0 "
            f"&& rm -rf /tmp/dl && echo {uuid.uuid4().hex}"]}]

    matrix = copy_matrix(tmp_path, add_a_layer_that_uses_the_secrets)
    workdir = tmp_path / "w"
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(workdir),
                     "--secret", f"ca-bundle={secret_canary['bundle']}",
                     env={"IMAGEBUILD_NETRC": secret_canary["netrc"], "IMAGEBUILD_SECRET_ENV": "IMAGEBUILD_NETRC"})
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((workdir / "build-report.json").read_text())
    fresh_image = next(v["image"] for v in report["variants"] if v["id"] == CPU_VARIANT)

    needles = [secret_canary["marker"].encode(), secret_canary["password"].encode()]
    # Certificates only this host trusts (the proxy's CA) must not reach any image either.
    host_bundle = Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    image_bundle = engine.containers.run(fresh_image, ["cat", "/etc/ssl/certs/ca-certificates.crt"],
                                         remove=True, network_disabled=True).decode()
    # Public CAs (the ones Debian ships, here or in the image) are not secrets: a newer
    # ca-certificates on one side, or pip's own certifi copy, may carry some the other lacks.
    public = set(pem_blocks(image_bundle))
    for shipped in Path("/usr/share/ca-certificates").rglob("*.crt"):
        public |= set(pem_blocks(shipped.read_text()))
    host_only = set(pem_blocks(host_bundle)) - public
    needles += [block.splitlines()[len(block.splitlines()) // 2].encode() for block in host_only]

    images = [fresh_image] + [v["image"] for v in built_example.report["variants"]]
    for image in images:
        engine.images.pull(image)
        findings = scan_image(engine, image, needles)
        assert findings.layers >= 3 and findings.files > 1000, "the image was not really read"
        assert findings.hits == {}, f"{image}: secret material found: {findings.hits}"
        assert not [p for p in findings.paths if p.startswith("/run/secrets/") and p != "/run/secrets/"]

    for path in [*workdir.rglob("*"), *built_example.workdir.rglob("*")]:
        if path.is_file():
            text = path.read_bytes()
            for needle in needles[:2]:
                assert needle not in text, f"{path} contains a secret"
    assert secret_canary["password"] not in run.stdout + run.stderr


def test_a_docker_cli_without_buildkit_is_refused_with_a_way_out(tmp_path, fresh_repository):
    def add_a_layer_to_build(data):
        data["repository"] = fresh_repository
        data["extra_layers"] = [{"name": "new", "run": [f"echo {uuid.uuid4().hex}"]}]

    matrix = copy_matrix(tmp_path, add_a_layer_to_build)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"),
                     env={"IMAGEBUILD_DOCKER": "/bin/false"})
    assert run.returncode == 3
    assert "BuildKit" in run.stderr and "docker.io" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_registry_that_is_down_is_reported_not_a_traceback(tmp_path):
    def point_at_a_closed_port(data):
        data["registry"] = "127.0.0.1:5999"

    matrix = copy_matrix(tmp_path, point_at_a_closed_port)
    run = imagebuild("build", "--matrix", str(matrix), "--workdir", str(tmp_path / "w"))
    assert run.returncode == 3
    assert "127.0.0.1:5999" in run.stderr or "127.0.0.1:5000" in run.stderr
    assert "Traceback" not in run.stderr
