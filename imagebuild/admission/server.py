"""The admission webhook's HTTPS server: POST /validate and /mutate, GET /healthz, /readyz and /metrics.

One asyncio loop serves every connection, HTTP/1.1 parsed by h11 and TLS (1.2 or later) done by
the standard library's ssl over memory buffers, so an idle or slow connection is a suspended
coroutine of a few tens of KB, not a thread or a slot of a small pool. (asyncio's own TLS
transport would do, but it allocates a 256 KiB read buffer per connection: a thousand slow
clients would cost 256 MB.) What a client on the cluster network could hold is bounded:

- one deadline for the whole request: TLS handshake (the first request), request line, headers
  and body all arrive within `request_deadline_s`, however slowly the bytes trickle in;
- connections per client address (an IPv6 client by its /64) and in total; a new connection
  first displaces the oldest idle keep-alive one, of that client or of anyone, and only when none
  is idle is it refused;
- bodies: a Content-Length is required (411), at most 3 MiB (413), and all bodies held at once
  share a byte budget; reviews run in a small thread pool, each image verified in another, except
  a small one whose verdicts are all in the cache: it is answered on the loop (no network, no hand-off).

The API server's connections are kept alive between requests (`idle_timeout_s`, longer than
the Go client's 90 s, so that the client closes an idle connection first). One Verifier serves
every request, so its by-digest cache is shared. Decisions go to stderr as one JSON line each
(never the request body: Pod specs carry environment values); connection-level events are
rate-limited per client, so a flood cannot flood the log. SIGTERM: not ready, stop accepting,
close idle connections, finish the requests in flight (within `drain_timeout_s`), exit.

The serving certificate and key are read again when their files change (`ServingCertificate`):
Kubernetes updates a mounted Secret by swapping a `..data` link, cert-manager rotates the pair. A
new connection gets the newest pair that loads; a connection already open keeps the pair it
began with, finishes the request it is on and is then closed, so its client reconnects to the new
one. A pair that does not load (half written, key and certificate apart) is ignored, once, with one
log line, until the files change again.
"""
from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import signal
import ssl
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, TextIO, TypeVar

import h11
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from imagebuild.admission import review as admission
from imagebuild.admission.metrics import CONTENT_TYPE, WebhookMetrics
from imagebuild.admission.review import Policy, Verdict
from imagebuild.core.errors import ImagebuildError

T = TypeVar("T")
Cached = Callable[[str], "Verdict | None"]  # the verdict verify(image) would give, when it needs no network
REVIEW_PATHS = {"/validate": False, "/mutate": True}  # path -> pin (the mutating answer)


class _NotCached(ImagebuildError):
    """A review needs a verdict that is not in the cache: it goes to a worker thread (never leaves the server)."""


INLINE_BODY_BYTES = 64 << 10  # larger bodies are parsed in a worker thread, never on the event loop


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
    request_deadline_s: float = 10.0  # handshake + request line + headers + body; the API server waits 10 s
    idle_timeout_s: float = 120.0  # a keep-alive connection between requests
    write_timeout_s: float = 10.0  # sending one answer
    max_connections: int = 1024
    max_connections_per_client: int = 128  # the API server opens several; an attacker's pod is one address
    review_workers: int = 4  # requests parsed and decided at once (a parsed 3 MiB body is tens of MB)
    verify_workers: int = 8  # images verified at once, across requests
    body_budget_bytes: int = 24 << 20  # request bodies held in memory at once, all connections together
    drain_timeout_s: float = 25.0  # SIGTERM: how long requests in flight may take (Kubernetes grants 30 s)
    max_header_bytes: int = 16 << 10
    linger_s: float = 2.0  # reading what is left of a refused body, so that the client reads our answer


