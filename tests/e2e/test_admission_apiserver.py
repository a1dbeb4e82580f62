"""Admission through a real Kubernetes API server, with the webhook configurations `policies generate` writes.

etcd and kube-apiserver run on loopback (tests/e2e/kubeapi.py); `imagebuild admission serve` runs in a
process of its own at this machine's address, behind the generated Service (the test writes the
Endpoints a kubelet-less cluster cannot). Everything the API server does here it does in a cluster:
it reads the generated MutatingWebhookConfiguration and ValidatingWebhookConfiguration (their rules,
namespace selector, caBundle, timeout and failure policy), sends its own AdmissionReviews for what
kubectl creates, checks the webhook's certificate against the Service's DNS name, applies the
patch that pins digests, and shows the denial or the warnings to kubectl. Nothing is mocked: the
images are real, in the real staging registry, signed with the real cosign.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from .admission_harness import (
    OUTSIDE,
    Images,
    Registry,
    Webhook,
    make_images,
    start_webhook_process,
    trust_file,
)
from .admission_harness import until as poll
from .certs import Authority, Tls
from .conftest import REPO, require_registry, run_imagebuild
from .kubeapi import Cluster, host_address

NAMESPACE = "imagebuild-system"  # the webhook's own
NAME = "imagebuild-admission"
SERVICE_DNS = f"{NAME}.{NAMESPACE}.svc"
WORKLOADS = "team-a"
TRAINING = "training"  # listed in the trust file: labelled for Pod Security `restricted` by `policies generate`
MUTATING = f"{NAME}-mutate.imagebuild.dev"
VALIDATING = f"{NAME}.imagebuild.dev"
CHANGE_TIMEOUT_S = 30.0  # the API server sees a new webhook configuration or Endpoints within a second or two

# A container that Pod Security's `restricted` level admits.
RESTRICTED = {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 1000,
              "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@dataclass
class Admission:
    """The cluster with imagebuild's webhook installed from the generated manifests."""

    cluster: Cluster
    images: Images
    tls: Tls
    directory: Path
    webhook_image: str
    host: str
    webhook: Webhook
    generated: dict[str, Path] = field(default_factory=dict)

    def trust(self, **config) -> Path:
        webhook = (f"webhook:\n  namespace: {NAMESPACE}\n  name: {NAME}\n  image: {self.webhook_image}\n"
                   f"  port: 8443\nnamespaces:\n  - {TRAINING}\n")
        return trust_file(self.directory, extra=webhook, **config)

    def generate(self, trust: Path) -> Path:
        out = self.directory / f"admission-{uuid.uuid4().hex[:6]}"
        run = run_imagebuild("policies", "generate", "--trust", str(trust), "--ca-bundle", str(self.tls.ca),
                             "--out", str(out))
        assert run.returncode == 0, run.stderr
        return out

    def install(self, out: Path) -> None:
        """kubectl apply of every generated object (the webhook's Deployment is stored; nothing runs it)."""
        for name in ("namespaces.yaml", "webhook.yaml"):
            if (out / name).exists():
                self.cluster.kubectl("apply", "-f", str(out / name))

    def start(self, trust: Path, port: int | None = None) -> Webhook:
        return start_webhook_process(self.directory, self.tls, trust, host=self.host, port=port)

    def route_to(self, webhook: Webhook) -> None:
        self.cluster.route_service(NAMESPACE, NAME, "https", self.host, webhook.port)

    def run(self, name: str, image: str, *args: str, namespace: str = WORKLOADS):
        return self.cluster.kubectl("run", name, "-n", namespace, f"--image={image}", "--restart=Never", *args,
                                    check=False)

    def apply(self, *documents: dict, args: tuple[str, ...] = ()):
        return self.cluster.kubectl("apply", "-f", "-", *args, input=yaml.safe_dump_all(documents), check=False)

    def images_of(self, kind: str, name: str, namespace: str = WORKLOADS) -> list[str]:
        """What is stored: every image of the object, as `kubectl get -o jsonpath='{..image}'` lists them."""
        out = self.cluster.kubectl("get", kind, name, "-n", namespace, "-o", "jsonpath={..image}").stdout
        return out.split()


