"""Harbor's REST API (v2.0): the release project, its immutable tag rules, a CI robot, scan results.

`ensure()` brings one project to the state a release needs and says what it changed; running
it again changes nothing. `imagebuild harbor ensure` calls it, and so does push. The request
builders and the readers of Harbor's answers are pure functions (unit-tested); `HarborClient`
does the I/O, with retries on 429/5xx and on failed connections (oci.retry's engine, HARBOR_RETRIES).

Secrets: the admin password only ever goes into the Authorization header, and a robot's secret
only into `RobotResult.secret` (hidden from repr); neither is put into a message or a report.
"""
from __future__ import annotations

import ipaddress
import math
import re
import ssl
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.oci import names, reference
from imagebuild.oci.retry import RETRY_STATUSES, RetryingTransport, RetryLog, RetryPolicy

API = "/api/v2.0"
SEVERITIES = ("none", "low", "medium", "high", "critical")
# Harbor's rule for project and robot names (lower case; separators only between alphanumerics).
NAME_RULE = names.PROJECT  # Harbor's rule for project (and repository component) names
# Harbor's default robot name prefix; an instance can configure another, so names are matched
# on the part after it.
ROBOT_PREFIX = "robot$"
# What the CI robot may do in its project: push and pull images (cosign's signatures and
# attestations are pushed as tags too) and read artifacts with their scan results.
ROBOT_ACCESS: tuple[tuple[str, str], ...] = (("repository", "pull"), ("repository", "push"), ("artifact", "read"))
# imagebuild's release tags all start with the Paddle version (3.0.0-gpu-cuda12.6-..., 2.6.2-py3.10).
DEFAULT_IMMUTABLE_TAGS = ("[0-9]*",)
VULN_REPORT_MIMES = ("application/vnd.security.vulnerability.report; version=1.1",
                     "application/vnd.scanner.adapter.vuln.report.harbor+json; version=1.0")
_SAFE_TEXT = re.compile(r"[^\x20-\x7e]")


class HarborError(ImagebuildError):
    """Harbor refused or failed a request; the message is one line, Harbor's own words included."""

    def __init__(self, message: str, status: int | None = None, request_id: str | None = None):
        super().__init__(message)
        self.status = status
        self.request_id = request_id


class HarborUnavailable(HarborError):
    """Harbor could not be reached, or kept failing (5xx, 429) after every retry."""

    exit_code = ExitCode.ENVIRONMENT


class HarborAuthError(HarborError):
    """Harbor refused the credentials (401) or the user lacks the right (403)."""

    exit_code = ExitCode.ENVIRONMENT


# -- what ensure is asked for, and what it reports --------------------------------------


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class ProjectSettings:
    """The project metadata a release project gets (Harbor keeps them as "true"/"false" strings)."""

    public: bool = False
    auto_scan: bool = True  # Harbor scans every pushed image
    prevent_vul: bool = True  # Harbor refuses pulls of images with findings at or above `severity`
    severity: str = "high"
    content_trust_cosign: bool = True  # Harbor refuses pulls of images without a cosign signature
    reuse_sys_cve_allowlist: bool = True

    def metadata(self) -> dict[str, str]:
        def flag(value: bool) -> str:
            return "true" if value else "false"

        return {"public": flag(self.public), "auto_scan": flag(self.auto_scan), "prevent_vul": flag(self.prevent_vul),
                "severity": self.severity, "enable_content_trust_cosign": flag(self.content_trust_cosign),
                "reuse_sys_cve_allowlist": flag(self.reuse_sys_cve_allowlist)}


@dataclass(frozen=True)
class RobotSpec:
    name: str  # without Harbor's prefix and project: "ci" becomes robot$PROJECT+ci
    duration_days: int = 90  # -1: never expires
    description: str = "imagebuild CI: push releases, read scan results"


@dataclass(frozen=True)
class HarborSetup:
    project: str
    settings: ProjectSettings = ProjectSettings()
    immutable_tags: tuple[str, ...] = DEFAULT_IMMUTABLE_TAGS
    robot: RobotSpec | None = None
    rotate_secret: bool = False


@dataclass(frozen=True)
class Project:
    id: int
    name: str
    metadata: Mapping[str, str]


