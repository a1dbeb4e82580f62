"""`imagebuild sign`: cosign signatures and attestations for the report's images, by digest (effects).

For each selected variant of the build report:

1. Refuse unless its smoke tests and its gate passed on this very digest
   (`variant.refusal(*SIGN_NEEDS)`, report.py); the refusal is recorded and says why.
2. Skip when `stages.sign` already passed for this digest with this key and the signature and
   the attestations are still in the registry (a rerun signs nothing; a deleted signature is
   signed again).
3. Write the five predicates (attest.py; the OpenVEX document from checks/vex.py) to WORKDIR/sign/<variant>/.
   The OpenVEX document holds the exceptions of the gate's policy (the file its record names, or the
   one the caller gives) valid on the gate's day that apply to the variant, with the purls of the
   packages they name from the variant's SBOM. When none applies it holds no statements: it is
   attached all the same, so that a trust file requiring `openvex` (with `vex_current`) admits an
   image without exceptions. `imagebuild vex attest` replaces it after a policy change.
4. Reuse the signature when the signature tag (`<repo>:sha256-<hex>.sig`, cosign v2's layout;
   Distribution 2.8 has no Referrers API) already holds one that verifies with this key's
   public half over a simplesigning payload naming this digest (with --tlog, one carrying its
   Rekor bundle): a fresh workdir (CI) signing the same digest again adds no layer, so the tag
   stays bounded (verify refuses over 256). The public key comes from `cosign public-key`, once
   per run; the check is verify.py's. Keyless signing has no stable key to check against (a new
   Fulcio certificate each run), so it always signs. Otherwise `cosign sign` the image by
   digest, then check in the registry that the tag holds a signature whose payload names this
   digest. The record says which (`signature_reused`).
5. Build the release record (provenance.py): SLSA v1 provenance from the report and the image's
   labels (read from the registry), and the release predicate from the other four (not the
   OpenVEX document, which changes on its own schedule) and the signature layout; written beside them.
6. `cosign attest --replace --type T --predicate FILE` by digest for each of the seven predicates,
   then check that the `.att` tag holds every predicate type.
7. Record `stages.sign` (report.SignStage).

Secrets: the key's password reaches cosign only through the environment (COSIGN_PASSWORD),
never its command line, for `cosign public-key` as for sign and attest; every cosign output
goes through tools.Runner with that value (and an identity token) redacted. The key is named
by its path or KMS URI; imagebuild reads only its public half, which cosign writes to a
scratch file. An interrupt while a variant is signed records it as interrupted, and a rerun
does the whole variant again: the signature made before the interrupt is this key's, so it is
reused rather than added again, and `attest --replace` replaces each predicate type's
attestation rather than adding another (attestations are always made again: their content
may have changed, and --replace keeps them one per type).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.checks import vex
from imagebuild.config.trust import PublicKey
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import (
    BuildReport,
    ChildImage,
    GateStage,
    ScanStage,
    SignStage,
    SmokeStage,
    StageStatus,
    VariantRecord,
    record_stage,
)
from imagebuild.core.runner import PinnedTool, Result, Runner, cancel_requested, find_pinned
from imagebuild.core.source import InputError, load_document
from imagebuild.oci.client import ImageRef, Registries, Registry, RegistryError, base_url
from imagebuild.oci.platforms import platform_folder
from imagebuild.trust import attest, provenance, verify

# The pinned cosign; scripts/versions.env says the same (COSIGN_VERSION), a test keeps them equal.
# The signature layout recorded below (tags beside the image) is cosign v2's.
COSIGN_VERSION = "v2.6.5"
COSIGN_TOOL = PinnedTool(
    "cosign", "IMAGEBUILD_COSIGN", COSIGN_VERSION, ("version", "--json"), "gitVersion",
    install=f"scripts/bootstrap.sh installs cosign {COSIGN_VERSION} into /opt/imagebuild-tools/bin",
    why="the signature layout it records and checks is that version's")
LAYOUT_TAG = "tag"
KMS_SCHEMES = ("awskms://", "gcpkms://", "azurekms://", "hashivault://", "k8s://")
PASSWORD_ENV = "COSIGN_PASSWORD"
TOKEN_ENV = "SIGSTORE_ID_TOKEN"  # cosign reads a keyless identity token from here when --identity-token is not given
SIGNATURE_ANNOTATION = verify.SIGNATURE_ANNOTATION
BUNDLE_ANNOTATION = "dev.sigstore.cosign/bundle"  # the Rekor entry cosign attaches to a signature it uploaded
# cosign settings that would put signatures somewhere else than the layout we record and check.
_COSIGN_ENV_DROPPED = ("COSIGN_REPOSITORY", "COSIGN_EXPERIMENTAL")
# What must have passed on a variant's very digest before it is signed (VariantRecord.refusal).
SIGN_NEEDS = (SmokeStage, GateStage)
# What sign attests on an image (each child of an index too): attest.KINDS and the OpenVEX document,
# the release record last (it names what the others are in the registry).
IMAGE_KINDS: tuple[attest.AttestationKind, ...] = (attest.SBOM, attest.VULN, attest.SMOKE, attest.GATE, attest.OPENVEX,
                                                   attest.PROVENANCE, attest.RELEASE)


class SignError(ImagebuildError):
    """cosign failed, or the registry does not hold what it should after signing."""


# --- options and command lines (pure) -------------------------------------------------------------


@dataclass(frozen=True)
class Keyless:
    """cosign's OIDC flags, passed through. Needs Fulcio and Rekor, so it cannot run on an offline machine."""

    oidc_issuer: str | None = None
    oidc_client_id: str | None = None
    oidc_provider: str | None = None
    identity_token: str | None = None  # a file holding the token (a token itself would sit on the command line)
    fulcio_url: str | None = None


