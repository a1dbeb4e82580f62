"""The policy's exceptions as an OpenVEX document, and such a document read back. Pure: no I/O.

Each exception that is valid today, applies to the variant and names a vulnerability (not a
Dockerfile check) becomes one OpenVEX v0.2.0 statement about the image by digest:

- product: the image as a `pkg:oci/<name>@sha256%3A<hex>` purl (Trivy's own purl of an image has
  that name and version, plus qualifiers; OpenVEX matching treats absent qualifiers as "any");
- subcomponents: when the exception names packages, the purls of those packages as the image's
  SBOM lists them (by binary or Debian source name), without version or qualifiers; an exception
  naming packages the image does not hold makes no statement (an empty list would mean "all");
- status `not_affected` with `justification` (default vulnerable_code_not_in_execute_path), or
  `affected` with an action statement naming the owner: Trivy drops only not_affected findings,
  so an `affected` exception still needs the policy to let its finding through;
- impact statement: the reason; the owner and the last valid day in `imagebuild:owner` and
  `imagebuild:expires`.

OpenVEX has no expiry: the last valid day is carried in `imagebuild:expires` (other readers ignore
the key), and every reader here drops expired statements before use (`for_trivy`), so a signed
document stops counting statement by statement; a renewed exception needs a new attestation.

A document read back from a registry is untrusted: `parse_document` checks every field it uses.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote, unquote

from imagebuild.core.source import Document, PathKey, Reader, known_list

OPENVEX_CONTEXT = "https://openvex.dev/ns/v0.2.0"
NOT_AFFECTED = "not_affected"
AFFECTED = "affected"
STATUSES = (NOT_AFFECTED, AFFECTED)  # the policy's `status` words are OpenVEX's (gate.py reads them here)
JUSTIFICATIONS = ("component_not_present", "vulnerable_code_not_present", "vulnerable_code_not_in_execute_path",
                  "vulnerable_code_cannot_be_controlled_by_adversary", "inline_mitigations_already_exist")
DEFAULT_JUSTIFICATION = "vulnerable_code_not_in_execute_path"
EXPIRES_KEY = "imagebuild:expires"
OWNER_KEY = "imagebuild:owner"
AUTHOR = "imagebuild"
MAX_STATEMENTS = 1000  # what a document read back may hold (a policy has tens)
# A Dockerfile check (DS-0002, DS002, AVD-DS-0002) is no vulnerability: Trivy's VEX does not apply.
_CHECK_ID = re.compile(r"^(AVD-)?[A-Z]{2,4}-?\d{3,4}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_PURL = re.compile(r"^pkg:[a-z][a-z0-9.+-]*/[^\s?#]+$")
_PURL_BASE = re.compile(r"^(pkg:[a-z][a-z0-9.+-]*/[^@?#\s]+)")
_OCI_PURL = re.compile(r"^pkg:oci/([^@?#/\s]+)@sha256%3A([0-9a-f]{64})$")


class AcceptedRisk(Protocol):
    """What a statement is made of: gate.PolicyException (not imported: verify reads VEX documents and must
    not load the gate, tests/test_cli_startup.py; the gate imports this module)."""

    @property
    def id(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def expires(self) -> dt.date: ...
    @property
    def packages(self) -> tuple[str, ...]: ...
    @property
    def variants(self) -> tuple[str, ...]: ...
    @property
    def status(self) -> str: ...
    @property
    def justification(self) -> str: ...


def package_key(name: str) -> str:
    """Debian names are lower case; PyPI treats case, '-', '_' and '.' as the same (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name.lower())


@dataclass(frozen=True)
class Statement:
    vulnerability: str
    digest: str  # the image the statement is about
    subcomponents: tuple[str, ...]  # package purls; empty: the whole image
    status: str
    justification: str  # not_affected
    impact: str
    action: str  # affected
    owner: str
    expires: dt.date  # the last day it counts

    def expired(self, today: dt.date) -> bool:
        return today > self.expires


@dataclass(frozen=True)
class VexDocument:
    id: str
    author: str
    timestamp: str
    version: int
    statements: tuple[Statement, ...]


def oci_purl(name: str, digest: str) -> str:
    """The image as OpenVEX names a product: `name` is the repository's last path segment."""
    return f"pkg:oci/{quote(name, safe='')}@{quote(digest, safe='')}"


def is_vulnerability(exc: AcceptedRisk) -> bool:
    return not _CHECK_ID.match(exc.id.upper())