@dataclass(frozen=True)
class ProjectResult:
    name: str
    id: int
    action: str  # created | updated | unchanged
    changes: Mapping[str, tuple[str | None, str]]  # metadata key -> (before, after)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.id, "action": self.action,
                "changes": {k: {"before": b, "after": a} for k, (b, a) in self.changes.items()}}


@dataclass(frozen=True)
class ImmutableRule:
    id: int
    tag_pattern: str
    tag_decoration: str  # matches | excludes
    repository_pattern: str
    repository_decoration: str  # repoMatches | repoExcludes
    disabled: bool


@dataclass(frozen=True)
class RuleResult:
    pattern: str
    id: int | None
    action: str  # created | enabled | unchanged

    def to_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "id": self.id, "action": self.action}


@dataclass(frozen=True)
class Robot:
    id: int
    name: str  # Harbor's full name, robot$PROJECT+NAME
    level: str
    disabled: bool
    expires_at: int  # seconds since the epoch; -1: never
    access: frozenset[tuple[str, str]]  # (resource, action) in its project


@dataclass(frozen=True)
class RobotResult:
    name: str
    id: int
    action: str  # created | updated | unchanged | rotated (| updated+rotated)
    expires_at: int
    secret: str | None = field(default=None, repr=False)  # only when created or rotated; shown once

    def to_dict(self) -> dict[str, Any]:
        """What may be printed or recorded: everything but the secret."""
        return {"name": self.name, "id": self.id, "action": self.action, "expires_at": self.expires_at,
                "secret_issued": self.secret is not None}


@dataclass(frozen=True)
class EnsureReport:
    url: str
    harbor_version: str
    project: ProjectResult
    rules: tuple[RuleResult, ...]
    robot: RobotResult | None

    @property
    def changed(self) -> bool:
        return (self.project.action != "unchanged" or any(r.action != "unchanged" for r in self.rules)
                or (self.robot is not None and self.robot.action != "unchanged"))

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "harbor_version": self.harbor_version, "changed": self.changed,
                "project": self.project.to_dict(),
                "immutable_rules": [r.to_dict() for r in self.rules],
                "robot": self.robot.to_dict() if self.robot else None}


@dataclass(frozen=True)
class ArtifactRef:
    project: str
    repository: str  # inside the project; may hold slashes
    digest: str

    def __str__(self) -> str:
        return f"{self.project}/{self.repository}@{self.digest}"


@dataclass(frozen=True)
class ScanOverview:
    artifact: ArtifactRef
    found: bool
    status: str  # Harbor's scan_status (Success, Running, Error ...), or "not scanned" / "not found"
    severity: str | None = None
    counts: Mapping[str, int] = field(default_factory=dict)  # Critical/High/Medium/Low/Unknown -> n
    total: int = 0
    fixable: int = 0
    scanner: str | None = None  # "Trivy v0.50.1"
    end_time: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"artifact": str(self.artifact), "found": self.found, "status": self.status,
                "severity": self.severity, "counts": dict(self.counts), "total": self.total,
                "fixable": self.fixable, "scanner": self.scanner, "end_time": self.end_time}


# -- pure: checking input and building requests -----------------------------------------


