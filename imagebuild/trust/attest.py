"""The attestations `imagebuild sign` attaches to each image, built from the report (pure: no I/O).

Four predicates, each about one image digest, each attached with `cosign attest --type T`:

    name   cosign --type                 predicateType (what verifiers and admission policies match)
    sbom   cyclonedx                     https://cyclonedx.org/bom
    vuln   vuln                          https://cosign.sigstore.dev/attestation/vuln/v1
    smoke  <the smoke URI>               https://imagebuild.dev/attestations/smoke/v1
    gate   <the gate URI>                https://imagebuild.dev/attestations/gate/v1
    provenance <the SLSA URI>            https://slsa.dev/provenance/v1 (provenance.py builds it)
    release    <the release URI>         https://imagebuild.dev/attestations/release/v1 (provenance.py)
    openvex    <the OpenVEX URI>         https://openvex.dev/ns/v0.2.0 (checks/vex.py; `imagebuild vex attest`)

The OpenVEX document is attested with its URI as `--type` too: cosign's word `openvex` would
re-encode it through go-vex's struct, dropping the statements' `imagebuild:expires`.

The provenance is attested with its URI as `--type`, not cosign's word `slsaprovenance1`: for
that word cosign re-encodes the predicate through in-toto-golang's struct, which writes
`runDetails.metadata.invocationID` where SLSA v1 says `invocationId`; a URI keeps our bytes.
`cosign verify-attestation --type slsaprovenance1` matches it all the same (same predicateType).

Every predicate names the digest it is about, besides the in-toto subject cosign writes: the
vuln predicate in `invocation.parameters` (cosign keeps only the fields of its vuln shape, so a
top-level key would be dropped), the SBOM in `metadata.properties`, smoke and gate at the top.

Nothing secret goes into a predicate: the builders copy named fields only, and the secrets a
Trivy scan found are reduced to rule, severity and place, never the matched text.
"""
from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import GateStage, ScanStage, SmokeStage

PREDICATE_SBOM = "https://cyclonedx.org/bom"
PREDICATE_VULN = "https://cosign.sigstore.dev/attestation/vuln/v1"
PREDICATE_SMOKE = "https://imagebuild.dev/attestations/smoke/v1"
PREDICATE_GATE = "https://imagebuild.dev/attestations/gate/v1"
PREDICATE_PROVENANCE = "https://slsa.dev/provenance/v1"
PREDICATE_RELEASE = "https://imagebuild.dev/attestations/release/v1"
PREDICATE_OPENVEX = "https://openvex.dev/ns/v0.2.0"

TRIVY_URI = "https://github.com/aquasecurity/trivy"
INVOCATION_URI = "https://imagebuild.dev/commands/scan"  # what produced the scan the vuln predicate carries
DIGEST_PROPERTY = "imagebuild:digest"  # the SBOM's metadata.properties entry naming the image digest
VARIANT_PROPERTY = "imagebuild:variant"


class PredicateError(ImagebuildError, ValueError):
    """A stage record or scan output cannot make a truthful predicate (wrong digest, missing field)."""


@dataclass(frozen=True)
class AttestationKind:
    name: str  # the word trust.yaml's require.attestations uses
    cosign_type: str  # what `cosign attest --type` is given
    predicate_type: str  # what cosign writes as the statement's predicateType

    def record(self) -> dict[str, str]:
        return {"type": self.name, "predicate_type": self.predicate_type}


SBOM = AttestationKind("sbom", "cyclonedx", PREDICATE_SBOM)
VULN = AttestationKind("vuln", "vuln", PREDICATE_VULN)
SMOKE = AttestationKind("smoke", PREDICATE_SMOKE, PREDICATE_SMOKE)
GATE = AttestationKind("gate", PREDICATE_GATE, PREDICATE_GATE)
PROVENANCE = AttestationKind("provenance", PREDICATE_PROVENANCE, PREDICATE_PROVENANCE)
RELEASE = AttestationKind("release", PREDICATE_RELEASE, PREDICATE_RELEASE)
KINDS: tuple[AttestationKind, ...] = (SBOM, VULN, SMOKE, GATE, PROVENANCE, RELEASE)
# The policy's exceptions as OpenVEX: `imagebuild sign` attaches it with the others (sign.IMAGE_KINDS), but it
# is not one of KINDS: the exceptions change on their own schedule, `imagebuild vex attest` replaces it by
# itself, and so no release record vouches for it (its digest would go stale).
OPENVEX = AttestationKind("openvex", PREDICATE_OPENVEX, PREDICATE_OPENVEX)
PREDICATE_TYPES: dict[str, str] = {kind.name: kind.predicate_type for kind in (*KINDS, OPENVEX)}


def _require_digest(what: str, recorded: Any, digest: str) -> None:
    """A predicate built from a record of another image would attest something untrue."""
    if recorded != digest:
        raise PredicateError(f"the {what} record is about {recorded}, not {digest}")


# --- SBOM ----------------------------------------------------------------------------------------


def sbom_predicate(sbom: Mapping[str, Any], *, digest: str, variant: str) -> dict[str, Any]:
    """The CycloneDX SBOM scan wrote, with the digest and variant added to metadata.properties.

    Refused when the BOM's own subject (metadata.component) names another digest.
    """
    if sbom.get("bomFormat") != "CycloneDX":
        raise PredicateError("the SBOM is not a CycloneDX document (bomFormat)")
    bom = copy.deepcopy(dict(sbom))
    metadata = bom.setdefault("metadata", {})
    component = metadata.get("component") or {}
    names = " ".join(str(component.get(key, "")) for key in ("name", "purl", "bom-ref"))
    if "@sha256:" in names and digest not in names:
        raise PredicateError(f"the SBOM describes {component.get('name')}, not {digest}")
    properties = [p for p in metadata.get("properties") or []
                  if p.get("name") not in (DIGEST_PROPERTY, VARIANT_PROPERTY)]
    metadata["properties"] = [*properties, {"name": DIGEST_PROPERTY, "value": digest},
                              {"name": VARIANT_PROPERTY, "value": variant}]
    return bom


