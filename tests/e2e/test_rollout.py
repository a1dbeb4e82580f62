"""`imagebuild rollout` end to end: the staging registry, the three regional registries, cosign
signatures, a real Prometheus and health endpoint (rollout_harness), a crash at every step (in
process) and real SIGKILLs, a registry outage and two rollouts racing for one channel.

Every test works in repositories of its own (rollout-e2e/<uuid>/...), so tests never see each
other's tags; images are small (`crane append` of one file) and signed with bootstrap's key.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from imagebuild.config.release_file import load_release
from imagebuild.config.trust import load_trust_config
from imagebuild.oci.client import Registry
from imagebuild.rollout import reconciler as rollout
from imagebuild.rollout.plan import Step
from imagebuild.rollout.reconciler import Runtime, StepPhase, Timing
from imagebuild.trust.verify import Verifier

from ..conftest import REPO_ROOT
from .conftest import REGIONS, STAGING, require_registry
from .rollout_harness import free_port, unique_metric
from .tools import KEYS, Cosign, bootstrap_key, push_tiny_image, tool


@pytest.fixture(scope="module", autouse=True)
def registries_up():
    for host in [STAGING, *REGIONS.values()]:
        require_registry(host)
    bootstrap_key()  # fails, saying how to make it, without bootstrap's key pair


def make_image(tmp_path: Path, registry: str, repository: str, tag: str, *, sign: bool = True) -> str:
    """A one-file image pushed with crane (unique content, so a unique digest), signed with cosign; its digest."""
    digest = push_tiny_image(tmp_path, f"{registry}/{repository}:{tag}")
    if sign:
        Cosign(tool("cosign")).sign(f"{registry}/{repository}@{digest}", bootstrap_key())
    return digest


@dataclass
class Setup:
    """One test's release: its repositories, files, and ways to run the CLI and look at the registries."""

    tmp_path: Path
    name: str = field(default_factory=lambda: f"rollout-e2e/{uuid.uuid4().hex[:10]}")
    regions: dict[str, str] = field(default_factory=lambda: dict(REGIONS))

    @property
    def repository(self) -> str:
        return f"{self.name}/paddle"

    @property
    def release(self) -> Path:
        return self.tmp_path / "release.yaml"

    @property
    def state_dir(self) -> Path:
        return self.tmp_path / "state"

    def write(self, waves: str, channels: str = '[stable, "2.6-gpu"]', lease_ttl: str = "1m",
              attestations: str = "[]", region_keys: dict[str, str] | None = None) -> None:
        """release.yaml and its trust file; `region_keys` adds flow-style keys to a region (`prepull: {...}`)."""
        (self.tmp_path / "trust.yaml").write_text(textwrap.dedent(f"""\
            schema: 1
            mode: enforce
            keys: [{{name: imagebuild-local, path: {KEYS / 'cosign.pub'}}}]
            images: ["127.0.0.1:*/**"]
            require: {{attestations: {attestations}, smoke_passed: {str(attestations != '[]').lower()},
                      gate_passed: {str(attestations != '[]').lower()}, block_severity: null}}
            failure_policy: fail
            cache_ttl_seconds: 0
            webhook: {{namespace: imagebuild-system, name: imagebuild-admission, image: "{STAGING}/a/b:c", port: 8443}}
            """))
        extra = region_keys or {}
        regions = "\n".join(f"  - {{name: {name}, registry: '{host}', repository: {self.repository}"
                            f"{', ' + extra[name] if name in extra else ''}}}"
                            for name, host in self.regions.items())
        self.release.write_text(f"schema: 1\ntrust: trust.yaml\n"
                                f"state: {{registry: '{STAGING}', repository: {self.name}/rollouts}}\n"
                                f"lease_ttl: {lease_ttl}\nregions:\n{regions}\nchannels: {channels}\n"
                                f"waves:\n{textwrap.indent(textwrap.dedent(waves), '  ')}")

    def source(self, tag: str = "candidate", *, sign: bool = True) -> str:
        digest = make_image(self.tmp_path, STAGING, self.repository, tag, sign=sign)
        return f"{STAGING}/{self.repository}@{digest}"

    def seed(self, tag: str) -> dict[str, str]:
        """A signed image already serving `tag` in every region (what a rollout replaces); region -> digest."""
        return {region: make_image(self.tmp_path, host, self.repository, tag) for region, host in self.regions.items()}

    def argv(self, *args: str, kill_at: str | None = None, real: bool = False, lease_ahead_s: float = 0.0) -> list[str]:
        """`python -m imagebuild` (its own waits) or tests/e2e/rollout_cli.py: short waits, a SIGKILL at kill_at,
        leases read `lease_ahead_s` seconds in the future."""
        kill = ["--kill-at", kill_at] if kill_at else []
        ahead = ["--lease-clock-ahead-s", str(lease_ahead_s)] if lease_ahead_s else []
        entry = ["imagebuild"] if real else ["tests.e2e.rollout_cli", *FAST, *kill, *ahead]
        return [sys.executable, "-m", *entry, "rollout", *args, "--release", str(self.release),
                *(["--state-dir", str(self.state_dir)] if args[0] != "status" else [])]

    def cli(self, *args: str, kill_at: str | None = None, real: bool = False, lease_ahead_s: float = 0.0,
            timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args, kill_at=kill_at, real=real, lease_ahead_s=lease_ahead_s), cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout, env=dict(os.environ))

    def popen(self, *args: str, real: bool = False) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args, real=real), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ))

    def start(self, image: str, *channels: str, kill_at: str | None = None, real: bool = False,
              lease_ahead_s: float = 0.0) -> subprocess.CompletedProcess:
        return self.cli("start", "--image", image, *[arg for c in channels or ("stable",) for arg in ("--channel", c)],
                        kill_at=kill_at, real=real, lease_ahead_s=lease_ahead_s)

    def tag(self, region: str, tag: str) -> str | None:
        with Registry(self.regions[region]) as registry:
            return registry.head_manifest(self.repository, tag)

    def has(self, region: str, digest: str) -> bool:
        with Registry(self.regions[region]) as registry:
            return registry.head_manifest(self.repository, digest) is not None

    def status(self, rollout_id: str) -> dict:
        run = self.cli("status", rollout_id, "--format", "json")
        assert run.returncode in (0, 1), run.stderr
        return json.loads(run.stdout)

    def record(self, rollout_id: str) -> dict:
        from imagebuild.config.release_file import load_release
        from imagebuild.rollout.reconciler import load_record
        from imagebuild.rollout.state import open_store

        config = load_release(self.release)
        return load_record(open_store(config), rollout_id, config)

    def audit(self) -> list[dict]:
        return [json.loads(line) for line in (self.state_dir / "audit.jsonl").read_text().splitlines()]

    def serving_unsigned(self, tags: tuple[str, ...] = ("stable",)) -> list[str]:
        """Every region/tag that exists but does not verify (unsigned, or its digest missing) in its registry."""
        bad = []
        with Verifier(load_trust_config(self.tmp_path / "trust.yaml"), cache_ttl_seconds=0) as verifier:
            for region, host in self.regions.items():
                for tag in tags:
                    if self.tag(region, tag) is None:
                        continue
                    verdict = verifier.verify(f"{host}/{self.repository}:{tag}")
                    if not verdict.allowed:
                        bad.append(f"{region}/{tag}: {verdict.reason}")
        return bad


