"""The vulnerability gate: a policy evaluated over Trivy's reports. Pure: no I/O.

Everything here takes parsed data (the policy's Document from source.py, Trivy's JSON
reports as dicts, today's date) and returns dataclasses; reading files, printing and
recording belong to the CLI. So every rule is specified by fast unit tests over
hand-written reports in Trivy's JSON schema (SchemaVersion 2).

The rules, per image:
- a vulnerability at or above `severity` blocks, unless a valid exception names it;
  with `ignore_unfixed`, one without a fixed version is ignored instead;
- a misconfiguration of its Dockerfiles at or above `misconfiguration_severity` blocks,
  unless a valid exception names its check id;
- a secret always blocks: it cannot be excepted, only removed (and rotated);
- an exception in scope that has expired blocks, whether or not it still matches;
- an exception that matches no finding any more is stale: a warning, a failure with strict;
- an image the scan stage did not finish for blocks.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from imagebuild.checks import vex
from imagebuild.checks.vex import package_key
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import GateStage, StageStatus
from imagebuild.core.source import Document, PathKey, Reader, known_list, suggest

POLICY_SCHEMA = 1
GATE_SCHEMA = "imagebuild.gate/v1"
SEVERITIES = ("UNKNOWN", "LOW", "MEDIUM", "HIGH", "CRITICAL")  # Trivy's order, lowest first
_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")  # CVE-…, GHSA-…, DS-0002, AVD-DS-0002, …

BLOCKED = "blocked"
EXCEPTED = "excepted"
IGNORED_UNFIXED = "ignored-unfixed"
BELOW_THRESHOLD = "below-threshold"


def severity_rank(severity: str) -> int:
    """Unknown words rank as UNKNOWN: below every threshold but UNKNOWN itself."""
    return _RANK.get(severity.upper(), 0)


# --- the policy ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyException:
    """An accepted risk: who accepted it, why, and until when (the last valid day)."""

    id: str
    owner: str
    reason: str
    expires: dt.date
    packages: tuple[str, ...] = ()  # empty: any package
    variants: tuple[str, ...] = ()  # empty: every variant
    line: int | None = None  # where it is written, for messages
    # As an OpenVEX statement (checks/vex.py): not_affected (with an OpenVEX justification) or affected.
    status: str = "not_affected"
    justification: str = ""  # empty: vex.DEFAULT_JUSTIFICATION

    def expired(self, today: dt.date) -> bool:
        return today > self.expires

    def where(self, policy_file: str) -> str:
        return f"{policy_file}:{self.line}" if self.line else policy_file

    def describe(self) -> str:
        scope = []
        if self.packages:
            scope.append("packages " + ", ".join(self.packages))
        if self.variants:
            scope.append("variants " + ", ".join(self.variants))
        return self.id + (f" ({'; '.join(scope)})" if scope else "")


@dataclass(frozen=True)
class Policy:
    file: str
    severity: str = "HIGH"
    ignore_unfixed: bool = False
    misconfiguration_severity: str = "HIGH"
    exceptions: tuple[PolicyException, ...] = ()


_POLICY_KEYS = ("schema", "severity", "ignore_unfixed", "misconfiguration_severity", "exceptions")
_EXCEPTION_KEYS = ("id", "packages", "variants", "owner", "reason", "expires", "status", "justification")



def parse_policy(doc: Document) -> Policy:
    """Validate a policy document; any problem is an InputError naming file, line and key."""
    r = Reader(doc)
    data = r.mapping(doc.data, (), allowed=_POLICY_KEYS, required=("schema",))
    schema = r.integer(data["schema"], ("schema",))
    if schema != POLICY_SCHEMA:
        raise r.error(("schema",), f"unsupported schema {schema} (this imagebuild reads schema {POLICY_SCHEMA})")
    severity = _severity(r, data.get("severity", "HIGH"), ("severity",))
    misconfig = _severity(r, data.get("misconfiguration_severity", "HIGH"), ("misconfiguration_severity",))
    ignore_unfixed = r.boolean(data["ignore_unfixed"], ("ignore_unfixed",)) if "ignore_unfixed" in data else False
    exceptions: list[PolicyException] = []
    seen: dict[tuple[str, frozenset[str], frozenset[str]], int | None] = {}
    for index, item in enumerate(r.sequence(data.get("exceptions", []) or [], ("exceptions",))):
        exc = _exception(r, item, ("exceptions", index))
        identity = (exc.id.upper(), frozenset(map(package_key, exc.packages)), frozenset(exc.variants))
        if identity in seen:
            raise r.error(("exceptions", index, "id"),
                          f"duplicate exception for {exc.id} with the same scope (first at line {seen[identity]})")
        seen[identity] = exc.line
        exceptions.append(exc)
    return Policy(file=doc.file, severity=severity, ignore_unfixed=ignore_unfixed,
                  misconfiguration_severity=misconfig, exceptions=tuple(exceptions))


def _severity(r: Reader, value: Any, path: PathKey) -> str:
    text = r.string(value, path).upper()
    if text not in SEVERITIES:
        raise r.error(path, f"unknown severity '{value}'{suggest(text, SEVERITIES)} "
                            f"(one of {known_list(SEVERITIES)})")
    return text


def _exception(r: Reader, item: Any, path: PathKey) -> PolicyException:
    spec = r.mapping(item, path, allowed=_EXCEPTION_KEYS, required=("id", "owner", "reason", "expires"))
    vuln_id = r.string(spec["id"], path + ("id",)).strip()
    if not _ID.match(vuln_id):
        raise r.error(path + ("id",), f"'{vuln_id}' is not a vulnerability or check id (e.g. CVE-2024-28757, DS-0002)")
    owner = r.string(spec["owner"], path + ("owner",)).strip()
    reason = r.string(spec["reason"], path + ("reason",)).strip()
    if len(reason) < 10:
        raise r.error(path + ("reason",), "say why the risk is accepted, in a sentence (at least 10 characters)")
    packages = _names(r, spec, "packages", path)
    variants = _names(r, spec, "variants", path)
    # What its OpenVEX statement says (checks/vex.py): OpenVEX's words.
    status = _word(r, spec, "status", vex.STATUSES, path) or vex.NOT_AFFECTED
    justification = _word(r, spec, "justification", vex.JUSTIFICATIONS, path)
    if justification and status != "not_affected":
        raise r.error(path + ("justification",), "a justification says why a product is not_affected; "
                                                 "an affected exception has none")
    return PolicyException(id=vuln_id, owner=owner, reason=reason, expires=_date(r, spec["expires"], path + ("expires",)),
                           packages=packages, variants=variants, line=r.doc.line(path), status=status,
                           justification=justification)


def _word(r: Reader, spec: dict[str, Any], key: str, known: tuple[str, ...], path: PathKey) -> str:
    if key not in spec:
        return ""
    word = r.string(spec[key], path + (key,)).strip()
    if word not in known:
        raise r.error(path + (key,), f"unknown {key} '{word}'{suggest(word, known)} (one of {known_list(known)})")
    return word


def _names(r: Reader, spec: dict[str, Any], key: str, path: PathKey) -> tuple[str, ...]:
    if key not in spec:
        return ()
    names = r.strings(spec[key], path + (key,))
    if not names:
        raise r.error(path + (key,), f"must not be empty (leave '{key}' out to match every one)")
    return tuple(name.strip() for name in names)


def _date(r: Reader, value: Any, path: PathKey) -> dt.date:
    # YAML reads 2027-01-31 as a date and '2027-01-31' as a string; both mean the same day.
    if isinstance(value, dt.datetime):
        raise r.error(path, "expected a date like 2027-01-31, not a date and time")
    if isinstance(value, dt.date):
        return value
    if isinstance(value, str):
        try:
            return dt.date.fromisoformat(value.strip())
        except ValueError:
            pass
    raise r.error(path, f"expected a date like 2027-01-31, got {value!r}")


# --- Trivy's reports --------------------------------------------------------------------------


class ReportError(ImagebuildError, ValueError):
    """A Trivy report that is not one (wrong schema, missing fields)."""


@dataclass(frozen=True)
class Finding:
    kind: str  # vulnerability, secret, misconfiguration
    id: str  # CVE id, secret rule id, check id
    severity: str
    title: str = ""
    target: str = ""  # Trivy's Target: the OS, "Python", a file in the image, a Dockerfile
    package: str = ""  # vulnerability: the package as installed (Debian: binary package)
    source_package: str = ""  # vulnerability: Debian's source package
    installed: str = ""
    fixed: str = ""  # the first fixed version(s); empty when there is no fix
    status: str = ""  # Trivy's status: fixed, affected, will_not_fix, …
    url: str = ""
    aliases: tuple[str, ...] = ()  # misconfiguration: other ids of the same check (AVD-…)
    line: int | None = None  # secret, misconfiguration: where in the file

    @property
    def fixable(self) -> bool:
        return bool(self.fixed)

    def subject(self) -> str:
        if self.kind == "vulnerability":
            return f"{self.package} {self.installed}"
        return f"{self.target}:{self.line}" if self.line else self.target


def findings(report: Mapping[str, Any], *, targets: Iterable[str] | None = None) -> list[Finding]:
    """Every vulnerability, secret and failed check in a Trivy JSON report (SchemaVersion 2).

    `targets`, when given, keeps only the results for those targets (the Dockerfiles of one
    variant, out of a `trivy config` report over all of them).
    """
    if not isinstance(report, Mapping) or report.get("SchemaVersion") != 2:
        version = report.get("SchemaVersion") if isinstance(report, Mapping) else None
        raise ReportError(f"not a Trivy JSON report with SchemaVersion 2 (got {version!r})")
    wanted = set(targets) if targets is not None else None
    found: list[Finding] = []
    for result in report.get("Results") or []:
        target = str(result.get("Target", ""))
        if wanted is not None and target not in wanted:
            continue
        # A vulnerability names its binary package; the source package (which Debian's
        # advisories are about, e.g. expat for libexpat1) is on the package list.
        sources = {p.get("ID"): p.get("SrcName", "") for p in result.get("Packages") or [] if p.get("ID")}
        for v in result.get("Vulnerabilities") or []:
            found.append(Finding(
                kind="vulnerability", id=_required(v, "VulnerabilityID"), severity=_sev(v), title=v.get("Title", ""),
                target=target, package=_required(v, "PkgName"), source_package=sources.get(v.get("PkgID"), ""),
                installed=v.get("InstalledVersion", ""), fixed=v.get("FixedVersion", "") or "",
                status=v.get("Status", ""), url=v.get("PrimaryURL", "")))
        for s in result.get("Secrets") or []:
            found.append(Finding(kind="secret", id=_required(s, "RuleID"), severity=_sev(s), title=s.get("Title", ""),
                                 target=target, line=s.get("StartLine")))
        for m in result.get("Misconfigurations") or []:
            if m.get("Status", "FAIL") != "FAIL":
                continue  # --include-non-failures lists passed checks too
            aliases = _check_aliases(m)
            cause = m.get("CauseMetadata") or {}
            found.append(Finding(kind="misconfiguration", id=_required(m, "ID"), severity=_sev(m),
                                 title=m.get("Title", ""), target=target, url=m.get("PrimaryURL", ""),
                                 aliases=aliases, line=cause.get("StartLine")))
    return found


def _check_aliases(m: Mapping[str, Any]) -> tuple[str, ...]:
    """Other names of a check, so a policy written against another Trivy release still matches.

    Trivy 0.76 says DS-0002; older releases said DS002 (still the tail of `Namespace`) and
    AVD-DS-0002.
    """
    names = [m.get("AVDID"), m.get("LongID"), f"AVD-{m['ID']}" if m.get("ID") else None]
    namespace = str(m.get("Namespace", ""))
    if namespace.startswith("builtin."):
        names.append(namespace.rsplit(".", 1)[-1])
    return tuple(dict.fromkeys(n for n in names if n))


def _required(entry: Mapping[str, Any], key: str) -> str:
    value = entry.get(key)
    if not value:
        raise ReportError(f"a finding without {key}: {dict(entry)!r:.200}")
    return str(value)


def _sev(entry: Mapping[str, Any]) -> str:
    severity = str(entry.get("Severity", "UNKNOWN")).upper()
    return severity if severity in _RANK else "UNKNOWN"


# --- evaluation -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageScan:
    """What the scan stage found for one variant's image (or why it has nothing)."""

    variant: str
    image: str
    digest: str
    findings: tuple[Finding, ...] = ()
    scanned: bool = True
    problem: str = ""  # why it was not scanned
    platform: str | None = None  # a child of a multi-platform variant's index: each child is judged on its own