def until(condition: Callable[[], object], what: str) -> None:
    """The harness's poll, a quarter second apart: each try here is a kubectl run."""
    poll(condition, what, timeout=CHANGE_TIMEOUT_S, interval=0.25)


def created(run) -> str:
    assert run.returncode == 0, run.stderr
    return run.stderr


def refused(run, image: str, reason: str) -> str:
    """The API server's own error text: which webhook denied it, naming the image and why."""
    assert run.returncode != 0, f"admitted: {run.stdout}"
    message = run.stderr
    assert "denied the request" in message, message
    assert f"image {image}: {reason}" in message, message
    return message


def pinned(image: str, stored: str) -> None:
    """`stored` is `image` (by tag or digest) pinned to a digest."""
    assert "@sha256:" in stored, stored
    assert stored.startswith(image.split("@", 1)[0]), (image, stored)


@pytest.fixture(scope="module")
def admission(kube_cluster, staging_registry, cosign_cli, our_key, other_key, tmp_path_factory) -> Admission:
    require_registry(OUTSIDE)
    directory = tmp_path_factory.mktemp("admission-apiserver")
    registry = Registry(directory / "images", cosign_cli, our_key)
    images = make_images(registry, other_key)
    host = host_address()
    # The API server checks the webhook's certificate against the Service's DNS name; the tests
    # reach it at this machine's address.
    tls = Authority.new("imagebuild webhook CA").issue(directory / "tls", NAME, (SERVICE_DNS, host))
    webhook_image = registry.push(f"{images.signed.split('/admission-e2e/')[0]}/admission-e2e/webhook")
    registry.sign(webhook_image)
    state = Admission(kube_cluster, images, tls, directory, webhook_image, host, webhook=None)  # type: ignore[arg-type]
    trust = state.trust()
    state.generated["enforce"] = state.generate(trust)
    # Each namespace with its default ServiceAccount (what kube-controller-manager adds), before the
    # generated files label them.
    for namespace in (WORKLOADS, TRAINING, NAMESPACE, "kube-system"):
        kube_cluster.namespace(namespace)
    state.install(state.generated["enforce"])
    state.webhook = state.start(trust)
    state.route_to(state.webhook)
    probe = unique("probe")
    until(lambda: state.run(probe, images.unsigned, "--dry-run=server").returncode != 0,
          "the API server calls the webhook for a Pod")
    yield state
    state.webhook.stop()


# --- Pods: allowed and refused images --------------------------------------------------------------------------


def test_kubectl_run_of_a_signed_image_by_digest_is_created_and_stored_by_digest(admission):
    name = unique("signed")
    created(admission.run(name, admission.images.signed))
    assert admission.images_of("pod", name) == [admission.images.signed]


def test_kubectl_run_of_a_signed_tag_is_stored_pinned_to_the_digest_it_was_verified_at(admission):
    name = unique("tagged")
    created(admission.run(name, admission.images.signed_tag))
    (stored,) = admission.images_of("pod", name)
    assert stored == f"{admission.images.signed_tag}@{admission.images.signed.split('@')[1]}"


@pytest.mark.parametrize("which, reason", [
    ("unsigned", "not signed"),
    ("other_key", "the signature does not verify with any configured key"),
    ("moved_tag", "not signed"),
    ("outside", "not covered by the policy"),
])
def test_kubectl_run_of_a_bad_image_is_refused_with_the_api_server_s_own_error_naming_it(admission, which, reason):
    image = getattr(admission.images, which)
    name = unique(which.replace("_", "-"))
    message = refused(admission.run(name, image), image, reason)
    assert message.startswith("Error from server"), message
    assert admission.cluster.kubectl("get", "pod", name, "-n", WORKLOADS, check=False).returncode != 0


