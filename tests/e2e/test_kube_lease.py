"""The rollout lease as a coordination.k8s.io/v1 Lease in a real kube-apiserver (tests/e2e/kubeapi.py), with a
real state registry (Debian's Distribution) beside it. Nothing is mocked.

What it shows: rollouts started at the same instant (processes released by one barrier, and two
`imagebuild rollout start` commands) get the channel exactly once, the others exit 4 naming the winner;
the resourceVersion is the compare-and-swap (a stale PUT or DELETE is refused by the server); an expired
lease is taken over and a renewal after that fails; a lease with fields that cannot be trusted is refused
saying which; TLS is verified against the kubeconfig's CA; the token never reaches any output or log.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from imagebuild.config.release_file import ReleaseConfig, load_release
from imagebuild.core.errors import ExitCode
from imagebuild.kube.client import KubeConflict
from imagebuild.kube.leases import format_micro_time, lease_body, lease_name
from imagebuild.rollout.lease import ChannelLease, KubernetesLease, kube_client, open_lease
from imagebuild.rollout.state import RECORD_TYPE, LeaseHeld, RolloutError, open_store, record_tag

from ..conftest import REPO_ROOT
from .certs import Authority
from .oci_servers import start_distribution
from .tools import KEYS, Cosign, bootstrap_key, push_tiny_image, tool

HOLDER_ID = "20260101t000000-0ld0ne"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """One Distribution registry on loopback: staging, the state repository and the region, by repository."""
    running = start_distribution(tmp_path_factory.mktemp("lease-registry"))
    yield running.host
    running.stop()


@dataclass
class Release:
    path: Path
    namespace: str
    registry: str
    name: str
    cluster: object

    @property
    def config(self) -> ReleaseConfig:
        return load_release(self.path)

    def lease(self, rollout_id: str, channels: tuple[str, ...] = ("stable",), ahead_s: float = 0.0) -> ChannelLease:
        return open_lease(self.config, open_store(self.config), channels, rollout_id, settle_s=0.0, sleep=time.sleep,
                          clock=lambda: time.time() + ahead_s)

    def get(self, channel: str = "stable") -> dict | None:
        run = self.cluster.kubectl("-n", self.namespace, "get", "lease", lease_name(channel), "-o", "json",
                                   check=False)
        if "NotFound" in run.stderr:
            return None
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    def put(self, spec: dict, channel: str = "stable", annotations: dict | None = None) -> None:
        """A Lease written by someone else (kubectl), as it would be found."""
        self.cluster.apply({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                            "metadata": {"name": lease_name(channel), "namespace": self.namespace,
                                         "annotations": annotations or {}}, "spec": spec})

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tests.e2e.rollout_cli", "--settle-s", "0.5", "--retry-base-s", "0.2",
                "rollout", *args, "--release", str(self.path)]


def write_release(tmp_path: Path, registry: str, kubeconfig: Path, namespace: str, waves: str = "") -> Path:
    name = f"lease-e2e/{uuid.uuid4().hex[:10]}"
    (tmp_path / "trust.yaml").write_text(textwrap.dedent(f"""\
        schema: 1
        mode: enforce
        keys: [{{name: imagebuild-local, path: {KEYS / 'cosign.pub'}}}]
        images: ["127.0.0.1:*/**"]
        require: {{attestations: [], smoke_passed: false, gate_passed: false, block_severity: null}}
        failure_policy: fail
        cache_ttl_seconds: 0
        webhook: {{namespace: imagebuild-system, name: imagebuild-admission, image: "{registry}/a/b:c", port: 8443}}
        """))
    path = tmp_path / "release.yaml"
    path.write_text(textwrap.dedent(f"""\
        schema: 1
        trust: trust.yaml
        state: {{registry: '{registry}', repository: {name}/rollouts}}
        lease_ttl: 1m
        lease: {{kubeconfig: '{kubeconfig}', namespace: {namespace}}}
        regions:
          - {{name: eu-west, registry: '{registry}', repository: {name}/paddle}}
        channels: [stable, "2.6-gpu"]
        waves:
        """) + (waves or "  - {name: canary, regions: [eu-west], gates: {approval: true}}\n"))
    return path


@pytest.fixture
def release(tmp_path, registry, kube_cluster) -> Release:
    namespace = kube_cluster.namespace(f"lease-{uuid.uuid4().hex[:8]}")
    path = write_release(tmp_path, registry, kube_cluster.kubeconfig, namespace)
    return Release(path, namespace, registry, load_release(path).state_repository.rsplit("/", 1)[0], kube_cluster)


def signed_image(tmp_path: Path, release: Release) -> str:
    ref = f"{release.registry}/{release.name}/paddle:candidate-{uuid.uuid4().hex[:6]}"
    digest = push_tiny_image(tmp_path, ref)
    Cosign(tool("cosign")).sign(f"{release.registry}/{release.name}/paddle@{digest}", bootstrap_key())
    return f"{release.registry}/{release.name}/paddle@{digest}"


# --- rollouts starting at the same instant -------------------------------------------------------


def contender(release_path: str, rollout_id: str, rounds: list[tuple[list[str], bool]], barrier, results) -> None:
    """One process racing for the channels of each round: every contender is let go by the same barrier."""
    config = load_release(Path(release_path))
    store = open_store(config)
    for channels, _ in rounds:
        lease = open_lease(config, store, tuple(channels), rollout_id, settle_s=0.0, sleep=time.sleep,
                           clock=time.time)
        lease.holder()  # connected (TLS handshake done) before the start
        barrier.wait()
        try:
            lease.acquire()
            results.put((rollout_id, "won", 0))
        except LeaseHeld as exc:
            results.put((rollout_id, str(exc), int(exc.exit_code)))
        barrier.wait()  # every contender has tried; the test looks at the Lease objects
        barrier.wait()
        lease.release()
        lease.close()
        barrier.wait()  # released: the next round starts from no lease at all


EXPIRED = {"holderIdentity": f"{HOLDER_ID}/0123456789abcdef", "leaseDurationSeconds": 30, "leaseTransitions": 7,
           "renewTime": "2020-01-01T00:00:00.000000Z"}


def test_rollouts_started_at_the_same_instant_get_the_channels_exactly_once(release):
    """Each round, four processes acquire at once: from no lease (all POST) or from an expired one (all PUT
    on the resourceVersion they read). Exactly one wins every channel of the round; the others exit 4
    naming it, and an expired lease changes hands exactly once (leaseTransitions goes up by one)."""
    contenders = 4
    rounds = [(["stable", "2.6-gpu"], False)] * 3 + [(["stable", "2.6-gpu"], True)] * 3 + [(["stable"], False)]
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(contenders + 1, timeout=120), spawn.Queue()
    ids = [f"20260101t00000{i}-race{i:02d}" for i in range(contenders)]
    processes = [spawn.Process(target=contender, args=(str(release.path), rollout_id, rounds, barrier, results))
                 for rollout_id in ids]
    for process in processes:
        process.start()
    raced = 0  # losers that lost the compare-and-swap itself (not a read that already saw the winner)
    try:
        for channels, expired in rounds:
            for channel in channels if expired else ():
                release.put(EXPIRED, channel)
            barrier.wait()  # go
            barrier.wait()  # all tried
            outcome = [results.get(timeout=60) for _ in ids]
            winners = [rollout_id for rollout_id, what, _ in outcome if what == "won"]
            assert len(winners) == 1, outcome
            (winner,) = winners
            for rollout_id, what, code in outcome:
                if rollout_id != winner:
                    assert code == ExitCode.LEASE_HELD, what
                    assert re.search(rf"channel '[^']+'( is being rolled out|: another rollout took the lease at "
                                     rf"the same time): rollout {winner} \(user ", what), what
                    raced += "at the same time" in what
            for channel in channels:  # every channel of the round is held by the winner, none by a loser
                spec = release.get(channel)["spec"]
                assert spec["holderIdentity"].startswith(f"{winner}/")
                assert spec["leaseTransitions"] == (8 if expired else 0)
            barrier.wait()  # release
            barrier.wait()
            assert all(release.get(channel) is None for channel in channels)  # deleted by its holder
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in processes] == [0] * contenders
    # The barrier lets them go within a millisecond or so of each other: many of them read the channel free (or
    # expired) and lost only at the write, the case a registry's read-write-read lease cannot rule out.
    assert raced > 0


def test_two_rollout_starts_at_once_one_runs_and_the_other_exits_4_naming_it(tmp_path, release):
    image = signed_image(tmp_path, release)
    logs = [tmp_path / f"start-{i}.log" for i in range(2)]
    argv = release.argv("start", "--image", image, "--channel", "stable", "--state-dir", str(tmp_path / "state"))
    starts = [subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                               env=dict(os.environ)) for log in logs]
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in starts) and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = [i for i, p in enumerate(starts) if p.poll() is not None]
        assert len(ended) == 1, [log.read_text() for log in logs]  # the winner waits on its approval gate
        loser, winner = ended[0], 1 - ended[0]
        assert starts[loser].returncode == ExitCode.LEASE_HELD, logs[loser].read_text()
        while "rollout " not in logs[winner].read_text() or "approval" not in logs[winner].read_text():
            assert starts[winner].poll() is None and time.monotonic() < deadline, logs[winner].read_text()
            time.sleep(0.2)
        winner_id = re.search(r"^rollout (\S+): ", logs[winner].read_text(), re.M).group(1)
        said = logs[loser].read_text().strip().splitlines()
        assert len(said) >= 1 and said[-1].startswith("error: rollout: channel 'stable'"), said
        assert f"rollout {winner_id} (user " in said[-1], said
        assert release.get()["spec"]["holderIdentity"].startswith(f"{winner_id}/")
        status = subprocess.run(release.argv("status", winner_id, "--format", "json"), cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["lease"]["rollout"] == winner_id  # read from the cluster's Lease
        aborted = subprocess.run(release.argv("abort", winner_id, "--state-dir", str(tmp_path / "state")),
                                 cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert aborted.returncode == 0, aborted.stderr
        assert starts[winner].wait(60) == ExitCode.FAILED  # aborted while it waited on its gate
        assert release.get() is None  # and it let the lease go
    finally:
        for process in starts:
            if process.poll() is None:
                process.kill()


def test_a_killed_rollouts_lease_blocks_others_and_its_resume_takes_it_over(tmp_path, registry, kube_cluster):
    namespace = kube_cluster.namespace(f"lease-{uuid.uuid4().hex[:8]}")
    path = write_release(tmp_path, registry, kube_cluster.kubeconfig, namespace,
                         waves="  - {name: canary, regions: [eu-west]}\n")
    release = Release(path, namespace, registry, load_release(path).state_repository.rsplit("/", 1)[0], kube_cluster)
    state = ["--state-dir", str(tmp_path / "state")]

    def cli(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
        argv = release.argv(*args, *state)
        if kill_at:  # tests/e2e/rollout_cli.py SIGKILLs itself there
            argv[3:3] = ["--kill-at", kill_at]
        return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)

    killed = cli("start", "--image", signed_image(tmp_path, release), "--channel", "stable", kill_at="recorded:0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr  # SIGKILL: nothing let the Lease go
    rollout_id = re.search(r"^rollout (\S+): ", killed.stderr, re.M).group(1)
    other = cli("start", "--image", signed_image(tmp_path, release), "--channel", "stable")
    assert other.returncode == ExitCode.LEASE_HELD, other.stderr
    assert f"rollout {rollout_id} (user " in other.stderr
    resumed = cli("resume", rollout_id)  # same rollout, same host, its process gone: taken over at once
    assert resumed.returncode == 0, resumed.stderr
    assert release.get() is None  # completed and released


# --- compare-and-swap, expiry, take-over -------------------------------------------------------


def test_the_resource_version_is_the_compare_and_swap(release):
    config = release.config
    assert config.lease_cluster is not None
    with kube_client(config.lease_cluster) as client:
        name, now = lease_name("stable"), time.time()

        def body(holder: str, version: str | None = None) -> dict:
            return lease_body(release.namespace, name, holder=holder, duration_s=60, acquire_time=now,
                              renew_time=now, transitions=0, annotations={}, resource_version=version)

        first = client.create_lease(body("a/0000000000000000"))
        with pytest.raises(KubeConflict, match="409 AlreadyExists") as exists:
            client.create_lease(body("b/0000000000000000"))
        assert exists.value.reason == "AlreadyExists"
        second = client.replace_lease(body("a/1111111111111111", first.resource_version))
        with pytest.raises(KubeConflict, match="409 Conflict") as stale:  # B read `first`, A wrote since
            client.replace_lease(body("b/0000000000000000", first.resource_version))
        assert stale.value.reason == "Conflict"
        with pytest.raises(KubeConflict, match="409 Conflict"):
            client.delete_lease(first)  # a release by who read an older version deletes nothing
        assert client.get_lease(release.namespace, name) == second
        assert client.delete_lease(second) and client.get_lease(release.namespace, name) is None


def test_an_unexpired_lease_holds_the_channel_and_an_expired_one_is_taken_over(release):
    renewed = time.time() - 10
    release.put({"holderIdentity": f"{HOLDER_ID}/0123456789abcdef", "leaseDurationSeconds": 60,
                 "renewTime": format_micro_time(renewed), "acquireTime": format_micro_time(renewed - 100),
                 "leaseTransitions": 3},
                annotations={"rollout.imagebuild.org/user": "alice", "rollout.imagebuild.org/host": "ci-7",
                             "rollout.imagebuild.org/pid": "4242"})
    before = release.get()
    lease = release.lease("20260202t000000-newone")
    with pytest.raises(LeaseHeld, match=rf"^channel 'stable' is being rolled out: rollout {HOLDER_ID} \(user alice "
                                        r"on ci-7, pid 4242\) holds it for another (4\d|50)s$") as held:
        lease.acquire()
    assert held.value.exit_code == ExitCode.LEASE_HELD
    assert release.get() == before  # refused without writing
    late = release.lease("20260202t000000-newone", ahead_s=51)  # a minute after its renewal: expired
    late.acquire()
    now = release.get()
    assert now["spec"]["holderIdentity"].startswith("20260202t000000-newone/")
    assert now["spec"]["leaseTransitions"] == 4 and now["spec"]["leaseDurationSeconds"] == 60
    assert now["metadata"]["resourceVersion"] != before["metadata"]["resourceVersion"]
    late.release()
    assert release.get() is None


def test_a_renewal_after_another_rollout_took_over_fails_and_its_release_leaves_the_new_holder(release):
    first = release.lease("20260303t000000-first1", ("stable", "2.6-gpu"))
    first.acquire()
    first.renew(force=True)  # ours: renewed by a PUT on the version read
    second = release.lease("20260303t000000-second", ("stable",), ahead_s=120)  # after the first one expired
    second.acquire()
    with pytest.raises(LeaseHeld, match=r"^lost the lease of channel 'stable': rollout 20260303t000000-second "
                                        r"\(user "):
        first.renew()
    first.release()
    assert release.get("stable")["spec"]["holderIdentity"].startswith("20260303t000000-second/")
    assert release.get("2.6-gpu") is None  # the channel it still held is let go
    second.release()


def test_a_finished_rollouts_lease_holds_nothing(release):
    """A rollout killed between recording its end and releasing its lease: its record says it finished."""
    config = release.config
    open_store(config).write(record_tag(HOLDER_ID), {"id": HOLDER_ID, "status": "completed"}, RECORD_TYPE)
    release.put({"holderIdentity": f"{HOLDER_ID}/0123456789abcdef", "leaseDurationSeconds": 600,
                 "renewTime": format_micro_time(time.time())})
    lease = release.lease("20260404t000000-after1")
    lease.acquire()
    assert release.get()["spec"]["holderIdentity"].startswith("20260404t000000-after1/")
    lease.release()


# --- what is read back is untrusted -------------------------------------------------------------------


@pytest.mark.parametrize("spec, message", [
    ({"holderIdentity": f"{HOLDER_ID}/0123456789abcdef", "leaseDurationSeconds": 60},
     "an unreadable lease holds it (lease {ns}/imagebuild-rollout-stable has a holder but no spec.renewTime); "
     "delete it if no rollout runs"),
    ({"holderIdentity": "x" * 2000, "leaseDurationSeconds": 60, "renewTime": "2020-01-01T00:00:00.000000Z"},
     "an unreadable lease holds it (lease {ns}/imagebuild-rollout-stable: spec.holderIdentity is 2000 characters "
     "long (at most 1024)); delete it if no rollout runs (kubectl -n {ns} delete lease imagebuild-rollout-stable)"),
    ({"holderIdentity": "\x1b]0;owned\x07kube-scheduler", "leaseDurationSeconds": 2147483647,
      "renewTime": "2020-01-01T00:00:00.000000Z"},
     "holder '\\x1b]0;owned\\x07kube-scheduler' (not an imagebuild rollout) holds it for another "),
], ids=["no renewTime", "a holder of 2000 characters", "escape sequences, 68 years"])
def test_a_lease_with_fields_that_cannot_be_trusted_is_refused_saying_which(release, spec, message):
    release.put(spec)
    before = release.get()
    with pytest.raises(LeaseHeld, match=re.escape("channel 'stable'")) as refused:
        release.lease("20260505t000000-carefl").acquire()
    assert message.format(ns=release.namespace) in str(refused.value)
    assert "\x1b" not in str(refused.value) and refused.value.exit_code == ExitCode.LEASE_HELD
    assert release.get() == before  # nothing was written


# --- TLS and secrets ---------------------------------------------------------------------------------


def kubeconfig_copy(tmp_path: Path, kube_cluster, edit) -> Path:
    data = yaml.safe_load(kube_cluster.kubeconfig.read_text())
    edit(data)
    path = tmp_path / "kubeconfig-copy"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_api_servers_certificate_is_verified_against_the_kubeconfigs_ca(tmp_path, release, kube_cluster):
    other_ca = tmp_path / "other-ca.crt"
    other_ca.write_bytes(Authority.new("not the cluster's CA").pem())
    path = kubeconfig_copy(tmp_path, kube_cluster,
                           lambda d: d["clusters"][0]["cluster"].update({"certificate-authority": str(other_ca)}))
    release.path.write_text(release.path.read_text().replace(str(kube_cluster.kubeconfig), str(path)))
    with pytest.raises(RolloutError, match=r"unreachable \(TLS: certificate verify failed") as refused:
        release.lease("20260606t000000-tlstst").acquire()
    assert refused.value.exit_code == ExitCode.ENVIRONMENT


def test_a_refused_token_ends_the_rollout_with_3_and_no_output_or_log_holds_a_token(tmp_path, release, kube_cluster,
                                                                                   caplog):
    canary = f"canary{uuid.uuid4().hex}"
    path = kubeconfig_copy(tmp_path, kube_cluster, lambda d: d["users"][0]["user"].update({"token": canary}))
    image = signed_image(tmp_path, release)
    good = release.path.read_text()
    release.path.write_text(good.replace(str(kube_cluster.kubeconfig), str(path)))
    for debug in ("0", "1"):
        run = subprocess.run(release.argv("start", "--image", image, "--channel", "stable",
                                          "--state-dir", str(tmp_path / "state")),
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "IMAGEBUILD_DEBUG": debug})
        assert run.returncode == ExitCode.ENVIRONMENT, run.stderr
        assert f"401 Unauthorized: Unauthorized (authenticating with a token from {path})" in run.stderr, run.stderr
        assert canary not in run.stdout + run.stderr
    # In process, with every logger at DEBUG (httpx and httpcore included), the real token in use.
    release.path.write_text(good)
    caplog.set_level(logging.DEBUG)
    lease = release.lease("20260707t000000-quiet1")
    lease.acquire()
    lease.renew(force=True)
    lease.release()
    assert isinstance(lease, KubernetesLease) and caplog.records  # httpx did log its requests
    assert kube_cluster.token not in caplog.text and kube_cluster.token not in repr(lease.client)
