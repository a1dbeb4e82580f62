"""The webhook image's smoke suite: run inside it by `imagebuild admission image`, as the image's own
user, with a read-only root, no network and no capabilities (the same runner as the Paddle images).

The webhook's command line works without a shell, the venv holds exactly the pinned distributions,
and the server starts and answers /healthz, /readyz and a review over TLS on the loopback.
Expectations come from imagebuild (`extra.distributions`: the pins of release/admission_image.py).
"""
from __future__ import annotations

import http.client
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sysconfig
import time
import uuid
from pathlib import Path

import pytest

# The checks every imagebuild image passes, collected here too: the image's own non-root user, no
# setuid or setgid file, the labels imagebuild expects (the source hash and the base digest among them).
from test_abi import (  # noqa: F401
    test_labels_match_the_matrix,
    test_no_unexpected_setuid_or_setgid_files,
    test_runs_as_the_non_root_user,
)

pytestmark = pytest.mark.abi
VENV = Path("/opt/venv")
SHELLS = ("sh", "bash", "dash", "rbash", "ash", "zsh", "busybox")
SERVER_START_S = 30.0


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_venv_holds_exactly_imagebuild_and_the_pinned_distributions(expect):
    site = sysconfig.get_paths()["purelib"]
    assert site.startswith(str(VENV)), f"the image's python is not the venv's ({site})"
    found = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[site])}
    assert "imagebuild" in found, f"imagebuild is not installed in {site}"
    found.pop("imagebuild")
    wanted = {canonical(name): version for name, version in expect.extra["distributions"].items()}
    assert found == wanted, "the venv differs from the pins: " + ", ".join(
        f"{n}: {found.get(n, 'missing')} (pinned {wanted.get(n, 'not at all')})"
        for n in sorted(set(found) | set(wanted)) if found.get(n) != wanted.get(n))


def test_there_is_no_shell():
    present = [name for name in SHELLS if shutil.which(name, path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")]
    assert not present, f"shells left in the image: {', '.join(present)}"
    assert not os.path.lexists("/bin/sh") and not os.path.lexists("/usr/bin/sh")


def test_it_runs_on_a_read_only_root():
    # The runner starts the container with --read-only; every other test here runs on that root.
    root = next(line.split() for line in Path("/proc/mounts").read_text().splitlines() if line.split()[1] == "/")
    assert "ro" in root[3].split(","), f"the root file system is mounted {root[3]}"


def test_the_entry_point_is_the_venv_script_run_without_a_shell():
    script = VENV / "bin" / "imagebuild"
    first = script.read_text().splitlines()[0]
    assert first.startswith(f"#!{VENV}/bin/python"), f"{script} starts with {first!r}"
    done = subprocess.run([str(script), "admission", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--tls-cert" in done.stdout and "--trust" in done.stdout


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made with the image's own cryptography."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "imagebuild-admission-smoke")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "tls.crt", folder / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _trust_file(folder: Path) -> Path:
    """A trust file covering registry.invalid/covered/** only, with a key nobody signs with."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    path = folder / "trust.yaml"
    path.write_text(json.dumps({"schema": 1, "mode": "enforce", "keys": [{"name": "smoke", "pem": pem}],
                                "images": ["registry.invalid/covered/**"], "failure_policy": "fail"}))
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _request(port: int, context: ssl.SSLContext, method: str, path: str, body: bytes | None = None):
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_the_server_answers_healthz_readyz_and_a_review_over_tls(tmp_path):
    cert, key = _certificate(tmp_path)
    port = _free_port()
    log = (tmp_path / "server.log").open("w+")
    server = subprocess.Popen(["imagebuild", "admission", "serve", "--trust", str(_trust_file(tmp_path)),
                               "--tls-cert", str(cert), "--tls-key", str(key), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    context = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                status, body = _request(port, context, "GET", "/healthz")
                break
            except OSError:
                assert server.poll() is None, f"the server exited ({server.returncode}): {_text(log)}"
                assert time.monotonic() < deadline, f"no answer on {port} in {SERVER_START_S:g} s: {_text(log)}"
                time.sleep(0.2)
        assert (status, body) == (200, b"ok\n")
        assert _request(port, context, "GET", "/readyz")[0] == 200
        uid = str(uuid.uuid4())
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE",
            "namespace": "smoke", "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                             "spec": {"containers": [{"name": "c", "image": "registry.invalid/other/x:1"}]}}}}
        status, body = _request(port, context, "POST", "/validate", json.dumps(review).encode())
        assert status == 200, body
        response = json.loads(body)["response"]
        # Refused without a registry call: the image is outside the file's images.
        assert response["uid"] == uid and response["allowed"] is False
        assert "not covered" in response["status"]["message"], response
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=30)
        finally:
            server.kill()
            server.wait()
            log.close()
    assert code == 0, f"SIGTERM: exit {code}"


def _text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-2000:]