def check_base_url(url: str) -> str:
    """Harbor's address as given (scheme://host[:port]), without a trailing slash; ValueError if not one.

    Plain http is accepted for loopback hosts only: the admin password travels in every request.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL such as https://harbor.example.com")
    if parts.username or parts.password:
        raise ValueError("the URL must not hold credentials (use HARBOR_USERNAME and HARBOR_PASSWORD)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: give Harbor's address only, without a path (the API is under {API})")
    try:
        parts.port  # noqa: B018 -- raises on a port out of range
    except ValueError as err:
        raise ValueError(f"{url!r}: {err}") from None
    if parts.scheme == "http" and not _is_loopback(parts.hostname):
        raise ValueError(f"{url!r}: plain http sends the password in clear; use https (http only for loopback)")
    return f"{parts.scheme}://{parts.netloc}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_name(kind: str, name: str) -> None:
    if not NAME_RULE.fullmatch(name) or len(name) > 255:
        raise ValueError(f"{name!r} is not a valid Harbor {kind} name (lower-case letters and digits, "
                         f"separated by single . _ or -)")


def project_request(name: str, settings: ProjectSettings) -> dict[str, Any]:
    """The body of POST /projects (ProjectReq)."""
    return {"project_name": name, "metadata": settings.metadata()}


def metadata_drift(current: Mapping[str, str], wanted: Mapping[str, str]) -> dict[str, tuple[str | None, str]]:
    """The metadata keys whose value differs from what is wanted: key -> (current, wanted)."""
    return {key: (current.get(key), value) for key, value in wanted.items() if current.get(key) != value}


def doublestar_regex(pattern: str) -> re.Pattern[str]:
    """A Harbor tag pattern (doublestar syntax: * ** ? [class] {a,b}) as a regular expression."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = pattern.find("]", i + 2)
            if end < 0:
                raise ValueError(f"unclosed [ in {pattern!r}")
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body[0] in "!^" else body).replace("\\", "\\\\") + "]")
            i = end + 1
        elif c == "{":
            end = pattern.find("}", i)
            if end < 0:
                raise ValueError(f"unclosed {{ in {pattern!r}")
            out.append("(?:" + "|".join(doublestar_regex(p).pattern[1:-1] for p in pattern[i + 1:end].split(",")) + ")")
            i = end + 1
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("^" + "".join(out) + "$")


# Tags cosign and the OCI 1.1 referrers fallback write beside an image: sha256-<hex>.sig/.att/.sbom
# and sha256-<hex>. A release rule must never make them immutable, or a re-signing (key rotation,
# a fresh attestation) is refused. Several digests, so that a class like [0-9a-f] is caught too.
_SAMPLE_HEXES = ("0" * 64, "9" * 64, "a" * 64, "f" * 64, "0123456789abcdef" * 4, "fedcba9876543210" * 4)
COSIGN_TAG_SAMPLES = tuple(f"sha256-{h}{suffix}" for h in _SAMPLE_HEXES for suffix in (".sig", ".att", ".sbom", ""))


def check_release_pattern(pattern: str) -> None:
    """ValueError unless PATTERN is a doublestar tag pattern that leaves cosign's tags writable."""
    if not pattern or len(pattern) > 128 or any(c.isspace() for c in pattern) or "/" in pattern:
        raise ValueError(f"{pattern!r} is not a tag pattern (no spaces or slashes, at most 128 characters)")
    try:
        regex = doublestar_regex(pattern)
    except (ValueError, re.error) as err:
        raise ValueError(f"{pattern!r} is not a doublestar pattern: {err}") from None
    hit = next((tag for tag in COSIGN_TAG_SAMPLES if regex.match(tag)), None)
    if hit is not None:
        raise ValueError(f"{pattern!r} would make cosign's signature and attestation tags (like {hit[:20]}...) "
                         f"immutable; choose a pattern for release tags only, e.g. '[0-9]*' or 'v*'")


def immutable_rule_body(pattern: str, *, rule_id: int | None = None) -> dict[str, Any]:
    """An immutable tag rule for every repository of the project and the tags PATTERN matches.

    Why `matches` PATTERN rather than one rule `excludes sha256-*`: Harbor evaluates only the
    first tag selector of a rule, so a rule cannot say "release tags but not sha256-*"; and an
    `excludes sha256-*` rule would freeze every other tag too (latest, branch tags). So each
    release pattern gets a `matches` rule of its own, and check_release_pattern has refused any
    pattern that could also match cosign's sha256-<hex>.sig/.att tags, which stay writable.
    """
    body: dict[str, Any] = {
        "disabled": False, "action": "immutable", "template": "immutable_template", "priority": 0, "params": {},
        "tag_selectors": [{"kind": "doublestar", "decoration": "matches", "pattern": pattern}],
        "scope_selectors": {"repository": [{"kind": "doublestar", "decoration": "repoMatches", "pattern": "**"}]},
    }
    if rule_id is not None:
        body["id"] = rule_id
    return body


