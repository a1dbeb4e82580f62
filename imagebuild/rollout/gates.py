"""The gates a rollout wave waits on: `evaluate(spec, ctx)` runs one check and says PASSED, FAILED or WAITING.

The reconciler (rollout) calls `evaluate` for every gate of a wave and region until all have
PASSED: on WAITING it asks again after `retry_in_s`; on FAILED it halts the rollout. A FAILED
that carries a `retry_in_s` means "could not reach the service" (registry, Prometheus, health
endpoint, Docker): the reconciler may retry it a few times before it halts on it (`transient`).

Every check is bounded (short timeouts) and never raises for a network error; details are one
line, name the region, and never carry credentials (a URL's userinfo is redacted).

Prometheus and `for`: the gate is stateless (one call, no memory of the previous one), so
`for: 10s` is answered from Prometheus itself with a range query over the last `for` seconds
since the tags moved, one point per step: PASSED once every point of a window `for` long holds
the threshold; FAILED as soon as any point since the move breaks it (a canary that spiked and
recovered still failed); WAITING while the window is shorter than `for` (moved recently, or the
series appeared late), with "held 4s of 10s". Without `for`, one instant query decides.
No series at all: WAITING for up to `for` + NO_DATA_GRACE_S after the move, then FAILED (a gate
that never sees data must not pass, nor wait forever). NaN values count as no data (0/0 ratios
when no jobs ran). Thresholds are inclusive: `max: 0.05` passes 0.05.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import httpx

from imagebuild.config.release_file import (
    ApprovalGate,
    GateSpec,
    HttpGate,
    PrometheusGate,
    Region,
    SignatureGate,
    SmokeGate,
    SoakGate,
)
from imagebuild.config.trust import TrustConfig
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.report import SmokeStage, StageStatus
from imagebuild.core.runner import ToolMissing
from imagebuild.core.source import InputError
from imagebuild.oci import names, reference
from imagebuild.trust.verify import Verifier

# How long a network gate may take, and when to ask again.
PROMETHEUS_TIMEOUT_S = 5.0
SIGNATURE_TIMEOUT_S = 10.0
SMOKE_TIMEOUT_S = 900.0
UNREACHABLE_RETRY_S = 5.0
POLL_S = 5.0  # WAITING on data or an approval
NO_DATA_GRACE_S = 300.0
MAX_RANGE_POINTS = 250  # points per series in a `for` window (Prometheus refuses over 11000)
MAX_RESPONSE_BYTES = 4 << 20

# A region name goes into PromQL label matchers and URLs: only names of the release file's rule are substituted.
REGION_NAME = names.NAME
PLACEHOLDER = "{region}"


class GateOutcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    WAITING = "waiting"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GateResult:
    gate: str  # soak, signature, smoke, prometheus, http, approval
    region: str | None  # None for a wave-wide gate (approval)
    outcome: GateOutcome
    detail: str  # one line, no secrets
    checked_at: str  # ISO 8601 UTC: ctx.now plus the time the check took
    retry_in_s: float | None = None  # WAITING: ask again then; FAILED: the service was unreachable

    @property
    def transient(self) -> bool:
        """A FAILED that says "could not reach it" rather than "it is bad": worth a few retries."""
        return self.outcome is GateOutcome.FAILED and self.retry_in_s is not None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome.value}


@dataclass(frozen=True)
class GateContext:
    wave: str
    region: Region
    image: str  # region registry/repository@digest
    digest: str
    channels: tuple[str, ...]
    moved_at: float  # epoch seconds when this wave's tags moved
    approvals: tuple[str, ...]  # the waves approved so far
    trust: TrustConfig
    now: float
    rollout_id: str | None = None  # for the approval hint
    workdir: Path | None = None  # smoke gate's JUnit and logs (default .imagebuild/rollout)


def gate_name(spec: GateSpec) -> str:
    """The release.yaml key of the gate (soak, signature, ...)."""
    try:
        return spec.kind
    except KeyError:
        return type(spec).__name__


def evaluate(spec: GateSpec, ctx: GateContext) -> GateResult:
    """One check of one gate for one region; bounded by the gate's timeout, never raises for I/O."""
    handler = _HANDLERS.get(type(spec))
    if handler is None:
        return _result(spec, ctx, GateOutcome.FAILED, f"unknown gate {type(spec).__name__}")
    started = time.monotonic()
    outcome, detail, retry = handler(spec, ctx)
    region = None if isinstance(spec, ApprovalGate) else ctx.region.name
    return GateResult(gate=gate_name(spec), region=region, outcome=outcome, detail=detail,
                      checked_at=iso_time(ctx.now + (time.monotonic() - started)), retry_in_s=retry)


