"""The OCI client's pure parts: challenges, scopes, Docker config and credential helpers, Retry-After, backoff."""
from __future__ import annotations

import base64
import json
import re
import uuid
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import pytest

from imagebuild.oci.auth import (
    Challenge,
    CredentialError,
    Credentials,
    DockerConfig,
    RealmRefused,
    RegistryAuth,
    credentials_for,
    docker_config_path,
    merge_scopes,
    parse_challenge,
    scopes_for,
    token_realms_from_env,
)
from imagebuild.oci.client import Registry, RegistryError, base_url
from imagebuild.oci.copy import cosign_tag
from imagebuild.oci.locations import BlobLocations, default_cache_dir
from imagebuild.oci.names import BadName, check_descriptor, check_digest, check_reference, check_tag, is_loopback
from imagebuild.oci.retry import RetryPolicy, parse_retry_after

from .conftest import program_on_path

ROBOT = "robot$imagebuild+ci"


# --- WWW-Authenticate -----------------------------------------------------------------------

def test_a_bearer_challenge_gives_realm_service_and_scope_with_its_commas():
    challenge = parse_challenge('Bearer realm="https://auth.example.com/token",service="registry.example.com",'
                                'scope="repository:team/app:pull,push"')
    assert challenge == Challenge("bearer", {"realm": "https://auth.example.com/token",
                                             "service": "registry.example.com",
                                             "scope": "repository:team/app:pull,push"})
    assert challenge.scopes == ("repository:team/app:pull,push",)


def test_a_challenge_may_carry_several_scopes_unquoted_values_and_odd_spacing():
    challenge = parse_challenge('bearer realm=https://auth/token , service="svc",  '
                                'scope="repository:a:pull repository:b:pull,push", error="insufficient_scope"')
    assert challenge.scheme == "bearer" and challenge.realm == "https://auth/token" and challenge.service == "svc"
    assert challenge.scopes == ("repository:a:pull", "repository:b:pull,push")
    assert challenge.params["error"] == "insufficient_scope"


def test_a_basic_challenge_and_an_absent_one():
    assert parse_challenge('Basic realm="Harbor"') == Challenge("basic", {"realm": "Harbor"})
    assert parse_challenge("") is None


# --- scopes ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "query", "expected"), [
    ("GET", "/v2/team/app/manifests/v1", {}, ("repository:team/app:pull",)),
    ("HEAD", "/v2/team/app/blobs/sha256:ab", {}, ("repository:team/app:pull",)),
    ("GET", "/v2/a/b/c/tags/list", {}, ("repository:a/b/c:pull",)),
    ("GET", "/v2/app/referrers/sha256:ab", {}, ("repository:app:pull",)),
    ("PUT", "/v2/team/app/manifests/v1", {}, ("repository:team/app:pull,push",)),
    ("PATCH", "/v2/team/app/blobs/uploads/uuid", {}, ("repository:team/app:pull,push",)),
    ("POST", "/v2/team/app/blobs/uploads/", {"mount": "sha256:ab", "from": "team/base"},
     ("repository:team/app:pull,push", "repository:team/base:pull")),
    ("GET", "/v2/", {}, ()),
])
def test_each_request_asks_for_the_scopes_it_needs(method, path, query, expected):
    assert scopes_for(method, path, query) == expected


def test_scopes_merge_per_repository():
    assert merge_scopes(["repository:a:pull", "repository:a:push", "repository:b:pull", "repository:a:pull"]) == (
        "repository:a:pull,push", "repository:b:pull")


# --- Docker config --------------------------------------------------------------------------

def _config(tmp_path: Path, content: dict) -> DockerConfig:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    return DockerConfig.load(path)


def test_the_docker_config_is_found_through_DOCKER_CONFIG_or_home():
    assert docker_config_path({"DOCKER_CONFIG": "/etc/ci/docker"}) == Path("/etc/ci/docker/config.json")
    assert docker_config_path({"HOME": "/home/me"}) == Path("/home/me/.docker/config.json")


