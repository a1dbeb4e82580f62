"""The release record of one variant: SLSA v1 provenance plus imagebuild's release predicate (pure: no I/O).

Two predicates, both about the image digest, both attached by `imagebuild sign` beside the four of
attest.py and read back by `imagebuild inspect`:

- provenance (https://slsa.dev/provenance/v1): how the image was built.
  buildDefinition.externalParameters: the matrix cell (the variant id and its axes) and the matrix
  file (path and sha256); internalParameters: the imagebuild version and the chain's layer keys;
  resolvedDependencies: the base image, the source revision and each layer image, by digest.
  runDetails: the builder's id, the build run's id and its start and end.
- release (https://imagebuild.dev/attestations/release/v1): what happened to it after the build:
  the smoke results, the scanner and its DB, the gate's decision with the exceptions it applied,
  where the signatures are, the tags, and a pointer to the provenance (its sha256).

Every value comes from the build report, the image's own labels (read by the caller), or the
predicates attest.py built for the other attestations; the builders copy named fields only, so
nothing secret (credentials, keys, environment) can get in. The same inputs give the same bytes.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from imagebuild.core.report import BuildReport, LayerRecord, VariantRecord
from imagebuild.oci import reference
from imagebuild.trust.attest import KINDS, PREDICATE_PROVENANCE, PredicateError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
BUILD_TYPE = "https://imagebuild.dev/build/v1"
LOCAL_BUILDER = "https://imagebuild.dev/builder/local"

# The OCI labels the release layer writes (templates/release.Dockerfile.j2): what the image says of itself.
LABEL_BASE_NAME = "org.opencontainers.image.base.name"
LABEL_BASE_DIGEST = "org.opencontainers.image.base.digest"
LABEL_REVISION = "org.opencontainers.image.revision"
LABEL_SOURCE = "org.opencontainers.image.source"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_UNKNOWN_REVISIONS = ("", "unknown")


@dataclass(frozen=True)
class Builder:
    """Who ran the build: SLSA's builder.id, a URI naming the platform trusted to have run it."""

    id: str = LOCAL_BUILDER
    imagebuild_version: str = "0"


def builder_from_environment(env: Mapping[str, str], imagebuild_version: str) -> Builder:
    """The builder id from CI's well-known variables (never their secrets): GitHub Actions' hosted or
    self-hosted runner, else imagebuild on a local machine."""
    if env.get("GITHUB_ACTIONS") == "true":
        hosting = "self-hosted" if env.get("RUNNER_ENVIRONMENT") == "self-hosted" else "github-hosted"
        return Builder(f"https://github.com/actions/runner/{hosting}", imagebuild_version)
    return Builder(LOCAL_BUILDER, imagebuild_version)


@dataclass(frozen=True)
class SignatureLayout:
    """Where `imagebuild sign` puts the signature and the attestations (sign.py knows the scheme)."""

    layout: str  # "tag": cosign v2's <repo>:sha256-<hex>.sig / .att
    signature: str  # the signature's tag reference
    attestations: str  # the attestations' tag reference
    key: str | None  # the key's path or KMS URI (never key material); None when keyless
    keyless: bool
    tlog: bool
    cosign_version: str

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "signature": self.signature, "attestations": self.attestations,
                "key": self.key, "keyless": self.keyless, "tlog": self.tlog, "cosign": self.cosign_version,
                "predicate_types": [kind.predicate_type for kind in KINDS]}


