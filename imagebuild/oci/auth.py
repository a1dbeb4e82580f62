"""Registry credentials and the distribution auth flow (basic, and bearer tokens per scope).

Credentials come from the caller, or from the Docker config file the way docker, crane and
skopeo read it: `credHelpers` for the host, then `credsStore`, then `auths`. They are never
part of a repr, an exception or a log line: `Credentials` hides its secrets, and errors name
the registry and the helper, never what a helper printed.

Credentials go to the registry's own origin only. A bearer challenge whose token realm is on
another host:port is followed only when that host is trusted for this registry: Docker Hub's
auth.docker.io, or a host named in IMAGEBUILD_TOKEN_REALMS
(`REGISTRY=HOST[:PORT][,HOST[:PORT]...]`, entries separated by spaces or `;`) or given by the
caller. A request to any other origin (a blob redirected to storage, a Location elsewhere)
carries no credentials, and its 401 is an error, not a challenge to answer.
"""
from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.runner import Runner
from imagebuild.oci.names import escaped, is_loopback, split_host

DOCKER_HUB_HOSTS = ("registry-1.docker.io", "docker.io", "index.docker.io")
DOCKER_HUB_CONFIG_KEY = "https://index.docker.io/v1/"
# A credential helper answers this username when the secret is an identity (refresh) token.
IDENTITY_TOKEN_USER = "<token>"
# Distribution's token spec: a token without `expires_in` lives 60 seconds.
DEFAULT_TOKEN_LIFETIME_S = 60.0
# Ask for a fresh token this long before the cached one expires (requests take time).
TOKEN_EXPIRY_MARGIN_S = 5.0
# Token services on another host than their registry, trusted for it (the operator adds others).
TOKEN_REALMS_ENV = "IMAGEBUILD_TOKEN_REALMS"
DEFAULT_TOKEN_REALMS: dict[str, tuple[str, ...]] = {"registry-1.docker.io": ("auth.docker.io",)}
_DEFAULT_PORTS = {"https": 443, "http": 80}
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?")


class CredentialError(ImagebuildError):
    """The Docker config or a credential helper could not give credentials (never carries them).
    The client raises it on as a RegistryAuthError (exit 3)."""

    exit_code = ExitCode.ENVIRONMENT


@dataclass(frozen=True)
class Credentials:
    """A username with a password, or an identity token; robot names (`robot$project+ci`) as they are."""

    username: str = ""
    password: str = field(default="", repr=False)
    identity_token: str = field(default="", repr=False)

    def __repr__(self) -> str:
        kind = "identity-token" if self.identity_token else "password" if self.password else "none"
        return f"Credentials(username={self.username!r}, secret=<{kind} hidden>)"

    __str__ = __repr__

    @property
    def empty(self) -> bool:
        return not (self.username or self.password or self.identity_token)

    def basic_header(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()

    def secrets(self) -> tuple[str, ...]:
        """What must never be printed (for scrubbing text that might echo a request)."""
        return tuple(s for s in (self.password, self.identity_token) if s)


ANONYMOUS = Credentials()


# --- WWW-Authenticate ---------------------------------------------------------------------

_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]*))\s*,?')


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "basic" or "bearer", lower case
    params: dict[str, str]

    @property
    def realm(self) -> str:
        return self.params.get("realm", "")

    @property
    def service(self) -> str:
        return self.params.get("service", "")

    @property
    def scopes(self) -> tuple[str, ...]:
        # Several scopes may come space-separated in one parameter.
        return tuple(self.params.get("scope", "").split())


def parse_challenge(header: str) -> Challenge | None:
    """`Bearer realm="https://auth",service="reg",scope="repository:a/b:pull,push"` -> Challenge.

    Quoted values may hold commas (a scope's actions); unquoted ones may not.
    """
    header = header.strip()
    if not header:
        return None
    scheme, _, rest = header.partition(" ")
    params: dict[str, str] = {}
    position = 0
    while position < len(rest):
        match = _PARAM.match(rest, position)
        if not match or match.end() == position:
            break
        quoted, bare = match.group(2), match.group(3)
        value = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare or ""
        params[match.group(1).lower()] = value
        position = match.end()
    return Challenge(scheme.lower(), params)


