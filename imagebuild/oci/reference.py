"""Image references: one grammar for every command, the webhook and the policy generator.

`parse` reads a reference the way the container runtime does (the distribution reference grammar
with Docker's defaults) and gives it one normal form, so that two spellings the runtime pulls from
the same place compare equal everywhere: `nginx`, `docker.io/nginx`, `index.docker.io/library/nginx`
and `registry-1.docker.io/library/nginx` are one image; so are `Harbor.Example.com:443/p/x` and
`harbor.example.com/p/x`.

The normal form:
- the registry is the API host: lower case, no `:443` for a host reached over https (loopback
  hosts are reached over plain http, so their :443 is kept), IPv6 literals compressed in brackets,
  Docker Hub as `registry-1.docker.io` (`DOCKER_HUB`, what the client talks to);
- a one-part Docker Hub name gets `library/`;
- `canonical()` names Docker Hub `docker.io` (as Pod specs and policies do), `familiar()` is the
  shortest spelling (`nginx:1`), `str()` the API host form.

Everything else the runtime would refuse is refused here too, with a ReferenceError (a ValueError)
that says which part is wrong and quotes it escaped: a host with an empty label or a trailing dot,
upper case in the path, a tag over 128 characters, a digest that is not sha256:<64 hex> or
sha512:<128 hex>, a name over 255 characters.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace

from imagebuild.core.errors import ImagebuildError
from imagebuild.oci import names

DOCKER_HUB = "registry-1.docker.io"  # the API host of Docker Hub
DOCKER_HUB_NAME = "docker.io"  # how Pod specs, policies and `docker pull` name it
DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
OFFICIAL_PREFIX = "library/"
HTTPS_PORT = 443

MAX_TEXT = 1024  # longer than any valid reference (name 255 + tag 128 + digest 135); refused before any regex
MAX_NAME = 255  # distribution's NameTotalLengthMax, of the canonical name
MAX_HOST = 253  # a DNS name
MAX_LABEL = 63

_PATH, _TAG = names.REPOSITORY, names.TAG
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
_PORT = re.compile(r"[0-9]{1,5}")
_DIGEST_HEX = names.DIGEST_HEX
_IMAGE_ID = re.compile(r"[a-f0-9]{64}")  # docker refuses it as a name: it reads as an image ID
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # no spaces, controls or non-ASCII anywhere in a reference


class ReferenceError(ImagebuildError, ValueError):
    """Not an image reference; the message says which part and why."""


class HostError(ReferenceError):
    pass


class RepositoryError(ReferenceError):
    pass


class TagError(ReferenceError):
    pass


class DigestError(ReferenceError):
    pass


def shown(value: str, limit: int = 100) -> str:
    """A value quoted for a message, every control or non-ASCII character escaped, cut short."""
    return names.escaped(value, limit)


# ---------------------------------------------------------------------------------------------
# Hosts


is_loopback = names.is_loopback


def _split_port(host: str) -> tuple[str, str | None]:
    """`name[:port]` or `[v6][:port]` -> (name, port text or None); HostError for anything else."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            raise HostError(f"registry host {shown(host)}: an IPv6 literal needs its closing ']'")
        name, rest = host[:end + 1], host[end + 1:]
        if rest and not rest.startswith(":"):
            raise HostError(f"registry host {shown(host)}: only ':PORT' may follow an IPv6 literal")
        return name, rest[1:] if rest else None
    name, colon, port = host.partition(":")
    return name, port if colon else None


def _normal_name(name: str, host: str) -> str:
    if name.startswith("["):
        literal = name[1:-1]
        try:
            if "%" in literal:
                raise ValueError("zone")
            address = ipaddress.IPv6Address(literal)
        except ValueError:
            raise HostError(f"registry host {shown(host)}: {shown(literal)} is not an IPv6 address") from None
        return f"[{address.compressed}]"
    if not name:
        raise HostError(f"registry host {shown(host)} has no name")
    if name.endswith("."):
        raise HostError(f"registry host {shown(host)} ends with a dot; write the name without it")
    if len(name) > MAX_HOST:
        raise HostError(f"registry host {shown(host)} is over {MAX_HOST} characters")
    for label in name.split("."):
        if not label or len(label) > MAX_LABEL or not _LABEL.fullmatch(label):
            raise HostError(f"registry host {shown(host)}: {shown(label)} is not a DNS label "
                            "(letters, digits and inner hyphens, 1-63 characters)")
    return name.lower()


def normalise_host(host: str) -> str:
    """The API host of `host[:port]`: checked, lower case, IPv6 compressed, :443 dropped where it is
    the default (https, so not for loopback hosts), Docker Hub's aliases as DOCKER_HUB."""
    if not host:
        raise HostError("the registry host is empty")
    name, port_text = _split_port(host)
    name = _normal_name(name, host)
    port: int | None = None
    if port_text is not None:
        if not _PORT.fullmatch(port_text) or not 0 < int(port_text) < 65536:
            raise HostError(f"registry host {shown(host)}: port {shown(port_text)} is not 1-65535")
        port = int(port_text)
    if port == HTTPS_PORT and not is_loopback(name):
        port = None
    if port is None and name in DOCKER_HUB_ALIASES:
        return DOCKER_HUB
    return name if port is None else f"{name}:{port}"


def _names_a_host(component: str) -> bool:
    """Docker's rule for the first path component: a host when it has a dot or a colon, is
    `localhost`, or has upper case (a repository path cannot)."""
    return "." in component or ":" in component or component == "localhost" or component != component.lower()