def test_auths_entries_decode_robot_names_intact_whatever_the_key_spelling(tmp_path):
    password = "pa:ss$word+with/colon"
    auth = base64.b64encode(f"{ROBOT}:{password}".encode()).decode()
    config = _config(tmp_path, {"auths": {
        "https://harbor.example.com": {"auth": auth},
        "registry.example.com:5443/v1/": {"username": "alice", "password": "pw"},
        "https://index.docker.io/v1/": {"identitytoken": "refresh-me"},
    }})
    assert config.from_auths("harbor.example.com") == Credentials(ROBOT, password)
    assert config.from_auths("registry.example.com:5443") == Credentials("alice", "pw")
    assert config.from_auths("registry-1.docker.io") == Credentials("", "", "refresh-me")
    assert config.from_auths("elsewhere.example.com") is None
    assert password not in repr(config) and auth not in repr(config) and "refresh-me" not in repr(config)


def test_a_missing_config_means_anonymous_and_a_broken_one_is_an_error_without_its_content(tmp_path):
    assert credentials_for("r.example.com", DockerConfig.load(tmp_path / "absent.json")).empty
    broken = tmp_path / "config.json"
    broken.write_text('{"auths": {"r": {"auth": "secret-canary')
    with pytest.raises(CredentialError, match=re.escape(f"{broken}: not readable as JSON")) as raised:
        DockerConfig.load(broken)
    assert "secret-canary" not in str(raised.value)


def _helper(tmp_path: Path, name: str, script: str, monkeypatch) -> Path:
    """A credential helper program on PATH speaking docker's protocol (stdin: server URL)."""
    return program_on_path(tmp_path, f"docker-credential-{name}", script, monkeypatch)


def test_cred_helpers_come_before_creds_store_which_comes_before_auths(tmp_path, monkeypatch):
    log = tmp_path / "asked"
    _helper(tmp_path, "perhost", f'read url; echo "$url" >> {log}; echo \'{{"Username":"{ROBOT}","Secret":"s1"}}\'',
            monkeypatch)
    _helper(tmp_path, "store", f'read url; echo "store $url" >> {log}; echo \'{{"Username":"bob","Secret":"s2"}}\'',
            monkeypatch)
    config = _config(tmp_path, {"credHelpers": {"harbor.example.com": "perhost"}, "credsStore": "store",
                                "auths": {"harbor.example.com": {"username": "file", "password": "f"}}})
    assert credentials_for("harbor.example.com", config) == Credentials(ROBOT, "s1")
    assert credentials_for("other.example.com:5000", config) == Credentials("bob", "s2")
    assert log.read_text().splitlines() == ["harbor.example.com", "store other.example.com:5000"]


def test_a_helper_without_credentials_falls_back_to_auths_and_a_token_user_means_an_identity_token(
        tmp_path, monkeypatch):
    _helper(tmp_path, "empty", 'echo "credentials not found in native keychain"; exit 1', monkeypatch)
    _helper(tmp_path, "oauth", 'echo \'{"Username":"<token>","Secret":"refresh"}\'', monkeypatch)
    config = _config(tmp_path, {"credHelpers": {"a.example.com": "empty", "b.example.com": "oauth"},
                                "auths": {"a.example.com": {"username": "u", "password": "p"}}})
    assert credentials_for("a.example.com", config) == Credentials("u", "p")
    assert credentials_for("b.example.com", config) == Credentials("", "", "refresh")


def test_a_failing_or_missing_helper_is_an_error_that_repeats_nothing_it_printed(tmp_path, monkeypatch):
    canary = f"canary-{uuid.uuid4().hex}"
    _helper(tmp_path, "broken", f'echo "{canary}"; echo "{canary}" >&2; exit 3', monkeypatch)
    config = _config(tmp_path, {"credHelpers": {"a.example.com": "broken", "b.example.com": "absent-helper"}})
    with pytest.raises(CredentialError, match=r"docker-credential-broken failed \(exit 3\)") as raised:
        credentials_for("a.example.com", config)
    assert canary not in str(raised.value)
    with pytest.raises(CredentialError, match="docker-credential-absent-helper is not installed"):
        credentials_for("b.example.com", config)


def test_credentials_never_show_their_secrets():
    creds = Credentials(ROBOT, "pw-canary", "token-canary")
    for text in (repr(creds), str(creds), f"{creds}", repr([creds]), repr(RegistryAuth("r", creds))):
        assert "pw-canary" not in text and "token-canary" not in text
    assert ROBOT in repr(creds)


# --- the token request ----------------------------------------------------------------------