# --- scopes -------------------------------------------------------------------------------

_REPO_PATH = re.compile(r"^/v2/(?P<repo>.+?)/(?:manifests|blobs|tags|referrers)(?:/|$)")
_READ_METHODS = ("GET", "HEAD")


def scopes_for(method: str, path: str, query: dict[str, str] | None = None) -> tuple[str, ...]:
    """The token scopes one request needs: pull to read, push and pull to write; a mount reads its source."""
    match = _REPO_PATH.match(path)
    if not match:
        return ()
    actions = "pull" if method.upper() in _READ_METHODS else "pull,push"
    scopes = [f"repository:{match.group('repo')}:{actions}"]
    source = (query or {}).get("from")
    if source and (query or {}).get("mount"):
        scopes.append(f"repository:{source}:pull")
    return tuple(scopes)


def merge_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """One entry per resource, with the union of its actions, in a stable order."""
    actions: dict[str, list[str]] = {}
    for scope in scopes:
        resource, _, wanted = scope.rpartition(":")
        if not resource:
            resource, wanted = scope, ""
        have = actions.setdefault(resource, [])
        for action in filter(None, wanted.split(",")):
            if action not in have:
                have.append(action)
    return tuple(f"{resource}:{','.join(sorted(acts))}" if acts else resource
                 for resource, acts in sorted(actions.items()))


# --- Docker config and credential helpers -------------------------------------------------

