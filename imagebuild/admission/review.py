"""AdmissionReview v1: read an untrusted request, find every image it would run, build the answer.

Pure: no sockets, no files, no registry. The verification itself is handed in as a function
(imagebuild.trust.verify.Verifier.verify in the webhook), so this module decides only how verdicts
become an answer: allowed when every image is; otherwise denied, naming each refused image
and why (warn mode admits and warns instead; an unreachable registry follows the failure policy).

Images are read from containers, init containers, ephemeral containers and image volumes
(`spec.volumes[].image.reference`). The mutating answer (`pin=True`, POST /mutate) adds a
JSONPatch that rewrites each admitted reference to the digest it was verified at
(`repo:tag@digest`, as Kyverno's mutateDigest does), so a tag moved after admission cannot
change what runs; in enforce mode an image that cannot be pinned is refused.

Anyone who can reach the webhook can send it anything, so the body is trusted in nothing: its
size is capped before it is parsed, nesting and the number of images are bounded, and every
value read is type-checked. A malformed body with a usable request.uid is denied with a
message that says what is wrong; without one there is nobody to answer, so it gets an HTTP 400.
"""
from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from imagebuild.core.errors import ImagebuildError
from imagebuild.core.source import safe_text
from imagebuild.oci import names, reference

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"


@dataclass(frozen=True)
class Limits:
    """What one AdmissionReview may hold. Real ones are far below: a Pod is a few KB, 10-20 levels deep."""

    max_body_bytes: int = 3 * 1024 * 1024  # the API server's own limit on a request body
    max_depth: int = 100  # nested objects and arrays; managedFields nest deepest
    max_images: int = 100  # image fields in one object (not distinct images)
    max_reference_length: int = 1024  # a registry host, a repository path, a tag and a digest fit easily


LIMITS = Limits()

# Where an object kind keeps its pod spec: (API group, kind) -> path of keys from the object.
POD_SPEC_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "Pod"): ("spec",),
    ("", "PodTemplate"): ("template", "spec"),
    ("", "ReplicationController"): ("spec", "template", "spec"),
    ("apps", "Deployment"): ("spec", "template", "spec"),
    ("apps", "StatefulSet"): ("spec", "template", "spec"),
    ("apps", "DaemonSet"): ("spec", "template", "spec"),
    ("apps", "ReplicaSet"): ("spec", "template", "spec"),
    ("batch", "Job"): ("spec", "template", "spec"),
    ("batch", "CronJob"): ("spec", "jobTemplate", "spec", "template", "spec"),
}
CONTAINER_FIELDS = ("initContainers", "containers", "ephemeralContainers")
VOLUME_FIELD = "volumes"  # an image volume: {name, image: {reference, pullPolicy}} (Kubernetes >= 1.31)
CHECKED_OPERATIONS = ("CREATE", "UPDATE")
OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
# A Pod's subresources that can change what it runs. Status updates and the like go through
# unchecked: refusing them would stop the kubelet reporting on a Pod admitted long ago.
CHECKED_SUBRESOURCES = ("", "ephemeralcontainers")

_MAX_REASON = 300  # characters of one verdict's reason kept in a message
_MAX_MESSAGE = 8000
_MAX_WARNING = 512  # kubectl shows every warning; the API server may cut those past 256 characters
_MAX_UID = 128
_UID = re.compile(r"[A-Za-z0-9._:-]+")
_UNPRINTABLE = re.compile(r"[^\x21-\x7e]")  # in an image reference: anything but visible ASCII


