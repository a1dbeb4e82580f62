"""rescan and quarantine, end to end: the signed example behind channel tags in the three local
regions, a vulnerability DB that learns of a new advisory, and a rollout that then refuses.

The example's two images differ in one package: the CPU variant has `paddlepaddle`, the GPU
variant `paddlepaddle-gpu`. The news is a (made-up, fixable) CRITICAL advisory against
`paddlepaddle`: only the CPU image must be quarantined.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ..conftest import REPO_ROOT
from .conftest import EXAMPLE_POLICY, REGIONS, STAGING, imagebuild, require_registry, unique
from .tools import KEYS

NEWS = {"ecosystem": "pypi", "id": "CVE-2099-41001", "package": "paddlepaddle", "vulnerable": ["<99.0"],
        "patched": ["99.0"], "severity": "CRITICAL", "title": "paddlepaddle: an advisory published after the release",
        "description": "A test advisory: every paddlepaddle before 99.0 is affected.",
        "published": "2026-11-30T00:00:00Z"}


@pytest.fixture(scope="module")
def deployed(signed_example, tmp_path_factory) -> dict:
    """A release of its own (regions, state repository), each example image rolled out to its channel."""
    for host in REGIONS.values():
        require_registry(host, "region registry")
    folder = tmp_path_factory.mktemp("quarantine")
    name = unique("quarantine")
    (folder / "trust.yaml").write_text(textwrap.dedent(f"""\
        schema: 1
        mode: enforce
        keys: [{{name: imagebuild-local, path: {KEYS / 'cosign.pub'}}}]
        images: ["127.0.0.1:*/**"]
        require: {{attestations: [sbom, vuln, smoke, gate], smoke_passed: true, gate_passed: true, block_severity: null}}
        failure_policy: fail
        cache_ttl_seconds: 0
        webhook: {{namespace: imagebuild-system, name: imagebuild-admission, image: "{STAGING}/a/b:c", port: 8443}}
        """))
    regions = "\n".join(f"  - {{name: {region}, registry: '{host}', repository: {name}/paddle}}"
                        for region, host in REGIONS.items())
    release = folder / "release.yaml"
    release.write_text(f"schema: 1\ntrust: trust.yaml\nstate: {{registry: '{STAGING}', repository: {name}/rollouts}}\n"
                       f"lease_ttl: 1m\nregions:\n{regions}\nchannels: [cpu, gpu]\n"
                       "waves:\n  - {name: canary, regions: [eu-west], gates: {soak: 1s, signature: true}}\n"
                       "  - {name: rest, regions: [us-east, ap-south], gates: {soak: 1s, signature: true}}\n")
    images = {v["device"]: v["image"] for v in signed_example.report["variants"]}
    for channel, image in images.items():
        started = rollout_start(release, folder, image, channel)
        assert started.returncode == 0, f"rollout of {image} failed:\n{started.stderr[-3000:]}"
    return {"release": release, "folder": folder, "images": images,
            "digests": {device: image.split("@", 1)[1] for device, image in images.items()}}


def rollout_start(release: Path, folder: Path, image: str, channel: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imagebuild", "rollout", "start", "--release", str(release),
                           "--image", image, "--channel", channel, "--state-dir", str(folder / "state")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def rescan(deployed: dict, cache_dir: Path, *args: str):
    return imagebuild("rescan", "--release", str(deployed["release"]), "--policy", str(EXAMPLE_POLICY), "--offline",
                      "--cache-dir", str(cache_dir), "--out", str(deployed["folder"] / "rescan"),
                      "--state-dir", str(deployed["folder"] / "state"), *args, timeout=1800)


def quarantined(deployed: dict) -> list[dict]:
    listed = imagebuild("quarantine", "--release", str(deployed["release"]), "--format", "json")
    assert listed.returncode == 0, listed.stderr
    return listed.json()["quarantined"]


@pytest.fixture(scope="module")
def news_db(scanned_example, tmp_path_factory) -> Path:
    """The session's Trivy cache (its layers analysed already), with a DB that knows of NEWS."""
    import shutil

    from .trivydb import FixtureError, build_fixture_db

    cache = tmp_path_factory.mktemp("trivy-news") / "cache"
    shutil.copytree(scanned_example.cache_dir, cache)
    try:
        return build_fixture_db(cache, extra=[NEWS])
    except FixtureError as exc:
        pytest.fail(str(exc), pytrace=False)