def test_the_token_request_names_the_robot_account_intact_and_sends_it_as_basic_auth():
    auth = RegistryAuth("harbor.example.com", Credentials(ROBOT, "secret"))
    challenge = Challenge("bearer", {"realm": "https://harbor.example.com/service/token", "service": "harbor-registry"})
    request = auth.token_request(challenge, ("repository:p/app:pull,push", "repository:p/base:pull"))
    query = parse_qs(request.url.query.decode())
    assert query == {"service": ["harbor-registry"], "account": [ROBOT],
                     "scope": ["repository:p/app:pull,push", "repository:p/base:pull"]}
    user, _, password = base64.b64decode(request.headers["Authorization"].split()[1]).decode().partition(":")
    assert (user, password) == (ROBOT, "secret")


def test_an_identity_token_is_exchanged_with_the_oauth2_refresh_grant():
    auth = RegistryAuth("r.example.com", Credentials("", "", "refresh-token"))
    request = auth.token_request(Challenge("bearer", {"realm": "https://auth/token", "service": "svc"}),
                                 ("repository:a:pull",))
    form = parse_qs(request.read().decode())
    assert request.method == "POST" and form["grant_type"] == ["refresh_token"]
    assert form["refresh_token"] == ["refresh-token"] and form["scope"] == ["repository:a:pull"]


def _respond(request: httpx.Request, status: int, headers: dict | None = None, body: dict | None = None):
    return httpx.Response(status, headers=headers or {}, json=body, request=request)


def test_tokens_are_cached_per_scope_until_shortly_before_they_expire():
    now = [1000.0]
    auth = RegistryAuth("r.example.com", Credentials("u", "p"), clock=lambda: now[0], token_realms=("auth",))
    challenge = 'Bearer realm="https://auth/token",service="svc",scope="repository:a:pull"'

    def send(path: str, token_answers: list[str]) -> str:
        flow = auth.auth_flow(httpx.Request("GET", f"https://r.example.com{path}"))
        outgoing = next(flow)
        while True:
            if outgoing.url.host == "auth":
                response = _respond(outgoing, 200, body={"token": token_answers.pop(0), "expires_in": 60})
            elif "Authorization" in outgoing.headers and outgoing.headers["Authorization"].startswith("Bearer"):
                response = _respond(outgoing, 200)
            else:
                response = _respond(outgoing, 401, {"WWW-Authenticate": challenge})
            try:
                outgoing = flow.send(response)
            except StopIteration:
                return outgoing.headers.get("Authorization", "")

    assert send("/v2/a/manifests/v1", ["t1"]) == "Bearer t1"
    assert send("/v2/a/blobs/sha256:00", []) == "Bearer t1", "same scope: the cached token, no token request"
    assert send("/v2/b/manifests/v1", ["t2"]) == "Bearer t2", "another repository: its own token"
    now[0] += 56  # within the last 5 seconds of t1's 60
    assert send("/v2/a/manifests/v1", ["t3"]) == "Bearer t3"
    assert auth.token_requests == 3


# --- credentials stay where they belong -----------------------------------------------------

def _drive(auth: RegistryAuth, request: httpx.Request, answer) -> list[httpx.Request]:
    """Run one request through the auth flow, `answer(outgoing)` standing in for each hop; what went out."""
    sent: list[httpx.Request] = []
    flow = auth.auth_flow(request)
    outgoing = next(flow)
    while True:
        sent.append(outgoing)
        try:
            outgoing = flow.send(answer(outgoing))
        except StopIteration:
            return sent


def _bearer(realm: str) -> dict[str, str]:
    return {"WWW-Authenticate": f'Bearer realm="{realm}",service="svc"'}


@pytest.mark.parametrize(("realm", "trusted"), [
    ("https://r.example.com/token", ()),  # the registry's own host:port
    ("https://r.example.com:443/token", ()),
    ("https://auth.example.com/token", ("auth.example.com",)),
    ("https://auth.example.com:8443/token", ("auth.example.com:8443",)),
    ("http://127.0.0.1:9000/token", ("127.0.0.1:9000",)),  # plain http only on loopback
])
def test_a_token_realm_is_followed_on_the_registry_itself_or_where_the_configuration_names_it(realm, trusted):
    auth = RegistryAuth("r.example.com", Credentials("u", "p"), token_realms=trusted)
    sent = _drive(auth, httpx.Request("GET", "https://r.example.com/v2/a/manifests/v1"),
                  lambda out: (_respond(out, 200, body={"token": "t"}) if out.url.path == "/token" else
                               _respond(out, 200) if "Authorization" in out.headers else
                               _respond(out, 401, _bearer(realm))))
    assert sent[1].url.copy_with(query=None) == httpx.URL(realm), "the token request went to the realm"
    assert sent[-1].headers["Authorization"] == "Bearer t"


