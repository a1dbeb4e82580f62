"""A Harbor API v2.0 stand-in: a real HTTP(S) server with in-memory state, for the tests only.

Harbor itself cannot run on the test machines. This double serves the operations imagebuild
uses (projects, immutable tag rules, robot accounts, artifacts with their scan overview, ping,
systeminfo, and manual GC runs with their status and log) with Harbor's behaviour where the client depends on it: basic auth, Harbor's
error body (`{"errors": [{"code", "message"}]}`), X-Request-Id, names and secrets as Harbor
forms them. Every request and every response goes through `HarborSpec` (spec.py); whatever
Harbor's description does not allow is answered 400 (for a request) and recorded in
`violations`, which every test asserts is empty. Operations the stand-in does not serve are
recorded too, so a client that starts calling a new one must extend the stand-in first.

Faults are injected with `inject()`: the next requests are answered with a status (5xx, 429)
as Harbor or the reverse proxy in front of it would, to test retries. GC runs: each GET of a
run moves it on (Pending, then Running for `gc_running_polls` reads, then `gc_outcome`); `start_gc()`
makes one already running, as a schedule or another admin would. Nothing is deleted: the log reports.
"""
from __future__ import annotations

import base64
import datetime as dt
import itertools
import json
import re
import secrets
import ssl
import string
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .spec import HarborSpec, Operation, SpecViolation

ADMIN = ("admin", "Harbor12345")
VULN_REPORT_V11 = "application/vnd.security.vulnerability.report; version=1.1"
VULN_REPORT_HARBOR = "application/vnd.scanner.adapter.vuln.report.harbor+json; version=1.0"

# Statuses real Harbor sends for an operation although its description omits them. Each is
# allowed for that operation only, with the reason; anything else undeclared is a violation.
KNOWN_UNDECLARED = {
    ("CreateRobot", 409): "Harbor's robot store answers a duplicate robot name with 409 CONFLICT",
}

# Harbor's project and robot name rule (src/common/utils/utils.go and the robot handler).
NAME_RULE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$")
# The project-level robot permissions Harbor accepts (resource -> actions), a subset of its RBAC
# table that covers what a CI robot asks for; anything else is Harbor's 400.
ROBOT_PROJECT_ACCESS = {
    "repository": {"list", "pull", "push", "delete", "update", "read"},
    "artifact": {"read", "list", "delete", "create"},
    "tag": {"create", "delete", "list"},
    "artifact-label": {"create", "delete"},
    "scan": {"create", "stop", "read"},
    "sbom": {"create", "stop", "read"},
    "accessory": {"list"},
    "artifact-addition": {"read"},
    "label": {"create", "delete", "list", "read", "update"},
    "helm-chart": {"read"},
}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class HarborFault(Exception):
    """Answer the request with Harbor's error body."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Reply:
    status: int
    body: Any = None  # JSON-serialisable, or None for no body
    headers: dict[str, str] = field(default_factory=dict)
    text: str | None = None  # a text/plain body (ping)


@dataclass
class Injected:
    status: int
    remaining: int
    operation: str | None
    retry_after: str | None
    after_effect: bool  # the operation is carried out, and its answer lost (a proxy timing out)


@dataclass
class Seen:
    """One request as the stand-in received it (headers without Authorization)."""

    method: str
    path: str
    operation: str | None
    query: dict[str, list[str]]
    body: Any
    status: int


def doublestar_regex(pattern: str) -> re.Pattern[str]:
    """Harbor's tag and repository patterns (bmatcuk/doublestar) as a regular expression."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        elif c == "{":
            end = pattern.index("}", i)
            out.append("(?:" + "|".join(doublestar_regex(p).pattern[1:-1] for p in pattern[i + 1:end].split(",")) + ")")
            i = end + 1
            continue
        elif c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("^" + "".join(out) + "$")