def read_rule(raw: Mapping[str, Any]) -> ImmutableRule | None:
    """A rule as Harbor lists it, or None for a shape this client does not write."""
    tags = raw.get("tag_selectors") or []
    repos = (raw.get("scope_selectors") or {}).get("repository") or []
    if not tags or not repos or raw.get("id") is None:
        return None
    return ImmutableRule(id=int(raw["id"]), tag_pattern=str(tags[0].get("pattern", "")),
                         tag_decoration=str(tags[0].get("decoration", "")),
                         repository_pattern=str(repos[0].get("pattern", "")),
                         repository_decoration=str(repos[0].get("decoration", "")),
                         disabled=bool(raw.get("disabled", False)))


def _is_our_rule(rule: ImmutableRule, pattern: str) -> bool:
    return (rule.tag_pattern == pattern and rule.tag_decoration == "matches"
            and rule.repository_pattern == "**" and rule.repository_decoration == "repoMatches")


def robot_permissions(project: str, access: tuple[tuple[str, str], ...] = ROBOT_ACCESS) -> list[dict[str, Any]]:
    return [{"kind": "project", "namespace": project,
             # no "effect": Harbor's own UI sends none, and an absent effect allows
             "access": [{"resource": resource, "action": action} for resource, action in access]}]


def robot_request(project: str, spec: RobotSpec) -> dict[str, Any]:
    """The body of POST /robots (RobotCreate): a project-level robot; Harbor generates the secret."""
    return {"name": spec.name, "description": spec.description, "level": "project", "disable": False,
            "duration": spec.duration_days, "permissions": robot_permissions(project)}


def robot_full_name_matches(full_name: str, project: str, name: str) -> bool:
    """robot$PROJECT+NAME, whatever prefix the Harbor instance is configured with."""
    return full_name.endswith(f"{project}+{name}") and full_name[: -len(f"{project}+{name}")].endswith("$")


def read_robot(raw: Mapping[str, Any], project: str) -> Robot:
    access = set()
    for permission in raw.get("permissions") or []:
        if permission.get("kind") == "project" and permission.get("namespace") == project:
            for item in permission.get("access") or []:
                if item.get("effect", "allow") == "allow":
                    access.add((str(item.get("resource")), str(item.get("action"))))
    return Robot(id=int(raw["id"]), name=str(raw.get("name", "")), level=str(raw.get("level", "")),
                 disabled=bool(raw.get("disable", False)), expires_at=int(raw.get("expires_at", -1)),
                 access=frozenset(access))


def robot_update_body(raw: Mapping[str, Any], project: str) -> dict[str, Any]:
    """PUT /robots/{id}: the robot as it is, enabled, with at least the access CI needs."""
    current = read_robot(raw, project)
    wanted = tuple(sorted(current.access | set(ROBOT_ACCESS)))
    return {"name": raw["name"], "description": raw.get("description", ""), "level": raw.get("level", "project"),
            "duration": raw.get("duration") if raw.get("duration") is not None else -1, "disable": False,
            "permissions": robot_permissions(project, wanted)}


def repository_segment(repository: str) -> str:
    """A repository name in a path: Harbor wants it URL-encoded twice (a/b -> a%252Fb)."""
    return quote(quote(repository, safe=""), safe="")


def parse_artifact(text: str) -> ArtifactRef:
    """[HOST/]PROJECT/REPOSITORY@sha256:HEX; ValueError if it is not one."""
    # The one reference grammar (imagebuild.oci.reference); the registry host, when written, is
    # dropped: the API is addressed by --url.
    try:
        parts = reference.split(text)
    except reference.ReferenceError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    if parts.digest is None or not parts.digest.startswith("sha256:") or parts.tag is not None:
        raise ValueError(f"{text!r}: give the image by digest, PROJECT/REPOSITORY@sha256:<64 hex digits>")
    project, slash, repository = parts.path.partition("/")
    if not slash:
        raise ValueError(f"{text!r}: expected PROJECT/REPOSITORY@DIGEST (a Harbor repository is inside a project)")
    check_name("project", project)
    return ArtifactRef(project, repository, parts.digest)


