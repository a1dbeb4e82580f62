"""examples/k8s/training-job.yaml, the training Job users start from: one A100 in eu-west, a Pod that passes the
`restricted` Pod Security Standard, and one placeholder for the image. (Applied to a real kube-apiserver
elsewhere; here it is read as YAML.)"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.pod_security import restricted_violations

JOB = Path(__file__).resolve().parent.parent / "examples" / "k8s" / "training-job.yaml"
PLACEHOLDER = "${IMAGE}"


def job(image: str = "registry.test/paddle/paddle:3.3.1@sha256:" + "ab" * 32) -> dict[str, Any]:
    text = JOB.read_text(encoding="utf-8")
    documents = list(yaml.safe_load_all(text.replace(PLACEHOLDER, image)))
    assert len(documents) == 1
    return documents[0]


def test_it_is_one_batch_v1_job_whose_image_is_the_one_placeholder() -> None:
    document = job("registry.test/x@sha256:" + "cd" * 32)
    assert (document["apiVersion"], document["kind"]) == ("batch/v1", "Job")
    assert "$" not in yaml.safe_dump(document)  # nothing else for envsubst (or a test) to fill in
    (container,) = document["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.test/x@sha256:" + "cd" * 32


def test_it_asks_for_one_a100_in_eu_west() -> None:
    pod = job()["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"region": "eu-west", "gpu-type": "a100"}
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["restartPolicy"] in ("Never", "OnFailure")  # what a Job's Pod may have


def test_its_pod_passes_restricted_non_root_without_privileges() -> None:
    pod = job()["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert security["runAsNonRoot"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