@dataclass(frozen=True)
class Decision:
    finding: Finding
    verdict: str  # blocked, excepted, ignored-unfixed, below-threshold
    why: str
    exception: PolicyException | None = None


@dataclass(frozen=True)
class ImageVerdict:
    variant: str
    image: str
    digest: str
    decisions: tuple[Decision, ...]
    problems: tuple[str, ...]  # blocking reasons that are not findings: not scanned, expired exceptions, …
    warnings: tuple[str, ...] = ()
    platform: str | None = None  # the child of the variant's index judged (None: its only image)

    @property
    def name(self) -> str:
        """The variant, and the platform of a child: how output names the image judged."""
        return f"{self.variant} ({self.platform})" if self.platform else self.variant

    @property
    def passed(self) -> bool:
        return not self.problems and not self.blocking

    @property
    def blocking(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.verdict == BLOCKED)

    @property
    def excepted(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.verdict == EXCEPTED)

    def counts(self) -> dict[str, int]:
        out = {verdict: 0 for verdict in (BLOCKED, EXCEPTED, IGNORED_UNFIXED, BELOW_THRESHOLD)}
        for d in self.decisions:
            out[d.verdict] += 1
        return out


@dataclass(frozen=True)
class ExceptionState:
    exception: PolicyException
    state: str  # active, expired, stale, out-of-scope
    matched: tuple[str, ...] = ()  # variants where it matched a finding