def read_scan_overview(ref: ArtifactRef, artifact: Mapping[str, Any]) -> ScanOverview:
    """The scan summary from GET .../artifacts/{digest}?with_scan_overview=true."""
    overview = artifact.get("scan_overview") or {}
    summary = next((overview[m] for m in VULN_REPORT_MIMES if m in overview), None)
    if summary is None:
        return ScanOverview(ref, found=True, status="not scanned")
    counts = (summary.get("summary") or {})
    scanner = summary.get("scanner") or {}
    scanner_text = " ".join(str(scanner[k]) for k in ("name", "version") if scanner.get(k)) or None
    return ScanOverview(ref, found=True, status=str(summary.get("scan_status") or "unknown"),
                        severity=summary.get("severity"), counts=dict(counts.get("summary") or {}),
                        total=int(counts.get("total") or 0), fixable=int(counts.get("fixable") or 0),
                        scanner=scanner_text, end_time=summary.get("end_time"))


def _error_text(response: httpx.Response) -> str:
    """Harbor's own words from its error body ({"errors": [{"code", "message"}]}), made one safe line."""
    try:
        errors = response.json().get("errors") or []
        text = "; ".join(f"{e.get('code', '')}: {e.get('message', '')}".strip(": ") for e in errors)
    except (ValueError, AttributeError):
        text = response.text[:200]
    return _SAFE_TEXT.sub("?", text)[:300] or response.reason_phrase


# -- I/O ------------------------------------------------------------------------------


# Harbor's retries on oci.retry's engine: on 429/5xx and on failed connections, backing off from
# half a second (jittered, so that many CI jobs do not retry in step) up to 30 s, for as long as the
# tries take; a Retry-After is honoured up to 30 s. Any method may be retried on an answer, but a
# POST whose connection broke after it may have reached Harbor is not sent again (it may have created
# what it asked for). HarborClient sets the number of tries and the first backoff.
HARBOR_RETRIES = RetryPolicy(attempts=5, base_delay_s=0.5, max_delay_s=30.0, max_elapsed_s=math.inf,
                             max_retry_after_s=30.0, cap_retry_after=True, send_once=frozenset(),
                             resend_unsent_only=frozenset({"POST"}))


def _env_proxy(url: str) -> str | None:
    """The proxy the environment names for URL (HTTPS_PROXY, ALL_PROXY, NO_PROXY, ...), as a client
    that trusts the environment picks it: httpx does not when it is handed its transport."""
    parts = urlsplit(url)
    if urllib.request.proxy_bypass(parts.netloc):
        return None
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    return proxy if not proxy or "://" in proxy else f"http://{proxy}"