@pytest.mark.parametrize(("realm", "trusted", "said"), [
    ("https://auth.example.com/token", (), "another host, auth.example.com:443"),
    ("https://r.example.com:8443/token", (), "another host, r.example.com:8443"),  # another port: another host
    ("https://auth.example.com:8443/token", ("auth.example.com",), "auth.example.com:8443"),
    ("https://auth.example.com/token", ("other.example.com",), "auth.example.com:443"),
    ("http://auth.example.com/token", ("auth.example.com",), "plain http"),
    ("ftp://r.example.com/token", (), "not an http(s) URL"),
    ("/token", (), "not an http(s) URL"),
])
def test_a_token_realm_nobody_named_is_refused_before_any_credential_goes_there(realm, trusted, said):
    auth = RegistryAuth("r.example.com", Credentials("u", "p-canary"), token_realms=trusted)
    sent: list[httpx.Request] = []

    def answer(out: httpx.Request) -> httpx.Response:
        sent.append(out)
        return _respond(out, 401, _bearer(realm))

    with pytest.raises(RealmRefused, match=re.escape(said)) as raised:
        _drive(auth, httpx.Request("GET", "https://r.example.com/v2/a/manifests/v1"), answer)
    assert "p-canary" not in str(raised.value)
    assert [r.url.host for r in sent] == ["r.example.com"], "no token request went out"
    assert auth._challenge is None and auth.token_requests == 0


def test_token_realm_hosts_come_from_IMAGEBUILD_TOKEN_REALMS_and_docker_hubs_is_built_in():
    env = {"IMAGEBUILD_TOKEN_REALMS": "registry.gitlab.com=gitlab.com;127.0.0.1:5443=127.0.0.1:9000,[::1]:9001 "
                                      "docker.io=extra.example.com"}
    assert token_realms_from_env("registry.gitlab.com", env) == ("gitlab.com",)
    assert token_realms_from_env("127.0.0.1:5443", env) == ("127.0.0.1:9000", "[::1]:9001")
    assert token_realms_from_env("registry-1.docker.io", env) == ("extra.example.com",)
    assert token_realms_from_env("elsewhere.example.com", env) == ()
    assert RegistryAuth("registry-1.docker.io", token_realms=()).trusted_realms() == ("auth.docker.io",)
    for bad in ("registry.gitlab.com", "r=", "r=host/path", "=host", "r=a,,b", "r=ho\x1bst"):
        with pytest.raises(CredentialError, match=re.escape("IMAGEBUILD_TOKEN_REALMS: entry 1 ")) as raised:
            token_realms_from_env("r", {"IMAGEBUILD_TOKEN_REALMS": bad})
        assert "expected REGISTRY=HOST[:PORT]" in str(raised.value) and "\x1b" not in str(raised.value)


def test_a_request_elsewhere_or_a_redirect_targets_401_gets_no_credentials_and_changes_nothing():
    auth = RegistryAuth("r.example.com", Credentials("u", "p"), origin="https://r.example.com")
    basic = _drive(auth, httpx.Request("GET", "https://r.example.com/v2/a/manifests/v1"),
                   lambda out: _respond(out, 200 if "Authorization" in out.headers else 401,
                                        {"WWW-Authenticate": 'Basic realm="r"'}))
    assert basic[-1].headers["Authorization"].startswith("Basic ") and auth._challenge.scheme == "basic"
    challenge = auth._challenge
    # The registry redirects a blob to storage, which answers 401 with a challenge of its own.
    storage = httpx.Request("GET", "https://storage.example.net/blob")
    sent = _drive(auth, httpx.Request("GET", "https://r.example.com/v2/a/blobs/sha256:00"),
                  lambda out: httpx.Response(401, headers=_bearer("https://storage.example.net/token"),
                                             request=storage))
    assert len(sent) == 1, "no token request and no retry"
    assert auth._challenge is challenge and auth.token_requests == 0
    # A URL on another origin (an upload Location elsewhere) goes out without credentials, and
    # the same host on another port or scheme is another origin.
    for url in ("https://storage.example.net/upload", "https://r.example.com:8443/v2/a/blobs/uploads/x",
                "http://r.example.com/v2/a/blobs/uploads/x"):
        [out] = _drive(auth, httpx.Request("PUT", url), lambda out: _respond(out, 401, {"WWW-Authenticate": 'Basic realm="x"'}))
        assert "Authorization" not in out.headers
    assert auth._challenge is challenge