# Short waits so the tests stay quick: the lease's settle delay and the backoff before a region's retries.
FAST = ["--settle-s", "0.5", "--retry-base-s", "0.2"]


def rollout_id_of(run: subprocess.CompletedProcess) -> str:
    for line in run.stderr.splitlines():
        if line.startswith("rollout ") and ": " in line:
            return line.split()[1].rstrip(":")
    raise AssertionError(f"no rollout ID in:\n{run.stderr}")


CANARY_THEN_REST = """\
- name: canary
  regions: [eu-west]
  gates: {soak: 1s, signature: true}
- name: rest
  regions: [us-east, ap-south]
  gates: {soak: 0s, signature: true}
"""


# --- the whole rollout ----------------------------------------------------------------------------------


def test_a_rollout_goes_canary_first_passes_its_gates_then_reaches_the_rest(tmp_path, rollout_services):
    setup = Setup(tmp_path)
    metric = unique_metric()
    services = rollout_services
    services.exporter.set(metric, 0.01, region="eu-west")
    services.prometheus.wait_for_value(f'{metric}{{region="eu-west"}}', 0.01)
    services.health.set("eu-west", 200)
    setup.write(f"""\
        - name: canary
          regions: [eu-west]
          gates:
            soak: 2s
            signature: true
            prometheus: {{url: "{services.prometheus.url}", query: '{metric}{{region="{{region}}"}}', max: 0.05}}
            http: {{url: "{services.health.url}", expect_status: 200, timeout: 5s}}
        - name: rest
          regions: [us-east, ap-south]
          gates: {{soak: 1s, signature: true}}
        """)
    before = setup.seed("stable")
    image = setup.source()
    digest = image.split("@")[1]

    run = setup.start(image, "stable", "2.6-gpu")
    assert run.returncode == 0, run.stderr
    rollout_id = rollout_id_of(run)
    assert "soak" in run.stderr  # progress shown while the canary soaked

    for region in REGIONS:
        assert setup.tag(region, "stable") == digest and setup.tag(region, "2.6-gpu") == digest
    assert setup.serving_unsigned(("stable", "2.6-gpu")) == []

    # The canary's tags moved and its gates (the real Prometheus query included) passed before the rest got a byte.
    events = setup.record(rollout_id)["events"]
    order = [(e["what"], e.get("region") or e.get("wave")) for e in events]
    canary_gates = order.index(("gates", "canary"))
    assert max(i for i, e in enumerate(order) if e == ("move-tag", "eu-west")) < canary_gates
    assert min(i for i, (what, where) in enumerate(order) if where in ("us-east", "ap-south")) > canary_gates
    gates = next(e for e in events if e["what"] == "gates" and e["wave"] == "canary")["gates"]
    assert {g["gate"] for g in gates} == {"soak", "signature", "prometheus", "http"}
    assert all(g["outcome"] == "passed" for g in gates)
    assert order[-1] == ("completed", None)

    # status: per region and tag the live digest and the previous one (none for the new 2.6-gpu tag)
    status = setup.status(rollout_id)
    assert status["status"] == "completed"
    rows = {(r["region"], r["tag"]): r for r in status["tags"]}
    assert {key: (r["current"], r["previous"]) for key, r in rows.items()} == {
        **{(region, "stable"): (digest, before[region]) for region in REGIONS},
        **{(region, "2.6-gpu"): (digest, None) for region in REGIONS}}
    table = setup.cli("status", rollout_id)
    assert table.returncode == 0 and f"rollout {rollout_id}: completed" in table.stdout

    # The audit trail: who, what, from which digest to which; locally and in the state registry alike.
    moves = [e for e in setup.audit() if e["what"] == "move-tag"]
    assert {(e["region"], e["tag"], e["from"] if "from" in e else None, e["to"]) for e in moves} == {
        *((region, "stable", before[region], digest) for region in REGIONS),
        *((region, "2.6-gpu", None, digest) for region in REGIONS)}
    assert all(e["who"]["user"] and e["at"] for e in moves)
    text = (setup.state_dir / "audit.jsonl").read_text()
    assert bootstrap_key().password not in text


