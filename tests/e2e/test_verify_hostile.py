"""imagebuild verify against someone who can push to a covered repository (README: threat model).

Attacks with real cosign signatures in the real staging registry: reordering the unsigned `.att`
manifest so that a superseded vuln report wins, taking the newest release record away, a signed
image copied under another repository's name, and a forged attestation whose self-declared type
carries terminal escapes. Then a hostile registry of the test's own on loopback that stuffs an
unsigned image's `.sig` and `.att` tags with many large layers: `imagebuild verify` refuses it
reading kilobytes, and its peak RSS stays under 100 MB.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.trust.provenance import canonical_sha256

from .conftest import REPO, imagebuild, trust_config
from .test_verify import STRICT, attest_all, covering, refused_line, vuln_predicate
from .tools import Image, crane

RELEASE_TYPE = "https://imagebuild.dev/attestations/release/v1"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DSSE = "application/vnd.dsse.envelope.v1+json"


def verify(*args: str):
    return imagebuild("verify", *args, timeout=120)


def att_manifest(image: Image) -> dict:
    registry, repository = image.repository.split("/", 1)
    response = httpx.get(f"http://{registry}/v2/{repository}/manifests/{image.signature_tag('.att')}",
                         headers={"Accept": OCI_MANIFEST})
    response.raise_for_status()
    return response.json()


def put_att_manifest(image: Image, manifest: dict) -> None:
    """What an attacker with push rights does: rewrite the (unsigned) `.att` manifest."""
    registry, repository = image.repository.split("/", 1)
    response = httpx.put(f"http://{registry}/v2/{repository}/manifests/{image.signature_tag('.att')}",
                         content=json.dumps(manifest).encode(), headers={"Content-Type": OCI_MANIFEST})
    assert response.status_code == 201, response.text


def layer_type(layer: dict) -> str:
    return (layer.get("annotations") or {}).get("predicateType", "")


def vuln_digest_as_attested(cosign_cli, image: Image, public: Path, finished: str) -> str:
    """The canonical sha256 of the vuln predicate cosign actually wrote (it re-encodes the vuln shape)."""
    for statement in cosign_cli.statements(image.by_digest, public, "vuln"):
        if statement["predicate"]["metadata"]["scanFinishedOn"] == finished:
            return canonical_sha256(statement["predicate"])
    raise AssertionError(f"no vuln statement finished {finished}")


@pytest.fixture
def superseded(push, cosign_cli, our_key, tmp_path):
    """A signed image whose `.att` holds a clean report and its release record, then a newer report with a
    CRITICAL and the newer release record naming it (attested without --replace: both stay)."""
    image = push()
    cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, image, our_key, tmp_path, vuln=None)
    old_finished, new_finished = "2026-11-01T00:01:00Z", "2026-11-20T00:01:00Z"
    for finished, issued, findings in ((old_finished, "2026-11-01T00:05:00Z", [("CVE-2026-0002", "zlib1g", "HIGH")]),
                                       (new_finished, "2026-11-20T00:05:00Z", [("CVE-2026-0001", "openssl", "CRITICAL")])):
        predicate = vuln_predicate(*findings)
        predicate["metadata"] = {"scanStartedOn": finished, "scanFinishedOn": finished}
        cosign_cli.attest(image, our_key, "vuln", predicate, tmp_path)
        vouched = vuln_digest_as_attested(cosign_cli, image, our_key.public, finished)
        cosign_cli.attest(image, our_key, RELEASE_TYPE, {"digest": image.digest, "issued_at": issued,
                                                         "attestations": {"vuln": vouched}}, tmp_path)
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    return image, config


def test_reordering_the_att_layers_never_lets_the_superseded_clean_report_win(superseded):
    image, config = superseded
    manifest = att_manifest(image)
    layers = manifest["layers"]
    assert [layer_type(layer) for layer in layers].count(RELEASE_TYPE) == 2
    for order in (layers, layers[::-1], sorted(layers, key=lambda layer: layer_type(layer) != RELEASE_TYPE)):
        put_att_manifest(image, {**manifest, "layers": order})
        run = verify("--config", str(config), image.by_digest)
        assert run.returncode == 1, run.stdout
        assert "CVE-2026-0001 (openssl, CRITICAL)" in refused_line(run, image.by_digest)


def test_taking_the_newest_release_record_away_refuses_instead_of_rolling_back(superseded):
    image, config = superseded
    manifest = att_manifest(image)
    newest_record = [layer for layer in manifest["layers"] if layer_type(layer) == RELEASE_TYPE][-1]
    put_att_manifest(image, {**manifest, "layers": [layer for layer in manifest["layers"] if layer != newest_record]})
    run = verify("--config", str(config), image.by_digest)
    assert run.returncode == 1
    assert "made after the newest release record" in refused_line(run, image.by_digest)


def test_two_reports_without_a_release_record_conflict(push, cosign_cli, our_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, image, our_key, tmp_path)
    cosign_cli.attest(image, our_key, "vuln", vuln_predicate(("CVE-2026-0003", "bash", "LOW")), tmp_path)
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    run = verify("--config", str(config), image.by_digest)
    assert run.returncode == 1
    assert "2 different vuln attestations and no release record naming one" in refused_line(run, image.by_digest)


def test_a_signed_image_copied_under_another_repository_name_is_refused(push, cosign_cli, our_key):
    debug_tools = push()
    cosign_cli.sign(debug_tools, our_key)
    production = Image(debug_tools.repository + "-prod", "v1", debug_tools.digest)
    crane("copy", debug_tools.by_digest, production.by_tag)
    crane("copy", f"{debug_tools.repository}:{debug_tools.signature_tag()}",
          f"{production.repository}:{production.signature_tag()}")
    assert verify("--key", str(our_key.public), debug_tools.by_digest).returncode == 0
    run = verify("--key", str(our_key.public), production.by_tag)
    assert run.returncode == 1
    signed_path = debug_tools.repository.split("/", 1)[1]
    assert f"the signature is for repository {signed_path}, not {signed_path}-prod" in refused_line(run, production.by_tag)


def forged_envelope(digest: str, predicate_type: str) -> bytes:
    """A DSSE envelope signed by a key nobody trusts, claiming whatever type it likes."""
    statement = {"_type": "https://in-toto.io/Statement/v1", "predicateType": predicate_type,
                 "subject": [{"name": "x", "digest": {"sha256": digest.split(":")[1]}}], "predicate": {}}
    payload = json.dumps(statement).encode()
    pae = b"DSSEv1 %d %s %d %s" % (len(b"application/vnd.in-toto+json"), b"application/vnd.in-toto+json",
                                   len(payload), payload)
    signature = ec.generate_private_key(ec.SECP256R1()).sign(pae, ec.ECDSA(hashes.SHA256()))
    return json.dumps({"payloadType": "application/vnd.in-toto+json", "payload": base64.b64encode(payload).decode(),
                       "signatures": [{"sig": base64.b64encode(signature).decode()}]}).encode()


def put_blob(image: Image, content: bytes) -> dict:
    registry, repository = image.repository.split("/", 1)
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    started = httpx.post(f"http://{registry}/v2/{repository}/blobs/uploads/")
    location = httpx.URL(f"http://{registry}").join(started.headers["location"])
    done = httpx.put(location.copy_merge_params({"digest": digest}), content=content)
    assert done.status_code == 201, done.text
    return {"mediaType": DSSE, "digest": digest, "size": len(content)}


def test_a_forged_attestations_terminal_escapes_are_printed_escaped(push, cosign_cli, our_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    hostile_type = "\x1b[2K\r\x1b[32m\u2714 verified\x1b[0m"
    layer = put_blob(image, forged_envelope(image.digest, hostile_type))
    config_blob = put_blob(image, b"{}")
    put_att_manifest(image, {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                             "config": {**config_blob, "mediaType": "application/vnd.oci.image.config.v1+json"},
                             "layers": [layer]})
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    for output_format in ("table", "json"):
        run = verify("--config", str(config), "--format", output_format, image.by_digest)
        assert run.returncode == 1
        assert "\x1b" not in run.stdout + run.stderr and "\r" not in run.stdout + run.stderr
    run = verify("--config", str(config), image.by_digest)
    assert "it claims to be \\x1b[2K\\r\\x1b[32m" in refused_line(run, image.by_digest)


# --- a hostile registry --------------------------------------------------------------------------------


@dataclass
class StuffedRegistry:
    """A registry that serves one tiny unsigned image whose `.sig` and `.att` tags are stuffed: 256
    signature layers whose blobs are all junk (declared small, served endlessly), and 256 attestation
    layers of 16 MB each. It counts the bytes it manages to send."""

    server: ThreadingHTTPServer = field(init=False)
    sent: int = 0
    paths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = b"{}"
        self.image = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                 "config": self._descriptor(self.config, "application/vnd.oci.image.config.v1+json"),
                                 "layers": []}).encode()
        self.digest = "sha256:" + hashlib.sha256(self.image).hexdigest()
        junk = [{"mediaType": "application/vnd.dev.cosign.simplesigning.v1+json",
                 "digest": "sha256:" + hashlib.sha256(b"%d" % i).hexdigest(), "size": 60_000,
                 "annotations": {"dev.cosignproject.cosign/signature": base64.b64encode(os.urandom(70)).decode()}}
                for i in range(256)]
        huge = [{"mediaType": DSSE, "digest": "sha256:" + hashlib.sha256(b"att%d" % i).hexdigest(),
                 "size": 16_000_000, "annotations": {"predicateType": "https://cosign.sigstore.dev/attestation/vuln/v1"}}
                for i in range(256)]
        self.signature_blobs = {layer["digest"] for layer in junk}
        self.tags = {self.digest.replace(":", "-") + ".sig": self._manifest(junk),
                     self.digest.replace(":", "-") + ".att": self._manifest(huge)}
        registry = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                registry.answer(self, body=False)

            def do_GET(self) -> None:
                registry.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def _descriptor(content: bytes, media_type: str) -> dict:
        return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(content).hexdigest(), "size": len(content)}

    def _manifest(self, layers: list[dict]) -> bytes:
        return json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": self._descriptor(self.config, "application/vnd.oci.image.config.v1+json"),
                           "layers": layers}).encode()

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        self.paths.append(handler.path)
        path = handler.path
        if path == "/v2/":
            return self._send(handler, b"{}", "application/json", body)
        if "/manifests/" in path:
            reference = path.rsplit("/", 1)[1]
            content = self.image if reference in ("v1", self.digest) else self.tags.get(reference)
            if content is None:
                return self._send(handler, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "application/json", body, 404)
            handler.send_response(200)
            handler.send_header("Content-Type", OCI_MANIFEST)
            handler.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(content).hexdigest())
            handler.send_header("Content-Length", str(len(content)))
            handler.end_headers()
            if body:
                handler.wfile.write(content)
                self.sent += len(content)
            return None
        if "/blobs/" in path:
            # Endless junk: a client that trusts the length it is sent holds all of it.
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(64 << 20))
            handler.end_headers()
            if body:
                chunk = b"\0" * (1 << 20)
                try:
                    for _ in range(64):
                        handler.wfile.write(chunk)
                        self.sent += len(chunk)
                except OSError:
                    pass
            return None
        return self._send(handler, b"{}", "application/json", body, 404)

    def _send(self, handler: BaseHTTPRequestHandler, content: bytes, media_type: str, body: bool,
              status: int = 200) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", media_type)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        if body:
            handler.wfile.write(content)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stuffed() -> Iterator[StuffedRegistry]:
    registry = StuffedRegistry()
    yield registry
    registry.stop()


# The CLI in a process of its own whose only child is `imagebuild verify`: RUSAGE_CHILDREN's peak RSS is its.
PEAK_RSS = """
import resource, subprocess, sys
proc = subprocess.run([sys.executable, "-m", "imagebuild", *sys.argv[1:]], capture_output=True, text=True)
sys.stdout.write(proc.stdout); sys.stderr.write(proc.stderr)
print("peak_rss_kib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(proc.returncode)
"""


def test_an_unsigned_image_with_stuffed_signature_tags_is_refused_in_kilobytes_and_under_100_mb(stuffed, our_key):
    run = subprocess.run([sys.executable, "-c", PEAK_RSS, "verify", "--key", str(our_key.public),
                          f"{stuffed.host}/evil/app:v1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "refused" in run.stderr
    peak_kib = int(run.stdout.rsplit("peak_rss_kib", 1)[1])
    print(f"imagebuild verify, stuffed unsigned image: peak RSS {peak_kib / 1024:.1f} MiB, "
          f"{stuffed.sent} bytes sent by the registry")
    assert peak_kib < 100 * 1024
    # The signature comes first and alone: no attestation blob is ever asked for, and at most
    # MAX_SIGNATURES_TRIED signature payloads, each cut off at its declared cap.
    asked = [path.rsplit("/", 1)[1] for path in stuffed.paths if "/blobs/" in path]
    assert asked and set(asked) <= stuffed.signature_blobs
    assert len(asked) <= 16