def test_with_yesterdays_db_every_image_behind_a_channel_passes_and_nothing_is_quarantined(deployed, scanned_example):
    run = rescan(deployed, scanned_example.cache_dir, "--format", "json")
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.json()
    assert {i["digest"] for i in result["images"]} == set(deployed["digests"].values()), "each digest once"
    for image in result["images"]:
        assert image["status"] == "passed"
        assert len(image["tags"]) == len(REGIONS), "the same digest behind its channel in every region"
    assert quarantined(deployed) == []


def test_a_new_advisory_quarantines_the_image_with_the_package_and_rollout_start_refuses_it(deployed, news_db):
    cpu, gpu = deployed["digests"]["cpu"], deployed["digests"]["gpu"]
    run = rescan(deployed, news_db, "--format", "json")
    assert run.returncode == 1, (run.stdout[-2000:], run.stderr[-2000:])
    by_digest = {i["digest"]: i for i in run.json()["images"]}
    assert by_digest[cpu]["status"] == "quarantined"
    assert [b["id"] for b in by_digest[cpu]["blocking"]] == [NEWS["id"]]
    assert by_digest[cpu]["blocking"][0]["package"] == "paddlepaddle"
    assert by_digest[gpu]["status"] == "passed", "paddlepaddle-gpu is another package"
    assert run.json()["quarantined"] == [cpu]

    marks = quarantined(deployed)
    assert [m["digest"] for m in marks] == [cpu]
    assert marks[0]["source"] == "rescan" and NEWS["id"] in marks[0]["reason"]
    audit = [json.loads(line) for line in (deployed["folder"] / "state" / "audit.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "quarantine" and e.get("digest") == cpu for e in audit)

    refused = rollout_start(deployed["release"], deployed["folder"], deployed["images"]["cpu"], "cpu")
    assert refused.returncode == 1, refused.stderr
    assert "quarantined" in refused.stderr and NEWS["id"] in refused.stderr

    table = rescan(deployed, news_db)
    assert table.returncode == 1
    line = next(line for line in table.stdout.splitlines() if cpu in line)
    assert line.startswith("STILL-QUARANTINED") and NEWS["id"] in line


def test_a_quarantine_by_hand_blocks_and_clearing_it_lets_the_rollout_go(deployed):
    gpu_image = deployed["images"]["gpu"]
    marked = imagebuild("quarantine", gpu_image, "--release", str(deployed["release"]), "--reason", "suspected leak",
                        "--state-dir", str(deployed["folder"] / "state"))
    assert marked.returncode == 0, marked.stderr
    refused = rollout_start(deployed["release"], deployed["folder"], gpu_image, "gpu")
    assert refused.returncode == 1 and "suspected leak" in refused.stderr

    cleared = imagebuild("quarantine", gpu_image, "--release", str(deployed["release"]), "--clear",
                         "--state-dir", str(deployed["folder"] / "state"))
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    assert deployed["digests"]["gpu"] not in [m["digest"] for m in quarantined(deployed)]
    again = rollout_start(deployed["release"], deployed["folder"], gpu_image, "gpu")
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.parametrize(("args", "message"), [
    ([], "--reason: missing"),
    (["--reason", "x", "--clear"], "--reason: is for quarantining"),
])
def test_quarantine_bad_input_is_one_line_exit_2(tmp_path, args, message):
    release = REPO_ROOT / "examples" / "local" / "release.yaml"
    run = imagebuild("quarantine", f"{STAGING}/x/y@sha256:{'0' * 64}", "--release", str(release), *args)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_a_region_that_cannot_be_reached_is_named_and_the_rescan_exits_3(trivy_db, tmp_path):
    """What an unreachable region serves was not judged: the nightly job must not read that as 'all clear'."""
    (tmp_path / "trust.yaml").write_text((REPO_ROOT / "examples" / "local" / "rollout-trust.yaml").read_text())
    release = tmp_path / "release.yaml"
    release.write_text(f"schema: 1\ntrust: trust.yaml\nstate: {{registry: '{STAGING}', repository: "
                       f"{unique('quarantine')}/rollouts}}\nregions:\n"
                       "  - {name: gone, registry: '127.0.0.1:9', repository: x/paddle}\n"
                       "channels: [cpu]\nwaves:\n  - {name: all, regions: [gone], gates: {soak: 1s}}\n")
    run = imagebuild("rescan", "--release", str(release), "--policy", str(EXAMPLE_POLICY), "--offline",
                     "--cache-dir", str(trivy_db), "--out", str(tmp_path / "rescan"), "--state-dir",
                     str(tmp_path / "state"), "--format", "json")
    assert run.returncode == 3, (run.stdout, run.stderr)
    assert list(run.json()["unreachable"]) == ["gone"]
    assert run.json()["images"] == []