def test_an_image_that_does_not_verify_in_staging_is_refused_before_anything_moves(tmp_path):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST)
    image = setup.source(sign=False)
    run = setup.start(image)
    assert run.returncode == 1 and "does not verify in staging" in run.stderr, run.stderr
    with Registry(STAGING) as registry:
        assert registry.list_tags(f"{setup.name}/rollouts") == set()
    assert all(not setup.has(region, image.split("@")[1]) for region in REGIONS)


def push_zstd_image(repository: str, tag: str) -> str:
    """A signed one-layer OCI image whose layer is tar+zstd (what `compression: zstd` pushes); its digest."""
    import io
    import tarfile

    import zstandard

    from imagebuild.oci.compression import OCI_CONFIG, OCI_LAYER_ZSTD, OCI_MANIFEST

    payload, tar = os.urandom(64), io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as archive:
        member = tarfile.TarInfo("payload")
        member.size = len(payload)
        archive.addfile(member, io.BytesIO(payload))
    diff_id = "sha256:" + hashlib.sha256(tar.getvalue()).hexdigest()
    layer = zstandard.ZstdCompressor().compress(tar.getvalue())
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    with Registry(STAGING) as registry:
        layer_digest, config_digest = registry.put_blob(repository, layer), registry.put_blob(repository, config)
        manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                               "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
                               "layers": [{"mediaType": OCI_LAYER_ZSTD, "digest": layer_digest,
                                           "size": len(layer)}]}).encode()
        digest = registry.put_manifest(repository, tag, manifest, OCI_MANIFEST)
    Cosign(tool("cosign")).sign(f"{STAGING}/{repository}@{digest}", bootstrap_key())
    return digest


