"""Posting notifications: one background thread per event and target, within the target's timeout, never raising.

A rollout must not wait on a receiver: `emit` returns at once, and `drain` (at the end of the command)
waits for what is still in flight at most until each send's deadline, its target's timeout after it
was emitted. Each send goes through oci.retry's RetryingTransport (503s, 429s and dropped connections
are tried again with its backoff) and each try gets only what is left of that timeout. A send that
fails is reported to the emitter's `on_failure` with the target's host and why: never its URL's path
(a Slack webhook's path is its secret) nor its headers.
"""
from __future__ import annotations

import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from imagebuild.config.release_file import NotifyTarget, notify_url_problem
from imagebuild.core.source import safe_text
from imagebuild.notify import events
from imagebuild.oci.retry import RetryingTransport, RetryPolicy

# (target host, event kind, why): called once per failed send, from the sending thread or from drain.
OnFailure = Callable[[str, str, str], None]
Clock = Callable[[], float]


def policy_for(target: NotifyTarget) -> RetryPolicy:
    """The target's tries: quick backoffs, every wait (a Retry-After too) within its timeout."""
    return RetryPolicy(attempts=5, base_delay_s=0.25, max_delay_s=2.0, max_elapsed_s=target.timeout_s,
                       max_retry_after_s=target.timeout_s)


def host_of(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc or "?"


@dataclass
class _Send:
    kind: str
    target: NotifyTarget
    deadline: float
    on_failure: OnFailure | None
    host: str = "?"
    last_error: str | None = None  # the last try's transport error, set by its thread
    thread: threading.Thread | None = None
    _settled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def settle(self, failure: str | None) -> None:
        """Once per send: the thread's outcome, or drain giving up on it, whichever comes first. The report is
        made under the lock, so a drain that finds the thread settling waits for its report (a local audit
        line) instead of returning before it is written."""
        with self._lock:
            if self._settled:
                return
            self._settled = True
            if failure is not None and self.on_failure is not None:
                try:
                    self.on_failure(self.host, self.kind, failure)
                except Exception:  # reporting a failed notification must not fail anything else
                    pass

    def given_up(self) -> str:
        """Why, when drain stops waiting: the timeout, and the last try's failure when there was one."""
        last = f" (last try: {self.last_error})" if self.last_error else ""
        return f"no answer within {self.target.timeout_s:g}s{last}"


class _WithinDeadline(httpx.BaseTransport):
    """Each try may take only what is left until the deadline (connect, TLS, write and read alike).
    Each try's failure is kept on the send, so a drain that gives up on it can still say what went wrong."""

    def __init__(self, inner: httpx.BaseTransport, send: _Send, clock: Clock):
        self.inner, self.send, self.clock = inner, send, clock

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        left = self.send.deadline - self.clock()
        if left <= 0:
            raise httpx.ConnectTimeout("the notification's timeout is spent", request=request)
        request.extensions["timeout"] = httpx.Timeout(left).as_dict()
        try:
            return self.inner.handle_request(request)
        except httpx.TransportError as exc:
            self.send.last_error = type(exc).__name__
            raise

    def close(self) -> None:
        self.inner.close()


class Notifier:
    """Sends each emitted event to every target that wants its kind; release.yaml's `notify:` gives the targets."""

    def __init__(self, targets: tuple[NotifyTarget, ...], *, environ: Mapping[str, str] | None = None,
                 clock: Clock = time.monotonic):
        self.targets = targets
        self._environ = environ if environ is not None else os.environ
        self._clock = clock
        self._sends: list[_Send] = []
        self._lock = threading.Lock()

    def emit(self, kind: str, source: str, subject: str, data: dict[str, Any],
             on_failure: OnFailure | None = None) -> None:
        """Start sending; returns at once and raises nothing (a thread that cannot start is a failed send)."""
        wanted = [target for target in self.targets if target.wants(kind)]
        if not wanted:
            return
        event = events.cloud_event(events.Notice(kind, source, subject, data))
        for target in wanted:
            send = _Send(kind, target, self._clock() + target.timeout_s, on_failure)
            thread = threading.Thread(target=self._deliver, args=(send, event), name=f"notify {kind}", daemon=True)
            send.thread = thread
            with self._lock:
                self._sends.append(send)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: this one event goes untold
                send.settle(f"could not start sending: {exc}")

    def drain(self) -> None:
        """Wait for the sends in flight, each at most until its deadline; one still going then is given up."""
        with self._lock:
            sends, self._sends = self._sends, []
        for send in sends:
            if send.thread is not None and send.thread.ident is not None:
                send.thread.join(max(0.0, send.deadline - self._clock()))
                if send.thread.is_alive():
                    send.settle(send.given_up())

    def _deliver(self, send: _Send, event: dict[str, Any]) -> None:
        try:
            failure = self._post(send, event)
        except Exception as exc:  # whatever goes wrong stays in this thread
            failure = f"{type(exc).__name__}"
        send.settle(failure)

    def _post(self, send: _Send, event: dict[str, Any]) -> str | None:
        """None once the target answered 2xx; else why not (no URL path, header or response body in it)."""
        target = send.target
        url = target.url or self._environ.get(target.url_env or "", "")
        if not url:
            return f"environment variable {target.url_env} (its URL) is not set"
        send.host = host_of(url)
        problem = notify_url_problem(url)
        if problem:
            return f"the URL in {target.url_env} {problem}"
        headers: dict[str, str] = {}
        for name, variable in target.headers:
            value = self._environ.get(variable)
            if not value:
                return f"header {name}: environment variable {variable} is not set"
            headers[name] = value
        content, content_type = events.body(event, target.format)
        headers["content-type"] = content_type
        verify: ssl.SSLContext | bool = True
        if target.ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=str(target.ca_file))
            except (OSError, ssl.SSLError) as exc:
                return f"ca_file {target.ca_file}: {safe_text(getattr(exc, 'strerror', None) or exc, 120)}"
        transport = RetryingTransport(_WithinDeadline(httpx.HTTPTransport(verify=verify), send, self._clock),
                                      policy_for(target))
        try:
            with httpx.Client(transport=transport, timeout=target.timeout_s) as client, \
                    client.stream("POST", url, content=content, headers=headers) as response:
                status = response.status_code  # the body is the receiver's: never read, never shown
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {safe_text(str(exc).replace(url, send.host), 200)}"
        return None if 200 <= status < 300 else f"HTTP {status}"
