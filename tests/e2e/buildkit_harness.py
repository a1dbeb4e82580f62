"""Real BuildKit daemons for the builder-pool tests: `buildkitd` on loopback TCP with mutual TLS.

Each daemon has its own root (its own cache and snapshots, as a separate machine would), the OCI
worker (runc from docker.io), and a config that lets it pull from and push to the plain-HTTP local
registries. The certificates are the test's own (tests/e2e/certs.py): a CA, one server certificate
for 127.0.0.1 that every daemon presents, and one client certificate imagebuild presents.

Missing buildkitd or buildctl fails the test, saying how to get them: these tests never skip.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .certs import Authority, Tls
from .tools import tool

READY_S = 60  # a fresh daemon answers within a few seconds; a loaded 2-core machine may take longer
REGISTRIES = ("127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Certificates:
    server: Tls  # ca.pem, server.crt, server.key: what each daemon presents and trusts
    client: Tls  # ca.pem, client.crt, client.key: what imagebuild presents

    @classmethod
    def make(cls, directory: Path) -> Certificates:
        authority = Authority.new("imagebuild pool test CA")
        return cls(authority.issue(directory / "server", "buildkitd", ("127.0.0.1",), stem="server"),
                   authority.issue(directory / "client", "imagebuild", (), stem="client", client=True))


@dataclass
class Daemon:
    """One running buildkitd. `kill()` is the fault: SIGKILL to it and everything it started."""

    name: str
    endpoint: str
    root: Path
    log: Path
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_daemon(name: str, directory: Path, certs: Certificates) -> Daemon:
    buildkitd = tool("buildkitd")
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "buildkitd.toml"
    config.write_text("".join(f'[registry."{host}"]\n  http = true\n  insecure = true\n' for host in REGISTRIES))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    log = directory / "buildkitd.log"
    with log.open("wb") as handle:
        # Its own session: kill() takes the daemon and the runc processes it started, nothing else.
        process = subprocess.Popen(
            [buildkitd, "--root", str(directory / "root"), "--addr", endpoint, "--config", str(config),
             "--oci-worker=true", "--containerd-worker=false",
             "--tlscert", str(certs.server.cert), "--tlskey", str(certs.server.key),
             "--tlscacert", str(certs.server.ca)],
            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    daemon = Daemon(name, endpoint, directory / "root", log, process)
    wait_ready(daemon, certs)
    return daemon


def buildctl(daemon: Daemon, certs: Certificates, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("buildctl"), "--addr", daemon.endpoint, "--tlscacert", str(certs.client.ca),
                           "--tlscert", str(certs.client.cert), "--tlskey", str(certs.client.key), *args],
                          capture_output=True, text=True, timeout=timeout)


def wait_ready(daemon: Daemon, certs: Certificates) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        if not daemon.alive:
            pytest.fail(f"buildkitd {daemon.name} exited ({daemon.process.returncode}):\n{daemon.output()[-3000:]}",
                        pytrace=False)
        if buildctl(daemon, certs, "debug", "workers").returncode == 0:
            return
        if time.monotonic() > deadline:
            daemon.kill()
            pytest.fail(f"buildkitd {daemon.name} not answering after {READY_S} s:\n{daemon.output()[-3000:]}",
                        pytrace=False)
        time.sleep(0.5)


def stop_daemon(daemon: Daemon) -> None:
    """Stop it (if the test did not kill it) and unmount what a killed daemon left mounted under its root."""
    if daemon.alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(daemon.process.pid, signal.SIGTERM)
        try:
            daemon.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
    with contextlib.suppress(ProcessLookupError):  # runc children of a daemon that ignored SIGTERM
        os.killpg(daemon.process.pid, signal.SIGKILL)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
              if line.split()[1].startswith(str(daemon.root))]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)


@dataclass(frozen=True)
class Pool:
    daemons: tuple[Daemon, ...]
    certs: Certificates
    builders_file: Path

    def daemon(self, name: str) -> Daemon:
        return next(d for d in self.daemons if d.name == name)


def builders_yaml(daemons: tuple[Daemon, ...], certs: Certificates, concurrency: int = 1) -> str:
    lines = ["schema: 1", "builders:"]
    for daemon in daemons:
        lines += [f"  - name: {daemon.name}", f"    endpoint: {daemon.endpoint}",
                  f"    tls: {{ca: {certs.client.ca}, cert: {certs.client.cert}, key: {certs.client.key}}}",
                  "    platforms: [linux/amd64]", f"    concurrency: {concurrency}"]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def buildkit_pool(directory: Path, names: tuple[str, ...] = ("bk-a", "bk-b"), concurrency: int = 1) -> Iterator[Pool]:
    """`names` daemons, started and answering, and a builders file naming them; all stopped afterwards."""
    tool("buildctl")
    certs = Certificates.make(directory / "certs")
    daemons: list[Daemon] = []
    try:
        for name in names:
            daemons.append(start_daemon(name, directory / name, certs))
        builders_file = directory / "builders.yaml"
        builders_file.write_text(builders_yaml(tuple(daemons), certs, concurrency))
        yield Pool(tuple(daemons), certs, builders_file)
    finally:
        for daemon in daemons:
            stop_daemon(daemon)
