"""The admission webhook's HTTPS server: POST /validate, GET /healthz and /readyz.

Standard library only: a threading HTTP server whose connections are wrapped in TLS (1.2 or
later) in their own thread, so a client that stalls in the handshake holds up nobody else.
Every connection has a socket timeout and every body a deadline; at most `max_connections`
are served at once (the rest are closed at once). One Verifier serves every request, so its
by-digest cache is shared; the distinct images of one request are verified in parallel.
Decisions go to stderr as one JSON line each; the request body never does (Pod specs carry
environment values).
"""
from __future__ import annotations

import json
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

from . import admission
from .admission import Policy, Verdict


@dataclass(frozen=True)
class ErrorVerdict:
    """The verdict on an image whose verification raised: refused, whatever the failure policy."""

    image: str
    reason: str
    digest: str | None = None
    allowed: bool = False
    unreachable: bool = False


@dataclass(frozen=True)
class ServerSettings:
    host: str = "0.0.0.0"
    port: int = 8443
    read_timeout_s: float = 10.0  # each socket read and write, the TLS handshake included
    body_deadline_s: float = 15.0  # the whole body; the API server gives a webhook 10 s by default
    max_connections: int = 64
    verify_workers: int = 8


class DecisionLog:
    """One JSON object per line, written whole under a lock so that threads do not interleave."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
        line = json.dumps(record, ensure_ascii=True, default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()


class ParallelVerifier:
    """verify(image) for each distinct image of a request, a few at a time; an exception refuses that image."""

    def __init__(self, verify: Callable[[str], Verdict], workers: int) -> None:
        self._verify = verify
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")

    def __call__(self, images: Sequence[str]) -> Mapping[str, Verdict]:
        return dict(zip(images, self._pool.map(self._one, images)))

    def _one(self, image: str) -> Verdict:
        try:
            return self._verify(image)
        except Exception as err:  # noqa: BLE001 -- a verifier bug refuses the image, it does not kill the request
            return ErrorVerdict(image, f"verification failed: {type(err).__name__}: {str(err)[:200]}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return context


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close waits for the requests in flight (a graceful SIGTERM)
    block_on_close = True
    request_queue_size = 128

    def __init__(self, settings: ServerSettings, context: ssl.SSLContext, verify: ParallelVerifier,
                 policy: Policy, log: DecisionLog) -> None:
        self.settings = settings
        self.context = context
        self.verify = verify
        self.policy = policy
        self.log = log
        self.ready = threading.Event()
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        # Open connections, and whether each is in the middle of a request: on SIGTERM the idle
        # keep-alive ones are closed at once, the busy ones once they have answered.
        self._connections: dict[ssl.SSLSocket, bool] = {}
        self._connections_lock = threading.Lock()
        self.stopping = False
        self.address_family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
        super().__init__((settings.host, settings.port), WebhookHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.log.write("connection_refused", client=client_address[0], error="too many connections")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """TLS handshake here, in the connection's own thread, under the read timeout."""
        request.settimeout(self.settings.read_timeout_s)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as err:
            self.log.write("tls_error", client=client_address[0], error=str(err)[:200])
            return
        with self._connections_lock:
            self._connections[tls] = False
        try:
            handler = WebhookHandler(tls, client_address, self)
            if handler.unread_body:
                _linger(tls)
        finally:
            with self._connections_lock:
                self._connections.pop(tls, None)
            try:
                tls.close()
            except OSError:
                pass

    def set_busy(self, tls: ssl.SSLSocket, busy: bool) -> bool:
        """Mark a connection busy or idle; returns whether the server is stopping."""
        with self._connections_lock:
            if tls in self._connections:
                self._connections[tls] = busy
            return self.stopping

    def close_idle_connections(self) -> None:
        """Stop: from now on every connection closes after its answer; the idle ones close now."""
        with self._connections_lock:
            self.stopping = True
            idle = [tls for tls, busy in self._connections.items() if not busy]
        for tls in idle:
            try:
                tls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        self.log.write("connection_error", client=client_address[0] if client_address else None,
                       error=f"{type(exc).__name__}: {str(exc)[:200]}")