def test_a_zstd_image_is_refused_before_anything_moves_where_a_region_pulls_gzip_only(tmp_path):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST, region_keys={"ap-south": "compressions: [gzip]"})
    digest = push_zstd_image(setup.repository, "candidate")
    run = setup.start(f"{STAGING}/{setup.repository}@{digest}")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "region ap-south: its engines pull gzip layers (release.yaml compressions), and the image has zstd " \
           "layers" in run.stderr, run.stderr
    with Registry(STAGING) as registry:
        assert registry.list_tags(f"{setup.name}/rollouts") == set(), "no record, no lease"
    assert all(not setup.has(region, digest) for region in REGIONS), "not even the canary got a copy"
    # Where every region's engines read zstd, the same image goes out.
    setup.write(CANARY_THEN_REST, region_keys={"ap-south": "compressions: [gzip, zstd]"})
    run = setup.start(f"{STAGING}/{setup.repository}@{digest}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert all(setup.tag(region, "stable") == digest for region in REGIONS)


# --- halts and rollback ---------------------------------------------------------------------------------


def test_a_failing_gate_halts_leaves_later_regions_untouched_and_rollback_restores(tmp_path, rollout_services):
    setup = Setup(tmp_path)
    metric = unique_metric()
    rollout_services.exporter.set(metric, 0.5, region="eu-west")  # the canary's error ratio is over the threshold
    rollout_services.prometheus.wait_for_value(f'{metric}{{region="eu-west"}}', 0.5)
    setup.write(f"""\
        - name: canary
          regions: [eu-west]
          gates:
            signature: true
            prometheus: {{url: "{rollout_services.prometheus.url}", query: '{metric}{{region="{{region}}"}}', max: 0.05}}
        - name: rest
          regions: [us-east, ap-south]
          gates: {{signature: true}}
        """)
    before = setup.seed("stable")
    image = setup.source()
    digest = image.split("@")[1]

    run = setup.start(image)
    assert run.returncode == 1, run.stderr
    assert "gate prometheus failed in region eu-west" in run.stderr
    rollout_id = rollout_id_of(run)
    assert setup.tag("eu-west", "stable") == digest
    for region in ("us-east", "ap-south"):  # untouched: not even copied
        assert setup.tag(region, "stable") == before[region]
        assert not setup.has(region, digest)
    assert setup.status(rollout_id)["status"] == "halted"

    back = setup.cli("rollback", rollout_id)
    assert back.returncode == 0, back.stderr
    for region in REGIONS:
        assert setup.tag(region, "stable") == before[region]
    record = setup.record(rollout_id)
    assert record["status"] == "rolled-back"
    assert [(e["region"], e["from"], e["to"]) for e in record["events"] if e["what"] == "restore-tag"] == [
        ("eu-west", digest, before["eu-west"])]
    assert setup.cli("rollback", rollout_id).returncode == 0  # again: nothing left to do
    assert setup.tag("eu-west", "stable") == before["eu-west"]


def test_a_signature_missing_in_one_region_halts_before_that_region_tags_move(tmp_path):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST)
    before = setup.seed("stable")
    image = setup.source()
    digest = image.split("@")[1]
    # Stop right after us-east's copy is recorded (step 7: canary is 0-6), then take the signature away there.
    run = setup.start(image, "stable", "2.6-gpu", kill_at="recorded:7")
    assert run.returncode == -signal.SIGKILL, run.stderr
    rollout_id = rollout_id_of(run)
    with Registry(REGIONS["us-east"]) as registry:
        signature = registry.head_manifest(setup.repository, "sha256-" + digest.split(":")[1] + ".sig")
        assert signature and registry.delete_manifest(setup.repository, signature)

    resumed = setup.cli("resume", rollout_id)
    assert resumed.returncode == 1, resumed.stderr
    assert "region us-east" in resumed.stderr and "does not verify" in resumed.stderr
    assert setup.tag("eu-west", "stable") == digest and setup.tag("eu-west", "2.6-gpu") == digest
    assert setup.tag("us-east", "stable") == before["us-east"]
    assert setup.tag("ap-south", "stable") == before["ap-south"]
    assert [setup.tag(region, "2.6-gpu") for region in ("us-east", "ap-south")] == [None, None]
    assert setup.serving_unsigned(("stable", "2.6-gpu")) == []

    assert setup.cli("rollback", rollout_id).returncode == 0
    assert {region: setup.tag(region, "stable") for region in REGIONS} == before
    assert setup.tag("eu-west", "2.6-gpu") is None  # the rollout created it: gone again
    assert setup.serving_unsigned(("stable", "2.6-gpu")) == []


