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

from imagebuild.checks import vex
from imagebuild.config.trust import PublicKey, Requirements, TrustConfig
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.source import InputError, safe_text
from imagebuild.oci import names, reference
from imagebuild.oci.client import INDEX_TYPES, ImageRef, Registries, Registry, RegistryError, RegistryUnreachable
from imagebuild.oci.platforms import BadIndex, Child, child_for, index_children
from imagebuild.oci.retry import QUICK_RETRIES
from imagebuild.trust.attest import (
    PREDICATE_GATE,
    PREDICATE_OPENVEX,
    PREDICATE_PROVENANCE,
    PREDICATE_RELEASE,
    PREDICATE_SBOM,
    PREDICATE_SMOKE,
    PREDICATE_VULN,
)
from imagebuild.trust.provenance import canonical_sha256, provenance_problems, release_problems

SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
SIMPLESIGNING_TYPE = "cosign container image signature"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
IN_TOTO_STATEMENTS = ("https://in-toto.io/Statement/v0.1", "https://in-toto.io/Statement/v1")

# The predicate types `imagebuild sign` attests, by the names the trust config's require.attestations uses.
ATTESTATION_TYPES = {"sbom": PREDICATE_SBOM, "vuln": PREDICATE_VULN, "smoke": PREDICATE_SMOKE, "gate": PREDICATE_GATE,
                     "provenance": PREDICATE_PROVENANCE, "release": PREDICATE_RELEASE, "openvex": PREDICATE_OPENVEX}
SEVERITIES = ("UNKNOWN", "LOW", "MEDIUM", "HIGH", "CRITICAL")
# What an index (a multi-platform release) carries itself: its release record. Every other requirement
# is about what a node runs, so it is judged on each child, about that child's digest.
INDEX_KINDS = ("release",)

# What a registry may make us read: everything it serves is untrusted, and anyone who can push to a
# covered repository can fill its `.sig`/`.att` tags (threat model: "the webhook's budget"). The
# signature is read first and alone: an unsigned image costs two manifests and a few small
# payloads, never an attestation blob. SBOMs of the CUDA images are the largest attestation blobs
# (a few MB, a third more as base64 in the envelope).
MAX_MANIFEST_BYTES = 4 << 20  # an image manifest or index
MAX_SIGNATURE_MANIFEST_BYTES = 1 << 20  # a `.sig` or `.att` manifest: 256 layers of annotations fit
MAX_SIGNATURE_BLOB_BYTES = 64 << 10  # a simplesigning payload is a few hundred bytes
MAX_SIGNATURES_TRIED = 16  # signature payloads read before the image is refused
MAX_ATTESTATION_BLOB_BYTES = 16 << 20
MAX_ATTESTATION_BYTES = 64 << 20  # all attestation blobs of one verification together
MAX_ATTESTATIONS_READ = 32
MAX_LAYERS = 256
READ_CONCURRENCY = 8  # reads in flight for one verification (and across a webhook's)


