"""imagebuild verify: cosign signatures and attestations, checked in-process against the trust config.

The checks are cosign v2's for key-based signatures, done here with `cryptography` instead of
one cosign run per image (the admission webhook verifies on every Pod):

- the tag is resolved to its manifest digest (every time: a moved tag must never hit the cache);
- `<repo>:sha256-<hex>.sig` holds one layer per signature: a simplesigning payload whose blob
  must match its descriptor's digest, whose `dev.cosignproject.cosign/signature` annotation must
  verify over the blob's bytes with one of the configured keys, and whose
  `critical.image.docker-manifest-digest` must be the resolved digest (which is what defeats a
  signature copied from another image, and a tag moved to another digest);
- `<repo>:sha256-<hex>.att` holds one DSSE envelope per attestation: signed over
  PAE(payloadType, payload) by one of the keys, an in-toto statement whose subject is this digest.

Then the TrustConfig's requirements over the attestations (present, smoke and gate passed on this
very digest, no unexcepted vulnerability at or above block_severity). The pure checks come first
in this module; `Verifier` does the registry I/O and caches verdicts by digest for a TTL.
"""
from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from dataclasses import field as dataclass_field
from functools import partial
from typing import Any, TypeVar

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from .attest import (
    PREDICATE_GATE,
    PREDICATE_PROVENANCE,
    PREDICATE_RELEASE,
    PREDICATE_SBOM,
    PREDICATE_SMOKE,
    PREDICATE_VULN,
)
from .oci_retry import QUICK_RETRIES
from .provenance import provenance_problems, release_problems
from .registry import DOCKER_HUB, ImageRef, Registry, RegistryError, RegistryUnreachable
from .source import InputError
from .trust import PublicKey, Requirements, TrustConfig

SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
SIMPLESIGNING_TYPE = "cosign container image signature"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
IN_TOTO_STATEMENTS = ("https://in-toto.io/Statement/v0.1", "https://in-toto.io/Statement/v1")

# The predicate types `imagebuild sign` attests, by the names the trust config's require.attestations uses.
ATTESTATION_TYPES = {"sbom": PREDICATE_SBOM, "vuln": PREDICATE_VULN, "smoke": PREDICATE_SMOKE, "gate": PREDICATE_GATE,
                     "provenance": PREDICATE_PROVENANCE, "release": PREDICATE_RELEASE}
SEVERITIES = ("UNKNOWN", "LOW", "MEDIUM", "HIGH", "CRITICAL")

# What a registry may make us read: everything it serves is untrusted. SBOMs of the CUDA images
# are the largest blobs (a few MB, a third more as base64 in the envelope).
MAX_MANIFEST_BYTES = 4 << 20
MAX_SIGNATURE_BLOB_BYTES = 1 << 20
MAX_ATTESTATION_BLOB_BYTES = 64 << 20
MAX_LAYERS = 256
READ_CONCURRENCY = 8  # reads in flight for one verification (and across a webhook's)