def pod(name: str, containers: list[tuple[str, str]], *, init: list[tuple[str, str]] = (),
        volumes: list[tuple[str, str]] = (), namespace: str = WORKLOADS, security: dict | None = None) -> dict:
    def container(n: str, image: str) -> dict:
        c: dict = {"name": n, "image": image}
        if security is not None:
            c["securityContext"] = security
        if volumes:
            c["volumeMounts"] = [{"name": v, "mountPath": f"/mnt/{v}"} for v, _ in volumes]
        return c

    spec: dict = {"containers": [container(n, i) for n, i in containers]}
    if init:
        spec["initContainers"] = [container(n, i) for n, i in init]
    if volumes:
        spec["volumes"] = [{"name": v, "image": {"reference": ref, "pullPolicy": "IfNotPresent"}} for v, ref in volumes]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def test_kubectl_apply_of_a_pod_with_an_unsigned_init_container_is_refused_naming_only_that_one(admission):
    images = admission.images
    message = refused(admission.apply(pod(unique("init"), [("app", images.signed)], init=[("setup", images.unsigned)])),
                      images.unsigned, "not signed")
    assert f'initContainer "setup" image {images.unsigned}' in message
    assert images.signed not in message


def test_an_image_volume_is_judged_like_a_container(admission):
    images = admission.images
    refused(admission.apply(pod(unique("vol"), [("app", images.signed)], volumes=[("models", images.unsigned)])),
            images.unsigned, "not signed")
    name = unique("vol")
    created(admission.apply(pod(name, [("app", images.signed)], volumes=[("models", images.signed_tag)])))
    stored = admission.cluster.get("pod", name, "-n", WORKLOADS)["spec"]["volumes"][0]["image"]["reference"]
    pinned(images.signed_tag, stored)


def test_kubectl_debug_adds_a_signed_ephemeral_container_and_is_refused_an_unsigned_one(admission):
    images = admission.images
    name = unique("debugged")
    created(admission.run(name, images.signed))
    debug = admission.cluster.kubectl("debug", name, "-n", WORKLOADS, f"--image={images.unsigned}", "-c", "dbg",
                                      check=False)
    refused(debug, images.unsigned, "not signed")
    created(admission.cluster.kubectl("debug", name, "-n", WORKLOADS, f"--image={images.signed_tag}", "-c", "dbg2",
                                      check=False))
    ephemeral = admission.cluster.get("pod", name, "-n", WORKLOADS)["spec"]["ephemeralContainers"]
    assert [c["name"] for c in ephemeral] == ["dbg2"]
    pinned(images.signed_tag, ephemeral[0]["image"])


# --- workloads -------------------------------------------------------------------------------------------------


def template(image: str, restart: str = "Always") -> dict:
    return {"metadata": {"labels": {"app": "w"}},
            "spec": {"containers": [{"name": "app", "image": image}], "restartPolicy": restart}}


def workload(kind: str, name: str, image: str) -> dict:
    meta = {"name": name, "namespace": WORKLOADS}
    selector = {"matchLabels": {"app": "w"}}
    spec: dict = {
        "Deployment": {"replicas": 1, "selector": selector, "template": template(image)},
        "StatefulSet": {"replicas": 1, "serviceName": name, "selector": selector, "template": template(image)},
        "DaemonSet": {"selector": selector, "template": template(image)},
        "ReplicaSet": {"replicas": 1, "selector": selector, "template": template(image)},
        "Job": {"template": template(image, "Never")},
        "CronJob": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": template(image, "OnFailure")}}},
    }[kind]
    group = "batch/v1" if kind in ("Job", "CronJob") else "apps/v1"
    return {"apiVersion": group, "kind": kind, "metadata": meta, "spec": spec}


KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob")