def test_abort_stops_before_the_next_step_and_resume_refuses(tmp_path):
    setup = Setup(tmp_path)
    setup.write("""\
        - name: canary
          regions: [eu-west]
          gates: {signature: true, approval: true}
        - name: rest
          regions: [us-east, ap-south]
        """)
    image = setup.source()
    process = setup.popen("start", "--image", image, "--channel", "stable")
    rollout_id = None
    deadline = time.time() + 120
    while rollout_id is None and time.time() < deadline:
        for path in setup.state_dir.glob("*.json") if setup.state_dir.exists() else []:
            rollout_id = path.stem
        time.sleep(0.2)
    assert rollout_id, "the rollout never recorded itself"
    while setup.record(rollout_id)["waves"]["canary"]["state"] != "gating" and time.time() < deadline:
        time.sleep(0.5)
    assert setup.cli("abort", rollout_id).returncode == 0
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1 and "aborted" in err, err
    assert setup.record(rollout_id)["status"] == "aborted"
    assert setup.tag("us-east", "stable") is None
    refused = setup.cli("resume", rollout_id)
    assert refused.returncode == 1 and "only `rollback` applies" in refused.stderr


def test_approval_gate_waits_for_approve(tmp_path):
    setup = Setup(tmp_path)
    setup.write("""\
        - name: canary
          regions: [eu-west]
          gates: {approval: true}
        - name: rest
          regions: [us-east, ap-south]
        """)
    image = setup.source()
    digest = image.split("@")[1]
    process = setup.popen("start", "--image", image, "--channel", "stable")
    deadline = time.time() + 120
    while setup.tag("eu-west", "stable") != digest and time.time() < deadline:
        time.sleep(0.3)
    time.sleep(2)
    assert setup.tag("us-east", "stable") is None  # held at the canary's approval
    rollout_id = next(setup.state_dir.glob("2*.json")).stem
    waiting = setup.status(rollout_id)  # progress, from the record in the registry
    assert waiting["status"] == "running" and waiting["waves"]["canary"]["state"] == "gating"
    assert [(g["gate"], g["outcome"]) for g in waiting["waves"]["canary"]["gates"]] == [("approval", "waiting")]
    assert "gate canary/approval" in setup.cli("status", rollout_id).stdout
    assert setup.cli("approve", rollout_id, "--wave", "canary").returncode == 0
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert setup.tag("us-east", "stable") == digest
    assert any(e["what"] == "approved" for e in setup.record(rollout_id)["events"])


# --- crashes --------------------------------------------------------------------------------------------


