"""End-to-end fixtures: the real Docker engine, the real local registry, real builds.

Nothing here is mocked. When the engine or the registry is missing the tests fail and
say how to start them (scripts/bootstrap.sh); they never skip.
"""
from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import docker
import httpx
import pytest
import yaml

from ..conftest import run_imagebuild
from .tools import KEYS, Cosign, Image, KeyPair, bootstrap_key, push_tiny_image

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "local" / "matrix.yaml"
STAGING = "127.0.0.1:5000"
# The regional registries scripts/bootstrap.sh starts beside staging.
REGIONS = {"eu-west": "127.0.0.1:5001", "us-east": "127.0.0.1:5002", "ap-south": "127.0.0.1:5003"}


# How scripts/test.sh spreads the e2e tests over pytest-xdist workers: four groups, each in file order
# on one worker. A file that uses the scanned or signed example, or runs the whole pipeline on the
# example's own images (which signs and pushes them too), goes with the others that do, so those
# images are signed by one process at a time; a file that only needs the example built goes in a
# second group (a build that finds every layer in the registry only tags); a file that talks to the
# real API server in a third, so that one etcd and one kube-apiserver (a few hundred MB) serve them
# all; the rest in a fourth.
SIGNED_EXAMPLE = frozenset({"scanned_example", "signed_example"})
KUBE = frozenset({"kube_cluster"})
BUILT_EXAMPLE = frozenset({"built_example"})
WHOLE_PIPELINE = frozenset({"test_example_job.py", "test_release.py"})


def _group(fixtures: set[str], filename: str) -> str:
    if fixtures & KUBE:
        return "e2e-kube"
    if fixtures & SIGNED_EXAMPLE or filename in WHOLE_PIPELINE:
        return "e2e-signed-example"
    return "e2e-built-example" if fixtures & BUILT_EXAMPLE else "e2e-standalone"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups off the items
def pytest_collection_modifyitems(items):
    e2e = [item for item in items if "tests/e2e/" in str(item.fspath)]
    used: dict[str, set[str]] = {}
    for item in e2e:
        used.setdefault(str(item.fspath), set()).update(item.fixturenames)
    for item in e2e:
        item.add_marker(pytest.mark.e2e)
        # A whole file in one group: its tests may build on one another's registry state.
        item.add_marker(pytest.mark.xdist_group(_group(used[str(item.fspath)], Path(str(item.fspath)).name)))


@pytest.fixture(scope="session")
def engine() -> docker.DockerClient:
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:  # any failure to reach the engine is the same answer
        pytest.fail(f"the Docker engine is not reachable ({exc}); run scripts/bootstrap.sh", pytrace=False)
    return client


