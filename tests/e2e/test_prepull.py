"""The rollout's prepull step against real containerd "nodes" (tests/e2e/nodes.py), the regional registries and
cosign signatures: a region's tags move only once every node of the region holds the digest, complete and
unpacked; a node that cannot pull (a dead registry mirror in its host config, its containerd down) halts the
wave before any of its tags moves, and a resume finishes once the node can pull.

The generated pre-pull DaemonSet is checked by a real kube-apiserver (tests/e2e/kubeapi.py): it is
accepted as it is, created, and read back unchanged.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from imagebuild.config.release_file import Prepull, PrepullNode, Region
from imagebuild.rollout.prepull import prepull_region

from ..conftest import REPO_ROOT
from .conftest import REGIONS, STAGING, require_registry
from .nodes import ContainerdNode
from .rollout_harness import free_port
from .test_rollout import CANARY_THEN_REST, Setup, rollout_id_of
from .tools import bootstrap_key


@pytest.fixture(scope="module", autouse=True)
def registries_up():
    for host in [STAGING, *REGIONS.values()]:
        require_registry(host)
    bootstrap_key()


@pytest.fixture
def nodes(tmp_path):
    """Containerd nodes by name, started on first use, all stopped at the end of the test."""
    started: dict[str, ContainerdNode] = {}

    def node(name: str) -> ContainerdNode:
        if name not in started:
            started[name] = ContainerdNode(tmp_path, name)
        return started[name]

    yield node
    for each in started.values():
        each.stop()


def prepull_keys(*entries: str, timeout: str = "2m") -> str:
    return f"prepull: {{timeout: {timeout}, nodes: [{', '.join(entries)}]}}"


def node_entry(node: ContainerdNode, hosts_dir: Path | None = None) -> str:
    hosts = f", hosts_dir: '{hosts_dir}'" if hosts_dir else ""
    return f"{{name: {node.name}, containerd: '{node.socket}'{hosts}}}"


def dead_mirror(tmp_path: Path, registry: str) -> Path:
    """A containerd hosts directory that sends every pull from `registry` to a mirror nobody serves."""
    directory = tmp_path / "hosts.d"
    (directory / registry).mkdir(parents=True)
    # A mirror that fails makes containerd fall back to the server: refuse that too, as a node without a route would.
    (directory / registry / "hosts.toml").write_text(textwrap.dedent(f"""\
        server = "http://127.0.0.1:{free_port()}"
        [host."http://127.0.0.1:{free_port()}"]
          capabilities = ["pull", "resolve"]
        """))
    return directory


def kinds_by_region(record: dict) -> list[tuple[str, str | None]]:
    return [(step["kind"], step["region"]) for step in record["steps"]]


def test_each_regions_tags_move_only_after_every_node_of_it_holds_the_digest(tmp_path, nodes):
    setup = Setup(tmp_path)
    eu_a, eu_b, us_a = nodes("eu-west-a"), nodes("eu-west-b"), nodes("us-east-a")
    setup.write(CANARY_THEN_REST, region_keys={
        "eu-west": prepull_keys(node_entry(eu_a), node_entry(eu_b)),
        "us-east": prepull_keys(node_entry(us_a)),
    })
    before = setup.seed("stable")
    image = setup.source()
    digest = image.split("@")[1]
    # Steps: canary copy 0, verify 1, prepull 2, record 3, move 4, gates 5. Killed once the prepull is
    # recorded: both eu-west nodes hold the digest, and no tag has moved yet.
    run = setup.start(image, "stable", kill_at="recorded:2")
    assert run.returncode == -signal.SIGKILL, run.stderr
    rollout_id = rollout_id_of(run)
    eu_image = f"{REGIONS['eu-west']}/{setup.repository}@{digest}"
    for node in (eu_a, eu_b):
        assert node.images().get(eu_image) == digest, node.name
        checked = node.ctr("images", "check", f"name=={eu_image}")
        assert "complete" in checked.stdout and checked.stdout.split()[-1] == "true", checked.stdout
    assert setup.tag("eu-west", "stable") == before["eu-west"]
    assert us_a.images() == {}  # the next wave's nodes are not touched before its turn

    resumed = setup.cli("resume", rollout_id)
    assert resumed.returncode == 0, resumed.stderr
    assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest)
    assert us_a.images().get(f"{REGIONS['us-east']}/{setup.repository}@{digest}") == digest

    record = setup.record(rollout_id)
    assert kinds_by_region(record)[:6] == [("copy", "eu-west"), ("verify", "eu-west"), ("prepull", "eu-west"),
                                           ("record-previous", "eu-west"), ("move-tag", "eu-west"), ("gates", None)]
    assert ("prepull", "ap-south") not in kinds_by_region(record)  # no prepull: in release.yaml: no step
    # In the audit trail every region's prepull, every node ready, comes before any of its tags moves.
    events = record["events"]
    for region, names in (("eu-west", ["eu-west-a", "eu-west-b"]), ("us-east", ["us-east-a"])):
        prepulls = [i for i, e in enumerate(events) if e["what"] == "prepull" and e["region"] == region]
        moves = [i for i, e in enumerate(events) if e["what"] == "move-tag" and e["region"] == region]
        assert prepulls and moves and max(prepulls) < min(moves), (region, events)
        last = events[max(prepulls)]
        assert [(n["node"], n["ready"]) for n in last["nodes"]] == [(name, True) for name in names]
        assert all("complete" in n["detail"] and "unpacked" in n["detail"] for n in last["nodes"])


def test_a_node_that_cannot_pull_halts_the_wave_before_any_of_its_tags_moves_and_resume_finishes(tmp_path, nodes):
    setup = Setup(tmp_path)
    us_a, us_b = nodes("us-east-a"), nodes("us-east-b")
    mirror = dead_mirror(tmp_path, REGIONS["us-east"])
    region_keys = {"us-east": prepull_keys(node_entry(us_a), node_entry(us_b, hosts_dir=mirror), timeout="20s")}
    setup.write(CANARY_THEN_REST, region_keys=region_keys)
    before = setup.seed("stable")
    image = setup.source()
    digest = image.split("@")[1]

    run = setup.start(image, "stable")
    assert run.returncode == 1, run.stderr
    assert "region us-east: node us-east-b could not pull" in run.stderr, run.stderr
    assert "1 of 2 nodes not ready, no tag of the region moved" in run.stderr
    assert setup.tag("eu-west", "stable") == digest  # the canary wave had passed
    # The whole wave halts: neither us-east nor ap-south (later in the same wave) moved.
    assert setup.tag("us-east", "stable") == before["us-east"]
    assert setup.tag("ap-south", "stable") == before["ap-south"]
    rollout_id = rollout_id_of(run)
    record = setup.record(rollout_id)
    assert record["status"] == "halted"
    prepull = next(e for e in record["events"] if e["what"] == "prepull")
    assert [(n["node"], n["ready"]) for n in prepull["nodes"]] == [("us-east-a", True), ("us-east-b", False)]

    # The node's route is fixed (no mirror any more): the same rollout resumes and finishes.
    region_keys["us-east"] = prepull_keys(node_entry(us_a), node_entry(us_b), timeout="2m")
    setup.write(CANARY_THEN_REST, region_keys=region_keys)
    resumed = setup.cli("resume", rollout_id)
    assert resumed.returncode == 0, resumed.stderr
    assert {region: setup.tag(region, "stable") for region in REGIONS} == dict.fromkeys(REGIONS, digest)
    assert us_b.images().get(f"{REGIONS['us-east']}/{setup.repository}@{digest}") == digest


def test_a_node_whose_containerd_is_down_is_not_ready_and_says_why(tmp_path, nodes):
    node = nodes("down-a")
    image_digest = Setup(tmp_path).source()
    registry, _, rest = image_digest.partition("/")
    repository, _, digest = rest.partition("@")
    node.stop()
    region = Region("eu-west", registry, repository,
                    prepull=Prepull((PrepullNode("down-a", node.socket),), timeout_s=20))
    [answer] = prepull_region(region, digest)
    assert not answer.ready and answer.node == "down-a"
    assert answer.detail.startswith("could not pull: ctr: ") and str(node.socket) in answer.detail


def test_the_prepull_daemonset_is_accepted_by_a_real_api_server_as_generated(kube_cluster, tmp_path):
    digest = "sha256:" + "ab" * 32
    image = f"{REGIONS['eu-west']}/imagebuild-example/paddle@{digest}"
    # The command's default namespace, the webhook's own: an admission webhook of the cluster (another test's,
    # whose service is gone) leaves it alone, as it leaves the pre-pull of a new image alone in production.
    namespace = kube_cluster.namespace("imagebuild-system")
    printed = subprocess.run([sys.executable, "-m", "imagebuild", "rollout", "prepull-manifest", "--image", image,
                              "--node-selector", "nvidia.com/gpu.present=true",
                              "--format", "json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    manifest = json.loads(printed.stdout)
    kube_cluster.apply(manifest, args=["--dry-run=server"])
    kube_cluster.apply(manifest)
    stored = kube_cluster.get("-n", namespace, "daemonset", manifest["metadata"]["name"])
    pod = stored["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["initContainers"]] == [image]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["automountServiceAccountToken"] is False and pod["tolerations"] == [{"operator": "Exists"}]
    assert stored["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    # A tag is not a pre-pull: the same digest on every node is the point.
    refused = subprocess.run([sys.executable, "-m", "imagebuild", "rollout", "prepull-manifest", "--image",
                              f"{REGIONS['eu-west']}/imagebuild-example/paddle:gpu"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "by digest" in refused.stderr and "Traceback" not in refused.stderr