def docker_config_path(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    directory = env.get("DOCKER_CONFIG")
    return Path(directory) / "config.json" if directory else Path(env.get("HOME", "~")).expanduser() / ".docker" / "config.json"


def config_key(registry: str) -> str:
    """The key docker writes for a registry: the host[:port], or the v1 URL for Docker Hub."""
    return DOCKER_HUB_CONFIG_KEY if registry in DOCKER_HUB_HOSTS else registry


def _host_of(key: str) -> str:
    """`https://reg.example.com/v1/` -> `reg.example.com` (auths keys come in many spellings)."""
    key = re.sub(r"^[a-z]+://", "", key.strip())
    host = key.split("/", 1)[0]
    return "registry-1.docker.io" if host in DOCKER_HUB_HOSTS else host


def _decode_auth(value: str, registry: str, path: Path) -> tuple[str, str]:
    try:
        text = base64.b64decode(value, validate=False).decode()
    except (ValueError, UnicodeDecodeError):
        raise CredentialError(f"{path}: auths: {registry}: `auth` is not base64 of user:password") from None
    username, sep, password = text.partition(":")
    if not sep:
        raise CredentialError(f"{path}: auths: {registry}: `auth` is not base64 of user:password")
    return username, password


@dataclass(frozen=True)
class DockerConfig:
    path: Path
    auths: dict[str, dict[str, str]] = field(repr=False)  # holds secrets
    cred_helpers: dict[str, str]
    creds_store: str | None

    @classmethod
    def load(cls, path: Path | None = None) -> DockerConfig:
        path = path or docker_config_path()
        if not path.is_file():
            return cls(path, {}, {}, None)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CredentialError(f"{path}: not readable as JSON ({exc.__class__.__name__})") from None
        if not isinstance(data, dict):
            raise CredentialError(f"{path}: not a JSON object")
        auths = {_host_of(k): v for k, v in (data.get("auths") or {}).items() if isinstance(v, dict)}
        helpers = {_host_of(k): str(v) for k, v in (data.get("credHelpers") or {}).items()}
        store = data.get("credsStore") or None
        return cls(path, auths, helpers, str(store) if store else None)

    def helper_for(self, registry: str) -> str | None:
        return self.cred_helpers.get(_host_of(registry)) or self.creds_store

    def from_auths(self, registry: str) -> Credentials | None:
        entry = self.auths.get(_host_of(registry))
        if not entry:
            return None
        username, password = entry.get("username", ""), entry.get("password", "")
        if entry.get("auth"):
            username, password = _decode_auth(entry["auth"], registry, self.path)
        token = entry.get("identitytoken", "")
        creds = Credentials(username, password, token)
        return None if creds.empty else creds


HELPER_TIMEOUT_S = 60.0


def credentials_from_helper(helper: str, registry: str, runner: Runner | None = None) -> Credentials | None:
    """`docker-credential-<helper> get` with the server URL on stdin; None when it knows no credentials.

    Through the one runner (a cancel stops it too), with no log: its answer is the secret."""
    program = f"docker-credential-{helper}"
    try:
        done = (runner or Runner()).run([program, "get"], input=config_key(registry), separate_stderr=True,
                                        timeout=HELPER_TIMEOUT_S)
    except FileNotFoundError:
        raise CredentialError(f"{registry}: credential helper {program} is not installed") from None
    if done.timed_out:
        raise CredentialError(f"{registry}: credential helper {program} did not answer in time")
    if done.cancelled:
        raise CredentialError(f"{registry}: credential helper {program} was stopped by a cancel")
    if done.returncode != 0:
        # The helpers' protocol: "credentials not found in native keychain" means none stored.
        if "credentials not found" in (done.output + done.stderr).lower():
            return None
        raise CredentialError(f"{registry}: credential helper {program} failed (exit {done.returncode})")
    try:
        answer = json.loads(done.output)
        username, secret = str(answer.get("Username", "")), str(answer.get("Secret", ""))
    except (ValueError, AttributeError):
        raise CredentialError(f"{registry}: credential helper {program} answered something other than JSON") from None
    if username == IDENTITY_TOKEN_USER:
        return Credentials("", "", secret)
    creds = Credentials(username, secret)
    return None if creds.empty else creds


def credentials_for(registry: str, config: DockerConfig | None = None,
                    runner: Runner | None = None) -> Credentials:
    """What docker would send to `registry`: its credential helper's, else the config's `auths`, else none."""
    config = config if config is not None else DockerConfig.load()
    helper = config.helper_for(registry)
    if helper:
        found = credentials_from_helper(helper, registry, runner)
        if found:
            return found
    return config.from_auths(registry) or ANONYMOUS


# --- where tokens may be fetched ----------------------------------------------------------

def _registry_key(registry: str) -> str:
    return _host_of(registry).lower()


def token_realms_from_env(registry: str, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The token realm hosts IMAGEBUILD_TOKEN_REALMS trusts for `registry`.

    `harbor.example.com=sso.example.com registry.gitlab.com=gitlab.com,gitlab.example.com:8443`
    """
    env = os.environ if environ is None else environ
    hosts: list[str] = []
    for number, entry in enumerate(filter(None, re.split(r"[\s;]+", env.get(TOKEN_REALMS_ENV, ""))), 1):
        name, sep, listed = entry.partition("=")
        realms = listed.split(",")
        if not sep or not name or not all(_HOST_PORT.fullmatch(host) for host in realms):
            raise CredentialError(f"{TOKEN_REALMS_ENV}: entry {number} {escaped(entry)}: expected "
                                  f"REGISTRY=HOST[:PORT][,HOST[:PORT]...]")
        if _registry_key(name) == _registry_key(registry):
            hosts += realms
    return tuple(hosts)


def _origin(url: httpx.URL) -> tuple[str, str, int]:
    """(scheme, host, port) with the scheme's default port filled in: `https://r` is `https://r:443`."""
    return url.scheme, url.host.lower(), url.port or _DEFAULT_PORTS.get(url.scheme, 0)


def _names_host(entry: str, realm: httpx.URL) -> bool:
    """An allowlist entry without a port means the realm scheme's default one."""
    host, port = split_host(entry)
    _, realm_host, realm_port = _origin(realm)
    return host.strip("[]") == realm_host and (port or _DEFAULT_PORTS.get(realm.scheme)) == realm_port


# --- the auth flow ------------------------------------------------------------------------

@dataclass
class _Token:
    value: str
    expires_at: float


class AuthDenied(ImagebuildError):
    """The registry or its token service refused the credentials (carries no secret). The client
    raises it on as a RegistryAuthError (exit 3)."""

    exit_code = ExitCode.ENVIRONMENT

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class RealmRefused(AuthDenied):
    """A bearer challenge named a token service the registry's configuration does not trust."""


class RegistryAuth(httpx.Auth):
    """Answers a registry's challenges: basic credentials, or bearer tokens fetched per scope.

    Once the registry has said which scheme it wants, later requests carry credentials up
    front (a token cached for the request's scopes, until shortly before it expires), so a
    streamed upload body is never sent into a 401. Credentials are resolved lazily, on the
    first challenge: a registry that needs none never runs a credential helper.

    Only requests to the registry's `origin` (scheme, host, port) are authenticated, and only
    its 401s are answered. `token_realms`: hosts trusted for token requests besides the
    registry's own; None reads IMAGEBUILD_TOKEN_REALMS (Docker Hub's auth host is always trusted).
    """

    # False: a streamed blob must stay streamed. The one body the flow reads (a token) it reads itself.
    requires_response_body = False

    def __init__(self, registry: str, credentials: Credentials | Callable[[], Credentials] | None = None,
                 clock: Callable[[], float] = time.monotonic, *, origin: str | None = None,
                 token_realms: Iterable[str] | None = None):
        self.registry = registry
        self.origin = httpx.URL(origin or f"https://{registry}")
        self._token_realms = None if token_realms is None else tuple(token_realms)
        self._credentials = credentials
        self._resolved: Credentials | None = credentials if isinstance(credentials, Credentials) else None
        self._clock = clock
        self._lock = threading.Lock()
        self._challenge: Challenge | None = None
        self._tokens: dict[tuple[str, ...], _Token] = {}
        self._fetching: dict[tuple[str, ...], threading.Lock] = {}
        self.token_requests = 0

    def __repr__(self) -> str:
        return f"RegistryAuth({self.registry!r}, {self.credentials!r})"

    @property
    def credentials(self) -> Credentials:
        with self._lock:
            if self._resolved is None:
                source = self._credentials
                self._resolved = (source() if callable(source) else source) or ANONYMOUS
            return self._resolved

    def same_origin(self, url: httpx.URL) -> bool:
        return _origin(url) == _origin(self.origin)

    def trusted_realms(self) -> tuple[str, ...]:
        try:
            configured = (self._token_realms if self._token_realms is not None
                          else token_realms_from_env(self.registry))
        except CredentialError as exc:
            raise RealmRefused(f"{self.registry}: {exc}", 401) from None
        return DEFAULT_TOKEN_REALMS.get(_registry_key(self.registry), ()) + configured

    def check_realm(self, challenge: Challenge) -> None:
        """Refuse a token service the credentials must not reach: not http(s), plain http where the
        registry speaks https (credentials in clear), or another host:port nobody named."""
        try:
            realm: httpx.URL | None = httpx.URL(challenge.realm)
        except httpx.InvalidURL:
            realm = None
        if realm is None or realm.scheme not in _DEFAULT_PORTS or not realm.host:
            raise RealmRefused(f"{self.registry}: the token realm {escaped(challenge.realm)} is not an "
                               f"http(s) URL", 401)
        scheme, host, port = _origin(realm)
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if scheme == "http" and self.origin.scheme != "http" and not is_loopback(host):
            raise RealmRefused(f"{self.registry}: the token realm {shown} is plain http while the registry "
                               f"speaks https; credentials are not sent in clear", 401)
        if (host, port) == _origin(self.origin)[1:]:
            return
        if not any(_names_host(entry, realm) for entry in self.trusted_realms()):
            raise RealmRefused(f"{self.registry}: the registry sends token requests to another host, {shown}; "
                               f"no credentials go there unless {TOKEN_REALMS_ENV} names it for this "
                               f"registry ({self.registry}={shown})", 401)

    def _request_scopes(self, request: httpx.Request) -> tuple[str, ...]:
        return merge_scopes(scopes_for(request.method, request.url.path, dict(request.url.params)))

    def _cached(self, scopes: tuple[str, ...]) -> str | None:
        token = self._tokens.get(scopes)
        if token and token.expires_at - TOKEN_EXPIRY_MARGIN_S > self._clock():
            return token.value
        return None

    def _authorize(self, request: httpx.Request, scopes: tuple[str, ...]) -> bool:
        challenge = self._challenge
        if challenge is None:
            return False
        if challenge.scheme == "basic":
            creds = self.credentials
            if creds.empty:
                return False
            request.headers["Authorization"] = creds.basic_header()
            return True
        token = self._cached(scopes)
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
            return True
        return False

    def token_request(self, challenge: Challenge, scopes: tuple[str, ...]) -> httpx.Request:
        creds = self.credentials
        if creds.identity_token:
            # OAuth2 refresh-token grant, as docker does with an identity token.
            form = {"grant_type": "refresh_token", "refresh_token": creds.identity_token,
                    "service": challenge.service, "client_id": "imagebuild", "scope": " ".join(scopes)}
            return httpx.Request("POST", challenge.realm, data=form)
        params: list[tuple[str, str | int | float | bool | None]] = (
            [("service", challenge.service)] if challenge.service else [])
        params += [("scope", scope) for scope in scopes]
        headers = {}
        if creds.username:
            params.append(("account", creds.username))
            headers["Authorization"] = creds.basic_header()
        return httpx.Request("GET", challenge.realm, params=params, headers=headers)

    def _store_token(self, scopes: tuple[str, ...], response: httpx.Response) -> str | None:
        try:
            body = response.json()
        except ValueError:
            return None
        value = body.get("token") or body.get("access_token")
        if not value:
            return None
        lifetime = float(body.get("expires_in") or DEFAULT_TOKEN_LIFETIME_S)
        self._tokens[scopes] = _Token(str(value), self._clock() + lifetime)
        return str(value)

    def _scope_lock(self, scopes: tuple[str, ...]) -> threading.Lock:
        with self._lock:
            return self._fetching.setdefault(scopes, threading.Lock())

    def _fetch_token(self, challenge: Challenge, scopes: tuple[str, ...]
                     ) -> Generator[httpx.Request, httpx.Response, str]:
        """One token request per scope set at a time: threads that wait reuse what the first one got."""
        with self._scope_lock(scopes):
            cached = self._cached(scopes)
            if cached:
                return cached
            self.token_requests += 1
            token_response = yield self.token_request(challenge, scopes)
            token_response.read()
            if token_response.status_code in (401, 403):
                raise AuthDenied(f"{self.registry}: the token service refused the credentials "
                                 f"(HTTP {token_response.status_code})", token_response.status_code)
            if token_response.status_code != 200:
                raise AuthDenied(f"{self.registry}: the token service answered HTTP {token_response.status_code}",
                                 token_response.status_code)
            token = self._store_token(scopes, token_response)
            if token is None:
                raise AuthDenied(f"{self.registry}: the token service answered without a token", 200)
            return token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if not self.same_origin(request.url):
            yield request  # not the registry: no credentials go there, and its 401s are not ours to answer
            return
        scopes = self._request_scopes(request)
        challenge = self._challenge
        if "Authorization" not in request.headers and not self._authorize(request, scopes):
            if challenge is not None and challenge.scheme == "bearer" and scopes:
                # The registry wants tokens: get this scope's before sending (no 401 round trip,
                # and a streamed body is never sent only to be refused).
                token = yield from self._fetch_token(challenge, scopes)
                request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        # A 401 from where a redirect led (blob storage) is the caller's error: answering it would
        # hand the registry's credentials to that host, and the registry's own state stays as it is.
        if response.status_code != 401 or not self.same_origin(response.request.url):
            return
        challenge = parse_challenge(response.headers.get("www-authenticate", ""))
        if challenge is None or challenge.scheme not in ("basic", "bearer"):
            return
        if challenge.scheme == "bearer":
            self.check_realm(challenge)
        self._challenge = challenge
        if challenge.scheme == "basic":
            if self.credentials.empty or request.headers.get("Authorization", "").startswith("Basic"):
                return  # none to offer, or the ones we sent were refused
            request.headers["Authorization"] = self.credentials.basic_header()
            yield request
            return
        wanted = merge_scopes([*challenge.scopes, *scopes])
        if request.headers.get("Authorization") == f"Bearer {self._cached(wanted)}":
            self._tokens.pop(wanted, None)  # the token we sent was refused: ask again, once
        token = yield from self._fetch_token(challenge, wanted)
        if wanted != scopes:
            self._tokens.setdefault(scopes, self._tokens[wanted])
        request.headers["Authorization"] = f"Bearer {token}"
        yield request
