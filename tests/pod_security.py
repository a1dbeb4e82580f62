"""Which fields of a pod spec the `restricted` Pod Security Standard looks at, so that a unit test can say which
one a manifest lacks. Kubernetes' Pod Security Admission is what enforces the standard (the generated namespaces
only carry its labels); this is the checklist of https://kubernetes.io/docs/concepts/security/pod-security-standards/
(baseline's host namespaces, privileged, host paths and ports; restricted's volume types, privilege escalation,
non-root, seccomp and capabilities), read by the tests and nowhere else."""
from __future__ import annotations

from typing import Any

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in POD (a pod spec) the restricted standard refuses; [] when it passes."""
    found = [f"spec.{key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    pod_context = pod.get("securityContext") or {}
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {', '.join(sorted(kinds - RESTRICTED_VOLUMES))}")
    containers = [*(pod.get("initContainers") or []), *pod["containers"], *(pod.get("ephemeralContainers") or [])]
    for container in containers:
        name, context = container["name"], container.get("securityContext") or {}
        effective = {**pod_context, **context}  # a container's own setting wins over the pod's
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        if effective.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if effective.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if (effective.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile is not RuntimeDefault or Localhost")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if any(port.get("hostPort") for port in container.get("ports") or []):
            found.append(f"{name}: hostPort")
    return found
