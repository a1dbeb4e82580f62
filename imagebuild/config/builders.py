"""builders.yaml: the BuildKit daemons (and the local Docker engine) a build sends its layers to.

    schema: 1
    builders:
      - name: amd64-a
        endpoint: tcp://10.0.0.5:1234          # or unix:///run/buildkit/buildkitd.sock
        tls: {ca: certs/ca.pem, cert: certs/client.pem, key: certs/client-key.pem}
        platforms: [linux/amd64]               # optional: default, every platform the daemon reports
        concurrency: 2                         # layers it builds at once (default 1)
      - name: local
        kind: local                            # this machine's Docker engine, as without a builders file

The file is read through the hostile-YAML loader like the matrix (it may come with a pull request
or a shared CI config), so every problem is one `file:line: key: message` InputError (exit 2).
TLS material is named by path, never given inline: the paths must exist, and neither a path's
contents nor a value that looks like key material is ever quoted in an error, a log or the report.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuild.core.source import Document, InputError, PathKey, Reader, load_document, suggest
from imagebuild.oci import names
from imagebuild.oci.platforms import Platform

SCHEMA = 1
ENV = "IMAGEBUILD_BUILDERS"  # the builders file when --builders is not given
BUILDKIT = "buildkit"
LOCAL = "local"
KINDS = (BUILDKIT, LOCAL)
MAX_CONCURRENCY = 64
# tcp://host:port (a DNS name, IPv4, or [IPv6]) or unix:///absolute/path: what buildctl --addr takes
# and what can be shown in a log (no user-info: a URL with credentials is refused).
_TCP = re.compile(r"tcp://(?P<host>[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>[0-9]{1,5})")
_UNIX = re.compile(r"unix://(?P<path>/[^\s\x00]*)")
_SERVER_NAME = re.compile(r"[A-Za-z0-9.-]{1,253}")


@dataclass(frozen=True)
class TlsFiles:
    """A builder's mutual TLS: the CA that signed the daemon's certificate, and this client's certificate
    and key. Paths only; imagebuild hands them to buildctl and never reads them."""

    ca: Path
    cert: Path
    key: Path
    server_name: str | None = None  # the name the daemon's certificate is for, when not the endpoint's host


@dataclass(frozen=True)
class BuilderSpec:
    name: str
    kind: str  # BUILDKIT or LOCAL
    endpoint: str | None = None  # BUILDKIT only
    tls: TlsFiles | None = None
    platforms: tuple[Platform, ...] = ()  # empty: a daemon's every reported platform; the local engine's any
    concurrency: int = 1

    def serves(self, platform: str) -> bool:
        """Is `platform` (a layer's) among the listed ones? With no list: yes (the probe narrows a daemon's)."""
        return not self.platforms or any(p.matches(Platform.parse(platform).descriptor()) for p in self.platforms)


@dataclass(frozen=True)
class BuildersConfig:
    path: Path
    builders: tuple[BuilderSpec, ...]

    @property
    def capacity(self) -> int:
        """Layers the pool can build at once: `build --jobs`'s default with a builders file."""
        return sum(b.concurrency for b in self.builders)


def load_builders(path: Path) -> BuildersConfig:
    """Read and validate a builders file; raises InputError naming file, line and key."""
    return parse_builders(load_document(path), Path(path))


def parse_builders(doc: Document, path: Path) -> BuildersConfig:
    r = Reader(doc)
    top = r.mapping(doc.data, (), allowed=("schema", "builders"), required=("schema", "builders"))
    schema = r.integer(top["schema"], ("schema",))
    if schema != SCHEMA:
        raise r.error(("schema",), f"unsupported schema {schema} (this imagebuild reads schema {SCHEMA})")
    items = r.sequence(top["builders"], ("builders",), non_empty=True)
    builders: list[BuilderSpec] = []
    names_seen: dict[str, int] = {}
    endpoints_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        at: PathKey = ("builders", index)
        spec = _builder(r, item, at, path)
        if spec.name in names_seen:
            raise r.error(at + ("name",), f"builder '{spec.name}' is declared twice "
                                          f"(first as builders[{names_seen[spec.name]}])")
        names_seen[spec.name] = index
        # The same daemon twice would get twice its concurrency, and lose both entries when it goes down.
        where = spec.endpoint or LOCAL
        if where in endpoints_seen:
            raise r.error(at + ("endpoint",) if spec.endpoint else at + ("kind",),
                          f"{'endpoint ' + where if spec.endpoint else 'the local engine'} is already "
                          f"builders[{endpoints_seen[where]}]; give it one entry with the concurrency it takes")
        endpoints_seen[where] = index
        builders.append(spec)
    return BuildersConfig(path, tuple(builders))