@pytest.mark.parametrize("kind", KINDS)
def test_a_workload_with_a_signed_tag_is_stored_pinned_and_one_with_an_unsigned_image_is_refused(admission, kind):
    images = admission.images
    refused(admission.apply(workload(kind, unique(kind.lower()), images.unsigned)), images.unsigned, "not signed")
    name = unique(kind.lower())
    created(admission.apply(workload(kind, name, images.signed_tag)))
    (stored,) = admission.images_of(kind.lower(), name)
    pinned(images.signed_tag, stored)


def test_an_update_that_swaps_in_an_unsigned_image_is_refused_and_the_stored_object_is_unchanged(admission):
    images = admission.images
    name = unique("swap")
    created(admission.apply(workload("Deployment", name, images.signed)))
    before = admission.images_of("deployment", name)
    swap = admission.cluster.kubectl("set", "image", f"deployment/{name}", f"app={images.unsigned}", "-n", WORKLOADS,
                                     check=False)
    refused(swap, images.unsigned, "not signed")
    assert admission.images_of("deployment", name) == before
    created(admission.cluster.kubectl("set", "image", f"deployment/{name}", f"app={images.signed_too}",
                                      "-n", WORKLOADS, check=False))
    assert admission.images_of("deployment", name) == [images.signed_too]


def test_a_server_side_dry_run_is_judged_and_stores_nothing(admission):
    images = admission.images
    refused(admission.apply(workload("Deployment", unique("dry"), images.unsigned), args=("--dry-run=server",)),
            images.unsigned, "not signed")
    name = unique("dry")
    out = admission.cluster.kubectl("apply", "-f", "-", "--dry-run=server", "-o", "json",
                                    input=yaml.safe_dump(workload("Deployment", name, images.signed_tag)))
    pinned(images.signed_tag, json.loads(out.stdout)["spec"]["template"]["spec"]["containers"][0]["image"])
    assert admission.cluster.kubectl("get", "deployment", name, "-n", WORKLOADS, check=False).returncode != 0


# --- what the generated configuration leaves out, and when the webhook is away -----------------------------


def test_the_webhook_s_own_namespace_and_kube_system_are_not_sent_to_it(admission):
    images = admission.images
    created(admission.run(unique("system"), images.unsigned, namespace="kube-system"))
    # The webhook's namespace is labelled for Pod Security `restricted`: a compliant Pod.
    created(admission.apply(pod(unique("own"), [("app", images.unsigned)], namespace=NAMESPACE, security=RESTRICTED)))


def test_every_admitted_pod_in_the_covered_namespaces_carries_digests(admission):
    out = admission.cluster.kubectl("get", "pods", "-n", WORKLOADS, "-o", "jsonpath={..image}").stdout.split()
    assert out, "no Pod was admitted"
    assert all("@sha256:" in image for image in out), out


def install_with(admission: Admission, **config) -> Path:
    trust = admission.trust(**config)
    out = admission.generate(trust)
    admission.cluster.kubectl("apply", "-f", str(out / "webhook.yaml"))
    return trust


def failure_policy(admission: Admission) -> str:
    config = admission.cluster.get("validatingwebhookconfiguration", NAME)
    return config["webhooks"][0]["failurePolicy"]


def test_with_the_webhook_stopped_failure_policy_fail_refuses_and_ignore_admits(admission):
    images = admission.images
    port = admission.webhook.port
    assert admission.webhook.stop() == 0
    try:
        assert failure_policy(admission) == "Fail"
        run = admission.run(unique("down"), images.signed)
        assert run.returncode != 0
        assert f'failed calling webhook "{MUTATING}"' in run.stderr, run.stderr
        install_with(admission, failure_policy="ignore")
        until(lambda: failure_policy(admission) == "Ignore", "the Ignore configuration is stored")
        name = unique("down")
        until(lambda: admission.run(name, images.unsigned).returncode == 0,
              "a Pod is admitted while the webhook is down under failurePolicy Ignore")
    finally:
        trust = install_with(admission)
        admission.webhook = admission.start(trust, port=port)
    until(lambda: admission.run(unique("back"), images.unsigned, "--dry-run=server").returncode != 0,
          "the webhook refuses again once it is back")