class ReviewRejected(ImagebuildError):
    """The body is not an AdmissionReview this webhook can judge; uid is None when nobody can be answered."""

    def __init__(self, message: str, uid: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.uid = uid


class Verdict(Protocol):
    """What admission reads from imagebuild.trust.verify.ImageVerdict."""

    @property
    def image(self) -> str: ...
    @property
    def digest(self) -> str | None: ...
    @property
    def allowed(self) -> bool: ...
    @property
    def reason(self) -> str: ...
    @property
    def unreachable(self) -> bool: ...


@dataclass(frozen=True)
class ContainerImage:
    """One image field: which kind of container (or volume), its name, the reference as written, and where."""

    field: str  # "container", "initContainer", "ephemeralContainer" or "volume"
    name: str
    image: str
    pointer: str = ""  # JSON pointer of the field in request.object, for the patch that pins it

    def describe(self) -> str:
        return f'{self.field} "{safe_text(self.name, 100)}" image {self.image}'


@dataclass(frozen=True)
class ReviewRequest:
    uid: str
    group: str
    kind: str
    operation: str
    namespace: str
    name: str
    images: tuple[ContainerImage, ...]
    skipped: str | None = None  # why nothing is checked (a DELETE, a kind without pods), or None
    # Pointers whose reference an UPDATE left as oldObject had it: not re-pinned, since changing the
    # image of a running Pod restarts its container and a template's starts a rollout.
    unchanged: frozenset[str] = frozenset()

    @property
    def distinct_images(self) -> list[str]:
        return list(dict.fromkeys(c.image for c in self.images))


@dataclass(frozen=True)
class Policy:
    """The trust configuration's two switches that shape the answer."""

    enforce: bool = True  # mode enforce; False = warn: admit, with warnings
    fail_closed: bool = True  # failure_policy fail; False = ignore: admit when the registry is unreachable


@dataclass(frozen=True)
class Finding:
    """The verdict on one image field, as logged and summed up."""

    container: ContainerImage
    digest: str | None
    allowed: bool
    reason: str
    unreachable: bool

    def line(self) -> str:
        return f"{self.container.describe()}: {safe_text(self.reason, _MAX_REASON)}"

    def to_dict(self) -> dict[str, Any]:
        return {"container": self.container.name, "field": self.container.field, "image": self.container.image,
                "digest": self.digest, "allowed": self.allowed, "reason": self.reason,
                "unreachable": self.unreachable}


@dataclass(frozen=True)
class Decision:
    allowed: bool
    message: str  # why it was denied; "" when allowed
    warnings: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    code: int = 200  # the status code in the response: 403 denied, 400 malformed
    patch: tuple[dict[str, str], ...] = ()  # JSONPatch operations pinning admitted images (mutate only)

    @property
    def outcome(self) -> str:
        if not self.allowed:
            return "denied"
        return "warned" if self.warnings else "allowed"


@dataclass(frozen=True)
class Outcome:
    """What the webhook sends back (HTTP status and JSON body) and the one log line it writes."""

    http_status: int
    body: dict[str, Any]
    log: dict[str, Any]


# --- parsing ---------------------------------------------------------------------------------------------------


def parse_review(body: bytes, limits: Limits = LIMITS) -> ReviewRequest:
    """The request of an AdmissionReview v1 body, with every image it would run; raises ReviewRejected."""
    document = _load_json(body, limits)
    if not isinstance(document, dict):
        raise ReviewRejected(f"the body is a JSON {_type_name(document)}, not an AdmissionReview object")
    request = document.get("request")
    if not isinstance(request, dict):
        raise ReviewRejected("request: missing, or not an object")
    uid = _uid(request.get("uid"))
    if document.get("apiVersion") != API_VERSION:
        raise ReviewRejected(f"apiVersion: expected {API_VERSION}, got {_show(document.get('apiVersion'))}", uid)
    if document.get("kind") != KIND:
        raise ReviewRejected(f"kind: expected {KIND}, got {_show(document.get('kind'))}", uid)
    return _parse_request(request, uid, limits)


def _load_json(body: bytes, limits: Limits) -> Any:
    if len(body) > limits.max_body_bytes:
        raise ReviewRejected(f"the body is {len(body)} bytes, more than the {limits.max_body_bytes} allowed")
    if not body.strip():
        raise ReviewRejected("the body is empty")
    try:
        text = body.decode("utf-8")
        document = json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as err:
        raise ReviewRejected(f"the body is not UTF-8 (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ReviewRejected(f"the body is not JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:  # json's decoder recurses once per level; Python's limit stops it first
        raise ReviewRejected(f"the body nests deeper than {limits.max_depth} levels") from None
    except ValueError as err:  # NaN/Infinity, an integer with thousands of digits
        raise ReviewRejected(f"the body is not JSON: {safe_text(str(err), 200)}") from None
    if _depth(document) > limits.max_depth:
        raise ReviewRejected(f"the body nests deeper than {limits.max_depth} levels")
    return document


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(document: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Iterable[Any] = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _uid(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ReviewRejected("request.uid: missing, or not a non-empty string")
    if len(value) > _MAX_UID or not _UID.fullmatch(value):
        raise ReviewRejected(f"request.uid: not a Kubernetes UID (at most {_MAX_UID} letters, digits and -._:)")
    return value


def _parse_request(request: dict[str, Any], uid: str, limits: Limits) -> ReviewRequest:
    kind_field = request.get("kind")
    if not isinstance(kind_field, dict):
        raise ReviewRejected("request.kind: missing, or not an object {group, version, kind}", uid)
    group = _string(kind_field, "group", "request.kind.group", uid, default="")
    kind = _string(kind_field, "kind", "request.kind.kind", uid)
    operation = _string(request, "operation", "request.operation", uid)
    if operation not in OPERATIONS:
        raise ReviewRejected(f"request.operation: expected one of {', '.join(OPERATIONS)}, got {_show(operation)}",
                             uid)
    subresource = _string(request, "subResource", "request.subResource", uid, default="")
    namespace = _string(request, "namespace", "request.namespace", uid, default="")
    name = _string(request, "name", "request.name", uid, default="")

    def skipped(why: str) -> ReviewRequest:
        return ReviewRequest(uid, group, kind, operation, namespace, name, (), skipped=why)

    if operation not in CHECKED_OPERATIONS:
        return skipped(f"{operation} runs no new image")
    path = POD_SPEC_PATHS.get((group, kind))
    if path is None:
        return skipped(f"{_kind_name(group, kind)} has no pod template this webhook knows")
    if subresource not in CHECKED_SUBRESOURCES:
        return skipped(f"subresource {safe_text(subresource, 64)} changes no image")
    obj = request.get("object")
    if not isinstance(obj, dict):
        raise ReviewRejected("request.object: missing, or not an object", uid)
    name = name or _object_name(obj)
    spec: Any = obj
    where = "request.object"
    for key in path:
        spec = spec.get(key) if isinstance(spec, dict) else None
        where = f"{where}.{key}"
        if not isinstance(spec, dict):
            raise ReviewRejected(f"{where}: missing, or not an object", uid)
    pointer = "".join(f"/{_escape_pointer(key)}" for key in path)
    images = tuple(_container_images(spec, where, pointer, uid, limits))
    unchanged = _unchanged(images, request.get("oldObject")) if operation == "UPDATE" else frozenset()
    return ReviewRequest(uid, group, kind, operation, namespace, name, images, unchanged=unchanged)


def _escape_pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unchanged(images: Sequence[ContainerImage], old: Any) -> frozenset[str]:
    """The pointers at which oldObject holds the very same reference (oldObject is read leniently:
    it only ever spares a field a patch; every image is verified whatever it says)."""
    same = set()
    for image in images:
        value = old
        for token in image.pointer.split("/")[1:]:
            key = token.replace("~1", "/").replace("~0", "~")
            if isinstance(value, dict):
                value = value.get(key)
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                value = None
                break
        if value == image.image:
            same.add(image.pointer)
    return frozenset(same)


def _object_name(obj: dict[str, Any]) -> str:
    """metadata.name, or generateName followed by `*` for an object whose name the API server picks."""
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict):
        return ""
    for key, suffix in (("name", ""), ("generateName", "*")):
        value = metadata.get(key)
        if isinstance(value, str) and value:
            return safe_text(value, 253) + suffix
    return ""


def _container_images(spec: dict[str, Any], where: str, pointer: str, uid: str,
                      limits: Limits) -> Iterable[ContainerImage]:
    count = 0
    for image in _field_images(spec, where, pointer, uid, limits):
        count += 1
        if count > limits.max_images:
            raise ReviewRejected(f"{where}: more than {limits.max_images} images in one object", uid)
        yield image


def _field_images(spec: dict[str, Any], where: str, pointer: str, uid: str,
                  limits: Limits) -> Iterable[ContainerImage]:
    for list_key in CONTAINER_FIELDS:
        containers = spec.get(list_key)
        if containers is None:
            continue
        if not isinstance(containers, list):
            raise ReviewRejected(f"{where}.{list_key}: not a list", uid)
        label = list_key[:-1] if list_key != "containers" else "container"
        for index, container in enumerate(containers):
            at = f"{where}.{list_key}[{index}]"
            if not isinstance(container, dict):
                raise ReviewRejected(f"{at}: not an object", uid)
            name = container.get("name", "")
            if not isinstance(name, str):
                raise ReviewRejected(f"{at}.name: not a string", uid)
            image = container.get("image")
            if not isinstance(image, str) or not image:
                raise ReviewRejected(f'{at}.image: {label} "{safe_text(name, 100)}" has no image', uid)
            _check_reference(image, f"{at}.image", uid, limits)
            yield ContainerImage(label, name, image, f"{pointer}/{list_key}/{index}/image")
    yield from _volume_images(spec, where, pointer, uid, limits)


def _volume_images(spec: dict[str, Any], where: str, pointer: str, uid: str,
                   limits: Limits) -> Iterable[ContainerImage]:
    """Image volumes: an OCI image or artifact mounted read-only, run by nobody but read by everyone."""
    volumes = spec.get(VOLUME_FIELD)
    if volumes is None:
        return
    if not isinstance(volumes, list):
        raise ReviewRejected(f"{where}.{VOLUME_FIELD}: not a list", uid)
    for index, volume in enumerate(volumes):
        at = f"{where}.{VOLUME_FIELD}[{index}]"
        if not isinstance(volume, dict):
            raise ReviewRejected(f"{at}: not an object", uid)
        source = volume.get("image")
        if source is None:
            continue  # another kind of volume
        name = volume.get("name", "")
        if not isinstance(name, str):
            raise ReviewRejected(f"{at}.name: not a string", uid)
        if not isinstance(source, dict):
            raise ReviewRejected(f"{at}.image: not an object", uid)
        reference = source.get("reference")
        if not isinstance(reference, str) or not reference:
            raise ReviewRejected(f'{at}.image.reference: volume "{safe_text(name, 100)}" has no image reference', uid)
        _check_reference(reference, f"{at}.image.reference", uid, limits)
        yield ContainerImage("volume", name, reference, f"{pointer}/{VOLUME_FIELD}/{index}/image/reference")


def _check_reference(image: str, at: str, uid: str, limits: Limits) -> None:
    if len(image) > limits.max_reference_length:
        raise ReviewRejected(f"{at}: longer than {limits.max_reference_length} characters", uid)
    if _UNPRINTABLE.search(image):
        raise ReviewRejected(f"{at}: {safe_text(ascii(image), 200)} is not an image reference", uid)


def _string(mapping: dict[str, Any], key: str, where: str, uid: str, default: str | None = None) -> str:
    value = mapping.get(key, default)
    if value is None and default is not None:  # a JSON null where the field is optional
        value = default
    if not isinstance(value, str):
        raise ReviewRejected(f"{where}: {'missing' if value is None else 'not a string'}", uid)
    return value


def _kind_name(group: str, kind: str) -> str:
    return safe_text(f"{group}/{kind}" if group else kind, 128)


def _type_name(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    """A value of the request quoted in a message: JSON, escaped, bounded."""
    if value is None:
        return "nothing"
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else f"a JSON {_type_name(value)}"
    return safe_text(text, 100)


# --- deciding --------------------------------------------------------------------------------------------------


def decide(request: ReviewRequest, verdicts: Mapping[str, Verdict], policy: Policy, pin: bool = False) -> Decision:
    """Allowed when every image is; warn mode and an ignored unreachable registry admit with warnings.

    With `pin`, an admitted image must also be pinnable (a verified digest) and the decision carries
    the JSONPatch that pins it; an image admitted only by warn mode or failure_policy ignore stays as written."""
    if request.skipped is not None:
        return Decision(True, "")
    findings = tuple(_finding(container, verdicts.get(container.image), pin) for container in request.images)
    admitted_unreachable = [f for f in findings if not f.allowed and f.unreachable and not policy.fail_closed]
    refused = [f for f in findings if not f.allowed and f not in admitted_unreachable]
    warnings = [_bounded(f"{f.line()} (admitted: failure_policy is ignore)", _MAX_WARNING)
                for f in admitted_unreachable]
    patch = tuple(_pin_patch(request, findings)) if pin else ()
    if not refused:
        return Decision(True, "", tuple(warnings), findings, patch=patch)
    if not policy.enforce:
        warnings += [_bounded(f"{f.line()} (admitted: mode is warn)", _MAX_WARNING) for f in refused]
        return Decision(True, "", tuple(warnings), findings, patch=patch)
    images = "image" if len(findings) == 1 else "images"
    message = f"imagebuild refused {len(refused)} of {len(findings)} {images}: " + "; ".join(f.line() for f in refused)
    return Decision(False, _bounded(message, _MAX_MESSAGE), tuple(warnings), findings, code=403)


def _finding(container: ContainerImage, verdict: Verdict | None, pin: bool = False) -> Finding:
    if verdict is None:  # the caller verified too little: refuse rather than admit unchecked
        return Finding(container, None, False, "not verified", False)
    finding = Finding(container, verdict.digest, verdict.allowed, verdict.reason or "no reason given",
                      verdict.unreachable)
    if pin and finding.allowed and pinned(container.image, verdict.digest) is None:
        return Finding(container, verdict.digest, False, "cannot be pinned: verified without a digest of its own "
                                                         f"({safe_text(str(verdict.digest), 80)})", False)
    return finding


def pinned(image: str, digest: str | None) -> str | None:
    """`image` rewritten to the digest it was verified at: repo:tag@digest or repo@digest (the tag kept
    for people, the digest for the runtime, which pulls by digest when both are given); None when
    that digest is no sha256 digest, or the reference already names another one."""
    if not names.is_sha256_digest(digest):
        return None
    try:
        written = reference.split(image).digest
    except reference.ReferenceError:
        return None
    if written is not None:
        return image if written == digest else None
    return f"{image}@{digest}"


def _pin_patch(request: ReviewRequest, findings: Sequence[Finding]) -> Iterable[dict[str, str]]:
    for finding in findings:
        target = pinned(finding.container.image, finding.digest) if finding.allowed else None
        if target is None or target == finding.container.image or finding.container.pointer in request.unchanged:
            continue
        yield {"op": "replace", "path": finding.container.pointer, "value": target}


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def response(uid: str, decision: Decision) -> dict[str, Any]:
    """The AdmissionReview v1 the API server expects back."""
    answer: dict[str, Any] = {"uid": uid, "allowed": decision.allowed}
    if not decision.allowed:
        reason = "BadRequest" if decision.code == 400 else "Forbidden"
        answer["status"] = {"code": decision.code, "reason": reason, "message": decision.message}
    if decision.warnings:
        answer["warnings"] = list(decision.warnings)
    if decision.allowed and decision.patch:
        answer["patchType"] = "JSONPatch"
        answer["patch"] = base64.b64encode(json.dumps(list(decision.patch)).encode()).decode("ascii")
    return {"apiVersion": API_VERSION, "kind": KIND, "response": answer}


# --- one review, start to end ----------------------------------------------------------------------------------


VerifyMany = Callable[[Sequence[str]], Mapping[str, Verdict]]


def review(body: bytes, verify: VerifyMany, policy: Policy, limits: Limits = LIMITS, pin: bool = False) -> Outcome:
    """Parse, verify every distinct image once (through `verify`), decide and answer; never raises on bad input.

    `pin`: the mutating webhook's answer, with the JSONPatch that pins every admitted image to its digest."""
    try:
        request = parse_review(body, limits)
    except ReviewRejected as err:
        return rejected(err)
    verdicts = verify(request.distinct_images) if request.images else {}
    decision = decide(request, verdicts, policy, pin)
    log = decision_log(request, decision)
    if pin:
        log["pinned"] = [op["value"] for op in decision.patch]
    return Outcome(200, response(request.uid, decision), log)


def rejected(err: ReviewRejected) -> Outcome:
    """A malformed body: denied when it has a uid to answer, else an HTTP 400 (the API server's failurePolicy)."""
    message = f"imagebuild: malformed AdmissionReview: {err.message}"
    log: dict[str, Any] = {"uid": err.uid, "decision": "malformed", "error": err.message}
    if err.uid is None:
        return Outcome(400, {"error": message}, log)
    return Outcome(200, response(err.uid, Decision(False, message, code=400)), {**log, "decision": "denied"})


def decision_log(request: ReviewRequest, decision: Decision) -> dict[str, Any]:
    """The one log line of a decision: who asked about what, and the verdict per image. Never the object itself."""
    log: dict[str, Any] = {
        "uid": request.uid, "kind": _kind_name(request.group, request.kind), "operation": request.operation,
        "object": f"{safe_text(request.namespace, 63)}/{safe_text(request.name, 256)}".lstrip("/"),
        "decision": decision.outcome, "images": [f.to_dict() for f in decision.findings],
    }
    if request.skipped is not None:
        log["skipped"] = request.skipped
    if decision.warnings:
        log["warnings"] = list(decision.warnings)
    return log
