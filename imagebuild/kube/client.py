"""Requests to a Kubernetes API server over verified TLS, and the Lease calls a rollout needs.

TLS is verified against the kubeconfig's CA (or the system's CAs when it names none), and the client
certificate, when there is one, is loaded into the TLS context: PEM data from the kubeconfig goes
through a private temporary file that is removed once loaded (Python's ssl reads certificates from
files only). The token travels only in the Authorization header: no message, repr or log line of this
module carries a header, a token or a key. Retries come from the caller, as a wrapper around the
transport (rollout wraps it in oci.retry's RetryingTransport): this module has no retry loop of its own.

Every failure is a KubeError (exit 3: the cluster is unreachable, refuses the credentials or answers
something else), a KubeConflict for 409 (AlreadyExists, or a resourceVersion that is no longer the
current one), or, for a Lease document that cannot be trusted, leases.LeaseDocumentError.
"""
from __future__ import annotations

import json
import os
import ssl
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.source import safe_text
from imagebuild.kube.config import ClusterAccess
from imagebuild.kube.leases import Lease, parse_lease

MAX_BODY = 1 << 20  # a Lease is a few hundred bytes; nothing we ask for is larger than this
TransportWrapper = Callable[[httpx.BaseTransport], httpx.BaseTransport]


class KubeError(ImagebuildError):
    """The API server could not be reached, refused the request, or answered something unusable (exit 3)."""

    exit_code = ExitCode.ENVIRONMENT

    def __init__(self, message: str, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason


class KubeConflict(KubeError):
    """409: the object exists already (reason AlreadyExists), or was changed since it was read (Conflict)."""


def tls_context(access: ClusterAccess) -> ssl.SSLContext:
    """A client TLS context that trusts the kubeconfig's CA (else the system's) and shows its client certificate."""
    where = f"{access.kubeconfig}: context {access.context}"
    try:
        context = ssl.create_default_context(cafile=str(access.ca_file) if access.ca_file else None,
                                             cadata=access.ca_pem)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise KubeError(f"{where}: the certificate authority cannot be loaded ({_ssl_reason(exc)})") from None
    if access.client_cert_file or access.client_cert_pem:
        _load_client_certificate(context, access, where)
    return context


def _ssl_reason(exc: BaseException) -> str:
    """What ssl says went wrong, without anything it read (its messages name a library and a reason)."""
    if isinstance(exc, ssl.SSLError):
        return safe_text(exc.reason or exc.__class__.__name__, 100)
    return safe_text(getattr(exc, "strerror", None) or exc.__class__.__name__, 100)


def _load_client_certificate(context: ssl.SSLContext, access: ClusterAccess, where: str) -> None:
    with tempfile.TemporaryDirectory(prefix="imagebuild-kube-") as private:  # mode 0700
        def path(file: Path | None, pem: bytes | None, name: str) -> str:
            if file is not None:
                return str(file)
            target = os.path.join(private, name)
            descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "wb") as stream:
                stream.write(pem or b"")
            return target

        try:
            context.load_cert_chain(path(access.client_cert_file, access.client_cert_pem, "cert.pem"),
                                    path(access.client_key_file, access.client_key_pem, "key.pem"),
                                    password=_no_password)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise KubeError(f"{where}: the client certificate or its key cannot be loaded "
                            f"({_ssl_reason(exc)})") from None


def _no_password() -> str:
    raise ValueError("an encrypted client key is not supported")