@dataclass(frozen=True)
class SignOptions:
    key: str | None = None  # a key file's path or a KMS URI; None with keyless
    keyless: Keyless | None = None
    tlog: bool = False  # upload to the transparency log (Rekor); keyless always does
    insecure_registries: tuple[str, ...] = ()  # plain http besides loopback registries
    timeout_s: float = 300.0
    rekor_url: str | None = None  # the transparency log, when one is used

    @property
    def key_reference(self) -> str | None:
        return self.key

    @property
    def uploads_to_tlog(self) -> bool:
        return self.tlog or self.keyless is not None


def is_kms_uri(reference: str) -> bool:
    return reference.startswith(KMS_SCHEMES)


def check_key(reference: str, option: str = "--key") -> str:
    """A key file that exists (made absolute, as cosign runs elsewhere), or a KMS URI as given; else bad input."""
    if is_kms_uri(reference):
        if reference.rstrip("/") in (s.rstrip("/") for s in KMS_SCHEMES):
            raise InputError(option, None, reference, "a KMS URI needs the key's name after the scheme")
        return reference
    if "://" in reference:
        raise InputError(option, None, reference,
                         f"unknown key scheme (a file, or one of {', '.join(KMS_SCHEMES)})")
    path = Path(reference)
    if not path.is_file():
        raise InputError(option, None, reference, "no such key file")
    return str(path.resolve())


def is_insecure(image: str, options: SignOptions) -> bool:
    registry = ImageRef.parse(image).registry
    return registry in options.insecure_registries or base_url(registry).startswith("http://")


def key_flags(options: SignOptions) -> list[str]:
    if options.keyless is not None:
        k = options.keyless
        flags: list[str] = []
        for name, value in (("--oidc-issuer", k.oidc_issuer), ("--oidc-client-id", k.oidc_client_id),
                            ("--oidc-provider", k.oidc_provider), ("--identity-token", k.identity_token),
                            ("--fulcio-url", k.fulcio_url)):
            if value:
                flags += [name, value]
        return flags
    if not options.key:
        raise ValueError("a key reference or keyless options are needed")
    return ["--key", options.key]


def common_flags(image: str, options: SignOptions) -> list[str]:
    flags = [*key_flags(options), f"--tlog-upload={'true' if options.uploads_to_tlog else 'false'}"]
    if options.rekor_url and options.uploads_to_tlog:
        flags += ["--rekor-url", options.rekor_url]
    if is_insecure(image, options):
        flags += ["--allow-http-registry", "--allow-insecure-registry"]
    return [*flags, "--yes"]


def sign_argv(cosign: str, image: str, options: SignOptions) -> list[str]:
    """`cosign sign` of one image by digest (`repo@sha256:...`)."""
    _require_digest_ref(image)
    return [cosign, "sign", *common_flags(image, options), image]


def attest_argv(cosign: str, image: str, kind: attest.AttestationKind, predicate: Path,
                options: SignOptions) -> list[str]:
    """`cosign attest` of one predicate file, replacing an earlier attestation of the same type."""
    _require_digest_ref(image)
    return [cosign, "attest", *common_flags(image, options), "--replace", "--type", kind.cosign_type,
            "--predicate", str(predicate), image]


def _require_digest_ref(image: str) -> None:
    if ImageRef.parse(image).digest is None:
        raise ValueError(f"{image} is not addressed by digest; only digests are signed")


def signature_tag(digest: str, suffix: str = "sig") -> str:
    """cosign v2's tag for what it attaches to `digest`: sha256-<hex>.sig / .att."""
    return verify.signature_tag(digest, f".{suffix}")


def public_key_argv(cosign: str, options: SignOptions, outfile: Path) -> list[str]:
    """`cosign public-key` of the signing key (a file's password comes from COSIGN_PASSWORD, as for sign)."""
    if not can_reuse_signature(options):
        raise ValueError("keyless signing has no public key to ask for")
    return [cosign, "public-key", *key_flags(options), "--outfile", str(outfile)]