STEPS = 14  # canary: copy, verify, record, move, gates; rest: 2 copies, 2 verifies, 2 records, 2 moves, gates


class Died(BaseException):
    """The process dying at a step hook: a BaseException, so no `except Exception` of the product catches it."""


def died_at(phase: str, index: int) -> str:
    """What Died says: the phase and step it was raised at."""
    return f"died at the {phase} of step {index}"


class FastClock:
    """Wall time plus every wait skipped: soaks, settles and backoffs pass at once, yet the gates see them pass."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def now(self) -> float:
        return time.time() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.skipped += max(seconds, 0.0)


def event_keys(events: list[dict], digest: str, before: dict[str, str | None]) -> list[tuple]:
    """What each event says happened (the digest as `new`, a tag's previous as `old`): equal across like runs."""
    def old(e: dict) -> object:
        return "old" if e["what"] == "move-tag" and e.get("from") == before.get(e.get("region", "")) else e.get("from")

    return [(e["what"], e.get("wave"), e.get("region"), e.get("tag"), old(e), "new" if e.get("to") == digest
             else e.get("to")) for e in events]


def test_a_crash_at_every_step_before_and_after_it_is_recorded_then_resume_ends_as_an_uninterrupted_run(tmp_path):
    """28 rollouts in process, each dying at a step before or after it is recorded, resume to the uninterrupted end."""
    # Died lets the lease go (as any exception does); the real SIGKILL test below covers a dead holder's lease.
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST)
    config = load_release(setup.release)
    clock = FastClock()
    timing = Timing(clock=clock.now, sleep=clock.sleep)  # the product's 2 s settle and 1 s backoff, skipped
    lines: list[str] = []

    def start(image: str, local: Path, hook, dies_at: tuple[str, int] | None) -> str:
        """A rollout started in process, which dies at its hook (at `dies_at`) or runs to the end; its ID."""
        lines.clear()
        if dies_at:
            with pytest.raises(Died, match=f"^{re.escape(died_at(*dies_at))}$"):
                rollout.start(config, image, ("stable",), local, lines.append, Runtime(timing, hook))
        else:
            assert rollout.start(config, image, ("stable",), local, lines.append, Runtime(timing, hook)) == 0
        return next(line.split()[1].rstrip(":") for line in lines if line.startswith("rollout "))

    def audit(local: Path) -> list[dict]:
        return [json.loads(line) for line in (local / "audit.jsonl").read_text().splitlines()]

    # The uninterrupted run, and how many events it had written when each step's effect and record were done.
    written: dict[tuple[int, str], int] = {}
    local = tmp_path / "uninterrupted"

    def count(step: Step, phase: StepPhase) -> None:
        written[step.index, phase] = len(audit(local))

    image = setup.source("candidate-uninterrupted")
    reference = setup.record(start(image, local, count, dies_at=None))
    keys = {"digest": image.split("@")[1], "before": dict.fromkeys(REGIONS)}  # the first rollout: no tag before
    expected = event_keys(reference["events"], **keys)
    assert event_keys(audit(local), **keys) == expected and len(written) == 2 * STEPS
    assert [e for e in expected if e[0] == "move-tag"] == [
        ("move-tag", wave, region, "stable", "old", "new") for wave, region in (
            ("canary", "eu-west"), ("rest", "us-east"), ("rest", "ap-south"))]
    assert expected[0][0] == "start" and expected[-1][0] == "completed"

    for phase in ("effect", "recorded"):
        for index in range(STEPS):
            at = (phase, index)
            image = setup.source(f"candidate-{phase}-{index}")
            digest = image.split("@")[1]
            before = {region: setup.tag(region, "stable") for region in REGIONS}

            def die(step: Step, when: StepPhase, at: tuple = at) -> None:
                if (when, step.index) == at:
                    raise Died(died_at(when, step.index))

            local = tmp_path / f"{phase}-{index}"
            rollout_id = start(image, local, die, dies_at=at)
            assert setup.serving_unsigned() == [], at
            assert rollout.resume(config, rollout_id, local, lines.append, Runtime(timing)) == 0, (at, lines)
            assert setup.serving_unsigned() == [], at
            assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest), at

            record = setup.record(rollout_id)
            assert record["status"] == "completed" and record["next_step"] == STEPS, at
            assert [s["state"] for s in record["steps"]] == ["done"] * STEPS, at
            assert record["previous"] == {f"{region}/stable": before[region] for region in REGIONS}, at
            assert {wave: state["state"] for wave, state in record["waves"].items()} == {
                "canary": "passed", "rest": "passed"}, at
            # The resume starts after the last recorded step: the one in flight (if unrecorded) runs again.
            resumed_from = written[index, "recorded"] if phase == "recorded" else (
                written[index - 1, "recorded"] if index else 1)
            resume = ("resume", None, None, None, None, None)
            keys = {"digest": digest, "before": before}
            assert event_keys(record["events"], **keys) == (expected[:resumed_from] + [resume]
                                                            + expected[resumed_from:]), at
            # Locally the dead run's events stay: the step in flight appears twice, nothing else does.
            assert event_keys(audit(local), **keys) == (expected[:written[index, phase]] + [resume]
                                                        + expected[resumed_from:]), at