# --- names from a registry ------------------------------------------------------------------

@pytest.mark.parametrize("digest", ["sha256:" + "a" * 64, "sha512:" + "0" * 128])
def test_registered_digests_pass(digest):
    assert check_digest(digest) == digest and check_reference(digest) == digest


@pytest.mark.parametrize("digest", [
    "sha256:../../other/blobs/sha256:" + "a" * 64, "sha256:" + "a" * 63, "sha256:" + "A" * 64,
    "sha512:" + "a" * 64, "md5:" + "a" * 32, "sha256:" + "a" * 64 + "/x", "sha256:" + "a" * 64 + "?x",
    "sha256:" + "a" * 64 + "\n", "", None, 7,
])
def test_anything_else_is_not_a_digest(digest):
    with pytest.raises(BadName, match=re.escape(f"digest {digest!r} is not a digest (sha256:<64 hex>")):
        check_digest(digest)


@pytest.mark.parametrize(("tag", "good"), [
    ("v1", True), ("_x", True), ("sha256-" + "a" * 64 + ".sig", True), ("a" * 128, True),
    ("a" * 129, False), (".hidden", False), ("-x", False), ("a/b", False), ("..", False), ("v1?x", False),
    ("t\x1b[2K", False), ("", False),
])
def test_tags_follow_the_oci_grammar(tag, good):
    if good:
        assert check_tag(tag) == tag
    else:
        with pytest.raises(BadName, match=re.escape(f"tag {tag!r} is not a tag ([A-Za-z0-9_]")):
            check_tag(tag)


def test_a_refusal_names_the_value_escaped():
    with pytest.raises(BadName, match=re.escape("layer digest 'sha256:\\x1b[32mverified\\x1b[0m/../x' is not")) as raised:
        check_descriptor({"digest": "sha256:\x1b[32mverified\x1b[0m/../x", "size": 1}, "layer")
    assert "\x1b" not in str(raised.value)
    with pytest.raises(BadName, match="size"):
        check_descriptor({"digest": "sha256:" + "a" * 64, "size": "1"})


def test_the_client_refuses_a_bad_name_before_any_request_goes_out():
    sent: list[httpx.Request] = []
    with Registry("127.0.0.1:9", event_hooks={"request": [sent.append]}) as registry:  # nothing listens
        for call, said in (
                (lambda: registry.get_blob("a", "sha256:../../b/blobs/x"),
                 "127.0.0.1:9/a: GET blob: digest 'sha256:../../b/blobs/x' is not a digest"),
                (lambda: registry.head_manifest("a", "v1/../../b"),
                 "127.0.0.1:9/a: HEAD manifest: reference 'v1/../../b' is not a tag"),
                (lambda: registry.referrers("a", "sha256:" + "a" * 64 + "/x"),
                 f"127.0.0.1:9/a: GET referrers: digest 'sha256:{'a' * 64}/x' is not a digest"),
                (lambda: registry.get_manifest("A/../b", "v1"),
                 "127.0.0.1:9: GET manifest: repository 'A/../b' is not a repository name"),
                (lambda: registry.try_mount("a", "sha256:" + "a" * 64, "../b"),
                 "127.0.0.1:9/a: mount blob: mount source '../b' is not a repository name")):
            with pytest.raises(RegistryError, match=re.escape(said)):
                call()
    assert sent == []


# --- Retry-After and backoff ----------------------------------------------------------------