class DecisionLog:
    """One JSON object per line, written whole under a lock so that threads do not interleave."""

    def __init__(self, stream: TextIO = sys.stderr, quiet_s: float = 10.0) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._quiet_s = quiet_s
        self._last: dict[tuple[str, str], list[float]] = {}  # (event, client) -> [last written, suppressed]

    def write(self, event: str, **fields: Any) -> None:
        record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
        line = json.dumps(record, ensure_ascii=True, default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def limited(self, event: str, client: str, **fields: Any) -> None:
        """A connection-level event: at most one line per event and client every `quiet_s`, counting the rest."""
        now = time.monotonic()
        with self._lock:
            if len(self._last) > 10000:
                self._last.clear()
            last = self._last.setdefault((event, client), [-self._quiet_s, 0])
            if now - last[0] < self._quiet_s:
                last[1] += 1
                return
            suppressed, last[0], last[1] = int(last[1]), now, 0
        self.write(event, client=client, **fields, **({"suppressed": suppressed} if suppressed else {}))


class ParallelVerifier:
    """verify(image) for each distinct image of a request, a few at a time; an exception refuses that image."""

    def __init__(self, verify: Callable[[str], Verdict], workers: int, metrics: WebhookMetrics | None = None) -> None:
        self._verify = verify
        self._metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")

    def __call__(self, images: Sequence[str]) -> Mapping[str, Verdict]:
        if len(images) == 1:  # most Pods: no hand-off to another thread (a warm verdict takes microseconds)
            return {images[0]: self._one(images[0])}
        return dict(zip(images, self._pool.map(self._one, images)))

    def _one(self, image: str) -> Verdict:
        try:
            verdict = self._verify(image)
        except Exception as err:  # noqa: BLE001 -- a verifier bug refuses the image, it does not kill the request
            verdict = ErrorVerdict(image, f"verification failed: {type(err).__name__}: {str(err)[:200]}")
        if verdict.unreachable and self._metrics is not None:  # the registry did not answer, or not readably
            self._metrics.registry_errors.inc()
        return verdict

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def tls_context(cert: Path | str, key: Path | str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))  # refuses a key that is not the certificate's
    context.set_alpn_protocols(["http/1.1"])  # the API server offers h2 too; we speak HTTP/1.1
    return context


FileStamp = tuple[str, int, int, int, int]  # resolved path, device, inode, size, mtime in ns