class HarborClient:
    """One Harbor instance, as one user. Use as a context manager."""

    def __init__(self, url: str, credentials: Credentials, *, ca_bundle: Path | None = None, retries: int = 4,
                 backoff: float = 0.5, timeout: float = 30.0):
        self.url = check_base_url(url)
        self.username = credentials.username
        self.retry_log = RetryLog()
        verify: ssl.SSLContext | bool = True
        if ca_bundle is not None:
            verify = ssl.create_default_context(cafile=str(ca_bundle))
        transport = RetryingTransport(httpx.HTTPTransport(verify=verify, proxy=_env_proxy(self.url)),
                                      replace(HARBOR_RETRIES, attempts=retries + 1, base_delay_s=backoff),
                                      self.retry_log)
        self._http = httpx.Client(base_url=self.url + API, auth=(credentials.username, credentials.password),
                                  timeout=timeout, transport=transport,
                                  headers={"Accept": "application/json", "User-Agent": "imagebuild-harbor"})

    def __enter__(self) -> HarborClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- requests ------------------------------------------------------------------------

    def request(self, method: str, path: str, *, what: str, params: Mapping[str, Any] | None = None,
                json: Any = None, headers: Mapping[str, str] | None = None,
                expect: tuple[int, ...] = (200,), tolerate: tuple[int, ...] = ()) -> httpx.Response:
        """METHOD PATH, retried on 429/5xx and on failed connections (HARBOR_RETRIES); a status outside
        EXPECT and TOLERATE raises. WHAT says what the request does, for the error line."""
        retried = self.retry_log.retries
        try:
            response = self._http.request(method, path, params=params, json=json, headers=headers)
        except httpx.HTTPError as err:
            raise HarborUnavailable(f"cannot reach Harbor at {self.url} to {what}: "
                                    f"{_SAFE_TEXT.sub('?', str(err) or type(err).__name__)}") from None
        if response.status_code in expect or response.status_code in tolerate:
            return response
        raise self._failure(response, what, self.retry_log.retries - retried + 1)

    def _failure(self, response: httpx.Response, what: str, attempts: int) -> HarborError:
        status = response.status_code
        request_id = response.headers.get("X-Request-Id")
        detail = f"Harbor answered {status} ({_error_text(response)})"
        tail = f" [request id {request_id}]" if request_id else ""
        if status == 401:
            return HarborAuthError(f"{detail} to {what}: wrong user name or password for {self.username!r}{tail}",
                                   status, request_id)
        if status == 403:
            return HarborAuthError(f"{detail} to {what}: user {self.username!r} lacks the permission{tail}",
                                   status, request_id)
        if status in RETRY_STATUSES:
            return HarborUnavailable(f"{detail} to {what}, {attempts} times{tail}", status, request_id)
        return HarborError(f"{detail} to {what}{tail}", status, request_id)

    def _pages(self, path: str, *, what: str, params: Mapping[str, Any] | None = None,
               headers: Mapping[str, str] | None = None) -> Iterator[Mapping[str, Any]]:
        page_size = 100
        for page in range(1, 1000):
            rows = self.request("GET", path, what=what, params={**(params or {}), "page": page, "page_size": page_size},
                                headers=headers).json()
            yield from rows
            if len(rows) < page_size:
                return

    def harbor_version(self) -> str:
        """Harbor's version from /systeminfo; HarborUnavailable when URL does not serve Harbor's v2.0 API."""
        response = self.request("GET", "/systeminfo", what="read Harbor's system info", tolerate=(404,))
        try:
            info = response.json() if response.status_code == 200 else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise HarborUnavailable(f"{self.url} does not serve Harbor's API (GET {API}/systeminfo answered "
                                    f"{response.status_code}{'' if info is None else ' with no JSON object'})",
                                    response.status_code)
        return str(info.get("harbor_version") or "unknown")

    # -- projects ------------------------------------------------------------------------

    def get_project(self, name: str) -> Project | None:
        response = self.request("GET", f"/projects/{quote(name, safe='')}", what=f"read project {name}",
                                headers={"X-Is-Resource-Name": "true"}, tolerate=(404,))
        if response.status_code == 404:
            return None
        raw = response.json()
        return Project(int(raw["project_id"]), str(raw["name"]), dict(raw.get("metadata") or {}))

    def ensure_project(self, name: str, settings: ProjectSettings) -> ProjectResult:
        check_name("project", name)
        wanted = settings.metadata()
        current = self.get_project(name)
        if current is None:
            response = self.request("POST", "/projects", what=f"create project {name}",
                                    json=project_request(name, settings), expect=(201,), tolerate=(409,))
            current = self.get_project(name)
            if current is None:
                raise HarborError(f"Harbor created project {name} but does not show it")
            if response.status_code == 201:
                return ProjectResult(name, current.id, "created", {k: (None, v) for k, v in wanted.items()})
            # 409: created meanwhile (a retried request, another job): bring it to the wanted state
        changes = metadata_drift(current.metadata, wanted)
        if not changes:
            return ProjectResult(name, current.id, "unchanged", {})
        self.request("PUT", f"/projects/{current.id}", what=f"update the metadata of project {name}",
                     json={"metadata": {key: after for key, (_, after) in changes.items()}})
        return ProjectResult(name, current.id, "updated", changes)

    # -- immutable tag rules -------------------------------------------------------------

    def immutable_rules(self, project: Project) -> list[tuple[ImmutableRule, Mapping[str, Any]]]:
        rows = self._pages(f"/projects/{project.id}/immutabletagrules", what=f"list the immutable tag rules of {project.name}")
        return [(rule, raw) for raw in rows if (rule := read_rule(raw)) is not None]

    def ensure_immutable_rule(self, project: Project, pattern: str) -> RuleResult:
        check_release_pattern(pattern)
        for rule, _ in self.immutable_rules(project):
            if _is_our_rule(rule, pattern):
                if not rule.disabled:
                    return RuleResult(pattern, rule.id, "unchanged")
                self.request("PUT", f"/projects/{project.id}/immutabletagrules/{rule.id}",
                             what=f"enable the immutable tag rule {pattern} of {project.name}",
                             json=immutable_rule_body(pattern, rule_id=rule.id))
                return RuleResult(pattern, rule.id, "enabled")
        response = self.request("POST", f"/projects/{project.id}/immutabletagrules",
                                what=f"add the immutable tag rule {pattern} to {project.name}",
                                json=immutable_rule_body(pattern), expect=(201,))
        return RuleResult(pattern, _id_from_location(response), "created")

    # -- robot accounts ------------------------------------------------------------------

    def find_robot(self, project: Project, name: str) -> Mapping[str, Any] | None:
        rows = self._pages("/robots", what=f"list the robot accounts of {project.name}",
                           params={"q": f"Level=project,ProjectID={project.id}"})
        return next((raw for raw in rows if robot_full_name_matches(str(raw.get("name", "")), project.name, name)), None)

    def ensure_robot(self, project: Project, spec: RobotSpec, *, rotate_secret: bool = False) -> RobotResult:
        check_name("robot", spec.name)
        if spec.duration_days != -1 and spec.duration_days <= 0:
            raise ValueError("a robot's duration is a number of days, or -1 for never")
        raw = self.find_robot(project, spec.name)
        if raw is None:
            response = self.request("POST", "/robots", what=f"create the robot account {spec.name} in {project.name}",
                                    json=robot_request(project.name, spec), expect=(201,), tolerate=(409,))
            if response.status_code == 201:
                created = response.json()
                return RobotResult(str(created["name"]), int(created["id"]), "created",
                                   int(created.get("expires_at", -1)), secret=str(created["secret"]))
            raw = self.find_robot(project, spec.name)  # created meanwhile: its secret went to whoever did
            if raw is None:
                raise HarborError(f"Harbor says robot {spec.name} exists in {project.name} but does not list it", 409)
        robot = read_robot(raw, project.name)
        actions = []
        if robot.disabled or not set(ROBOT_ACCESS) <= robot.access:
            self.request("PUT", f"/robots/{robot.id}", what=f"update the robot account {robot.name}",
                         json=robot_update_body(raw, project.name))
            actions.append("updated")
        secret = None
        if rotate_secret:
            # An empty RobotSec asks Harbor to generate the new secret itself.
            answer = self.request("PATCH", f"/robots/{robot.id}", what=f"refresh the secret of {robot.name}", json={})
            secret = str(answer.json()["secret"])
            actions.append("rotated")
        return RobotResult(robot.name, robot.id, "+".join(actions) or "unchanged", robot.expires_at, secret=secret)

    # -- scan results --------------------------------------------------------------------

    def scan_overview(self, ref: ArtifactRef) -> ScanOverview:
        path = (f"/projects/{quote(ref.project, safe='')}/repositories/{repository_segment(ref.repository)}"
                f"/artifacts/{ref.digest}")
        response = self.request("GET", path, what=f"read the scan overview of {ref}",
                                params={"with_scan_overview": "true", "with_tag": "false"},
                                headers={"X-Accept-Vulnerabilities": ", ".join(VULN_REPORT_MIMES)}, tolerate=(404,))
        if response.status_code == 404:
            return ScanOverview(ref, found=False, status="not found")
        return read_scan_overview(ref, response.json())


def _id_from_location(response: httpx.Response) -> int | None:
    location = response.headers.get("Location", "")
    tail = location.rstrip("/").rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else None


def ensure(client: HarborClient, setup: HarborSetup) -> EnsureReport:
    """Bring SETUP's project, immutable rules and robot about; idempotent (a rerun reports unchanged)."""
    for pattern in setup.immutable_tags:
        check_release_pattern(pattern)  # refuse bad input before changing anything
    if setup.robot is not None:
        check_name("robot", setup.robot.name)
    version = client.harbor_version()
    project_result = client.ensure_project(setup.project, setup.settings)
    project = client.get_project(setup.project)
    if project is None:
        raise HarborError(f"project {setup.project} vanished while it was being set up")
    rules = tuple(client.ensure_immutable_rule(project, pattern) for pattern in setup.immutable_tags)
    robot = (client.ensure_robot(project, setup.robot, rotate_secret=setup.rotate_secret)
             if setup.robot is not None else None)
    return EnsureReport(client.url, version, project_result, rules, robot)
