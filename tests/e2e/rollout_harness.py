"""The services a rollout's gates talk to, run by the tests on loopback: a metrics exporter whose
values the test sets, a real Prometheus (Debian's package) scraping it every second, and a
health endpoint whose answer per region the test chooses.

Prometheus keeps every series it scraped for the whole session: a test that looks back in time
(a `for` window) uses a metric name of its own (`unique_metric`) or starts its window after its
values are visible (`Prometheus.wait_for_value`).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

SCRAPE_JOB = "rollout-exporter"
HANG = "hang"  # a health status: answer nothing until the test ends (timeouts)


class HarnessError(RuntimeError):
    """A service could not be started; the message says what to install or look at."""


def free_port() -> int:
    """A loopback port nothing listens on (bound, then released): for a server to start on, or a service down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port_url(path: str = "") -> str:
    """A loopback URL where nothing listens: a service that is down."""
    return f"http://127.0.0.1:{free_port()}{path}"


def unique_metric(prefix: str = "job_error_ratio") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _quiet_server(handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name=handler.__name__, daemon=True).start()
    return server


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


# --- the exporter --------------------------------------------------------------------------------


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Exporter:
    """GET /metrics: gauges in Prometheus' text format, set and removed by the test at run time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        exporter = self

        class Metrics(_Handler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = _quiet_server(Metrics)
        self.address = f"127.0.0.1:{self._server.server_address[1]}"

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._values[(name, tuple(sorted(labels.items())))] = float(value)

    def remove(self, name: str, **labels: str) -> None:
        with self._lock:
            self._values.pop((name, tuple(sorted(labels.items()))), None)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def render(self) -> str:
        with self._lock:
            items = sorted(self._values.items())
        lines, typed = [], set()
        for (name, labels), value in items:
            if name not in typed:
                lines.append(f"# TYPE {name} gauge")
                typed.add(name)
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {_sample_value(value)}" if text else f"{name} {_sample_value(value)}")
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- the health endpoint -----------------------------------------------------------------------------


class HealthServer:
    """GET /healthz?region=NAME answers the status the test set for that region (404 when unset);
    HANG holds the request open until the server stops."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int | str] = {}
        self._release = threading.Event()
        self.requests: list[str] = []  # the regions asked for, in order
        health = self

        class Health(_Handler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                region = urllib.parse.parse_qs(url.query).get("region", [""])[0]
                with health._lock:
                    health.requests.append(region)
                    status = health._status.get(region, 404)
                if url.path != "/healthz":
                    status = 404
                if status == HANG:
                    health._release.wait(60)
                    status = 200
                body = json.dumps({"region": region, "status": status}).encode()
                self.send_response(int(status))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = _quiet_server(Health, tls)
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{self._server.server_address[1]}"
        self.url = self.base + "/healthz?region={region}"  # a release.yaml http gate's url

    def set(self, region: str, status: int | str) -> None:
        with self._lock:
            self._status[region] = status

    def reset(self) -> None:
        with self._lock:
            self._status.clear()
            self.requests.clear()

    def stop(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()


def self_signed_tls(folder: Path) -> ssl.SSLContext:
    """A server context with a fresh self-signed certificate for 127.0.0.1 (trusted by no CA store)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    return context


# --- Prometheus -----------------------------------------------------------------------------------------


def find_prometheus() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)
    if path is None:
        raise HarnessError("prometheus is not installed (Debian: apt-get install prometheus; "
                           "scripts/bootstrap.sh installs it)")
    return path


def _die_with_parent() -> None:
    # Linux prctl(PR_SET_PDEATHSIG, SIGTERM): a killed test run does not leave Prometheus behind.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class Pushgateway:
    """A real Prometheus Pushgateway (Debian's prometheus-pushgateway) on a free loopback port, no persistence."""

    def __init__(self, workdir: Path, binary: str | None = None):
        self.binary = binary or shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
        self.workdir = workdir
        self.log_path = workdir / "pushgateway.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def start(self, timeout_s: float = 30) -> Pushgateway:
        if not Path(self.binary).exists():
            raise HarnessError("prometheus-pushgateway is not installed (Debian: apt-get install --no-install-recommends "
                               "prometheus-pushgateway; scripts/bootstrap.sh installs it)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # the free port may be taken between choosing and binding it
            self.address = f"127.0.0.1:{free_port()}"
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen([self.binary, f"--web.listen-address={self.address}"],
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                preexec_fn=_die_with_parent)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.process.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as answer:  # noqa: S310
                        if answer.status == 200:
                            return self
                time.sleep(0.1)
            self.stop()
        raise HarnessError(f"the Pushgateway did not start; log:\n{self.log_path.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Prometheus:
    """A real Prometheus on a free loopback port, scraping `targets` every second."""

    def __init__(self, workdir: Path, targets: list[str], binary: str | None = None,
                 scrape_configs: list[dict] | None = None, rule_files: list[Path] | None = None):
        self.binary = binary or find_prometheus()
        self.workdir = workdir
        self.targets = targets
        self.scrape_configs = scrape_configs or []  # more jobs, as Prometheus's configuration writes them
        self.rule_files = rule_files or []
        self.log_path = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float = 60) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": SCRAPE_JOB, "honor_labels": True,
                                "static_configs": [{"targets": self.targets}]}, *self.scrape_configs],
            "rule_files": [str(path) for path in self.rule_files],
        }))
        for _ in range(3):  # the free port may be taken between choosing and binding it
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=2h"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
            if self._wait_ready(timeout_s):
                return self
            if self.process.poll() is None:
                break
        self.stop()
        raise HarnessError(f"prometheus did not become ready with its first scrape; log:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(OSError, ValueError):
                if self._get("/-/ready")[0] == 200 and self.query(f'up{{job="{SCRAPE_JOB}"}} == 1'):
                    return True
            time.sleep(0.2)
        return False

    def _get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, bytes]:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback http
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's samples (labels, value) now."""
        status, body = self._get("/api/v1/query", {"query": promql})
        answer = json.loads(body)
        if status != 200 or answer.get("status") != "success":
            raise HarnessError(f"query {promql!r} failed: {answer}")
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [({}, float(data["result"][1]))]
        return [(item["metric"], float(item["value"][1])) for item in data["result"]]

    def wait_until(self, promql: str, accept: Callable[[list[tuple[dict[str, str], float]]], bool],
                   timeout_s: float = 15) -> list[tuple[dict[str, str], float]]:
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.query(promql)
            if accept(samples):
                return samples
            if time.monotonic() > deadline:
                raise HarnessError(f"prometheus did not show the expected samples for {promql!r} within "
                                   f"{timeout_s:g}s; last: {samples}")
            time.sleep(0.2)

    def wait_for_value(self, promql: str, value: float, timeout_s: float = 15) -> None:
        """Until the exporter's new value has been scraped (every sample of the query equals it)."""
        self.wait_until(promql, lambda s: bool(s) and all(math.isclose(v, value) for _, v in s), timeout_s)

    def wait_for_absent(self, promql: str, timeout_s: float = 15) -> None:
        self.wait_until(promql, lambda s: not s, timeout_s)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


# --- all three ------------------------------------------------------------------------------------------


class RolloutServices:
    """The exporter, Prometheus scraping it, and the health endpoint; `stop` ends all three."""

    def __init__(self, workdir: Path):
        self.exporter = Exporter()
        self.health = HealthServer()
        self.prometheus = Prometheus(workdir / "prometheus", [self.exporter.address])
        try:
            self.prometheus.start()
        except BaseException:
            self.exporter.stop()
            self.health.stop()
            raise

    def reset(self) -> None:
        """Between tests: no metric exported, no health status set (Prometheus keeps its history)."""
        self.exporter.clear()
        self.health.reset()

    def stop(self) -> None:
        self.prometheus.stop()
        self.exporter.stop()
        self.health.stop()