def sha256_hex(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise PredicateError(f"'{digest}' is not a sha256 digest")
    return digest.split(":", 1)[1]


def canonical_sha256(document: Any) -> str:
    """sha256 of the JSON with sorted keys and no spaces: the same for the same content, whoever re-encoded it."""
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _repository(image: str) -> str:
    """registry/repository of a reference, without tag or digest, in its canonical spelling
    (imagebuild.oci.reference: `docker.io/library/x`, host lower case, no default port)."""
    try:
        return reference.parse(image).canonical_name
    except reference.ReferenceError as exc:
        raise PredicateError(f"not an image reference: {exc}") from None


def matrix_cell(variant: VariantRecord) -> dict[str, Any]:
    return {"id": variant.id, "os": variant.os, "device": variant.device, "cuda": variant.cuda,
            "cudnn": variant.cudnn, "python": variant.python, "paddle": variant.paddle}


def _layers(report: BuildReport, variant: VariantRecord) -> list[LayerRecord]:
    layers = []
    for key in variant.chain:
        try:
            layer = report.layer(key)
        except StopIteration:
            raise PredicateError(f"the report has no layer {key} of {variant.id}'s chain") from None
        if not layer.digest:
            raise PredicateError(f"layer {layer.path} ({key}) has no digest in the report")
        sha256_hex(layer.digest)
        layers.append(layer)
    if not layers:
        raise PredicateError(f"{variant.id} has no layers in the report")
    return layers


def source_revision(report: BuildReport, labels: Mapping[str, str]) -> str | None:
    """The commit the image was built from: its revision label, else the report's; None when unknown."""
    for candidate in (labels.get(LABEL_REVISION), report.revision):
        if candidate and candidate not in _UNKNOWN_REVISIONS:
            return candidate
    return None


def _base(labels: Mapping[str, str], variant: VariantRecord) -> dict[str, Any]:
    name, digest = labels.get(LABEL_BASE_NAME), labels.get(LABEL_BASE_DIGEST)
    if not name or not digest or not _DIGEST.match(digest):
        raise PredicateError(f"{variant.id}: the image's labels name no base image digest "
                             f"({LABEL_BASE_NAME}={name!r}, {LABEL_BASE_DIGEST}={digest!r})")
    return {"name": "base", "uri": f"oci://{_repository(name)}@{digest}", "digest": {"sha256": sha256_hex(digest)},
            "annotations": {"reference": name}}


def provenance_statement(report: BuildReport, variant: VariantRecord, *, labels: Mapping[str, str],
                         builder: Builder) -> dict[str, Any]:
    """The in-toto statement (v1) holding the SLSA v1 provenance of the variant's image.

    `labels` are the image config's labels (the base image and the revision it was built from);
    PredicateError when the report cannot say something the provenance must (a digest, a layer's digest).
    """
    if not variant.digest or not variant.image:
        raise PredicateError(f"{variant.id} is not built: no image digest to attest")
    hex_digest = sha256_hex(variant.digest)
    layers = _layers(report, variant)
    dependencies = [_base(labels, variant)]
    revision = source_revision(report, labels)
    if revision is not None:
        source = labels.get(LABEL_SOURCE)
        entry: dict[str, Any] = {"name": "source", "digest": {"gitCommit": revision}}
        if source:
            entry["uri"] = f"git+{source}"
        dependencies.append(entry)
    cache = _repository(report.cache_repository)
    dependencies += [{"name": f"layer/{layer.kind}", "uri": f"oci://{cache}@{layer.digest}",
                      "digest": {"sha256": sha256_hex(layer.digest or "")},
                      "annotations": {"key": layer.key, "kind": layer.kind, "path": layer.path}}
                     for layer in layers]
    matrix: dict[str, Any] = {"path": report.matrix}
    if report.matrix_sha256:
        matrix["sha256"] = report.matrix_sha256
    metadata: dict[str, Any] = {"invocationId": report.run_id, "startedOn": report.created}
    if report.finished:
        metadata["finishedOn"] = report.finished
    predicate = {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {"variant": matrix_cell(variant), "matrix": matrix},
            "internalParameters": {
                "imagebuild": builder.imagebuild_version,
                "repository": report.repository,
                "cache_repository": report.cache_repository,
                "layers": [{"kind": layer.kind, "key": layer.key, "path": layer.path} for layer in layers],
            },
            "resolvedDependencies": dependencies,
        },
        "runDetails": {
            "builder": {"id": builder.id, "version": {"imagebuild": builder.imagebuild_version}},
            "metadata": metadata,
        },
    }
    return {"_type": STATEMENT_TYPE, "subject": [{"name": _repository(variant.image), "digest": {"sha256": hex_digest}}],
            "predicateType": PREDICATE_PROVENANCE, "predicate": predicate}


# --- the release predicate --------------------------------------------------------------------------

_SMOKE_KEPT = ("status", "counts", "tiers", "gpu_requested", "suite_digest", "duration_s", "reason", "failures")
_GATE_KEPT = ("decision", "policy", "evaluated_on", "counts", "blocking", "exceptions_applied")


