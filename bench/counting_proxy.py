"""A reverse proxy on loopback in front of one registry that counts what its clients ask for.

    with CountingProxy("127.0.0.1:5000") as proxy:     # proxy.host: "127.0.0.1:<free port>"
        ...                                            # point a client at proxy.host
        proxy.counts()                                 # {"requests": 41, "by_method": {...}, ...}

Every request is passed on as it came (the Host header too, so the registry's absolute upload
URLs name the proxy again), and its response passed back; request and response bodies are
counted as they stream through, never held whole. For the benchmarks only: plain HTTP, no TLS.
"""
from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHUNK = 1 << 20
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class _Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_method: Counter[str] = Counter()
        self.by_kind: Counter[str] = Counter()
        self.sent = 0  # request bodies: client -> registry
        self.received = 0  # response bodies: registry -> client

    def add(self, method: str, path: str, sent: int, received: int) -> None:
        kind = ("blob upload" if "/blobs/uploads" in path else "blob" if "/blobs/" in path
                else "manifest" if "/manifests/" in path else "tags" if path.endswith("/tags/list")
                else "referrers" if "/referrers/" in path else "other")
        with self.lock:
            self.by_method[method] += 1
            self.by_kind[f"{method} {kind}"] += 1
            self.sent += sent
            self.received += received


def _handler(upstream: str, tally: _Tally) -> type[BaseHTTPRequestHandler]:
    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

        def _body(self):
            """The request body as chunks, whether sized or chunked."""
            length = self.headers.get("Content-Length")
            if length is not None:
                left = int(length)
                while left > 0:
                    chunk = self.rfile.read(min(CHUNK, left))
                    if not chunk:
                        return
                    left -= len(chunk)
                    yield chunk
            elif self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return
                    yield self.rfile.read(size)
                    self.rfile.readline()

        def _forward(self) -> None:
            sent = 0

            def counted():
                nonlocal sent
                for chunk in self._body():
                    sent += len(chunk)
                    yield chunk

            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            connection = http.client.HTTPConnection(upstream, timeout=600)
            try:
                has_body = "Content-Length" in self.headers or "Transfer-Encoding" in self.headers
                if "Content-Length" in self.headers:
                    connection.request(self.command, self.path, body=b"".join(counted()) if int(self.headers["Content-Length"]) < CHUNK
                                       else counted(), headers=headers)
                elif has_body:
                    connection.request(self.command, self.path, body=counted(), headers=headers, encode_chunked=True)
                else:
                    connection.request(self.command, self.path, headers=headers)
                response = connection.getresponse()
                received = 0
                self.send_response_only(response.status, response.reason)
                length = response.getheader("Content-Length")
                for name, value in response.getheaders():
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                chunked = length is None and self.command != "HEAD" and response.status not in (204, 304)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if self.command != "HEAD":
                    while chunk := response.read(CHUNK):
                        received += len(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                tally.add(self.command, self.path.split("?")[0], sent, received)
            finally:
                connection.close()

        do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _forward

    return Forward


class CountingProxy:
    """In front of `upstream` ("host:port"); counts every request until closed."""

    def __init__(self, upstream: str):
        self.tally = _Tally()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(upstream, self.tally))
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> CountingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self.tally.lock:
            self.tally.by_method.clear()
            self.tally.by_kind.clear()
            self.tally.sent = self.tally.received = 0

    def counts(self) -> dict[str, Any]:
        with self.tally.lock:
            return {"requests": sum(self.tally.by_method.values()), "by_method": dict(self.tally.by_method),
                    "by_kind": dict(sorted(self.tally.by_kind.items())), "bytes_sent": self.tally.sent,
                    "bytes_received": self.tally.received}