def sbom_purls(sbom: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Package key (gate.package_key of its name, and of its Debian source name) -> purls without version or
    qualifiers, from a CycloneDX SBOM as Trivy writes it."""
    found: dict[str, list[str]] = {}
    for component in sbom.get("components") or []:
        if not isinstance(component, Mapping) or not isinstance(component.get("purl"), str):
            continue
        found_base = _PURL_BASE.match(component["purl"])  # a purl's type/namespace/name, before @version?qualifiers
        if not found_base:
            continue
        base = found_base.group(1)
        names = [component.get("name")]
        names += [p.get("value") for p in component.get("properties") or []
                  if isinstance(p, Mapping) and p.get("name") == "aquasecurity:trivy:SrcName"]
        for name in names:
            if isinstance(name, str) and name:
                entry = found.setdefault(package_key(name), [])
                if base not in entry:
                    entry.append(base)
    return {key: tuple(purls) for key, purls in found.items()}


def build_document(exceptions: Iterable[AcceptedRisk], *, variant: str, digest: str, name: str, today: dt.date, now: dt.datetime,
                   purls: Mapping[str, tuple[str, ...]], tooling: str = "imagebuild vex attest") -> dict[str, Any]:
    """The OpenVEX document of the image `name@digest` of `variant`: one statement per exception (a policy's)
    valid `today` that applies to the variant and names a vulnerability. None applying: no statements (a
    document still, so that a trust file requiring openvex finds one on every image)."""
    if not _DIGEST.match(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    stamp = now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    product = oci_purl(name, digest)
    statements = []
    for exc in exceptions:
        if today > exc.expires or (exc.variants and variant not in exc.variants) or not is_vulnerability(exc):
            continue
        entry: dict[str, Any] = {"@id": product}
        if exc.packages:
            subcomponents = list(dict.fromkeys(p for pkg in exc.packages for p in purls.get(package_key(pkg), ())))
            if not subcomponents:
                continue  # none of its packages is in this image
            entry["subcomponents"] = [{"@id": p} for p in subcomponents]
        statement: dict[str, Any] = {"vulnerability": {"name": exc.id}, "products": [entry], "status": exc.status,
                                     "impact_statement": exc.reason, "timestamp": stamp}
        if exc.status == NOT_AFFECTED:
            statement["justification"] = exc.justification or DEFAULT_JUSTIFICATION
        else:
            statement["action_statement"] = f"accepted by {exc.owner} until {exc.expires.isoformat()}: {exc.reason}"
        statement[OWNER_KEY] = exc.owner
        statement[EXPIRES_KEY] = exc.expires.isoformat()
        statements.append(statement)
    content = hashlib.sha256(json.dumps(statements, sort_keys=True).encode()).hexdigest()[:16]
    return {"@context": OPENVEX_CONTEXT, "@id": f"https://imagebuild.dev/vex/{variant}/{digest}/{content}",
            "author": AUTHOR, "timestamp": stamp, "version": 1, "tooling": tooling,
            "statements": statements}


def image_document(exceptions: Iterable[AcceptedRisk], *, variant: str, repository: str, digest: str,
                   sbom: Mapping[str, Any], today: dt.date, now: dt.datetime,
                   tooling: str = "imagebuild vex attest") -> dict[str, Any]:
    """build_document for the image `repository@digest`, its packages' purls read from its CycloneDX SBOM."""
    return build_document(exceptions, variant=variant, digest=digest, name=product_name(repository), today=today,
                          now=now, purls=sbom_purls(sbom), tooling=tooling)


# --- a document read back (untrusted) ------------------------------------------------------------------


def parse_document(data: Any, where: str) -> VexDocument:
    """Check a VEX document field by field (one-line InputError naming the key); `where` names its source."""
    r = Reader(Document(where, data))
    top = r.mapping(data, (), required=("@context", "@id", "author", "timestamp", "version", "statements"))
    if top["@context"] != OPENVEX_CONTEXT:
        raise r.error(("@context",), f"not an OpenVEX v0.2.0 document (expected {OPENVEX_CONTEXT})")
    version = r.integer(top["version"], ("version",), minimum=1)
    items = r.sequence(top["statements"], ("statements",))
    if len(items) > MAX_STATEMENTS:
        raise r.error(("statements",), f"{len(items)} statements, over the {MAX_STATEMENTS} read")
    statements = tuple(_statement(r, item, ("statements", i)) for i, item in enumerate(items))
    return VexDocument(_text(r, top["@id"], ("@id",)), _text(r, top["author"], ("author",)),
                       _text(r, top["timestamp"], ("timestamp",)), version, statements)


def _text(r: Reader, value: Any, path: PathKey, limit: int = 2000) -> str:
    text = r.string(value, path)
    if len(text) > limit:
        raise r.error(path, f"longer than {limit} characters")
    return text


def _statement(r: Reader, item: Any, path: PathKey) -> Statement:
    spec = r.mapping(item, path, required=("vulnerability", "products", "status", EXPIRES_KEY))
    vuln = r.mapping(spec["vulnerability"], path + ("vulnerability",), required=("name",))
    name = _text(r, vuln["name"], path + ("vulnerability", "name"), 200)
    status = r.string(spec["status"], path + ("status",))
    if status not in STATUSES:
        raise r.error(path + ("status",), f"unsupported status '{status[:40]}' (one of {known_list(STATUSES)})")
    justification = ""
    if status == NOT_AFFECTED:
        justification = r.string(spec.get("justification"), path + ("justification",))
        if justification not in JUSTIFICATIONS:
            raise r.error(path + ("justification",), f"unknown justification (one of {known_list(JUSTIFICATIONS)})")
    products = r.sequence(spec["products"], path + ("products",), non_empty=True)
    if len(products) != 1:
        raise r.error(path + ("products",), "expected exactly one product (the image)")
    product = r.mapping(products[0], path + ("products", 0), required=("@id",))
    found = _OCI_PURL.match(_text(r, product["@id"], path + ("products", 0, "@id"), 400))
    if not found:
        raise r.error(path + ("products", 0, "@id"), "not an image by digest (pkg:oci/NAME@sha256%3AHEX)")
    subs: list[str] = []
    for i, sub in enumerate(r.sequence(product.get("subcomponents", []), path + ("products", 0, "subcomponents"))):
        at = path + ("products", 0, "subcomponents", i)
        purl = _text(r, r.mapping(sub, at, required=("@id",))["@id"], at + ("@id",), 400)
        if not _PURL.match(purl):
            raise r.error(at + ("@id",), "not a package URL without qualifiers (pkg:TYPE/NAME)")
        subs.append(purl)
    if "subcomponents" in product and not subs:
        raise r.error(path + ("products", 0, "subcomponents"), "empty: a statement about no package")
    expires_text = r.string(spec[EXPIRES_KEY], path + (EXPIRES_KEY,))
    try:
        expires = dt.date.fromisoformat(expires_text)
    except ValueError:
        raise r.error(path + (EXPIRES_KEY,), "expected a date like 2027-01-31") from None
    return Statement(
        vulnerability=name, digest="sha256:" + found.group(2), subcomponents=tuple(subs), status=status,
        justification=justification,
        impact=_text(r, spec.get("impact_statement") or "-", path + ("impact_statement",)),
        action=_text(r, spec.get("action_statement") or "-", path + ("action_statement",)),
        owner=_text(r, spec.get(OWNER_KEY) or "-", path + (OWNER_KEY,), 200), expires=expires)


# --- use ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    document: dict[str, Any]  # what Trivy is given (--vex)
    kept: tuple[Statement, ...]
    expired: tuple[Statement, ...]
    other_images: int  # statements about another digest (dropped)


def for_trivy(doc: VexDocument, *, digest: str, name: str, today: dt.date) -> Applied:
    """The statements of `doc` about `digest` still valid today, as an OpenVEX document for `trivy --vex`;
    the product is named as this scan names the image (the digest is what was signed)."""
    about = [s for s in doc.statements if s.digest == digest]
    kept = tuple(s for s in about if not s.expired(today))
    expired = tuple(s for s in about if s.expired(today))
    product = oci_purl(name, digest)
    statements = []
    for s in kept:
        entry: dict[str, Any] = {"@id": product}
        if s.subcomponents:
            entry["subcomponents"] = [{"@id": p} for p in s.subcomponents]
        out: dict[str, Any] = {"vulnerability": {"name": s.vulnerability}, "products": [entry], "status": s.status}
        if s.status == NOT_AFFECTED:
            out["justification"] = s.justification
        else:
            out["action_statement"] = s.action
        statements.append(out)
    document = {"@context": OPENVEX_CONTEXT, "@id": doc.id, "author": doc.author, "timestamp": doc.timestamp,
                "version": doc.version, "statements": statements}
    return Applied(document, kept, expired, len(doc.statements) - len(about))


def currency_problems(doc: VexDocument, digest: str, today: dt.date) -> list[str]:
    """Why a signed VEX document is not current for `digest`: a statement about another image, or one expired
    (its exception was renewed or dropped, and the image not attested again)."""
    problems = []
    others = [s for s in doc.statements if s.digest != digest]
    if others:
        problems.append(f"the openvex attestation has {len(others)} statement(s) about another image")
    expired = sorted({s.vulnerability for s in doc.statements if s.expired(today)})
    if expired:
        named = ", ".join(expired[:3]) + (f" and {len(expired) - 3} more" if len(expired) > 3 else "")
        problems.append(f"the openvex attestation has expired statements ({named}): attest the image's VEX again")
    return problems


def summary(applied: Applied) -> dict[str, Any]:
    return {"statements": [s.vulnerability for s in applied.kept],
            "expired": [f"{s.vulnerability} (expired {s.expires.isoformat()})" for s in applied.expired]}


def vulnerabilities(statements: Iterable[Statement]) -> list[str]:
    return sorted({s.vulnerability for s in statements})


def product_name(repository: str) -> str:
    """The name an image's purl has: the last segment of its repository."""
    return unquote(repository.rsplit("/", 1)[-1])