class KubeClient:
    """JSON requests to one API server as one user. `wrap` adds the caller's retries around the transport."""

    def __init__(self, access: ClusterAccess, *, wrap: TransportWrapper | None = None, timeout_s: float = 10.0):
        self.access = access
        self.server = access.server
        transport: httpx.BaseTransport = httpx.HTTPTransport(verify=tls_context(access))
        if wrap is not None:
            transport = wrap(transport)
        headers = {"Accept": "application/json", "User-Agent": "imagebuild"}
        if access.token is not None:
            headers["Authorization"] = f"Bearer {access.token}"
        # trust_env off: no proxy from the environment, and no ~/.netrc credentials added to a request.
        self._http = httpx.Client(base_url=access.server, transport=transport, headers=headers,
                                  timeout=timeout_s, trust_env=False, follow_redirects=False)

    def __repr__(self) -> str:
        return f"KubeClient({self.server!r}, context {self.access.context!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The JSON object the server answered; None for 404 on a GET or DELETE. Else KubeError/KubeConflict."""
        what = f"kubernetes API {self.server}: {method} {path}"
        content = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else {}
        try:
            with self._http.stream(method, path, content=content, headers=headers) as response:
                raw = _read_limited(response, what)
        except httpx.TransportError as exc:
            raise KubeError(f"{what}: unreachable ({_transport_reason(exc)})") from None
        status = response.status_code
        data = _json_object(raw)
        if status == 404 and method in ("GET", "DELETE"):
            return None
        if 200 <= status < 300:
            if data is None:
                raise KubeError(f"{what}: the answer is not a JSON object", status)
            return data
        reason, message = _status_of(data)
        line = f"{what}: {status} {reason or response.reason_phrase}" + (f": {message}" if message else "")
        if status in (401, 403):
            line += f" (authenticating with {self.access.authentication} from {self.access.kubeconfig})"
        if status == 409:
            raise KubeConflict(line, status, reason)
        raise KubeError(line, status, reason)

    # --- coordination.k8s.io/v1 Leases -------------------------------------------------------

    @staticmethod
    def _leases(namespace: str) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    def get_lease(self, namespace: str, name: str) -> Lease | None:
        found = self.request("GET", f"{self._leases(namespace)}/{name}")
        return None if found is None else parse_lease(found, f"{namespace}/{name}")

    def create_lease(self, body: dict[str, Any]) -> Lease:
        """POST: KubeConflict (AlreadyExists) when a lease of that name exists."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        created = self.request("POST", self._leases(namespace), body)
        return parse_lease(created, f"{namespace}/{name}")

    def replace_lease(self, body: dict[str, Any]) -> Lease:
        """PUT with the body's metadata.resourceVersion: KubeConflict when the lease changed since that version."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        replaced = self.request("PUT", f"{self._leases(namespace)}/{name}", body)
        return parse_lease(replaced, f"{namespace}/{name}")

    def delete_lease(self, lease: Lease) -> bool:
        """DELETE only if it is still this very object at this version (preconditions uid and resourceVersion):
        False when it was gone already; KubeConflict when it changed since it was read."""
        options = {"kind": "DeleteOptions", "apiVersion": "v1",
                   "preconditions": {"uid": lease.uid, "resourceVersion": lease.resource_version}}
        return self.request("DELETE", f"{self._leases(lease.namespace)}/{lease.name}", options) is not None


def _read_limited(response: httpx.Response, what: str) -> bytes:
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > MAX_BODY:
            raise KubeError(f"{what}: the answer is longer than {MAX_BODY} bytes; refused", response.status_code)
        chunks.append(chunk)
    return b"".join(chunks)


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _status_of(data: dict[str, Any] | None) -> tuple[str | None, str | None]:
    """A metav1.Status answer's reason and message, escaped and bounded (it is the server's text)."""
    if data is None or data.get("kind") != "Status":
        return None, None
    reason, message = data.get("reason"), data.get("message")
    return (safe_text(reason, 60) if isinstance(reason, str) and reason else None,
            safe_text(message, 300) if isinstance(message, str) and message else None)


def _transport_reason(exc: httpx.TransportError) -> str:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"TLS: certificate verify failed: {safe_text(seen.verify_message or seen.reason, 160)}"
        seen = seen.__cause__ or seen.__context__
    return f"{exc.__class__.__name__}: {safe_text(str(exc), 200)}" if str(exc) else exc.__class__.__name__
