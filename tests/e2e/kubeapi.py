"""A real Kubernetes API server for the tests: etcd and kube-apiserver on loopback, no kubelet.

Both binaries are built from the Go module proxy by scripts/build-test-tools.sh (pinned in
scripts/versions.env). An admitted Pod is stored and stays Pending: nothing runs it, which is all
admission needs. What a cluster would add and this one lacks, on purpose:

- no kube-controller-manager: a namespace gets no `default` ServiceAccount until a test makes one
  (`Cluster.namespace` does), a Job gets no Pods, a Service gets no EndpointSlice;
- so the API server reaches a webhook Service through Endpoints the test writes
  (`--enable-aggregator-routing`: a Service is resolved to its endpoints, not its ClusterIP) at
  this machine's own non-loopback address, where the test's webhook listens. The webhook's
  certificate is checked against the Service's DNS name, exactly as in a cluster.

Authentication is a static token of the group system:masters; the kubeconfig names it, the CA,
and the server. `--allow-privileged` is on so that a privileged Pod is refused by Pod Security
Admission (what the tests check) and not by the API server's own flag.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from .certs import Authority, service_account_key
from .rollout_harness import free_port
from .tools import tool

START_TIMEOUT_S = 90.0  # the API server is ready about 6 s after start; a loaded 2-core machine is slower


def host_address() -> str:
    """This machine's first non-loopback IPv4 address: Endpoints may not name 127.0.0.0/8."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: connect() on UDP only picks the route
            address = probe.getsockname()[0]
        except OSError:
            address = ""
    if address and not address.startswith("127."):
        return str(address)
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    for candidate in out:
        if "." in candidate and not candidate.startswith("127."):
            return candidate
    pytest.fail("this machine has no non-loopback IPv4 address for the API server to reach a webhook at",
                pytrace=False)


@dataclass
class Cluster:
    server: str  # https://127.0.0.1:PORT
    ca: Path
    kubeconfig: Path
    token: str
    directory: Path
    _logs: list[Path] = field(default_factory=list)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`kubectl --kubeconfig ... ARGS`; with check, a non-zero exit fails the test with kubectl's stderr."""
        run = subprocess.run([tool("kubectl"), "--kubeconfig", str(self.kubeconfig), *args], input=input,
                             capture_output=True, text=True, timeout=timeout)
        if check and run.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} exited {run.returncode}: {run.stderr[-3000:]}", pytrace=False)
        return run

    def apply(self, *documents: dict, args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", *args, input=yaml.safe_dump_all(documents))

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def namespace(self, name: str, labels: dict[str, str] | None = None) -> str:
        """A namespace with its `default` ServiceAccount (what kube-controller-manager would add)."""
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}},
                   {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": name}})
        return name

    def route_service(self, namespace: str, name: str, port_name: str, address: str, port: int) -> None:
        """Endpoints (and the EndpointSlice the mirroring controller would make) for a Service with no Pods."""
        self.apply(
            {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": name, "namespace": namespace},
             "subsets": [{"addresses": [{"ip": address}], "ports": [{"name": port_name, "port": port}]}]},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": f"{name}-test", "namespace": namespace,
                          "labels": {"kubernetes.io/service-name": name}},
             "addressType": "IPv4", "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
             "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]})

    def log_tail(self, characters: int = 3000) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-characters:]}" for path in self._logs
                         if path.exists())


def _kubeconfig(path: Path, server: str, ca: Path, token: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
    }))
    path.chmod(0o600)


def _wait_ready(url: str, ca: Path, process: subprocess.Popen, what: str, cluster_logs: str) -> None:
    context = ssl.create_default_context(cafile=str(ca)) if url.startswith("https") else None
    deadline = time.monotonic() + START_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode}:\n{cluster_logs}", pytrace=False)
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                if answer.status == 200:
                    return
        except OSError as err:
            last = str(err)
        time.sleep(0.2)
    pytest.fail(f"{what} was not ready at {url} in {START_TIMEOUT_S:.0f} s ({last}):\n{cluster_logs}", pytrace=False)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_cluster(directory: Path) -> Iterator[Cluster]:
    """etcd and kube-apiserver, each on free loopback ports, with certificates and a token of their own."""
    directory.mkdir(parents=True, exist_ok=True)
    authority = Authority.new("imagebuild test cluster CA")
    tls = authority.issue(directory / "pki", "kube-apiserver",
                          ("127.0.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
                          stem="apiserver")
    sa_key, sa_pub = service_account_key(directory / "pki")
    token = secrets.token_hex(24)
    tokens = directory / "pki" / "tokens.csv"
    tokens.write_text(f'{token},admin,admin,"system:masters"\n')
    tokens.chmod(0o600)
    client_port, peer_port, secure_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{client_port}"
    logs = [directory / "etcd.log", directory / "kube-apiserver.log"]
    processes: list[subprocess.Popen] = []
    try:
        processes.append(subprocess.Popen(
            [tool("etcd"), "--name", "test", "--data-dir", str(directory / "etcd"),
             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer_port}",
             # a test cluster's data is thrown away: fsync would only make every write wait for the disk
             "--unsafe-no-fsync", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logs[0].open("w")))
        server = f"https://127.0.0.1:{secure_port}"
        cluster = Cluster(server, tls.ca, directory / "kubeconfig", token, directory, logs)
        _wait_ready(f"{etcd_url}/health", tls.ca, processes[0], "etcd", cluster.log_tail())
        processes.append(subprocess.Popen(
            [tool("kube-apiserver"), "--etcd-servers", etcd_url,
             "--bind-address", "127.0.0.1", "--secure-port", str(secure_port),
             "--tls-cert-file", str(tls.cert), "--tls-private-key-file", str(tls.key),
             "--token-auth-file", str(tokens), "--authorization-mode", "RBAC",
             "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
             "--service-account-key-file", str(sa_pub), "--service-account-signing-key-file", str(sa_key),
             "--service-cluster-ip-range", "10.96.0.0/24",
             "--enable-aggregator-routing=true",  # webhook Services resolve to the Endpoints the tests write
             "--endpoint-reconciler-type", "none",  # no Endpoints for 'kubernetes' at a loopback address
             "--feature-gates", "ImageVolume=true",  # image volumes: beta, off by default in 1.34
             "--allow-privileged=true", "--profiling=false", "-v", "1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logs[1].open("w"),
            env={**os.environ, "KUBECONFIG": "/dev/null"}))
        _kubeconfig(cluster.kubeconfig, server, tls.ca, token)
        _wait_ready(f"{server}/readyz", tls.ca, processes[1], "kube-apiserver", cluster.log_tail())
        yield cluster
    finally:
        for process in reversed(processes):
            _stop(process)
