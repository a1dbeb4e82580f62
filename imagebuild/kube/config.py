"""Reading a kubeconfig: which server, which CA to verify it against, and which credentials to show it.

The file goes through the same hostile-YAML loader as every input (imagebuild.core.source), and every
problem is one `file:line: key: message` InputError (exit 2). It holds secrets (a token, a client
key): no message, repr or log line ever quotes one of those values, only the key it was found under.

What is read, as kubectl reads it: `current-context` (or the context asked for), that context's cluster
(`server`, https only; `certificate-authority` or `certificate-authority-data`, else the system's CAs)
and user (`token` or `tokenFile`, or `client-certificate(-data)` with `client-key(-data)`). Relative
paths are relative to the kubeconfig's folder. What would weaken or bypass the checks, or run a program
(`insecure-skip-tls-verify: true`, `exec`, `auth-provider`, a password, impersonation, `proxy-url`,
`tls-server-name`), is refused by name rather than ignored.
"""
from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.core.source import PathKey, Reader, load_document

_SERVER = re.compile(r"https://[^\s/@?#]+(/[^\s?#]*)?")
# Keys whose values are secrets: their values are never shown, whatever is wrong with them.
SECRET_KEYS = frozenset({"token", "client-key-data", "password"})
_REFUSED = {
    "insecure-skip-tls-verify": "imagebuild always verifies the API server's certificate; give "
                                "certificate-authority or certificate-authority-data instead",
    "tls-server-name": "is not supported (the server's certificate must name the host in `server`)",
    "proxy-url": "is not supported (imagebuild talks to the API server directly)",
    "exec": "runs a program to get credentials; not supported: give a token, tokenFile or a client certificate",
    "auth-provider": "is not supported: give a token, tokenFile or a client certificate",
    "username": "basic authentication is not supported: give a token or a client certificate",
    "password": "basic authentication is not supported: give a token or a client certificate",
    "as": "impersonation is not supported", "as-uid": "impersonation is not supported",
    "as-groups": "impersonation is not supported", "as-user-extra": "impersonation is not supported",
}
_CLUSTER_KEYS = ("server", "certificate-authority", "certificate-authority-data", "extensions",
                 "disable-compression", "insecure-skip-tls-verify", "tls-server-name", "proxy-url")
_USER_KEYS = ("token", "tokenFile", "client-certificate", "client-certificate-data", "client-key",
              "client-key-data", "extensions", "exec", "auth-provider", "username", "password",
              "as", "as-uid", "as-groups", "as-user-extra")
MAX_TOKEN_FILE = 64 * 1024


@dataclass(frozen=True)
class ClusterAccess:
    """How to reach one cluster as one user. Secrets are left out of repr (and so of any log of it)."""

    kubeconfig: Path
    context: str
    server: str  # https://host[:port][/path], no trailing slash
    namespace: str | None = None  # the context's namespace, if it names one
    ca_file: Path | None = None
    ca_pem: str | None = field(default=None, repr=False)
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    client_cert_pem: bytes | None = field(default=None, repr=False)
    client_key_pem: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)

    @property
    def authentication(self) -> str:
        """How it authenticates, for messages: 'a token' or 'a client certificate' (never the secret)."""
        if self.token is not None:
            return "a token"
        return "a client certificate" if self.client_cert_pem or self.client_cert_file else "no credentials"


class _KubeconfigReader(Reader):
    def secret(self, value: Any, path: PathKey) -> str:
        """A secret's value, checked without ever showing it."""
        if not isinstance(value, str) or not value.strip():
            raise self.error(path, "expected a non-empty string (its value is not shown)")
        return value.strip()

    def named(self, value: Any, path: PathKey, section: str, inner: str) -> dict[str, dict[str, Any]]:
        """clusters/contexts/users: a list of {name, <inner>: {...}}, by name (a later duplicate is an error)."""
        found: dict[str, dict[str, Any]] = {}
        for index, item in enumerate(self.sequence(value if value is not None else [], path)):
            at = path + (index,)
            entry = self.mapping(item, at, required=("name",))
            name = self.string(entry["name"], at + ("name",))
            if name in found:
                raise self.error(at + ("name",), f"{section} '{name[:80]}' is defined twice")
            body = entry.get(inner) or {}
            found[name] = {"at": at + (inner,), "body": self.mapping(body, at + (inner,))}
        return found

    def data(self, value: Any, path: PathKey, secret: bool) -> bytes:
        text = self.secret(value, path) if secret else self.string(value, path)
        try:
            decoded = base64.b64decode("".join(text.split()), validate=True)
        except (binascii.Error, ValueError):
            raise self.error(path, "is not base64" + (" (its value is not shown)" if secret else "")) from None
        if b"-----BEGIN" not in decoded:
            raise self.error(path, "does not decode to PEM" + (" (its value is not shown)" if secret else ""))
        return decoded