def _result(spec: GateSpec, ctx: GateContext, outcome: GateOutcome, detail: str) -> GateResult:
    return GateResult(gate_name(spec), ctx.region.name, outcome, detail, iso_time(ctx.now))


Check = tuple[GateOutcome, str, float | None]


# --- pure helpers ------------------------------------------------------------------------------


def iso_time(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def seconds_text(seconds: float) -> str:
    return f"{max(0.0, seconds):.0f}s"


def substitute_region(template: str, region: str, *, in_url: bool = False) -> str:
    """`{region}` replaced by a validated region name; nothing else in the template is touched
    (PromQL's own braces stay). ValueError for a name that could break out of a label matcher."""
    if not REGION_NAME.fullmatch(region):
        raise ValueError(f"region name '{region[:64]}' is not lowercase letters, digits and dashes")
    value = urllib.parse.quote(region, safe="") if in_url else region
    return template.replace(PLACEHOLDER, value)


def redact_url(url: str) -> str:
    """The URL with any user:password@ replaced, for details and logs."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"***@{host}"))


def redact(text: str, url: str) -> str:
    """Text (an exception message) with the URL's userinfo removed wherever it appears."""
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        text = text.replace(url, redact_url(url)).replace(userinfo, "***")
        for secret in (parts.username, parts.password):
            if secret and len(secret) >= 3:
                text = text.replace(secret, "***")
    return text


def format_value(value: float) -> str:
    return f"{value:.6g}"


def format_series(labels: Mapping[str, str]) -> str:
    name = labels.get("__name__", "")
    rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest or not name else name


# --- Prometheus answers (pure) ----------------------------------------------------------------


class PrometheusAnswerError(ImagebuildError, ValueError):
    """The body is not a Prometheus API answer we can judge (or an error answer)."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: tuple[tuple[float, float], ...]  # (epoch seconds, value), NaN kept


def _number(text: Any) -> float:
    # Prometheus sends sample values as strings: "0.01", "NaN", "+Inf", "-Inf".
    if not isinstance(text, str):
        raise PrometheusAnswerError(f"sample value {str(text)[:40]!r} is not a string")
    try:
        return float(text)
    except ValueError:
        raise PrometheusAnswerError(f"sample value {text[:40]!r} is not a number") from None


def _point(pair: Any) -> tuple[float, float]:
    if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], (int, float)):
        raise PrometheusAnswerError("a sample is not [timestamp, \"value\"]")
    return float(pair[0]), _number(pair[1])


def _labels(metric: Any) -> dict[str, str]:
    if not isinstance(metric, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items()):
        raise PrometheusAnswerError("a series' labels are not a string map")
    return dict(metric)


def parse_answer(body: Any) -> list[Series]:
    """A /api/v1/query or /api/v1/query_range answer as series (a scalar is one unlabelled series)."""
    if not isinstance(body, dict):
        raise PrometheusAnswerError("the answer is not a JSON object")
    if body.get("status") != "success":
        kind, error = body.get("errorType", "error"), body.get("error", "no error message")
        raise PrometheusAnswerError(f"{str(kind)[:40]}: {str(error)[:300]}")
    data = body.get("data")
    if not isinstance(data, dict):
        raise PrometheusAnswerError("the answer has no data object")
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [Series({}, (_point(result),))]
    if kind == "vector" and isinstance(result, list):
        out = []
        for item in result:
            if not isinstance(item, dict):
                raise PrometheusAnswerError("a vector element is not an object")
            out.append(Series(_labels(item.get("metric", {})), (_point(item.get("value")),)))
        return out
    if kind == "matrix" and isinstance(result, list):
        out = []
        for item in result:
            if not isinstance(item, dict) or not isinstance(item.get("values"), list):
                raise PrometheusAnswerError("a matrix element has no values list")
            out.append(Series(_labels(item.get("metric", {})), tuple(_point(p) for p in item["values"])))
        return out
    if kind == "string":
        raise PrometheusAnswerError("the query returns a string, not a number")
    raise PrometheusAnswerError(f"unexpected resultType {str(kind)[:40]!r}")


def breaks_threshold(value: float, maximum: float | None, minimum: float | None) -> bool:
    return (maximum is not None and value > maximum) or (minimum is not None and value < minimum)


def threshold_text(maximum: float | None, minimum: float | None) -> str:
    parts = []
    if maximum is not None:
        parts.append(f"max {format_value(maximum)}")
    if minimum is not None:
        parts.append(f"min {format_value(minimum)}")
    return ", ".join(parts) or "no threshold"


@dataclass(frozen=True)
class Window:
    """The points a `for` check asks for: start, start+step, ... up to end."""

    start: float
    end: float
    step: float

    @classmethod
    def for_check(cls, now: float, moved_at: float, for_seconds: float) -> Window:
        start = min(now, max(moved_at, now - for_seconds))
        step = max(1.0, math.ceil(for_seconds / MAX_RANGE_POINTS))
        return cls(round(start, 3), round(now, 3), float(step))

    @property
    def count(self) -> int:
        return int((self.end - self.start) // self.step) + 1

    def index(self, at: float) -> int:
        return round((at - self.start) / self.step)


def judge(series: list[Series], spec: PrometheusGate, window: Window | None, since_move_s: float) -> Check:
    """PASSED / FAILED / WAITING from the series a query gave (see the module docstring)."""
    limits = threshold_text(spec.max, spec.min)
    points = [(at, value, s.labels) for s in series for at, value in s.points if not math.isnan(value)]
    breaches = [p for p in points if breaks_threshold(p[1], spec.max, spec.min)]
    if breaches:
        at, value, labels = max(breaches, key=lambda p: _distance(p[1], spec))
        return (GateOutcome.FAILED, f"{format_series(labels)} = {format_value(value)} at {iso_time(at)} "
                                    f"breaks {limits}", None)
    if not points:
        deadline = spec.for_seconds + NO_DATA_GRACE_S
        if since_move_s >= deadline:
            return (GateOutcome.FAILED, f"no data for the query {seconds_text(since_move_s)} after the tags moved "
                                        f"(waited {seconds_text(deadline)})", None)
        return GateOutcome.WAITING, f"no data for the query yet (fails {seconds_text(deadline)} after the move)", POLL_S
    # Shown: the newest point of each series, the one nearest its threshold.
    newest: dict[tuple[tuple[str, str], ...], tuple[float, float, dict[str, str]]] = {}
    for at, value, labels in points:
        key = tuple(sorted(labels.items()))
        if key not in newest or at >= newest[key][0]:
            newest[key] = (at, value, labels)
    _, value, labels = max(newest.values(), key=lambda p: _distance(p[1], spec))
    shown = f"{format_series(labels)} = {format_value(value)}"
    if window is None:
        return GateOutcome.PASSED, f"{shown} within {limits}", None
    # The run of consecutive points that ends at the window's last point.
    present = {window.index(at) for at, _, _ in points}
    last = window.count - 1
    if last not in present:
        return GateOutcome.WAITING, f"no data at the latest point; earlier {shown} within {limits}", POLL_S
    first = last
    while first - 1 in present:
        first -= 1
    held = window.end - (window.start + first * window.step)
    if first == 0 and since_move_s >= spec.for_seconds:
        return GateOutcome.PASSED, f"{shown} within {limits} for {seconds_text(spec.for_seconds)}", None
    retry = min(POLL_S, max(1.0, spec.for_seconds - held))
    return (GateOutcome.WAITING, f"{shown} within {limits}, held {seconds_text(held)} of "
                                 f"{seconds_text(spec.for_seconds)}", retry)


def _distance(value: float, spec: PrometheusGate) -> float:
    """How close to (negative) or past (positive) the threshold a value is; the largest is shown."""
    candidates = []
    if spec.max is not None:
        candidates.append(value - spec.max)
    if spec.min is not None:
        candidates.append(spec.min - value)
    return max(candidates) if candidates else value


# --- the gates ----------------------------------------------------------------------------------


def _soak(spec: SoakGate, ctx: GateContext) -> Check:
    elapsed = ctx.now - ctx.moved_at
    progress = f"soak {seconds_text(elapsed)} of {seconds_text(spec.seconds)}"
    if elapsed >= spec.seconds:
        return GateOutcome.PASSED, progress, None
    return GateOutcome.WAITING, progress, max(0.5, min(spec.seconds - elapsed, 30.0))


def _approval(spec: ApprovalGate, ctx: GateContext) -> Check:
    if ctx.wave in ctx.approvals:
        return GateOutcome.PASSED, f"wave {ctx.wave} approved", None
    hint = f"imagebuild rollout approve {ctx.rollout_id or 'ID'} --wave {ctx.wave}"
    return GateOutcome.WAITING, f"waiting for `{hint}`", POLL_S


def _unreachable(what: str, ctx: GateContext, exc: BaseException, url: str = "") -> Check:
    untrusted = _certificate_error(exc)
    if untrusted is not None:  # retrying will not make the certificate trusted
        return (GateOutcome.FAILED, f"region {ctx.region.name}: {what}: TLS certificate not trusted by the "
                                    f"system CA store ({untrusted.verify_message or untrusted.reason})", None)
    reason = redact(_exception_text(exc), url) if url else _exception_text(exc)
    return GateOutcome.FAILED, f"region {ctx.region.name}: {what} unreachable: {reason}", UNREACHABLE_RETRY_S


def _certificate_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLCertVerificationError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _exception_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def _client(timeout_s: float) -> httpx.Client:
    # The system's CA store (not certifi's): sites add their internal CAs there.
    return httpx.Client(timeout=timeout_s, verify=ssl.create_default_context(), follow_redirects=False)


def _get_json(client: httpx.Client, url: str, params: Mapping[str, str]) -> tuple[int, Any]:
    """Status and parsed JSON body (None when not JSON), reading at most MAX_RESPONSE_BYTES."""
    with client.stream("GET", url, params=params) as response:
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise PrometheusAnswerError(f"the answer is over {MAX_RESPONSE_BYTES >> 20} MiB")
            chunks.append(chunk)
        try:
            return response.status_code, json.loads(b"".join(chunks))
        except ValueError:
            return response.status_code, None


def _prometheus(spec: PrometheusGate, ctx: GateContext) -> Check:
    try:
        query = substitute_region(spec.query, ctx.region.name)
        base = substitute_region(spec.url, ctx.region.name, in_url=True).rstrip("/")
    except ValueError as exc:
        return GateOutcome.FAILED, f"prometheus: {exc}", None
    shown = redact_url(base)
    window = Window.for_check(ctx.now, ctx.moved_at, spec.for_seconds) if spec.for_seconds > 0 else None
    if window is None:
        endpoint, params = "/api/v1/query", {"query": query, "time": f"{ctx.now:.3f}"}
    else:
        endpoint, params = "/api/v1/query_range", {"query": query, "start": f"{window.start:.3f}",
                                                   "end": f"{window.end:.3f}", "step": f"{window.step:g}"}
    params["timeout"] = f"{PROMETHEUS_TIMEOUT_S:g}s"
    try:
        with _client(PROMETHEUS_TIMEOUT_S) as client:
            status, body = _get_json(client, base + endpoint, params)
    except httpx.HTTPError as exc:
        return _unreachable(f"prometheus {shown}", ctx, exc, base)
    except PrometheusAnswerError as exc:
        return GateOutcome.FAILED, f"prometheus {shown}: {exc}", None
    if status >= 500 and not (isinstance(body, dict) and body.get("errorType") == "execution"):
        return (GateOutcome.FAILED, f"region {ctx.region.name}: prometheus {shown} unreachable: "
                                    f"HTTP {status}", UNREACHABLE_RETRY_S)
    try:
        series = parse_answer(body)
    except PrometheusAnswerError as exc:
        return GateOutcome.FAILED, f"prometheus {shown} (HTTP {status}) for {query!r}: {exc}", None
    outcome, detail, retry = judge(series, spec, window, ctx.now - ctx.moved_at)
    return outcome, f"{query}: {detail}", retry


def _http(spec: HttpGate, ctx: GateContext) -> Check:
    try:
        url = substitute_region(spec.url, ctx.region.name, in_url=True)
    except ValueError as exc:
        return GateOutcome.FAILED, f"http: {exc}", None
    shown = redact_url(url)
    try:
        with _client(spec.timeout_s) as client, client.stream("GET", url) as response:
            status = response.status_code
    except httpx.HTTPError as exc:
        return _unreachable(f"GET {shown}", ctx, exc, url)
    if status == spec.expect_status:
        return GateOutcome.PASSED, f"GET {shown}: {status}", None
    return GateOutcome.FAILED, f"GET {shown}: {status} (expected {spec.expect_status})", None


def _signature(spec: SignatureGate, ctx: GateContext) -> Check:

    try:
        verifier = Verifier(ctx.trust, cache_ttl_seconds=0, timeout_s=SIGNATURE_TIMEOUT_S)
    except InputError as exc:
        return GateOutcome.FAILED, f"trust config: {exc}", None
    try:
        with verifier:
            verdict = verifier.verify(ctx.image)
    except Exception as exc:  # a verifier bug or an odd registry answer must halt, not crash, the rollout
        return GateOutcome.FAILED, f"region {ctx.region.name}: verification error: {_exception_text(exc)}", None
    where = f"region {ctx.region.name} ({ctx.region.registry})"
    if verdict.unreachable:
        return GateOutcome.FAILED, f"{where}: {verdict.reason}", UNREACHABLE_RETRY_S
    if not verdict.allowed:
        return GateOutcome.FAILED, f"{where}: {verdict.reason}", None
    if verdict.digest != ctx.digest:
        return GateOutcome.FAILED, f"{where}: verified {verdict.digest}, not the rollout's {ctx.digest}", None
    return GateOutcome.PASSED, f"{where}: {verdict.reason}", None


# Smoke runs that passed in this process, by (image, tier): the reconciler asks every gate of a wave
# again while any one is WAITING, and a passed smoke run (minutes) need not be repeated for that.
_SMOKE_PASSED: dict[tuple[str, str], str] = {}
_SMOKE_LOCK = threading.Lock()


def _smoke(spec: SmokeGate, ctx: GateContext) -> Check:
    with _SMOKE_LOCK:
        passed = _SMOKE_PASSED.get((ctx.image, spec.tier))
    if passed is not None:
        return GateOutcome.PASSED, passed, None
    outcome, detail, retry = _run_smoke(spec, ctx)
    if outcome is GateOutcome.PASSED:
        with _SMOKE_LOCK:
            _SMOKE_PASSED[(ctx.image, spec.tier)] = detail
    return outcome, detail, retry


def _run_smoke(spec: SmokeGate, ctx: GateContext) -> Check:
    import docker.errors
    import requests

    from imagebuild.checks import smoke_run

    where = f"region {ctx.region.name}"
    try:
        parts = reference.split(ctx.image)
    except reference.ReferenceError as exc:
        return GateOutcome.FAILED, f"{where}: {exc}", None
    if parts.digest is None:
        return GateOutcome.FAILED, f"{where}: smoke needs a digest reference, got {ctx.image}", None
    workdir = (ctx.workdir or Path(".imagebuild/rollout")) / "smoke"
    try:
        client = smoke_run.docker_client()
    except ToolMissing as exc:
        return GateOutcome.FAILED, f"{where}: {exc}", UNREACHABLE_RETRY_S
    try:
        options = smoke_run.RunOptions(timeout_s=SMOKE_TIMEOUT_S, tier=spec.tier,
                                       cpus=min(4.0, float(os.cpu_count() or 1)))
        harness = smoke_run.ensure_harness(workdir / ".harness")
        out = workdir / re.sub(r"[^a-z0-9-]", "_", ctx.region.name)
        runner = smoke_run.SmokeRunner(client, options, out, harness)
        # Always from the region's registry, even when the engine has the image: the gate proves
        # the region serves it (layers the engine has are not downloaded again).
        runner.pull_from_registry(ctx.image)
        results = smoke_run.run_images((ctx.image,), None, lambda: runner)
    except ToolMissing as exc:  # pytest for the containers could not be installed
        return GateOutcome.FAILED, f"{where}: {exc}", UNREACHABLE_RETRY_S
    except docker.errors.NotFound as exc:
        return GateOutcome.FAILED, f"{where}: {ctx.image} not found: {_docker_text(exc)}", None
    except (docker.errors.DockerException, requests.RequestException) as exc:
        return GateOutcome.FAILED, f"{where}: cannot pull {ctx.image}: {_docker_text(exc)}", UNREACHABLE_RETRY_S
    finally:
        client.close()
    return smoke_check(results[0].record, where, spec.tier)


def smoke_check(record: SmokeStage, where: str, tier: str) -> Check:
    """A smoke run's record as a gate answer: the failing tests by name."""
    counts = f"{record.passed} passed, {record.failed + record.errors} failed, {record.skipped} skipped; tier {tier}"
    if record.status == StageStatus.PASSED:
        return GateOutcome.PASSED, f"{where}: smoke {counts}", None
    failing = [f["test"] for f in record.failures]
    if failing:
        shown = ", ".join(failing[:5]) + (f" and {len(failing) - 5} more" if len(failing) > 5 else "")
        return GateOutcome.FAILED, f"{where}: smoke tests failed: {shown} ({counts})", None
    return GateOutcome.FAILED, f"{where}: smoke {record.status}: {record.reason or 'no reason recorded'}", None


def _docker_text(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc).strip().splitlines()[0][:300] if str(explanation or exc).strip() else type(exc).__name__


_HANDLERS: dict[type, Callable[[Any, GateContext], Check]] = {
    SoakGate: _soak, SignatureGate: _signature, SmokeGate: _smoke,
    PrometheusGate: _prometheus, HttpGate: _http, ApprovalGate: _approval,
}
