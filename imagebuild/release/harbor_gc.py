"""Harbor's own garbage collection (API v2.0 /system/gc): start a manual run, wait for it, report it.

`imagebuild gc sweep --harbor URL` calls `run_gc`: POST /system/gc/schedule with a Manual schedule,
then GET /system/gc/{id} every `GcWait.poll_s` until the run ends (Success, Error, Stopped) or
`GcWait.timeout_s` passes, then the tail of its log. Harbor runs one GC at a time: when it answers 409
(or 412) because one is already running, that run is the one waited on and reported.

Every answer is untrusted: read field by field (InputError naming the key, exit 2). A run's
job_parameters hold Harbor's own settings (its Redis URL, with a password where Redis has one), so only
the two booleans imagebuild sets are read from them, and every log line shown has URL credentials and
the caller's password blanked.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from imagebuild.core.source import Document, InputError, PathKey, Reader, format_key, safe_text
from imagebuild.release.harbor import API, HarborClient, HarborError

STATUSES = ("Pending", "Running", "Success", "Error", "Stopped")
FINISHED = frozenset({"Success", "Error", "Stopped"})
CONFLICT_STATUSES = (409, 412)  # Harbor's answers while a GC runs
MAX_LOG_BYTES = 64 * 1024  # only the log's tail is read
LOG_LINES = 8  # lines in the report's summary
MAX_PARAMETERS = 16 * 1024  # job_parameters longer than this are not read
_LISTED = 25  # GC runs read to find the running one (newest first)
_STARTS = 3  # POSTs while each conflict's run ends before it can be read
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]*@")


@dataclass(frozen=True)
class GcWait:
    """How a GC run is waited on; the CLI passes rollout's Timing clock and sleep, tests instant ones."""

    sleep: Callable[[float], None]
    clock: Callable[[], float]
    poll_s: float = 5.0
    timeout_s: float = 3600.0


@dataclass(frozen=True)
class GcRunView:
    """One GCHistory as Harbor answers it, the fields imagebuild reads."""

    id: int
    status: str
    trigger: str | None  # job_kind: Manual, Schedule ...
    dry_run: bool | None  # from job_parameters; None when it does not say
    delete_untagged: bool | None
    creation_time: str | None
    update_time: str | None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class HarborGcResult:
    url: str
    harbor_version: str
    run: GcRunView
    started: bool  # False: a GC already running was waited on
    polls: int
    log: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.run.status == "Success"

    def to_dict(self) -> dict[str, Any]:
        return {"harbor": self.url, "harbor_version": self.harbor_version, "gc_id": self.run.id,
                "status": self.run.status, "started": self.started, "trigger": self.run.trigger,
                "dry_run": self.run.dry_run, "delete_untagged": self.run.delete_untagged,
                "creation_time": self.run.creation_time, "update_time": self.run.update_time,
                "polls": self.polls, "log": list(self.log)}


class HarborGcTimeout(HarborError):
    """Harbor's GC run did not end within the wait; it goes on in Harbor."""


# -- pure: the request and the readers ------------------------------------------------------


def manual_gc_request(*, delete_untagged: bool, dry_run: bool) -> dict[str, Any]:
    """The body of POST /system/gc/schedule (Schedule) that starts a GC now."""
    return {"schedule": {"type": "Manual"}, "parameters": {"delete_untagged": delete_untagged, "dry_run": dry_run}}


class _AnswerReader(Reader):
    """A Reader over a JSON answer: errors name the request and the key (an answer has no lines)."""

    def error(self, path: PathKey, message: str) -> InputError:
        return InputError(self.doc.file, None, format_key(path), message)


def _optional_text(r: Reader, raw: dict[str, Any], key: str, path: PathKey, limit: int = 64) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    text = r.string(value, path + (key,), non_empty=False)
    if len(text) > limit:
        raise r.error(path + (key,), f"longer than {limit} characters")
    return safe_text(text, limit)


def _flags(text: str | None) -> tuple[bool | None, bool | None]:
    """dry_run and delete_untagged from job_parameters (a JSON object in a string); nothing else is kept."""
    if not text:
        return None, None
    try:
        params = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(params, dict):
        return None, None
    dry_run, untagged = params.get("dry_run"), params.get("delete_untagged")
    return (dry_run if isinstance(dry_run, bool) else None, untagged if isinstance(untagged, bool) else None)


def _run(r: Reader, value: Any, path: PathKey) -> GcRunView:
    raw = r.mapping(value, path, required=("id", "job_status"))
    gc_id = r.integer(raw["id"], path + ("id",), minimum=1, maximum=2**63 - 1)
    status = r.string(raw["job_status"], path + ("job_status",))
    if status not in STATUSES:
        raise r.error(path + ("job_status",), f"unknown status {safe_text(status, 40)} (one of {', '.join(STATUSES)})")
    parameters = raw.get("job_parameters")
    if parameters is not None:
        parameters = r.string(parameters, path + ("job_parameters",), non_empty=False)
    dry_run, untagged = _flags(parameters if parameters and len(parameters) <= MAX_PARAMETERS else None)
    return GcRunView(gc_id, status, _optional_text(r, raw, "job_kind", path), dry_run, untagged,
                     _optional_text(r, raw, "creation_time", path), _optional_text(r, raw, "update_time", path))


