"""A small OCI distribution client: manifest HEAD/GET/PUT, cross-repository blob mounts.

httpx instead of the docker SDK because the plan asks the registry about many layer keys
at once (one HEAD each, concurrently) without pulling anything, and because tagging a
built image in another repository is a manifest copy, not a re-push.
"""
from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

MANIFEST_TYPES = ", ".join([
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
])


DOCKER_HUB = "registry-1.docker.io"


class RegistryError(Exception):
    pass


class RegistryUnreachable(RegistryError):
    """No answer at all (connection refused, DNS, TLS, timeout), or a 5xx: the registry is down, not saying no."""


@dataclass(frozen=True)
class ImageRef:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        """Docker's rules: no registry host means Docker Hub, and a one-part name is library/."""
        name, at, after = text.partition("@")
        digest = after if at else None
        registry, _, rest = name.partition("/")
        if not rest or not ("." in registry or ":" in registry or registry == "localhost"):
            registry, rest = DOCKER_HUB, name if "/" in name else f"library/{name}"
        elif registry == "docker.io":
            registry = DOCKER_HUB
            rest = rest if "/" in rest.split(":", 1)[0] else f"library/{rest}"
        tag = None
        if ":" in rest.rsplit("/", 1)[-1]:
            rest, tag = rest.rsplit(":", 1)
        return cls(registry, rest, tag, digest)

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def _is_local(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry
    return host in ("localhost", "::1") or host.startswith("127.")


def base_url(registry: str, insecure: bool | None = None) -> str:
    """Plain http for loopback registries (as the docker engine does), https elsewhere."""
    plain = _is_local(registry) if insecure is None else insecure
    return f"{'http' if plain else 'https'}://{registry}"


def _basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


class _TokenAuth(httpx.Auth):
    """Anonymous or basic credentials, upgraded to a bearer token on a registry's challenge."""

    requires_response_body = True

    def __init__(self, username: str | None = None, password: str | None = None):
        self.username, self.password = username, password
        self._tokens: dict[str, str] = {}

    def auth_flow(self, request: httpx.Request):
        scope_key = request.url.host
        if scope_key in self._tokens:
            request.headers["Authorization"] = f"Bearer {self._tokens[scope_key]}"
        response = yield request
        if response.status_code != 401:
            return
        challenge = response.headers.get("www-authenticate", "")
        if challenge.lower().startswith("basic") and self.username:
            request.headers["Authorization"] = _basic(self.username, self.password or "")
            yield request
        elif challenge.lower().startswith("bearer"):
            params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
            query = {k: v for k, v in params.items() if k in ("service", "scope")}
            headers = {"Authorization": _basic(self.username, self.password or "")} if self.username else {}
            token_response = yield httpx.Request("GET", params.get("realm", ""), params=query, headers=headers)
            if token_response.status_code == 200:
                body = token_response.json()
                token = body.get("token") or body.get("access_token")
                if token:
                    self._tokens[scope_key] = token
                    request.headers["Authorization"] = f"Bearer {token}"
                    yield request


class Registry:
    """Synchronous client for one registry host."""

    def __init__(self, registry: str, username: str | None = None, password: str | None = None,
                 insecure: bool | None = None, timeout: float = 30.0):
        self.registry = registry
        self.url = base_url(registry, insecure)
        self.client = httpx.Client(base_url=self.url, auth=_TokenAuth(username, password), timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            return self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RegistryUnreachable(f"{self.registry}: {exc.__class__.__name__}: {exc}") from None

    def ping(self) -> None:
        response = self._request("GET", "/v2/")
        if response.status_code not in (200, 401):
            raise RegistryError(f"{self.registry}: /v2/ answered {response.status_code}")

    def head_manifest(self, repository: str, reference: str) -> str | None:
        """The manifest digest for a tag or digest, or None when absent."""
        response = self._request("HEAD", f"/v2/{repository}/manifests/{reference}",
                                 headers={"Accept": MANIFEST_TYPES})
        if response.status_code == 404:
            return None
        if response.status_code >= 500:
            raise RegistryUnreachable(f"{self.registry}/{repository}:{reference}: HEAD answered {response.status_code}")
        if response.status_code != 200:
            raise RegistryError(f"{self.registry}/{repository}:{reference}: HEAD answered {response.status_code}")
        return response.headers.get("docker-content-digest")

    def list_tags(self, repository: str, page_size: int = 10000) -> set[str]:
        """Every tag of a repository (empty when it does not exist), following Link pagination."""
        tags: set[str] = set()
        url: str | None = f"/v2/{repository}/tags/list?n={page_size}"
        while url:
            response = self._request("GET", url)
            if response.status_code == 404:
                return tags
            if response.status_code != 200:
                raise RegistryError(f"{self.registry}/{repository}: tags/list answered {response.status_code}")
            tags.update(response.json().get("tags") or [])
            link = response.headers.get("link", "")
            match = re.match(r'\s*<([^>]+)>\s*;\s*rel="?next"?', link)
            url = match.group(1) if match else None
        return tags

    def get_manifest(self, repository: str, reference: str) -> tuple[bytes, str, str]:
        """(raw bytes, media type, digest)."""
        response = self._request("GET", f"/v2/{repository}/manifests/{reference}",
                                 headers={"Accept": MANIFEST_TYPES})
        if response.status_code != 200:
            raise RegistryError(f"{self.registry}/{repository}:{reference}: GET manifest answered {response.status_code}")
        return (response.content, response.headers.get("content-type", ""),
                response.headers.get("docker-content-digest", ""))

    def find_manifest(self, repository: str, reference: str) -> tuple[bytes, str, str] | None:
        """Like get_manifest, but None when the registry says it does not exist (404)."""
        response = self._request("GET", f"/v2/{repository}/manifests/{reference}",
                                 headers={"Accept": MANIFEST_TYPES})
        if response.status_code == 404:
            return None
        if response.status_code >= 500:
            raise RegistryUnreachable(f"{self.registry}/{repository}:{reference}: GET manifest answered "
                                      f"{response.status_code}")
        if response.status_code != 200:
            raise RegistryError(f"{self.registry}/{repository}:{reference}: GET manifest answered {response.status_code}")
        return (response.content, response.headers.get("content-type", ""),
                response.headers.get("docker-content-digest", ""))

    def get_blob_limited(self, repository: str, digest: str, max_bytes: int) -> bytes:
        """A blob, refused (RegistryError) once the registry sends more than max_bytes of it."""
        try:
            with self.client.stream("GET", f"/v2/{repository}/blobs/{digest}", follow_redirects=True) as response:
                if response.status_code >= 500:
                    raise RegistryUnreachable(f"{self.registry}/{repository}@{digest}: GET blob answered "
                                              f"{response.status_code}")
                if response.status_code != 200:
                    raise RegistryError(f"{self.registry}/{repository}@{digest}: GET blob answered "
                                        f"{response.status_code}")
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise RegistryError(f"{self.registry}/{repository}@{digest}: blob larger than {max_bytes} bytes")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as exc:
            raise RegistryUnreachable(f"{self.registry}: {exc.__class__.__name__}: {exc}") from None

    def get_blob(self, repository: str, digest: str) -> bytes:
        response = self._request("GET", f"/v2/{repository}/blobs/{digest}", follow_redirects=True)
        if response.status_code != 200:
            raise RegistryError(f"{self.registry}/{repository}@{digest}: GET blob answered {response.status_code}")
        return response.content

    def mount_blob(self, repository: str, digest: str, source_repository: str) -> None:
        """Make a blob of another repository on this registry available here, without copying."""
        if self._request("HEAD", f"/v2/{repository}/blobs/{digest}").status_code == 200:
            return
        response = self._request("POST", f"/v2/{repository}/blobs/uploads/",
                                 params={"mount": digest, "from": source_repository})
        if response.status_code != 201:
            raise RegistryError(f"{self.registry}: mounting {digest} from {source_repository} into "
                                f"{repository} answered {response.status_code}")

    def put_manifest(self, repository: str, reference: str, raw: bytes, media_type: str) -> str:
        response = self._request("PUT", f"/v2/{repository}/manifests/{reference}", content=raw,
                                 headers={"Content-Type": media_type})
        if response.status_code not in (200, 201):
            raise RegistryError(f"{self.registry}/{repository}:{reference}: PUT manifest answered "
                                f"{response.status_code}: {response.text[:200]}")
        return response.headers.get("docker-content-digest", "")

    def copy_within(self, source_repository: str, digest: str, repository: str, tag: str) -> str:
        """Tag `source@digest` as `repository:tag` on this registry (blobs are mounted, not copied)."""
        raw, media_type, _ = self.get_manifest(source_repository, digest)
        manifest = json.loads(raw)
        if "manifests" in manifest:
            raise RegistryError("copying multi-platform indexes is not supported yet")
        for blob in [manifest["config"], *manifest.get("layers", [])]:
            self.mount_blob(repository, blob["digest"], source_repository)
        return self.put_manifest(repository, tag, raw, media_type)


def head_many(registry: str, refs: Iterable[tuple[str, str]], concurrency: int = 16,
              username: str | None = None, password: str | None = None,
              insecure: bool | None = None,
              event_hooks: dict | None = None) -> dict[tuple[str, str], str | None]:
    """HEAD many (repository, reference) pairs at once: one request each, `concurrency` in flight.

    Threads over one pooled client: measured here, asyncio httpx spent about 8 ms of client
    CPU per HEAD, threads about 1.6 ms. `event_hooks` are httpx's (to count requests).
    """
    refs = list(dict.fromkeys(refs))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(base_url=base_url(registry, insecure), limits=limits, timeout=30.0,
                      auth=_TokenAuth(username, password), event_hooks=event_hooks) as client:
        def one(ref: tuple[str, str]) -> str | None:
            repository, reference = ref
            try:
                response = client.head(f"/v2/{repository}/manifests/{reference}",
                                       headers={"Accept": MANIFEST_TYPES})
            except httpx.HTTPError as exc:
                raise RegistryError(f"{registry}: {exc.__class__.__name__}: {exc}") from None
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise RegistryError(f"{registry}/{repository}:{reference}: HEAD answered {response.status_code}")
            return response.headers.get("docker-content-digest")

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(one, refs))
    return dict(zip(refs, results))
