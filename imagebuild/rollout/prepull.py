"""Warming a region's nodes: each pulls and unpacks the rollout's digest before the region's tags move.

A tag that moves before the nodes have the image makes every job scheduled next wait for a
multi-gigabyte pull, on every node at once. The rollout's prepull step (release.yaml `prepull:`
of a region) has each node's containerd pull `registry/repository@digest` from the region's
registry, all nodes at once, and then asks each for the image by that name: the step passes
only when every node reports the digest complete and unpacked. A node that cannot pull
(down, no route to the registry, a timeout) halts the rollout before the tags move.

Nodes are reached through `ctr` (containerd's own client, Debian's containerd package) on the
node's socket, in the kubelet's namespace by default, with the node's own registry host
configuration (`hosts_dir`): a node pulls with what it would pull with, no credentials of ours.

For Kubernetes clusters, `daemonset_manifest` gives a DaemonSet that makes every kubelet pull the
digest (an init container of the image that exits at once, then a pause container): its rollout
status, once every desired pod is ready, says the same thing as this step.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from imagebuild.config.release_file import Prepull, PrepullNode, Region
from imagebuild.core.runner import Result, Runner, find_tool
from imagebuild.core.source import safe_text
from imagebuild.oci import names, reference
from imagebuild.oci.client import base_url

CTR_HINT = "install Debian's containerd package (it ships /usr/bin/ctr); scripts/bootstrap.sh installs docker.io with it"
CHECK_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class NodePull:
    """What one node answered: `ready` when it holds the digest complete and unpacked."""

    node: str
    ready: bool
    detail: str  # one line: "complete (13/13), unpacked" or why not

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "ready": self.ready, "detail": self.detail}


# --- pure parts -------------------------------------------------------------------------------


def ctr_base(ctr: str, node: PrepullNode) -> list[str]:
    return [ctr, "--address", str(node.containerd), "--namespace", node.namespace]


def pull_command(ctr: str, node: PrepullNode, image: str, registry: str) -> list[str]:
    """`ctr images pull` of `image` (by digest) on the node; plain HTTP where imagebuild itself would use it."""
    command = [*ctr_base(ctr, node), "images", "pull"]
    if node.hosts_dir is not None:
        command += ["--hosts-dir", str(node.hosts_dir)]
    if base_url(registry).startswith("http://"):
        command.append("--plain-http")
    return [*command, image]


def check_command(ctr: str, node: PrepullNode, image: str) -> list[str]:
    return [*ctr_base(ctr, node), "images", "check", f"name=={image}"]


_CHECK_STATUS = re.compile(r"(complete|incomplete|missing|unavailable)\s+\((\d+)/(\d+)\)")


def judge_check(output: str, image: str, digest: str) -> tuple[bool, str]:
    """`ctr images check` output -> (ready, detail). Ready: a row for the image, at the digest,
    complete and unpacked. Columns: REF TYPE DIGEST STATUS (with its "(n/m)") SIZE UNPACKED."""
    for line in output.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[0] != image:
            continue
        if fields[2] != digest:
            return False, f"holds {names.escaped(fields[2])} under that name, not {digest}"
        status = _CHECK_STATUS.search(line)
        if status is None:
            return False, f"unexpected check output: {names.escaped(line.strip()[:160])}"
        state, have, want = status.group(1), status.group(2), status.group(3)
        if state != "complete":
            return False, f"{state} ({have}/{want})"
        if fields[-1] != "true":
            return False, f"complete ({have}/{want}) but not unpacked"
        return True, f"complete ({have}/{want}), unpacked"
    return False, "the image is not on the node after the pull"


def last_error(output: str) -> str:
    """The line of ctr's output that says why (its `ctr: ...` line, else the last line), shortened."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    chosen = next((line for line in reversed(lines) if line.startswith("ctr: ")), lines[-1] if lines else "no output")
    return safe_text(chosen, 300)


# Each a new mapping on every call: YAML prints a mapping used twice as an anchor and alias.
def _labels(short: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "imagebuild-prepull", "app.kubernetes.io/managed-by": "imagebuild",
            "imagebuild.io/prepull": short}


def _hardened() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


def _small() -> dict[str, Any]:
    return {"requests": {"cpu": "1m", "memory": "8Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}


def daemonset_manifest(image: str, *, namespace: str, name: str | None = None, pause_image: str,
                       node_selector: dict[str, str] | None = None, command: tuple[str, ...] = ("/bin/true",)
                       ) -> dict[str, Any]:
    """A DaemonSet whose pods pull `image` (by digest) on every node it selects, then idle in a pause container.

    Its init container runs the image's `command` (default /bin/true) and exits; with
    maxUnavailable 100% the whole cluster pulls at once. It tolerates every taint, GPU nodes'
    included, and asks for no service account token; delete it once its pods are ready.
    """
    digest = reference.split(image).digest  # raises a ReferenceError (a ValueError) for what is not a reference
    if digest is None:
        raise reference.DigestError(f"{reference.shown(image)}: a pre-pull names its image by digest")
    short = digest.split(":")[1][:12]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "tolerations": [{"operator": "Exists"}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [{"name": "pull", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": list(command), "resources": _small(), "securityContext": _hardened()}],
        "containers": [{"name": "pause", "image": pause_image, "imagePullPolicy": "IfNotPresent",
                        "resources": _small(), "securityContext": _hardened()}],
    }
    if node_selector:
        pod["nodeSelector"] = dict(sorted(node_selector.items()))
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name or f"imagebuild-prepull-{short}", "namespace": namespace, "labels": _labels(short),
                     "annotations": {"imagebuild.io/image": image}},
        "spec": {
            "selector": {"matchLabels": {"imagebuild.io/prepull": short}},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}},
            "template": {"metadata": {"labels": _labels(short)}, "spec": pod},
        },
    }


# --- effects ----------------------------------------------------------------------------------


def pull_on_node(runner: Runner, ctr: str, node: PrepullNode, region: Region, digest: str,
                 timeout_s: float) -> NodePull:
    image = region.image(digest)
    pulled = runner.run(pull_command(ctr, node, image, region.registry), timeout=timeout_s)
    if pulled.timed_out:
        return NodePull(node.name, False, f"did not pull within {timeout_s:g}s")
    if pulled.returncode != 0:
        return NodePull(node.name, False, f"could not pull: {last_error(pulled.output)}")
    checked: Result = runner.run(check_command(ctr, node, image), timeout=CHECK_TIMEOUT_S)
    if checked.returncode != 0:
        return NodePull(node.name, False, f"could not be asked for the image: {last_error(checked.output)}")
    ready, detail = judge_check(checked.output, image, digest)
    return NodePull(node.name, ready, detail)


def prepull_region(region: Region, digest: str, *, runner: Runner | None = None,
                   on_node: Callable[[NodePull], None] | None = None) -> list[NodePull]:
    """Every node of the region pulls `digest`, all at once; each node's answer, in release.yaml's order."""
    spec: Prepull | None = region.prepull
    if spec is None:
        return []
    ctr = find_tool("ctr", "IMAGEBUILD_CTR", CTR_HINT)
    runner = runner or Runner()

    def one(node: PrepullNode) -> NodePull:
        result = pull_on_node(runner, ctr, node, region, digest, spec.timeout_s)
        if on_node is not None:
            on_node(result)
        return result

    with ThreadPoolExecutor(max_workers=min(16, len(spec.nodes)), thread_name_prefix=f"prepull-{region.name}") as pool:
        return list(pool.map(one, spec.nodes))