def require_registry(host: str, what: str = "registry") -> str:
    """host, once its /v2/ answers; otherwise the test fails saying how to start the local registries."""
    try:
        httpx.get(f"http://{host}/v2/", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        pytest.fail(f"the {what} {host} is not answering ({exc}); run scripts/bootstrap.sh", pytrace=False)
    return host


@pytest.fixture(scope="session")
def staging_registry() -> str:
    return require_registry(STAGING, "staging registry")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


def imagebuild(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 3600) -> Run:
    proc = run_imagebuild(*args, cwd=cwd, env=env, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr)


@dataclass
class BuiltExample:
    workdir: Path
    report: dict
    run: Run
    canary: str  # the netrc password handed to the build as a secret


@pytest.fixture(scope="session")
def secret_canary(tmp_path_factory) -> dict:
    """Build secrets carrying unique markers: the host CA bundle plus a marker, and a netrc."""
    directory = tmp_path_factory.mktemp("secrets")
    marker = f"imagebuild-canary-{uuid.uuid4().hex}"
    bundle = directory / "ca-bundle.pem"
    bundle.write_text(Path("/etc/ssl/certs/ca-certificates.crt").read_text() + f"\n# {marker}\n")
    netrc = f"machine packages.invalid login canary-user password {marker}-netrc\n"
    return {"marker": marker, "bundle": bundle, "netrc": netrc, "password": f"{marker}-netrc"}


@pytest.fixture(scope="session")
def built_example(engine, staging_registry, tmp_path_factory, secret_canary) -> BuiltExample:
    """The example matrix, built for real (layers already in the registry are reused)."""
    workdir = tmp_path_factory.mktemp("example-build")
    run = imagebuild("build", "--matrix", str(EXAMPLE), "--workdir", str(workdir), "--jobs", "2",
                     "--secret", f"ca-bundle={secret_canary['bundle']}",
                     env={"IMAGEBUILD_NETRC": secret_canary["netrc"], "IMAGEBUILD_SECRET_ENV": "IMAGEBUILD_NETRC"})
    assert run.returncode == 0, f"example build failed:\n{run.stdout}\n{run.stderr[-5000:]}"
    report = json.loads((workdir / "build-report.json").read_text())
    return BuiltExample(workdir, report, run, secret_canary["password"])


def copy_matrix(tmp_path: Path, edit) -> Path:
    """A copy of the example matrix in tmp_path, changed by `edit(data)`, with its Dockerfiles rendered."""
    data = yaml.safe_load(EXAMPLE.read_text())
    edit(data)
    target = tmp_path / "matrix.yaml"
    target.write_text(yaml.safe_dump(data, sort_keys=False))
    run = imagebuild("render", "--matrix", str(target))
    assert run.returncode == 0, run.stderr
    return target


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fresh_repository():
    """A repository name of its own, so a test's release tags never touch the example's."""
    return unique("e2e")



# --- scanning (imagebuild scan / gate): the fixture vulnerability DB and one scan of the example ---------


@pytest.fixture(scope="session")
def trivy_db(tmp_path_factory) -> Path:
    """A folder holding db/trivy.db and db/metadata.json, built with Go from tests/fixtures/trivydb."""
    from .trivydb import FixtureError, build_fixture_db

    try:
        return build_fixture_db(tmp_path_factory.mktemp("trivy-db"))
    except FixtureError as exc:
        pytest.fail(str(exc), pytrace=False)


def trivy_cache_with_db(trivy_db: Path, target: Path) -> Path:
    """A fresh Trivy cache dir (no layer analysed yet) holding a copy of the fixture DB."""
    import shutil

    shutil.copytree(trivy_db / "db", target / "db")
    return target


@pytest.fixture(scope="session")
def trivy() -> str:
    from imagebuild.checks.scan import Trivy
    from imagebuild.core.runner import ToolMissing

    try:
        return Trivy.find().path
    except ToolMissing as exc:
        pytest.fail(f"{exc}; run scripts/bootstrap.sh", pytrace=False)


@dataclass
class ScannedExample:
    workdir: Path  # holds build-report.json (with stages["scan"]) and scan/
    cache_dir: Path  # Trivy's cache: the fixture DB and every layer analysed so far
    run: Run
    seconds: float

    @property
    def report(self) -> dict:
        return json.loads((self.workdir / "build-report.json").read_text())

    @property
    def summary(self) -> dict:
        return json.loads((self.workdir / "scan" / "summary.json").read_text())

    def copy(self, target: Path) -> Path:
        """A workdir of a test's own (its gate verdicts must not leak into other tests)."""
        import shutil

        shutil.copytree(self.workdir, target)
        return target


def scan_workdir(workdir: Path, cache_dir: Path) -> Run:
    return imagebuild("scan", "--workdir", str(workdir), "--cache-dir", str(cache_dir), "--offline",
                      "--dockerfiles", str(EXAMPLE.parent / "dockerfiles"), "--format", "json")


@pytest.fixture(scope="session")
def scanned_example(built_example, trivy, trivy_db, tmp_path_factory) -> ScannedExample:
    """The example's images scanned once, with a cold cache, against the fixture DB."""
    import shutil
    import time

    workdir = tmp_path_factory.mktemp("example-scan")
    shutil.copy(built_example.workdir / "build-report.json", workdir / "build-report.json")
    cache_dir = trivy_cache_with_db(trivy_db, tmp_path_factory.mktemp("trivy-cache"))
    started = time.monotonic()
    run = scan_workdir(workdir, cache_dir)
    seconds = time.monotonic() - started
    assert run.returncode == 0, f"imagebuild scan failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return ScannedExample(workdir, cache_dir, run, seconds)


# --- signing (imagebuild sign): the example smoke-tested, gated and signed once per session -----------

COSIGN_PUB = KEYS / "cosign.pub"
EXAMPLE_POLICY = EXAMPLE.parent / "policy.yaml"


@dataclass
class SignedExample:
    workdir: Path  # build-report.json with stages smoke, scan, gate and sign; scan/, smoke/, gate/, sign/
    report_path: Path
    images: list[str]  # registry/repository@sha256:... of every signed variant
    tags: list[str]  # the tag references of those variants
    public_key: Path  # verifies the signatures and attestations (cosign.pub)
    run: Run | None = None  # the `imagebuild sign` that signed them

    @property
    def report(self) -> dict:
        return json.loads(self.report_path.read_text())

    def copy(self, target: Path) -> Path:
        """A workdir of a test's own, for tests that edit the report."""
        import shutil

        shutil.copytree(self.workdir, target)
        return target / "build-report.json"


@pytest.fixture(scope="session")
def our_key() -> KeyPair:
    """The key pair bootstrap generates outside the repository, and the key's password."""
    return bootstrap_key()


@pytest.fixture(scope="session")
def cosign_keys(our_key) -> dict:
    """our_key as the paths `imagebuild sign --key` and `cosign verify --key` take: key, pub, password."""
    return {"key": our_key.private, "pub": our_key.public, "password": our_key.password}


@pytest.fixture(scope="session")
def cosign() -> str:
    from imagebuild.core.runner import ToolMissing
    from imagebuild.trust.sign import Cosign as PinnedCosign

    try:
        return PinnedCosign.find().path
    except ToolMissing as exc:
        pytest.fail(f"{exc}; run scripts/bootstrap.sh", pytrace=False)


def sign_workdir(workdir: Path, key: Path | str, password: str, *args: str) -> Run:
    return imagebuild("sign", "--workdir", str(workdir), "--key", str(key), *args,
                      env={"COSIGN_PASSWORD": password}, timeout=900)


@pytest.fixture(scope="session")
def signed_example(scanned_example, cosign, cosign_keys, tmp_path_factory) -> SignedExample:
    """The scanned example smoke-tested (`imagebuild test`), gated with the example policy, then signed."""
    workdir = scanned_example.copy(tmp_path_factory.mktemp("example-sign") / "work")
    smoke = imagebuild("test", "--workdir", str(workdir), "--format", "json", timeout=1800)
    assert smoke.returncode == 0, f"imagebuild test failed:\n{smoke.stdout[-3000:]}\n{smoke.stderr[-3000:]}"
    gate = imagebuild("gate", "--workdir", str(workdir), "--policy", str(EXAMPLE_POLICY), timeout=300)
    assert gate.returncode == 0, f"imagebuild gate failed:\n{gate.stdout[-3000:]}\n{gate.stderr[-3000:]}"
    run = sign_workdir(workdir, cosign_keys["key"], cosign_keys["password"], "--format", "json")
    assert run.returncode == 0, f"imagebuild sign failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report_path = workdir / "build-report.json"
    variants = json.loads(report_path.read_text())["variants"]
    return SignedExample(workdir, report_path, images=[v["image"] for v in variants],
                         tags=[tag for v in variants for tag in v["images"]], public_key=cosign_keys["pub"], run=run)


# --- the tests' own cosign, keys, images and trust configs (tools.py): checks independent of imagebuild ---


@pytest.fixture(scope="session")
def cosign_cli(cosign) -> Cosign:
    """That cosign, run by the tests themselves (offline) to sign, attest and verify independently of imagebuild."""
    return Cosign(cosign)


@pytest.fixture(scope="session")
def other_key(cosign_cli, tmp_path_factory) -> KeyPair:
    """A key pair nobody trusts (no password), made once per session: other.key, other.pub."""
    return cosign_cli.generate_key_pair(tmp_path_factory.mktemp("other-key"))


@pytest.fixture
def push(request, staging_registry, tmp_path):
    """push(repository=..., tag=...) -> Image: a tiny image of random content (so a digest of its own).

    By default in a repository of the test's own, under <module>-e2e/ (test_verify: verify-e2e/...).
    """
    namespace = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_") + "-e2e"
    default = f"{staging_registry}/{namespace}/{uuid.uuid4().hex[:10]}"

    def push_image(repository: str = default, tag: str = "v1") -> Image:
        return Image(repository, tag, push_tiny_image(tmp_path, f"{repository}:{tag}"))

    return push_image


@pytest.fixture(scope="session")
def tools() -> dict[str, str]:
    """crane, skopeo and cosign found on PATH (the pinned tools' folder put first), by name."""
    from imagebuild.core.runner import TOOLS_DIR

    from .oci_servers import require_tool

    hint = f"run scripts/bootstrap.sh (crane and cosign in {TOOLS_DIR}, skopeo from Debian)"
    os.environ["PATH"] = f"{TOOLS_DIR}:{os.environ['PATH']}"
    return {name: require_tool(name, hint) for name in ("crane", "skopeo", "cosign")}


def trust_config(tmp_path: Path, keys: list[Path], images: list[str], **require) -> Path:
    """A trust config for the test: its keys, the images it covers, the requirements (none by default)."""
    path = tmp_path / "trust.yaml"
    path.write_text(yaml.safe_dump({
        "mode": "enforce",
        "keys": [{"name": key.stem if key.parent != KEYS else "imagebuild-local", "path": str(key)} for key in keys],
        "images": images,
        "require": {"attestations": require.get("attestations", []),
                    "smoke_passed": require.get("smoke_passed", False),
                    "gate_passed": require.get("gate_passed", False),
                    "block_severity": require.get("block_severity")},
        "failure_policy": "fail",
        "cache_ttl_seconds": 60,
        "webhook": {"namespace": "imagebuild-system", "name": "imagebuild-admission", "image": "REF", "port": 8443},
    }, sort_keys=False))
    return path


# --- rollout gates: a real Prometheus scraping an exporter the test controls, and a health endpoint ---------


@pytest.fixture(scope="session")
def rollout_services_session(tmp_path_factory):
    from .rollout_harness import HarnessError, RolloutServices

    try:
        services = RolloutServices(tmp_path_factory.mktemp("rollout-services"))
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield services
    services.stop()


@pytest.fixture
def rollout_services(rollout_services_session):
    """The session's exporter, Prometheus and health endpoint, with no metric and no health status set.

    services.exporter.set("job_error_ratio", 0.01, region="eu-west"); services.prometheus.url;
    services.prometheus.wait_for_value(query, 0.01); services.health.set("eu-west", 500); services.health.url.
    """
    rollout_services_session.reset()
    return rollout_services_session


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory):
    """A real kube-apiserver with its etcd on loopback (tests/e2e/kubeapi.py), for the whole session."""
    from .kubeapi import running_cluster

    with running_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        yield cluster
