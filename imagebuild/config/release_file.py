"""release.yaml: the regions, channel tags, waves and gates of a staged rollout (pure: no I/O but reading it).

The file comes from a pull request like the matrix, so it goes through the same hostile-YAML
loader (imagebuild.core.source) and every problem is one `file:line: key: message` InputError.
Credentials are named, never given: a Docker config path or an environment variable's name.
So are a notification target's headers (`notify:`): each value is an environment variable's name.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imagebuild.config.tiers import TIERS
from imagebuild.core.source import Document, InputError, Reader, load_document, safe_text, suggest
from imagebuild.oci import names
from imagebuild.oci.compression import PULL_FAMILIES

SCHEMA = 1
# OCI distribution-spec tag grammar.
_REGISTRY = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # a Kubernetes namespace (DNS-1123 label)
_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a Kubernetes node name (DNS-1123 subdomain)
_CONTAINERD_NAMESPACE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,74}[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DURATION = re.compile(r"([0-9]{1,7})(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# Keys that would carry a secret's value; credentials may only point at one.
_SECRET_KEYS = frozenset({"password", "token", "secret", "auth", "identitytoken", "registrytoken"})
# What a rollout and a quarantine tell release.yaml's `notify:` targets, in the order the README lists them.
NOTIFY_EVENTS: tuple[str, ...] = ("rollout.halted", "rollout.aborted", "rollout.rolledback", "rollout.completed", "gate.failed",
                 "image.quarantined")
NOTIFY_FORMATS = ("cloudevents", "slack")
_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
# Headers the sender writes itself: a target's own would contradict the body or the connection.
_OWN_HEADERS = frozenset({"content-type", "content-length", "host", "transfer-encoding", "connection"})


@dataclass(frozen=True)
class CredentialRef:
    """Where a region's credentials are: a Docker config file, or the environment variable holding one."""

    docker_config: Path | None = None
    env: str | None = None


@dataclass(frozen=True)
class LeaseCluster:
    """release.yaml `lease:`: the rollout lease is a coordination.k8s.io/v1 Lease in this cluster and namespace
    (else a tag of the state repository). The kubeconfig is read when a rollout takes the lease."""

    kubeconfig: Path
    namespace: str
    context: str | None = None


@dataclass(frozen=True)
class PrepullNode:
    """One node of a region that pulls a rollout's digest before the region's tags move: a containerd
    reached at its socket (what a kubelet's node runs), in its namespace, with its own registry config."""

    name: str
    containerd: Path  # the containerd socket
    namespace: str = "k8s.io"  # the kubelet's namespace: what the node's pods will find
    hosts_dir: Path | None = None  # containerd's registry host configuration (mirrors, CAs), as the node has it


@dataclass(frozen=True)
class Prepull:
    """release.yaml `prepull:` of a region: its nodes, and how long one node may take to pull and unpack."""

    nodes: tuple[PrepullNode, ...]
    timeout_s: float = 900.0


@dataclass(frozen=True)
class Region:
    name: str
    registry: str
    repository: str
    harbor_project: str | None = None
    credentials: CredentialRef | None = None
    prepull: Prepull | None = None  # None: the tags move without the nodes having pulled first
    # The layer compressions every engine of the region pulls (compression.PULL_FAMILIES); None: all of them.
    compressions: frozenset[str] | None = None

    def reads(self, families: frozenset[str]) -> bool:
        """Whether the region's engines can pull layers of all these compressions."""
        return self.compressions is None or families <= self.compressions

    def image(self, digest: str) -> str:
        return f"{self.registry}/{self.repository}@{digest}"


@dataclass(frozen=True)
class GateSpec:
    """One check a wave must pass before the next wave starts."""

    @property
    def kind(self) -> str:
        return GATE_KINDS_BY_CLASS[type(self)]


@dataclass(frozen=True)
class SoakGate(GateSpec):
    seconds: float


@dataclass(frozen=True)
class SignatureGate(GateSpec):
    pass


@dataclass(frozen=True)
class SmokeGate(GateSpec):
    tier: str


@dataclass(frozen=True)
class PrometheusGate(GateSpec):
    url: str
    query: str
    max: float | None
    min: float | None
    for_seconds: float