def _stamp(path: Path) -> FileStamp | None:
    """What changes when a file is replaced or rewritten: where its links lead, and its stat."""
    try:
        resolved = path.resolve()
        info = resolved.stat()
    except OSError:
        return None
    return str(resolved), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class ServingCertificate:
    """The webhook's certificate and key, and the TLS context made of them, read again when the files change.

    `current()` is asked on each accepted connection; it looks at the files (a stat of each, links
    followed) at most every `check_interval_s`, and loads them only when that changed. A pair that
    does not load keeps the context in use, and is logged once (the reason, never key material) until
    the files change again: a pair written one file at a time fails until its second file lands,
    then loads. Used from the event loop only.
    """

    def __init__(self, cert: Path | str, key: Path | str, log: DecisionLog | None = None,
                 check_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.cert, self.key = Path(cert), Path(key)
        self._log = log
        self._interval = check_interval_s
        self._clock = clock
        stamps = self._stamps()
        self._context = tls_context(self.cert, self.key)  # the first pair must load: the caller says why not
        self._seen, self._checked = stamps, clock()
        self.generation = 0  # how many times a new pair replaced the one before

    def _stamps(self) -> tuple[FileStamp | None, FileStamp | None]:
        return _stamp(self.cert), _stamp(self.key)

    def current(self) -> ssl.SSLContext:
        """The context for a new connection: the newest pair that loaded."""
        now = self._clock()
        if now - self._checked < self._interval:
            return self._context
        self._checked = now
        stamps = self._stamps()  # before reading: a change while we read shows as a change next time
        if stamps == self._seen:
            return self._context
        self._seen = stamps
        try:
            context = tls_context(self.cert, self.key)
        except (ssl.SSLError, OSError, ValueError) as err:
            if self._log is not None:
                self._log.write("tls_reload_failed", cert=str(self.cert), key=str(self.key),
                                error=_tls_error(err), kept="the pair in use")
            return self._context
        self._context = context
        self.generation += 1
        if self._log is not None:
            self._log.write("tls_reloaded", cert=str(self.cert), **certificate_summary(self.cert))
        return context

    def is_current(self, context: ssl.SSLContext) -> bool:
        return context is self._context


def _tls_error(err: Exception) -> str:
    """What went wrong loading a pair, in words of ssl or the OS: never a byte of the files."""
    if isinstance(err, ssl.SSLError):
        return f"{err.library or 'ssl'}: {err.reason or type(err).__name__}"
    if isinstance(err, OSError):
        return f"{type(err).__name__}: {err.strerror or err.errno}"
    return type(err).__name__


def certificate_summary(cert: Path) -> dict[str, str]:
    """The first certificate of a PEM chain, as a log names it: subject, issuer, expiry, SHA-256 fingerprint."""
    try:
        leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):
        return {}  # it loaded a moment ago; a file changed again since, and the next check reads it
    return {"subject": leaf.subject.rfc4514_string()[:200], "issuer": leaf.issuer.rfc4514_string()[:200],
            "not_after": leaf.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sha256": leaf.fingerprint(hashes.SHA256()).hex()}


# --- TLS over memory buffers ---------------------------------------------------------------------------------


class TlsStream:
    """Server-side TLS on an asyncio stream, through ssl.MemoryBIO: buffers of 16 KiB per read, not 256 KiB."""

    READ_SIZE = 16 << 10

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, context: ssl.SSLContext) -> None:
        self._reader, self._writer = reader, writer
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._shut = False

    async def handshake(self) -> None:
        await self._until_done(self._tls.do_handshake)

    async def recv(self) -> bytes:
        """Up to READ_SIZE bytes of plaintext; b"" once the client closed."""
        try:
            data: bytes = await self._until_done(lambda: self._tls.read(self.READ_SIZE))
            return data
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return b""

    async def send(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()

    async def _until_done(self, step: Callable[[], Any]) -> Any:
        while True:
            try:
                result = step()
            except ssl.SSLWantReadError:
                await self._flush()
                data = await self._reader.read(self.READ_SIZE)
                if data:
                    self._incoming.write(data)
                else:
                    self._incoming.write_eof()
                continue
            await self._flush()
            return result

    async def _flush(self) -> None:
        pending = self._outgoing.read()
        if pending:
            self._writer.write(pending)
            await self._writer.drain()

    def shut(self) -> None:
        """Send close_notify and end our half of the TCP stream, without waiting for anything."""
        if self._shut:
            return
        self._shut = True
        try:
            self._tls.unwrap()
        except (ssl.SSLError, ValueError):
            pass  # it wants the client's close_notify, which we do not wait for
        try:
            pending = self._outgoing.read()
            if pending and not self._writer.is_closing():
                self._writer.write(pending)
            if self._writer.can_write_eof() and not self._writer.is_closing():
                self._writer.write_eof()
        except (OSError, RuntimeError):
            pass

    async def discard(self, seconds: float, limit: int) -> None:
        """Read and drop what the client still sends (raw bytes, no decryption), briefly."""
        deadline = asyncio.get_running_loop().time() + seconds
        try:
            while limit > 0:
                chunk = await within(deadline, functools.partial(self._reader.read, 64 << 10))
                if not chunk:
                    return
                limit -= len(chunk)
        except (asyncio.TimeoutError, OSError):
            pass

    def close(self) -> None:
        self.shut()
        transport = self._writer.transport
        if transport.get_write_buffer_size():
            transport.abort()  # a client that reads nothing must not keep the socket open for what is queued
        else:
            self._writer.close()


async def within(deadline: float | None, step: Callable[[], Awaitable[T]]) -> T:
    """await step() by `deadline` (the loop's clock), else asyncio.TimeoutError (asyncio.timeout is 3.11+)."""
    if deadline is None:
        return await step()
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise asyncio.TimeoutError
    return await asyncio.wait_for(step(), remaining)


# --- connections ---------------------------------------------------------------------------------------------


def client_key(host: str) -> str:
    """Whom a connection counts against: its IPv4 address, or its IPv6 /64 (one host's usual share)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{address}/64", strict=False))
    return str(address)


class Refusal(ImagebuildError):
    """An answer to send instead of a review (411, 413, 408, ...); the connection closes after it."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Connection:
    """One client connection: TLS, then requests one after another (keep-alive) until either side closes."""

    def __init__(self, server: WebhookServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 client: str, address: str) -> None:
        self.server = server
        self.settings = server.settings
        self.client = client  # the key connections are counted under
        self.address = address
        self.context = server.certificate.current()  # the newest pair; this connection keeps it to the end
        self.tls = TlsStream(reader, writer, self.context)
        self.task: asyncio.Task[Any] | None = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.busy = False  # a request has arrived whole and is not answered yet: SIGTERM lets it finish
        self.idle_since: float | None = None  # waiting for the next request, nothing of it read yet
        self.deadline: float | None = self.loop.time() + self.settings.request_deadline_s  # of the current request
        self.phase = "handshake"

    async def run(self) -> None:
        try:
            await within(self.deadline, self.tls.handshake)
        except asyncio.TimeoutError:
            self.server.log.limited("request_timeout", self.address, phase="handshake")
            return
        except (ssl.SSLError, OSError) as err:
            self.server.log.limited("tls_error", self.address, error=str(err)[:200])
            return
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=self.settings.max_header_bytes)
        while await self._one_request(http):
            http.start_next_cycle()
            self.busy = False
            # A pipelined request already begun keeps its deadline running; otherwise we wait, idle.
            self.deadline = self.loop.time() + self.settings.request_deadline_s if http.trailing_data[0] else None

    async def _one_request(self, http: h11.Connection) -> bool:
        """Read, judge and answer one request; whether the connection can carry another."""
        self.phase = "head"
        try:
            event = await self._event(http)
        except h11.RemoteProtocolError as err:
            return await self._refuse(http, Refusal(HTTPStatus(err.error_status_hint), f"bad request: {err}"))
        except asyncio.TimeoutError:
            if self.phase != "idle":  # an idle keep-alive connection timing out is no event
                self._timed_out(self.phase)
            return False
        if not isinstance(event, h11.Request):
            return False  # the client closed between requests
        self.busy = True
        try:
            status, payload, content_type = await self._answer(http, event)
        except Refusal as refusal:
            return await self._refuse(http, refusal)
        except asyncio.TimeoutError:
            return await self._refuse(http, Refusal(HTTPStatus.REQUEST_TIMEOUT, "the request took too long"))
        except h11.RemoteProtocolError as err:
            return await self._refuse(http, Refusal(HTTPStatus(err.error_status_hint), f"bad request: {err}"))
        if status is None:
            return False  # the client went away before its body was whole
        # A connection on a replaced certificate ends after this answer: its client reconnects to the new one.
        keep = not self.server.stopping and http.their_state is h11.DONE and \
            self.server.certificate.is_current(self.context)
        await self._send(http, status, payload, content_type, close=not keep)
        return keep and http.our_state is h11.DONE

    async def _answer(self, http: h11.Connection, request: h11.Request) -> tuple[HTTPStatus | None, bytes, str]:
        method = request.method.decode("ascii", "replace")
        path = request.target.decode("ascii", "replace").split("?", 1)[0]
        length = _content_length(request)
        if method == "GET":
            if length != 0:
                raise Refusal(HTTPStatus.BAD_REQUEST, "a GET has no body")
            await self._rest(http)  # EndOfMessage, at once
            return self._probe(path)
        if method != "POST":
            raise Refusal(HTTPStatus.METHOD_NOT_ALLOWED, f"{method[:16]} is not served here")
        if path not in REVIEW_PATHS:
            raise Refusal(HTTPStatus.NOT_FOUND, "not found")
        if length is None or not any(name == b"content-length" for name, _ in request.headers):
            raise Refusal(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required")
        limit = admission.LIMITS.max_body_bytes
        if length > limit:
            raise Refusal(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes, more than {limit}")
        started = time.monotonic()
        budget = self.server.bodies
        try:
            await within(self.deadline, functools.partial(budget.take, length))
        except asyncio.TimeoutError:
            raise Refusal(HTTPStatus.SERVICE_UNAVAILABLE, "too many reviews at once; try again") from None
        try:
            if http.they_are_waiting_for_100_continue:
                await self.tls.send(http.send(h11.InformationalResponse(status_code=100, headers=[])))
            body = await self._rest(http)
            if body is None:
                return None, b"", ""
            self.phase = "review"
            self.server.metrics.in_flight.inc()
            try:
                payload = self.server.review_inline(body, REVIEW_PATHS[path], started)
                if payload is None:
                    payload = await self.loop.run_in_executor(
                        self.server.reviews, functools.partial(self.server.review, body, REVIEW_PATHS[path], started))
            finally:
                self.server.metrics.in_flight.dec()
        finally:
            await budget.give(length)
        return HTTPStatus.OK if payload[0] == 200 else HTTPStatus(payload[0]), payload[1], "application/json"

    def _probe(self, path: str) -> tuple[HTTPStatus, bytes, str]:
        if path == "/healthz":
            return HTTPStatus.OK, b"ok\n", "text/plain"
        if path == "/readyz":
            ready = self.server.ready and not self.server.stopping
            return (HTTPStatus.OK, b"ok\n", "text/plain") if ready else \
                (HTTPStatus.SERVICE_UNAVAILABLE, b"shutting down\n", "text/plain")
        if path == "/metrics":
            return HTTPStatus.OK, self.server.metrics.exposition(), CONTENT_TYPE
        return HTTPStatus.NOT_FOUND, b"not found\n", "text/plain"

    async def _event(self, http: h11.Connection) -> Any:
        """The next h11 event, reading under the request's deadline (or the idle timeout before it begins)."""
        while True:
            event = http.next_event()
            if event is not h11.NEED_DATA:
                return event
            if self.deadline is None:
                self.idle_since = self.loop.time()
                self.phase = "idle"
                try:
                    data = await within(self.loop.time() + self.settings.idle_timeout_s, self.tls.recv)
                finally:
                    self.idle_since = None
                self.phase = "head"  # the next request has begun: its deadline runs from its first byte
                self.deadline = self.loop.time() + self.settings.request_deadline_s
            else:
                data = await within(self.deadline, self.tls.recv)
            http.receive_data(data)

    async def _rest(self, http: h11.Connection) -> bytes | None:
        """The body up to EndOfMessage (h11 holds it to the Content-Length); None if the client went away."""
        self.phase = "body"
        chunks: list[bytes] = []
        while True:
            event = await self._event(http)
            if isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                return None

    def _timed_out(self, phase: str) -> None:
        self.server.log.limited("request_timeout", self.address, phase=phase)

    async def _refuse(self, http: h11.Connection, refusal: Refusal) -> bool:
        self.server.metrics.refused.labels(str(int(refusal.status))).inc()
        if refusal.status is HTTPStatus.REQUEST_TIMEOUT:
            self._timed_out(self.phase)
        else:
            self.server.log.limited("request_refused", self.address, status=int(refusal.status),
                                    error=refusal.message[:200])
        payload = json.dumps({"error": f"imagebuild: {refusal.message[:300]}"}).encode()
        try:
            await self._send(http, refusal.status, payload, "application/json", close=True)
        except (h11.LocalProtocolError, asyncio.TimeoutError, OSError):
            return False
        if http.their_state is not h11.DONE:  # a body left unread: let the client finish sending, then close
            self.tls.shut()
            await self.tls.discard(self.settings.linger_s, 8 << 20)
        return False

    async def _send(self, http: h11.Connection, status: HTTPStatus, payload: bytes, content_type: str,
                    close: bool) -> None:
        self.phase = "respond"
        headers = [("Content-Type", content_type), ("Content-Length", str(len(payload))),
                   ("Server", "imagebuild-admission")]
        if close:
            headers.append(("Connection", "close"))
        data = http.send(h11.Response(status_code=int(status), headers=headers, reason=status.phrase.encode()))
        data = (data or b"") + (http.send(h11.Data(data=payload)) or b"") + (http.send(h11.EndOfMessage()) or b"")
        await within(self.loop.time() + self.settings.write_timeout_s, functools.partial(self.tls.send, data))


def _content_length(request: h11.Request) -> int | None:
    """The declared body length: 0 when there is none, None when it is chunked (refused with 411)."""
    length = 0
    for name, value in request.headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            length = int(value)  # h11 has checked it is digits, and that repeated ones agree
    return length


class ByteBudget:
    """Bytes of request bodies in memory at once, all connections together; a request waits for its share."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._changed = asyncio.Condition()

    async def take(self, size: int) -> None:
        size = min(size, self.total)
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= size)
            self.free -= size

    async def give(self, size: int) -> None:
        async with self._changed:
            self.free += min(size, self.total)
            self._changed.notify_all()


# --- the server ----------------------------------------------------------------------------------------------


class WebhookServer:
    """Accepts connections within the limits, runs each, and stops gracefully."""

    def __init__(self, settings: ServerSettings, certificate: ServingCertificate, verify: ParallelVerifier,
                 policy: Policy, log: DecisionLog, cached: Cached | None = None,
                 metrics: WebhookMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WebhookMetrics()
        self.certificate = certificate
        self.verify = verify
        self.cached = cached
        self.policy = policy
        self.log = log
        self.reviews = ThreadPoolExecutor(max_workers=settings.review_workers, thread_name_prefix="review")
        self.ready = False
        self.stopping = False
        self.connections: set[Connection] = set()
        self.per_client: dict[str, int] = {}
        self.bodies = ByteBudget(settings.body_budget_bytes)
        self._listener: asyncio.Server | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.address: tuple[str, int] | None = None

    def review(self, body: bytes, pin: bool, started: float) -> tuple[int, bytes]:
        """In a worker thread: judge one AdmissionReview, log the decision, and encode the answer."""
        return self._answered(admission.review(body, self.verify, self.policy, pin=pin), pin, started, inline=False)

    def review_inline(self, body: bytes, pin: bool, started: float) -> tuple[int, bytes] | None:
        """On the event loop: the answer when every image's verdict is in the verifier's cache (a small body,
        nothing to fetch: well under a millisecond), else None and the review goes to a worker thread. The two
        thread hand-offs it saves were most of a warm review's time at the API server."""
        if self.cached is None or len(body) > INLINE_BODY_BYTES:
            return None
        cached = self.cached

        def from_cache(images: Sequence[str]) -> Mapping[str, Verdict]:
            verdicts = {}
            for image in images:
                verdict = cached(image)
                if verdict is None:
                    raise _NotCached
                verdicts[image] = verdict
            return verdicts

        try:
            outcome = admission.review(body, from_cache, self.policy, pin=pin)
        except _NotCached:
            return None
        return self._answered(outcome, pin, started, inline=True)

    def _answered(self, outcome: admission.Outcome, pin: bool, started: float, inline: bool) -> tuple[int, bytes]:
        seconds = time.monotonic() - started
        endpoint = "mutate" if pin else "validate"
        self.metrics.decided(endpoint, outcome.log, seconds)
        self.log.write("decision", endpoint=endpoint, **outcome.log, duration_ms=round(seconds * 1000, 1),
                       inline=inline)
        return outcome.http_status, json.dumps(outcome.body).encode()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._listener = await asyncio.start_server(self._accepted, self.settings.host, self.settings.port,
                                                    backlog=1024, limit=TlsStream.READ_SIZE * 4)
        self.address = self._listener.sockets[0].getsockname()[:2]
        self.ready = True
        self.metrics.ready.set(1)

    def request_stop(self) -> None:
        """From any thread (or a signal handler): begin the graceful stop."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def wait_stopped(self) -> None:
        assert self._stop is not None
        await self._stop.wait()
        await self._drain()

    async def _drain(self) -> None:
        self.ready = False
        self.metrics.ready.set(0)
        self.stopping = True
        if self._listener is not None:
            self._listener.close()
        for connection in list(self.connections):
            if not connection.busy:
                self._cancel(connection)
        pending = [c.task for c in self.connections if c.task is not None]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.settings.drain_timeout_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=2)
        self.reviews.shutdown(wait=True, cancel_futures=True)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        address = str(peer[0])
        client = client_key(address)
        if not self._admit(client, address):
            self.metrics.connections_refused.inc()
            writer.transport.abort()
            return
        connection = Connection(self, reader, writer, client, address)
        self.connections.add(connection)
        self.per_client[client] = self.per_client.get(client, 0) + 1
        try:
            await connection.run()
        except asyncio.CancelledError:
            pass  # displaced while idle, or stopping: nothing of a request was lost
        except Exception as err:  # noqa: BLE001 -- one connection's failure must not reach the loop
            self.log.limited("connection_error", address, error=f"{type(err).__name__}: {str(err)[:200]}")
        finally:
            self._release(connection)
            connection.tls.close()

    def _admit(self, client: str, address: str) -> bool:
        if self.stopping:
            return False
        if self.per_client.get(client, 0) >= self.settings.max_connections_per_client and \
                not self._displace_idle(client):
            self.log.limited("connection_refused", address, error="too many connections from this client",
                             limit=self.settings.max_connections_per_client)
            return False
        if len(self.connections) >= self.settings.max_connections and not self._displace_idle(None) \
                and not self._displace_unfinished():
            self.log.limited("connection_refused", address, error="too many connections",
                             limit=self.settings.max_connections)
            return False
        return True

    def _displace_idle(self, client: str | None) -> bool:
        """Close the longest-idle keep-alive connection (of this client, or of anyone) to make room."""
        idle = [c for c in self.connections if c.idle_since is not None and (client is None or c.client == client)]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since or 0.0)
        self._cancel(oldest)
        return True

    def _displace_unfinished(self) -> bool:
        """Full with no idle connection: close the one whose request has been arriving longest (a real one
        arrives in milliseconds; the oldest unfinished ones are the trickling ones), if over a second old."""
        now = asyncio.get_running_loop().time()
        arriving = [c for c in self.connections if not c.busy and c.deadline is not None
                    and now - (c.deadline - self.settings.request_deadline_s) > 1.0]
        if not arriving:
            return False
        self._cancel(min(arriving, key=lambda c: c.deadline or 0.0))
        return True

    def _cancel(self, connection: Connection) -> None:
        self._release(connection)
        if connection.task is not None:
            connection.task.cancel()

    def _release(self, connection: Connection) -> None:
        if connection in self.connections:
            self.connections.discard(connection)
            left = self.per_client.get(connection.client, 1) - 1
            if left > 0:
                self.per_client[connection.client] = left
            else:
                self.per_client.pop(connection.client, None)


def serve(settings: ServerSettings, certificate: ServingCertificate, verify: Callable[[str], Verdict],
          policy: Policy, log: DecisionLog, on_ready: Callable[[WebhookServer], None] | None = None,
          cached: Cached | None = None, metrics: WebhookMetrics | None = None) -> None:
    """Serve until SIGTERM or SIGINT (or server.request_stop()); then drain as the module docstring says.

    `cached`: verify's verdict when it is had without the network (Verifier.cached), for reviews answered on
    the event loop; None sends every review to a worker thread. `metrics`: what GET /metrics shows (a new set
    when None)."""
    metrics = metrics or WebhookMetrics()
    verifier = ParallelVerifier(verify, settings.verify_workers, metrics)
    try:
        asyncio.run(_serve(WebhookServer(settings, certificate, verifier, policy, log, cached, metrics), on_ready))
    finally:
        verifier.close()


async def _serve(server: WebhookServer, on_ready: Callable[[WebhookServer], None] | None) -> None:
    await server.start()
    loop = asyncio.get_running_loop()
    installed = _on_signals(loop, server)
    try:
        host, port = server.address or ("?", 0)
        settings = server.settings
        server.log.write("serving", address=f"https://{_host(str(host))}:{port}",
                         mode="enforce" if server.policy.enforce else "warn",
                         failure_policy="fail" if server.policy.fail_closed else "ignore",
                         request_deadline_s=settings.request_deadline_s, max_connections=settings.max_connections,
                         max_connections_per_client=settings.max_connections_per_client,
                         certificate=certificate_summary(server.certificate.cert).get("sha256"))
        if on_ready is not None:
            on_ready(server)
        await server.wait_stopped()
        server.log.write("stopped")
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


def _on_signals(loop: asyncio.AbstractEventLoop, server: WebhookServer) -> list[int]:
    installed: list[int] = []

    def stopping(signum: int) -> None:
        server.log.write("stopping", signal=signal.Signals(signum).name)
        server.request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, stopping, signum)
            installed.append(signum)
        except (ValueError, RuntimeError):  # not the main thread: request_stop() is the way
            pass
    return installed


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