def test_warn_mode_admits_and_kubectl_shows_the_warning(admission):
    images = admission.images
    warn_trust = install_with(admission, mode="warn")
    # The warn-mode webhook takes the enforcing one's place (the API server keeps its connections to
    # an address alive, so a second process beside the first would not be asked).
    port = admission.webhook.port
    admission.webhook.stop()
    warn = admission.start(warn_trust, port=port)
    try:
        name = unique("warned")
        until(lambda: admission.run(name, images.unsigned), "warn mode admits an unsigned image")
        run = admission.run(unique("warned"), images.unsigned)
        assert run.returncode == 0, run.stderr
        assert "Warning:" in run.stderr and images.unsigned in run.stderr and "not signed" in run.stderr, run.stderr
    finally:
        warn.stop()
        admission.webhook = admission.start(install_with(admission), port=port)
    until(lambda: admission.run(unique("enforced"), images.unsigned, "--dry-run=server").returncode != 0,
          "enforce mode again")


# --- the training Job under Pod Security `restricted` ----------------------------------------------------------

TRAINING_JOB = REPO / "examples" / "k8s" / "training-job.yaml"


def training_job(image: str, namespace: str, **security) -> dict:
    job = yaml.safe_load(TRAINING_JOB.read_text())
    job["metadata"]["namespace"] = namespace
    job["metadata"]["name"] = unique("train")
    for container in job["spec"]["template"]["spec"]["containers"]:
        container["image"] = image
        container.setdefault("securityContext", {}).update(security)
    return job


def pod_of(job: dict) -> dict:
    """The Pod the Job controller would create from the Job's template (there is no controller here)."""
    template = job["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": job["metadata"]["name"], "namespace": job["metadata"]["namespace"],
                         "labels": template.get("metadata", {}).get("labels", {})},
            "spec": template["spec"]}


def test_the_generated_namespaces_carry_pod_security_labels_at_restricted(admission):
    labels = admission.cluster.get("namespace", TRAINING)["metadata"]["labels"]
    for mode in ("enforce", "warn", "audit"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted", labels


def test_the_training_job_with_a_signed_image_is_admitted_under_restricted_and_stored_pinned(admission):
    images = admission.images
    job = training_job(images.signed_tag, TRAINING)
    run = admission.apply(job)
    assert created(run) == "", run.stderr  # no Pod Security warning either
    (stored,) = admission.images_of("job", job["metadata"]["name"], namespace=TRAINING)
    pinned(images.signed_tag, stored)
    spec = admission.cluster.get("job", job["metadata"]["name"], "-n", TRAINING)["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"region": "eu-west", "gpu-type": "a100"}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # The Pod the Job controller would make passes Pod Security and our webhook too.
    created(admission.apply(pod_of(job)))


def test_the_training_job_made_privileged_is_refused_by_pod_security_not_by_us(admission):
    job = training_job(admission.images.signed, TRAINING, privileged=True, allowPrivilegeEscalation=True)
    # Pod Security enforces on Pods; on a Job it warns at once, naming what its Pods would violate.
    warned = admission.apply(job)
    assert warned.returncode == 0, warned.stderr
    assert 'would violate PodSecurity "restricted:latest"' in warned.stderr and "privileged" in warned.stderr
    refused_pod = admission.apply(pod_of(job))
    assert refused_pod.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in refused_pod.stderr, refused_pod.stderr
    assert "imagebuild refused" not in refused_pod.stderr


def test_the_training_job_with_an_unsigned_image_is_refused_by_our_webhook(admission):
    images = admission.images
    refused(admission.apply(training_job(images.unsigned, TRAINING)), images.unsigned, "not signed")
