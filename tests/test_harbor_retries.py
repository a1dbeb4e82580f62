"""HarborClient's retries, on oci.retry's engine, against real HTTP servers that drop, refuse and rate-limit.

The stand-in (tests/harbor_standin) answers with statuses; these servers also break connections,
which only a socket can show: what may be sent again depends on whether the request went out.
"""
from __future__ import annotations

import http.server
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from imagebuild.release import harbor

CREDENTIALS = harbor.Credentials("admin", "Canary-Pw-Retries-3")
Answer = Callable[[http.server.BaseHTTPRequestHandler, int], bool]  # False: drop the connection, unanswered


class Server:
    """A loopback HTTP server; `answer(handler, n)` handles the n-th request (1-based) of its method."""

    def __init__(self, answer: Answer, *, listen: bool = True):
        self.seen: list[str] = []
        seen, lock = self.seen, threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    seen.append(f"{self.command} {self.path}")
                    number = sum(1 for s in seen if s.startswith(self.command + " "))
                del body
                if not answer(self, number):
                    self.close_connection = True  # the request arrived; its answer never leaves

            do_GET = do_POST = do_PUT = _any

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        self.httpd.daemon_threads = True
        self.httpd.server_bind()  # bound, not listening: a connection is refused until listen()
        if listen:
            self.listen()

    def listen(self) -> None:
        self.httpd.server_activate()
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def reply(handler: http.server.BaseHTTPRequestHandler, status: int, body: object,
          headers: dict[str, str] | None = None) -> bool:
    data = json.dumps(body).encode()
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
        handler.send_header(name, value)
    handler.end_headers()
    handler.wfile.write(data)
    return True


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(answer: Answer, **kwargs: bool) -> Server:
        servers.append(Server(answer, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_a_get_whose_answer_was_lost_is_sent_again_but_a_post_that_may_have_reached_harbor_is_not(serve):
    def answer(handler: http.server.BaseHTTPRequestHandler, number: int) -> bool:
        if number == 1:
            return False  # the first GET and the first POST: read, never answered
        return reply(handler, 200, {"harbor_version": "v2.11.0"})

    server = serve(answer)
    with harbor.HarborClient(server.url, CREDENTIALS, retries=3, backoff=0.05) as client:
        assert client.harbor_version() == "v2.11.0"
        with pytest.raises(harbor.HarborUnavailable,
                           match=f"^{re.escape(f'cannot reach Harbor at {server.url} to create project paddle: ')}"):
            client.request("POST", "/projects", what="create project paddle", json={"project_name": "paddle"},
                           expect=(201,))
    assert server.seen == ["GET /api/v2.0/systeminfo", "GET /api/v2.0/systeminfo", "POST /api/v2.0/projects"]
    assert client.retry_log.retries == 1 and client.retry_log.reasons[0].startswith("GET /api/v2.0/systeminfo: ")


def test_a_post_whose_connection_was_refused_is_sent_once_harbor_listens(serve):
    server = serve(lambda handler, number: reply(handler, 201, {}, {"Location": "/api/v2.0/projects/7"}),
                   listen=False)
    with harbor.HarborClient(server.url, CREDENTIALS, retries=10, backoff=0.1) as client:
        def listen_once_refused() -> None:  # after a refusal the client has seen, however slow the machine
            while not client.retry_log.retries:
                time.sleep(0.01)
            server.listen()

        threading.Thread(target=listen_once_refused, daemon=True).start()
        response = client.request("POST", "/projects", what="create project paddle",
                                  json={"project_name": "paddle"}, expect=(201,))
    assert response.status_code == 201 and server.seen == ["POST /api/v2.0/projects"]
    assert client.retry_log.retries >= 1 and all("ConnectError" in r for r in client.retry_log.reasons)


def test_a_rate_limit_waits_what_retry_after_says_and_a_lasting_one_fails_with_the_number_of_tries(serve):
    def answer(handler: http.server.BaseHTTPRequestHandler, number: int) -> bool:
        if handler.path.endswith("/systeminfo") and number > 1:
            return reply(handler, 200, {"harbor_version": "v2.11.0"})
        return reply(handler, 429, {"errors": [{"code": "TOO_MANY_REQUESTS", "message": "slow down"}]},
                     {"Retry-After": "1", "X-Request-Id": "rid-9"})

    server = serve(answer)
    with harbor.HarborClient(server.url, CREDENTIALS, retries=2, backoff=0.05) as client:
        started = time.monotonic()
        assert client.harbor_version() == "v2.11.0"
        assert time.monotonic() - started >= 1.0 and client.retry_log.waited_s == 1.0
        refused = "Harbor answered 429 (TOO_MANY_REQUESTS: slow down) to update project paddle, 3 times [request id rid-9]"
        with pytest.raises(harbor.HarborUnavailable, match=f"^{re.escape(refused)}\\Z") as raised:
            client.request("PUT", "/projects/7", what="update project paddle", json={})
    assert raised.value.status == 429 and server.seen.count("PUT /api/v2.0/projects/7") == 3


def test_the_environments_proxy_is_used_unless_no_proxy_names_harbor(serve, monkeypatch):
    direct = serve(lambda handler, number: reply(handler, 200, {"harbor_version": "direct"}))
    proxy = serve(lambda handler, number: reply(handler, 200, {"harbor_version": "through the proxy"}))
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    monkeypatch.setenv("http_proxy", proxy.url)
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with harbor.HarborClient(direct.url, CREDENTIALS) as client:
        assert client.harbor_version() == "through the proxy"
    assert proxy.seen == [f"GET {direct.url}/api/v2.0/systeminfo"]  # a proxy's request line: the whole URL
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    with harbor.HarborClient(direct.url, CREDENTIALS) as client:
        assert client.harbor_version() == "direct"
    assert direct.seen == ["GET /api/v2.0/systeminfo"] and len(proxy.seen) == 1


def test_nothing_listening_is_a_one_line_error_after_the_retries():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with harbor.HarborClient(f"http://127.0.0.1:{port}", CREDENTIALS, retries=2, backoff=0.05) as client:
        with pytest.raises(harbor.HarborUnavailable, match=f"^cannot reach Harbor at http://127.0.0.1:{port} to "
                                                           f"read Harbor's system info: "):
            client.harbor_version()
    assert client.retry_log.retries == 2