class Refused(ImagebuildError):
    """The image is refused; `reason` is the verdict's one line."""

    def __init__(self, reason: str, key: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.key = key


@dataclass(frozen=True)
class ChildVerdict:
    """One platform's image of an index, verified as itself: its own signature and attestations."""

    platform: str  # as the index entry says it (and the child's config agrees, when it was read)
    digest: str
    allowed: bool
    reason: str
    key: str | None = None

    def line(self) -> str:
        return f"{self.platform} {self.digest}: {'verified: ' if self.allowed else 'refused: '}{self.reason}"


@dataclass(frozen=True)
class ImageVerdict:
    image: str  # as asked (tag or digest ref)
    digest: str | None  # resolved manifest digest, None when it could not be resolved
    allowed: bool
    reason: str  # one line: why refused, or what was verified
    key: str | None = None  # name of the key that verified the signature
    unreachable: bool = False  # the registry could not be reached (the webhook applies failure_policy)
    # An index: each child's verdict (the index is allowed only when every one is); () for an image.
    children: tuple[ChildVerdict, ...] = ()

    @property
    def digests(self) -> tuple[str, ...]:
        """Every digest this verdict vouches for: the image's and, for an index, each child's."""
        return tuple(d for d in (self.digest, *(c.digest for c in self.children)) if d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- image references --------------------------------------------------------------------------

_DIGEST = names.SHA256_DIGEST  # cosign's tag scheme (sha256-<hex>.sig) knows sha256 only


def parse_image(text: str) -> ImageRef:
    """A tag or digest reference in normal form (imagebuild.oci.reference, the one grammar); ValueError
    saying what is wrong with it."""
    parsed = reference.parse(text)
    if parsed.digest is not None and not _DIGEST.fullmatch(parsed.digest):
        raise reference.DigestError(f"digest {reference.shown(parsed.digest)}: images are verified by sha256 "
                                    "(cosign's signature tags name sha256 digests)")
    return ImageRef(parsed.registry, parsed.repository, parsed.tag, parsed.digest)


def covered_names(ref: ImageRef) -> list[str]:
    """The names a trust file's globs may give the image: Docker Hub goes by docker.io in policies and
    Pod specs, while ImageRef names its API host."""
    name = f"{ref.registry}/{ref.repository}"
    return [name, f"{reference.DOCKER_HUB_NAME}/{ref.repository}"] if ref.registry == reference.DOCKER_HUB else [name]


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


def check_simple_signing(payload: bytes, digest: str, repository: str | None = None,
                         match: str = "name") -> str | None:
    """cosign's claim check: the signed payload names this very manifest digest and, when `repository`
    (its path, without the registry host) is given, an identity that matches it. Returns the signed
    repository path.

    One key signs every image, so without this a signed debugging image copied, signature and all,
    under a production name would pass. The registry host is never compared (staging and the regions
    hold copies that keep the staging signature). `match` is the trust file's `signed_identity`:
    `name` (the default) wants the same image name, the last path component, so that a promotion
    from one project to another (staging/paddle -> prod/paddle) keeps verifying; `repository` wants
    the same whole path. Push and promote audit a copy with the same rule, so they never write an
    image under a name where it would not verify."""
    try:
        document = json.loads(payload)
        critical = document["critical"]
        signed_digest = critical["image"]["docker-manifest-digest"]
        kind = critical["type"]
        signed_reference = (critical.get("identity") or {}).get("docker-reference")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise Refused("signature payload is not a cosign simplesigning document") from None
    if kind != SIMPLESIGNING_TYPE:
        raise Refused(f"signature payload has type '{safe_text(str(kind), 80)}', not '{SIMPLESIGNING_TYPE}'")
    if signed_digest != digest:
        raise Refused(f"the signature is for {safe_text(str(signed_digest), 80)}, not this image's digest {digest} "
                      "(copied from another image, or the tag moved)")
    signed_path = signed_repository_path(signed_reference)
    if repository is None:
        return signed_path
    if signed_path is None:
        raise Refused("the signature names no repository (critical.identity.docker-reference)")
    same = signed_path == repository
    if match == "name":
        same = same or signed_path.rsplit("/", 1)[-1] == repository.rsplit("/", 1)[-1]
    if not same:
        raise Refused(f"the signature is for repository {safe_text(signed_path, 120)}, not {repository} "
                      "(a signed image copied under another name)")
    return signed_path


def signed_repository_path(reference: object) -> str | None:
    """The repository path a simplesigning `docker-reference` names (registry host, tag and digest dropped)."""
    if not isinstance(reference, str) or not reference or len(reference) > 1024:
        return None
    try:
        return parse_image(reference).repository
    except ValueError:
        return None




@dataclass(frozen=True)
class Attestation:
    predicate_type: str
    predicate: Any
    key: str  # the key the envelope verified with
    # sha256 of the predicate's canonical JSON: what a release record names the attestations it vouches for by
    content_sha256: str = dataclass_field(default="", compare=False)


def open_envelope(blob: bytes, keys: Iterable[Key], digest: str) -> Attestation:
    """A DSSE envelope signed by one of the keys, holding an in-toto statement about this digest."""
    payload_type, payload, signatures = _envelope(blob)
    message = pae(payload_type, payload)
    key = next((k for sig in signatures if (k := key_that_signed(keys, sig, message))), None)
    if key is None:
        raise Refused("an attestation is not signed by any configured key" + _claimed_kind(payload))
    return _statement(payload_type, payload, digest, key.name)


def read_statement(blob: bytes, digest: str) -> Attestation:
    """The statement of a DSSE envelope, its signature NOT checked: for `sign` reading back what it has
    just attested with a key it cannot name (keyless). Never for a decision."""
    payload_type, payload, _ = _envelope(blob)
    return _statement(payload_type, payload, digest, "")


def _envelope(blob: bytes) -> tuple[str, bytes, list[bytes]]:
    try:
        envelope = json.loads(blob)
        payload_type = envelope["payloadType"]
        payload = decode_base64(envelope["payload"])
        signatures = [decode_base64(entry["sig"]) for entry in envelope["signatures"]]
        if not isinstance(payload_type, str):
            raise TypeError
        payload_type.encode("utf-8")  # a lone surrogate cannot be signed over: UnicodeEncodeError here
    except (ValueError, KeyError, TypeError, RecursionError):
        raise Refused("an attestation layer is not a DSSE envelope") from None
    return payload_type, payload, signatures


def _statement(payload_type: str, payload: bytes, digest: str, key_name: str) -> Attestation:
    if payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise Refused(f"an attestation has payloadType '{safe_text(payload_type, 80)}', not in-toto")
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
        raise Refused(f"an attestation's statement type '{safe_text(str(statement_type), 80)}' is not in-toto's")
    algorithm, _, hex_digest = digest.partition(":")
    if not any(subject.get(algorithm) == hex_digest for subject in subjects):
        named = ", ".join(f"{a}:{h}" for s in subjects for a, h in s.items()) or "nothing"
        raise Refused(f"the {kind_name(predicate_type)} attestation is about {safe_text(named, 160)}, not {digest}",
                      key_name or None)
    try:
        content = canonical_sha256(predicate)
    except (ValueError, TypeError, RecursionError):
        raise Refused("an attestation's predicate cannot be encoded canonically") from None
    return Attestation(predicate_type, predicate, key_name, content)


def _claimed_kind(payload: bytes) -> str:
    """What an unverified statement says it is, for the message only (nothing else is read from it)."""
    try:
        claimed = json.loads(payload).get("predicateType")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return f" (it claims to be {kind_name(claimed)})" if isinstance(claimed, str) else ""


def kind_name(predicate_type: str) -> str:
    """The trust file's name of a predicate type; an unknown one escaped (it comes from the registry)."""
    return next((name for name, uri in ATTESTATION_TYPES.items() if uri == predicate_type),
                safe_text(predicate_type, 120))


# --- which attestations count (pure) -------------------------------------------------------------


_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:Z|[+-]\d{2}:\d{2})")


def signed_time(attestation: Attestation) -> dt.datetime | None:
    """When the statement says it was made, from its signed predicate: a release record's `issued_at`,
    the vuln shape's `metadata.scanFinishedOn`, a CycloneDX `metadata.timestamp`; None without one."""
    predicate: dict[str, Any] = attestation.predicate if isinstance(attestation.predicate, dict) else {}
    found = predicate.get("metadata")
    metadata: dict[str, Any] = found if isinstance(found, dict) else {}
    for value in (predicate.get("issued_at"), metadata.get("scanFinishedOn"), metadata.get("timestamp")):
        if isinstance(value, str) and _RFC3339.fullmatch(value):
            try:
                return dt.datetime.fromisoformat(_trim_fraction(value))
            except ValueError:
                continue
    return None


def _trim_fraction(value: str) -> str:
    """RFC 3339 (up to 9 fractional digits, Z or an offset) as Python 3.10's fromisoformat reads it."""
    value = value.replace("Z", "+00:00")
    head, zone = value[:-6], value[-6:]
    seconds, _, fraction = head.partition(".")
    return f"{seconds}.{(fraction + '000000')[:6]}{zone}"


def choose_attestations(verified: Iterable[Attestation]) -> tuple[dict[str, Attestation], list[str]]:
    """The attestations that count, by predicate type, decided by signed content and never by layer
    order (the `.att` manifest is not signed: whoever can push can reorder, drop or re-add layers).

    - Release records: the newest by its signed `issued_at` is the one; two different ones with the
      same time (or without one) conflict, and the image is refused.
    - The release record names the canonical sha256 of each attestation it vouches for; for those
      types only the named one counts, and the others (superseded, or never vouched for) are ignored.
    - Any other type: one distinct statement counts; several different ones conflict (refused).
    Returns the chosen attestations and one line per attestation ignored."""
    by_type: dict[str, dict[str, Attestation]] = {}
    for attestation in verified:
        by_type.setdefault(attestation.predicate_type, {})[attestation.content_sha256] = attestation
    ignored: list[str] = []
    chosen: dict[str, Attestation] = {}
    releases = list(by_type.pop(PREDICATE_RELEASE, {}).values())
    vouched: dict[str, str] = {}
    if releases:
        release = _newest_release(releases)
        chosen[PREDICATE_RELEASE] = release
        if len(releases) > 1:
            ignored.append(f"{len(releases) - 1} older release record(s) ignored")
        vouched = _vouched_for(release)
    issued = signed_time(chosen[PREDICATE_RELEASE]) if releases else None
    for predicate_type, candidates in by_type.items():
        name = kind_name(predicate_type)
        wanted = vouched.get(name)
        if wanted is not None:
            if wanted in candidates:
                chosen[predicate_type] = candidates[wanted]
            for digest, other in candidates.items():
                if digest == wanted:
                    continue
                made = signed_time(other)
                if issued is not None and made is not None and made > issued:
                    # Newer than the record that should name it: the newer record was taken away.
                    raise Refused(f"a {name} attestation made after the newest release record, which does not "
                                  "vouch for it (a newer release record was removed?)")
                ignored.append(f"a {name} attestation the release record does not vouch for (superseded)")
            if wanted not in candidates:
                ignored.append(f"the {name} attestation the release record vouches for is absent")
            continue
        if len(candidates) > 1:
            raise Refused(f"{len(candidates)} different {name} attestations and no release record naming one "
                          "(conflicting statements)")
        chosen[predicate_type] = next(iter(candidates.values()))
    return chosen, ignored


def _newest_release(releases: list[Attestation]) -> Attestation:
    if len(releases) == 1:
        return releases[0]
    times = [(signed_time(release), release) for release in releases]
    if any(issued is None for issued, _ in times):
        raise Refused(f"{len(releases)} different release records, not all with a signed issued_at (conflicting)")
    times.sort(key=lambda pair: pair[0] or dt.datetime.min.replace(tzinfo=dt.timezone.utc))
    if times[-1][0] == times[-2][0]:
        raise Refused(f"{len(releases)} different release records issued at the same time (conflicting)")
    return times[-1][1]


def _vouched_for(release: Attestation) -> dict[str, str]:
    """What a release record vouches for: attestation name -> canonical sha256 ({} for an older record)."""
    named = _predicate_field(release, "attestations")
    if not isinstance(named, dict):
        return {}
    return {str(name): digest for name, digest in named.items()
            if names.is_sha256_digest(digest)}


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
    openvex = attestations.get(ATTESTATION_TYPES["openvex"])
    if require.vex_current and openvex is not None:
        failures += vex_problems(openvex, digest, today)
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


def signed_vex(attestation: Attestation) -> vex.VexDocument:
    """The OpenVEX document of a verified attestation, checked field by field (InputError when it is not one)."""
    return vex.parse_document(attestation.predicate, f"the openvex attestation (signed by {attestation.key})")


def vex_problems(attestation: Attestation, digest: str, today: dt.date) -> list[str]:
    """Why the signed OpenVEX document is not current for `digest` (trust file: require.vex_current)."""
    try:
        return vex.currency_problems(signed_vex(attestation), digest, today)
    except InputError as exc:
        return [safe_text(str(exc), 300)]


def needs_attestations(require: Requirements) -> bool:
    return bool(require.attestations or require.smoke_passed or require.gate_passed or require.block_severity
                or require.vex_current)


def split_requirements(require: Requirements) -> tuple[Requirements, Requirements]:
    """(what an index must satisfy itself, what each of its children must). The smoke tests, the scan,
    the gate and the SBOM are about the bytes a node runs, one platform's image: each child carries
    them about its own digest. The index carries the release record (INDEX_KINDS)."""
    own = Requirements(attestations=tuple(k for k in require.attestations if k in INDEX_KINDS))
    children = replace(require, attestations=tuple(k for k in require.attestations if k not in INDEX_KINDS))
    return own, children


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
    children: tuple[ChildVerdict, ...] = ()  # an index: each platform's image, verified as itself


@dataclass
class Evidence:
    """What one verification read, every byte checked against its digest: the signature and
    attestation manifests by tag, their blobs by digest, and the kinds of the attestations that
    verified. Push copies these very bytes, so the target receives exactly what was verified."""

    manifests: dict[str, tuple[bytes, str, str]] = dataclass_field(default_factory=dict)  # tag -> (raw, media type, digest)
    blobs: dict[str, bytes] = dataclass_field(default_factory=dict)  # digest -> content
    # The kinds that verified: an index's own and those every child carries (push audits the same).
    attestation_kinds: tuple[str, ...] = ()
    children: tuple[str, ...] = ()  # an index: its children's digests (their .sig/.att are in `manifests`)
    child_kinds: dict[str, tuple[str, ...]] = dataclass_field(default_factory=dict)  # child digest -> its kinds


def _common_kinds(children: Iterable[ChildVerdict], evidence: Evidence | None) -> set[str]:
    """The attestation kinds every child carries (each child's own, verified about its digest)."""
    if evidence is None:
        return set()
    sets = [set(evidence.child_kinds.get(child.digest, ())) for child in children]
    return set.intersection(*sets) if sets else set()


_Fetched = tuple[bytes, str, str] | None | RegistryError
_Checked = TypeVar("_Checked", "Key", "Attestation")


class _Reads:
    """One verification's registry reads, concurrent where the order allows: the `.sig` and `.att`
    manifests together, then the signature payloads, and only once a signature verified, the
    attestation blobs together (three round trips, not one per blob; a release image carries six
    attestations). A failed read is kept and raised where the check reaches it."""

    def __init__(self, registry: Registry, repository: str, pool: ThreadPoolExecutor,
                 known_blobs: Mapping[str, bytes] | None = None):
        self.registry, self.repository, self.pool = registry, repository, pool
        self.known_blobs = known_blobs or {}
        self._manifests: dict[str, _Fetched] = {}
        self._blobs: dict[str, bytes | RegistryError] = {}

    def prefetch_manifests(self, tags: Iterable[str]) -> None:
        """Read these manifests concurrently (one round trip)."""
        tags = [tag for tag in tags if tag not in self._manifests]
        for tag, found in zip(tags, self.pool.map(self._fetch_manifest, tags)):
            self._manifests[tag] = found

    def prefetch_blobs(self, digests: Iterable[str], limit: int) -> None:
        """Read these blobs concurrently, each within `limit` (the caller bounds their number)."""
        wanted = [digest for digest in dict.fromkeys(digests) if digest not in self._blobs]
        for digest, blob in zip(wanted, self.pool.map(lambda d: self._fetch_blob(d, limit), wanted)):
            self._blobs[digest] = blob

    def _fetch_manifest(self, tag: str) -> _Fetched:
        try:
            return self.registry.find_manifest(self.repository, tag, max_bytes=MAX_SIGNATURE_MANIFEST_BYTES)
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


@dataclass(frozen=True)
class CacheStats:
    """A Verifier's verdict cache since it started: verdicts answered from it, and verifications made."""

    hits: int
    misses: int


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
        self._registries = Registries(timeout=timeout_s, retry=QUICK_RETRIES)
        self._cache: dict[tuple[str, str], tuple[float, ImageVerdict]] = {}
        self._in_flight: dict[tuple[str, str], Future[ImageVerdict]] = {}
        self._hits = self._misses = 0  # under _lock
        self._pool: ThreadPoolExecutor | None = None  # the concurrent reads of each verification
        # Checks already made over given bytes, by content digest: the same signature or envelope
        # (push reads it in the source, then again in the target; the webhook sees one image in many
        # repositories) is read and its digest checked every time, but parsed and verified once.
        self._checked: dict[tuple[str, ...], Key | Attestation | Refused] = {}

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._registries.close()

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
        if not self._covers(ref):
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

    def cached(self, image: str) -> ImageVerdict | None:
        """What verify(image) would answer, when that needs no network: a covered image by digest whose verdict
        is in the cache and fresh. None otherwise (a tag must be resolved on every request)."""
        try:
            ref = parse_image(image)
        except ValueError:
            return None
        if ref.digest is None or not self._covers(ref):
            return None
        with self._lock:
            hit = self._fresh(self._registry(ref.registry), ref.repository, ref.digest)
            if hit is not None:
                self._hits += 1
        return None if hit is None else replace(hit, image=image)

    def cache_stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses)

    def _covers(self, ref: ImageRef) -> bool:
        """The trust config covers the image as it is spelled (any of the names it may be pulled by)."""
        return any(self.config.covers(name) for name in covered_names(ref))

    @staticmethod
    def _cache_key(registry: Registry, repository: str, digest: str) -> tuple[str, str]:
        return f"{registry.registry}/{repository}", digest

    def _fresh(self, registry: Registry, repository: str, digest: str) -> ImageVerdict | None:
        """The cached verdict while its TTL lasts, else None; the caller holds the lock."""
        hit = self._cache.get(self._cache_key(registry, repository, digest))
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

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
        if not self._covers(ref):
            return Inspection(image, ref.digest, None, f"not covered by the policy: {repository} matches none "
                                                       f"of its images ({', '.join(self.config.images)})", {})
        registry = self._registry(ref.registry)
        digest: str | None = ref.digest
        try:
            digest = digest or self._resolve(registry, ref)
            if not digest or not _DIGEST.fullmatch(digest):
                return Inspection(image, None, None, f"tag {ref.reference} not found in {repository}", {})
            reads = self._reads(registry, ref.repository)
            reads.prefetch_manifests([digest, *self._signature_tags(digest, attestations=True)])
            key = self._check_signature(reads, digest, {})
            attestations, rejected = self._attestations(reads, digest, {})
            listed = self._index(reads, digest)
            children = () if listed is None else self._verify_children(
                registry, ref.repository, listed, split_requirements(self.config.require)[1], {})
            return Inspection(image, digest, key.name, None, attestations, tuple(dict.fromkeys(rejected)),
                              children=children)
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
        return self._registries.get(host)

    def _verdict_for(self, registry: Registry, repository: str, digest: str) -> ImageVerdict:
        """The cached verdict, or the one a concurrent caller is computing, or a fresh one."""
        cache_key = self._cache_key(registry, repository, digest)
        with self._lock:
            hit = self._fresh(registry, repository, digest)
            if hit is not None:
                self._hits += 1
                return hit
            pending = self._in_flight.get(cache_key)
            if pending is None:
                self._misses += 1
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
                    for key, entry in self._cache_entries(registry, repository, verdict):
                        self._cache[key] = (now + self.ttl, entry)

    def _cache_entries(self, registry: Registry, repository: str,
                       verdict: ImageVerdict) -> list[tuple[tuple[str, str], ImageVerdict]]:
        """What one verification lets the cache answer, by digest: the verdict itself and, for an index
        allowed as a whole, each child's, but only when a child inside an index is held to exactly what
        it would be alone (the index takes no requirement on itself): then the child's verdict is the
        one verifying it by its digest would give. A child never vouches for its index."""
        entries = [(self._cache_key(registry, repository, verdict.digest or ""), verdict)]
        if verdict.allowed and verdict.children and split_requirements(self.config.require)[1] == self.config.require:
            entries += [(self._cache_key(registry, repository, child.digest),
                         ImageVerdict(f"{registry.registry}/{repository}@{child.digest}", child.digest, True,
                                      child.reason, key=child.key)) for child in verdict.children]
        return entries

    @staticmethod
    def _signature_tags(digest: str, attestations: bool) -> list[str]:
        return [signature_tag(digest, ".sig"), *([signature_tag(digest, ".att")] if attestations else [])]

    def _verify_digest(self, registry: Registry, repository: str, digest: str,
                       evidence: Evidence | None = None, known_blobs: Mapping[str, bytes] | None = None) -> ImageVerdict:
        """The verdict; with `evidence`, the attestations are verified whatever the requirements, and
        what was read and checked is kept in it. An index is verified whole: its own signature (and
        record), then every child as itself; it is allowed only when every child is."""
        image = f"{registry.registry}/{repository}@{digest}"
        key: Key | None = None
        children: tuple[ChildVerdict, ...] = ()
        read_all = evidence is not None
        reads = self._reads(registry, repository, known_blobs)
        checked: dict[str, bytes] = {}
        try:
            # The manifest tells an index from an image; it is read with the signature tags, at once.
            reads.prefetch_manifests([digest, *self._signature_tags(digest, self.check_attestations or read_all)])
            listed = self._index(reads, digest)
            own, each_child = (self.config.require, self.config.require) if listed is None \
                else split_requirements(self.config.require)
            key, summary, kinds = self._judge(reads, digest, own, checked, read_all)
            if listed is not None:
                children = self._verify_children(registry, repository, listed, each_child, checked, evidence,
                                                 known_blobs)
                refused = [child for child in children if not child.allowed]
                if refused:
                    raise Refused(f"{len(refused)} of {len(children)} platforms refused: "
                                  + "; ".join(child.line() for child in refused), key.name)
                summary += f"; index of {len(children)} platforms, each verified " \
                           f"({', '.join(child.platform for child in children)})"
                kinds = tuple(sorted(set(kinds) | _common_kinds(children, evidence)))
            if evidence is not None:
                evidence.attestation_kinds = kinds
            return ImageVerdict(image, digest, True, summary, key=key.name, children=children)
        except Refused as refused:
            return ImageVerdict(image, digest, False, refused.reason, key=key.name if key else refused.key,
                                children=children)
        except RegistryUnreachable as exc:
            return ImageVerdict(image, digest, False, f"registry unreachable: {exc}", unreachable=True)
        except RegistryError as exc:
            return ImageVerdict(image, digest, False, f"registry: {exc}")
        finally:
            if evidence is not None:
                evidence.manifests = {**reads.found_manifests(), **evidence.manifests}
                evidence.blobs = checked

    def _judge(self, reads: _Reads, digest: str, require: Requirements, checked: dict[str, bytes],
               read_all: bool) -> tuple[Key, str, tuple[str, ...]]:
        """One manifest's own signature and attestations against `require`: (the key, the summary, the
        kinds that verified). Refused says why not. `read_all`: the attestations are read and verified
        even when `require` asks for none (push's evidence)."""
        key = self._check_signature(reads, digest, checked)
        summary = f"signed by {key.name}"
        check = self.check_attestations and needs_attestations(require)
        if not (check or read_all):
            return key, summary, ()
        attestations, rejected = self._attestations(reads, digest, checked)
        kinds = tuple(sorted(kind_name(t) for t in attestations))
        if check:
            failures = requirement_failures(require, attestations, digest, dt.datetime.now(dt.timezone.utc).date())
            if failures:
                if rejected:
                    failures.append(f"rejected: {'; '.join(dict.fromkeys(rejected))}")
                raise Refused("; ".join(failures), key.name)
            summary += f"; {len(kinds)} attestations ({', '.join(kind_name(t) for t in attestations)})"
        return key, summary, kinds

    def _index(self, reads: _Reads, digest: str) -> tuple[Child, ...] | None:
        """The children `digest` lists when it is an index (None for an image manifest), bounded and
        checked entry by entry (platforms.index_children). A manifest that any of its media types or
        its `manifests` list calls an index is one: judged as an image, a runtime that reads it as an
        index would run children nobody verified."""
        found = reads.manifest(digest)
        if found is None:
            raise Refused(f"no manifest {digest} in {reads.registry.registry}/{reads.repository}")
        raw, media_type, _ = found
        try:
            document = json.loads(raw)
        except (ValueError, RecursionError):
            raise Refused(f"the manifest {digest} is not JSON") from None
        if not isinstance(document, dict):
            raise Refused(f"the manifest {digest} is not a JSON object")
        if media_type not in INDEX_TYPES and document.get("mediaType") not in INDEX_TYPES \
                and "manifests" not in document:
            return None
        try:
            return index_children(raw)
        except BadIndex as exc:
            raise Refused(f"the index {digest} is refused: {exc}") from None

    def _verify_children(self, registry: Registry, repository: str, listed: tuple[Child, ...],
                         require: Requirements, checked: dict[str, bytes], evidence: Evidence | None = None,
                         known_blobs: Mapping[str, bytes] | None = None) -> tuple[ChildVerdict, ...]:
        """Each child of an index (already bounded) as itself: an image manifest whose config says the
        platform its entry says (child_for, all children at once), then its own signature and
        attestations about its own digest. Every child is judged, so the verdict names each refusal."""
        pool = self._reads(registry, repository).pool
        manifests = list(pool.map(partial(self._child_manifest, registry, repository), listed))
        verdicts: list[ChildVerdict] = []
        for child, problem in zip(listed, manifests):
            if problem is not None:
                verdicts.append(ChildVerdict(child.platform, child.digest, False, problem))
                continue
            reads = self._reads(registry, repository, known_blobs)
            try:
                reads.prefetch_manifests(self._signature_tags(child.digest, self.check_attestations or bool(evidence)))
                key, summary, kinds = self._judge(reads, child.digest, require, checked, evidence is not None)
                verdicts.append(ChildVerdict(child.platform, child.digest, True, summary, key.name))
                if evidence is not None:
                    evidence.child_kinds[child.digest] = kinds
            except Refused as refused:
                verdicts.append(ChildVerdict(child.platform, child.digest, False, refused.reason, refused.key))
            except RegistryUnreachable:
                raise
            except RegistryError as exc:
                verdicts.append(ChildVerdict(child.platform, child.digest, False, f"registry: {exc}"))
            finally:
                if evidence is not None:
                    evidence.manifests.update(reads.found_manifests())
        if evidence is not None:
            evidence.children = tuple(child.digest for child in listed)
        return tuple(verdicts)

    @staticmethod
    def _child_manifest(registry: Registry, repository: str, child: Child) -> str | None:
        """Why the child cannot be this platform's image (None when it can): what a runtime selecting
        the entry would get must be an image whose config says that platform, by that digest."""
        try:
            child_for(registry, repository, child.digest, child.platform)
            return None
        except RegistryUnreachable:
            raise
        except RegistryError as exc:
            return safe_text(str(exc), 300)

    def _layers(self, reads: _Reads, tag: str) -> list[dict[str, Any]] | None:
        found = reads.manifest(tag)
        if found is None:
            return None
        raw = found[0]
        if len(raw) > MAX_SIGNATURE_MANIFEST_BYTES:
            raise Refused(f"{tag}: manifest over {MAX_SIGNATURE_MANIFEST_BYTES} bytes")
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
    def _descriptor(layer: Mapping[str, Any], limit: int) -> tuple[str, int]:
        """The layer's (digest, size), checked before anything is read: a sha256 digest (it goes into a
        URL) and a declared size within `limit` (the read stops there whatever the registry sends)."""
        digest, size = layer.get("digest"), layer.get("size")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise Refused(f"a layer descriptor names '{safe_text(str(digest), 80)}', not a sha256 digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise Refused(f"blob {digest} has no size in its descriptor")
        if size > limit:
            raise Refused(f"blob {digest} is {size} bytes, over {limit}")
        return digest, size

    def _blob(self, reads: _Reads, descriptor: Mapping[str, Any], limit: int, checked: dict[str, bytes]) -> bytes:
        digest, _ = self._descriptor(descriptor, limit)
        blob = reads.blob(digest, limit)
        check_blob(descriptor, blob)
        checked[digest] = blob
        return blob

    def _signature_key(self, annotation: object, payload: bytes, digest: str, repository: str) -> Key:
        key = key_that_signed(self.keys, decode_base64(annotation), payload)
        if key is None:
            raise Refused("the signature does not verify with any configured key "
                          f"({', '.join(k.name for k in self.keys)})")
        check_simple_signing(payload, digest, repository, self.config.signed_identity)
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
        """The key of the first signature layer that verifies. At most MAX_SIGNATURES_TRIED payloads
        are read, each within MAX_SIGNATURE_BLOB_BYTES: a `.sig` tag stuffed with junk layers costs
        kilobytes."""
        registry, repository = reads.registry, reads.repository
        tag = signature_tag(digest, ".sig")
        layers = self._layers(reads, tag)
        if layers is None:
            raise Refused(f"not signed: no signature {registry.registry}/{repository}:{tag}")
        signed = [layer for layer in layers if (layer.get("annotations") or {}).get(SIGNATURE_ANNOTATION)]
        if not signed:
            raise Refused(f"not signed: {registry.registry}/{repository}:{tag} holds no signature")
        tried, skipped = signed[:MAX_SIGNATURES_TRIED], len(signed) - MAX_SIGNATURES_TRIED
        failures: list[str] = []
        readable = []
        for layer in tried:
            try:
                readable.append((layer, self._descriptor(layer, MAX_SIGNATURE_BLOB_BYTES)[0]))
            except Refused as refused:
                failures.append(refused.reason)
        reads.prefetch_blobs([blob for _, blob in readable], MAX_SIGNATURE_BLOB_BYTES)
        for layer, blob_digest in readable:
            annotation = str(layer["annotations"][SIGNATURE_ANNOTATION])
            try:
                payload = self._blob(reads, layer, MAX_SIGNATURE_BLOB_BYTES, checked)
                return self._once(("sig", blob_digest, annotation, digest, repository),
                                  partial(self._signature_key, annotation, payload, digest, repository), Key)
            except (Refused, ValueError) as exc:
                failures.append(exc.reason if isinstance(exc, Refused) else f"signature annotation: {exc}")
            except RegistryUnreachable:
                raise
            except RegistryError as exc:  # this payload could not be read (too large, refused): try the next
                failures.append(f"signature payload: {safe_text(str(exc))}")
        if skipped > 0:
            failures.append(f"{skipped} more signature layers not read (at most {MAX_SIGNATURES_TRIED} are)")
        # A signature made by our key for another digest says more than one from a stranger's key.
        failures.sort(key=lambda reason: "not this image's digest" not in reason)
        more = f" (and {len(failures) - 1} other signatures refused)" if len(failures) > 1 else ""
        raise Refused(failures[0] + more)

    def _attestations(self, reads: _Reads, digest: str,
                      checked: dict[str, bytes]) -> tuple[dict[str, Attestation], list[str]]:
        """The attestations that count, by predicate type (choose_attestations: by signed content, not
        by layer order), and why the others were rejected or ignored. Read only after the signature
        verified, at most MAX_ATTESTATIONS_READ blobs and MAX_ATTESTATION_BYTES in all."""
        layers = [layer for layer in self._layers(reads, signature_tag(digest, ".att")) or []
                  if layer.get("mediaType") == DSSE_MEDIA_TYPE]
        if len(layers) > MAX_ATTESTATIONS_READ:
            raise Refused(f"{len(layers)} attestations, over the {MAX_ATTESTATIONS_READ} read for one image")
        rejected: list[str] = []
        readable = []
        for layer in layers:
            try:
                readable.append((layer, *self._descriptor(layer, MAX_ATTESTATION_BLOB_BYTES)))
            except Refused as refused:
                rejected.append(refused.reason)
        total = sum(size for _, _, size in readable)
        if total > MAX_ATTESTATION_BYTES:
            raise Refused(f"the attestations add up to {total} bytes, over {MAX_ATTESTATION_BYTES}")
        reads.prefetch_blobs([blob for _, blob, _ in readable], MAX_ATTESTATION_BLOB_BYTES)
        verified: list[Attestation] = []
        for layer, blob_digest, _ in readable:
            try:
                blob = self._blob(reads, layer, MAX_ATTESTATION_BLOB_BYTES, checked)
                verified.append(self._once(("att", blob_digest, digest),
                                           partial(open_envelope, blob, self.keys, digest), Attestation))
            except Refused as refused:
                rejected.append(refused.reason)
            # A RegistryError (a blob the manifest names is missing or too large) refuses the image:
            # the registry does not hold what it says it holds.
        chosen, ignored = choose_attestations(verified)
        return chosen, rejected + ignored