def read_gc_run(data: Any, where: str) -> GcRunView:
    """GET /system/gc/{id}'s GCHistory."""
    return _run(_AnswerReader(Document(where, data)), data, ())


def read_gc_history(data: Any, where: str) -> list[GcRunView]:
    """GET /system/gc's list of GCHistory."""
    r = _AnswerReader(Document(where, data))
    return [_run(r, item, (i,)) for i, item in enumerate(r.sequence(data, ()))]


def gc_id_from_location(location: str | None) -> int | None:
    """The run's ID from the 201's Location (/api/v2.0/system/gc/{id}), or None when it holds none."""
    if not location:
        return None
    path = location.split("?", 1)[0].rstrip("/")
    head, _, tail = path.rpartition("/")
    if not head.endswith("/system/gc") or not tail.isdigit() or len(tail) > 18:
        return None
    return int(tail) or None


def log_summary(text: str, hide: Iterable[str] = ()) -> tuple[str, ...]:
    """The last lines of a GC log worth showing, each one safe line, URL credentials and HIDE blanked."""
    lines = []
    for line in text.splitlines():
        line = _URL_CREDENTIALS.sub(r"\1***@", line.strip())
        for secret in hide:
            if secret:
                line = line.replace(secret, "***")
        if line:
            lines.append(safe_text(line, 300))
    return tuple(lines[-LOG_LINES:])


# -- I/O ---------------------------------------------------------------------------------------


def _json(response: httpx.Response, where: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise InputError(where, None, "", "Harbor's answer is not JSON") from None


def _get_run(client: HarborClient, gc_id: int) -> GcRunView:
    path = f"/system/gc/{gc_id}"
    response = client.request("GET", path, what=f"read GC run {gc_id}")
    where = f"{client.url}{API}{path}"
    run = read_gc_run(_json(response, where), where)
    if run.id != gc_id:
        raise InputError(where, None, "id", f"Harbor answered run {run.id} for run {gc_id}")
    return run


def _running(client: HarborClient) -> GcRunView | None:
    """The newest run that has not ended, from GET /system/gc (newest first)."""
    response = client.request("GET", "/system/gc", what="list GC runs", params={"page": 1, "page_size": _LISTED})
    where = f"{client.url}{API}/system/gc"
    return next((run for run in read_gc_history(_json(response, where), where) if not run.finished), None)


def _start(client: HarborClient, body: dict[str, Any]) -> tuple[int, bool]:
    """The run to wait on: the one started (True), or the one already running (False)."""
    for _ in range(_STARTS):
        response = client.request("POST", "/system/gc/schedule", what="start a GC run", json=body,
                                  expect=(201,), tolerate=CONFLICT_STATUSES)
        if response.status_code == 201:
            gc_id = gc_id_from_location(response.headers.get("Location"))
            if gc_id is None:
                running = _running(client)  # no usable Location: the newest unfinished run is ours
                if running is None:
                    raise HarborError(f"Harbor started a GC run at {client.url} but names no ID and lists none running")
                gc_id = running.id
            return gc_id, True
        running = _running(client)
        if running is not None:
            return running.id, False
        # the run that conflicted ended between the two requests: ask again
    raise HarborError(f"Harbor at {client.url} keeps refusing a GC run ({response.status_code}) but lists none running")


def _log(client: HarborClient, gc_id: int, hide: Iterable[str]) -> tuple[str, ...]:
    response = client.request("GET", f"/system/gc/{gc_id}/log", what=f"read the log of GC run {gc_id}",
                              headers={"Accept": "text/plain"}, tolerate=(404,))
    if response.status_code == 404:
        return ()
    tail = response.content[-MAX_LOG_BYTES:]
    return log_summary(tail.decode("utf-8", "replace"), hide)


def run_gc(client: HarborClient, wait: GcWait, *, delete_untagged: bool = False, dry_run: bool = False,
           hide: Iterable[str] = (), on_event: Callable[[str], None] = lambda line: None) -> HarborGcResult:
    """Start Harbor's GC (or join the one running), poll it until it ends, and read its log's tail.

    HIDE: text never to show from the log (the caller's password). HarborGcTimeout when the run has
    not ended within wait.timeout_s."""
    version = client.harbor_version()
    gc_id, started = _start(client, manual_gc_request(delete_untagged=delete_untagged, dry_run=dry_run))
    on_event(f"Harbor GC run {gc_id}: {'started' if started else 'already running; waiting on it'}")
    deadline = wait.clock() + wait.timeout_s
    polls = 0
    while True:
        run = _get_run(client, gc_id)
        polls += 1
        if run.finished:
            break
        if wait.clock() >= deadline:
            raise HarborGcTimeout(f"Harbor GC run {gc_id} at {client.url} is still {run.status} after "
                                  f"{wait.timeout_s:g} s; it goes on in Harbor (GET {API}/system/gc/{gc_id})")
        wait.sleep(wait.poll_s)
    if not started and run.dry_run is not None and run.dry_run != dry_run:
        on_event(f"note: the run waited on was {'a dry run' if run.dry_run else 'not a dry run'}; sweep again "
                 f"for {'a real one' if run.dry_run else 'a dry run'}")
    return HarborGcResult(client.url, version, run, started, polls, _log(client, gc_id, hide))
