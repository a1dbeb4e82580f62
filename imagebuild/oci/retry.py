"""Retrying HTTP requests: 429, 5xx and dropped connections, with backoff, jitter and Retry-After.

The one retry engine of imagebuild: the registry client and Harbor's REST client both send
through `RetryingTransport`, each with its `RetryPolicy`. A transport wrapper, so every request
of a client retries the same way (token requests, HEADs, manifest and chunk uploads). A request
whose body is a one-shot stream cannot be sent twice; it is passed through once and its caller
resumes (see oci_copy's uploads).
"""
from __future__ import annotations

import random
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime

import httpx

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
SMALL_BODY = 4 * 1024 * 1024  # manifests, configs, signatures: read in the transport and retried whole


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date; None if absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return max(0.0, (when - now).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries and `max_elapsed_s` seconds of waiting for one request."""

    attempts: int = 6
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0
    max_elapsed_s: float = 120.0
    # A Retry-After longer than this is not waited out: the request fails instead ...
    max_retry_after_s: float = 60.0
    # ... unless this is set: then it is waited max_retry_after_s and the request tried again.
    cap_retry_after: bool = False
    # Methods sent once only, whatever the answer: a registry's chunk upload (PATCH) is resumed
    # from what the registry says it holds rather than sent again.
    send_once: frozenset[str] = frozenset({"PATCH"})
    # Methods sent again after a broken connection only when it broke before the request went
    # out (NOT_SENT): one that may have reached the server may have created something (Harbor's POSTs).
    resend_unsent_only: frozenset[str] = frozenset()

    def backoff(self, retry: int, rng: Callable[[], float] = random.random) -> float:
        """Full jitter: uniform in [0, min(max, base * 2**retry)] for the retry-th retry (0-based)."""
        ceiling = min(self.max_delay_s, self.base_delay_s * (2 ** retry))
        return float(ceiling * rng())

    def delay(self, retry: int, retry_after: float | None, rng: Callable[[], float] = random.random) -> float | None:
        """How long to wait before retry number `retry`, or None when the server's wait is too long
        (with cap_retry_after: the longest wait allowed instead)."""
        if retry_after is not None:
            if retry_after <= self.max_retry_after_s:
                return retry_after
            return self.max_retry_after_s if self.cap_retry_after else None
        return self.backoff(retry, rng)


NO_RETRIES = RetryPolicy(attempts=1)
# For readers that answer someone waiting (verify, the admission webhook): a blip is retried, an
# outage is reported within about two seconds.
QUICK_RETRIES = RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0, max_elapsed_s=2.0, max_retry_after_s=2.0)


@dataclass
class RetryLog:
    """What the retries cost: counts and the waits, for reports and tests."""

    retries: int = 0
    waited_s: float = 0.0
    reasons: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, reason: str, wait: float) -> None:
        with self._lock:
            self.retries += 1
            self.waited_s += wait
            self.reasons.append(reason)


def tls_failure(exc: BaseException) -> bool:
    """A certificate the client does not trust: retrying cannot help."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# Failures that come before any of the request was sent: safe to send again, whatever it does.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def _replayable(request: httpx.Request, policy: RetryPolicy) -> bool:
    """Bodies in memory can be sent again; a registry's chunk (PATCH, in send_once) is not: its uploader
    asks the registry how much arrived and resumes, rather than resending bytes it may already hold."""
    return isinstance(request.stream, httpx.ByteStream) and request.method not in policy.send_once


class RetryingTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, policy: RetryPolicy, log: RetryLog | None = None,
                 sleep: Callable[[float], None] = time.sleep, rng: Callable[[], float] = random.random):
        self.inner, self.policy, self.log = inner, policy, log or RetryLog()
        self._sleep, self._rng = sleep, rng

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        started = time.monotonic()
        retry = 0
        while True:
            last_try = retry + 1 >= self.policy.attempts or not _replayable(request, self.policy)
            try:
                response = self.inner.handle_request(request)
                if response.status_code not in RETRY_STATUSES:
                    return self._read_small(request, response, last_try)
            except httpx.TransportError as exc:  # no answer, or a body cut short
                if last_try or tls_failure(exc) or isinstance(exc, httpx.UnsupportedProtocol):
                    raise
                if request.method in self.policy.resend_unsent_only and not isinstance(exc, NOT_SENT):
                    raise
                wait = self.policy.delay(retry, None, self._rng)
                assert wait is not None  # without a Retry-After there is always a backoff
                if time.monotonic() - started + wait > self.policy.max_elapsed_s:
                    raise
                self._pause(request, exc.__class__.__name__, wait)
                retry += 1
                continue
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            delay = None if last_try else self.policy.delay(retry, retry_after, self._rng)
            if delay is None or time.monotonic() - started + delay > self.policy.max_elapsed_s:
                return response
            response.read()
            response.close()
            self._pause(request, f"HTTP {response.status_code}", delay)
            retry += 1

    def _pause(self, request: httpx.Request, reason: str, wait: float) -> None:
        self.log.record(f"{request.method} {request.url.path}: {reason}", wait)
        self._sleep(wait)

    @staticmethod
    def _read_small(request: httpx.Request, response: httpx.Response, last_try: bool) -> httpx.Response:
        """Read a small GET body here, so a body cut short is retried like any dropped connection.
        Large bodies (blobs) stay streamed: the copier resumes those with Range requests."""
        length = response.headers.get("content-length")
        if request.method == "GET" and not last_try and length is not None and int(length) <= SMALL_BODY:
            response.read()
        return response

    def close(self) -> None:
        self.inner.close()