# --- vulnerabilities -------------------------------------------------------------------------------

_SECRET_FIELDS_KEPT = ("RuleID", "Category", "Severity", "Title", "StartLine", "EndLine")


def scrub_trivy_report(report: Mapping[str, Any]) -> dict[str, Any]:
    """Trivy's JSON without the text of any secret it found (Match, Code): where and what kind only."""
    clean = copy.deepcopy(dict(report))
    for result in clean.get("Results") or []:
        if result.get("Secrets"):
            result["Secrets"] = [{k: s[k] for k in _SECRET_FIELDS_KEPT if k in s} for s in result["Secrets"]]
    return clean


def _rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> dt.datetime:
    moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def vuln_predicate(trivy_report: Mapping[str, Any], *, digest: str, variant: str, image: str,
                   scan: ScanStage, db: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """cosign's vuln predicate: {invocation, scanner: {uri, version, db, result}, metadata}.

    `scan` is the variant's scan stage record; `db` the scan summary's `db` entry when there
    is one. The result is Trivy's JSON report, scrubbed of secret text; refused when the
    stage or the report is about another digest.
    """
    _require_digest("scan", scan.digest, digest)
    repo_digests = (trivy_report.get("Metadata") or {}).get("RepoDigests") or []
    artifact = str(trivy_report.get("ArtifactName", ""))
    if digest not in artifact and not any(str(d).endswith(digest) for d in repo_digests):
        raise PredicateError(f"the Trivy report is about {artifact or 'an unnamed artifact'}, not {digest}")
    if not scan.scanned_at:
        raise PredicateError("the scan record has no scanned_at time")
    started = _parse_time(str(scan.scanned_at))
    finished = started + dt.timedelta(seconds=float(scan.duration_s or 0))
    db = db or {}
    return {
        "invocation": {
            "parameters": {"image": image, "digest": digest, "variant": variant,
                           "scanners": ["vuln", "secret"], "image_src": "remote"},
            "uri": INVOCATION_URI,
            "event_id": "",
            "builder.id": "imagebuild",
        },
        "scanner": {
            "uri": TRIVY_URI,
            "version": str(scan.trivy_version or ""),
            "db": {"uri": str(db.get("source") or "trivy-db"),
                   "version": str(db.get("updated_at") or scan.db_updated_at or "")},
            "result": scrub_trivy_report(trivy_report),
        },
        "metadata": {"scanStartedOn": _rfc3339(started), "scanFinishedOn": _rfc3339(finished)},
    }


# --- smoke tests ---------------------------------------------------------------------------------

_SMOKE_FIELDS = ("reason", "tiers", "gpu_requested", "suite_digest", "duration_s", "exit_code")


def smoke_predicate(smoke: SmokeStage, *, digest: str, variant: str,
                    tests: Sequence[Mapping[str, str]] = ()) -> dict[str, Any]:
    """The smoke result for this digest: status, counts, failures and skip reasons, per-test outcomes.

    `smoke` is the variant's smoke stage record; `tests` the JUnit cases as [{name, outcome}]
    when the JUnit file is at hand.
    """
    _require_digest("smoke", smoke.digest, digest)
    return {
        "digest": digest,
        "variant": variant,
        "image": smoke.image,
        "status": smoke.status.value,
        "counts": {key: int(getattr(smoke, key) or 0) for key in ("passed", "failed", "errors", "skipped")},
        **{key: getattr(smoke, key) for key in _SMOKE_FIELDS},
        "failures": [dict(f) for f in smoke.failures or []],
        "skip_reasons": [dict(s) for s in smoke.skip_reasons or []],
        "tests": [dict(t) for t in tests],
    }


# --- the gate ------------------------------------------------------------------------------------


def exceptions_applied(gate: GateStage) -> list[dict[str, Any]]:
    """Each accepted risk the gate applied: the finding (id, package) and the policy's owner, reason, expiry."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[str, str, str]] = set()
    for finding in gate.excepted or []:
        exception = finding.get("exception") or {}
        package = str(finding.get("package") or finding.get("target") or "")
        key = (str(finding.get("id")), package, str(exception.get("id")))
        if key in seen:
            continue
        seen.add(key)
        out.append({"id": finding.get("id"), "package": package, "severity": finding.get("severity"),
                    "exception": exception.get("id"), "owner": exception.get("owner"),
                    "reason": exception.get("reason"), "expires": exception.get("expires")})
    return out


def gate_predicate(gate: GateStage, *, digest: str, variant: str) -> dict[str, Any]:
    """The gate's decision for this digest, the policy it applied, and the exceptions that let findings through.

    `gate` is the variant's gate stage record.
    """
    _require_digest("gate", gate.digest, digest)
    return {
        "digest": digest,
        "variant": variant,
        "image": gate.image,
        "decision": "passed" if gate.status == "passed" else "blocked",
        "policy": {"file": gate.policy, "severity": gate.severity,
                   "ignore_unfixed": bool(gate.ignore_unfixed), "strict": bool(gate.strict)},
        "evaluated_on": gate.evaluated_on,
        "counts": dict(gate.counts or {}),
        "blocking": [{"id": b.get("id"), "kind": b.get("kind"), "severity": b.get("severity"),
                      "package": b.get("package"), "target": b.get("target")} for b in gate.blocking or []],
        "exceptions_applied": exceptions_applied(gate),
        "problems": list(gate.problems or []),
        "warnings": list(gate.warnings or []),
    }
