"""The prepull step's pure parts: release.yaml's `prepull:`, where the step sits in the plan, the `ctr`
commands, how a node's `ctr images check` answer is judged, and the generated DaemonSet."""
from __future__ import annotations

from pathlib import Path

import pytest

from imagebuild.config.release_file import Prepull, PrepullNode, Region, ReleaseConfig, SoakGate, Wave, load_release
from imagebuild.oci.reference import ReferenceError
from imagebuild.rollout.plan import plan_rollout
from imagebuild.rollout.prepull import check_command, daemonset_manifest, judge_check, last_error, pull_command

DIGEST = "sha256:" + "61" * 32
OTHER = "sha256:" + "0a" * 32
IMAGE = f"127.0.0.1:5001/imagebuild-example/paddle@{DIGEST}"
NODE = PrepullNode("eu-west-a", Path("/run/nodes/a/containerd.sock"))

# `ctr images check` as containerd 1.6.20 prints it (columns padded with spaces).
CHECK_HEADER = "REF   TYPE   DIGEST   STATUS   SIZE   UNPACKED"


def check_row(image: str = IMAGE, digest: str = DIGEST, status: str = "complete (13/13)", unpacked: str = "true") -> str:
    return (f"{CHECK_HEADER}\n{image} application/vnd.docker.distribution.manifest.v2+json {digest} {status}"
            f"   353.6 MiB/353.6 MiB   {unpacked}\n")


def test_release_yaml_prepull_reads_into_nodes_with_the_kubelets_namespace_by_default(tmp_path):
    path = tmp_path / "release.yaml"
    path.write_text(
        "schema: 1\ntrust: trust.yaml\nstate: {registry: 127.0.0.1:5000, repository: r/rollouts}\n"
        "regions:\n  - name: eu-west\n    registry: 127.0.0.1:5001\n    repository: r/paddle\n"
        "    prepull:\n      timeout: 5m\n      nodes:\n"
        "        - {name: gpu-node-1.eu, containerd: /run/containerd/containerd.sock}\n"
        "        - {name: gpu-node-2.eu, containerd: /run/b.sock, namespace: moby, hosts_dir: /etc/containerd/certs.d}\n"
        "  - {name: us-east, registry: 127.0.0.1:5002, repository: r/paddle}\n"
        "channels: [stable]\nwaves:\n  - {name: canary, regions: [eu-west]}\n  - {name: rest, regions: [us-east]}\n")
    config = load_release(path)
    assert config.region("eu-west").prepull == Prepull((
        PrepullNode("gpu-node-1.eu", Path("/run/containerd/containerd.sock"), "k8s.io", None),
        PrepullNode("gpu-node-2.eu", Path("/run/b.sock"), "moby", Path("/etc/containerd/certs.d"))), 300.0)
    assert config.region("us-east").prepull is None


def release(prepull_in: set[str]) -> ReleaseConfig:
    regions = tuple(Region(name, f"127.0.0.1:{5001 + i}", "imagebuild/paddle",
                           prepull=Prepull((NODE,)) if name in prepull_in else None)
                    for i, name in enumerate(("eu", "us", "ap")))
    return ReleaseConfig(path=Path("release.yaml"), trust_path=Path("trust.yaml"), state_registry="127.0.0.1:5000",
                         state_repository="imagebuild/rollouts", lease_ttl_s=600.0, regions=regions,
                         channels=("stable",), waves=(Wave("canary", ("eu",), (SoakGate(1.0),)),
                                                      Wave("rest", ("us", "ap"), (SoakGate(1.0),))))


def test_a_region_with_nodes_prepulls_after_its_verify_and_before_any_tag_of_its_wave_moves():
    steps = [(s.kind.value, s.region) for s in plan_rollout(release({"eu", "ap"}), DIGEST, ["stable"])]
    assert steps == [("copy", "eu"), ("verify", "eu"), ("prepull", "eu"), ("record-previous", "eu"),
                     ("move-tag", "eu"), ("gates", None),
                     ("copy", "us"), ("verify", "us"), ("copy", "ap"), ("verify", "ap"), ("prepull", "ap"),
                     ("record-previous", "us"), ("record-previous", "ap"), ("move-tag", "us"), ("move-tag", "ap"),
                     ("gates", None)]