class HarborStandIn:
    """Start with `start()`; `url` is then http(s)://127.0.0.1:PORT. Thread-safe."""

    def __init__(self, spec: HarborSpec, *, tls: ssl.SSLContext | None = None,
                 users: dict[str, str] | None = None, admins: tuple[str, ...] = (ADMIN[0],)):
        self.spec = spec
        self.tls = tls
        self.users = {ADMIN[0]: ADMIN[1], **(users or {})}
        self.admins = set(admins)
        self.violations: list[str] = []
        self.requests: list[Seen] = []
        self.lock = threading.RLock()
        self.projects: dict[int, dict[str, Any]] = {}
        self.rules: dict[int, list[dict[str, Any]]] = {}  # project id -> immutable rules
        self.robots: dict[int, dict[str, Any]] = {}  # id -> robot, secret included
        self.artifacts: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (project, repository)
        self.gc_runs: dict[int, dict[str, Any]] = {}
        self.gc_outcome = "Success"  # how the next runs end: Success, Error or Stopped
        self.gc_running_polls = 2  # reads of a run that find it Running before it ends
        self.gc_log_extra: list[str] = []  # lines every GC log gets (a test's canaries)
        self._ids = itertools.count(1)
        self._faults: list[Injected] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> HarborStandIn:
        standin = self

        class Handler(_Handler):
            owner = standin

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        if self.tls is not None:
            server.socket = self.tls.wrap_socket(server.socket, server_side=True)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="harbor-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the stand-in first"
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self._server.server_address[1]}"

    # -- what tests arrange and inspect ---------------------------------------------------

    def inject(self, status: int, times: int = 1, *, operation: str | None = None,
               retry_after: str | None = None, after_effect: bool = False) -> None:
        """Answer the next TIMES requests (to OPERATION, an operationId, if given) with STATUS;
        AFTER_EFFECT: carry each out first, so only its answer is lost."""
        with self.lock:
            self._faults.append(Injected(status, times, operation, retry_after, after_effect))

    def add_project(self, name: str, metadata: dict[str, str] | None = None) -> dict[str, Any]:
        with self.lock:
            return self._create_project(name, {"public": "false", **(metadata or {})})

    def project(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            return next((p for p in self.projects.values() if p["name"] == name), None)

    def add_artifact(self, project: str, repository: str, digest: str, *, tags: tuple[str, ...] = (),
                     scan: dict[str, Any] | None = None) -> None:
        """An artifact as pushed (and, with SCAN, scanned: a NativeReportSummary's fields)."""
        with self.lock:
            owner = self.project(project)
            assert owner is not None, f"add_project({project!r}) first"
            stored = {"id": next(self._ids), "digest": digest, "project_id": owner["project_id"],
                      "tags": list(tags), "scan": scan, "push_time": _now()}
            self.artifacts.setdefault((project, repository), []).append(stored)

    def is_immutable(self, project: str, repository: str, tag: str) -> bool:
        """Whether Harbor would refuse to overwrite or delete PROJECT/REPOSITORY:TAG.

        As Harbor's immutable-rule matcher does: a rule applies when its first repository
        selector and its first tag selector both select the candidate (`matches`: the pattern
        matches; `excludes`: it does not); any enabled rule that applies makes the tag immutable.
        """
        with self.lock:
            owner = self.project(project)
            if owner is None:
                return False
            for rule in self.rules.get(owner["project_id"], []):
                if rule.get("disabled"):
                    continue
                repo_selector = rule["scope_selectors"]["repository"][0]
                tag_selector = rule["tag_selectors"][0]
                repo_hit = bool(doublestar_regex(repo_selector["pattern"]).match(repository))
                if repo_selector["decoration"] == "repoExcludes":
                    repo_hit = not repo_hit
                tag_hit = bool(doublestar_regex(tag_selector["pattern"]).match(tag))
                if tag_selector["decoration"] == "excludes":
                    tag_hit = not tag_hit
                if repo_hit and tag_hit:
                    return True
            return False

    def start_gc(self, *, dry_run: bool = False) -> int:
        """A GC run already running in Harbor (scheduled, or started by someone else): its ID."""
        with self.lock:
            run = self._new_gc_run({"delete_untagged": False, "dry_run": dry_run}, "Schedule")
            run.update(job_status="Running", _polls=1)
            return int(run["id"])

    def robot_named(self, full_name: str) -> dict[str, Any] | None:
        with self.lock:
            return next((r for r in self.robots.values() if r["name"] == full_name), None)

    # -- one request ---------------------------------------------------------------------

    def handle(self, method: str, raw_target: str, headers: dict[str, str], body: bytes) -> tuple[Reply, Operation | None]:
        parts = urlsplit(raw_target)
        query = parse_qs(parts.query, keep_blank_values=True)
        try:
            operation, path_params = self.spec.match(method, parts.path)
        except SpecViolation as err:
            self._violation(str(err))
            return _error(404, "NOT_FOUND", str(err)), None
        problems = self.spec.check_request(operation, path_params, query, headers, body)
        parsed = json.loads(body) if body and not problems else None
        if problems:
            for problem in problems:
                self._violation(problem)
            reply = _error(400, "BAD_REQUEST", "; ".join(problems))
            reply.headers["X-Standin-Unchecked"] = "1"  # the test fails on the request already
        else:
            fault = self._fault_for(operation)
            if fault is None or fault[1]:
                served = self._serve(operation, path_params, query, headers, parsed)
            reply = fault[0] if fault is not None else served
        with self.lock:
            self.requests.append(Seen(method, parts.path, operation.operation_id, query, parsed, reply.status))
        return reply, operation

    def check_reply(self, operation: Operation | None, reply: Reply, headers: dict[str, str], body: bytes) -> None:
        if operation is None or reply.headers.get("X-Standin-Unchecked"):
            return
        if (operation.operation_id, reply.status) in KNOWN_UNDECLARED:
            for problem in self.spec.definition_errors("Errors", json.loads(body or b"null"), request=False):
                self._violation(f"{operation.operation_id} {reply.status}: {problem}")
            return
        for problem in self.spec.check_response(operation, reply.status, headers, body):
            self._violation(problem)

    def _violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(text)

    def _fault_for(self, operation: Operation) -> tuple[Reply, bool] | None:
        with self.lock:
            for fault in self._faults:
                if fault.remaining > 0 and fault.operation in (None, operation.operation_id):
                    fault.remaining -= 1
                    reply = _error(fault.status, "INTERNAL_SERVER_ERROR" if fault.status >= 500 else "TOO_MANY_REQUESTS",
                                   f"injected fault {fault.status}")
                    if fault.retry_after is not None:
                        reply.headers["Retry-After"] = fault.retry_after
                    if str(fault.status) not in operation.responses:
                        reply.headers["X-Standin-Unchecked"] = "1"  # from the proxy in front: not Harbor's API
                    return reply, fault.after_effect
        return None

    def _serve(self, op: Operation, path: dict[str, str], query: dict[str, list[str]], headers: dict[str, str],
               body: Any) -> Reply:
        handler: Callable[..., Reply] | None = getattr(self, f"_op_{op.operation_id}", None)
        if handler is None:
            self._violation(f"{op.operation_id}: the stand-in does not serve this operation; extend tests/harbor_standin")
            return _error(500, "UNKNOWN", f"stand-in: {op.operation_id} not implemented")
        if op.operation_id not in ("getPing", "getSystemInfo"):
            user = self._authenticate(headers.get("authorization", ""))
            if user is None:
                return _error(401, "UNAUTHORIZED", "unauthorized")
            if user not in self.admins:
                return _error(403, "FORBIDDEN", f"forbidden: user {user} may not {op.operation_id}")
        q = {k: v[0] for k, v in query.items()}
        try:
            with self.lock:
                return handler(path=path, query=q, headers=headers, body=body)
        except HarborFault as fault:
            return _error(fault.status, fault.code, fault.message)

    def _authenticate(self, header: str) -> str | None:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        known = self.users.get(user)
        return user if known is not None and secrets.compare_digest(known, password) else None

    # -- projects ------------------------------------------------------------------------

    def _create_project(self, name: str, metadata: dict[str, str]) -> dict[str, Any]:
        pid = next(self._ids)
        now = _now()
        project = {
            "project_id": pid, "owner_id": 1, "owner_name": "admin", "name": name, "registry_id": 0,
            "creation_time": now, "update_time": now, "deleted": False, "togglable": True,
            "current_user_role_id": 1, "current_user_role_ids": [1], "repo_count": 0,
            "metadata": dict(metadata),
            "cve_allowlist": {"id": pid, "project_id": pid, "items": [], "creation_time": now, "update_time": now},
        }
        self.projects[pid] = project
        self.rules[pid] = []
        return project

    def _find_project(self, name_or_id: str, headers: dict[str, str]) -> dict[str, Any]:
        by_name = headers.get("x-is-resource-name", "false") == "true" or not name_or_id.isdigit()
        for project in self.projects.values():
            if (project["name"] == name_or_id) if by_name else (str(project["project_id"]) == name_or_id):
                return project
        raise HarborFault(404, "NOT_FOUND", f"project {name_or_id} not found")

    def _op_getPing(self, **_: Any) -> Reply:
        return Reply(200, text="Pong")

    def _op_getSystemInfo(self, **_: Any) -> Reply:
        return Reply(200, {"harbor_version": "v2.14.0-standin", "auth_mode": "db_auth",
                           "current_time": _now(), "self_registration": False})

    def _op_headProject(self, query: dict[str, str], **_: Any) -> Reply:
        found = self.project(query["project_name"])
        return Reply(200) if found is not None else Reply(404)

    def _op_listProjects(self, query: dict[str, str], **_: Any) -> Reply:
        rows = [p for p in self.projects.values() if query.get("name") in (None, p["name"])]
        return Reply(200, rows, {"X-Total-Count": str(len(rows))})

    def _op_createProject(self, headers: dict[str, str], body: dict[str, Any], **_: Any) -> Reply:
        name = body.get("project_name") or ""
        if not NAME_RULE.match(name):
            raise HarborFault(400, "BAD_REQUEST", f"project name is not in lower case or contains illegal characters: {name}")
        if self.project(name) is not None:
            raise HarborFault(409, "CONFLICT", f"The project named {name} already exists")
        metadata = {"public": "false", **(body.get("metadata") or {})}
        if body.get("public") is not None:
            metadata["public"] = str(body["public"]).lower()
        _check_metadata(metadata)
        project = self._create_project(name, metadata)
        by_name = headers.get("x-resource-name-in-location") == "true"
        location = f"/api/v2.0/projects/{name if by_name else project['project_id']}"
        return Reply(201, headers={"Location": location})

    def _op_getProject(self, path: dict[str, str], headers: dict[str, str], **_: Any) -> Reply:
        return Reply(200, self._find_project(path["project_name_or_id"], headers))

    def _op_updateProject(self, path: dict[str, str], headers: dict[str, str], body: dict[str, Any], **_: Any) -> Reply:
        project = self._find_project(path["project_name_or_id"], headers)
        # Harbor updates the metadata keys the request names and keeps the others.
        merged = {**project["metadata"], **(body.get("metadata") or {})}
        _check_metadata(merged)
        project["metadata"] = merged
        project["update_time"] = _now()
        return Reply(200)

    # -- immutable tag rules -------------------------------------------------------------

    def _op_ListImmuRules(self, path: dict[str, str], headers: dict[str, str], **_: Any) -> Reply:
        project = self._find_project(path["project_name_or_id"], headers)
        rows = self.rules[project["project_id"]]
        return Reply(200, rows, {"X-Total-Count": str(len(rows))})

    def _op_CreateImmuRule(self, path: dict[str, str], headers: dict[str, str], body: dict[str, Any], **_: Any) -> Reply:
        project = self._find_project(path["project_name_or_id"], headers)
        rule = _checked_rule(body)
        existing = self.rules[project["project_id"]]
        if any(_rule_key(r) == _rule_key(rule) for r in existing):
            raise HarborFault(400, "BAD_REQUEST", "the immutable tag rule already exists in this project")
        if len(existing) >= 15:
            raise HarborFault(400, "BAD_REQUEST", "a project holds at most 15 immutable tag rules")
        rule["id"] = next(self._ids)
        existing.append(rule)
        return Reply(201, headers={"Location": f"/api/v2.0/projects/{project['project_id']}/immutabletagrules/{rule['id']}"})

    def _op_UpdateImmuRule(self, path: dict[str, str], headers: dict[str, str], body: dict[str, Any], **_: Any) -> Reply:
        project = self._find_project(path["project_name_or_id"], headers)
        rules = self.rules[project["project_id"]]
        for i, old in enumerate(rules):
            if old["id"] == int(path["immutable_rule_id"]):
                rule = _checked_rule(body)
                rule["id"] = old["id"]
                rules[i] = rule
                return Reply(200)
        raise HarborFault(404, "NOT_FOUND", f"immutable rule {path['immutable_rule_id']} not found")

    # -- robot accounts ------------------------------------------------------------------

    def _op_ListRobot(self, query: dict[str, str], **_: Any) -> Reply:
        filters = _parse_q(query.get("q", ""))
        rows = []
        for robot in self.robots.values():
            if all(_robot_field(robot, key, self) == value for key, value in filters.items()):
                rows.append(_public_robot(robot))
        return Reply(200, rows, {"X-Total-Count": str(len(rows))})

    def _op_GetRobotByID(self, path: dict[str, str], **_: Any) -> Reply:
        return Reply(200, _public_robot(self._robot(path["robot_id"])))

    def _op_CreateRobot(self, body: dict[str, Any], **_: Any) -> Reply:
        name, level = body.get("name", ""), body.get("level")
        if not NAME_RULE.match(name):
            raise HarborFault(400, "BAD_REQUEST", f"robot name is not in lower case or contains illegal characters: {name}")
        duration = body.get("duration")
        if duration is None or (duration != -1 and duration <= 0):
            raise HarborFault(400, "BAD_REQUEST", "duration must be either -1(Never) or a positive integer")
        if level != "project":
            raise HarborFault(400, "BAD_REQUEST", f"the stand-in serves project-level robots only, not {level!r}")
        permissions = body.get("permissions") or []
        if len(permissions) != 1 or permissions[0].get("kind") != "project":
            raise HarborFault(400, "BAD_REQUEST", "a project-level robot has exactly one permission of kind project")
        namespace = permissions[0].get("namespace", "")
        if self.project(namespace) is None:
            raise HarborFault(404, "NOT_FOUND", f"project {namespace} not found")
        _check_access(permissions[0].get("access") or [])
        full_name = f"robot${namespace}+{name}"
        if self.robot_named(full_name) is not None:
            raise HarborFault(409, "CONFLICT", f"robot account {full_name} already exists")
        now = dt.datetime.now(dt.timezone.utc)
        expires = -1 if duration == -1 else int((now + dt.timedelta(days=duration)).timestamp())
        robot = {"id": next(self._ids), "name": full_name, "description": body.get("description", ""),
                 "secret": body.get("secret") or _robot_secret(), "level": level, "duration": duration,
                 "editable": True, "disable": bool(body.get("disable", False)), "expires_at": expires,
                 "permissions": permissions, "creator_type": "local", "creator_ref": 1,
                 "creation_time": _now(), "update_time": _now()}
        self.robots[robot["id"]] = robot
        created = {"id": robot["id"], "name": full_name, "secret": robot["secret"],
                   "creation_time": robot["creation_time"], "expires_at": expires}
        return Reply(201, created, {"Location": f"/api/v2.0/robots/{robot['id']}"})

    def _op_UpdateRobot(self, path: dict[str, str], body: dict[str, Any], **_: Any) -> Reply:
        robot = self._robot(path["robot_id"])
        if body.get("name") != robot["name"] or body.get("level") != robot["level"]:
            raise HarborFault(400, "BAD_REQUEST", "cannot update the name or level of a robot account")
        permissions = body.get("permissions") or []
        if len(permissions) != 1 or permissions[0].get("namespace") != robot["permissions"][0]["namespace"]:
            raise HarborFault(400, "BAD_REQUEST", "cannot change the project of a robot account")
        _check_access(permissions[0].get("access") or [])
        robot.update(permissions=permissions, disable=bool(body.get("disable", False)),
                     description=body.get("description", robot["description"]), update_time=_now())
        return Reply(200)

    def _op_RefreshSec(self, path: dict[str, str], body: dict[str, Any], **_: Any) -> Reply:
        robot = self._robot(path["robot_id"])
        given = body.get("secret") or ""
        if given and not _strong_secret(given):
            raise HarborFault(400, "BAD_REQUEST", "the secret must have 8-128 characters with an upper- and a "
                                                  "lower-case letter and a digit")
        robot["secret"] = given or _robot_secret()
        return Reply(200, {"secret": robot["secret"]})

    def _robot(self, robot_id: str) -> dict[str, Any]:
        robot = self.robots.get(int(robot_id))
        if robot is None:
            raise HarborFault(404, "NOT_FOUND", f"robot {robot_id} not found")
        return robot

    # -- garbage collection --------------------------------------------------------------

    def _new_gc_run(self, parameters: dict[str, Any], trigger: str) -> dict[str, Any]:
        # Harbor's job_parameters: the policy's attributes, its Redis URL (with a password) among them.
        settings = {**parameters, "redis_url_reg": "redis://:Redis-Canary-Pw-31@redis:6379/1?idle_timeout_seconds=30",
                    "time_window": 2}
        # job_kind is the execution's trigger as Harbor writes it (MANUAL, SCHEDULE); Harbor puts the same
        # word in schedule.type, outside its own enum, so the stand-in answers the enum's spelling there.
        run = {"id": next(self._ids), "job_name": "GARBAGE_COLLECTION", "job_kind": trigger.upper(),
               "job_parameters": json.dumps(settings), "schedule": {"type": trigger}, "job_status": "Pending",
               "deleted": False, "creation_time": _now(), "update_time": _now(), "_polls": 0,
               "_dry_run": bool(parameters.get("dry_run"))}
        self.gc_runs[run["id"]] = run
        return run

    def _gc_view(self, run: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in run.items() if not k.startswith("_")}

    def _op_createGCSchedule(self, body: dict[str, Any], **_: Any) -> Reply:
        kind = (body.get("schedule") or {}).get("type")
        if kind != "Manual":
            raise HarborFault(400, "BAD_REQUEST", f"the stand-in serves manual GC runs only, not {kind!r}")
        if any(run["job_status"] in ("Pending", "Running") for run in self.gc_runs.values()):
            raise HarborFault(409, "CONFLICT", "a garbage collection job is already running")
        run = self._new_gc_run(dict(body.get("parameters") or {}), "Manual")
        return Reply(201, headers={"Location": f"/api/v2.0/system/gc/{run['id']}"})

    def _op_getGCHistory(self, query: dict[str, str], **_: Any) -> Reply:
        if "q" in query or "sort" in query:
            raise HarborFault(400, "BAD_REQUEST", "the stand-in lists GC runs newest first, without q or sort")
        page, size = int(query.get("page", 1)), int(query.get("page_size", 10))
        runs = sorted(self.gc_runs.values(), key=lambda r: -r["id"])
        rows = [self._gc_view(r) for r in runs[(page - 1) * size:page * size]]
        return Reply(200, rows, {"X-Total-Count": str(len(runs))})

    def _op_getGC(self, path: dict[str, str], **_: Any) -> Reply:
        run = self._gc_run(path["gc_id"])
        # Each read moves the run on, so a client polling it sees Pending, Running, then the end.
        # The first read finds it Pending, the next gc_running_polls Running, the one after ended.
        run["_polls"] += 1
        if run["job_status"] in ("Pending", "Running"):
            if run["_polls"] > 1 + self.gc_running_polls:
                run.update(job_status=self.gc_outcome, update_time=_now())
            elif run["_polls"] > 1:
                run["job_status"] = "Running"
        return Reply(200, self._gc_view(run))

    def _op_getGCLog(self, path: dict[str, str], **_: Any) -> Reply:
        run = self._gc_run(path["gc_id"])
        if run["job_status"] == "Pending":
            raise HarborFault(404, "NOT_FOUND", f"garbage collection {run['id']} log is not found")
        lines = [f"{run['creation_time']} [INFO] [garbage_collection.go]: start to run gc in job.",
                 *self.gc_log_extra,
                 f"{run['creation_time']} [INFO] [garbage_collection.go]: 3 blobs and 1 manifests eligible for deletion",
                 f"{run['creation_time']} [INFO] [garbage_collection.go]: The GC job actual frees up 12 MB space."]
        if run["_dry_run"]:
            lines[-1] = f"{run['creation_time']} [INFO] [garbage_collection.go]: dry run: nothing was deleted"
        if run["job_status"] == "Error":
            lines.append(f"{run['update_time']} [ERROR] [garbage_collection.go]: failed to delete blob: storage error")
        return Reply(200, text="\n".join(lines) + "\n")

    def _gc_run(self, gc_id: str) -> dict[str, Any]:
        run = self.gc_runs.get(int(gc_id))
        if run is None:
            raise HarborFault(404, "NOT_FOUND", f"garbage collection {gc_id} not found")
        return run

    # -- artifacts -----------------------------------------------------------------------

    def _op_getArtifact(self, path: dict[str, str], query: dict[str, str], headers: dict[str, str], **_: Any) -> Reply:
        project = self._find_project(path["project_name"], {"x-is-resource-name": "true"})
        repository = unquote(path["repository_name"])  # sent encoded twice: the router decoded it once
        reference = path["reference"]
        for artifact in self.artifacts.get((project["name"], repository), []):
            if reference in (artifact["digest"], *artifact["tags"]):
                return Reply(200, self._artifact_view(project, repository, artifact, query, headers))
        raise HarborFault(404, "NOT_FOUND", f"artifact {project['name']}/{repository}@{reference} not found")

    def _artifact_view(self, project: dict[str, Any], repository: str, artifact: dict[str, Any],
                       query: dict[str, str], headers: dict[str, str]) -> dict[str, Any]:
        view: dict[str, Any] = {
            "id": artifact["id"], "type": "IMAGE", "media_type": "application/vnd.oci.image.config.v1+json",
            "manifest_media_type": "application/vnd.oci.image.manifest.v1+json", "project_id": project["project_id"],
            "repository_id": artifact["id"], "repository_name": f"{project['name']}/{repository}",
            "digest": artifact["digest"], "size": 1024, "push_time": artifact["push_time"],
            "pull_time": "0001-01-01T00:00:00.000Z", "extra_attrs": {}, "annotations": {}, "references": [],
            "addition_links": {"vulnerabilities": {"absolute": False, "href": (
                f"/api/v2.0/projects/{project['name']}/repositories/{repository.replace('/', '%252F')}"
                f"/artifacts/{artifact['digest']}/additions/vulnerabilities")}},
        }
        if query.get("with_tag", "true") == "true":
            view["tags"] = [{"id": artifact["id"] * 100 + i, "repository_id": artifact["id"], "artifact_id": artifact["id"],
                             "name": tag, "push_time": artifact["push_time"], "pull_time": "0001-01-01T00:00:00.000Z",
                             "immutable": self.is_immutable(project["name"], repository, tag)}
                            for i, tag in enumerate(artifact["tags"])]
        if query.get("with_scan_overview") == "true" and artifact["scan"] is not None:
            accepted = [m.strip() for m in re.split(r",\s*(?=application/)",
                                                    headers.get("x-accept-vulnerabilities", VULN_REPORT_V11))]
            mime = next((m for m in accepted if m in (VULN_REPORT_V11, VULN_REPORT_HARBOR)), None)
            if mime is not None:
                view["scan_overview"] = {mime: artifact["scan"]}
        return view


def _error(status: int, code: str, message: str) -> Reply:
    return Reply(status, {"errors": [{"code": code, "message": message}]})


def _check_metadata(metadata: dict[str, Any]) -> None:
    for key in ("public", "auto_scan", "prevent_vul", "enable_content_trust", "enable_content_trust_cosign",
                "reuse_sys_cve_allowlist", "auto_sbom_generation"):
        if metadata.get(key) not in (None, "true", "false"):
            raise HarborFault(400, "BAD_REQUEST", f"metadata {key} must be \"true\" or \"false\", not {metadata[key]!r}")
    if metadata.get("severity") not in (None, "none", "low", "medium", "high", "critical"):
        raise HarborFault(400, "BAD_REQUEST", f"metadata severity {metadata['severity']!r} is not a severity")


def _checked_rule(body: dict[str, Any]) -> dict[str, Any]:
    """Harbor's own checks of an immutable rule (what the UI always sends, and nothing else)."""
    tags = body.get("tag_selectors") or []
    repos = (body.get("scope_selectors") or {}).get("repository") or []
    if body.get("action") != "immutable" or body.get("template") != "immutable_template":
        raise HarborFault(400, "BAD_REQUEST", "an immutable rule has action immutable and template immutable_template")
    if len(tags) != 1 or tags[0].get("kind") != "doublestar" or tags[0].get("decoration") not in ("matches", "excludes"):
        raise HarborFault(400, "BAD_REQUEST", "an immutable rule has one doublestar tag selector (matches or excludes)")
    if len(repos) != 1 or repos[0].get("kind") != "doublestar" or repos[0].get("decoration") not in ("repoMatches", "repoExcludes"):
        raise HarborFault(400, "BAD_REQUEST", "an immutable rule has one doublestar repository selector")
    for selector in (tags[0], repos[0]):
        if not selector.get("pattern"):
            raise HarborFault(400, "BAD_REQUEST", "a selector needs a pattern")
        try:
            doublestar_regex(selector["pattern"])
        except (ValueError, re.error) as err:
            raise HarborFault(400, "BAD_REQUEST", f"bad pattern {selector['pattern']!r}: {err}") from None
    return {"priority": body.get("priority", 0), "disabled": bool(body.get("disabled", False)),
            "action": "immutable", "template": "immutable_template", "params": body.get("params") or {},
            "tag_selectors": tags, "scope_selectors": {"repository": repos}}


def _rule_key(rule: dict[str, Any]) -> str:
    return json.dumps([rule["tag_selectors"], rule["scope_selectors"]], sort_keys=True)


def _check_access(access: list[dict[str, Any]]) -> None:
    if not access:
        raise HarborFault(400, "BAD_REQUEST", "a robot needs at least one access")
    for item in access:
        if item.get("action") not in ROBOT_PROJECT_ACCESS.get(item.get("resource", ""), ()):
            raise HarborFault(400, "BAD_REQUEST", f"bad request: no such robot permission {item.get('resource')}:"
                                                  f"{item.get('action')} at project level")
        if item.get("effect", "allow") not in ("allow", "deny"):
            raise HarborFault(400, "BAD_REQUEST", f"bad effect {item.get('effect')!r}")


def _parse_q(q: str) -> dict[str, str]:
    """Harbor's `q` for robots: exact matches `k=v` joined by commas (the stand-in knows these keys)."""
    filters = {}
    for part in filter(None, q.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in ("Level", "ProjectID", "name") or value.startswith(("~", "[", "{", "(")):
            raise HarborFault(400, "BAD_REQUEST", f"the stand-in does not support the query {part!r}")
        filters[key] = value
    return filters


def _robot_field(robot: dict[str, Any], key: str, standin: HarborStandIn) -> str:
    if key == "Level":
        return robot["level"]
    if key == "name":
        return robot["name"]
    project = standin.project(robot["permissions"][0]["namespace"])
    return str(project["project_id"]) if project else ""


def _public_robot(robot: dict[str, Any]) -> dict[str, Any]:
    """What Harbor lists: everything but the secret."""
    return {k: v for k, v in robot.items() if k != "secret"}


def _robot_secret() -> str:
    alphabet = string.ascii_letters + string.digits
    while True:
        secret = "".join(secrets.choice(alphabet) for _ in range(32))
        if _strong_secret(secret):
            return secret


def _strong_secret(secret: str) -> bool:
    return (8 <= len(secret) <= 128 and any(c.islower() for c in secret) and any(c.isupper() for c in secret)
            and any(c.isdigit() for c in secret))


class _Handler(BaseHTTPRequestHandler):
    owner: HarborStandIn
    protocol_version = "HTTP/1.1"
    server_version = "harbor-standin"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the base class's name
        pass  # the tests read `requests` and `violations`, not an access log

    def _handle(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        reply, operation = self.owner.handle(self.command, self.path, headers, body)
        request_id = headers.get("x-request-id") or str(uuid.uuid4())
        out_headers = {"X-Request-Id": request_id, **reply.headers}
        if reply.text is not None:
            payload = reply.text.encode()
            out_headers["Content-Type"] = "text/plain"
        elif reply.body is not None:
            payload = json.dumps(reply.body).encode()
            out_headers["Content-Type"] = "application/json"
        else:
            payload = b""
        self.owner.check_reply(operation, reply, {k.lower(): v for k, v in out_headers.items()}, payload)
        self.send_response(reply.status)
        for key, value in out_headers.items():
            if key != "X-Standin-Unchecked":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle
