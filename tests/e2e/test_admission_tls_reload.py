"""The webhook's serving certificate rotated under load, for real: `imagebuild admission serve` runs with its pair
in a Secret volume laid out as the kubelet writes one (tests/secret_volume.py), while two threads send reviews
without pause, one over a kept-alive connection, one over a new connection each time. The pair moves to one
from another CA, through broken pairs on the way; not one review may fail, and each new handshake must present
the newest pair that loads. The client trusts every CA involved, as the API server's caBundle does during a
CA rotation."""
from __future__ import annotations

import hashlib
import http.client
import json
import socket
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from tests.secret_volume import MountedSecret

from .admission_harness import until
from .certs import Authority, Tls
from .test_admission import images, pod, registry, start_webhook, tls  # noqa: F401


def der(pair: Tls) -> bytes:
    return x509.load_pem_x509_certificate(pair.cert.read_bytes()).public_bytes(serialization.Encoding.DER)


def handshake(port: int, context: ssl.SSLContext) -> bytes:
    """The certificate a new connection is shown."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
        return conn.getpeercert(binary_form=True) or b""


@dataclass
class Traffic:
    """Reviews of an admitted Pod, back to back, until stopped; what failed, word for word."""

    url: str
    context: ssl.SSLContext
    image: str
    sent: dict[str, int] = field(default_factory=lambda: {"kept-alive": 0, "new connection": 0})
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for how in self.sent:
            thread = threading.Thread(target=self._send, args=(how,), name=f"traffic-{how}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def _send(self, how: str) -> None:
        headers = {"Content-Type": "application/json", **({"Connection": "close"} if how == "new connection" else {})}
        with httpx.Client(verify=self.context, timeout=10) as client:
            while not self._stop.is_set():
                review = pod(("app", self.image))
                try:
                    reply = client.post(f"{self.url}/validate", content=json.dumps(review).encode(), headers=headers)
                    response = reply.json()["response"] if reply.status_code == 200 else {}
                    if response.get("uid") != review["request"]["uid"] or response.get("allowed") is not True:
                        self.failures.append(f"{how}: HTTP {reply.status_code}: {reply.text[:300]}")
                except (httpx.HTTPError, ValueError, KeyError) as err:
                    self.failures.append(f"{how}: {type(err).__name__}: {err}")
                self.sent[how] += 1


def test_a_rotated_pair_serves_new_handshakes_and_no_review_fails_while_broken_pairs_are_ignored(
        start_webhook, images, tmp_path: Path):  # noqa: F811
    first, second, third = (Authority.new(f"imagebuild test CA {n}").issue(
        tmp_path / f"ca-{n}", "imagebuild-admission", ("localhost", "127.0.0.1")) for n in (1, 2, 3))
    bundle = tmp_path / "ca-bundle.pem"
    bundle.write_text("".join(pair.ca.read_text() for pair in (first, second, third)))
    secret = MountedSecret(tmp_path / "tls")
    secret.publish_files(first.cert, first.key)
    webhook = start_webhook(serving=Tls(bundle, secret.cert, secret.key))
    port, context = webhook.port, ssl.create_default_context(cafile=str(bundle))
    assert handshake(port, context) == der(first)
    assert webhook.events("serving")[0]["certificate"] == hashlib.sha256(der(first)).hexdigest()

    held = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)  # a connection kept open
    assert _review_over(held, images.signed) == (200, None)
    traffic = Traffic(webhook.url, context, images.signed)
    traffic.start()
    try:
        # A Secret update whose key is not its certificate's: ignored, one line, the pair in use serves on.
        secret.publish(second.cert.read_bytes(), first.key.read_bytes())
        until(lambda: len(webhook.events("tls_reload_failed")) == 1, "the broken pair is noticed")
        assert handshake(port, context) == der(first)

        # The good pair, from another CA: new handshakes get it.
        secret.publish_files(second.cert, second.key)
        until(lambda: handshake(port, context) == der(second), "new handshakes present the new certificate")
        # The connection opened before finishes its request on the old pair, then is closed.
        assert held.sock is not None and held.sock.getpeercert(binary_form=True) == der(first)  # type: ignore[attr-defined]
        assert _review_over(held, images.signed) == (200, "close")

        # A pair written one file after the other: the certificate first (with the old key, it fails), then the key.
        secret.rewrite("tls.crt", third.cert.read_bytes())
        until(lambda: len(webhook.events("tls_reload_failed")) == 2, "the half-written pair is noticed")
        assert handshake(port, context) == der(second)
        secret.rewrite("tls.key", third.key.read_bytes())
        until(lambda: handshake(port, context) == der(third), "the completed pair is served")
        sent = sum(traffic.sent.values())
        until(lambda: sum(traffic.sent.values()) > sent + 50, "reviews on the newest pair, too")
    finally:
        traffic.stop()
    print(f"\nreviews during the rotation: {traffic.sent}, failed: {len(traffic.failures)}")
    assert traffic.failures == []
    assert min(traffic.sent.values()) >= 20, traffic.sent  # both kinds of connection were busy throughout
    assert [line["sha256"] for line in webhook.events("tls_reloaded")] == [
        hashlib.sha256(der(pair)).hexdigest() for pair in (second, third)]
    failed = webhook.events("tls_reload_failed")
    assert len(failed) == 2 and all("KEY_VALUES_MISMATCH" in line["error"] for line in failed), failed
    assert "PRIVATE KEY" not in webhook.log_path.read_text()
    assert webhook.stop() == 0


def _review_over(connection: http.client.HTTPSConnection, image: str) -> tuple[int, str | None]:
    review = pod(("app", image))
    connection.request("POST", "/validate", body=json.dumps(review).encode(),
                       headers={"Content-Type": "application/json"})
    reply = connection.getresponse()
    answer = json.loads(reply.read())
    assert answer["response"]["uid"] == review["request"]["uid"] and answer["response"]["allowed"] is True, answer
    return reply.status, reply.getheader("Connection")