@dataclass(frozen=True)
class GateResult:
    policy: Policy
    today: dt.date
    strict: bool
    images: tuple[ImageVerdict, ...]
    exceptions: tuple[ExceptionState, ...] = field(default=())

    @property
    def passed(self) -> bool:
        # No image at all is not a pass: a gate must have seen what it lets through.
        return bool(self.images) and all(image.passed for image in self.images)

    def warnings(self) -> list[str]:
        return [w for image in self.images for w in image.warnings]


def matches(exc: PolicyException, finding: Finding, variant: str) -> bool:
    """Does `exc` name this finding in this variant? Secrets are never matched."""
    if finding.kind == "secret":
        return False
    if exc.variants and variant not in exc.variants:
        return False
    if exc.id.upper() not in {finding.id.upper(), *(a.upper() for a in finding.aliases)}:
        return False
    if exc.packages:
        if finding.kind != "vulnerability":
            return False  # a package list narrows to packages; a Dockerfile check has none
        wanted = {package_key(p) for p in exc.packages}
        return package_key(finding.package) in wanted or (
            bool(finding.source_package) and package_key(finding.source_package) in wanted)
    return True


def _decide(policy: Policy, today: dt.date, finding: Finding, variant: str) -> Decision:
    if finding.kind == "secret":
        return Decision(finding, BLOCKED, f"secret ({finding.title or finding.id}) in {finding.subject()}: "
                                          "secrets cannot be excepted; remove it from the image and rotate it")
    threshold = policy.severity if finding.kind == "vulnerability" else policy.misconfiguration_severity
    if severity_rank(finding.severity) < severity_rank(threshold):
        return Decision(finding, BELOW_THRESHOLD, f"{finding.severity} is below the threshold {threshold}")
    if finding.kind == "vulnerability" and policy.ignore_unfixed and not finding.fixable:
        return Decision(finding, IGNORED_UNFIXED, f"no fixed version ({finding.status or 'unfixed'}); "
                                                  "ignore_unfixed is on")
    candidates = [exc for exc in policy.exceptions if matches(exc, finding, variant)]
    valid = sorted((exc for exc in candidates if not exc.expired(today)), key=lambda e: e.expires, reverse=True)
    if valid:
        exc = valid[0]
        return Decision(finding, EXCEPTED, f"excepted until {exc.expires.isoformat()} by {exc.owner} "
                                           f"({exc.where(policy.file)}): {exc.reason}", exc)
    if candidates:
        exc = max(candidates, key=lambda e: e.expires)
        return Decision(finding, BLOCKED, f"its exception expired on {exc.expires.isoformat()} "
                                          f"({exc.owner}, {exc.where(policy.file)})", exc)
    return Decision(finding, BLOCKED, f"{finding.severity} is at or above {threshold}; no exception")