def test_without_prepull_the_plan_is_what_it_was():
    steps = [s.kind.value for s in plan_rollout(release(set()), DIGEST, ["stable"])]
    assert "prepull" not in steps and len(steps) == 14


def test_the_node_pulls_by_digest_over_plain_http_only_where_imagebuild_would():
    assert pull_command("/usr/bin/ctr", NODE, IMAGE, "127.0.0.1:5001") == [
        "/usr/bin/ctr", "--address", "/run/nodes/a/containerd.sock", "--namespace", "k8s.io", "images", "pull",
        "--plain-http", IMAGE]
    remote = PrepullNode("n", Path("/run/c.sock"), "k8s.io", Path("/etc/containerd/certs.d"))
    command = pull_command("ctr", remote, "harbor.example.com/p/paddle@" + DIGEST, "harbor.example.com")
    assert "--plain-http" not in command and command[-3:-1] == ["--hosts-dir", "/etc/containerd/certs.d"]
    assert check_command("ctr", NODE, IMAGE)[-3:] == ["images", "check", f"name=={IMAGE}"]


@pytest.mark.parametrize("output, ready, detail", [
    (check_row(), True, "complete (13/13), unpacked"),
    (check_row(status="incomplete (5/13)"), False, "incomplete (5/13)"),
    (check_row(unpacked="false"), False, "complete (13/13) but not unpacked"),
    (check_row(digest=OTHER), False, f"not {DIGEST}"),
    (check_row(image=IMAGE.replace("paddle", "other")), False, "not on the node"),
    (CHECK_HEADER + "\n", False, "not on the node"),
    (f"{CHECK_HEADER}\n{IMAGE} type {DIGEST} whatever 1 2 true\n", False, "unexpected check output"),
])
def test_a_node_is_ready_only_with_the_digest_complete_and_unpacked(output, ready, detail):
    judged = judge_check(output, IMAGE, DIGEST)
    assert judged[0] is ready and detail in judged[1]


def test_ctrs_reason_is_its_ctr_line_escaped_and_bounded():
    output = 'time="..." level=info msg="trying next host"\nctr: failed to resolve reference "x": not found\n'
    assert last_error(output) == 'ctr: failed to resolve reference "x": not found'
    assert last_error("ctr: \x1b[31mred\x1b[0m " + "x" * 500).startswith("ctr: \\x1b[31mred")
    assert len(last_error("ctr: " + "x" * 500)) <= 300
    assert last_error("") == "no output"


def test_the_daemonset_pulls_the_digest_on_every_selected_node_and_asks_for_nothing_else():
    manifest = daemonset_manifest(IMAGE, namespace="imagebuild-system", pause_image="registry.k8s.io/pause:3.9",
                                  node_selector={"nvidia.com/gpu.present": "true"})
    assert manifest["metadata"]["name"] == "imagebuild-prepull-616161616161"
    pod = manifest["spec"]["template"]["spec"]
    [pull] = pod["initContainers"]
    assert pull["image"] == IMAGE and pull["command"] == ["/bin/true"] and pull["imagePullPolicy"] == "IfNotPresent"
    assert pod["containers"][0]["image"] == "registry.k8s.io/pause:3.9"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["automountServiceAccountToken"] is False
    assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in [pull, *pod["containers"]])
    selector = manifest["spec"]["selector"]["matchLabels"]
    assert selector.items() <= manifest["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("image, message", [("127.0.0.1:5001/imagebuild-example/paddle:gpu", "names its image by digest"),
                                            ("not a reference@@", "space")])
def test_a_daemonset_for_anything_but_a_digest_is_refused(image, message):
    with pytest.raises(ReferenceError, match=message):
        daemonset_manifest(image, namespace="ns", pause_image="pause")