def tag_ref(image: str, digest: str, suffix: str) -> str:
    ref = ImageRef.parse(image)
    return f"{ref.registry}/{ref.repository}:{signature_tag(digest, suffix)}"


# --- a signature already there (pure) ----------------------------------------------------------------


def can_reuse_signature(options: SignOptions) -> bool:
    """Whether a signature already in the registry may stand for this run's: only with a key.

    Keyless signing signs with a fresh Fulcio certificate each run: there is no stable key to
    check an earlier signature against, so it signs every time (and cosign adds a layer each time).
    """
    return options.keyless is None and bool(options.key)


def signing_key(pem: str, reference: str) -> verify.Key:
    """The public half of the signing key, as cosign printed it; InputError when verify.py cannot check with it."""
    return verify.load_key(PublicKey(name=reference, pem=pem, source=f"cosign public-key --key {reference}"))


@dataclass(frozen=True)
class SignatureLayer:
    """One signature of a `.sig` manifest: the layer's annotations and its payload."""

    annotations: dict[str, Any]
    payload: bytes  # cosign's simplesigning document, checked against the layer's digest


def names_digest(payload: bytes, digest: str) -> bool:
    """The payload is a cosign simplesigning document about this very digest."""
    try:
        verify.check_simple_signing(payload, digest)
    except verify.Refused:
        return False
    return True


def signed_by(layers: Iterable[SignatureLayer], key: verify.Key, digest: str, *, tlog: bool) -> bool:
    """One of the layers is `key`'s signature over a payload naming `digest`: `cosign sign` would add nothing.

    With `tlog` (this run uploads to Rekor) that signature must also carry its Rekor bundle: one made
    without the transparency log is not what the run asks for. The bundle itself is cosign verify's
    to check (against Rekor), not ours.
    """
    for layer in layers:
        if tlog and not layer.annotations.get(BUNDLE_ANNOTATION):
            continue
        try:
            signature = verify.decode_base64(layer.annotations.get(SIGNATURE_ANNOTATION))
        except ValueError:
            continue
        if verify.key_that_signed([key], signature, layer.payload) is not None and names_digest(layer.payload, digest):
            return True
    return False


# --- cosign ----------------------------------------------------------------------------------------


@dataclass
class Cosign:
    path: str
    version: str
    runner: Runner = field(default_factory=Runner)

    @classmethod
    def find(cls, runner: Runner | None = None) -> Cosign:
        """The cosign binary, refused unless it is the pinned version."""
        runner = runner or Runner()
        path, version = find_pinned(COSIGN_TOOL, runner, _clean_env())
        return cls(path, version, runner)

    def run(self, argv: list[str], *, secrets: Iterable[str], log: Path | None, timeout: float) -> Result:
        return self.runner.run(argv, secrets=secrets, log=log, env=_clean_env(), timeout=timeout)


def _clean_env() -> dict[str, str | None]:
    return {name: None for name in _COSIGN_ENV_DROPPED}


def secret_values(options: SignOptions) -> list[str]:
    """What must never reach a log: the key's password and a keyless identity token."""
    values = [os.environ.get(PASSWORD_ENV, ""), os.environ.get(TOKEN_ENV, "")]
    token = options.keyless.identity_token if options.keyless else None
    if token:
        try:
            values.append(Path(token).read_text(encoding="utf-8").strip())
        except OSError:
            pass
    return [v for v in values if v]


# --- the registry side -----------------------------------------------------------------------------


def _manifest(client: Registry, repository: str, tag: str) -> dict[str, Any] | None:
    """A `.sig` or `.att` manifest, read as verify reads it (size-capped, its digest checked); None when absent."""
    found = client.find_manifest(repository, tag, max_bytes=verify.MAX_SIGNATURE_MANIFEST_BYTES)
    if found is None:
        return None
    try:
        data = json.loads(found[0])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def signature_layers(client: Registry, image: str, digest: str) -> Iterator[SignatureLayer]:
    """The signatures under the `.sig` tag, read one at a time (a caller that found its one reads no more).

    A layer whose payload cannot be read, is too large, or is not the blob its descriptor names is left out.
    """
    repository = ImageRef.parse(image).repository
    manifest = _manifest(client, repository, signature_tag(digest, "sig"))
    payloads: dict[str, bytes] = {}  # cosign's payload for one digest is the same bytes in every layer
    for descriptor in (manifest or {}).get("layers") or []:
        if not isinstance(descriptor, dict):
            continue
        annotations, blob = descriptor.get("annotations"), descriptor.get("digest")
        if not isinstance(annotations, dict) or SIGNATURE_ANNOTATION not in annotations or not isinstance(blob, str):
            continue
        try:
            if blob not in payloads:
                payloads[blob] = client.get_blob_limited(repository, blob, verify.MAX_SIGNATURE_BLOB_BYTES)
            verify.check_blob(descriptor, payloads[blob])
        except (RegistryError, verify.Refused):
            continue
        yield SignatureLayer(annotations, payloads[blob])