def load_kubeconfig(path: Path, context: str | None = None) -> ClusterAccess:
    """The cluster and credentials of `context` (else the file's current-context); InputError otherwise."""
    path = Path(path)
    doc = load_document(path)
    r = _KubeconfigReader(doc)
    top = r.mapping(doc.data, ())
    base = path.parent
    contexts = r.named(top.get("contexts"), ("contexts",), "context", "context")
    clusters = r.named(top.get("clusters"), ("clusters",), "cluster", "cluster")
    users = r.named(top.get("users"), ("users",), "user", "user")
    if context is None:
        if not top.get("current-context"):
            raise r.error(("current-context",), "no current-context: name the context in release.yaml "
                                                "(lease.context)")
        context = r.string(top["current-context"], ("current-context",))
    if context not in contexts:
        known = ", ".join(sorted(contexts)[:8]) or "none"
        raise r.error(("contexts",), f"no context '{context[:80]}' (contexts: {known[:300]})")
    ctx_at, ctx = contexts[context]["at"], contexts[context]["body"]
    r.mapping(ctx, ctx_at, allowed=("cluster", "user", "namespace", "extensions"), required=("cluster",))
    cluster_name = r.string(ctx["cluster"], ctx_at + ("cluster",))
    if cluster_name not in clusters:
        raise r.error(ctx_at + ("cluster",), f"no cluster '{cluster_name[:80]}' under clusters")
    namespace = r.string(ctx["namespace"], ctx_at + ("namespace",)) if ctx.get("namespace") else None
    cluster_at, cluster = clusters[cluster_name]["at"], clusters[cluster_name]["body"]
    _refuse_keys(r, cluster, cluster_at, _CLUSTER_KEYS)
    r.mapping(cluster, cluster_at, required=("server",))
    server = r.string(cluster["server"], cluster_at + ("server",))
    if re.match(r"[a-z]+://[^/]*@", server):  # user:password@host: a secret; say nothing of the value
        raise r.error(cluster_at + ("server",), "credentials in the server URL are not supported (its value is not "
                                                "shown); give a token or a client certificate under users")
    if not _SERVER.fullmatch(server):
        raise r.error(cluster_at + ("server",), f"'{server[:100]}' is not an https:// URL without credentials "
                                                "(plain http would send the credentials in the clear)")
    access: dict[str, Any] = {"kubeconfig": path, "context": context, "server": server.rstrip("/"),
                              "namespace": namespace}
    if "certificate-authority-data" in cluster:
        access["ca_pem"] = r.data(cluster["certificate-authority-data"], cluster_at + ("certificate-authority-data",),
                                  secret=False).decode("ascii", "replace")
    elif "certificate-authority" in cluster:
        access["ca_file"] = _file(r, cluster["certificate-authority"], cluster_at + ("certificate-authority",), base)
    user_name = r.string(ctx["user"], ctx_at + ("user",)) if ctx.get("user") else None
    if user_name is not None:
        if user_name not in users:
            raise r.error(ctx_at + ("user",), f"no user '{user_name[:80]}' under users")
        access.update(_credentials(r, users[user_name]["body"], users[user_name]["at"], base))
    return ClusterAccess(**access)


def _refuse_keys(r: _KubeconfigReader, body: dict[str, Any], at: PathKey, allowed: tuple[str, ...]) -> None:
    for key, value in body.items():
        if key == "insecure-skip-tls-verify" and value is False:
            continue  # says what imagebuild does anyway
        if key in _REFUSED:
            raise r.error(at + (key,), _REFUSED[key])
    r.mapping(body, at, allowed=allowed)


def _file(r: _KubeconfigReader, value: Any, at: PathKey, base: Path) -> Path:
    path = Path(r.string(value, at)).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise r.error(at, f"{path} is not a file")
    return path


def _credentials(r: _KubeconfigReader, user: dict[str, Any], at: PathKey, base: Path) -> dict[str, Any]:
    _refuse_keys(r, user, at, _USER_KEYS)
    found: dict[str, Any] = {}
    if "token" in user and "tokenFile" in user:
        raise r.error(at, "give token or tokenFile, not both")
    if "token" in user:
        found["token"] = r.secret(user["token"], at + ("token",))
    elif "tokenFile" in user:
        token_path = _file(r, user["tokenFile"], at + ("tokenFile",), base)
        try:
            token = token_path.read_bytes()[:MAX_TOKEN_FILE + 1].decode("utf-8").strip()
        except (OSError, UnicodeDecodeError):
            raise r.error(at + ("tokenFile",), f"{token_path} cannot be read as text") from None
        if not token or len(token) > MAX_TOKEN_FILE or any(c.isspace() or not c.isprintable() for c in token):
            raise r.error(at + ("tokenFile",), f"{token_path} does not hold one token (its content is not shown)")
        found["token"] = token
    for kind, attribute in (("client-certificate", "client_cert"), ("client-key", "client_key")):
        if f"{kind}-data" in user:
            found[f"{attribute}_pem"] = r.data(user[f"{kind}-data"], at + (f"{kind}-data",),
                                               secret=kind == "client-key")
        elif kind in user:
            found[f"{attribute}_file"] = _file(r, user[kind], at + (kind,), base)
    has_cert = "client_cert_pem" in found or "client_cert_file" in found
    has_key = "client_key_pem" in found or "client_key_file" in found
    if has_cert != has_key:
        raise r.error(at, "a client certificate needs its key, and a key its certificate "
                          "(client-certificate(-data) with client-key(-data))")
    if not found:
        raise r.error(at, "no credentials: give token, tokenFile or client-certificate(-data) with client-key(-data)")
    return found