def evaluate(policy: Policy, scans: Iterable[ImageScan], today: dt.date, strict: bool = False) -> GateResult:
    scans = list(scans)
    scanned_variants = {s.variant for s in scans if s.scanned}
    # Exceptions name variants, so every child of a variant's index is judged by the same ones.
    decisions = [tuple(_decide(policy, today, f, s.variant) for f in s.findings) for s in scans]

    states: list[ExceptionState] = []
    for exc in policy.exceptions:
        in_scope = [v for v in scanned_variants if not exc.variants or v in exc.variants]
        matched = tuple(sorted(s.variant for s in scans if s.scanned
                               and any(matches(exc, f, s.variant) for f in s.findings)))
        if exc.expired(today):
            state = "expired"
        elif exc.variants and not in_scope:
            state = "out-of-scope"  # names only variants this report does not hold
        elif not matched:
            state = "stale"
        else:
            state = "active"
        states.append(ExceptionState(exc, state, matched))

    verdicts = []
    for scan, decided in zip(scans, decisions):
        problems: list[str] = []
        warnings: list[str] = []
        if not scan.scanned:
            problems.append(f"not scanned: {scan.problem or 'no scan result'}")
        for st in states:
            exc = st.exception
            if exc.variants and scan.variant not in exc.variants:
                continue
            where = exc.where(policy.file)
            if st.state == "expired":
                problems.append(f"exception for {exc.describe()} ({where}, {exc.owner}) expired on "
                                f"{exc.expires.isoformat()}: renew it with a new date and reason, or remove it")
            elif st.state == "stale":
                text = (f"stale exception for {exc.describe()} ({where}, {exc.owner}): it matches no finding "
                        "any more; remove it")
                (problems if strict else warnings).append(text)
        verdicts.append(ImageVerdict(scan.variant, scan.image, scan.digest, decided, tuple(problems), tuple(warnings),
                                     scan.platform))
    return GateResult(policy, today, strict, tuple(verdicts), tuple(states))