# ---------------------------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Parts:
    """A reference as written, each part checked against the grammar, no defaults applied."""

    host: str | None  # as written; None when the name has no registry host
    path: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """The name as written, without tag or digest."""
        return f"{self.host}/{self.path}" if self.host is not None else self.path


def _check_digest(digest: str) -> str:
    algorithm, colon, encoded = digest.partition(":")
    pattern = _DIGEST_HEX.get(algorithm)
    if not colon or pattern is None or not pattern.fullmatch(encoded):
        raise DigestError(f"digest {shown(digest)} is not sha256:<64 hex> or sha512:<128 hex> (lower case)")
    return digest


def _check_tag(tag: str) -> str:
    if not _TAG.fullmatch(tag):
        raise TagError(f"tag {shown(tag)} is not 1-128 of A-Z a-z 0-9 _ . - (not starting with . or -)")
    return tag


def _check_path(path: str, text: str) -> str:
    if not path:
        raise RepositoryError(f"{shown(text)} names no repository")
    if not _PATH.fullmatch(path):
        raise RepositoryError(f"repository {shown(path)} is not lowercase path components "
                              "(a-z 0-9, separated by '.', '_', '__' or '-', joined by single '/')")
    return path


def split(text: str) -> Parts:
    """The parts of a reference as written: `[host[:port]/]path[:tag][@digest]`."""
    if not isinstance(text, str) or not text:
        raise ReferenceError("the image reference is empty")
    if len(text) > MAX_TEXT:
        raise ReferenceError(f"{shown(text)} is over {MAX_TEXT} characters")
    if not _PRINTABLE.fullmatch(text):
        raise ReferenceError(f"{shown(text)} has a space, control or non-ASCII character")
    name, at, digest = text.partition("@")
    if at:
        _check_digest(digest)
    last = name.rfind("/")
    tag: str | None = None
    colon = name.rfind(":")
    if colon > last:
        name, tag = name[:colon], _check_tag(name[colon + 1:])
    first, slash, rest = name.partition("/")
    if slash and _names_a_host(first):
        if not re.search(r"[.:\[]", first) and first.lower() != "localhost":
            # A host only by its upper case (`Host/app`): in lower case it would name Docker Hub's
            # host/app, so it has no normal form. Registries have a dot or a port, or are localhost.
            raise HostError(f"registry host {shown(first)} has no dot or port; in lower case it would "
                            "read as a Docker Hub repository")
        normalise_host(first)  # checked here, normalised by parse
        return Parts(first, _check_path(rest, text), tag, digest if at else None)
    if _IMAGE_ID.fullmatch(text):
        raise RepositoryError(f"{shown(text)} is 64 hex digits, an image ID, not a repository name")
    return Parts(None, _check_path(name, text), tag, digest if at else None)


@dataclass(frozen=True)
class Reference:
    """An image reference in normal form (see the module's docstring)."""

    registry: str  # the API host
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def is_docker_hub(self) -> bool:
        return self.registry == DOCKER_HUB

    @property
    def familiar_registry(self) -> str:
        return DOCKER_HUB_NAME if self.is_docker_hub else self.registry

    @property
    def reference(self) -> str:
        """What to ask the registry for: the digest, else the tag, else `latest`."""
        return self.digest or self.tag or "latest"

    @property
    def name(self) -> str:
        """`registry/repository` with the API host."""
        return f"{self.registry}/{self.repository}"

    @property
    def canonical_name(self) -> str:
        """`registry/repository` as policies and Pod specs name it (`docker.io/library/nginx`)."""
        return f"{self.familiar_registry}/{self.repository}"

    def _suffix(self) -> str:
        return (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def canonical(self) -> str:
        return self.canonical_name + self._suffix()

    def familiar(self) -> str:
        """The shortest spelling the runtime reads as this image (`nginx:1`, `user/app`)."""
        name = self.canonical_name
        short = self.repository.removeprefix(OFFICIAL_PREFIX)
        # Without docker.io/, a first segment with a dot (`my.org/app`) would read as a host.
        if self.is_docker_hub and ("/" not in short or "." not in short.split("/", 1)[0]):
            name = short
        return name + self._suffix()

    def pinned(self, digest: str) -> Reference:
        """The same image by this digest (the tag kept, for the reader)."""
        return replace(self, digest=_check_digest(digest))

    def __str__(self) -> str:
        return self.name + self._suffix()


def parse(text: str) -> Reference:
    """A tag and/or digest reference in normal form; ReferenceError saying what is wrong."""
    parts = split(text)
    registry = normalise_host(parts.host) if parts.host is not None else DOCKER_HUB
    repository = parts.path
    if registry == DOCKER_HUB and "/" not in repository:
        repository = OFFICIAL_PREFIX + repository
    if len(f"{DOCKER_HUB_NAME if registry == DOCKER_HUB else registry}/{repository}") > MAX_NAME:
        raise RepositoryError(f"{shown(text)}: the name is over {MAX_NAME} characters")
    return Reference(registry, repository, parts.tag, parts.digest)


def parse_repository(text: str) -> Reference:
    """`host[:port]/path`: an explicit registry and a repository, no tag or digest."""
    parts = split(text)
    if parts.host is None:
        raise HostError(f"{shown(text)} names no registry host (e.g. harbor.example.com/project)")
    if parts.tag is not None or parts.digest is not None:
        raise ReferenceError(f"{shown(text)} names a tag or digest; give a repository")
    return parse(text)
