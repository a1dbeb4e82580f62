"""Notification receivers of the tests' own, on loopback: one that records what it is posted (over HTTPS
with a test CA, or plain HTTP) answering the statuses a test lines up, and one that accepts and never answers."""
from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """POST anything: recorded, answered with the next status lined up (200 once they are used up).
    GET answers 500: an unhealthy service, for a rollout's http gate to fail on."""

    def __init__(self, statuses: tuple[int, ...] = (), tls: ssl.SSLContext | None = None,
                 extra_headers: dict[str, str] | None = None):
        self.received: list[Received] = []
        self._statuses = list(statuses)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._arrived:
                    receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    status = receiver._statuses.pop(0) if receiver._statuses else 200
                    receiver._arrived.notify_all()
                self.send_response(status)
                for name, value in (extra_headers or {}).items():
                    self.send_header(name, value)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self.send_response(500)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._server.server_address[1]}/events"

    def wait_for(self, count: int, timeout_s: float = 10) -> list[Received]:
        with self._arrived:
            self._arrived.wait_for(lambda: len(self.received) >= count, timeout_s)
            return list(self.received)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.json() for r in self.received]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def silent_receiver() -> Iterator[str]:
    """A loopback port that completes TCP handshakes (the kernel's backlog) and never reads or answers."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(16)
        yield f"http://127.0.0.1:{held.getsockname()[1]}/events"


def refused_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/events"
