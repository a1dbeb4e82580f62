"""coordination.k8s.io/v1 Lease documents (pure): the body we send, and what an API server sends back.

A Lease read back is untrusted input: anyone who may write Leases in the namespace can put anything
the API server's own validation lets through there (a holderIdentity of escape sequences, a lease of
68 years, no renewTime at all). `parse_lease` checks every field this package acts on, by type and
grammar, before anything decides on it; a document it cannot vouch for is a LeaseDocumentError that
says which field and why, never a guess.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from imagebuild.core.errors import ImagebuildError
from imagebuild.core.source import safe_text

API_VERSION = "coordination.k8s.io/v1"
KIND = "Lease"
# metav1.MicroTime as the API server writes it (RFC3339 with exactly six fractional digits).
MICRO_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)\.(\d{6})(Z|[+-]\d\d:\d\d)")
# Object names and namespaces: DNS-1123 subdomain (names), label (namespaces).
NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_RESOURCE_VERSION = re.compile(r"[0-9A-Za-z_.:-]{1,64}")  # opaque to clients; bounded before it is sent back
_UID = re.compile(r"[0-9a-fA-F-]{1,64}")
MAX_DURATION_S = 2**31 - 1  # int32, as the API has it
MAX_HOLDER = 1024
MAX_ANNOTATION = 4096


class LeaseDocumentError(ImagebuildError):
    """A Lease read back is not one this package can act on: which field, and why."""


@dataclass(frozen=True)
class Lease:
    """The fields of a Lease that decide who holds it, checked (parse_lease)."""

    namespace: str
    name: str
    uid: str
    resource_version: str
    holder: str | None  # None: nobody (absent, null or empty)
    duration_s: int | None
    acquire_time: float | None  # seconds since the epoch
    renew_time: float | None
    transitions: int
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def expires_at(self) -> float | None:
        """When the holder's claim ends (renewTime + leaseDurationSeconds); None when either is missing."""
        if self.renew_time is None or self.duration_s is None:
            return None
        return self.renew_time + self.duration_s


def format_micro_time(seconds: float) -> str:
    """Seconds since the epoch as metav1.MicroTime: 2026-01-02T03:04:05.678901Z."""
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_micro_time(text: str) -> float | None:
    """metav1.MicroTime (RFC3339, six fractional digits, a zone) -> seconds since the epoch; None if not one."""
    if not MICRO_TIME.fullmatch(text):
        return None
    try:
        when = dt.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:  # 2026-13-45 and the like
        return None
    return when.timestamp()


def lease_name(channel: str) -> str:
    """The Lease object of a channel: `imagebuild-rollout-<channel>` when the tag is already a valid name;
    else (capitals, underscores) a lower-cased form with a hash of the exact tag, marked by a dot no plain
    name can have there (a tag never starts with '.'), so two channels never share one."""
    plain = f"imagebuild-rollout-{channel}"
    if NAME.fullmatch(plain):
        return plain
    cleaned = re.sub(r"[^a-z0-9.-]+", "-", channel.lower()).strip(".-")[:100] or "channel"
    return f"imagebuild-rollout.{cleaned}.{hashlib.sha256(channel.encode()).hexdigest()[:16]}"


def lease_body(namespace: str, name: str, *, holder: str, duration_s: int, acquire_time: float, renew_time: float,
               transitions: int, annotations: Mapping[str, str], resource_version: str | None = None) -> dict[str, Any]:
    """The Lease to create (no resource_version) or to replace only if it is still at `resource_version`."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "annotations": dict(annotations),
                                "labels": {"app.kubernetes.io/managed-by": "imagebuild"}}
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration_s,
                     "acquireTime": format_micro_time(acquire_time), "renewTime": format_micro_time(renew_time),
                     "leaseTransitions": transitions}}


def _shown(value: Any) -> str:
    """A value read back, for a message: a string quoted, anything else as JSON would say it; escaped, bounded."""
    if isinstance(value, str):
        return f"'{safe_text(value, 80)}'"
    return "null" if value is None else safe_text(value, 80)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_lease(data: Any, where: str) -> Lease:
    """A Lease as an API server answered it, every field this package reads checked; else LeaseDocumentError
    naming `where` (namespace/name), the field and what is wrong with it (the value escaped and bounded)."""

    def refuse(key: str, problem: str) -> LeaseDocumentError:
        return LeaseDocumentError(f"lease {where}: {key} {problem}")

    if not isinstance(data, dict):
        raise refuse("document", "is not a JSON object")
    if data.get("apiVersion") != API_VERSION or data.get("kind") != KIND:
        raise refuse("document", f"is kind {_shown(data.get('kind'))} of {_shown(data.get('apiVersion'))}, "
                                 f"not a {API_VERSION} {KIND}")
    metadata, spec = data.get("metadata"), data.get("spec", {})
    if not isinstance(metadata, dict):
        raise refuse("metadata", "is not an object")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise refuse("spec", "is not an object")
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise refuse("metadata.name", f"{_shown(name)} is not an object name")
    if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
        raise refuse("metadata.namespace", f"{_shown(namespace)} is not a namespace")
    version, uid = metadata.get("resourceVersion"), metadata.get("uid")
    if not isinstance(version, str) or not _RESOURCE_VERSION.fullmatch(version):
        raise refuse("metadata.resourceVersion", f"{_shown(version)} is not a resource version")
    if not isinstance(uid, str) or not _UID.fullmatch(uid):
        raise refuse("metadata.uid", f"{_shown(uid)} is not a UID")
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_ANNOTATION for k, v in annotations.items()):
        raise refuse("metadata.annotations", f"is not a map of strings (each at most {MAX_ANNOTATION} characters)")

    holder = spec.get("holderIdentity")
    if holder is not None and not isinstance(holder, str):
        raise refuse("spec.holderIdentity", f"{_shown(holder)} is not a string")
    if holder is not None and len(holder) > MAX_HOLDER:
        raise refuse("spec.holderIdentity", f"is {len(holder)} characters long (at most {MAX_HOLDER})")
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not _int(duration) or not 0 < duration <= MAX_DURATION_S):
        raise refuse("spec.leaseDurationSeconds", f"{_shown(duration)} is not a whole number of seconds "
                                                  f"from 1 to {MAX_DURATION_S}")
    transitions = spec.get("leaseTransitions", 0)
    if transitions is None:
        transitions = 0
    if not _int(transitions) or not 0 <= transitions <= MAX_DURATION_S:
        raise refuse("spec.leaseTransitions", f"{_shown(transitions)} is not a count")
    times: dict[str, float | None] = {}
    for key in ("acquireTime", "renewTime"):
        value = spec.get(key)
        if value is None:
            times[key] = None
            continue
        parsed = parse_micro_time(value) if isinstance(value, str) else None
        if parsed is None:
            raise refuse(f"spec.{key}", f"{_shown(value)} is not an RFC3339 micro time "
                                        f"(2006-01-02T15:04:05.000000Z)")
        times[key] = parsed
    return Lease(namespace=namespace, name=name, uid=uid, resource_version=version, holder=holder or None,
                 duration_s=duration, acquire_time=times["acquireTime"], renew_time=times["renewTime"],
                 transitions=transitions, annotations=dict(annotations))