def test_real_sigkills_mid_step_after_a_step_and_at_a_random_time_then_resume_completes(tmp_path):
    """The real crash path: SIGKILLed mid-step, after a step and at random; the real CLI resumes at once to the end."""
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST, lease_ttl="1m")  # a resume waiting out the lease would take a minute: it must not
    rng = random.Random(12)
    for kill in ("effect:3", "recorded:11", "random"):
        image = setup.source(f"candidate-{uuid.uuid4().hex[:6]}")
        digest = image.split("@")[1]
        if kill == "random":
            process = setup.popen("start", "--image", image, "--channel", "stable")
            assert process.stderr is not None
            started = ""
            for line in process.stderr:  # the record exists once the rollout names itself: then any time
                if line.startswith("rollout "):
                    started = line
                    break
            time.sleep(rng.uniform(0.0, 3.0))
            process.send_signal(signal.SIGKILL)
            _, err = process.communicate(timeout=60)
            assert started, err
            rollout_id = started.split()[1].rstrip(":")
        else:
            run = setup.start(image, kill_at=kill)
            assert run.returncode == -signal.SIGKILL, (kill, run.stderr)
            rollout_id = rollout_id_of(run)
        assert setup.serving_unsigned() == [], kill

        began = time.time()
        resumed = setup.cli("resume", rollout_id, real=True)
        assert resumed.returncode == 0, (kill, resumed.stderr)
        assert time.time() - began < 50, kill  # took the dead process's lease over, did not wait for it to expire
        assert setup.serving_unsigned() == [], kill
        assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest)
        record = setup.record(rollout_id)
        assert record["status"] == "completed" and record["next_step"] == STEPS
        assert all(s["state"] == "done" for s in record["steps"])
        moves = [(e["region"], e["tag"]) for e in record["events"] if e["what"] == "move-tag"]
        assert sorted(moves) == sorted((region, "stable") for region in REGIONS), (kill, moves)
        if kill == "effect:3":  # the killed run moved the canary's tag; the resume found it moved and said so
            found = [e for e in record["events"] if e["what"] == "move-tag" and e["region"] == "eu-west"]
            assert [e.get("detail") for e in found] == ["found moved (a killed run moved it)"], found


# --- a region down --------------------------------------------------------------------------------------