def _builder(r: Reader, value: Any, at: PathKey, path: Path) -> BuilderSpec:
    data = r.mapping(value, at, allowed=("name", "kind", "endpoint", "tls", "platforms", "concurrency"),
                     required=("name",))
    name = r.string(data["name"], at + ("name",))
    if not names.NAME.fullmatch(name):
        raise r.error(at + ("name",), f"'{name[:80]}' is not a builder name (lower-case letters, digits, - inside; "
                                      "at most 63)")
    kind = r.string(data.get("kind", BUILDKIT), at + ("kind",))
    if kind not in KINDS:
        raise r.error(at + ("kind",), f"unknown kind '{kind[:40]}'{suggest(kind, KINDS)} (one of {', '.join(KINDS)})")
    platforms = _platforms(r, data["platforms"], at + ("platforms",)) if "platforms" in data else ()
    concurrency = (r.integer(data["concurrency"], at + ("concurrency",), minimum=1, maximum=MAX_CONCURRENCY)
                   if "concurrency" in data else 1)
    if kind == LOCAL:
        for key in ("endpoint", "tls"):
            if key in data:
                raise r.error(at + (key,), "a local builder is this machine's Docker engine: it takes no "
                                           f"{key} (give kind: buildkit for a BuildKit daemon)")
        return BuilderSpec(name, kind, platforms=platforms, concurrency=concurrency)
    if "endpoint" not in data:
        raise r.error(at, "missing required key 'endpoint' (tcp://host:port or unix:///path)")
    endpoint = r.string(data["endpoint"], at + ("endpoint",))
    tcp = _TCP.fullmatch(endpoint)
    if tcp is None and not _UNIX.fullmatch(endpoint):
        shown = "a URL with credentials (not shown)" if "@" in endpoint else f"'{endpoint[:80]}'"
        raise r.error(at + ("endpoint",), f"{shown} is not an endpoint like tcp://host:port or unix:///path")
    if tcp is not None and not 1 <= int(tcp.group("port")) <= 65535:
        raise r.error(at + ("endpoint",), f"port {tcp.group('port')} is out of range (1-65535)")
    tls = _tls(r, data["tls"], at + ("tls",), path) if "tls" in data else None
    if tcp is not None and tls is None:
        # A daemon on TCP without client certificates runs anyone's build as root, and the build
        # secrets (CA bundle, index credentials) would cross the network in the clear.
        raise r.error(at, "a tcp:// endpoint needs tls (ca, cert and key files): BuildKit without client "
                          "certificates runs anyone's build, and the build secrets would cross the network in the "
                          "clear")
    return BuilderSpec(name, kind, endpoint, tls, platforms, concurrency)


def _platforms(r: Reader, value: Any, at: PathKey) -> tuple[Platform, ...]:
    items = r.sequence(value, at, non_empty=True)
    out: list[Platform] = []
    for i, item in enumerate(items):
        text = r.string(item, at + (i,))
        try:
            platform = Platform.parse(text)
        except ValueError as exc:
            raise r.error(at + (i,), str(exc)) from None
        if platform in out:
            raise r.error(at + (i,), f"platform {platform} is listed twice")
        out.append(platform)
    return tuple(out)


def _tls(r: Reader, value: Any, at: PathKey, path: Path) -> TlsFiles:
    data = r.mapping(value, at, allowed=("ca", "cert", "key", "server_name"), required=("ca", "cert", "key"))
    files: dict[str, Path] = {}
    for key in ("ca", "cert", "key"):
        raw = data[key]
        if isinstance(raw, str) and ("-----BEGIN" in raw or "\n" in raw):
            # Say nothing about the value: it may be a real private key.
            raise r.error(at + (key,), "give the path of a PEM file, not its contents; remove it and rotate "
                                       "the key if it was real")
        text = r.string(raw, at + (key,))
        file = Path(text).expanduser()
        if not file.is_absolute():
            file = path.parent / file  # beside the builders file, as the release file's paths are
        if not file.is_file():
            raise r.error(at + (key,), f"'{text[:120]}' is not a file (relative paths are from the builders file's "
                                       "folder)")
        files[key] = file
    server_name = None
    if "server_name" in data:
        server_name = r.string(data["server_name"], at + ("server_name",))
        if not _SERVER_NAME.fullmatch(server_name):
            raise r.error(at + ("server_name",), f"'{server_name[:80]}' is not a host name")
    return TlsFiles(files["ca"], files["cert"], files["key"], server_name)


__all__ = ["BUILDKIT", "ENV", "LOCAL", "BuilderSpec", "BuildersConfig", "InputError", "TlsFiles", "load_builders",
           "parse_builders"]