@dataclass(frozen=True)
class HttpGate(GateSpec):
    url: str
    expect_status: int
    timeout_s: float


@dataclass(frozen=True)
class ApprovalGate(GateSpec):
    pass


GATE_KINDS_BY_CLASS: dict[type[GateSpec], str] = {
    SoakGate: "soak", SignatureGate: "signature", SmokeGate: "smoke", PrometheusGate: "prometheus",
    HttpGate: "http", ApprovalGate: "approval",
}


@dataclass(frozen=True)
class Wave:
    name: str
    regions: tuple[str, ...]
    gates: tuple[GateSpec, ...]


@dataclass(frozen=True)
class NotifyTarget:
    """release.yaml `notify:` entry: where rollout and quarantine events are posted, and how.

    The URL is given as text or, when it is itself a secret (a Slack webhook's path), as the name
    of the environment variable holding it (`url_env`); header values are always variable names."""

    url: str | None
    url_env: str | None = None
    events: tuple[str, ...] = NOTIFY_EVENTS
    format: str = "cloudevents"
    timeout_s: float = 5.0  # everything one event may cost per target: every try and every wait between
    ca_file: Path | None = None
    headers: tuple[tuple[str, str], ...] = ()  # (header name, environment variable holding its value)

    def wants(self, kind: str) -> bool:
        return kind in self.events


@dataclass(frozen=True)
class ReleaseConfig:
    path: Path
    trust_path: Path
    state_registry: str
    state_repository: str
    lease_ttl_s: float
    regions: tuple[Region, ...]
    channels: tuple[str, ...]
    waves: tuple[Wave, ...]
    lease_cluster: LeaseCluster | None = None  # None: the lease is a tag of the state repository
    notify: tuple[NotifyTarget, ...] = ()

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(name)

    def wave(self, name: str) -> Wave:
        for wave in self.waves:
            if wave.name == name:
                return wave
        raise KeyError(name)