class WebhookHandler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"  # keep-alive: the API server reuses its connections
    server_version = "imagebuild-admission"
    sys_version = ""
    unread_body = False  # answered before its body was read: the connection closes after a linger

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.settings.read_timeout_s)

    def parse_request(self) -> bool:
        """The request line has arrived: this connection is busy until its answer is sent."""
        self.server.set_busy(self.connection, True)
        return super().parse_request()

    def handle_one_request(self) -> None:
        super().handle_one_request()
        if self.server.set_busy(self.connection, False):
            self.close_connection = True

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, b"ok\n", "text/plain")
        elif self.path == "/readyz":
            ready = self.server.ready.is_set()
            self._send(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                       b"ok\n" if ready else b"shutting down\n", "text/plain")
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/validate":
            self.close_connection = self.unread_body = True
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        started = time.monotonic()
        body = self._body()
        if body is None:
            return
        outcome = admission.review(body, self.server.verify, self.server.policy)
        self.server.log.write("decision", **outcome.log, duration_ms=round((time.monotonic() - started) * 1000, 1))
        self._send(HTTPStatus(outcome.http_status), json.dumps(outcome.body).encode(), "application/json")

    def _body(self) -> bytes | None:
        """The body, read within the deadline and the size cap; None when it was refused (answered already)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = self.unread_body = True
            self._refuse(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required")
            return None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = self.unread_body = True
            self._refuse(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required")
            return None
        limit = admission.LIMITS.max_body_bytes
        if length > limit:
            self.close_connection = self.unread_body = True  # this connection cannot carry another request
            self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes, more than {limit}")
            return None
        deadline = time.monotonic() + self.server.settings.body_deadline_s
        chunks: list[bytes] = []
        remaining = length
        while remaining:
            if time.monotonic() > deadline:
                self.close_connection = self.unread_body = True
                self._refuse(HTTPStatus.REQUEST_TIMEOUT, "the body took too long")
                return None
            chunk = self.rfile.read1(min(remaining, 65536))
            if not chunk:
                self.close_connection = True
                return None  # the client went away
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def _refuse(self, status: HTTPStatus, message: str) -> None:
        self.server.log.write("request_refused", client=self.client_address[0], status=int(status), error=message)
        self._send(status, json.dumps({"error": f"imagebuild: {message}"}).encode(), "application/json")

    def _send(self, status: HTTPStatus, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a bad request line, headers too long): JSON, and logged like ours."""
        self.close_connection = True
        self._refuse(HTTPStatus(code), message or HTTPStatus(code).phrase)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- http.server's signature
        """Access lines would repeat the decision log; http.server's errors go through send_error."""


def serve(settings: ServerSettings, context: ssl.SSLContext, verify: Callable[[str], Verdict], policy: Policy,
          log: DecisionLog, on_ready: Callable[[WebhookServer], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; then stop being ready, finish the requests in flight, and return."""
    verifier = ParallelVerifier(verify, settings.verify_workers)
    server = WebhookServer(settings, context, verifier, policy, log)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.write("stopping", signal=signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    loop = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="serve")
    try:
        loop.start()
        server.ready.set()
        host, port = server.server_address[:2]
        log.write("serving", address=f"https://{_host(str(host))}:{port}", mode="enforce" if policy.enforce else "warn",
                  failure_policy="fail" if policy.fail_closed else "ignore")
        if on_ready is not None:
            on_ready(server)
        while not stop.wait(0.5):
            pass
    finally:
        server.ready.clear()
        server.shutdown()
        server.close_idle_connections()
        loop.join()
        server.server_close()  # waits for the requests in flight
        verifier.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        log.write("stopped")


def _linger(tls: ssl.SSLSocket, seconds: float = 2.0, limit: int = 8 << 20) -> None:
    """Close gently a connection whose body was left unread: closing it at once would reset it, and the
    client could lose the answer (413, 411) before reading it. Stop writing, read what is left, briefly."""
    deadline = time.monotonic() + seconds
    try:
        tls.shutdown(socket.SHUT_WR)
        tls.settimeout(0.5)
        while limit > 0 and time.monotonic() < deadline:
            chunk = tls.recv(65536)
            if not chunk:
                return
            limit -= len(chunk)
    except (OSError, ValueError):
        pass


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
