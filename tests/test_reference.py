"""imagebuild.oci.reference: one grammar, Docker's defaults, one normal form; fuzzed with hypothesis."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from imagebuild.oci import reference
from imagebuild.oci.client import DOCKER_HUB, ImageRef
from imagebuild.oci.reference import DigestError, HostError, ReferenceError, RepositoryError, TagError

D256 = "sha256:" + "ab" * 32
D512 = "sha512:" + "cd" * 64
HUB = "registry-1.docker.io"


@pytest.mark.parametrize("text, registry, repository, tag, digest", [
    ("nginx", HUB, "library/nginx", None, None),
    ("nginx:1.27", HUB, "library/nginx", "1.27", None),
    ("library/nginx", HUB, "library/nginx", None, None),
    ("docker.io/nginx", HUB, "library/nginx", None, None),
    ("index.docker.io/library/nginx:1", HUB, "library/nginx", "1", None),
    ("registry-1.docker.io/nginx", HUB, "library/nginx", None, None),
    ("docker.io:443/user/app", HUB, "user/app", None, None),
    ("user/app:V1_x", HUB, "user/app", "V1_x", None),
    ("Harbor.Example.COM:443/p/x:3.3.1", "harbor.example.com", "p/x", "3.3.1", None),
    ("harbor.example.com:0443/p/x", "harbor.example.com", "p/x", None, None),
    ("harbor.example.com:8443/p/x", "harbor.example.com:8443", "p/x", None, None),
    ("127.0.0.1:443/x", "127.0.0.1:443", "x", None, None),  # loopback is plain http: 443 is no default there
    ("127.0.0.1:5000/a/b:t@" + D256, "127.0.0.1:5000", "a/b", "t", D256),
    ("[::1]:5000/a/b@" + D512, "[::1]:5000", "a/b", None, D512),
    ("[0:0:0::1]:5000/a", "[::1]:5000", "a", None, None),
    ("[2001:DB8::1]/a", "[2001:db8::1]", "a", None, None),
    ("localhost/a", "localhost", "a", None, None),
    ("LOCALHOST:5000/a", "localhost:5000", "a", None, None),
    ("a.b-c/d__e/f-g.h_i", "a.b-c", "d__e/f-g.h_i", None, None),
    ("localhost", HUB, "library/localhost", None, None),
    ("nginx:5000", HUB, "library/nginx", "5000", None),
])
def test_parses_with_dockers_defaults_into_one_normal_form(text: str, registry: str, repository: str,
                                                           tag: str | None, digest: str | None) -> None:
    ref = reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    assert reference.parse(str(ref)) == ref == reference.parse(ref.canonical()) == reference.parse(ref.familiar())
    assert ImageRef.parse(text) == ImageRef(registry, repository, tag, digest)


def test_formats_canonical_familiar_and_api_host_forms() -> None:
    ref = reference.parse("index.docker.io/nginx:1@" + D256)
    assert ref.canonical() == "docker.io/library/nginx:1@" + D256
    assert ref.familiar() == "nginx:1@" + D256
    assert str(ref) == f"{DOCKER_HUB}/library/nginx:1@{D256}" == str(ImageRef.parse("nginx:1@" + D256))
    assert ref.reference == D256 and reference.parse("nginx").reference == "latest"
    assert reference.parse("user/app").familiar() == "user/app"
    assert reference.parse("docker.io/my.org/app").familiar() == "docker.io/my.org/app"  # else a host
    assert reference.parse("Harbor.example.com:443/p/x").familiar() == "harbor.example.com/p/x"
    assert ref.pinned(D512).digest == D512
    with pytest.raises(DigestError, match=re.escape("digest 'sha256:short' is not sha256:<64 hex>")):
        ref.pinned("sha256:short")


@pytest.mark.parametrize("text, error, says", [
    ("", ReferenceError, "empty"),
    (" nginx", ReferenceError, "space, control"),
    ("nginx\x1b[2J", ReferenceError, "control"),
    ("x" * 1025, ReferenceError, "over 1024"),
    ("harbor.example.com./p/x", HostError, "ends with a dot"),
    ("harbor..example.com/p/x", HostError, "not a DNS label"),
    ("-harbor.example.com/p/x", HostError, "not a DNS label"),
    ("harbor.example.com:0/p", HostError, "not 1-65535"),
    ("harbor.example.com:65536/p", HostError, "not 1-65535"),
    ("harbor.example.com:/p", HostError, "not 1-65535"),
    ("a:b:c/p", HostError, "not 1-65535"),
    ("[::1/p", HostError, "closing"),
    ("[::g]/p", HostError, "not an IPv6"),
    ("[fe80::1%eth0]/p", HostError, "not an IPv6"),
    ("[::1]x/p", HostError, "only ':PORT'"),
    ("Host/app", HostError, "no dot or port"),  # a host by its case alone: `host/app` is Docker Hub's
    (f"{'a' * 64}.example.com/p", HostError, "not a DNS label"),
    ("harbor.example.com/P/x", RepositoryError, "lowercase"),
    ("harbor.example.com//x", RepositoryError, "lowercase"),
    ("harbor.example.com/x/", RepositoryError, "lowercase"),
    ("harbor.example.com/-x", RepositoryError, "lowercase"),
    ("harbor.example.com/x..y", RepositoryError, "lowercase"),
    ("harbor.example.com/", RepositoryError, "names no repository"),
    ("a" * 64, RepositoryError, "image ID"),
    ("h.example.com/" + "a/" * 127 + "a", RepositoryError, "over 255"),
    ("nginx:", TagError, "tag ''"),
    ("nginx:.x", TagError, "not starting"),
    ("nginx:" + "t" * 129, TagError, "1-128"),
    ("nginx@", DigestError, "sha256:<64 hex>"),
    ("nginx@sha256:" + "A" * 64, DigestError, "lower case"),
    ("nginx@sha256:" + "a" * 63, DigestError, "sha256:<64 hex>"),
    ("nginx@sha512:" + "a" * 64, DigestError, "sha512:<128 hex>"),
    ("nginx@md5:" + "a" * 32, DigestError, "sha256"),
    ("nginx@sha256:../../x", DigestError, "sha256"),
])
def test_refuses_what_the_runtime_would_saying_which_part(text: str, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=re.escape(says)) as caught:
        reference.parse(text)
    assert isinstance(caught.value, ValueError)
    assert "\x1b" not in str(caught.value) and len(str(caught.value)) < 400  # quoted escaped and cut short


def test_parse_repository_wants_an_explicit_host_and_no_tag() -> None:
    assert reference.parse_repository("Harbor.example.com:443/release").name == "harbor.example.com/release"
    with pytest.raises(HostError, match="names no registry host"):
        reference.parse_repository("release/paddle")
    with pytest.raises(ReferenceError, match="names a tag or digest"):
        reference.parse_repository("harbor.example.com/release:1")


def test_split_keeps_the_spelling_as_written() -> None:
    parts = reference.split("Harbor.example.com:443/p/x:1@" + D256)
    assert (parts.host, parts.path, parts.tag, parts.digest) == ("Harbor.example.com:443", "p/x", "1", D256)
    assert parts.name == "Harbor.example.com:443/p/x" and reference.split("nginx").name == "nginx"


@pytest.mark.parametrize("host, loopback", [("localhost", True), ("LOCALHOST:5000", True), ("127.0.0.1", True),
                                            ("127.0.0.1:5000", True), ("127.255.0.9", True), ("[::1]:5000", True),
                                            ("127.evil.example", False), ("127.0.0.1.nip.io", False),
                                            ("10.0.0.1", False), ("harbor.example.com", False)])
def test_loopback_means_an_address_that_parses_as_one(host: str, loopback: bool) -> None:
    assert reference.is_loopback(host) is loopback


# --- fuzzing ---------------------------------------------------------------------------------------

_ALNUM = st.text("abcxyz0189", min_size=1, max_size=6)
_COMPONENT = st.builds(lambda parts, seps: "".join(p + s for p, s in zip(parts, seps)) + parts[-1],
                       st.lists(_ALNUM, min_size=2, max_size=3), st.lists(st.sampled_from([".", "_", "__", "-", "--"]),
                                                                          min_size=1, max_size=2))
_PATH = st.lists(st.one_of(_ALNUM, _COMPONENT), min_size=1, max_size=4).map("/".join)
_LABEL = st.builds(lambda a, b: a + b, st.text("abcXYZ019", min_size=1, max_size=8), st.sampled_from(["", "-a", "0"]))
_HOST = st.one_of(
    st.lists(_LABEL, min_size=2, max_size=4).map(".".join),
    st.sampled_from(["localhost", "LocalHost", "127.0.0.1", "[::1]", "[2001:db8::7]", "docker.io", "Index.Docker.io",
                     "registry-1.docker.io"]),
)
_PORT = st.one_of(st.none(), st.integers(1, 65535).map(str), st.sampled_from(["443", "0443", "5000"]))
_TAG = st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}\Z")
_DIGEST = st.one_of(st.text("0123456789abcdef", min_size=64, max_size=64).map(lambda h: "sha256:" + h),
                    st.text("0123456789abcdef", min_size=128, max_size=128).map(lambda h: "sha512:" + h))


@st.composite
def references(draw: st.DrawFn) -> str:
    host = draw(st.one_of(st.none(), _HOST))
    port = draw(_PORT) if host is not None else None
    path = draw(_PATH)
    if host is None and "/" in path and "." in path.split("/")[0]:
        path = "p" + path.replace(".", "-")  # with no host, a first segment with a dot would read as one
    text = (f"{host}:{port}/" if port else f"{host}/" if host else "") + path
    if draw(st.booleans()):
        text += ":" + draw(_TAG)
    if draw(st.booleans()):
        text += "@" + draw(_DIGEST)
    return text


@settings(max_examples=200, deadline=None, database=None)
@given(references())
def test_every_reference_of_the_grammar_parses_to_a_fixed_point(text: str) -> None:
    ref = reference.parse(text)
    # Normal form: parsing any of its formatted forms gives it back.
    assert reference.parse(str(ref)) == ref == reference.parse(ref.canonical()) == reference.parse(ref.familiar())
    assert ref.registry == ref.registry.lower() and not ref.registry.endswith(":443") or reference.is_loopback(ref.registry)
    assert ImageRef.parse(text) == ImageRef(ref.registry, ref.repository, ref.tag, ref.digest)
    # Host case and an explicit default port do not make another image (loopback keeps :443).
    parts = reference.split(text)
    if parts.host is not None and ":" not in parts.host.rpartition("]")[2]:
        assert reference.parse(text.replace(parts.host, parts.host.upper(), 1)) == ref
        if not reference.is_loopback(parts.host):
            assert reference.parse(text.replace(parts.host, parts.host + ":443", 1)) == ref


# An independent reading of distribution's reference grammar (reference/regexp.go, normalize.go),
# without digests, IPv6 or port ranges, to compare with on arbitrary text.
_D_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_D_DOMAIN = rf"{_D_COMPONENT}(?:\.{_D_COMPONENT})*(?::[0-9]+)?"
_D_PATH = r"[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*"
_D_REFERENCE = re.compile(rf"(?:{_D_DOMAIN}/)?{_D_PATH}(?:/{_D_PATH})*(?::[\w][\w.-]{{0,127}})?", re.ASCII)


def distribution_accepts(text: str) -> bool:
    if re.fullmatch(r"[a-f0-9]{64}", text):
        return False
    i = text.find("/")
    if i == -1 or ("." not in text[:i] and ":" not in text[:i] and text[:i] != "localhost"
                   and text[:i].lower() == text[:i]):
        domain, remainder = "docker.io", text
    else:
        domain, remainder = text[:i], text[i + 1:]
        if "." not in domain and ":" not in domain and domain.lower() != "localhost":
            return False  # stricter here: a host by its case alone has no lower-case spelling
    name = remainder.split(":", 1)[0]
    return name.lower() == name and _D_REFERENCE.fullmatch(f"{domain}/{remainder}") is not None


@settings(max_examples=500, deadline=None, database=None)
@given(st.text("abAB09.-_:/", max_size=24))
def test_accepts_exactly_what_distribution_accepts(text: str) -> None:
    ports = re.findall(r"^[^/]*:([0-9]*)/", text)
    if ports and ports[0] and not 0 < int(ports[0]) < 65536:
        return  # distribution takes any digits as a port; a registry cannot listen there
    try:
        reference.parse(text)
        accepted = True
    except ReferenceError:
        accepted = False
    assert accepted is distribution_accepts(text), text


@settings(max_examples=300, deadline=None, database=None)
@given(st.one_of(st.text(max_size=80), st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                 references().map(lambda t: t[:-1] + "\x00" if t else t)))
def test_arbitrary_text_is_a_reference_or_one_reference_error(text: str) -> None:
    try:
        ref = reference.parse(text)
    except ReferenceError as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) < 400
        return
    assert re.fullmatch(r"[\x21-\x7e]+", str(ref))
    assert reference.parse(str(ref)) == ref
