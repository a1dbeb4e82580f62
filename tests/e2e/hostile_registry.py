"""A hostile registry of the tests' own, on loopback: just enough of Distribution's API to serve what
someone with push rights could put in a covered repository or in the state repository.

- `hostile/app:v1`, a small unsigned image whose `.sig` and `.att` tags list LAYERS layers of BLOB
  bytes each; every blob GET streams that many zeros (no digest matches);
- `hostile/state`, quarantine marks as given by the test (`marks[tag] = (manifest, blob)`), so that
  a mark whose blob does not hash to its descriptor can be served (a real registry refuses to store it).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .rollout_harness import free_port

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class HostileRegistry:
    """Distribution's API, just enough of it. /v2/hostile/app holds three unsigned images: `many` (its `.sig` and
    `.att` manifests list MANY layers), `huge` (FEW layers, each said to be BLOB bytes) and `liar` (FEW layers
    said to be small); every blob GET streams BLOB bytes of zeros, whatever the descriptor said."""

    MANY = 1000
    FEW = 16
    BLOB = 64 << 20
    REPOSITORY = "hostile/app"
    STATE = "hostile/state"

    def __init__(self) -> None:
        self.tags: dict[str, bytes] = {}  # tag or digest -> manifest
        for name, count, size in (("many", self.MANY, self.BLOB), ("huge", self.FEW, self.BLOB),
                                  ("liar", self.FEW, 300)):
            self._image(name, count, size)
        self.blob_bytes_sent = 0
        self.marks: dict[str, tuple[bytes, bytes]] = {}  # tag in STATE -> (manifest, the blob served for its layer)
        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def mark(self, digest: str, record: dict, blob: bytes | None = None) -> None:
        """A quarantine mark for `digest` in STATE, as imagebuild writes one, whose layer is served as `blob`
        (by default the record itself; anything else does not hash to the descriptor)."""
        content = json.dumps(record).encode()
        config = b"{}"
        raw = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                          "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": sha256(config),
                                     "size": 2},
                          "layers": [{"mediaType": "application/vnd.imagebuild.quarantine.v1+json",
                                      "digest": sha256(content), "size": len(content)}]}).encode()
        self.marks["quarantine-" + digest.replace(":", "-")] = (raw, content if blob is None else blob)

    def _image(self, tag: str, layers: int, size: int) -> None:
        config, layer = b"{}", f"not a tarball: {tag}".encode()
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": sha256(config), "size": 2},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha256(layer),
                        "size": len(layer)}]}).encode()
        junk = [{"mediaType": "application/vnd.dev.cosign.simplesigning.v1+json",
                 "digest": sha256(f"{tag}{i}".encode()), "size": size,
                 "annotations": {"dev.cosignproject.cosign/signature": base64.b64encode(os.urandom(72)).decode()}}
                for i in range(layers)]
        signatures = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                 "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                            "digest": sha256(config), "size": 2},
                                 "layers": junk}).encode()
        signature_tag = sha256(manifest).replace(":", "-")
        self.tags.update({tag: manifest, sha256(manifest): manifest, f"{signature_tag}.sig": signatures,
                          f"{signature_tag}.att": signatures})

    def image(self, tag: str) -> str:
        return f"127.0.0.1:{self.port}/{self.REPOSITORY}:{tag}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _manifest_for(self, reference: str) -> bytes | None:
        return self.tags.get(reference)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hostile = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                prefix = f"/v2/{hostile.REPOSITORY}/"
                path = self.path.split("?", 1)[0]
                if path == "/v2/":
                    return self._send(200, b"{}", "application/json", head)
                if path.startswith(f"/v2/{hostile.STATE}/"):
                    return self._state(path[len(f"/v2/{hostile.STATE}/"):], head)
                if path.startswith(prefix + "manifests/"):
                    raw = hostile._manifest_for(path[len(prefix + "manifests/"):])
                    if raw is not None:
                        return self._send(200, raw, OCI_MANIFEST, head, digest=sha256(raw))
                if path.startswith(prefix + "blobs/"):
                    return self._junk(head)
                return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "application/json", head)

            def _state(self, rest: str, head: bool) -> None:
                kind, _, reference = rest.partition("/")
                for tag, (raw, blob) in hostile.marks.items():
                    if kind == "manifests" and reference in (tag, sha256(raw)):
                        return self._send(200, raw, OCI_MANIFEST, head, digest=sha256(raw))
                    if kind == "blobs" and reference == json.loads(raw)["layers"][0]["digest"]:
                        return self._send(200, blob, "application/octet-stream", head)
                return self._send(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', "application/json", head)

            def _send(self, status: int, body: bytes, content_type: str, head: bool, digest: str | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _junk(self, head: bool) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(hostile.BLOB))
                self.end_headers()
                if head:
                    return
                chunk = bytes(1 << 20)
                try:
                    for _ in range(hostile.BLOB // len(chunk)):
                        self.wfile.write(chunk)
                        hostile.blob_bytes_sent += len(chunk)
                except OSError:
                    self.close_connection = True

        return Handler


