"""The webhook's serving certificate is read again when its files change, and a pair that does not load is
ignored: `ServingCertificate`, in-process, with the clock in the test's hands and real TLS handshakes over
memory buffers. (tests/e2e/test_admission_tls_reload.py rotates the pair under a running webhook.)"""
from __future__ import annotations

import hashlib
import io
import json
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from imagebuild.admission.server import DecisionLog, ServingCertificate
from tests.harbor_standin import tls as test_tls
from tests.secret_volume import MountedSecret


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.5) -> None:
        self.now += seconds


def pki(directory: Path) -> test_tls.TestPKI:
    directory.mkdir(parents=True)
    return test_tls.make_pki(directory)


def der(pki_: test_tls.TestPKI) -> bytes:
    return x509.load_pem_x509_certificate(pki_.cert_pem.read_bytes()).public_bytes(serialization.Encoding.DER)


def presented(server_context: ssl.SSLContext, *cas: test_tls.TestPKI) -> bytes:
    """The certificate a client sees in a full TLS handshake with this context (the client trusts CAS)."""
    client_context = ssl.create_default_context(cadata="".join(ca.ca_pem.read_text() for ca in cas))
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_in, client_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(client_in, client_out, server_hostname="127.0.0.1")
    server = server_context.wrap_bio(to_server, to_client, server_side=True)
    done = {id(client): False, id(server): False}
    for _ in range(10):
        for side in (client, server):
            try:
                side.do_handshake()
                done[id(side)] = True
            except ssl.SSLWantReadError:
                pass
        to_server.write(client_out.read())
        client_in.write(to_client.read())
        if all(done.values()):
            return client.getpeercert(binary_form=True)  # type: ignore[return-value]
    raise AssertionError("the handshake did not finish")


@pytest.fixture
def setting(tmp_path: Path) -> tuple[MountedSecret, test_tls.TestPKI, test_tls.TestPKI, Clock, io.StringIO, ServingCertificate]:
    first, second = pki(tmp_path / "ca-1"), pki(tmp_path / "ca-2")
    secret = MountedSecret(tmp_path / "tls")
    secret.publish_files(first.cert_pem, first.key_pem)
    clock, stream = Clock(), io.StringIO()
    certificate = ServingCertificate(secret.cert, secret.key, DecisionLog(stream), clock=clock)
    return secret, first, second, clock, stream, certificate


def events(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_new_pair_behind_the_secret_s_data_link_serves_new_handshakes(setting) -> None:
    secret, first, second, clock, stream, certificate = setting
    old = certificate.current()
    assert presented(old, first, second) == der(first)
    secret.publish_files(second.cert_pem, second.key_pem)
    clock.advance()
    new = certificate.current()
    assert new is not old and presented(new, first, second) == der(second)
    assert not certificate.is_current(old) and certificate.generation == 1
    (line,) = events(stream)
    assert line["event"] == "tls_reloaded" and line["issuer"] == "CN=imagebuild test CA"
    assert line["sha256"] == hashlib.sha256(der(second)).hexdigest()


def test_the_files_are_looked_at_at_most_once_per_interval(setting) -> None:
    secret, _, second, clock, stream, certificate = setting
    old = certificate.current()
    secret.publish_files(second.cert_pem, second.key_pem)
    clock.advance(0.5)
    assert certificate.current() is old  # within the interval: not even a stat
    clock.advance(0.6)
    assert certificate.current() is not old


def test_unchanged_files_are_not_loaded_again(setting) -> None:
    _, _, _, clock, stream, certificate = setting
    old = certificate.current()
    for _ in range(3):
        clock.advance()
        assert certificate.current() is old
    assert certificate.generation == 0 and events(stream) == []


def test_a_key_that_is_not_the_certificate_s_keeps_the_pair_in_use_with_one_log_line(setting) -> None:
    secret, first, second, clock, stream, certificate = setting
    old = certificate.current()
    secret.publish(second.cert_pem.read_bytes(), first.key_pem.read_bytes())  # a certificate and someone else's key
    for _ in range(3):
        clock.advance()
        assert certificate.current() is old
    assert presented(certificate.current(), first, second) == der(first)
    (line,) = events(stream)
    assert line["event"] == "tls_reload_failed" and "KEY_VALUES_MISMATCH" in line["error"]
    assert line["kept"] == "the pair in use"


def test_a_pair_written_one_file_at_a_time_loads_once_its_second_file_lands(setting) -> None:
    secret, first, second, clock, stream, certificate = setting
    old = certificate.current()
    secret.rewrite("tls.crt", second.cert_pem.read_bytes())  # the new certificate beside the old key: half written
    clock.advance()
    assert certificate.current() is old
    secret.rewrite("tls.key", second.key_pem.read_bytes())
    clock.advance()
    assert presented(certificate.current(), first, second) == der(second)
    assert [line["event"] for line in events(stream)] == ["tls_reload_failed", "tls_reloaded"]


@pytest.mark.parametrize("cert, key", [
    (b"-----BEGIN CERTIFICATE-----\ntruncated", None),
    (b"", b""),
    (None, b"not a key at all\n"),
])
def test_an_unparsable_pair_is_ignored_and_no_key_material_reaches_the_log(setting, cert, key) -> None:
    secret, first, second, clock, stream, certificate = setting
    old = certificate.current()
    secret.publish(cert if cert is not None else second.cert_pem.read_bytes(),
                   key if key is not None else second.key_pem.read_bytes())
    clock.advance()
    assert certificate.current() is old
    (line,) = events(stream)
    assert line["event"] == "tls_reload_failed"
    body = b"".join(second.key_pem.read_bytes().splitlines()[1:-1]).decode()
    assert "PRIVATE" not in stream.getvalue() and body[:40] not in stream.getvalue()


def test_a_pair_whose_files_are_gone_for_a_moment_keeps_serving(setting) -> None:
    secret, first, second, clock, stream, certificate = setting
    old = certificate.current()
    (secret.root / "..data").unlink()  # between the kubelet's remove and its rename, say
    clock.advance()
    assert certificate.current() is old
    assert [line["event"] for line in events(stream)] == ["tls_reload_failed"]
    secret.publish_files(second.cert_pem, second.key_pem)
    clock.advance()
    assert presented(certificate.current(), first, second) == der(second)


def test_the_first_pair_must_load(tmp_path: Path) -> None:
    first, second = pki(tmp_path / "ca-1"), pki(tmp_path / "ca-2")
    with pytest.raises(ssl.SSLError, match="KEY_VALUES_MISMATCH"):
        ServingCertificate(first.cert_pem, second.key_pem)