# --- records and output ---------------------------------------------------------------------------


def _finding_record(d: Decision) -> dict[str, Any]:
    f = d.finding
    record: dict[str, Any] = {"kind": f.kind, "id": f.id, "severity": f.severity, "title": f.title,
                              "target": f.target, "why": d.why}
    if f.kind == "vulnerability":
        record |= {"package": f.package, "source_package": f.source_package, "installed": f.installed,
                   "fixed": f.fixed, "status": f.status, "url": f.url}
    else:
        record["line"] = f.line
    if d.exception is not None:
        e = d.exception
        record["exception"] = {"id": e.id, "owner": e.owner, "reason": e.reason,
                               "expires": e.expires.isoformat(), "line": e.line}
    return record


def stage_record(verdict: ImageVerdict, result: GateResult) -> GateStage:
    """The gate stage's record of one image (`variants[i].stages["gate"]`): enough for sign/push and for people.

    Sign and push ask it `refusal(digest)` (through VariantRecord.refusal): passed, on that very image.
    """
    return GateStage(
        status=StageStatus.PASSED if verdict.passed else StageStatus.FAILED,
        digest=verdict.digest,
        image=verdict.image,
        policy=result.policy.file,
        evaluated_on=result.today.isoformat(),
        strict=result.strict,
        severity=result.policy.severity,
        ignore_unfixed=result.policy.ignore_unfixed,
        counts=verdict.counts(),
        blocking=[_finding_record(d) for d in verdict.blocking],
        excepted=[_finding_record(d) for d in verdict.excepted],
        problems=list(verdict.problems),
        warnings=list(verdict.warnings),
    )


def to_json(result: GateResult) -> dict[str, Any]:
    return {
        "schema": GATE_SCHEMA,
        "passed": result.passed,
        "policy": result.policy.file,
        "today": result.today.isoformat(),
        "strict": result.strict,
        "images": [{"variant": v.variant, **({"platform": v.platform} if v.platform else {}),
                    **stage_record(v, result).to_dict()} for v in result.images],
        "exceptions": [{"id": s.exception.id, "packages": list(s.exception.packages),
                        "variants": list(s.exception.variants), "owner": s.exception.owner,
                        "expires": s.exception.expires.isoformat(), "line": s.exception.line,
                        "state": s.state, "matched": list(s.matched)} for s in result.exceptions],
        "warnings": result.warnings(),
    }


# SARIF: GitHub code scanning ranks alerts by this number when a rule has no CVSS of its own.
_SECURITY_SEVERITY = {"CRITICAL": "9.5", "HIGH": "8.0", "MEDIUM": "5.5", "LOW": "2.0", "UNKNOWN": "0.0"}
SARIF_SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"