def signature_present(client: Registry, image: str, digest: str) -> bool:
    """The `.sig` tag exists and one of its signatures is over a payload naming `digest`."""
    return any(names_digest(layer.payload, digest) for layer in signature_layers(client, image, digest))


def attestation_types(client: Registry, image: str, digest: str) -> set[str]:
    """The predicate types attached under the `.att` tag (cosign annotates each layer with its type)."""
    manifest = _manifest(client, ImageRef.parse(image).repository, signature_tag(digest, "att"))
    if manifest is None:
        return set()
    return {str((layer.get("annotations") or {}).get("predicateType"))
            for layer in manifest.get("layers") or [] if (layer.get("annotations") or {}).get("predicateType")}


def attested_digests(client: Registry, image: str, digest: str, key: verify.Key | None) -> dict[str, str]:
    """The canonical sha256 of each attestation now under the `.att` tag, by attestation name, as a
    verifier will see it: cosign re-encodes some predicates (the vuln shape) on the way, so the
    release record names what was attested, read back, not the file handed to cosign. With a key,
    only envelopes it signed count; a type found twice (someone re-added an old layer) is an error."""
    repository = ImageRef.parse(image).repository
    manifest = _manifest(client, repository, signature_tag(digest, "att")) or {}
    names = {kind.predicate_type: kind.name for kind in attest.KINDS if kind is not attest.RELEASE}
    found: dict[str, set[str]] = {}
    for descriptor in manifest.get("layers") or []:
        if not isinstance(descriptor, dict) or descriptor.get("mediaType") != verify.DSSE_MEDIA_TYPE:
            continue
        try:
            blob = client.get_blob_limited(repository, str(descriptor.get("digest")), verify.MAX_ATTESTATION_BLOB_BYTES)
            verify.check_blob(descriptor, blob)
            attestation = (verify.open_envelope(blob, [key], digest) if key is not None
                           else verify.read_statement(blob, digest))
        except (RegistryError, verify.Refused):
            continue
        name = names.get(attestation.predicate_type)
        if name is not None:
            found.setdefault(name, set()).add(attestation.content_sha256)
    doubled = sorted(name for name, digests in found.items() if len(digests) > 1)
    if doubled:
        raise SignError(f"{tag_ref(image, digest, 'att')} holds more than one {', '.join(doubled)} attestation "
                        "after cosign attest --replace")
    return {name: next(iter(digests)) for name, digests in found.items()}


# --- predicates from the workdir -------------------------------------------------------------------


