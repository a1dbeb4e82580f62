"""Scaffolding for the OCI client's end-to-end tests: real Distribution registries with basic auth,
token auth or TLS, the token service they trust (a test double, as the brief allows), a test CA,
a fault-injecting proxy that sits between the client and a real registry, and small hostile
servers on loopback that record every request they get.
"""
from __future__ import annotations

import base64
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from .rollout_harness import free_port

DISTRIBUTION = "/usr/bin/docker-registry"
TOKEN_REALMS_ENV = "IMAGEBUILD_TOKEN_REALMS"


# --- certificates ---------------------------------------------------------------------------

def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def self_signed(common: str, ca: bool) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(_name(common))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


@dataclass
class TestCA:
    __test__ = False  # not a test class, despite its name

    directory: Path

    def __post_init__(self) -> None:
        self.key, self.cert = self_signed(f"imagebuild test CA {uuid.uuid4().hex[:6]}", ca=True)
        self.trust_dir = self.directory / "trust"  # as skopeo's --cert-dir wants it: only *.crt
        self.trust_dir.mkdir()
        self.bundle = self.trust_dir / "ca.crt"
        self.bundle.write_bytes(_pem(self.cert))

    def server_cert(self, name: str = "127.0.0.1") -> tuple[Path, Path]:
        """A certificate for 127.0.0.1 signed by this CA: (cert path, key path)."""
        import ipaddress

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(name))]), critical=False)
                .sign(self.key, hashes.SHA256()))
        cert_path, key_path = self.directory / "server.pem", self.directory / "server.key"
        cert_path.write_bytes(_pem(cert))
        key_path.write_bytes(_key_pem(key))
        return cert_path, key_path


# --- the registry itself ------------------------------------------------------------------

@dataclass
class RunningRegistry:
    host: str  # 127.0.0.1:PORT
    process: subprocess.Popen
    log: Path
    trusted_realm: str = ""  # the IMAGEBUILD_TOKEN_REALMS entry set for it, removed when it stops

    def stop(self) -> None:
        if self.trusted_realm:
            _untrust(self.trusted_realm)
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def start_distribution(directory: Path, auth: dict | None = None, tls: tuple[Path, Path] | None = None) -> RunningRegistry:
    """Debian's docker-registry (CNCF Distribution 2.8) on a free loopback port, storage in `directory`."""
    if not Path(DISTRIBUTION).exists():
        pytest.fail(f"{DISTRIBUTION} is missing; run scripts/bootstrap.sh (Debian package docker-registry)",
                    pytrace=False)
    port = free_port()
    http: dict = {"addr": f"127.0.0.1:{port}", "secret": uuid.uuid4().hex}
    if tls:
        http["tls"] = {"certificate": str(tls[0]), "key": str(tls[1])}
    config = {"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
              "storage": {"filesystem": {"rootdirectory": str(directory / "storage")}, "delete": {"enabled": True}},
              "http": http}
    if auth:
        config["auth"] = auth
    config_path = directory / "config.yml"
    config_path.write_text(yaml.safe_dump(config))
    log = directory / "registry.log"
    process = subprocess.Popen([DISTRIBUTION, "serve", str(config_path)], stdout=log.open("wb"),
                               stderr=subprocess.STDOUT)
    scheme = "https" if tls else "http"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"docker-registry exited ({process.returncode}): {log.read_text()[-2000:]}", pytrace=False)
        try:
            httpx.get(f"{scheme}://127.0.0.1:{port}/v2/", verify=False, timeout=2)
            host = f"127.0.0.1:{port}"
            return RunningRegistry(host, process, log, _trust_token_service(host, auth))
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    pytest.fail(f"docker-registry did not answer on port {port}: {log.read_text()[-2000:]}", pytrace=False)


def _trust_token_service(registry: str, auth: dict | None) -> str:
    """A token registry's realm is the test token service on another port, so another host:port,
    which imagebuild trusts only where named: name it for this process and its children, as an
    operator sets IMAGEBUILD_TOKEN_REALMS. The entry, for RunningRegistry.stop to remove."""
    realm = ((auth or {}).get("token") or {}).get("realm")
    if not realm:
        return ""
    entry = f"{registry}={urlsplit(realm).netloc}"
    os.environ[TOKEN_REALMS_ENV] = f"{os.environ.get(TOKEN_REALMS_ENV, '')} {entry}".strip()
    return entry


def _untrust(entry: str) -> None:
    left = [e for e in os.environ.get(TOKEN_REALMS_ENV, "").split() if e != entry]
    if left:
        os.environ[TOKEN_REALMS_ENV] = " ".join(left)
    else:
        os.environ.pop(TOKEN_REALMS_ENV, None)


