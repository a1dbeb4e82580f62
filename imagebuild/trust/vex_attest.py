"""`imagebuild vex attest`: the policy's valid exceptions as a signed OpenVEX attestation of one image, and the
signed document read back for a scan (rescan feeds it to `trivy --vex`).

`imagebuild sign` attaches the same document (from the gate's policy) with the other attestations; this
command is for attesting it again after the policy changed (a renewed or a new exception).

The document is built by checks/vex.py (pure) and attached with `cosign attest --replace` by digest,
so a newer document replaces the older one. Reading it back trusts only what verifies: the image's
signature and the attestation's envelope with the trust file's keys (Verifier.inspect), then every
field of the predicate (vex.parse_document), then only the statements about this digest that have
not expired (vex.for_trivy).
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.checks import vex
from imagebuild.checks.gate import Policy
from imagebuild.core.source import InputError, safe_text
from imagebuild.oci.client import ImageRef
from imagebuild.trust import attest
from imagebuild.trust.sign import Cosign, SignError, SignOptions, attest_argv, secret_values
from imagebuild.trust.verify import Verifier, signed_vex


@dataclass(frozen=True)
class Attested:
    image: str
    path: Path  # the document attested
    statements: tuple[str, ...]  # the vulnerabilities it speaks of


def attest_image(cosign: Cosign, image: str, *, variant: str, policy: Policy, sbom: dict[str, Any],
                 options: SignOptions, out: Path, today: dt.date, now: dt.datetime) -> Attested:
    """Build the image's OpenVEX document (exceptions valid `today`) into OUT/openvex.json and attest it."""
    ref = ImageRef.parse(image)
    if ref.digest is None:
        raise InputError(image, None, "", "not addressed by digest; only digests are attested")
    document = vex.image_document(policy.exceptions, variant=variant, repository=ref.repository, digest=ref.digest,
                                  sbom=sbom, today=today, now=now)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "openvex.json"
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    result = cosign.run(attest_argv(cosign.path, image, attest.OPENVEX, path, options),
                        secrets=secret_values(options), log=out / "cosign-attest-openvex.log", timeout=options.timeout_s)
    if result.returncode != 0:
        tail = "\n".join(result.output.strip().splitlines()[-8:])
        raise SignError(f"cosign attest (openvex) of {image} failed (exit {result.returncode}): {tail}")
    return Attested(image, path, tuple(s["vulnerability"]["name"] for s in document["statements"]))


@dataclass
class SignedVex:
    """What a scan of one image may take from its signed VEX: the file for Trivy, or why there is none."""

    path: Path | None = None
    statements: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    problem: str | None = None  # no VEX counted (unsigned, not verified, malformed, absent)

    def record(self) -> dict[str, Any]:
        return {"file": str(self.path) if self.path else None, "statements": self.statements,
                "expired": self.expired, "problem": self.problem}


def signed_for_scan(verifier: Verifier, image: str, out: Path, today: dt.date) -> SignedVex:
    """The image's signed OpenVEX statements still valid `today`, written to OUT/vex.openvex.json for `--vex`.

    Anything short of a verified, well-formed document about this digest counts as no VEX: the scan
    then reports every finding, and the gate judges them by the policy alone."""
    ref = ImageRef.parse(image)
    if ref.digest is None:
        return SignedVex(problem="not addressed by digest")
    inspection = verifier.inspect(image)
    if inspection.problem is not None:
        return SignedVex(problem=f"not verified: {inspection.problem}")
    attestation = inspection.attestations.get(attest.PREDICATE_OPENVEX)
    if attestation is None:
        return SignedVex(problem="no signed openvex attestation")
    try:
        document = signed_vex(attestation)
    except InputError as exc:
        return SignedVex(problem=safe_text(str(exc), 300))
    applied = vex.for_trivy(document, digest=ref.digest, name=vex.product_name(ref.repository), today=today)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "vex.openvex.json"
    path.write_text(json.dumps(applied.document, indent=2) + "\n", encoding="utf-8")
    summary = vex.summary(applied)
    return SignedVex(path, summary["statements"], summary["expired"])