class Refused(Exception):
    """The image is refused; `reason` is the verdict's one line."""

    def __init__(self, reason: str, key: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.key = key


@dataclass(frozen=True)
class ImageVerdict:
    image: str  # as asked (tag or digest ref)
    digest: str | None  # resolved manifest digest, None when it could not be resolved
    allowed: bool
    reason: str  # one line: why refused, or what was verified
    key: str | None = None  # name of the key that verified the signature
    unreachable: bool = False  # the registry could not be reached (the webhook applies failure_policy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- image references --------------------------------------------------------------------------

_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?")
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")


def parse_image(text: str) -> ImageRef:
    """A tag or digest reference, with Docker's defaults; ValueError saying what is wrong with it."""
    if not text or len(text) > 1024 or text != text.strip():
        raise ValueError("empty, over 1024 characters, or padded with spaces")
    ref = ImageRef.parse(text)
    if not _HOST.fullmatch(ref.registry):
        raise ValueError(f"registry '{ref.registry}' is not a host[:port]")
    if not _REPOSITORY.fullmatch(ref.repository) or len(ref.repository) > 255:
        raise ValueError(f"repository '{ref.repository}' is not lowercase path components")
    if ref.tag is not None and not _TAG.fullmatch(ref.tag):
        raise ValueError(f"tag '{ref.tag}' is not a valid tag")
    if ref.digest is not None and not _DIGEST.fullmatch(ref.digest):
        raise ValueError(f"digest '{ref.digest}' is not sha256:<64 hex digits>")
    return ref


def signature_tag(digest: str, suffix: str) -> str:
    """cosign's tag scheme: sha256:<hex> -> sha256-<hex>.sig (or .att)."""
    return digest.replace(":", "-", 1) + suffix


# --- keys and signatures -----------------------------------------------------------------------

VerificationKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey

# cosign's default hash is SHA-256 whatever the curve; newer sigstore code picks the curve's own.
_EC_HASHES: dict[str, tuple[type[hashes.HashAlgorithm], ...]] = {
    "secp256r1": (hashes.SHA256,),
    "secp384r1": (hashes.SHA384, hashes.SHA256),
    "secp521r1": (hashes.SHA512, hashes.SHA256),
}


@dataclass(frozen=True)
class Key:
    name: str
    public_key: VerificationKey


def load_key(key: PublicKey) -> Key:
    """A configured PEM public key; InputError (naming where it came from) when it is not one we verify with."""
    try:
        loaded = serialization.load_pem_public_key(key.pem.encode())
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise InputError(key.source, None, f"keys: {key.name}", f"not a PEM public key ({exc})") from None
    if isinstance(loaded, ec.EllipticCurvePublicKey) and loaded.curve.name in _EC_HASHES:
        return Key(key.name, loaded)
    if isinstance(loaded, (ed25519.Ed25519PublicKey, rsa.RSAPublicKey)):
        return Key(key.name, loaded)
    raise InputError(key.source, None, f"keys: {key.name}",
                     "unsupported key type (ECDSA P-256/P-384/P-521, Ed25519 or RSA)")


def signature_verifies(key: VerificationKey, signature: bytes, message: bytes) -> bool:
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            for algorithm in _EC_HASHES[key.curve.name]:
                try:
                    key.verify(signature, message, ec.ECDSA(algorithm()))
                    return True
                except InvalidSignature:
                    continue
            return False
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
            return True
        try:
            key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            key.verify(signature, message, padding.PSS(padding.MGF1(hashes.SHA256()), padding.PSS.AUTO),
                       hashes.SHA256())
        return True
    except (InvalidSignature, ValueError):
        return False


def key_that_signed(keys: Iterable[Key], signature: bytes, message: bytes) -> Key | None:
    """The first configured key the signature verifies with (any one suffices: key rotation)."""
    return next((key for key in keys if signature_verifies(key.public_key, signature, message)), None)


def decode_base64(text: object) -> bytes:
    """Standard or URL-safe base64 (DSSE allows either); ValueError otherwise."""
    if not isinstance(text, str):
        raise ValueError("not a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        try:
            return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except binascii.Error as exc:
            raise ValueError(f"not base64 ({exc})") from None


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what an envelope's signature is over."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def check_blob(descriptor: Mapping[str, Any], blob: bytes) -> None:
    """The blob is the one the (signed-for) manifest names: its sha256 and size match the descriptor."""
    actual = "sha256:" + hashlib.sha256(blob).hexdigest()
    if descriptor.get("digest") != actual:
        raise Refused(f"blob {descriptor.get('digest')} does not match its content ({actual})")
    if "size" in descriptor and descriptor["size"] != len(blob):
        raise Refused(f"blob {actual} is {len(blob)} bytes, its descriptor says {descriptor['size']}")


def check_simple_signing(payload: bytes, digest: str) -> None:
    """cosign's claim check: the signed payload names this very manifest digest."""
    try:
        document = json.loads(payload)
        critical = document["critical"]
        signed_digest = critical["image"]["docker-manifest-digest"]
        kind = critical["type"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise Refused("signature payload is not a cosign simplesigning document") from None
    if kind != SIMPLESIGNING_TYPE:
        raise Refused(f"signature payload has type '{kind}', not '{SIMPLESIGNING_TYPE}'")
    if signed_digest != digest:
        raise Refused(f"the signature is for {signed_digest}, not this image's digest {digest} "
                      "(copied from another image, or the tag moved)")


@dataclass(frozen=True)
class Attestation:
    predicate_type: str
    predicate: Any
    key: str  # the key the envelope verified with


def open_envelope(blob: bytes, keys: Iterable[Key], digest: str) -> Attestation:
    """A DSSE envelope signed by one of the keys, holding an in-toto statement about this digest."""
    try:
        envelope = json.loads(blob)
        payload_type = envelope["payloadType"]
        payload = decode_base64(envelope["payload"])
        signatures = [decode_base64(entry["sig"]) for entry in envelope["signatures"]]
        if not isinstance(payload_type, str):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise Refused("an attestation layer is not a DSSE envelope") from None
    message = pae(payload_type, payload)
    key = next((k for sig in signatures if (k := key_that_signed(keys, sig, message))), None)
    if key is None:
        raise Refused("an attestation is not signed by any configured key" + _claimed_kind(payload))
    if payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise Refused(f"an attestation has payloadType '{payload_type}', not in-toto")
    try:
        statement = json.loads(payload)
        statement_type = statement["_type"]
        predicate_type = statement["predicateType"]
        subjects = [subject["digest"] for subject in statement["subject"]]
        predicate = statement.get("predicate")
        if not isinstance(predicate_type, str) or not all(isinstance(s, dict) for s in subjects):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise Refused("an attestation's payload is not an in-toto statement") from None
    if statement_type not in IN_TOTO_STATEMENTS:
        raise Refused(f"an attestation's statement type '{statement_type}' is not in-toto's")
    algorithm, _, hex_digest = digest.partition(":")
    if not any(subject.get(algorithm) == hex_digest for subject in subjects):
        named = ", ".join(f"{a}:{h}" for s in subjects for a, h in s.items()) or "nothing"
        raise Refused(f"the {kind_name(predicate_type)} attestation is about {named}, not {digest}", key.name)
    return Attestation(predicate_type, predicate, key.name)


def _claimed_kind(payload: bytes) -> str:
    """What an unverified statement says it is, for the message only (nothing else is read from it)."""
    try:
        claimed = json.loads(payload).get("predicateType")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return f" (it claims to be {kind_name(claimed)})" if isinstance(claimed, str) else ""


def kind_name(predicate_type: str) -> str:
    return next((name for name, uri in ATTESTATION_TYPES.items() if uri == predicate_type), predicate_type)


# --- the policy over the attestations (pure) ---------------------------------------------------


@dataclass(frozen=True)
class Finding:
    vulnerability: str
    package: str
    severity: str


def severity_rank(severity: object) -> int:
    text = str(severity).upper()
    return SEVERITIES.index(text) if text in SEVERITIES else 0


def vulnerabilities(vuln_predicate: Any) -> list[Finding]:
    """Every vulnerability of cosign's vuln predicate (scanner.result is a Trivy JSON report)."""
    try:
        results = vuln_predicate["scanner"]["result"].get("Results") or []
        found = []
        for result in results:
            for entry in result.get("Vulnerabilities") or []:
                found.append(Finding(str(entry["VulnerabilityID"]), str(entry.get("PkgName", "")),
                                     str(entry.get("Severity", "UNKNOWN")).upper()))
        return found
    except (KeyError, TypeError, AttributeError):
        raise Refused("the vuln attestation's predicate is not cosign's vuln shape with a Trivy report") from None


def is_excepted(finding: Finding, exceptions: Any, today: dt.date) -> bool:
    """Excepted by an unexpired gate exception for its id (and package, when the exception names one)."""
    for exception in exceptions if isinstance(exceptions, list) else []:
        if not isinstance(exception, dict) or exception.get("id") != finding.vulnerability:
            continue
        if exception.get("package") and exception["package"] != finding.package:
            continue
        try:
            if exception.get("expires") and dt.date.fromisoformat(str(exception["expires"])) < today:
                continue
        except ValueError:
            continue
        return True
    return False


def blocking_findings(vuln_predicate: Any, exceptions: Any, block_severity: str, today: dt.date) -> list[Finding]:
    threshold = severity_rank(block_severity)
    return [f for f in vulnerabilities(vuln_predicate)
            if severity_rank(f.severity) >= threshold and not is_excepted(f, exceptions, today)]


def _predicate_field(attestation: Attestation, field: str) -> Any:
    return attestation.predicate.get(field) if isinstance(attestation.predicate, dict) else None


def requirement_failures(require: Requirements, attestations: Mapping[str, Attestation], digest: str,
                         today: dt.date) -> list[str]:
    """Why the attestations (by predicate type, each already verified) do not satisfy the requirements."""
    failures = []
    missing = [kind for kind in require.attestations if ATTESTATION_TYPES.get(kind, kind) not in attestations]
    if missing:
        failures.append(f"attestations missing: {', '.join(missing)}")
    smoke = attestations.get(ATTESTATION_TYPES["smoke"])
    gate = attestations.get(ATTESTATION_TYPES["gate"])
    for wanted, name, attestation, field, good in (
            (require.smoke_passed, "smoke", smoke, "status", "passed"),
            (require.gate_passed, "gate", gate, "decision", "passed")):
        if not wanted:
            continue
        if attestation is None:
            if name not in missing:
                failures.append(f"no {name} attestation")
        elif _predicate_field(attestation, "digest") != digest:
            failures.append(f"the {name} attestation's results are for {_predicate_field(attestation, 'digest')}, "
                            f"not {digest}")
        elif _predicate_field(attestation, field) != good:
            failures.append(f"the {name} attestation says {field} {_predicate_field(attestation, field)}")
    # A required provenance must be imagebuild's build (its buildType), a required release record
    # must be about this digest and point to the provenance beside it.
    provenance = attestations.get(ATTESTATION_TYPES["provenance"])
    if "provenance" in require.attestations and provenance is not None:
        failures += provenance_problems(provenance.predicate)
    release = attestations.get(ATTESTATION_TYPES["release"])
    if "release" in require.attestations and release is not None:
        failures += release_problems(release.predicate, provenance.predicate if provenance else None, digest)
    if require.block_severity:
        vuln = attestations.get(ATTESTATION_TYPES["vuln"])
        if vuln is None:
            if "vuln" not in missing:
                failures.append(f"no vuln attestation to check block_severity {require.block_severity} against")
        else:
            # Only the gate's decision for this very digest can excuse a finding.
            exceptions = (_predicate_field(gate, "exceptions_applied")
                          if gate is not None and _predicate_field(gate, "digest") == digest else [])
            try:
                blocking = blocking_findings(vuln.predicate, exceptions, require.block_severity, today)
            except Refused as refused:
                blocking, failures = [], [*failures, refused.reason]
            if blocking:
                named = ", ".join(f"{f.vulnerability} ({f.package}, {f.severity})" for f in blocking[:3])
                more = f" and {len(blocking) - 3} more" if len(blocking) > 3 else ""
                failures.append(f"unexcepted vulnerabilities at or above {require.block_severity.upper()} "
                                f"in the vuln attestation: {named}{more}")
    return failures


def needs_attestations(require: Requirements) -> bool:
    return bool(require.attestations or require.smoke_passed or require.gate_passed or require.block_severity)


# --- the verifier (registry I/O, cache) --------------------------------------------------------


@dataclass(frozen=True)
class Inspection:
    """An image's signature and every attestation that verified, for reading (`imagebuild inspect`)."""

    image: str
    digest: str | None
    key: str | None  # the key the image's signature verified with; None when it did not
    problem: str | None  # why the image itself is not verified (unsigned, not covered, unreachable)
    attestations: dict[str, Attestation]  # verified (signed by a key, about this digest), by predicate type
    rejected: tuple[str, ...] = ()  # attestations that did not verify, and why
    unreachable: bool = False


@dataclass
class Evidence:
    """What one verification read, every byte checked against its digest: the signature and
    attestation manifests by tag, their blobs by digest, and the kinds of the attestations that
    verified. Push copies these very bytes, so the target receives exactly what was verified."""

    manifests: dict[str, tuple[bytes, str, str]] = dataclass_field(default_factory=dict)  # tag -> (raw, media type, digest)
    blobs: dict[str, bytes] = dataclass_field(default_factory=dict)  # digest -> content
    attestation_kinds: tuple[str, ...] = ()


_Fetched = tuple[bytes, str, str] | None | RegistryError
_Checked = TypeVar("_Checked", "Key", "Attestation")


class _Reads:
    """One verification's registry reads. The signature and attestation manifests, then every blob
    they name, are fetched concurrently up front: two round trips instead of one per blob (a
    release image carries six attestations). The checks then run in order over what was read; a
    failed read is kept and raised where the check reaches it, as if it had been read then."""

    def __init__(self, registry: Registry, repository: str, pool: ThreadPoolExecutor,
                 known_blobs: Mapping[str, bytes] | None = None):
        self.registry, self.repository, self.pool = registry, repository, pool
        self.known_blobs = known_blobs or {}
        self._manifests: dict[str, _Fetched] = {}
        self._blobs: dict[str, bytes | RegistryError] = {}

    def prefetch(self, tags_and_limits: Mapping[str, int]) -> None:
        """Read the manifests of `tags` and the blobs of their signature or DSSE layers (within each tag's limit)."""
        tags = list(tags_and_limits)
        for tag, found in zip(tags, self.pool.map(self._fetch_manifest, tags)):
            self._manifests[tag] = found
        wanted = {digest: limit for tag, limit in tags_and_limits.items() for digest in self._blob_candidates(tag, limit)}
        for digest, blob in zip(wanted, self.pool.map(lambda d: self._fetch_blob(d, wanted[d]), wanted)):
            self._blobs[digest] = blob

    def _blob_candidates(self, tag: str, limit: int) -> list[str]:
        """The blobs of the tag's signature or DSSE layers within `limit`: what the checks will read.
        Lenient: a manifest the checks will refuse gives none, and the checks say why."""
        found = self._manifests.get(tag)
        if not isinstance(found, tuple) or len(found[0]) > MAX_MANIFEST_BYTES:
            return []
        try:
            layers = json.loads(found[0]).get("layers") or []
        except (ValueError, AttributeError, RecursionError):
            return []
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
            return []
        return [layer["digest"] for layer in layers
                if isinstance(layer, dict) and isinstance(layer.get("digest"), str) and _DIGEST.fullmatch(layer["digest"])
                and isinstance(layer.get("size"), int) and layer["size"] <= limit
                and (layer.get("mediaType") == DSSE_MEDIA_TYPE
                     or SIGNATURE_ANNOTATION in (layer.get("annotations") or {}))]

    def _fetch_manifest(self, tag: str) -> _Fetched:
        try:
            return self.registry.find_manifest(self.repository, tag)
        except RegistryError as exc:
            return exc

    def _fetch_blob(self, digest: str, limit: int) -> bytes | RegistryError:
        try:
            known = self.known_blobs.get(digest)
            if known is not None and "sha256:" + hashlib.sha256(known).hexdigest() == digest:
                # Bytes with this digest are in hand (read and checked moments ago elsewhere): the
                # registry need only say it holds a blob of that digest and size.
                size = self.registry.blob_size(self.repository, digest)
                if size == len(known):
                    return known
                raise RegistryError(f"{self.registry.registry}/{self.repository}@{digest}: blob "
                                    f"{'missing' if size is None else f'of {size} bytes, not {len(known)}'}",
                                    registry=self.registry.registry, repository=self.repository,
                                    operation="HEAD blob", status=404 if size is None else None)
            return self.registry.get_blob_limited(self.repository, digest, limit)
        except RegistryError as exc:
            return exc

    def manifest(self, tag: str) -> tuple[bytes, str, str] | None:
        found = self._manifests[tag] if tag in self._manifests else self._fetch_manifest(tag)
        self._manifests[tag] = found
        if isinstance(found, RegistryError):
            raise found
        return found

    def blob(self, digest: str, limit: int) -> bytes:
        blob = self._blobs.get(digest)
        if blob is None:
            blob = self._blobs[digest] = self._fetch_blob(digest, limit)
        if isinstance(blob, RegistryError):
            raise blob
        return blob

    def found_manifests(self) -> dict[str, tuple[bytes, str, str]]:
        """The manifests read, by tag (absent ones and failed reads left out)."""
        return {tag: found for tag, found in self._manifests.items() if isinstance(found, tuple)}


class Verifier:
    """Verifies images against one TrustConfig. Thread-safe: the webhook calls it from many threads.

    Verdicts are cached per repository and digest for the TTL (refusals too, so a flood of Pods
    with an unsigned image costs one registry round); a verdict for an unreachable registry is
    not cached. Tags are resolved on every call.
    """

    def __init__(self, config: TrustConfig, *, check_attestations: bool = True,
                 cache_ttl_seconds: float | None = None, timeout_s: float = 10.0):
        self.config = config
        self.keys = tuple(load_key(key) for key in config.keys)
        self.check_attestations = check_attestations and needs_attestations(config.require)
        self.ttl = float(config.cache_ttl_seconds if cache_ttl_seconds is None else cache_ttl_seconds)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._registries: dict[str, Registry] = {}
        self._cache: dict[tuple[str, str], tuple[float, ImageVerdict]] = {}
        self._in_flight: dict[tuple[str, str], Future[ImageVerdict]] = {}
        self._pool: ThreadPoolExecutor | None = None  # the concurrent reads of each verification
        # Checks already made over given bytes, by content digest: the same signature or envelope
        # (push reads it in the source, then again in the target; the webhook sees one image in many
        # repositories) is read and its digest checked every time, but parsed and verified once.
        self._checked: dict[tuple[str, ...], Key | Attestation | Refused] = {}

    def close(self) -> None:
        with self._lock:
            registries, self._registries = list(self._registries.values()), {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for registry in registries:
            registry.close()

    def _reads(self, registry: Registry, repository: str, known_blobs: Mapping[str, bytes] | None = None) -> _Reads:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=READ_CONCURRENCY, thread_name_prefix="imagebuild-verify")
            return _Reads(registry, repository, self._pool, known_blobs)

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify_many(self, images: Iterable[str], concurrency: int = 8) -> list[ImageVerdict]:
        images = list(images)
        if len(images) <= 1:
            return [self.verify(image) for image in images]
        with ThreadPoolExecutor(max_workers=min(concurrency, len(images))) as pool:
            return list(pool.map(self.verify, images))

    def verify(self, image: str) -> ImageVerdict:
        try:
            ref = parse_image(image)
        except ValueError as exc:
            return ImageVerdict(image, None, False, f"not an image reference: {exc}")
        repository = f"{ref.registry}/{ref.repository}"
        # Docker Hub goes by docker.io in policies and Pod specs; ImageRef names its API host.
        names = [repository, f"docker.io/{ref.repository}"] if ref.registry == DOCKER_HUB else [repository]
        if not any(self.config.covers(name) for name in names):
            return ImageVerdict(image, ref.digest, False,
                                f"not covered by the policy: {repository} matches none of its images "
                                f"({', '.join(self.config.images)})")
        registry = self._registry(ref.registry)
        try:
            digest = ref.digest or self._resolve(registry, ref)
        except RegistryUnreachable as exc:
            return ImageVerdict(image, None, False, f"registry unreachable: {exc}", unreachable=True)
        except RegistryError as exc:
            return ImageVerdict(image, None, False, f"cannot resolve the tag: {exc}")
        if not digest or not _DIGEST.fullmatch(digest):
            reason = f"tag {ref.reference} not found" if not digest else f"registry gave digest '{digest[:80]}'"
            return ImageVerdict(image, None, False, f"{reason} in {repository}")
        return replace(self._verdict_for(registry, ref.repository, digest), image=image)

    def examine(self, image_by_digest: str, known: Evidence | None = None) -> tuple[ImageVerdict, Evidence]:
        """Verify `registry/repository@digest` now (no cache), and keep what was read: push verifies a
        source, copies exactly the verified signature and attestations, then audits the target.
        Attestations are read and verified even when the trust config requires none.

        `known`: an earlier examination's evidence (push: the source's). Its blobs are not read
        again: a HEAD must show this registry holds each, by digest and size. Manifests are read."""
        ref = parse_image(image_by_digest)
        if ref.digest is None:
            raise ValueError(f"{image_by_digest}: examine needs a digest reference")
        evidence = Evidence()
        verdict = self._verify_digest(self._registry(ref.registry), ref.repository, ref.digest, evidence,
                                      known.blobs if known else None)
        return replace(verdict, image=image_by_digest), evidence

    def inspect(self, image: str) -> Inspection:
        """The image's verified signature and attestations (not cached, no requirements applied):
        what a reader of the release record may believe, and what was rejected."""
        try:
            ref = parse_image(image)
        except ValueError as exc:
            return Inspection(image, None, None, f"not an image reference: {exc}", {})
        repository = f"{ref.registry}/{ref.repository}"
        if not self.config.covers(repository):
            return Inspection(image, ref.digest, None, f"not covered by the policy: {repository} matches none "
                                                       f"of its images ({', '.join(self.config.images)})", {})
        registry = self._registry(ref.registry)
        digest: str | None = ref.digest
        try:
            digest = digest or self._resolve(registry, ref)
            if not digest or not _DIGEST.fullmatch(digest):
                return Inspection(image, None, None, f"tag {ref.reference} not found in {repository}", {})
            reads = self._reads(registry, ref.repository)
            reads.prefetch(self._prefetched(digest, attestations=True))
            key = self._check_signature(reads, digest, {})
            attestations, rejected = self._attestations(reads, digest, {})
            return Inspection(image, digest, key.name, None, attestations, tuple(dict.fromkeys(rejected)))
        except Refused as refused:
            return Inspection(image, digest, None, refused.reason, {})
        except RegistryUnreachable as exc:
            return Inspection(image, digest, None, f"registry unreachable: {exc}", {}, unreachable=True)
        except RegistryError as exc:
            return Inspection(image, digest, None, f"registry: {exc}", {})

    @staticmethod
    def _resolve(registry: Registry, ref: ImageRef) -> str | None:
        """The tag's manifest digest: HEAD's Docker-Content-Digest, else the sha256 of the manifest GET returns."""
        digest = registry.head_manifest(ref.repository, ref.reference)
        if digest:
            return digest
        found = registry.find_manifest(ref.repository, ref.reference)
        return None if found is None else "sha256:" + hashlib.sha256(found[0]).hexdigest()

    def _registry(self, host: str) -> Registry:
        with self._lock:
            if host not in self._registries:
                self._registries[host] = Registry(host, timeout=self.timeout_s, retry=QUICK_RETRIES)
            return self._registries[host]

    def _verdict_for(self, registry: Registry, repository: str, digest: str) -> ImageVerdict:
        """The cached verdict, or the one a concurrent caller is computing, or a fresh one."""
        cache_key = (f"{registry.registry}/{repository}", digest)
        with self._lock:
            hit = self._cache.get(cache_key)
            if hit is not None and hit[0] > time.monotonic():
                return hit[1]
            pending = self._in_flight.get(cache_key)
            if pending is None:
                future: Future[ImageVerdict] = Future()
                self._in_flight[cache_key] = future
        if pending is not None:
            return pending.result()
        verdict: ImageVerdict | None = None
        try:
            verdict = self._verify_digest(registry, repository, digest)
            future.set_result(verdict)
            return verdict
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._in_flight[cache_key]
                if verdict is not None and not verdict.unreachable and self.ttl > 0:
                    now = time.monotonic()
                    if len(self._cache) >= 10_000:
                        self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
                    self._cache[cache_key] = (now + self.ttl, verdict)

    @staticmethod
    def _prefetched(digest: str, attestations: bool) -> dict[str, int]:
        tags = {signature_tag(digest, ".sig"): MAX_SIGNATURE_BLOB_BYTES}
        if attestations:
            tags[signature_tag(digest, ".att")] = MAX_ATTESTATION_BLOB_BYTES
        return tags

    def _verify_digest(self, registry: Registry, repository: str, digest: str,
                       evidence: Evidence | None = None, known_blobs: Mapping[str, bytes] | None = None) -> ImageVerdict:
        """The verdict; with `evidence`, the attestations are verified whatever the requirements, and
        what was read and checked is kept in it."""
        image = f"{registry.registry}/{repository}@{digest}"
        key: Key | None = None
        read_attestations = self.check_attestations or evidence is not None
        reads = self._reads(registry, repository, known_blobs)
        checked: dict[str, bytes] = {}
        try:
            reads.prefetch(self._prefetched(digest, read_attestations))
            key = self._check_signature(reads, digest, checked)
            summary = f"signed by {key.name}"
            if read_attestations:
                attestations, rejected = self._attestations(reads, digest, checked)
                if evidence is not None:
                    evidence.attestation_kinds = tuple(sorted(kind_name(t) for t in attestations))
                if self.check_attestations:
                    failures = requirement_failures(self.config.require, attestations, digest,
                                                    dt.datetime.now(dt.timezone.utc).date())
                    if failures:
                        if rejected:
                            failures.append(f"rejected: {'; '.join(dict.fromkeys(rejected))}")
                        raise Refused("; ".join(failures))
                    kinds = [kind_name(t) for t in attestations]
                    summary += f"; {len(kinds)} attestations ({', '.join(kinds)})"
            return ImageVerdict(image, digest, True, summary, key=key.name)
        except Refused as refused:
            return ImageVerdict(image, digest, False, refused.reason, key=key.name if key else refused.key)
        except RegistryUnreachable as exc:
            return ImageVerdict(image, digest, False, f"registry unreachable: {exc}", unreachable=True)
        except RegistryError as exc:
            return ImageVerdict(image, digest, False, f"registry: {exc}")
        finally:
            if evidence is not None:
                evidence.manifests, evidence.blobs = reads.found_manifests(), checked

    def _layers(self, reads: _Reads, tag: str) -> list[dict[str, Any]] | None:
        found = reads.manifest(tag)
        if found is None:
            return None
        raw = found[0]
        if len(raw) > MAX_MANIFEST_BYTES:
            raise Refused(f"{tag}: manifest over {MAX_MANIFEST_BYTES} bytes")
        try:
            layers = json.loads(raw).get("layers") or []
            if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
                raise TypeError
        except (ValueError, TypeError, AttributeError, RecursionError):  # JSON nested past the parser: hostile
            raise Refused(f"{tag} is not an image manifest") from None
        if len(layers) > MAX_LAYERS:
            raise Refused(f"{tag} has {len(layers)} layers, over {MAX_LAYERS}")
        return layers

    @staticmethod
    def _blob(reads: _Reads, descriptor: Mapping[str, Any], limit: int, checked: dict[str, bytes]) -> bytes:
        digest, size = descriptor.get("digest"), descriptor.get("size")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise Refused(f"a layer descriptor names '{str(digest)[:80]}', not a sha256 digest")
        if isinstance(size, int) and size > limit:
            raise Refused(f"blob {digest} is {size} bytes, over {limit}")
        blob = reads.blob(digest, limit)
        check_blob(descriptor, blob)
        checked[digest] = blob
        return blob

    def _signature_key(self, annotation: object, payload: bytes, digest: str) -> Key:
        key = key_that_signed(self.keys, decode_base64(annotation), payload)
        if key is None:
            raise Refused("the signature does not verify with any configured key "
                          f"({', '.join(k.name for k in self.keys)})")
        check_simple_signing(payload, digest)
        return key

    def _once(self, identity: tuple[str, ...], check: Callable[[], _Checked], kind: type[_Checked]) -> _Checked:
        """`check()`'s outcome (a value, or Refused raised), made once per identity: content digests
        and the image digest, all the check depends on besides this verifier's keys."""
        done = self._checked.get(identity)
        if done is None:
            try:
                done = check()
            except Refused as refused:
                done = refused
            if len(self._checked) >= 4096:
                self._checked.clear()
            self._checked[identity] = done
        if isinstance(done, Refused):
            raise Refused(done.reason, done.key)
        if not isinstance(done, kind):
            raise TypeError(f"{identity[0]} check gave {type(done).__name__}")
        return done

    def _check_signature(self, reads: _Reads, digest: str, checked: dict[str, bytes]) -> Key:
        registry, repository = reads.registry, reads.repository
        tag = signature_tag(digest, ".sig")
        layers = self._layers(reads, tag)
        if layers is None:
            raise Refused(f"not signed: no signature {registry.registry}/{repository}:{tag}")
        failures: list[str] = []
        for layer in layers:
            annotation = (layer.get("annotations") or {}).get(SIGNATURE_ANNOTATION)
            if not annotation:
                continue
            try:
                payload = self._blob(reads, layer, MAX_SIGNATURE_BLOB_BYTES, checked)
                return self._once(("sig", str(layer["digest"]), str(annotation), digest),
                                  partial(self._signature_key, annotation, payload, digest), Key)
            except (Refused, ValueError) as exc:
                failures.append(exc.reason if isinstance(exc, Refused) else f"signature annotation: {exc}")
        if not failures:
            raise Refused(f"not signed: {registry.registry}/{repository}:{tag} holds no signature")
        # A signature made by our key for another digest says more than one from a stranger's key.
        failures.sort(key=lambda reason: "not this image's digest" not in reason)
        more = f" (and {len(failures) - 1} other signatures refused)" if len(failures) > 1 else ""
        raise Refused(failures[0] + more)

    def _attestations(self, reads: _Reads, digest: str,
                      checked: dict[str, bytes]) -> tuple[dict[str, Attestation], list[str]]:
        """The verified attestations by predicate type (a later layer, attested later, replaces an
        earlier one of its type), and why the others were rejected."""
        layers = self._layers(reads, signature_tag(digest, ".att")) or []
        found: dict[str, Attestation] = {}
        rejected: list[str] = []
        for layer in layers:
            if layer.get("mediaType") != DSSE_MEDIA_TYPE:
                continue
            try:
                blob = self._blob(reads, layer, MAX_ATTESTATION_BLOB_BYTES, checked)
                attestation = self._once(("att", str(layer["digest"]), digest),
                                         partial(open_envelope, blob, self.keys, digest), Attestation)
            except Refused as refused:
                rejected.append(refused.reason)
                continue
            found.pop(attestation.predicate_type, None)
            found[attestation.predicate_type] = attestation
        return found, rejected