def parse_duration(text: str) -> float | None:
    """`30s`, `10m`, `1h`, `500ms` -> seconds; None when it is not a duration."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        return None
    return int(match.group(1)) * _DURATION_UNITS[match.group(2)]


def notify_url_problem(url: str) -> str | None:
    """Why `url` may not receive notifications, or None: https, or http to a loopback address only (what
    goes out may name digests and regions, and the headers carry tokens); no credentials in it."""
    if not re.fullmatch(r"https?://[^\s/?#]+([/?#]\S*)?", url):
        return "is not an http(s) URL"
    scheme, _, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority:
        return "credentials in a URL are not allowed (they would be logged)"
    if scheme == "https":
        return None
    host = authority.rsplit(":", 1)[0] if not authority.startswith("[") else authority[1:].split("]", 1)[0]
    if host == "localhost":
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return None if loopback else "must be https (http only to a loopback address)"


def load_release(path: Path) -> ReleaseConfig:
    """Read and validate a release file; raises InputError naming file, line and key."""
    return parse_release(load_document(path), Path(path))


class _ReleaseReader(Reader):
    def duration(self, value: Any, path: tuple[str | int, ...], minimum: float = 0.0) -> float:
        if isinstance(value, bool) or not isinstance(value, str):
            raise self.error(path, f"expected a duration like 30s, 10m or 1h, got {_shown(value)}")
        seconds = parse_duration(value)
        if seconds is None:
            raise self.error(path, f"'{value}' is not a duration (a whole number and ms, s, m or h: 30s, 10m, 1h)")
        if seconds < minimum:
            raise self.error(path, f"must be at least {minimum:g}s")
        return seconds

    def number(self, value: Any, path: tuple[str | int, ...]) -> float:
        if isinstance(value, bool):
            raise self.error(path, "expected a number, got a boolean")
        try:
            return float(value)  # floats arrive as their source text (the loader keeps it)
        except (TypeError, ValueError):
            raise self.error(path, f"expected a number, got {_shown(value)}") from None

    def pattern(self, value: Any, path: tuple[str | int, ...], regex: re.Pattern[str], what: str) -> str:
        text = self.string(value, path)
        if not regex.fullmatch(text):
            raise self.error(path, f"'{text[:80]}' is not {what}")
        return text

    def url(self, value: Any, path: tuple[str | int, ...]) -> str:
        text = self.string(value, path)
        if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", text):
            raise self.error(path, f"'{text[:80]}' is not an http(s) URL")
        if re.match(r"https?://[^/]*@", text):
            raise self.error(path, "credentials in a URL are not allowed (they would be logged)")
        return text


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    if value is None:
        return "nothing (null)"
    return f"'{str(value)[:60]}'"


def parse_release(doc: Document, path: Path) -> ReleaseConfig:
    r = _ReleaseReader(doc)
    top = r.mapping(doc.data, (), allowed=("schema", "trust", "state", "lease_ttl", "lease", "regions", "channels",
                                          "waves", "notify"),
                    required=("schema", "trust", "state", "regions", "channels", "waves"))
    schema = r.integer(top["schema"], ("schema",))
    if schema != SCHEMA:
        raise r.error(("schema",), f"unsupported schema {schema} (this imagebuild reads schema {SCHEMA})")
    trust_text = r.string(top["trust"], ("trust",))
    trust_path = Path(trust_text)
    if not trust_path.is_absolute():
        trust_path = path.parent / trust_path
    state = r.mapping(top["state"], ("state",), allowed=("registry", "repository"), required=("registry", "repository"))
    state_registry = r.pattern(state["registry"], ("state", "registry"), _REGISTRY, "a registry host[:port]")
    state_repository = r.pattern(state["repository"], ("state", "repository"), names.REPOSITORY, "a repository name")
    lease_ttl = r.duration(top["lease_ttl"], ("lease_ttl",), minimum=5.0) if "lease_ttl" in top else 600.0
    lease_cluster = _lease_cluster(r, top["lease"], path) if "lease" in top else None
    regions = _regions(r, top["regions"])
    channels = _channels(r, top["channels"])
    waves = _waves(r, top["waves"], {region.name for region in regions})
    notify = _notify(r, top["notify"], path) if "notify" in top else ()
    return ReleaseConfig(path=path, trust_path=trust_path, state_registry=state_registry,
                         state_repository=state_repository, lease_ttl_s=lease_ttl, regions=regions,
                         channels=channels, waves=waves, lease_cluster=lease_cluster, notify=notify)


def _lease_cluster(r: _ReleaseReader, value: Any, path: Path) -> LeaseCluster:
    at: tuple[str | int, ...] = ("lease",)
    _refuse_secret_values(r, value, at, "the cluster's credentials are read from the kubeconfig; never give them here")
    data = r.mapping(value, at, allowed=("kubeconfig", "namespace", "context"), required=("kubeconfig", "namespace"))
    kubeconfig = Path(r.string(data["kubeconfig"], at + ("kubeconfig",))).expanduser()
    if not kubeconfig.is_absolute():
        kubeconfig = path.parent / kubeconfig
    namespace = r.pattern(data["namespace"], at + ("namespace",), _NAMESPACE,
                          "a namespace (lower-case letters, digits, - inside; at most 63)")
    context = r.string(data["context"], at + ("context",)) if "context" in data else None
    if context is not None and (len(context) > 253 or any(char.isspace() for char in context)):
        raise r.error(at + ("context",), f"'{context[:80]}' is not a kubeconfig context name")
    return LeaseCluster(kubeconfig, namespace, context)


def _refuse_secret_values(r: _ReleaseReader, value: Any, at: tuple[str | int, ...], advice: str) -> None:
    if isinstance(value, dict):
        for key in value:
            if str(key).lower().replace("_", "").replace("-", "") in _SECRET_KEYS:
                # Say nothing about the value: it may be a real secret.
                raise r.error(at + (key,), f"{advice}; remove it and rotate it if it was real")


def _regions(r: _ReleaseReader, value: Any) -> tuple[Region, ...]:
    items = r.sequence(value, ("regions",), non_empty=True)
    regions: list[Region] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        at: tuple[str | int, ...] = ("regions", index)
        data = r.mapping(item, at, allowed=("name", "registry", "repository", "harbor_project", "credentials",
                                            "prepull", "compressions"),
                         required=("name", "registry", "repository"))
        name = r.pattern(data["name"], at + ("name",), names.NAME,
                         "a region name (lower-case letters, digits, - inside; at most 63)")
        if name in seen:
            raise r.error(at + ("name",), f"region '{name}' is declared twice (first as regions[{seen[name]}])")
        seen[name] = index
        registry = r.pattern(data["registry"], at + ("registry",), _REGISTRY, "a registry host[:port]")
        repository = r.pattern(data["repository"], at + ("repository",), names.REPOSITORY, "a repository name")
        project = data.get("harbor_project")
        harbor_project = (r.pattern(project, at + ("harbor_project",), names.PROJECT, "a Harbor project name")
                          if project is not None else None)
        credentials = _credentials(r, data["credentials"], at + ("credentials",)) if "credentials" in data else None
        prepull = _prepull(r, data["prepull"], at + ("prepull",)) if "prepull" in data else None
        compressions = _compressions(r, data["compressions"], at + ("compressions",)) if "compressions" in data else None
        regions.append(Region(name, registry, repository, harbor_project, credentials, prepull, compressions))
    return tuple(regions)


def _compressions(r: _ReleaseReader, value: Any, at: tuple[str | int, ...]) -> frozenset[str]:
    """`[gzip]` for a region whose engines read gzip only (Docker 20.10), `[gzip, zstd]` for containerd >= 1.5."""
    listed = r.sequence(value, at, non_empty=True)
    for index, item in enumerate(listed):
        if item not in PULL_FAMILIES:
            raise r.error(at + (index,), f"'{safe_text(item, 40)}' is not a layer compression an engine pulls "
                                         f"(known: {', '.join(PULL_FAMILIES)}; eStargz is gzip to every engine)")
    return frozenset(listed)


def _prepull(r: _ReleaseReader, value: Any, at: tuple[str | int, ...]) -> Prepull:
    data = r.mapping(value, at, allowed=("nodes", "timeout"), required=("nodes",))
    timeout = r.duration(data["timeout"], at + ("timeout",), minimum=1.0) if "timeout" in data else 900.0
    nodes: list[PrepullNode] = []
    for index, item in enumerate(r.sequence(data["nodes"], at + ("nodes",), non_empty=True)):
        where = at + ("nodes", index)
        _refuse_secret_values(r, item, where, "a node pulls with its own registry configuration (hosts_dir); "
                                              "never give credentials here")
        node = r.mapping(item, where, allowed=("name", "containerd", "namespace", "hosts_dir"),
                         required=("name", "containerd"))
        name = r.pattern(node["name"], where + ("name",), _NODE_NAME, "a node name (lower-case letters, digits, "
                                                                       "- and . inside; at most 253)")
        if name in (known.name for known in nodes):
            raise r.error(where + ("name",), f"node '{name}' is listed twice")
        socket = Path(r.string(node["containerd"], where + ("containerd",)))
        if not socket.is_absolute():
            raise r.error(where + ("containerd",), f"'{str(socket)[:80]}' is not an absolute path to a containerd socket")
        namespace = (r.pattern(node["namespace"], where + ("namespace",), _CONTAINERD_NAMESPACE,
                               "a containerd namespace (letters, digits, . _ -; at most 76)")
                     if "namespace" in node else "k8s.io")
        hosts_dir = Path(r.string(node["hosts_dir"], where + ("hosts_dir",))) if "hosts_dir" in node else None
        nodes.append(PrepullNode(name, socket, namespace, hosts_dir))
    return Prepull(tuple(nodes), timeout)


def _credentials(r: _ReleaseReader, value: Any, at: tuple[str | int, ...]) -> CredentialRef:
    _refuse_secret_values(r, value, at, "credentials are given by reference only (docker_config: PATH or "
                                        "env: VARIABLE), never as a value")
    data = r.mapping(value, at, allowed=("docker_config", "env"))
    if len(data) != 1:
        raise r.error(at, "give exactly one of docker_config (a path) or env (a variable name)")
    if "docker_config" in data:
        return CredentialRef(docker_config=Path(r.string(data["docker_config"], at + ("docker_config",))))
    return CredentialRef(env=r.pattern(data["env"], at + ("env",), _ENV_NAME, "an environment variable name"))


def _env_ref(r: _ReleaseReader, value: Any, at: tuple[str | int, ...], what: str) -> str:
    """`{env: VARIABLE}` -> VARIABLE; anything else (a literal value above all) is refused without quoting it."""
    if not isinstance(value, dict):
        raise r.error(at, f"{what} is given by reference only ({{env: VARIABLE}}), never as a value; "
                          f"remove it and rotate it if it was real")
    data = r.mapping(value, at, allowed=("env",), required=("env",))
    return r.pattern(data["env"], at + ("env",), _ENV_NAME, "an environment variable name")


def _notify(r: _ReleaseReader, value: Any, path: Path) -> tuple[NotifyTarget, ...]:
    targets: list[NotifyTarget] = []
    for index, item in enumerate(r.sequence(value, ("notify",))):
        at: tuple[str | int, ...] = ("notify", index)
        _refuse_secret_values(r, item, at, "a notification's secrets are given by reference only "
                                           "(headers: {NAME: {env: VARIABLE}}), never as a value")
        data = r.mapping(item, at, allowed=("url", "events", "format", "timeout", "ca_file", "headers"),
                         required=("url",))
        url: str | None = None
        url_env: str | None = None
        if isinstance(data["url"], dict):
            url_env = _env_ref(r, data["url"], at + ("url",), "the URL")
        else:
            url = r.string(data["url"], at + ("url",))
            problem = notify_url_problem(url)
            if problem:
                shown = f"'{url[:80]}' " if "@" not in url else ""  # never quote a URL's credentials
                raise r.error(at + ("url",), f"{shown}{problem}")
        events = NOTIFY_EVENTS
        if "events" in data:
            chosen: list[str] = []
            for position, kind in enumerate(r.sequence(data["events"], at + ("events",), non_empty=True)):
                where = at + ("events", position)
                text = r.string(kind, where)
                if text not in NOTIFY_EVENTS:
                    raise r.error(where, f"unknown event '{text[:80]}'{suggest(text, NOTIFY_EVENTS)} "
                                         f"(one of {', '.join(NOTIFY_EVENTS)})")
                if text in chosen:
                    raise r.error(where, f"event '{text}' is listed twice")
                chosen.append(text)
            events = tuple(chosen)
        form = r.string(data.get("format", "cloudevents"), at + ("format",))
        if form not in NOTIFY_FORMATS:
            raise r.error(at + ("format",), f"unknown format '{form[:80]}'{suggest(form, NOTIFY_FORMATS)} "
                                            f"(one of {', '.join(NOTIFY_FORMATS)})")
        timeout = r.duration(data["timeout"], at + ("timeout",), minimum=0.1) if "timeout" in data else 5.0
        ca_file = None
        if "ca_file" in data:
            ca_file = Path(r.string(data["ca_file"], at + ("ca_file",))).expanduser()
            if not ca_file.is_absolute():
                ca_file = path.parent / ca_file
        headers: list[tuple[str, str]] = []
        for name, ref in r.mapping(data.get("headers", {}), at + ("headers",)).items():
            where = at + ("headers", name)
            header = r.pattern(name, where, _HEADER_NAME, "a header name (letters, digits and -)")
            if header.lower() in _OWN_HEADERS:
                raise r.error(where, f"{header} is written by imagebuild itself")
            if header.lower() in (known.lower() for known, _ in headers):
                raise r.error(where, f"header {header} is given twice")
            headers.append((header, _env_ref(r, ref, where, "a header's value")))
        targets.append(NotifyTarget(url=url, url_env=url_env, events=events, format=form, timeout_s=timeout,
                                    ca_file=ca_file, headers=tuple(headers)))
    return tuple(targets)


def _channels(r: _ReleaseReader, value: Any) -> tuple[str, ...]:
    items = r.sequence(value, ("channels",), non_empty=True)
    channels: list[str] = []
    for index, item in enumerate(items):
        at: tuple[str | int, ...] = ("channels", index)
        tag = r.pattern(item, at, names.TAG, "a valid tag (letters, digits, _ . -; at most 128; no leading . or -)")
        if tag in channels:
            raise r.error(at, f"channel '{tag}' is listed twice")
        # A channel is never a cosign tag (sha256-<hex>.sig/.att) nor a state document's tag.
        if tag.startswith(("sha256-", "rollout-", "lease-", "channel-", "quarantine-")):
            raise r.error(at, f"'{tag}' is reserved (signature or rollout-state tag names)")
        channels.append(tag)
    return tuple(channels)


def _waves(r: _ReleaseReader, value: Any, declared: set[str]) -> tuple[Wave, ...]:
    items = r.sequence(value, ("waves",), non_empty=True)
    waves: list[Wave] = []
    placed: dict[str, str] = {}
    seen: set[str] = set()
    for index, item in enumerate(items):
        at: tuple[str | int, ...] = ("waves", index)
        data = r.mapping(item, at, allowed=("name", "regions", "gates"), required=("name", "regions"))
        name = r.pattern(data["name"], at + ("name",), names.NAME, "a wave name (lower-case letters, digits, - inside)")
        if name in seen:
            raise r.error(at + ("name",), f"wave '{name}' is declared twice")
        seen.add(name)
        region_names = r.sequence(data["regions"], at + ("regions",), non_empty=True)
        regions: list[str] = []
        for position, region_value in enumerate(region_names):
            where = at + ("regions", position)
            region = r.string(region_value, where)
            if region not in declared:
                raise r.error(where, f"region '{region}' is not declared under regions")
            if region in placed:
                raise r.error(where, f"region '{region}' is already in wave '{placed[region]}' "
                                     f"(each region is in at most one wave)")
            placed[region] = name
            regions.append(region)
        gates = _gates(r, data.get("gates", {}), at + ("gates",))
        waves.append(Wave(name, tuple(regions), gates))
    return tuple(waves)


def _gates(r: _ReleaseReader, value: Any, at: tuple[str | int, ...]) -> tuple[GateSpec, ...]:
    data = r.mapping(value if value is not None else {}, at,
                     allowed=("soak", "signature", "smoke", "prometheus", "http", "approval"))
    gates: list[GateSpec] = []
    if "soak" in data:
        gates.append(SoakGate(r.duration(data["soak"], at + ("soak",))))
    if "signature" in data and r.boolean(data["signature"], at + ("signature",)):
        gates.append(SignatureGate())
    if "smoke" in data:
        smoke = r.mapping(data["smoke"], at + ("smoke",), allowed=("tier",))
        tier = r.string(smoke.get("tier", "abi"), at + ("smoke", "tier"))
        if tier not in TIERS:
            raise r.error(at + ("smoke", "tier"), f"unknown tier '{tier}'{suggest(tier, TIERS)} "
                                                  f"(one of {', '.join(TIERS)})")
        gates.append(SmokeGate(tier))
    if "prometheus" in data:
        where = at + ("prometheus",)
        prom = r.mapping(data["prometheus"], where, allowed=("url", "query", "max", "min", "for"),
                         required=("url", "query"))
        high = r.number(prom["max"], where + ("max",)) if "max" in prom else None
        low = r.number(prom["min"], where + ("min",)) if "min" in prom else None
        if high is None and low is None:
            raise r.error(where, "give max, min or both (the threshold the query's value must keep)")
        if high is not None and low is not None and low > high:
            raise r.error(where + ("min",), f"min {low:g} is above max {high:g}")
        for_s = r.duration(prom["for"], where + ("for",)) if "for" in prom else 0.0
        gates.append(PrometheusGate(r.url(prom["url"], where + ("url",)), r.string(prom["query"], where + ("query",)),
                                    high, low, for_s))
    if "http" in data:
        where = at + ("http",)
        http = r.mapping(data["http"], where, allowed=("url", "expect_status", "timeout"), required=("url",))
        status = r.integer(http.get("expect_status", 200), where + ("expect_status",), minimum=100, maximum=599)
        timeout = r.duration(http["timeout"], where + ("timeout",), minimum=0.001) if "timeout" in http else 5.0
        gates.append(HttpGate(r.url(http["url"], where + ("url",)), status, timeout))
    if "approval" in data and r.boolean(data["approval"], at + ("approval",)):
        gates.append(ApprovalGate())
    return tuple(gates)


__all__ = ["NOTIFY_EVENTS", "ApprovalGate", "CredentialRef", "GateSpec", "HttpGate", "InputError", "LeaseCluster",
           "NotifyTarget", "notify_url_problem", "PrepullNode",
           "Prepull", "PrometheusGate", "Region", "ReleaseConfig", "SignatureGate", "SmokeGate", "SoakGate", "Wave", "load_release",
           "parse_duration", "parse_release"]