def junit_tests(path: str | None) -> list[dict[str, str]]:
    """[{name, outcome}] from a smoke run's JUnit XML; empty when it is gone."""
    if not path:
        return []
    import xml.etree.ElementTree as ET  # here: push, which imports this module, reads no XML

    try:
        root = ET.fromstring(Path(path).read_text(encoding="utf-8"))
    except (OSError, ET.ParseError):
        return []
    tests = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                outcome = word
                break
        tests.append({"name": f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":"), "outcome": outcome})
    return tests


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(str(path), None, "", f"{what} not found (run imagebuild scan again)") from None
    except json.JSONDecodeError as exc:
        raise InputError(str(path), exc.lineno, "", f"not JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise InputError(str(path), None, "", f"{what}: not a JSON object")
    return data


# The predicates to attest, by image: None for a variant's only image, else each child's platform.
Prepared = dict[str | None, dict[str, dict[str, Any]]]
# A gate record -> the exceptions of the policy it judged by (SignRun.exceptions_of reads the file).
ExceptionsOf = Callable[[GateStage], Sequence[vex.AcceptedRisk]]
# (the image's labels, its signature layout) -> its provenance and release predicates.
ReleaseOf = Callable[[dict[str, str], provenance.SignatureLayout], dict[str, dict[str, Any]]]
# An index is attested with its provenance and its release record; what was tested, scanned and gated
# (smoke, vuln, SBOM, gate) is each child's, attested on the child's own digest.
INDEX_KINDS = (attest.PROVENANCE, attest.RELEASE)


def prepare(workdir: Path, report: BuildReport, variant: VariantRecord, exceptions_of: ExceptionsOf,
            now: dt.datetime) -> Prepared:
    """The five predicates of the variant's image, or of each child of its index, from each one's own records."""
    if not variant.multi_platform:
        return {None: build_predicates(workdir, variant, exceptions_of, now)}
    return {c.platform: build_predicates(workdir, report.child_variant(variant, c), exceptions_of, now)
            for c in variant.children}


def openvex_predicate(exceptions: Sequence[vex.AcceptedRisk], *, variant: VariantRecord, sbom: dict[str, Any],
                      gate: GateStage, now: dt.datetime) -> dict[str, Any]:
    """The variant's OpenVEX document: the exceptions valid on the gate's day (today when it recorded none)."""
    try:
        day = dt.date.fromisoformat(gate.evaluated_on) if gate.evaluated_on else now.astimezone(dt.timezone.utc).date()
    except ValueError:
        raise SignError(f"{variant.id}: the gate record's evaluated_on is not a date: {gate.evaluated_on!r:.40}") from None
    ref = ImageRef.parse(variant.image or "")
    return vex.image_document(exceptions, variant=variant.id, repository=ref.repository, digest=variant.digest or "",
                              sbom=sbom, today=day, now=now, tooling="imagebuild sign")


def build_predicates(workdir: Path, variant: VariantRecord, exceptions_of: ExceptionsOf,
                     now: dt.datetime) -> dict[str, dict[str, Any]]:
    """The five predicates of a variant, by attestation name, from its stage records, scan files and the gate's policy."""
    digest, image = variant.digest or "", variant.image or ""
    scan = variant.stage(ScanStage)
    smoke = variant.stage(SmokeStage)
    gate = variant.stage(GateStage)
    if scan is None or scan.status != StageStatus.OK:
        raise SignError(f"{variant.id}: no successful scan to attest (run imagebuild scan)")
    if smoke is None or gate is None:
        raise SignError(f"{variant.id}: smoke or gate record missing")
    sbom_path = workdir / scan.reports.get("sbom", "")
    trivy_path = workdir / scan.reports.get("image", "")
    summary_path = workdir / "scan" / "summary.json"
    db = _read_json(summary_path, "scan summary").get("db") if summary_path.is_file() else None
    sbom = _read_json(sbom_path, "SBOM")
    try:
        return {
            attest.SBOM.name: attest.sbom_predicate(sbom, digest=digest, variant=variant.id),
            attest.VULN.name: attest.vuln_predicate(_read_json(trivy_path, "Trivy report"), digest=digest,
                                                    variant=variant.id, image=image, scan=scan, db=db),
            attest.SMOKE.name: attest.smoke_predicate(smoke, digest=digest, variant=variant.id,
                                                      tests=junit_tests(smoke.junit)),
            attest.GATE.name: attest.gate_predicate(gate, digest=digest, variant=variant.id),
            attest.OPENVEX.name: openvex_predicate(exceptions_of(gate), variant=variant, sbom=sbom, gate=gate, now=now),
        }
    except (attest.PredicateError, ValueError) as exc:  # ValueError: build_document's digest check
        raise SignError(f"{variant.id}: {exc}") from None


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


PREDICATE_FILES = {attest.SBOM.name: "sbom.cdx.json", attest.VULN.name: "vuln.json",
                   attest.SMOKE.name: "smoke.json", attest.GATE.name: "gate.json", attest.OPENVEX.name: "openvex.json",
                   attest.PROVENANCE.name: "provenance.json", attest.RELEASE.name: "release.json"}
MAX_CONFIG_BYTES = 4 << 20


def image_labels(client: Registry, image: str) -> dict[str, str]:
    """The image config's labels (the release layer's: base image, revision, source); {} when it has none.

    An index (several platforms) is read through its first manifest: every platform is built
    from the same chain, so their labels agree.
    """
    ref = ImageRef.parse(image)
    raw, _, _ = client.get_manifest(ref.repository, ref.reference)
    manifest = json.loads(raw)
    if not manifest.get("config") and manifest.get("manifests"):
        raw, _, _ = client.get_manifest(ref.repository, manifest["manifests"][0]["digest"])
        manifest = json.loads(raw)
    config_digest = (manifest.get("config") or {}).get("digest")
    if not config_digest:
        raise SignError(f"{image}: its manifest names no image config")
    config = json.loads(client.get_blob_limited(ref.repository, config_digest, MAX_CONFIG_BYTES))
    labels = ((config.get("config") or {}).get("Labels")) or {}
    return {str(k): str(v) for k, v in labels.items()}


def signature_layout(image: str, digest: str, options: SignOptions, cosign_version: str) -> provenance.SignatureLayout:
    return provenance.SignatureLayout(layout=LAYOUT_TAG, signature=tag_ref(image, digest, "sig"),
                                      attestations=tag_ref(image, digest, "att"), key=options.key_reference,
                                      keyless=options.keyless is not None, tlog=options.uploads_to_tlog,
                                      cosign_version=cosign_version)


def index_release_record(report: BuildReport, variant: VariantRecord, children: list[provenance.ChildRelease],
                         labels: dict[str, str], layout: provenance.SignatureLayout,
                         env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The provenance and release predicates of a multi-platform variant's index (see
    provenance.index_release_predicate): its own provenance, and a release record naming each child's."""
    from imagebuild.checks.gate_run import tool_version

    builder = provenance.builder_from_environment(dict(os.environ) if env is None else env, tool_version())
    try:
        statement = provenance.provenance_statement(report, variant, labels=labels, builder=builder)
        release = provenance.index_release_predicate(variant, provenance=statement["predicate"], children=children,
                                                     signature=layout)
    except attest.PredicateError as exc:
        raise SignError(f"{variant.id}: {exc}") from None
    return {attest.PROVENANCE.name: statement["predicate"], attest.RELEASE.name: release}


def release_record(report: BuildReport, variant: VariantRecord, predicates: dict[str, dict[str, Any]],
                   labels: dict[str, str], layout: provenance.SignatureLayout,
                   env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The provenance and release predicates of a variant, from the report, the image's labels and the
    four predicates already built (SignError when the report cannot support them)."""
    from imagebuild.checks.gate_run import tool_version

    builder = provenance.builder_from_environment(dict(os.environ) if env is None else env, tool_version())
    try:
        statement = provenance.provenance_statement(report, variant, labels=labels, builder=builder)
        release = provenance.release_predicate(
            variant, provenance=statement["predicate"], smoke=predicates[attest.SMOKE.name],
            vuln=predicates[attest.VULN.name], gate=predicates[attest.GATE.name], signature=layout,
            sbom=predicates.get(attest.SBOM.name))
    except attest.PredicateError as exc:
        raise SignError(f"{variant.id}: {exc}") from None
    return {attest.PROVENANCE.name: statement["predicate"], attest.RELEASE.name: release}


# --- the run ---------------------------------------------------------------------------------------


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tail(output: str, lines: int = 8) -> str:
    return " | ".join(line.strip() for line in output.strip().splitlines()[-lines:] if line.strip())


@dataclass
class SignOutcome:
    variant: str
    image: str
    digest: str | None
    action: str  # signed, skipped (already signed), refused, failed
    record: SignStage

    def row(self) -> dict[str, Any]:
        return {"id": self.variant, "image": self.image, "digest": self.digest, "action": self.action,
                **self.record.to_dict()}


Event = Callable[[str, VariantRecord, str], None]  # ("start" | "done", variant, message)


@dataclass(frozen=True)
class SignerKey:
    """What a run knows of its signing key's public half: the key, or why it has none to check with."""

    key: verify.Key | None = None
    problem: str | None = None  # cosign could not give it (every variant is then signed, as before)


@dataclass
class SignRun:
    report_path: Path
    options: SignOptions
    cosign: Cosign
    on_event: Event = lambda *_: None
    # The vulnerability policy the OpenVEX documents are made from; None: the one each gate record names
    # (a path as the gate was given it, so relative to the directory the gate ran in).
    policy: Path | None = None
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)

    def __post_init__(self) -> None:
        self.report_path = self.report_path.resolve()
        self.workdir = self.report_path.parent
        self._signer: SignerKey | None = None
        self._policies: dict[str, tuple[str, tuple[vex.AcceptedRisk, ...]]] = {}  # path -> (sha256, exceptions)
        self.registries = Registries(insecure=self.options.insecure_registries)

    def exceptions_of(self, gate: GateStage) -> Sequence[vex.AcceptedRisk]:
        """The exceptions of the policy `gate` judged by, each file read once (InputError when it is bad: exit 2).

        SignError when the gate named none, or when the file is not the one a release's gate judged by
        (its record keeps the policy's sha256): the document would speak of exceptions the gate never saw."""
        from imagebuild.checks.gate import parse_policy  # the gate (SARIF's XML): push imports this module

        path = self.policy if self.policy is not None else (Path(gate.policy) if gate.policy else None)
        if path is None:
            raise SignError("the gate record names no policy to make the OpenVEX document from (pass --policy)")
        if str(path) not in self._policies:
            document = load_document(path)
            sha256 = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
            self._policies[str(path)] = (sha256, tuple(parse_policy(document).exceptions))
        sha256, exceptions = self._policies[str(path)]
        inputs = gate.extra.get("inputs")
        judged = inputs.get("policy_sha256") if isinstance(inputs, dict) else None
        if judged is not None and judged != sha256:
            raise SignError(f"{path} changed since the gate judged this image by it: gate it again "
                            "(or attest its VEX with `imagebuild vex attest`)")
        return exceptions

    def signer_key(self) -> SignerKey:
        """The signing key's public half, asked of cosign once per run; none with keyless signing."""
        if self._signer is None:
            self._signer = self._ask_public_key() if can_reuse_signature(self.options) else SignerKey()
        return self._signer

    def _ask_public_key(self) -> SignerKey:
        folder = self.workdir / "sign"
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="imagebuild-public-key-") as scratch:
            outfile = Path(scratch) / "signing.pub"  # a file: on stdout the PEM would be mixed with cosign's notes
            result = self.cosign.run(public_key_argv(self.cosign.path, self.options, outfile),
                                     secrets=secret_values(self.options), log=folder / "cosign-public-key.log",
                                     timeout=self.options.timeout_s)
            if result.returncode != 0:
                return SignerKey(problem=f"cosign public-key failed (exit {result.returncode}): {_tail(result.output, 2)}")
            try:
                return SignerKey(signing_key(outfile.read_text(encoding="ascii"), self.options.key or ""))
            except (OSError, UnicodeDecodeError, InputError) as exc:
                return SignerKey(problem=f"cosign public-key gave no usable public key: {exc}")

    def run(self, variants: list[VariantRecord]) -> list[SignOutcome]:
        """Check everything first (bad input, an unreachable registry: nothing written), then sign one by one."""
        prepared: dict[str, Prepared | SignError] = {}
        report = BuildReport.read(self.report_path)
        for variant in variants:
            if variant.refusal(*SIGN_NEEDS) is None:
                try:
                    prepared[variant.id] = prepare(self.workdir, report, variant, self.exceptions_of,
                                                   self.clock())  # InputError: exit 2
                except SignError as exc:  # a record about another digest: this variant fails, the others go on
                    prepared[variant.id] = exc
        one_image_per_registry = {ImageRef.parse(v.image).registry: v.image for v in variants
                                  if v.id in prepared and v.image}
        try:
            for image in one_image_per_registry.values():
                self.client_for(image).ping()  # RegistryError: exit 3
            outcomes = []
            for variant in variants:
                if cancel_requested():
                    break
                outcomes.append(self.one(variant, prepared.get(variant.id)))
            return outcomes
        finally:
            self.registries.close()

    def client_for(self, image: str) -> Registry:
        return self.registries.get(ImageRef.parse(image).registry)

    def _record(self, variant: VariantRecord, record: SignStage) -> None:
        variant.stages["sign"] = record
        record_stage(self.report_path, "sign", {variant.id: record})

    def _base(self, variant: VariantRecord, status: StageStatus, **fields: Any) -> SignStage:
        return SignStage(status=status, digest=variant.digest, image=variant.image,
                         key=self.options.key_reference, keyless=self.options.keyless is not None,
                         cosign_version=self.cosign.version, tlog=self.options.uploads_to_tlog, **fields)

    def one(self, variant: VariantRecord, predicates: Prepared | SignError | None = None) -> SignOutcome:
        """Refuse, skip, or sign and attest one variant; `predicates` as run() prepared them (else built here)."""
        image = variant.image or ""
        why = variant.refusal(*SIGN_NEEDS)
        if why:
            record = self._base(variant, StageStatus.REFUSED, reason=why)
            self._record(variant, record)
            return SignOutcome(variant.id, image, variant.digest, "refused", record)
        digest = variant.digest or ""
        client = self.client_for(image)
        earlier = variant.stage(SignStage)
        if earlier is not None and self.already_signed(earlier, variant, client):
            return SignOutcome(variant.id, image, digest, "skipped", earlier)
        self.on_event("start", variant, image)
        try:
            if predicates is None:
                predicates = prepare(self.workdir, BuildReport.read(self.report_path), variant, self.exceptions_of,
                                     self.clock())
            if isinstance(predicates, SignError):
                raise predicates
            record = self._sign_variant(variant, client, predicates)
        except KeyboardInterrupt:  # tools.Cancelled too: the rerun does this variant again
            self._record(variant, self._base(variant, StageStatus.INTERRUPTED, reason="interrupted"))
            raise
        except (SignError, RegistryError) as exc:
            record = self._base(variant, StageStatus.FAILED, reason=str(exc).strip().splitlines()[0][:500])
            self._record(variant, record)
            self.on_event("done", variant, f"failed: {record.reason}")
            return SignOutcome(variant.id, image, digest, "failed", record)
        self._record(variant, record)
        self.on_event("done", variant, done_message(record, self.signer_key()))
        return SignOutcome(variant.id, image, digest, "signed", record)

    def already_signed(self, earlier: SignStage, variant: VariantRecord, client: Registry) -> bool:
        """Passed before for this digest (each child of an index on its own) and this key, and every signature
        and attestation is still there."""
        if variant.stage_problem(SignStage) is not None:
            return False
        if earlier.key != self.options.key_reference or earlier.keyless != (self.options.keyless is not None):
            return False
        image, digest = variant.image or "", variant.digest or ""
        digests = {digest: INDEX_KINDS if variant.multi_platform else IMAGE_KINDS}
        digests.update({c.digest: IMAGE_KINDS for c in variant.children})
        for signed, kinds in digests.items():
            if not signature_present(client, image, signed):
                return False
            if not {kind.predicate_type for kind in kinds} <= attestation_types(client, image, signed):
                return False
        return True

    def _sign_variant(self, variant: VariantRecord, client: Registry, prepared: Prepared) -> SignStage:
        """A variant's image; or each child of its index (all seven attestations, its own predicates), then the
        index itself (its provenance and a release record naming every child), the index last."""
        report = BuildReport.read(self.report_path)
        folder = self.workdir / "sign" / variant.id
        if not variant.multi_platform:
            return self._sign(report, variant, client, prepared[None], folder)
        signed: list[tuple[ChildImage, SignStage]] = []
        releases = []
        for child in variant.children:
            own = report.child_variant(variant, child)
            record = self._sign(report, own, client, prepared[child.platform], folder / platform_folder(child.platform))
            signed.append((child, record))
            releases.append(provenance.ChildRelease(child.platform, child.digest,
                                                    _read_json(self.workdir / record.predicates[attest.RELEASE.name],
                                                               "release predicate")))

        def index_release(labels: dict[str, str], layout: provenance.SignatureLayout) -> dict[str, dict[str, Any]]:
            return index_release_record(report, variant, releases, labels, layout)

        record = self._sign(report, variant, client, {}, folder, INDEX_KINDS, index_release)
        record.per_platform = {child.platform: r.to_dict() for child, r in signed}
        return record

    def _sign(self, report: BuildReport, variant: VariantRecord, client: Registry,
              predicates: dict[str, dict[str, Any]], folder: Path, kinds: tuple[attest.AttestationKind, ...] = IMAGE_KINDS,
              release_of: ReleaseOf | None = None) -> SignStage:
        """Sign one image by digest (reusing this key's signature) and attest `kinds`: the given predicates, then
        its provenance and release record (`release_of`; default: a single image's, from the four given)."""
        image, digest = variant.image or "", variant.digest or ""
        try:
            labels = image_labels(client, image)
        except (ValueError, AttributeError, TypeError, KeyError, IndexError):
            raise SignError(f"{image}: its manifest or config is not JSON an image has") from None
        layout = signature_layout(image, digest, self.options, self.cosign.version)
        made = (release_of(labels, layout) if release_of is not None
                else release_record(report, variant, predicates, labels, layout))
        predicates = {**predicates, **made}
        paths = {}
        for name, predicate in predicates.items():
            path = folder / PREDICATE_FILES[name]
            _write_atomic(path, predicate)
            paths[name] = path
        secrets = secret_values(self.options)

        def cosign(argv: list[str], what: str) -> None:
            result = self.cosign.run(argv, secrets=secrets, log=folder / f"cosign-{what}.log",
                                     timeout=self.options.timeout_s)
            if result.returncode != 0:
                raise SignError(f"cosign {what} {image} failed (exit {result.returncode}): {_tail(result.output)}")

        # A signature by this very key over this digest is all `cosign sign` would make. Each fresh
        # workdir (CI) signs the same digest again, and cosign skips a duplicate only when every
        # annotation matches: with --tlog (a new Rekor bundle each run) it adds a layer every time,
        # until the `.sig` manifest outgrows what verify accepts.
        signer = self.signer_key().key
        reused = signer is not None and signed_by(signature_layers(client, image, digest), signer, digest,
                                                  tlog=self.options.uploads_to_tlog)
        if not reused:
            cosign(sign_argv(self.cosign.path, image, self.options), "sign")
            if not signature_present(client, image, digest):
                raise SignError(f"cosign sign exited 0, but {tag_ref(image, digest, 'sig')} holds no signature of {digest}")
        for kind in kinds:
            if kind is attest.RELEASE:
                # Last, naming what the others are in the registry now (verify decides by it).
                vouched = attested_digests(client, image, digest, signer)
                release = {**predicates[kind.name], "attestations": vouched}
                _write_atomic(paths[kind.name], release)
            cosign(attest_argv(self.cosign.path, image, kind, paths[kind.name], self.options), f"attest-{kind.name}")
        missing = {k.predicate_type for k in kinds} - attestation_types(client, image, digest)
        if missing:
            raise SignError(f"{tag_ref(image, digest, 'att')} lacks {', '.join(sorted(missing))} after cosign attest")
        return self._base(
            variant, StageStatus.PASSED, layout=LAYOUT_TAG, signature=tag_ref(image, digest, "sig"),
            signature_reused=reused, attestation_ref=tag_ref(image, digest, "att"),
            attestations=[k.record() for k in kinds],
            predicates={name: str(path.relative_to(self.workdir)) for name, path in paths.items()},
            signed_at=_now())


def done_message(record: SignStage, signer: SignerKey) -> str:
    """The per-variant line once signed: whether the signature was made now or was already there."""
    how = "signature already present by this key: reused" if record.signature_reused else "signed"
    note = f" (not checked for an earlier signature: {signer.problem})" if signer.problem else ""
    children = [SignStage.from_dict(c) for c in record.per_platform.values()]
    each = f" on the index, {', '.join(str(len(c.attestations)) for c in children)} on its {len(children)} children" \
        if children else ""
    return f"{how}; {len(record.attestations)} attestations{each}{note}"


def select_report(workdir: Path) -> tuple[Path, BuildReport]:
    report_path = workdir / "build-report.json"
    return report_path, BuildReport.read(report_path)
