"""`imagebuild gc` against real Distribution registries, real cosign signatures and real rollouts.

A release is rolled out a few times; what the rollouts replaced is then dead weight in every region.
gc keeps every channel tag, the latest rollout's rollback targets, the kept releases and quarantined
digests with everything that hangs off them, deletes the rest by digest, and compacts the state
repository. The registry's own garbage collection then frees exactly the bytes the dry run promised.
Stopped at any deletion (in-process, and by a real SIGKILL), gc leaves every tag on a manifest that
exists, and a rerun finishes; while a rollout holds a channel it refuses, and a rollout waits for it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from imagebuild.config.release_file import load_release
from imagebuild.config.trust import load_trust_config
from imagebuild.oci.client import Registry
from imagebuild.retention import gc
from imagebuild.retention.state import Retention
from imagebuild.rollout import quarantine
from imagebuild.rollout.lease import RegistryLease
from imagebuild.rollout.reconciler import Timing
from imagebuild.rollout.state import open_store
from imagebuild.trust.verify import Verifier

from ..conftest import REPO_ROOT
from .conftest import STAGING
from .rollout_harness import free_port
from .test_rollout import Setup, registries_up, rollout_id_of  # noqa: F401 - registries_up: the same autouse check
from .tools import Cosign, bootstrap_key, crane, push_tiny_image, tool

ONE_WAVE = """\
- name: all
  regions: [eu-west, us-east]
  gates: {signature: true}