def htpasswd(path: Path, users: dict[str, str]) -> Path:
    try:
        import bcrypt
    except ImportError:
        pytest.fail("python package bcrypt is missing: pip install -e '.[test]'", pytrace=False)
    lines = [f"{user}:{bcrypt.hashpw(pw.encode(), bcrypt.gensalt(rounds=5)).decode()}" for user, pw in users.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- the token service --------------------------------------------------------------------

def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenRequest:
    account: str | None
    scopes: list[str]
    granted: list[str]


@dataclass
class TokenIssuer:
    """Distribution's token protocol: checks basic credentials, grants scopes per user, signs ES256 JWTs.

    `users`: name -> (password, actions granted on every repository). Anonymous callers get a
    token granting nothing; wrong credentials get 401.
    """

    directory: Path
    users: dict[str, tuple[str, tuple[str, ...]]]
    service: str = "imagebuild-test-registry"
    issuer: str = "imagebuild-test-issuer"
    lifetime_s: int = 300
    requests: list[TokenRequest] = field(default_factory=list)
    # OAuth2 refresh tokens (docker's `identitytoken`) -> the user they stand for.
    refresh_tokens: dict[str, str] = field(default_factory=dict)
    issued: list[str] = field(default_factory=list)  # every token handed out (none may be logged)
    # user -> the repository prefix their grants are limited to (others: every repository)
    limited_to: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.key, self.cert = self_signed("imagebuild test token issuer", ca=False)
        self.rootcertbundle = self.directory / "token-issuer.pem"
        self.rootcertbundle.write_bytes(_pem(self.cert))
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                issuer._answer(self)

            def do_POST(self) -> None:
                issuer._answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        """127.0.0.1:PORT: another host:port than any registry, so trusted only where named."""
        return f"127.0.0.1:{self.server.server_address[1]}"

    def registry_auth(self) -> dict:
        return {"token": {"realm": self.realm, "service": self.service, "issuer": self.issuer,
                          "rootcertbundle": str(self.rootcertbundle)}}


    def stop(self) -> None:
        self.server.shutdown()

    def _refuse(self, handler: BaseHTTPRequestHandler, account: str | None, scopes: list[str]) -> None:
        self.requests.append(TokenRequest(account, scopes, []))
        handler.send_response(401)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        query = parse_qs(urlsplit(handler.path).query)
        if handler.command == "POST":  # the OAuth2 refresh-token grant
            length = int(handler.headers.get("Content-Length") or 0)
            query = parse_qs(handler.rfile.read(length).decode())
        scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
        account: str | None = None
        allowed: tuple[str, ...] = ()
        header = handler.headers.get("Authorization", "")
        if handler.command == "POST":
            user = self.refresh_tokens.get((query.get("refresh_token") or [""])[0])
            if query.get("grant_type") != ["refresh_token"] or user is None:
                self._refuse(handler, None, scopes)
                return
            account, allowed = user, self.users[user][1]
        elif header.startswith("Basic "):
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            known = self.users.get(user)
            if not known or known[0] != password:
                self._refuse(handler, user, scopes)
                return
            account, allowed = user, known[1]
        access, granted = [], []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            prefix = self.limited_to.get(account or "")
            give = [a for a in actions.split(",") if a in allowed and (prefix is None or name.startswith(prefix))]
            if give:
                access.append({"type": kind, "name": name, "actions": give})
                granted.append(f"{kind}:{name}:{','.join(give)}")
        self.requests.append(TokenRequest(account, scopes, granted))
        now = int(time.time())
        header_json = {"typ": "JWT", "alg": "ES256",
                       "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        claims = {"iss": self.issuer, "sub": account or "", "aud": self.service, "exp": now + self.lifetime_s,
                  "nbf": now - 10, "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{_b64url(json.dumps(header_json).encode())}.{_b64url(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        token = f"{signing_input}.{_b64url(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"
        self.issued.append(token)
        body = json.dumps({"token": token, "access_token": token, "expires_in": self.lifetime_s}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)


# --- the fault-injecting proxy ------------------------------------------------------------

@dataclass
class Fault:
    """Answer `times` requests matching `method` and the `path` regex with a fault instead of the registry.

    kinds: "status" (answer `status`, with Retry-After when given); "drop" (read the request,
    close the connection); "forward-drop" (the registry gets and handles the request, the
    client never hears back); "cut" (forward, then close after half the response body); "stall"
    (forward, then stop sending after half the response body for `stall_s`, then close);
    "redirect" (answer 307 to `location`, as a registry sends a blob GET to its storage).
    """

    method: str
    path: str
    kind: str
    times: int = 1
    status: int = 503
    retry_after: str | None = None
    after: int = 0  # let this many matching requests through first
    stall_s: float = 5.0
    location: str = ""
    served: int = 0
    seen: int = 0


_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
        "proxy-authenticate", "content-length"}


class FlakyProxy:
    def __init__(self, upstream: str, faults: list[Fault] | None = None):
        self.upstream = upstream
        self.faults: list[Fault] = faults or []
        self.log: list[tuple[str, str, str]] = []  # (method, path, what happened)
        self._log_lock = threading.Lock()
        self.client = httpx.Client(base_url=f"http://{upstream}", timeout=60)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def handle_one(self) -> None:
                proxy._handle(self)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = handle_one

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.client.close()

    def _fault_for(self, method: str, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.method == method and re.search(fault.path, path):
                fault.seen += 1
                if fault.seen > fault.after and fault.served < fault.times:
                    fault.served += 1
                    return fault
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        method, path = handler.command, handler.path
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        fault = self._fault_for(method, urlsplit(path).path)
        if fault and fault.kind == "status":
            self.log.append((method, path, f"status {fault.status}"))
            handler.send_response(fault.status)
            if fault.retry_after is not None:
                handler.send_header("Retry-After", fault.retry_after)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if fault and fault.kind == "redirect":
            self.log.append((method, path, f"redirected to {fault.location}"))
            handler.send_response(307)
            handler.send_header("Location", fault.location)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if fault and fault.kind == "drop":
            self.log.append((method, path, "dropped"))
            self._close(handler)
            return
        headers = [(k, v) for k, v in handler.headers.items() if k.lower() not in _HOP]
        if body:
            headers.append(("Content-Length", str(len(body))))
        # A one-shot iterator, so the body is not kept alive by httpx's request/response cycle
        # (the large-blob test measures the memory the copy needs).
        request = self.client.build_request(method, path, content=iter([body]) if body else None, headers=headers)
        response = self.client.send(request, stream=True)
        try:
            if fault and fault.kind == "forward-drop":
                response.read()
                self.log.append((method, path, f"forwarded ({response.status_code}), answer dropped"))
                self._close(handler)
                return
            with self._log_lock:
                entry = len(self.log)
                self.log.append((method, path, f"forwarded ({response.status_code})"))
            content_length = response.headers.get("content-length")
            data = None if content_length is not None else response.read()
            handler.send_response(response.status_code)
            for key, value in response.headers.items():
                if key.lower() not in _HOP:
                    handler.send_header(key, value)
            total = int(content_length) if content_length is not None else len(data or b"")
            handler.send_header("Content-Length", str(total))
            handler.end_headers()
            if method == "HEAD":
                return
            if data is not None:
                handler.wfile.write(data)
                return
            sent = 0
            for piece in response.iter_raw():
                if fault and fault.kind in ("cut", "stall") and sent + len(piece) > total // 2:
                    handler.wfile.write(piece[: total // 2 - sent])
                    handler.wfile.flush()
                    self.log[entry] = (method, path, f"forwarded ({response.status_code}), body {fault.kind} in half")
                    if fault.kind == "stall":
                        time.sleep(fault.stall_s)
                    self._close(handler)
                    return
                handler.wfile.write(piece)
                sent += len(piece)
        finally:
            response.close()

    @staticmethod
    def _close(handler: BaseHTTPRequestHandler) -> None:
        handler.close_connection = True
        try:
            handler.wfile.flush()
            handler.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# --- hostile servers ------------------------------------------------------------------------

@dataclass
class Seen:
    method: str
    path: str  # with its query
    authorization: str | None


Answer = tuple[int, dict[str, str], bytes]


class RecordingServer:
    """A loopback HTTP server that records every request (method, path, Authorization header) and
    answers from `routes` (exact path without query -> status, headers, body; else `default`).
    Routes may be changed while it runs: a test sets them after it knows the server's port."""

    def __init__(self, routes: dict[str, Answer] | None = None, default: Answer = (404, {}, b"")):
        self.routes: dict[str, Answer] = dict(routes or {})
        self.default = default
        self.seen: list[Seen] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                server.seen.append(Seen(self.command, self.path, self.headers.get("Authorization")))
                status, headers, body = server.routes.get(urlsplit(self.path).path, server.default)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        # A short poll: stop() waits one poll for the loop to end, and tests stop one per test.
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def paths(self) -> list[str]:
        return [seen.path for seen in self.seen]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def require_tool(name: str, hint: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not on PATH; {hint}", pytrace=False)
    return found


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}", pytrace=False)
    return done


Wait = Callable[[], None]
