"""Who is trusted to have built an image: the one configuration behind verify, the policies and the webhook.

A trust file (`policies/trust.yaml` in production, `examples/local/trust.yaml` for the local
example) names the public keys whose signatures count, the images the policy covers, and what
each image must carry besides its signature. `imagebuild verify`, `imagebuild policies generate`
and `imagebuild admission serve` all read it, so a policy in the cluster, the webhook and a
release engineer's check cannot disagree about what "trusted" means.

The file is untrusted input like a matrix: it goes through imagebuild.core.source, and any problem
is an InputError naming its file, line and key. Public keys are parsed here, so a truncated or
private key is refused before anything is verified with it.

Optional `quarantine: {registry: HOST[:PORT], repository: PATH, cache_ttl_seconds: 10}` names the
release's state repository (release.yaml `state:`), where `imagebuild rescan` and `imagebuild
quarantine` leave their marks (tag `quarantine-sha256-<hex>`): the webhook refuses a digest marked
there, and reads each digest's mark again once its cache_ttl_seconds (0-3600) have passed.
Without it, quarantine is enforced by rollouts only.

`webhook: {namespace, name, image, port}` describes imagebuild's own webhook as `policies generate`
writes its manifests; `image` is a reference (a tag, which generate pins to its digest, or a digest),
checked by generate, the one command that uses it, which also verifies that digest against this file.

`namespaces` lists the cluster's workload namespaces, which `policies generate` labels for Kubernetes'
Pod Security Admission (`pod-security.kubernetes.io/enforce`, `warn`, `audit` and their versions):
each entry a name (level `restricted`, version `latest`) or `{name, pod_security, version}`, with
`pod_security` one of POD_SECURITY_LEVELS and `version` `latest` or `v1.N`. Kubernetes' own
namespaces (`kube-*`) and the webhook's (labelled in its own manifests) cannot be listed.

`signed_identity` (`name`, the default, or `repository`) is what a signature's
`critical.identity.docker-reference` must share with the image it is found on: the image name
(the last path component; any project or registry, so promotions keep verifying) or the whole
repository path. Either way a signed image copied under another name is refused.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from imagebuild.core.source import Document, InputError, PathKey, Reader, known_list, load_document, suggest
from imagebuild.oci import reference

TRUST_SCHEMA = 1
# provenance: SLSA v1 provenance whose buildType is imagebuild's; release: imagebuild's release record
# (`require: {attestations: [provenance]}` is how a trust file requires provenance).
# openvex: the policy's exceptions as OpenVEX (`imagebuild vex attest`); `vex_current` asks that none of its
# statements has expired.
ATTESTATION_KINDS = ("sbom", "vuln", "smoke", "gate", "provenance", "release", "openvex")
SEVERITIES = ("UNKNOWN", "LOW", "MEDIUM", "HIGH", "CRITICAL")
_MAX_KEY_BYTES = 16 * 1024
# A repository glob: registry host[:port] then path segments; `*` and `**` are the only wildcards.
_GLOB_CHARS = re.compile(r"^[A-Za-z0-9._:/*\-\[\]]+$")


class Mode(str, Enum):
    ENFORCE = "enforce"  # refuse what fails verification
    WARN = "warn"  # admit, with a warning naming what failed

    def __str__(self) -> str:
        return self.value


class FailurePolicy(str, Enum):
    """What the webhook answers when it cannot reach a registry to verify."""

    FAIL = "fail"
    IGNORE = "ignore"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PublicKey:
    name: str
    pem: str
    source: str  # the file it was read from, or "inline"


@dataclass(frozen=True)
class Requirements:
    attestations: tuple[str, ...] = ()  # kinds from ATTESTATION_KINDS, each signed by a trusted key
    smoke_passed: bool = False  # the smoke attestation says passed, about this digest
    gate_passed: bool = False  # the gate attestation says passed, about this digest
    block_severity: str | None = None  # an unexcepted vulnerability at or above this refuses the image
    vex_current: bool = False  # an openvex attestation about this digest, none of its statements expired


@dataclass(frozen=True)
class WebhookSettings:
    namespace: str = "imagebuild-system"
    name: str = "imagebuild-admission"
    image: str = "registry.example.com/imagebuild/admission:latest"
    port: int = 8443
    image_line: int | None = field(default=None, compare=False)  # where the file names `image`; None: not named


POD_SECURITY_LEVELS = ("privileged", "baseline", "restricted")  # Kubernetes' Pod Security Standards


@dataclass(frozen=True)
class WorkloadNamespace:
    """A namespace labelled for Pod Security Admission at `pod_security` (enforce, warn and audit alike)."""

    name: str
    pod_security: str = "restricted"
    version: str = "latest"  # the standard's version (`v1.33`); `latest` follows the cluster


@dataclass(frozen=True)
class QuarantineSource:
    """The state repository holding quarantine marks, as the webhook reads them."""

    registry: str
    repository: str
    cache_ttl_seconds: int = 10  # a new mark refuses a digest at admission within this long


@dataclass(frozen=True)
class TrustConfig:
    path: Path
    mode: Mode
    keys: tuple[PublicKey, ...]
    images: tuple[str, ...]
    require: Requirements
    failure_policy: FailurePolicy = FailurePolicy.FAIL
    cache_ttl_seconds: int = 60
    webhook: WebhookSettings = WebhookSettings()
    quarantine: QuarantineSource | None = None
    signed_identity: str = "name"  # one of SIGNED_IDENTITIES: what a signature's docker-reference must match
    namespaces: tuple[WorkloadNamespace, ...] = ()  # labelled for Pod Security Admission by `policies generate`

    def covers(self, repository: str) -> bool:
        """Whether `registry/repository` (no tag or digest) falls under one of the image globs."""
        return any(glob_matches(pattern, repository) for pattern in self.images)


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """`**` matches any number of path segments (any text), `*` any text within one segment."""
    out = []
    for part in re.split(r"(\*\*|\*)", pattern):
        if part == "**":
            out.append(".*")
        elif part == "*":
            out.append("[^/]*")
        else:
            out.append(re.escape(part))
    return re.compile("".join(out) + r"\Z")


def glob_matches(pattern: str, repository: str) -> bool:
    return glob_to_regex(pattern).match(repository) is not None


_TOP_KEYS = ("schema", "mode", "keys", "images", "require", "failure_policy", "cache_ttl_seconds", "webhook",
             "quarantine", "signed_identity", "namespaces")
SIGNED_IDENTITIES = ("name", "repository")
_QUARANTINE_KEYS = ("registry", "repository", "cache_ttl_seconds")
_REGISTRY = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?")
_REPOSITORY = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_KEY_KEYS = ("name", "path", "pem")
_REQUIRE_KEYS = ("attestations", "smoke_passed", "gate_passed", "block_severity", "vex_current")
_WEBHOOK_KEYS = ("namespace", "name", "image", "port")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAMESPACE_KEYS = ("name", "pod_security", "version")
_POD_SECURITY_VERSION = re.compile(r"latest|v1\.(0|[1-9][0-9]{0,2})")


def load_trust_config(path: Path) -> TrustConfig:
    """Read and validate a trust file; raises InputError (file, line, key) on any problem."""
    return parse_trust_config(load_document(path), Path(path))


def parse_trust_config(doc: Document, path: Path) -> TrustConfig:
    r = Reader(doc)
    data = r.mapping(doc.data, (), allowed=_TOP_KEYS, required=("keys", "images"))
    if "schema" in data and r.integer(data["schema"], ("schema",)) != TRUST_SCHEMA:
        raise r.error(("schema",), f"unsupported schema {data['schema']} (this imagebuild reads schema {TRUST_SCHEMA})")
    mode = _choice(r, data.get("mode", "enforce"), ("mode",), Mode)
    keys = _keys(r, data["keys"], path.parent)
    images = _images(r, data["images"])
    require = _requirements(r, data.get("require") or {})
    failure = _choice(r, data.get("failure_policy", "fail"), ("failure_policy",), FailurePolicy)
    ttl = r.integer(data.get("cache_ttl_seconds", 60), ("cache_ttl_seconds",), minimum=0, maximum=86400)
    webhook = _webhook(r, data.get("webhook") or {})
    quarantine = _quarantine(r, data["quarantine"]) if data.get("quarantine") is not None else None
    identity = r.string(data.get("signed_identity", "name"), ("signed_identity",))
    if identity not in SIGNED_IDENTITIES:
        raise r.error(("signed_identity",), f"'{identity}' is not one of {known_list(SIGNED_IDENTITIES)}")
    namespaces = _namespaces(r, data["namespaces"], webhook) if data.get("namespaces") is not None else ()
    return TrustConfig(path=path, mode=mode, keys=keys, images=images, require=require,
                       failure_policy=failure, cache_ttl_seconds=ttl, webhook=webhook, quarantine=quarantine,
                       signed_identity=identity, namespaces=namespaces)


def trust_config_for_keys(keys: Sequence[Path], images: Sequence[str] = ("**",)) -> TrustConfig:
    """An ad-hoc configuration (`verify --key`): these keys, these images, no attestation required."""
    loaded = []
    for index, key_path in enumerate(keys):
        pem = _read_key_file(key_path, str(key_path), None, ("keys", index))
        loaded.append(PublicKey(name=Path(key_path).name, pem=pem, source=str(key_path)))
    return TrustConfig(path=Path("<command line>"), mode=Mode.ENFORCE, keys=tuple(loaded),
                       images=tuple(images), require=Requirements())


def _choice(r: Reader, value: Any, path: PathKey, enum: type[Mode] | type[FailurePolicy]) -> Any:
    text = r.string(value, path)
    words = [member.value for member in enum]
    if text not in words:
        raise r.error(path, f"unknown value '{text}'{suggest(text, words)} (one of {known_list(words)})")
    return enum(text)


def _keys(r: Reader, value: Any, base: Path) -> tuple[PublicKey, ...]:
    keys: list[PublicKey] = []
    names: set[str] = set()
    for index, item in enumerate(r.sequence(value, ("keys",), non_empty=True)):
        at: PathKey = ("keys", index)
        entry = r.mapping(item, at, allowed=_KEY_KEYS, required=("name",))
        name = r.string(entry["name"], at + ("name",))
        if name in names:
            raise r.error(at + ("name",), f"duplicate key name '{name}'")
        names.add(name)
        if ("path" in entry) == ("pem" in entry):
            raise r.error(at, "give exactly one of 'path' (a PEM file) or 'pem' (the key itself)")
        if "path" in entry:
            file = Path(r.string(entry["path"], at + ("path",)))
            file = file if file.is_absolute() else base / file
            pem = _read_key_file(file, r.doc.file, r, at + ("path",))
            source = str(file)
        else:
            pem = r.string(entry["pem"], at + ("pem",))
            source = "inline"
        _check_public_key(pem, r, at + ("pem" if source == "inline" else "path",), r.doc.file)
        keys.append(PublicKey(name=name, pem=pem.strip() + "\n", source=source))
    return tuple(keys)


def _read_key_file(file: Path, display: str, r: Reader | None, at: PathKey) -> str:
    def refuse(message: str) -> InputError:
        return r.error(at, message) if r else InputError(str(file), None, "", message)

    try:
        with open(file, "rb") as stream:
            raw = stream.read(_MAX_KEY_BYTES + 1)
    except FileNotFoundError:
        raise refuse(f"public key file not found: {file}") from None
    except OSError as exc:
        raise refuse(f"cannot read public key {file}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_KEY_BYTES:
        raise refuse(f"{file} is larger than {_MAX_KEY_BYTES:,} bytes; not a public key")
    try:
        pem = raw.decode("ascii")
    except UnicodeDecodeError:
        raise refuse(f"{file} is not a PEM file") from None
    if r is None:
        _check_public_key(pem, None, at, str(file))
    return pem


def _check_public_key(pem: str, r: Reader | None, at: PathKey, display: str) -> None:
    # Never echo key material back: a private key pasted here by mistake must not reach a log.
    def refuse(message: str) -> InputError:
        return r.error(at, message) if r else InputError(display, None, "", message)

    if "PRIVATE KEY" in pem:
        raise refuse("this is a private key; give the public key (cosign.pub)")
    try:
        key = load_pem_public_key(pem.strip().encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise refuse("not a PEM public key (expected -----BEGIN PUBLIC KEY-----)") from None
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey, rsa.RSAPublicKey)):
        raise refuse("unsupported key type (ECDSA, Ed25519 and RSA keys are supported)")


def _images(r: Reader, value: Any) -> tuple[str, ...]:
    patterns = []
    for index, item in enumerate(r.sequence(value, ("images",), non_empty=True)):
        at: PathKey = ("images", index)
        pattern = r.string(item, at)
        if not _GLOB_CHARS.match(pattern):
            raise r.error(at, f"'{pattern}' is not a repository glob (registry/path, with * and ** only)")
        if "@" in pattern or re.search(r"/[^/]*:[^/]*$", pattern):
            raise r.error(at, "globs name repositories; leave out tags and digests")
        patterns.append(_normal_glob_host(r, at, pattern))
    return tuple(patterns)


def _normal_glob_host(r: Reader, at: PathKey, pattern: str) -> str:
    """The glob with its literal registry host in the normal form the webhook compares against
    (lower case, no default :443, Docker Hub as docker.io): `Harbor.example.com:443/x/**` would
    otherwise never match, and the generated policies would cover other spellings than verify."""
    host, slash, rest = pattern.partition("/")
    if not slash or "*" in host or "[" in host:
        return pattern
    try:
        normal = reference.normalise_host(host)
    except reference.ReferenceError as exc:
        raise r.error(at, f"'{pattern}': {exc}") from None
    return f"{reference.DOCKER_HUB_NAME if normal in reference.DOCKER_HUB_ALIASES else normal}/{rest}"


def _requirements(r: Reader, value: Any) -> Requirements:
    data = r.mapping(value, ("require",), allowed=_REQUIRE_KEYS)
    kinds: list[str] = []
    for index, item in enumerate(r.sequence(data.get("attestations") or [], ("require", "attestations"))):
        kind = r.string(item, ("require", "attestations", index))
        if kind not in ATTESTATION_KINDS:
            raise r.error(("require", "attestations", index),
                          f"unknown attestation '{kind}'{suggest(kind, ATTESTATION_KINDS)} "
                          f"(one of {known_list(ATTESTATION_KINDS)})")
        if kind in kinds:
            raise r.error(("require", "attestations", index), f"'{kind}' is listed twice")
        kinds.append(kind)
    smoke = r.boolean(data["smoke_passed"], ("require", "smoke_passed")) if "smoke_passed" in data else False
    gate = r.boolean(data["gate_passed"], ("require", "gate_passed")) if "gate_passed" in data else False
    severity = None
    if data.get("block_severity") is not None:
        severity = r.string(data["block_severity"], ("require", "block_severity")).upper()
        if severity not in SEVERITIES:
            raise r.error(("require", "block_severity"), f"unknown severity '{data['block_severity']}'"
                                                         f"{suggest(severity, SEVERITIES)} (one of {known_list(SEVERITIES)})")
    vex_current = r.boolean(data["vex_current"], ("require", "vex_current")) if "vex_current" in data else False
    # A requirement on an attestation's content needs that attestation.
    for needed, flag in (("smoke", smoke), ("gate", gate), ("vuln", severity is not None), ("openvex", vex_current)):
        if flag and needed not in kinds:
            kinds.append(needed)
    if severity is not None and "gate" not in kinds:
        kinds.append("gate")  # the exceptions the gate applied decide what is "unexcepted"
    return Requirements(attestations=tuple(kinds), smoke_passed=smoke, gate_passed=gate, block_severity=severity,
                        vex_current=vex_current)


def _webhook(r: Reader, value: Any) -> WebhookSettings:
    data = r.mapping(value, ("webhook",), allowed=_WEBHOOK_KEYS)
    defaults = WebhookSettings()
    namespace = r.string(data.get("namespace", defaults.namespace), ("webhook", "namespace"))
    name = r.string(data.get("name", defaults.name), ("webhook", "name"))
    for key, text in (("namespace", namespace), ("name", name)):
        if not _DNS_LABEL.match(text):
            raise r.error(("webhook", key), f"'{text}' is not a Kubernetes name (lower-case letters, digits, '-')")
    image = r.string(data.get("image", defaults.image), ("webhook", "image"))
    if any(c.isspace() for c in image):
        raise r.error(("webhook", "image"), "an image reference has no spaces")
    port = r.integer(data.get("port", defaults.port), ("webhook", "port"), minimum=1, maximum=65535)
    line = r.doc.line(("webhook", "image")) if "image" in data else None
    return WebhookSettings(namespace=namespace, name=name, image=image, port=port, image_line=line)


def _namespaces(r: Reader, value: Any, webhook: WebhookSettings) -> tuple[WorkloadNamespace, ...]:
    found: list[WorkloadNamespace] = []
    for index, item in enumerate(r.sequence(value, ("namespaces",))):
        at: PathKey = ("namespaces", index)
        named = isinstance(item, dict)  # {name, pod_security, version}, or the name alone
        entry = r.mapping(item, at, allowed=_NAMESPACE_KEYS, required=("name",)) if named else {"name": item}
        where = at + ("name",) if named else at
        name = r.string(entry["name"], where)
        if not _DNS_LABEL.match(name):
            raise r.error(where, f"'{name}' is not a Kubernetes name (lower-case letters, digits, '-')")
        if name.startswith("kube-"):
            raise r.error(where, f"'{name}' is one of Kubernetes' own namespaces (kube-*); list workload namespaces")
        if name == webhook.namespace:
            raise r.error(where, f"'{name}' is the webhook's own namespace, labelled restricted with its manifests")
        if any(known.name == name for known in found):
            raise r.error(where, f"'{name}' is listed twice")
        level = r.string(entry.get("pod_security", "restricted"), at + ("pod_security",))
        if level not in POD_SECURITY_LEVELS:
            raise r.error(at + ("pod_security",), f"unknown level '{level}'{suggest(level, POD_SECURITY_LEVELS)} "
                                                  f"(one of {known_list(POD_SECURITY_LEVELS)})")
        version = r.string(entry.get("version", "latest"), at + ("version",))
        if not _POD_SECURITY_VERSION.fullmatch(version):
            raise r.error(at + ("version",), f"'{version}' is not a Pod Security version (latest, or v1.N)")
        found.append(WorkloadNamespace(name=name, pod_security=level, version=version))
    return tuple(found)


def _quarantine(r: Reader, value: Any) -> QuarantineSource:
    data = r.mapping(value, ("quarantine",), allowed=_QUARANTINE_KEYS, required=("registry", "repository"))
    registry = r.string(data["registry"], ("quarantine", "registry"))
    if not _REGISTRY.fullmatch(registry):
        raise r.error(("quarantine", "registry"), f"'{registry}' is not a registry host[:port]")
    repository = r.string(data["repository"], ("quarantine", "repository"))
    if not _REPOSITORY.fullmatch(repository) or len(repository) > 255:
        raise r.error(("quarantine", "repository"), f"'{repository}' is not a repository name (lower-case path)")
    ttl = r.integer(data.get("cache_ttl_seconds", 10), ("quarantine", "cache_ttl_seconds"), minimum=0, maximum=3600)
    return QuarantineSource(registry=registry, repository=repository, cache_ttl_seconds=ttl)