@pytest.fixture
def throwaway_registry(tmp_path):
    """A Distribution registry of this test's own on a free port, to stop and start (never the shared ones)."""
    port = free_port()
    storage = tmp_path / "registry-storage"
    config = tmp_path / "registry.yml"
    config.write_text(textwrap.dedent(f"""\
        version: 0.1
        log: {{level: error, accesslog: {{disabled: true}}}}
        storage: {{filesystem: {{rootdirectory: {storage}}}, delete: {{enabled: true}}}}
        http: {{addr: 127.0.0.1:{port}}}
        """))

    class Throwaway:
        host = f"127.0.0.1:{port}"
        process: subprocess.Popen | None = None

        def start(self) -> None:
            self.process = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    if httpx.get(f"http://{self.host}/v2/", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    time.sleep(0.2)
            pytest.fail("the throwaway registry did not start", pytrace=False)

        def stop(self) -> None:
            if self.process is not None:
                self.process.terminate()
                self.process.wait(10)
                self.process = None

    registry = Throwaway()
    yield registry
    registry.stop()


def test_a_region_registry_down_halts_naming_it_and_resume_completes_after_it_returns(tmp_path, throwaway_registry):
    setup = Setup(tmp_path)
    setup.regions["ap-south"] = throwaway_registry.host  # down from the start: never started yet
    setup.write(CANARY_THEN_REST)
    image = setup.source()
    digest = image.split("@")[1]

    run = setup.start(image)
    assert run.returncode == 3, run.stderr
    assert f"region ap-south ({throwaway_registry.host}) unreachable" in run.stderr
    assert run.stderr.count("retrying") >= 3
    rollout_id = rollout_id_of(run)
    assert setup.tag("eu-west", "stable") == digest
    assert setup.tag("us-east", "stable") is None  # the wave's tags wait until every region of it has the image
    status = setup.status(rollout_id)
    assert status["status"] == "halted" and "ap-south" in status["reason"]

    throwaway_registry.start()
    resumed = setup.cli("resume", rollout_id)
    assert resumed.returncode == 0, resumed.stderr
    assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest)
    assert setup.serving_unsigned() == []


# --- two rollouts of one channel ------------------------------------------------------------------------


def test_two_concurrent_starts_of_the_same_channel_exactly_one_proceeds(tmp_path):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST)
    first, second = setup.source("one"), setup.source("two")
    # The real CLI: its own 2 s settle delay is what keeps the two apart.
    processes = [setup.popen("start", "--image", image, "--channel", "stable", real=True) for image in (first, second)]
    results = [(p.wait(300), p.stderr.read() if p.stderr else "") for p in processes]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 4], results
    loser = next(err for code, err in results if code == 4)
    assert "channel 'stable'" in loser and "rollout" in loser
    winner = first if results[0][0] == 0 else second
    assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, winner.split("@")[1])
    # The lease is released at the end: the next rollout of the channel starts.
    assert setup.start(second if winner == first else first).returncode == 0


# --- the example image ---------------------------------------------------------------------------------


def test_the_signed_example_rolls_out_with_its_attestations(tmp_path, signed_example):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST, attestations="[sbom, vuln, smoke, gate]")
    # The CPU variant (the smaller copy): repository@digest in staging, signed and attested by `imagebuild sign`.
    variants = json.loads(signed_example.report_path.read_text())["variants"]
    image = next(v["image"] for v in variants if v["device"] == "cpu")
    run = setup.start(image)
    assert run.returncode == 0, run.stderr
    digest = image.split("@")[1]
    assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest)
    with Verifier(load_trust_config(tmp_path / "trust.yaml"), cache_ttl_seconds=0) as verifier:
        for host in REGIONS.values():
            verdict = verifier.verify(f"{host}/{setup.repository}:stable")
            assert verdict.allowed, verdict.reason  # signature and all four attestations copied into each region


def test_a_crashed_rollouts_lease_blocks_another_rollout_until_it_expires(tmp_path):
    setup = Setup(tmp_path)
    setup.write(CANARY_THEN_REST, lease_ttl="60s")
    crashed = setup.start(setup.source("one"), kill_at="recorded:0")
    assert crashed.returncode == -signal.SIGKILL
    other = setup.source("two")
    refused = setup.start(other)
    assert refused.returncode == 4, refused.stderr
    assert f"rollout {rollout_id_of(crashed)}" in refused.stderr and "holds it for another" in refused.stderr
    still_held = setup.start(other, lease_ahead_s=50)  # ten seconds before it expires: still refused
    assert still_held.returncode == 4, still_held.stderr
    proceeded = setup.start(other, lease_ahead_s=61)  # a minute later, as a real clock would be: expired
    assert proceeded.returncode == 0, proceeded.stderr
    assert setup.tag("eu-west", "stable") == other.split("@")[1]