"""


class OwnRegistry:
    """A Distribution registry of the test's own (its storage measured, restarted read-only or stopped)."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = folder / "storage"
        self.config = folder / "config.yml"
        self.process: subprocess.Popen | None = None

    def start(self, readonly: bool = False) -> OwnRegistry:
        self.config.write_text(textwrap.dedent(f"""\
            version: 0.1
            log: {{level: error, accesslog: {{disabled: true}}}}
            storage:
              filesystem: {{rootdirectory: {self.storage}}}
              delete: {{enabled: true}}
              maintenance: {{readonly: {{enabled: {str(readonly).lower()}}}}}
            http: {{addr: '{self.host}'}}
            """))
        self.process = subprocess.Popen(["docker-registry", "serve", str(self.config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        pytest.fail(f"the registry on {self.host} did not start", pytrace=False)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def blob_bytes(self) -> int:
        return gc.storage_bytes(self.storage)[1]


@pytest.fixture
def own_registries(tmp_path):
    registries = {name: OwnRegistry(tmp_path / name).start() for name in ("eu-west", "us-east")}
    yield registries
    for registry in registries.values():
        registry.stop()


def imagebuild_gc(setup: Setup, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imagebuild", "gc", "--release", str(setup.release), "--settle-s",
                           "0.2", "--state-dir", str(setup.state_dir), *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


def seed(setup: Setup, tag: str = "stable", size: int = 300_000) -> dict[str, str]:
    """A signed image of `size` random bytes serving `tag` in every region: what the first rollout replaces."""
    found = {}
    for region, host in setup.regions.items():
        ref = f"{host}/{setup.repository}:{tag}"
        found[region] = push_tiny_image(setup.tmp_path / "seed" / region, ref, size=size)
        Cosign(tool("cosign")).sign(f"{host}/{setup.repository}@{found[region]}", bootstrap_key())
    return found


def roll_out(setup: Setup, times: int) -> tuple[list[str], list[str]]:
    """`times` signed images rolled out to `stable`, one after the other: (their digests, the rollout IDs)."""
    digests, ids = [], []
    for n in range(times):
        image = setup.source(f"c{n}")
        run = setup.start(image)
        assert run.returncode == 0, run.stderr
        digests.append(image.split("@")[1])
        ids.append(rollout_id_of(run))
    return digests, ids


def every_tag_resolves(setup: Setup) -> dict[str, dict[str, str]]:
    """region -> tag -> digest, failing when any tag names a manifest the registry does not serve."""
    found: dict[str, dict[str, str]] = {}
    for region, host in setup.regions.items():
        with Registry(host) as registry:
            found[region] = {}
            for tag in sorted(registry.list_tags(setup.repository)):
                digest = registry.head_manifest(setup.repository, tag)
                assert digest is not None, f"{region}: tag {tag} names nothing"
                assert registry.get_manifest(setup.repository, digest)[2] == digest
                found[region][tag] = digest
    return found


def verifies(setup: Setup, region: str, digest: str) -> bool:
    with Verifier(load_trust_config(setup.tmp_path / "trust.yaml"), cache_ttl_seconds=0) as verifier:
        return verifier.verify(f"{setup.regions[region]}/{setup.repository}@{digest}").allowed


def state_tags(setup: Setup) -> set[str]:
    with Registry(STAGING) as registry:
        return registry.list_tags(f"{setup.name}/rollouts")


def test_gc_deletes_what_rollouts_replaced_keeps_every_channel_and_rollback_and_frees_what_it_promised(
        tmp_path, own_registries):
    setup = Setup(tmp_path)
    setup.regions = {name: registry.host for name, registry in own_registries.items()}
    setup.write(ONE_WAVE)
    seeded = seed(setup)
    (c0, c1, c2), ids = roll_out(setup, 3)
    store = open_store(load_release(setup.release))
    try:
        quarantine.mark(store, c0, "CVE-2026-0001 in libfoo", source="manual")
    finally:
        store.registry.close()
    before = every_tag_resolves(setup)

    dry = imagebuild_gc(setup, "--keep-releases", "1", "--record-retention", "0s", "--format", "json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["mode"] == "dry-run" and plan["deleted"] == []
    assert every_tag_resolves(setup) == before  # a dry run changes nothing
    for region in plan["regions"]:
        name = region["region"]
        dead = [entry["digest"] for entry in region["dead"]]
        assert dead[0] == seeded[name], "the replaced seed goes first, before its signature"
        assert len(dead) == 2 and region["dead"][1]["tags"] == [seeded[name].replace(":", "-") + ".sig"]
        kept = {entry["digest"]: entry["why"] for entry in region["kept"]}
        assert kept[c2] == "tag stable"
        assert kept[c1].startswith("rollback target of latest rollout of stable")
        assert kept[c0] == "quarantined: CVE-2026-0001 in libfoo"
    assert plan["state"]["compacted_records"] == [ids[1], ids[0]]
    promised = {entry["registry"]: entry["bytes"] for entry in plan["registries"]}
    assert all(size > 300_000 for size in promised.values())  # the seed's layer, at least

    applied = imagebuild_gc(setup, "--keep-releases", "1", "--record-retention", "0s", "--apply", "--format", "json")
    assert applied.returncode == 0, applied.stderr
    report = json.loads(applied.stdout)
    assert [e["digest"] for e in report["deleted"] if "region" in e] == [
        d["digest"] for region in plan["regions"] for d in region["dead"]]
    after = every_tag_resolves(setup)
    for name in setup.regions:
        assert set(before[name]) - set(after[name]) == {seeded[name].replace(":", "-") + ".sig"}
        assert after[name]["stable"] == c2
        for digest in (c2, c1, c0):
            assert verifies(setup, name, digest), f"{name}: {digest} no longer verifies"
        assert not setup.has(name, seeded[name])
    assert not {f"rollout-{ids[0]}", f"rollout-{ids[1]}"} & state_tags(setup)
    assert f"rollout-{ids[2]}" in state_tags(setup)
    archived = json.loads((setup.state_dir / "gc-archive" / f"{ids[0]}.json").read_text())
    assert archived["id"] == ids[0] and archived["events"], "the audit trail of a compacted record is kept locally"
    assert "lease-stable" not in state_tags(setup), "gc released the lease it held"
    audit = [json.loads(line) for line in (setup.state_dir / "audit.jsonl").read_text().splitlines()]
    assert sum(1 for entry in audit if entry.get("event") == "gc-delete") == len(report["deleted"])

    # The sweep: refused while the registry takes uploads; read-only, or stopped, it frees what was promised.
    eu, us = own_registries["eu-west"], own_registries["us-east"]
    refused = imagebuild_gc(setup, "sweep", "--config", str(eu.config))
    assert refused.returncode == 1 and "accepts uploads" in refused.stderr
    eu_before, us_before = eu.blob_bytes(), us.blob_bytes()
    eu.stop()
    eu.start(readonly=True)
    us.stop()
    for registry, was in ((eu, eu_before), (us, us_before)):
        swept = imagebuild_gc(setup, "--format", "json", "sweep", "--config", str(registry.config))
        assert swept.returncode == 0, swept.stderr
        result = json.loads(swept.stdout)
        assert result["bytes_before"] == was
        assert result["freed_bytes"] == was - registry.blob_bytes() == promised[registry.host]
    eu.stop()
    eu.start()
    us.start()
    for name in setup.regions:
        for digest in (c2, c1, c0):
            assert verifies(setup, name, digest)
        crane("pull", f"{setup.regions[name]}/{setup.repository}@{c1}", str(tmp_path / f"{name}.tar"))
    rolled_back = setup.cli("rollback", ids[2])
    assert rolled_back.returncode == 0, rolled_back.stderr
    assert setup.tag("eu-west", "stable") == setup.tag("us-east", "stable") == c1


class Died(BaseException):
    """A gc stopped part-way (BaseException: nothing of gc's catches it, as nothing catches SIGKILL)."""


def test_a_gc_stopped_at_every_deletion_leaves_every_tag_on_a_manifest_and_reruns_finish(tmp_path):
    setup = Setup(tmp_path)
    setup.write(ONE_WAVE.replace("[eu-west, us-east]", "[eu-west, us-east, ap-south]"))
    seeded = seed(setup, size=1024)
    (c0, c1), ids = roll_out(setup, 2)
    config = load_release(setup.release)

    def options(stop_at: int | None) -> gc.GcOptions:
        count = {"n": 0}

        def before_delete(entry: dict) -> None:
            count["n"] += 1
            if count["n"] == stop_at:
                raise Died(entry["digest"])

        return gc.GcOptions(retention=Retention(keep_releases=1, record_retention_s=0), apply=True,
                            state_dir=setup.state_dir, timing=Timing(settle_s=0.1), before_delete=before_delete)

    planned, _ = gc.collect_garbage(config, gc.GcOptions(retention=Retention(1, 0)))
    expected = sum(len(c.dead) for c in planned.collections.values()) + len(planned.judgement.compacted_records)
    assert expected == 7  # each region's seed and its signature; the first rollout's record
    stops = 0
    while True:
        try:
            gc.collect_garbage(config, options(stop_at=2))  # each run deletes one thing, then stops
        except Died:
            stops += 1
            every_tag_resolves(setup)
            assert setup.serving_unsigned() == []
            assert stops <= expected
            continue
        break
    assert stops == expected - 1  # the last run had one deletion left and finished
    tags = every_tag_resolves(setup)
    for region in setup.regions:
        assert tags[region]["stable"] == c1 and verifies(setup, region, c0) and not setup.has(region, seeded[region])
    assert f"rollout-{ids[0]}" not in state_tags(setup)
    again, run = gc.collect_garbage(config, options(stop_at=None))
    assert run.deleted == [] and all(not c.dead for c in again.collections.values())

    # A real SIGKILL mid-deletion: the lease stays behind, a rollout is refused, and gc run again takes it over.
    for region, host in setup.regions.items():
        push_tiny_image(setup.tmp_path / "extra" / region, f"{host}/{setup.repository}:scratch")
    digests, _ = roll_out(setup, 1)
    killer = textwrap.dedent(f"""\
        import os, signal
        from pathlib import Path
        from imagebuild.config.release_file import load_release
        from imagebuild.retention import gc
        from imagebuild.retention.state import Retention
        from imagebuild.rollout.reconciler import Timing
        seen = []
        def before_delete(entry):
            seen.append(entry)
            if len(seen) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        gc.collect_garbage(load_release(Path({str(setup.release)!r})), gc.GcOptions(
            retention=Retention(1, 0), apply=True, state_dir=Path({str(setup.state_dir)!r}), timing=Timing(settle_s=0.1),
            before_delete=before_delete))
        """)
    killed = subprocess.run([sys.executable, "-c", killer], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    every_tag_resolves(setup)
    blocked = setup.start(setup.source("blocked"))
    assert blocked.returncode == 4 and "rollout gc" in blocked.stderr, blocked.stderr
    rerun = imagebuild_gc(setup, "--keep-releases", "1", "--record-retention", "0s", "--apply", "--format", "json")
    assert rerun.returncode == 0, rerun.stderr
    tags = every_tag_resolves(setup)
    for region in setup.regions:
        assert tags[region]["stable"] == digests[0] and "scratch" in tags[region]
        assert verifies(setup, region, c1) and not setup.has(region, c0)


def test_gc_refuses_while_a_rollout_holds_a_channel_and_deletes_nothing(tmp_path):
    setup = Setup(tmp_path)
    setup.write(ONE_WAVE)
    seed(setup, size=1024)
    roll_out(setup, 2)  # the seed is then no rollback target: dead
    config = load_release(setup.release)
    store = open_store(config)
    lease = RegistryLease(store, ("stable",), "someone-elses-rollout", 60.0, 0.0, time.sleep, time.time)
    lease.acquire()
    try:
        before = every_tag_resolves(setup)
        refused = imagebuild_gc(setup, "--apply", "--keep-releases", "1", "--record-retention", "0s")
        assert refused.returncode == 4, refused.stderr
        assert "someone-elses-rollout" in refused.stderr
        assert every_tag_resolves(setup) == before
        dry = imagebuild_gc(setup, "--keep-releases", "1", "--format", "json")
        assert dry.returncode == 0 and json.loads(dry.stdout)["regions"][0]["dead"], "a dry run takes no lease"
        table = imagebuild_gc(setup, "--keep-releases", "1")
        assert table.returncode == 0 and "dry run: nothing was deleted" in table.stdout
        assert "eu-west" in table.stdout and "`gc sweep` then frees at most" in table.stdout
    finally:
        lease.release()
        store.registry.close()
