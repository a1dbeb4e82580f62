"""The OCI client against real registries: basic auth, token auth, TLS, faults, copies, signatures.

Images are made by crane in the staging registry; digests are checked with skopeo and crane,
signatures with cosign, all independently of imagebuild's client.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import tracemalloc
import uuid
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest

from imagebuild.oci.auth import Credentials
from imagebuild.oci.client import (
    DOCKER_MANIFEST_LIST,
    OCI_INDEX,
    OCI_MANIFEST,
    Registry,
    RegistryAuthError,
    RegistryError,
)
from imagebuild.oci.copy import CopyOptions, copy_image, cosign_tag
from imagebuild.oci.locations import BlobLocations
from imagebuild.oci.retry import RetryPolicy

from .conftest import STAGING, require_registry
from .oci_servers import (
    TOKEN_REALMS_ENV,
    Fault,
    FlakyProxy,
    RecordingServer,
    TestCA,
    TokenIssuer,
    htpasswd,
    run,
    start_distribution,
)
from .tools import push_tiny_image, skopeo_digest

REGION = "127.0.0.1:5001"
ROBOT = "robot$imagebuild+ci"  # Harbor's robot naming: `$` and `+` must survive every layer
FAST_RETRIES = RetryPolicy(attempts=4, base_delay_s=0.05, max_delay_s=0.2, max_elapsed_s=30)


def _unique(prefix: str) -> str:
    return f"e2e-oci/{prefix}-{uuid.uuid4().hex[:8]}"


# --- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def own_blob_cache(tmp_path_factory):
    """Copies remember where blobs landed (oci_locations); these tests keep theirs apart."""
    import imagebuild.oci.copy as oci_copy

    previous = os.environ.get("IMAGEBUILD_CACHE_DIR")
    os.environ["IMAGEBUILD_CACHE_DIR"] = str(tmp_path_factory.mktemp("imagebuild-cache"))
    oci_copy._default = None
    yield
    oci_copy._default = None
    if previous is None:
        os.environ.pop("IMAGEBUILD_CACHE_DIR")
    else:
        os.environ["IMAGEBUILD_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def region_registry() -> str:
    return require_registry(REGION, "region registry")


@pytest.fixture(scope="session")
def passwords() -> dict[str, str]:
    """Unique per run: each doubles as a canary that must never show up in output."""
    return {ROBOT: f"canary-robot-{uuid.uuid4().hex}", "reader": f"canary-reader-{uuid.uuid4().hex}"}


@pytest.fixture(scope="session")
def basic_registry(tmp_path_factory, passwords):
    directory = tmp_path_factory.mktemp("basic-registry")
    users = htpasswd(directory / "htpasswd", {ROBOT: passwords[ROBOT], "reader": passwords["reader"]})
    registry = start_distribution(directory, auth={"htpasswd": {"realm": "imagebuild-test", "path": str(users)}})
    yield registry.host
    registry.stop()


@pytest.fixture(scope="session")
def token_service(tmp_path_factory, passwords):
    issuer = TokenIssuer(tmp_path_factory.mktemp("token-issuer"),
                         {ROBOT: (passwords[ROBOT], ("pull", "push")), "reader": (passwords["reader"], ("pull",))})
    yield issuer
    issuer.stop()


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory, token_service):
    # The token service listens on another port, another host:port: start_distribution names it in
    # IMAGEBUILD_TOKEN_REALMS for this registry, as an operator would.
    registry = start_distribution(tmp_path_factory.mktemp("token-registry"), auth=token_service.registry_auth())
    yield registry.host
    registry.stop()


@pytest.fixture(scope="session")
def test_ca(tmp_path_factory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="session")
def tls_registry(tmp_path_factory, test_ca):
    directory = tmp_path_factory.mktemp("tls-registry")
    registry = start_distribution(directory, tls=test_ca.server_cert())
    yield registry.host
    registry.stop()


def crane_image(tmp_path: Path, repository: str, size: int = 64, base: str | None = None) -> str:
    """A one-layer image of `size` random bytes pushed by crane to staging; its digest."""
    return push_tiny_image(tmp_path, f"{STAGING}/{repository}:t", base, size)


def crane_blob_digest(tools, ref: str) -> str:
    """The sha256 of the blob as crane downloads it."""
    import subprocess

    done = subprocess.run([tools["crane"], "blob", "--insecure", ref], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-500:]
    return "sha256:" + hashlib.sha256(done.stdout).hexdigest()


def skopeo_raw_digest(tools, ref: str, creds: str | None = None) -> str:
    argv = [tools["skopeo"], "inspect", "--raw", "--tls-verify=false"]
    if creds:
        argv += ["--creds", creds]
    return "sha256:" + hashlib.sha256(run([*argv, f"docker://{ref}"]).stdout.encode()).hexdigest()


# --- basic auth -----------------------------------------------------------------------------

def test_a_robot_account_copies_into_a_basic_auth_registry(tools, tmp_path, basic_registry, passwords):
    repository = _unique("basic")
    digest = crane_image(tmp_path, repository)
    with Registry(STAGING) as source, Registry(basic_registry, credentials=Credentials(ROBOT, passwords[ROBOT])) as target:
        result = copy_image(source, repository, digest, target, repository, tags=["v1"])
    assert result.digest == digest
    assert skopeo_digest(tools["skopeo"], f"{basic_registry}/{repository}:v1", creds=f"{ROBOT}:{passwords[ROBOT]}") == digest


def test_credentials_come_from_the_docker_config_file(tools, tmp_path, basic_registry, passwords):
    repository = _unique("dockercfg")
    digest = crane_image(tmp_path, repository)
    config = tmp_path / "docker" / "config.json"
    config.parent.mkdir()
    auth = base64.b64encode(f"{ROBOT}:{passwords[ROBOT]}".encode()).decode()
    config.write_text(json.dumps({"auths": {f"http://{basic_registry}": {"auth": auth}}}))
    with Registry(STAGING) as source, Registry(basic_registry, docker_config=config) as target:
        copy_image(source, repository, digest, target, repository, tags=["v1"])
    # crane reads the same file (DOCKER_CONFIG) and agrees.
    env = {**os.environ, "DOCKER_CONFIG": str(config.parent)}
    assert run([tools["crane"], "digest", "--insecure", f"{basic_registry}/{repository}:v1"], env=env).stdout.strip() == digest


def test_wrong_credentials_fail_in_one_line_naming_the_registry_and_never_the_secret(
        tmp_path, basic_registry, caplog):
    canary = f"canary-wrong-{uuid.uuid4().hex}"
    repository = _unique("denied")
    digest = crane_image(tmp_path, repository)
    caplog.set_level(logging.DEBUG)
    target = Registry(basic_registry, credentials=Credentials(ROBOT, canary))
    denied = f"{basic_registry}/{repository}@{digest}: HEAD manifest answered HTTP 401 (credentials missing or refused)"
    with Registry(STAGING) as source, pytest.raises(RegistryAuthError, match=re.escape(denied)) as raised:
        copy_image(source, repository, digest, target, repository, tags=["v1"])
    message = str(raised.value)
    assert "\n" not in message
    assert raised.value.status == 401
    header = base64.b64encode(f"{ROBOT}:{canary}".encode()).decode()  # what went over the wire
    assert "HTTP Request: PUT" not in caplog.text and "HTTP Request: HEAD http" in caplog.text
    for text in (message, repr(raised.value), repr(target), repr(target.auth), repr(target.auth.credentials),
                 str(target.auth.credentials), caplog.text):
        assert canary not in text and header not in text
    target.close()


# --- token auth -----------------------------------------------------------------------------

def test_token_auth_grants_push_to_the_robot_and_caches_tokens_per_scope(tools, tmp_path, token_registry,
                                                                          token_service, passwords, caplog):
    caplog.set_level(logging.DEBUG)
    repository = _unique("token")
    first, second = crane_image(tmp_path, repository), None
    before = len(token_service.requests)
    with Registry(STAGING) as source, Registry(token_registry, credentials=Credentials(ROBOT, passwords[ROBOT])) as target:
        copy_image(source, repository, first, target, repository, tags=["v1"])
        second = crane_image(tmp_path, repository)
        copy_image(source, repository, second, target, repository, tags=["v2"])
    asked = token_service.requests[before:]
    assert all(request.account == ROBOT for request in asked), "the robot's name arrives intact"
    assert any(f"repository:{repository}:pull,push" in request.granted for request in asked)
    # One token per scope (pull; pull+push), reused for every request of both copies.
    assert len(asked) <= 2, asked
    assert "HTTP Request: GET http://127.0.0.1" in caplog.text, "httpx's request log was captured"
    for secret in (passwords[ROBOT], *token_service.issued):
        assert secret not in caplog.text, "neither the password nor a token is logged"
    creds = f"{ROBOT}:{passwords[ROBOT]}"
    assert skopeo_digest(tools["skopeo"], f"{token_registry}/{repository}:v1", creds=creds) == first
    assert skopeo_digest(tools["skopeo"], f"{token_registry}/{repository}:v2", creds=creds) == second


def test_token_auth_refuses_a_push_the_user_may_not_make(tmp_path, token_registry, passwords):
    repository = _unique("readonly")
    digest = crane_image(tmp_path, repository)
    with Registry(STAGING) as source, Registry(token_registry, credentials=Credentials("reader", passwords["reader"])) as target:
        with pytest.raises(RegistryAuthError, match=re.escape(f"{token_registry}/{repository}: start upload answered HTTP ")
                           + r"(401 \(credentials missing or refused\)|403 \(the credentials lack permission\))") as raised:
            copy_image(source, repository, digest, target, repository, tags=["v1"])
    assert raised.value.status in (401, 403)
    assert passwords["reader"] not in str(raised.value)


def test_token_auth_with_wrong_password_is_refused_by_the_token_service(token_registry):
    canary = f"canary-{uuid.uuid4().hex}"
    with Registry(token_registry, credentials=Credentials(ROBOT, canary)) as target:
        with pytest.raises(RegistryAuthError,
                           match=re.escape(f"{token_registry}: the token service refused the credentials (HTTP 401)")) as raised:
            target.head_manifest(_unique("any"), "v1")
    assert canary not in str(raised.value)


def test_a_mount_within_a_token_registry_asks_for_pull_on_the_source_repository(
        tools, tmp_path, basic_registry, token_registry, token_service, passwords):
    # The image comes from the basic-auth registry (an authenticated source), lands in one
    # repository of the token registry, then moves to another there by mounting.
    first, second = _unique("token-mount-a"), _unique("token-mount-b")
    digest = crane_image(tmp_path, first)
    robot = Credentials(ROBOT, passwords[ROBOT])
    with Registry(STAGING) as staging, Registry(basic_registry, credentials=robot) as basic:
        copy_image(staging, first, digest, basic, first)
    with Registry(basic_registry, credentials=robot) as basic, Registry(token_registry, credentials=robot) as target:
        across = copy_image(basic, first, digest, target, first)
        before = len(token_service.requests)
        within = copy_image(target, first, digest, target, second, tags=["mounted"])
    assert across.stats.blobs_uploaded == 2
    assert within.stats.blobs_mounted == 2 and within.stats.bytes_uploaded == 0
    asked = [scope for request in token_service.requests[before:] for scope in request.granted]
    assert f"repository:{first}:pull" in asked and f"repository:{second}:pull,push" in asked
    creds = f"{ROBOT}:{passwords[ROBOT]}"
    assert skopeo_digest(tools["skopeo"], f"{token_registry}/{second}:mounted", creds=creds) == digest


def test_an_identity_token_from_the_docker_config_is_exchanged_for_registry_tokens(
        tmp_path, token_registry, token_service):
    refresh = f"refresh-canary-{uuid.uuid4().hex}"
    token_service.refresh_tokens[refresh] = ROBOT
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {token_registry: {"identitytoken": refresh}}}))
    repository = _unique("identity")
    digest = crane_image(tmp_path, repository)
    with Registry(STAGING) as source, Registry(token_registry, docker_config=config) as target:
        target.check_access(repository, push=True)
        copy_image(source, repository, digest, target, repository, tags=["v1"])
        assert target.head_manifest(repository, "v1") == digest
        assert refresh not in repr(target)


def test_check_access_tells_pull_rights_from_push_rights(token_registry, passwords):
    repository = _unique("access")
    with Registry(token_registry, credentials=Credentials("reader", passwords["reader"])) as reader:
        reader.check_access(repository)
        with pytest.raises(RegistryAuthError, match=re.escape(f"{token_registry}/{repository}: check access answered "
                                                               "HTTP 401 (credentials missing or refused)")) as raised:
            reader.check_access(repository, push=True)
    assert raised.value.status == 401


# --- credentials stay where they belong -----------------------------------------------------

def test_a_blob_redirected_to_a_host_asking_for_credentials_gets_none_and_the_registry_keeps_working(
        basic_registry, passwords):
    repository = _unique("redirect")
    robot = Credentials(ROBOT, passwords[ROBOT])
    content = json.dumps({"redirected": uuid.uuid4().hex}).encode()
    with Registry(basic_registry, credentials=robot) as direct:
        digest = direct.put_blob(repository, content)
    # Storage that answers 401 with a bearer realm of its own, on its own host:port. It is even
    # named as a trusted realm: a redirect's host gets no credentials whatever the allowlist says.
    storage = RecordingServer()
    storage.default = (401, {"WWW-Authenticate": f'Bearer realm="http://{storage.host}/token",service="storage"'}, b"")
    storage.routes["/token"] = (200, {"Content-Type": "application/json"}, b'{"token": "storage-token"}')
    proxy = FlakyProxy(basic_registry, [Fault("GET", r"/blobs/sha256:", "redirect", location=f"http://{storage.host}/b")])
    try:
        with Registry(proxy.host, credentials=robot, token_realms=(storage.host,)) as client:
            assert client.blob_size(repository, digest) == len(content)  # the registry's basic challenge
            with pytest.raises(RegistryError, match=re.escape(f"GET blob: the redirect target {storage.host!r} answered "
                                                              "HTTP 401 (the registry's credentials are never sent")) as raised:
                client.get_blob(repository, digest)
            assert [seen.authorization for seen in storage.seen] == [None], "no credentials, no token"
            assert storage.paths() == ["/b"], "followed once, no token request, no retry"
            assert raised.value.status == 401 and passwords[ROBOT] not in str(raised.value)
            assert client.auth._challenge is not None and client.auth._challenge.scheme == "basic"
            assert client.auth.token_requests == 0
            # The registry itself still works with its own credentials (the redirect was a one-off).
            assert client.get_blob(repository, digest) == content
            assert client.blob_size(repository, digest) == len(content)
        assert [seen.authorization for seen in storage.seen] == [None]
    finally:
        proxy.stop()
        storage.stop()


def test_a_token_realm_on_another_host_is_refused_unless_named_and_works_once_named(
        token_registry, token_service, passwords, monkeypatch):
    monkeypatch.delenv(TOKEN_REALMS_ENV, raising=False)
    repository = _unique("realm")
    robot = Credentials(ROBOT, passwords[ROBOT])
    before = len(token_service.requests)
    refused = (f"{token_registry}: the registry sends token requests to another host, {token_service.host}; "
               f"no credentials go there unless {TOKEN_REALMS_ENV} names it")
    with Registry(token_registry, credentials=robot) as untrusting, \
            pytest.raises(RegistryAuthError, match=re.escape(refused)) as raised:
        untrusting.check_access(repository, push=True)
    message = str(raised.value)
    assert passwords[ROBOT] not in message and "\n" not in message
    assert len(token_service.requests) == before, "the unnamed token service heard nothing"
    with Registry(token_registry, credentials=robot, token_realms=[token_service.host]) as named:
        named.check_access(repository, push=True)
    monkeypatch.setenv(TOKEN_REALMS_ENV, f"elsewhere.example.com=x.example.com;{token_registry}={token_service.host}")
    with Registry(token_registry, credentials=robot) as configured:
        configured.check_access(repository, push=True)
    accounts = {request.account for request in token_service.requests[before:]}
    assert accounts == {ROBOT}, "tokens came once the realm was named, by argument or by the environment"


# --- TLS ------------------------------------------------------------------------------------

def test_a_tls_registry_is_reached_with_its_ca_bundle_and_refused_without(tools, tmp_path, tls_registry, test_ca):
    repository = _unique("tls")
    digest = crane_image(tmp_path, repository)
    with Registry(STAGING) as source, Registry(tls_registry, ca_bundle=test_ca.bundle) as target:
        assert target.url.startswith("https://")
        copy_image(source, repository, digest, target, repository, tags=["v1"])
    assert skopeo_digest(tools["skopeo"], f"{tls_registry}/{repository}:v1", ca_dir=test_ca.trust_dir) == digest
    untrusted = (re.escape(f"{tls_registry}/{repository}: HEAD manifest: ") + ".*certificate verify failed.*"
                 + re.escape("(the registry's certificate is not trusted: give its CA bundle)"))
    with Registry(tls_registry, insecure=False) as untrusting, pytest.raises(RegistryError, match=untrusted):
        untrusting.head_manifest(repository, "v1")
    assert untrusting.retry_log.retries == 0, "an untrusted certificate is not retried"


# --- copies ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "media_type"), [
    ([], OCI_INDEX),
    (["--docker-empty-base"], DOCKER_MANIFEST_LIST),
], ids=["oci-index", "docker-manifest-list"])
def test_a_multi_arch_index_is_copied_whole_and_a_second_copy_uploads_nothing(tools, tmp_path, region_registry,
                                                                              flags, media_type):
    repository = _unique("index")
    children = [crane_image(tmp_path, f"{repository}-{n}") for n in range(2)]
    index_ref = f"{STAGING}/{repository}:multi"
    run([tools["crane"], "index", "append", "--insecure", *flags, "-t", index_ref,
         *[arg for n, d in enumerate(children) for arg in ("-m", f"{STAGING}/{repository}-{n}@{d}")]])
    index_digest = run([tools["crane"], "digest", "--insecure", index_ref]).stdout.strip()
    with Registry(STAGING) as source, Registry(region_registry) as target:
        first = copy_image(source, repository, index_digest, target, repository, tags=["multi"])
        assert first.media_type == media_type
        assert first.stats.manifests_put == 3 and first.stats.blobs_uploaded == 4 and first.stats.bytes_uploaded > 0
        again = copy_image(source, repository, index_digest, target, repository, tags=["multi"])
    assert again.stats.bytes_uploaded == 0 and again.stats.blobs_uploaded == 0 and again.stats.manifests_put == 0
    assert skopeo_raw_digest(tools, f"{region_registry}/{repository}:multi") == index_digest
    for child in children:
        assert run([tools["crane"], "digest", "--insecure", f"{region_registry}/{repository}@{child}"]).stdout.strip() == child


def test_an_image_whose_base_layers_the_target_holds_uploads_only_its_own(tools, tmp_path, region_registry):
    repository = _unique("layers")
    base = crane_image(tmp_path, repository, size=200_000)
    child = crane_image(tmp_path, repository, size=1000, base=f"{STAGING}/{repository}@{base}")
    with Registry(STAGING) as source, Registry(region_registry) as target:
        copy_image(source, repository, base, target, repository)
        result = copy_image(source, repository, child, target, repository, tags=["child"])
        manifest = json.loads(source.get_manifest(repository, child)[0])
    new_layer, config = manifest["layers"][-1], manifest["config"]
    assert result.stats.blobs_present == 1, "the base layer was already there"
    assert result.stats.bytes_uploaded == new_layer["size"] + config["size"]
    assert skopeo_digest(tools["skopeo"], f"{region_registry}/{repository}:child") == child


def test_a_copy_within_one_registry_mounts_every_blob(tools, tmp_path, staging_registry):
    source_repository, target_repository = _unique("mount-src"), _unique("mount-dst")
    digest = crane_image(tmp_path, source_repository)
    with Registry(STAGING) as registry:
        result = copy_image(registry, source_repository, digest, registry, target_repository, tags=["release"])
    assert result.stats.blobs_mounted == 2 and result.stats.bytes_uploaded == 0
    assert run([tools["crane"], "digest", "--insecure", f"{STAGING}/{target_repository}:release"]).stdout.strip() == digest


def _large_image(tmp_path, repository: str, size: int) -> tuple[str, dict]:
    digest = crane_image(tmp_path, repository, size=size)
    with Registry(STAGING) as staging:
        return digest, json.loads(staging.get_manifest(repository, digest)[0])


def test_blobs_the_target_registry_holds_in_another_repository_are_mounted_across_registries(
        tools, tmp_path, region_registry):
    repository = _unique("hinted")
    digest = crane_image(tmp_path, repository, size=300_000)
    cache = tmp_path / "blob-locations.json"
    first, second, third = (f"{repository}-{n}" for n in range(3))
    with Registry(STAGING) as source, Registry(region_registry) as target:
        uploaded = copy_image(source, repository, digest, target, first, options=CopyOptions(locations=BlobLocations(cache)))
        # A later process reads where the first copy put the blobs, and mounts them from there.
        mounted = copy_image(source, repository, digest, target, second, options=CopyOptions(locations=BlobLocations(cache)))
        # Without that knowledge, the same copy uploads everything again.
        unhinted = copy_image(source, repository, digest, target, third, options=CopyOptions(locations=BlobLocations()))
    assert uploaded.stats.blobs_uploaded == 2 and uploaded.stats.bytes_uploaded > 300_000
    assert mounted.stats.blobs_mounted == 2 and mounted.stats.bytes_uploaded == 0
    assert unhinted.stats.blobs_uploaded == 2 and unhinted.stats.bytes_uploaded == uploaded.stats.bytes_uploaded
    assert skopeo_raw_digest(tools, f"{region_registry}/{second}@{digest}") == digest
    with Registry(STAGING) as source:
        layer = json.loads(source.get_manifest(repository, digest)[0])["layers"][0]["digest"]
    assert BlobLocations(cache).hints(region_registry, layer) == [second, first]


def test_a_hint_to_a_repository_the_user_may_not_read_falls_back_to_an_upload(
        tools, tmp_path, token_registry, token_service, passwords):
    repository = _unique("private")
    digest = crane_image(tmp_path, repository)
    token_service.users["team"] = (passwords["reader"], ("pull", "push"))
    token_service.limited_to["team"] = "e2e-oci/team-"
    locations = BlobLocations()
    options = CopyOptions(locations=locations)
    with Registry(STAGING) as source:
        with Registry(token_registry, credentials=Credentials(ROBOT, passwords[ROBOT])) as robot:
            copy_image(source, repository, digest, robot, repository, options=options)
        with Registry(token_registry, credentials=Credentials("team", passwords["reader"])) as team:
            own = _unique("team")
            result = copy_image(source, repository, digest, team, own, tags=["v1"], options=options)
    with Registry(STAGING) as source:
        layer = json.loads(source.get_manifest(repository, digest)[0])["layers"][0]["digest"]
    assert locations.hints(token_registry, layer) == [own, repository]
    assert result.stats.blobs_mounted == 0 and result.stats.blobs_uploaded == 2
    tried = [r for r in token_service.requests if r.account == "team" and f"repository:{repository}:pull" in r.scopes]
    assert tried and not any(repository in scope for r in tried for scope in r.granted), "the mount was tried, refused"
    assert skopeo_digest(tools["skopeo"], f"{token_registry}/{own}:v1", creds=f"team:{passwords['reader']}") == digest


def test_a_large_blob_goes_in_chunks_and_an_interrupted_upload_resumes_where_the_registry_stands(
        tools, tmp_path, region_registry):
    repository = _unique("large")
    size, chunk = 64 * 1024 * 1024, 4 * 1024 * 1024
    digest, manifest = _large_image(tmp_path, repository, size)
    layer = manifest["layers"][0]
    chunks = -(-layer["size"] // chunk)
    assert chunks > 8
    # The third chunk is lost before it reaches the target (the source is read again from that
    # chunk's start); then the source's stream breaks off half-way (read again from there).
    source_proxy = FlakyProxy(STAGING, [Fault("GET", f"/blobs/{layer['digest']}$", "cut", after=1)])
    target_proxy = FlakyProxy(region_registry, [Fault("PATCH", r"/blobs/uploads/", "drop", after=2)])
    tracemalloc.start()
    try:
        with Registry(source_proxy.host) as source, Registry(target_proxy.host) as target:
            result = copy_image(source, repository, digest, target, repository, tags=["big"],
                                options=CopyOptions(chunk_size=chunk))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        source_proxy.stop()
        target_proxy.stop()
    # Streamed: what this process held at most (the two proxies included) is a fraction of the blob.
    assert peak < layer["size"] // 3, f"{peak} bytes in memory at once for a {layer['size']}-byte blob"
    assert target_proxy.faults[0].served == 1 and source_proxy.faults[0].served == 1
    assert result.stats.uploads_resumed == 1 and result.stats.uploads_restarted == 0
    assert result.stats.source_reopened == 1
    patches = [entry for entry in target_proxy.log if entry[0] == "PATCH"]
    assert len(patches) == chunks + 1, "the lost chunk was sent again, nothing else"
    assert result.stats.bytes_uploaded == layer["size"] + chunk + manifest["config"]["size"]
    reads = [entry[2] for entry in source_proxy.log if entry[0] == "GET" and layer["digest"] in entry[1]]
    assert reads == ["forwarded (200)", "forwarded (206), body cut in half", "forwarded (206)"], \
        "read again from the lost chunk, then from where the stream broke; never from the start"
    assert skopeo_digest(tools["skopeo"], f"{region_registry}/{repository}:big") == digest
    assert crane_blob_digest(tools, f"{region_registry}/{repository}@{layer['digest']}") == layer["digest"]


def test_a_source_that_stalls_mid_blob_times_out_and_is_read_again_from_where_it_stopped(
        tools, tmp_path, region_registry):
    repository = _unique("stall")
    size, chunk = 24 * 1024 * 1024, 4 * 1024 * 1024
    digest, manifest = _large_image(tmp_path, repository, size)
    layer = manifest["layers"][0]
    proxy = FlakyProxy(STAGING, [Fault("GET", f"/blobs/{layer['digest']}$", "stall", stall_s=6)])
    try:
        with Registry(proxy.host, timeout=1.5) as source, Registry(region_registry) as target:
            result = copy_image(source, repository, digest, target, repository, tags=["stalled"],
                                options=CopyOptions(chunk_size=chunk))
    finally:
        proxy.stop()
    reads = [entry[2] for entry in proxy.log if entry[0] == "GET" and layer["digest"] in entry[1]]
    assert reads == ["forwarded (200), body stall in half", "forwarded (206)"], "timed out, read again from there"
    assert result.stats.source_reopened == 1 and result.stats.uploads_resumed == 0
    assert result.stats.bytes_uploaded == layer["size"] + manifest["config"]["size"]
    assert skopeo_digest(tools["skopeo"], f"{region_registry}/{repository}:stalled") == digest


def test_an_upload_whose_session_is_lost_starts_over_and_still_lands_whole(tools, tmp_path, region_registry):
    # The registry takes the fourth chunk but its answer is lost: Distribution then refuses the
    # session's stale URL, so the blob starts over in a new session.
    repository = _unique("restart")
    size, chunk = 24 * 1024 * 1024, 4 * 1024 * 1024
    digest, manifest = _large_image(tmp_path, repository, size)
    layer = manifest["layers"][0]
    proxy = FlakyProxy(region_registry, [Fault("PATCH", r"/blobs/uploads/", "forward-drop", after=3)])
    try:
        with Registry(STAGING) as source, Registry(proxy.host) as target:
            result = copy_image(source, repository, digest, target, repository, tags=["big"],
                                options=CopyOptions(chunk_size=chunk))
    finally:
        proxy.stop()
    assert proxy.faults[0].served == 1
    assert result.stats.uploads_restarted + result.stats.uploads_resumed == 1
    assert result.stats.bytes_uploaded >= layer["size"] + manifest["config"]["size"]
    assert skopeo_digest(tools["skopeo"], f"{region_registry}/{repository}:big") == digest
    assert crane_blob_digest(tools, f"{region_registry}/{repository}@{layer['digest']}") == layer["digest"]


def test_429_503_and_dropped_connections_are_retried_honouring_retry_after(tools, tmp_path, region_registry):
    repository = _unique("flaky")
    digest = crane_image(tmp_path, repository)
    in_four_seconds = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=4), usegmt=True)
    proxy = FlakyProxy(region_registry, [
        Fault("HEAD", r"/manifests/", "status", status=429, retry_after="1"),
        Fault("HEAD", r"/manifests/", "status", status=429, retry_after=in_four_seconds),
        Fault("HEAD", r"/blobs/", "status", status=503, times=2),
        Fault("POST", r"/blobs/uploads/", "drop"),
        Fault("PUT", r"/manifests/flaky$", "status", status=502),
    ])
    try:
        with Registry(STAGING) as source, Registry(proxy.host, retry=FAST_RETRIES) as target:
            result = copy_image(source, repository, digest, target, repository, tags=["flaky"])
            log = target.retry_log
    finally:
        proxy.stop()
    assert result.digest == digest
    assert [f.served for f in proxy.faults] == [1, 1, 2, 1, 1]
    # 1 s, then what is left of the four (an HTTP date counts whole seconds), then short backoffs.
    assert log.retries == 6 and log.waited_s >= 2.5, log
    assert skopeo_digest(tools["skopeo"], f"{region_registry}/{repository}:flaky") == digest


def test_a_registry_that_keeps_failing_gives_one_clear_error_and_leaves_no_tag(tmp_path, region_registry):
    repository = _unique("down")
    digest = crane_image(tmp_path, repository)
    proxy = FlakyProxy(region_registry, [Fault("PUT", r"/manifests/sha256:", "status", status=503, times=100)])
    try:
        with Registry(STAGING) as source, Registry(proxy.host, retry=FAST_RETRIES) as target:
            with pytest.raises(RegistryError, match=re.escape(f"{proxy.host}/{repository}@{digest}: PUT manifest "
                                                              "answered HTTP 503")) as raised:
                copy_image(source, repository, digest, target, repository, tags=["never"])
    finally:
        proxy.stop()
    assert raised.value.status == 503 and proxy.faults[0].served == FAST_RETRIES.attempts
    assert httpx.head(f"http://{region_registry}/v2/{repository}/manifests/never").status_code == 404


def test_a_retry_after_longer_than_the_policy_allows_fails_at_once_with_the_status(tmp_path, region_registry):
    repository = _unique("slow-down")
    digest = crane_image(tmp_path, repository)
    proxy = FlakyProxy(region_registry, [Fault("HEAD", r"/manifests/", "status", status=429, retry_after="3600")])
    try:
        with Registry(STAGING) as source, Registry(proxy.host) as target:
            with pytest.raises(RegistryError, match=re.escape(f"{proxy.host}/{repository}@{digest}: HEAD manifest "
                                                              "answered HTTP 429")) as raised:
                copy_image(source, repository, digest, target, repository)
            assert target.retry_log.retries == 0
    finally:
        proxy.stop()
    assert raised.value.status == 429


def test_a_missing_source_image_is_one_clear_error_and_the_target_is_left_alone(region_registry):
    repository = _unique("missing")
    with Registry(STAGING) as source, Registry(region_registry) as target:
        with pytest.raises(RegistryError, match=f"^{re.escape(f'{STAGING}/{repository}:v1: no such manifest')}\\Z") as raised:
            copy_image(source, repository, "v1", target, repository, tags=["v1"])
        assert target.list_tags(repository) == set()
    assert raised.value.status == 404


# --- signatures, attestations, referrers ----------------------------------------------------

def test_signatures_attestations_and_sboms_travel_and_cosign_verifies_them_in_the_target(
        cosign_cli, our_key, tmp_path, region_registry):
    repository = _unique("signed")
    digest = crane_image(tmp_path, repository)
    ref = f"{STAGING}/{repository}@{digest}"
    cosign_cli.sign(ref, our_key)
    cosign_cli.attest(ref, our_key, "https://imagebuild.dev/test/v1", {"status": "passed", "digest": digest}, tmp_path)
    sbom = tmp_path / "sbom.json"
    sbom.write_text(json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": []}))
    attach = cosign_cli.run("attach", "sbom", "--sbom", str(sbom), "--type", "cyclonedx", "--input-format", "json",
                            "--allow-http-registry", "--allow-insecure-registry", ref)
    assert attach.returncode == 0, attach.stderr
    target_ref = f"{region_registry}/{repository}@{digest}"
    with Registry(STAGING) as source, Registry(region_registry) as target:
        copy_image(source, repository, digest, target, repository, tags=["v1"])
        assert not cosign_cli.admits(target_ref, our_key.public), "no signature copied by default"
        result = copy_image(source, repository, digest, target, repository, tags=["v1"],
                            options=CopyOptions(signatures=True))
    assert sorted(result.stats.signature_tags) == [cosign_tag(digest, kind) for kind in ("att", "sbom", "sig")]
    verified = cosign_cli.verified(target_ref, our_key.public)
    assert verified[0]["critical"]["image"]["docker-manifest-digest"] == digest
    [statement] = cosign_cli.statements(target_ref, our_key.public, "https://imagebuild.dev/test/v1")
    assert statement["predicate"] == {"status": "passed", "digest": digest}
    sbom_copied = cosign_cli.run("download", "sbom", "--allow-http-registry", "--allow-insecure-registry", target_ref)
    assert sbom_copied.returncode == 0, sbom_copied.stderr
    assert json.loads(sbom_copied.stdout)["bomFormat"] == "CycloneDX"


def _push_blob(registry: str, repository: str, content: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(content).hexdigest()
    start = httpx.post(f"http://{registry}/v2/{repository}/blobs/uploads/")
    location = str(start.url.join(start.headers["location"]))
    httpx.put(httpx.URL(location).copy_merge_params({"digest": digest}), content=content).raise_for_status()
    return {"digest": digest, "size": len(content)}


def test_referrers_travel_by_the_fallback_tag_where_there_is_no_referrers_api(tools, tmp_path, region_registry):
    repository = _unique("referrers")
    digest = crane_image(tmp_path, repository)
    subject_size = len(httpx.get(f"http://{STAGING}/v2/{repository}/manifests/{digest}",
                                 headers={"Accept": OCI_MANIFEST + ", application/vnd.docker.distribution.manifest.v2+json"}).content)
    # An SBOM artifact that refers to the image, pushed by hand the way oras does against a
    # registry without the Referrers API: the artifact by digest, then the fallback tag's index.
    empty = _push_blob(STAGING, repository, b"{}")
    sbom = _push_blob(STAGING, repository, json.dumps({"bomFormat": "CycloneDX"}).encode())
    artifact_type = "application/vnd.cyclonedx+json"
    artifact = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", **empty},
        "layers": [{"mediaType": artifact_type, **sbom}],
        "subject": {"mediaType": OCI_MANIFEST, "digest": digest, "size": subject_size}}).encode()
    artifact_digest = "sha256:" + hashlib.sha256(artifact).hexdigest()
    httpx.put(f"http://{STAGING}/v2/{repository}/manifests/{artifact_digest}", content=artifact,
              headers={"Content-Type": OCI_MANIFEST}).raise_for_status()
    fallback = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        {"mediaType": OCI_MANIFEST, "digest": artifact_digest, "size": len(artifact), "artifactType": artifact_type}]})
    httpx.put(f"http://{STAGING}/v2/{repository}/manifests/{cosign_tag(digest)}", content=fallback,
              headers={"Content-Type": OCI_INDEX}).raise_for_status()

    with Registry(STAGING) as source, Registry(region_registry) as target:
        assert source.referrers(repository, digest) is None, "Distribution 2.8 has no Referrers API"
        result = copy_image(source, repository, digest, target, repository, options=CopyOptions(signatures=True))
        index = json.loads(target.get_manifest(repository, cosign_tag(digest))[0])
    assert result.stats.referrers == [artifact_digest]
    assert [d["digest"] for d in index["manifests"]] == [artifact_digest]
    assert skopeo_raw_digest(tools, f"{region_registry}/{repository}@{artifact_digest}") == artifact_digest
    assert run([tools["crane"], "blob", "--insecure", f"{region_registry}/{repository}@{sbom['digest']}"]).stdout \
        == json.dumps({"bomFormat": "CycloneDX"})
