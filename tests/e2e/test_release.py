"""`imagebuild release` on the example, for real: the whole chain, then a rerun that does no work.

The example's layers are in the registry already (the session's `built_example`), so the first
run builds at most the release layers of this checkout's revision; then it smoke-tests, scans
with the fixture DB, gates with the example's policy, signs with bootstrap's key and pushes to a
repository of its own. The second run must find all of it done.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .conftest import EXAMPLE, EXAMPLE_POLICY, STAGING, Run, imagebuild, trivy_cache_with_db, unique

STAGES = ("build", "smoke", "scan", "gate", "sign", "push")


@dataclass
class Released:
    workdir: Path
    cache_dir: Path
    push_to: str
    first: Run
    args: tuple[str, ...]
    password: str

    def again(self, workdir: Path | None = None, *extra: str) -> Run:
        return release(workdir or self.workdir, self.cache_dir, self.password, *self.args, *extra)


def this_revision() -> tuple[str, str]:
    """The checkout's commit and its time, pinned for the module: a commit made while the tests
    run must not make the rerun a release of another revision (its release layers would differ)."""
    import subprocess

    out = subprocess.run(["git", "log", "-1", "--format=%H %ct"], cwd=EXAMPLE.parents[2], capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0], out[1]


REVISION, COMMIT_TIME = this_revision()


def release(workdir: Path, cache_dir: Path, password: str, *args: str) -> Run:
    return imagebuild("release", "--matrix", str(EXAMPLE), "--workdir", str(workdir), "--offline",
                      "--cache-dir", str(cache_dir), "--revision", REVISION, *args,
                      env={"COSIGN_PASSWORD": password, "SOURCE_DATE_EPOCH": COMMIT_TIME}, timeout=3600)


@pytest.fixture(scope="module")
def released(built_example, trivy, trivy_db, cosign, cosign_keys, tmp_path_factory) -> Released:
    workdir = tmp_path_factory.mktemp("release") / "work"
    cache_dir = trivy_cache_with_db(trivy_db, tmp_path_factory.mktemp("release-trivy"))
    push_to = f"{STAGING}/{unique('release-e2e')}"
    args = ("--policy", str(EXAMPLE_POLICY), "--key", str(cosign_keys["key"]), "--push-to", push_to,
            "--trust", str(EXAMPLE.parent / "trust.yaml"), "--format", "json")
    first = release(workdir, cache_dir, cosign_keys["password"], *args)
    assert first.returncode == 0, f"imagebuild release failed:\n{first.stdout[-4000:]}\n{first.stderr[-4000:]}"
    return Released(workdir, cache_dir, push_to, first, args, cosign_keys["password"])


def stage_records(workdir: Path) -> dict[str, dict]:
    report = json.loads((workdir / "build-report.json").read_text())
    return {v["id"]: v for v in report["variants"]}


def test_the_first_run_takes_every_variant_through_every_stage(released):
    summary = released.first.json()
    assert summary["status"] == "released"
    assert {v["id"] for v in summary["variants"]} == set(stage_records(released.workdir))
    for v in summary["variants"]:
        assert v["failed_stage"] is None
        for stage in STAGES:
            assert v["stages"][stage]["outcome"] in ("done", "reused"), (v["id"], stage, v["stages"][stage])
    records = stage_records(released.workdir)
    for vid, record in records.items():
        digest = record["digest"]
        for stage in ("smoke", "scan", "gate", "sign", "push"):
            assert record["stages"][stage]["digest"] == digest, (vid, stage)
        assert record["stages"]["gate"]["status"] == "passed"
        assert record["stages"]["sign"]["status"] == "passed"
        assert record["stages"]["push"]["target"].startswith(released.push_to + "/")


def test_a_second_run_does_no_build_smoke_scan_gate_sign_or_push_work_and_says_so(released):
    before = stage_records(released.workdir)
    again = released.again()
    assert again.returncode == 0, again.stderr[-3000:]
    summary = again.json()
    assert summary["nothing_new"] is True
    assert summary["work"] == {"layers_built": 0, "smoke_runs": 0, "scans": 0, "gate_runs": 0, "signed": 0, "pushed": 0}
    words = {"build": "reused", "smoke": "already passed", "scan": "already scanned", "gate": "already passed",
             "sign": "already signed", "push": "already pushed"}
    for v in summary["variants"]:
        for stage in STAGES:
            assert v["stages"][stage]["outcome"] == "reused", (v["id"], stage)
            assert v["stages"][stage]["result"].startswith(words[stage]), (v["id"], stage)
    after = stage_records(released.workdir)
    for vid in before:
        assert after[vid]["digest"] == before[vid]["digest"]
        # The records are the first run's: same scan time, same signing time, same smoke run.
        assert after[vid]["stages"]["scan"]["scanned_at"] == before[vid]["stages"]["scan"]["scanned_at"]
        assert after[vid]["stages"]["sign"]["signed_at"] == before[vid]["stages"]["sign"]["signed_at"]
        assert after[vid]["stages"]["smoke"]["junit"] == before[vid]["stages"]["smoke"]["junit"]
        # Push checks the target again (reads only): nothing uploaded, no tag written.
        push = after[vid]["stages"]["push"]
        assert (push["bytes_uploaded"], push["blobs_uploaded"], push["tags_written"]) == (0, 0, []), push
        assert push["tags"] == before[vid]["stages"]["push"]["tags"]


def test_the_table_names_each_reused_stage_per_variant(released):
    table = released.again(None, "--format", "table")
    assert table.returncode == 0, table.stderr[-3000:]
    for vid in stage_records(released.workdir):
        line = next(line for line in table.stdout.splitlines() if line.startswith(vid))
        for word in ("reused", "already passed", "already scanned", "already signed", "already pushed", "released"):
            assert word in line, line
    assert "nothing new" in table.stdout


def test_a_variant_blocked_by_the_gate_stops_there_while_the_other_goes_on(released, tmp_path):
    """The zlib exception narrowed to the GPU variant: the CPU image is blocked, the GPU one signed."""
    workdir = tmp_path / "work"
    shutil.copytree(released.workdir, workdir)
    records = stage_records(workdir)
    gpu = next(vid for vid, r in records.items() if r["device"] == "gpu")
    cpu = next(vid for vid, r in records.items() if r["device"] == "cpu")
    policy = yaml.safe_load(EXAMPLE_POLICY.read_text())
    for exception in policy["exceptions"]:
        if exception["id"] == "CVE-2023-45853":
            exception["variants"] = [gpu]
    narrowed = tmp_path / "policy.yaml"
    narrowed.write_text(yaml.safe_dump(policy))
    args = list(released.args)
    args[args.index("--policy") + 1] = str(narrowed)
    result = release(workdir, released.cache_dir, released.password, *args)
    assert result.returncode == 1, result.stderr[-3000:]
    by_id = {v["id"]: v for v in result.json()["variants"]}
    assert by_id[cpu]["failed_stage"] == "gate"
    assert by_id[cpu]["stages"]["gate"]["outcome"] == "failed"
    assert "CVE-2023-45853" in by_id[cpu]["stages"]["gate"]["detail"]
    assert [by_id[cpu]["stages"][s]["outcome"] for s in ("sign", "push")] == ["not reached", "not reached"]
    assert by_id[gpu]["status"] == "released"
    assert by_id[gpu]["stages"]["gate"]["outcome"] == "done", "a new policy is a new verdict"
    assert by_id[gpu]["stages"]["sign"]["outcome"] == "reused"


def test_an_interrupted_release_exits_130_and_a_rerun_finishes_the_job(released, tmp_path):
    """SIGINT while the smoke tests run: exit 130, the report says which stage stopped; the rerun completes."""
    import os
    import signal
    import subprocess
    import sys

    workdir = tmp_path / "work"
    args = [a for a in released.args if a not in ("--format", "json")]
    argv = [sys.executable, "-m", "imagebuild", "release", "--matrix", str(EXAMPLE), "--workdir", str(workdir),
            "--offline", "--cache-dir", str(released.cache_dir), "--revision", REVISION, *args]
    env = {**os.environ, "COSIGN_PASSWORD": released.password, "SOURCE_DATE_EPOCH": COMMIT_TIME}
    proc = subprocess.Popen(argv, cwd=EXAMPLE.parents[2], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    seen = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("smoke: "):
            proc.send_signal(signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=600)
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted by SIGINT" in rest
    report = json.loads((workdir / "build-report.json").read_text())
    smoke = [v["stages"].get("smoke", {}).get("status") for v in report["variants"]]
    assert "passed" not in smoke[:1], smoke  # the first variant's run was cut short
    assert not any(v["stages"].get("sign") for v in report["variants"]), "nothing past the stopped stage"

    again = release(workdir, released.cache_dir, released.password, *released.args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.json()["status"] == "released"


def release_cpu_variant(tmp_path: Path, trivy_db: Path, cosign_keys: dict, compression: str,
                        edit=lambda data: None) -> tuple[dict, dict]:
    """`imagebuild release` of the example's 3.3.1 CPU variant with `compression: <compression>` (only its release
    layer is new: the layers below are the example's gzip ones, built FROM as before), pushed to a repository of
    its own that the example's trust covers: (the variant's record, the manifest of its digest). Every stage must
    have judged the pushed digest, and what is pushed must verify."""
    from imagebuild.oci.client import Registry

    from .conftest import copy_matrix

    def edited(data: dict) -> None:
        data.update(compression=compression)
        edit(data)

    matrix = copy_matrix(tmp_path, edited)
    workdir = tmp_path / "work"
    push_to = f"{STAGING}/imagebuild-example/{unique('release-' + compression)}"
    run = imagebuild("release", "--matrix", str(matrix), "--workdir", str(workdir), "--offline",
                     "--only", "id=paddle3.3.1-cpu-py3.11-debian12",
                     "--cache-dir", str(trivy_cache_with_db(trivy_db, tmp_path / "trivy")), "--revision", REVISION,
                     "--policy", str(EXAMPLE_POLICY), "--key", str(cosign_keys["key"]), "--push-to", push_to,
                     "--trust", str(EXAMPLE.parent / "trust.yaml"), "--format", "json",
                     env={"COSIGN_PASSWORD": cosign_keys["password"], "SOURCE_DATE_EPOCH": COMMIT_TIME}, timeout=3600)
    assert run.returncode == 0, f"{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    variant = stage_records(workdir)["paddle3.3.1-cpu-py3.11-debian12"]
    for stage in ("smoke", "scan", "gate", "sign", "push"):
        assert variant["stages"][stage]["digest"] == variant["digest"], (stage, variant["stages"][stage])
    for stage in ("smoke", "gate", "sign"):
        assert variant["stages"][stage]["status"] == "passed", (stage, variant["stages"][stage])
    built = {layer["path"]: layer["status"] for layer in json.loads((workdir / "build-report.json").read_text())["layers"]}
    # Below the release layer, the example's gzip layers are reused as they are: only the release push differs.
    assert {path for path, status in built.items() if status == "built"} <= {"release/paddle3.3.1-cpu-py3.11-debian12"}
    assert len(built) > 1 and "release/paddle3.3.1-cpu-py3.11-debian12" in built

    host, _, repository = variant["image"].partition("/")
    with Registry(host) as registry:
        raw, media_type, _ = registry.get_manifest(repository.split("@")[0], variant["digest"])
    assert media_type == "application/vnd.oci.image.manifest.v1+json"
    pushed = variant["stages"]["push"]["target"]
    verified = imagebuild("verify", "--trust", str(EXAMPLE.parent / "trust.yaml"), f"{pushed}@{variant['digest']}")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    return variant, json.loads(raw)


def test_a_zstd_variant_goes_through_every_stage_and_is_pushed_signed_with_zstd_layers(
        built_example, trivy, trivy_db, cosign, cosign_keys, tmp_path):
    """The whole chain on a zstd release (`compression: zstd`): smoke runs it on this Docker 20.10 engine (from
    its config when the engine holds it, else from the zstd layers smoke loads); Trivy scans and cosign signs the
    zstd digest; what is pushed verifies and has zstd layers."""
    variant, manifest = release_cpu_variant(tmp_path, trivy_db, cosign_keys, "zstd")
    assert variant["compression"] == "zstd:3"
    assert {layer["mediaType"] for layer in manifest["layers"]} == {"application/vnd.oci.image.layer.v1.tar+zstd"}


def test_an_estargz_variant_goes_through_every_stage_with_its_start_up_first_in_each_layer(
        built_example, engine, trivy, trivy_db, cosign, cosign_keys, tmp_path):
    """The whole chain on an eStargz release (`compression: estargz`): every layer is written again as eStargz
    with what the image's health check (`import paddle`) read before each prefetch landmark; smoke runs the
    eStargz digest (this Docker 20.10 engine pulls it in full: a new config), Trivy scans it, cosign signs the
    manifest that carries each layer's TOC digest, and the pushed image verifies."""
    import hashlib
    import uuid

    import httpx

    from imagebuild.oci import estargz
    from tests.test_estargz import gunzip, toc_of

    # A label of its own: a release layer (and so a push) of its own, whatever earlier runs left in the registry.
    nonce = uuid.uuid4().hex
    variant, manifest = release_cpu_variant(
        tmp_path, trivy_db, cosign_keys, "estargz",
        lambda data: data.setdefault("labels", {}).update({"io.imagebuild.e2e-nonce": nonce}))
    # Smoke pulled the eStargz image into this engine (a new config: every layer); it is the test's to remove.
    engine.images.remove(manifest["config"]["digest"], force=True)
    assert variant["compression"] == "estargz"
    assert {layer["mediaType"] for layer in manifest["layers"]} == {"application/vnd.oci.image.layer.v1.tar+gzip"}
    host, _, repository = variant["image"].split("@")[0].partition("/")
    config = httpx.get(f"http://{host}/v2/{repository}/blobs/{manifest['config']['digest']}").json()
    prioritized = {}
    for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"]):
        blob = httpx.get(f"http://{host}/v2/{repository}/blobs/{layer['digest']}", timeout=300).content
        assert estargz.TOC_DIGEST_ANNOTATION in layer["annotations"]
        raw, toc = toc_of(blob)
        assert "sha256:" + hashlib.sha256(raw).hexdigest() == layer["annotations"][estargz.TOC_DIGEST_ANNOTATION]
        names = [estargz.clean_name(e["name"]) for e in toc["entries"] if e["type"] != "chunk"]
        if estargz.PREFETCH_LANDMARK in names:
            prioritized.update(dict.fromkeys(names[:names.index(estargz.PREFETCH_LANDMARK)]))
        assert "sha256:" + hashlib.sha256(gunzip(blob)).hexdigest() == diff_id
    # What `import paddle` read is first in its layers: the interpreter, Paddle's own modules and libraries.
    assert "opt/venv/lib/python3.11/site-packages/paddle/__pycache__/__init__.cpython-311.pyc" in prioritized
    assert "usr/bin/python3.11" in prioritized
    assert any(name.startswith("opt/venv/lib/python3.11/site-packages/paddle/") and ".so" in name for name in prioritized)
    assert any(name.startswith("usr/lib/x86_64-linux-gnu/libc.so") for name in prioritized)
    log = tmp_path / "work" / next(layer["log"] for layer in json.loads((tmp_path / "work" / "build-report.json")
                                                                         .read_text())["layers"]
                                   if layer["path"] == "release/paddle3.3.1-cpu-py3.11-debian12")
    assert "the health check) read" in log.read_text() and "before the prefetch landmark" in log.read_text()