def to_sarif(result: GateResult, *, tool_version: str, locations: Mapping[str, str] | None = None,
             dockerfiles_root: str = "") -> dict[str, Any]:
    """A SARIF 2.1.0 log: blocking findings are errors, excepted ones carry an accepted suppression.

    `locations` maps a variant to the repository file that makes its image (its release
    Dockerfile); image findings are reported there, since code scanning needs a file in the
    repository. Dockerfile checks point at their own file and line under `dockerfiles_root`.
    Expired and stale exceptions point at their line in the policy file.
    """
    locations = dict(locations or {})
    rules: list[dict[str, Any]] = []
    rule_index: dict[str, int] = {}

    def rule(rule_id: str, name: str, text: str, severity: str, url: str, tags: list[str]) -> int:
        if rule_id not in rule_index:
            entry: dict[str, Any] = {
                "id": rule_id, "name": name,
                "shortDescription": {"text": text or rule_id},
                "fullDescription": {"text": text or rule_id},
                "defaultConfiguration": {"level": "error"},
                "properties": {"tags": ["security", *tags], "security-severity": _SECURITY_SEVERITY.get(severity, "0.0")},
            }
            if url:
                entry["helpUri"] = url
                entry["help"] = {"text": f"{rule_id}: {text}\n{url}", "markdown": f"**{rule_id}**: {text}\n\n<{url}>"}
            rule_index[rule_id] = len(rules)
            rules.append(entry)
        return rule_index[rule_id]

    def location(uri: str, line: int | None, image: str = "") -> dict[str, Any]:
        loc: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": uri or "unknown"},
                                                    "region": {"startLine": max(1, int(line or 1))}}}
        if image:
            loc["logicalLocations"] = [{"fullyQualifiedName": image, "kind": "module"}]
        return loc

    results: list[dict[str, Any]] = []
    for image in result.images:
        for d in image.decisions:
            if d.verdict not in (BLOCKED, EXCEPTED):
                continue
            f = d.finding
            index = rule(f.id, f.kind, f.title, f.severity, f.url, [f.kind, f.severity])
            if f.kind == "misconfiguration":
                where = location(f"{dockerfiles_root.rstrip('/')}/{f.target}" if dockerfiles_root else f.target,
                                 f.line, image.image)
            else:
                where = location(locations.get(image.variant, ""), 1, image.image)
            if f.kind == "vulnerability":
                text = (f"{f.id} ({f.severity}) in {f.package} {f.installed} of {image.name}"
                        + (f", fixed in {f.fixed}" if f.fixed else ", no fixed version") + f": {d.why}")
            else:
                text = f"{f.id} ({f.severity}) in {f.subject()} of {image.name}: {d.why}"
            entry: dict[str, Any] = {
                "ruleId": f.id, "ruleIndex": index, "level": "error",
                "message": {"text": text}, "locations": [where],
                "partialFingerprints": {"imagebuild/v1": _fingerprint(image.name, f)},
                "properties": {"variant": image.variant, "image": image.image, "verdict": d.verdict,
                               "kind": f.kind, "severity": f.severity},
            }
            if d.verdict == EXCEPTED and d.exception is not None:
                entry["suppressions"] = [{"kind": "external", "status": "accepted",
                                          "justification": f"{d.exception.reason} (owner {d.exception.owner}, "
                                                           f"until {d.exception.expires.isoformat()})"}]
            results.append(entry)
    for st in result.exceptions:
        if st.state not in ("expired", "stale"):
            continue
        exc = st.exception
        rule_id = f"imagebuild/{st.state}-exception"
        index = rule(rule_id, f"{st.state}-exception",
                     "An exception in the vulnerability policy has expired" if st.state == "expired"
                     else "An exception in the vulnerability policy matches no finding any more",
                     "HIGH" if st.state == "expired" else "LOW", "", ["policy"])
        level = "error" if st.state == "expired" or result.strict else "warning"
        results.append({
            "ruleId": rule_id, "ruleIndex": index, "level": level,
            "message": {"text": f"{st.state} exception for {exc.describe()} (owner {exc.owner}, "
                                f"expires {exc.expires.isoformat()})"},
            "locations": [location(result.policy.file, exc.line)],
        })
    return {
        "$schema": SARIF_SCHEMA_URI,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "imagebuild-gate", "version": tool_version,
                                "informationUri": "https://example.com/imagebuild", "rules": rules}},
            "invocations": [{"executionSuccessful": True,
                             "properties": {"passed": result.passed, "policy": result.policy.file,
                                            "today": result.today.isoformat(), "strict": result.strict}}],
            "results": results,
        }],
    }


def _fingerprint(variant: str, f: Finding) -> str:
    key = "\0".join([variant, f.kind, f.id, f.package, f.target, str(f.line or "")])
    return hashlib.sha256(key.encode()).hexdigest()[:32]