def test_retry_after_in_seconds_or_as_an_http_date():
    now = datetime(2026, 12, 1, 6, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(format_datetime(now + timedelta(seconds=30), usegmt=True), now=now) == 30.0
    assert parse_retry_after(format_datetime(now - timedelta(seconds=30), usegmt=True), now=now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_backoff_doubles_up_to_its_ceiling_with_full_jitter():
    policy = RetryPolicy(base_delay_s=0.5, max_delay_s=4.0)
    assert [policy.backoff(n, rng=lambda: 1.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.backoff(3, rng=lambda: 0.0) == 0.0
    assert 0.0 <= policy.backoff(2) <= 2.0


def test_a_retry_after_is_obeyed_unless_longer_than_the_policy_allows():
    policy = RetryPolicy(max_retry_after_s=30)
    assert policy.delay(0, 12.0) == 12.0
    assert policy.delay(0, 31.0) is None
    assert policy.delay(2, None, rng=lambda: 1.0) == policy.base_delay_s * 4
    capped = RetryPolicy(max_retry_after_s=30, cap_retry_after=True)  # Harbor's: wait the most, then try again
    assert capped.delay(0, 12.0) == 12.0 and capped.delay(0, 3600.0) == 30.0


# --- transport and names --------------------------------------------------------------------

def test_plain_http_only_for_loopback_by_default_or_registries_marked_insecure(tmp_path):
    assert base_url("127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert base_url("localhost:5000") == "http://localhost:5000"
    assert base_url("harbor.example.com") == "https://harbor.example.com"
    assert base_url("harbor.example.com", insecure=True) == "http://harbor.example.com"
    assert base_url("127.0.0.1:5443", ca_bundle=tmp_path / "ca.pem") == "https://127.0.0.1:5443"
    assert base_url("127.0.0.1:5000", insecure=False) == "https://127.0.0.1:5000"


@pytest.mark.parametrize(("registry", "scheme"), [
    ("127.0.0.1:5000", "http"), ("127.9.8.7", "http"), ("[::1]:5000", "http"), ("::1", "http"),
    ("localhost", "http"), ("LOCALHOST:5000", "http"),
    # Names that merely start like loopback are names: whoever controls their DNS gets https.
    ("127.evil.example", "https"), ("127.0.0.1.nip.io:5000", "https"), ("127.1", "https"),
    ("localhost.evil.example", "https"), ("0x7f000001", "https"), ("[::ffff:127.0.0.1]:5000", "https"),
])
def test_loopback_means_an_address_that_parses_as_one_not_a_prefix(registry, scheme):
    assert base_url(registry).split(":", 1)[0] == scheme
    assert is_loopback("127.evil.example") is False


def test_cosign_and_referrers_fallback_tags_of_a_digest():
    digest = "sha256:" + "ab" * 32
    assert cosign_tag(digest, "sig") == "sha256-" + "ab" * 32 + ".sig"
    assert cosign_tag(digest) == "sha256-" + "ab" * 32


# --- where blobs were seen ------------------------------------------------------------------

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def test_blob_locations_keep_the_newest_repositories_first_and_survive_in_their_file(tmp_path):
    path = tmp_path / "cache" / "blob-locations.json"
    locations = BlobLocations(path)
    for repository in ("a", "b", "c", "d", "e", "b"):
        locations.remember("r.example.com", D1, repository)
    assert locations.hints("r.example.com", D1) == ["b", "e", "d", "c"]
    assert locations.hints("other.example.com", D1) == []
    locations.save()
    assert BlobLocations(path).hints("r.example.com", D1) == ["b", "e", "d", "c"]


def test_saving_merges_what_another_process_wrote_meanwhile(tmp_path):
    path = tmp_path / "blob-locations.json"
    mine, theirs = BlobLocations(path), BlobLocations(path)
    theirs.remember("r", D1, "theirs")
    theirs.remember("r", D2, "theirs")
    theirs.save()
    mine.remember("r", D1, "mine")
    mine.save()
    again = BlobLocations(path)
    assert again.hints("r", D1) == ["mine", "theirs"] and again.hints("r", D2) == ["theirs"]


def test_a_damaged_cache_file_is_ignored_and_a_refused_hint_forgotten(tmp_path):
    path = tmp_path / "blob-locations.json"
    path.write_text('{"locations": {"r": ')
    locations = BlobLocations(path)
    assert locations.hints("r", D1) == []
    locations.remember("r", D1, "gone")
    locations.remember("r", D1, "here")
    locations.forget("r", D1, "gone")
    assert locations.hints("r", D1) == ["here"]


def test_the_cache_lives_under_IMAGEBUILD_CACHE_DIR_or_the_xdg_cache():
    assert default_cache_dir({"IMAGEBUILD_CACHE_DIR": "/c"}) == Path("/c")
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/imagebuild")
    assert default_cache_dir({"HOME": "/h"}) == Path("/h/.cache/imagebuild")


def test_cache_entries_outside_the_oci_grammar_are_dropped_when_read(tmp_path):
    path = tmp_path / "blob-locations.json"
    path.write_text(json.dumps({"version": 1, "locations": {"r": {
        D1: ["good/repo", "../other", "Upper", "a?mount=x"], "sha256:../../x": ["good/repo"]}}}))
    locations = BlobLocations(path)
    assert locations.hints("r", D1) == ["good/repo"] and locations.hints("r", "sha256:../../x") == []