def release_predicate(variant: VariantRecord, *, provenance: Mapping[str, Any], smoke: Mapping[str, Any],
                      vuln: Mapping[str, Any], gate: Mapping[str, Any], signature: SignatureLayout,
                      sbom: Mapping[str, Any] | None = None, issued_at: str | None = None) -> dict[str, Any]:
    """imagebuild's release record for the variant's image.

    `smoke`, `vuln`, `gate` (and `sbom`) are the predicates attest.py built for those attestations
    (each already checked to be about this digest); `provenance` is the provenance predicate, which
    the record points to by its canonical sha256.

    `attestations` names every attestation the record vouches for by the canonical sha256 of its
    predicate, and `issued_at` is when (signed, as the whole record is): verifiers decide which
    attestations count by these, never by the order of the unsigned `.att` manifest's layers, so
    an older attestation re-added by someone who can push is ignored.
    """
    digest = variant.digest or ""
    sha256_hex(digest)
    vuln_digest = ((vuln.get("invocation") or {}).get("parameters") or {}).get("digest")
    for name, recorded in (("smoke", smoke.get("digest")), ("gate", gate.get("digest")), ("vuln", vuln_digest)):
        if recorded != digest:
            raise PredicateError(f"the {name} predicate is about {recorded}, not {digest}")
    scanner = vuln.get("scanner") or {}
    return {
        "digest": digest,
        "variant": variant.id,
        "image": variant.image,
        "tags": list(variant.images),
        "smoke": {key: smoke.get(key) for key in _SMOKE_KEPT},
        "scan": {"scanner": {"uri": scanner.get("uri"), "version": scanner.get("version")},
                 "db": dict(scanner.get("db") or {}),
                 "started": (vuln.get("metadata") or {}).get("scanStartedOn"),
                 "finished": (vuln.get("metadata") or {}).get("scanFinishedOn")},
        "gate": {key: gate.get(key) for key in _GATE_KEPT},
        "signature": signature.to_dict(),
        "provenance": {"predicateType": PREDICATE_PROVENANCE, "buildType": BUILD_TYPE,
                       "sha256": canonical_sha256(provenance)},
        "attestations": {name: canonical_sha256(predicate) for name, predicate in
                         (("sbom", sbom), ("vuln", vuln), ("smoke", smoke), ("gate", gate), ("provenance", provenance))
                         if predicate is not None},
        "issued_at": issued_at or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }


@dataclass(frozen=True)
class ChildRelease:
    """One child of an index as its release record names it: the child's own release predicate, signed on it."""

    platform: str
    digest: str
    release: Mapping[str, Any]


def index_release_predicate(variant: VariantRecord, *, provenance: Mapping[str, Any], children: Sequence[ChildRelease],
                            signature: SignatureLayout, issued_at: str | None = None) -> dict[str, Any]:
    """imagebuild's release record for a multi-platform variant's index.

    The smoke tests, the scan and the gate judged each child, so their predicates are attested on each
    child's digest, and each child carries its own release record. The index's names every child (platform,
    digest, the canonical sha256 of that child's release predicate, and its smoke and gate outcome), the
    index's own provenance, and the signature layout: a verifier of the index finds from it which children
    it must find signed and released, each on its own digest.
    """
    digest = variant.digest or ""
    sha256_hex(digest)
    wanted = {c.digest for c in variant.children}
    named = {c.digest for c in children}
    if named != wanted:
        raise PredicateError(f"the index's release record must name each child of {digest} once "
                             f"(children {sorted(wanted)}, named {sorted(named)})")
    for child in children:
        if child.release.get("digest") != child.digest:
            raise PredicateError(f"the {child.platform} release predicate is about {child.release.get('digest')}, "
                                 f"not {child.digest}")
    return {
        "digest": digest,
        "variant": variant.id,
        "image": variant.image,
        "tags": list(variant.images),
        "platforms": [{"platform": c.platform, "digest": c.digest, "release_sha256": canonical_sha256(c.release),
                       "smoke": (c.release.get("smoke") or {}).get("status"),
                       "gate": (c.release.get("gate") or {}).get("decision")} for c in children],
        "signature": signature.to_dict(),
        "provenance": {"predicateType": PREDICATE_PROVENANCE, "buildType": BUILD_TYPE,
                       "sha256": canonical_sha256(provenance)},
        "attestations": {"provenance": canonical_sha256(provenance)},
        "issued_at": issued_at or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }


# --- reading them back (inspect, verify) ------------------------------------------------------------


def provenance_problems(predicate: Any) -> list[str]:
    """Why a (verified) provenance predicate is not imagebuild's SLSA v1 provenance; empty when it is."""
    if not isinstance(predicate, dict):
        return ["the provenance predicate is not a JSON object"]
    build = predicate.get("buildDefinition")
    run = predicate.get("runDetails")
    problems = []
    if not isinstance(build, dict) or not isinstance(run, dict):
        return ["the provenance has no buildDefinition and runDetails"]
    if build.get("buildType") != BUILD_TYPE:
        problems.append(f"the provenance's buildType is {build.get('buildType')!r}, not imagebuild's {BUILD_TYPE}")
    if not isinstance(build.get("externalParameters"), dict):
        problems.append("the provenance has no externalParameters")
    builder = run.get("builder")
    if not isinstance(builder, dict) or not isinstance(builder.get("id"), str):
        problems.append("the provenance names no builder id")
    return problems


def release_problems(release: Any, provenance: Any, digest: str) -> list[str]:
    """Why a (verified) release record does not belong with this digest and this provenance."""
    if not isinstance(release, dict):
        return ["the release record is not a JSON object"]
    problems = []
    if release.get("digest") != digest:
        problems.append(f"the release record is about {release.get('digest')}, not {digest}")
    pointer: dict[str, Any] = release["provenance"] if isinstance(release.get("provenance"), dict) else {}
    if provenance is not None and pointer.get("sha256") != canonical_sha256(provenance):
        problems.append("the release record points to another provenance (sha256 differs)")
    variant = (((provenance or {}).get("buildDefinition") or {}).get("externalParameters") or {}).get("variant")
    if isinstance(variant, dict) and variant.get("id") != release.get("variant"):
        problems.append(f"the release record is of {release.get('variant')}, the provenance of {variant.get('id')}")
    return problems


def dependencies_named(provenance: Mapping[str, Any], prefix: str) -> Sequence[Mapping[str, Any]]:
    deps = (provenance.get("buildDefinition") or {}).get("resolvedDependencies") or []
    return [d for d in deps if isinstance(d, dict) and str(d.get("name", "")).startswith(prefix)]


def record_summary(provenance: Mapping[str, Any], release: Mapping[str, Any] | None) -> dict[str, Any]:
    """What `imagebuild inspect` shows: the fields of both predicates a person asks about, by name."""
    build = provenance.get("buildDefinition") or {}
    run = provenance.get("runDetails") or {}
    external = build.get("externalParameters") or {}
    cell = external.get("variant") or {}
    base = next(iter(dependencies_named(provenance, "base")), {})
    source = next(iter(dependencies_named(provenance, "source")), {})
    layers = [{"kind": (d.get("annotations") or {}).get("kind"), "key": (d.get("annotations") or {}).get("key"),
               "digest": "sha256:" + str((d.get("digest") or {}).get("sha256"))}
              for d in dependencies_named(provenance, "layer/")]
    metadata = run.get("metadata") or {}
    release = release or {}
    return {
        "variant": cell.get("id"),
        "matrix_cell": dict(cell),
        "matrix": dict(external.get("matrix") or {}),
        "base": {"image": (base.get("annotations") or {}).get("reference"),
                 "digest": "sha256:" + str((base.get("digest") or {}).get("sha256")) if base else None},
        "source": {"uri": source.get("uri"), "revision": (source.get("digest") or {}).get("gitCommit")},
        "layers": layers,
        "builder": (run.get("builder") or {}).get("id"),
        "build_run": {"id": metadata.get("invocationId"), "started": metadata.get("startedOn"),
                      "finished": metadata.get("finishedOn")},
        "smoke": release.get("smoke"),
        "scan": release.get("scan"),
        "gate": release.get("gate"),
        "signature": release.get("signature"),
        "tags": release.get("tags"),
    }
