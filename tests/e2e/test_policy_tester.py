"""The generated ClusterImagePolicy under policy-controller's own evaluator, and `imagebuild verify` agreeing.

policy-controller's `tester` (cmd/tester of github.com/sigstore/policy-controller, built by
scripts/bootstrap.sh) compiles the policy exactly as the admission controller does and verifies
one image against it, offline, with the registry on 127.0.0.1 (plain HTTP, as go-containerregistry
does for loopback hosts). Images here are tiny single-layer images made with crane, signed and
attested with the real cosign and the bootstrap key (or a key made for the test).
"""
from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from imagebuild.admission import policies
from imagebuild.config.trust import load_trust_config
from imagebuild.core.runner import TOOLS_DIR
from imagebuild.trust.attest import KINDS

from .conftest import REPO, imagebuild
from .oci_servers import RecordingServer
from .tools import Cosign, KeyPair, push_tiny_image

# The installed evaluator first; the lead's build tree while bootstrap has not installed it yet.
TESTER_CANDIDATES = (TOOLS_DIR / "policy-tester", Path("/tmp/pcbuild/policy-tester"))
COSIGN_TYPES = {kind.name: kind.cosign_type for kind in KINDS}  # sbom -> cyclonedx, ..., provenance


@pytest.fixture(scope="session")
def policy_tester() -> str:
    override = os.environ.get("IMAGEBUILD_POLICY_TESTER")
    for candidate in ([Path(override)] if override else []) + list(TESTER_CANDIDATES):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("policy-controller's tester is not installed (looked for "
                + ", ".join(map(str, TESTER_CANDIDATES)) + "); run scripts/bootstrap.sh, which builds "
                "cmd/tester of github.com/sigstore/policy-controller, or set IMAGEBUILD_POLICY_TESTER",
                pytrace=False)


@pytest.fixture(scope="session")
def namespace(staging_registry: str) -> str:
    """A repository prefix of this run's own: nothing another run or test pushes lands under it."""
    return f"{staging_registry}/imagebuild-policies-e2e/{uuid.uuid4().hex[:12]}"


def pushed(tmp_path: Path, reference: str) -> str:
    """A one-layer image whose content is unique, pushed to reference; its by-digest reference."""
    return f"{reference.rsplit(':', 1)[0]}@{push_tiny_image(tmp_path, reference)}"


def digest_of(image: str) -> str:
    return image.rsplit("@", 1)[1]


def attest_all(cosign_cli: Cosign, key: KeyPair, image: str, tmp_path: Path, *, smoke_status: str = "passed",
               smoke_digest: str | None = None, gate_decision: str = "passed", skip: tuple[str, ...] = ()) -> None:
    """The four attestations `imagebuild sign` attaches, in their predicate shapes."""
    digest = digest_of(image)
    predicates = {
        "sbom": {"bomFormat": "CycloneDX", "specVersion": "1.5", "version": 1, "components": []},
        "vuln": {"invocation": {"parameters": None, "uri": "", "event_id": "", "builder.id": ""},
                 "scanner": {"uri": "https://github.com/aquasecurity/trivy", "version": "0.58.0",
                             "db": {"uri": "", "version": ""}, "result": {"SchemaVersion": 2, "Results": []}},
                 "metadata": {"scanStartedOn": "2026-12-01T00:00:00Z", "scanFinishedOn": "2026-12-01T00:00:05Z"}},
        "smoke": {"digest": smoke_digest or digest, "variant": "tiny", "status": smoke_status,
                  "counts": {"passed": 3, "failed": 0 if smoke_status == "passed" else 1, "skipped": 0}},
        "gate": {"digest": digest, "variant": "tiny", "decision": gate_decision, "policy": {"severity": "HIGH"},
                 "exceptions_applied": []},
    }
    for kind, predicate in predicates.items():
        if kind not in skip:
            cosign_cli.attest(image, key, COSIGN_TYPES[kind], predicate, tmp_path)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    output: str


def evaluate(tester: str, policy: Path, image: str) -> Decision:
    result = subprocess.run([tester, "--policy", str(policy), "--image", image, "--log-level", "info"],
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert "CIP is invalid" not in output, f"policy-controller refused the policy itself:\n{output[-3000:]}"
    assert "Policy was successfully validated" in output, output[-3000:]
    if result.returncode == 0:
        assert "Verification was successful" in output, output[-3000:]
        return Decision(True, output)
    errors = json.loads(result.stdout.strip().splitlines()[-1])["errors"]  # the tester's refusal: JSON on stdout
    assert result.returncode == 1 and errors, output[-3000:]
    return Decision(False, "\n".join(errors))


def trust_file(folder: Path, keys: list[Path], images: list[str], *, mode: str = "enforce",
               require: str = "{}") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    entries = "".join(f"  - name: key-{n}\n    path: {key}\n" for n, key in enumerate(keys))
    globs = "".join(f"  - \"{g}\"\n" for g in images)
    path = folder / "trust.yaml"
    path.write_text(f"schema: 1\nmode: {mode}\nkeys:\n{entries}images:\n{globs}require: {require}\n")
    return path


def generate(config: Path, out: Path) -> Path:
    # These trust files name no webhook image (only the ClusterImagePolicy is evaluated): keep the placeholder.
    run = imagebuild("policies", "generate", "--config", str(config), "--out", str(out), "--keep-webhook-tag", cwd=REPO)
    assert run.returncode == 0, run.stderr
    return out / policies.CLUSTER_IMAGE_POLICY


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def images(namespace: str, cosign_cli: Cosign, our_key: KeyPair, other_key: KeyPair,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """signed (bootstrap key), unsigned, foreign (another key), moved (a signed tag moved to an
    unsigned digest), outside (signed, in a repository no glob covers)."""
    tmp = tmp_path_factory.mktemp("images")
    made = {
        "signed": pushed(tmp, f"{namespace}/app/signed:t"),
        "unsigned": pushed(tmp, f"{namespace}/app/unsigned:t"),
        "foreign": pushed(tmp, f"{namespace}/app/foreign:t"),
        "outside": pushed(tmp, f"{namespace}-elsewhere/app:t"),
    }
    cosign_cli.sign(made["signed"], our_key)
    cosign_cli.sign(made["foreign"], other_key)
    cosign_cli.sign(made["outside"], our_key)
    moved_tag = f"{namespace}/app/moved:t"
    cosign_cli.sign(pushed(tmp, moved_tag), our_key)
    pushed(tmp, moved_tag)  # the tag now names a digest nobody signed
    made["moved"] = moved_tag
    return made


@pytest.fixture(scope="module")
def single_key_policy(namespace: str, our_key: KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("single")
    return generate(trust_file(folder, [our_key.public], [f"{namespace}/app/**"]), folder / "admission")


EXPECTED_SINGLE_KEY = {"signed": True, "unsigned": False, "foreign": False, "moved": False, "outside": False}


def test_tester_admits_the_signed_image(policy_tester: str, single_key_policy: Path, images: dict[str, str]) -> None:
    assert evaluate(policy_tester, single_key_policy, images["signed"]).admitted


def test_tester_refuses_the_unsigned_image(policy_tester: str, single_key_policy: Path, images: dict[str, str]) -> None:
    decision = evaluate(policy_tester, single_key_policy, images["unsigned"])
    assert not decision.admitted and "no signatures found" in decision.output


def test_tester_refuses_an_image_signed_with_another_key(policy_tester: str, single_key_policy: Path,
                                                         images: dict[str, str]) -> None:
    decision = evaluate(policy_tester, single_key_policy, images["foreign"])
    assert not decision.admitted and "sig-key-0" in decision.output


def test_tester_refuses_a_tag_moved_to_an_unsigned_digest(policy_tester: str, single_key_policy: Path,
                                                          images: dict[str, str]) -> None:
    assert not evaluate(policy_tester, single_key_policy, images["moved"]).admitted


def test_tester_refuses_an_image_outside_the_configured_repositories(policy_tester: str, single_key_policy: Path,
                                                                     images: dict[str, str]) -> None:
    decision = evaluate(policy_tester, single_key_policy, images["outside"])
    assert not decision.admitted and "uncovered by policy" in decision.output


def test_rotated_policy_admits_images_signed_with_either_key(policy_tester: str, namespace: str,
                                                             our_key: KeyPair, other_key: KeyPair,
                                                             images: dict[str, str], tmp_path: Path) -> None:
    config = trust_file(tmp_path, [our_key.public, other_key.public], [f"{namespace}/app/**"])
    policy = generate(config, tmp_path / "admission")
    assert evaluate(policy_tester, policy, images["signed"]).admitted
    assert evaluate(policy_tester, policy, images["foreign"]).admitted
    assert not evaluate(policy_tester, policy, images["unsigned"]).admitted


def test_warn_mode_admits_the_unsigned_image_with_a_warning(policy_tester: str, namespace: str,
                                                            our_key: KeyPair, images: dict[str, str],
                                                            tmp_path: Path) -> None:
    config = trust_file(tmp_path, [our_key.public], [f"{namespace}/app/**"], mode="warn")
    decision = evaluate(policy_tester, generate(config, tmp_path / "admission"), images["unsigned"])
    assert decision.admitted and "no signatures found" in decision.output


def test_the_committed_production_policy_compiles_in_policy_controller(policy_tester: str,
                                                                        images: dict[str, str]) -> None:
    decision = evaluate(policy_tester, REPO / "policies" / "admission" / policies.CLUSTER_IMAGE_POLICY,
                        images["signed"])
    assert not decision.admitted and "uncovered by policy" in decision.output


# --- attestations ------------------------------------------------------------------------------

REQUIRE_ALL = "{attestations: [sbom, vuln, smoke, gate], smoke_passed: true, gate_passed: true}"


@pytest.fixture(scope="module")
def attested(namespace: str, cosign_cli: Cosign, our_key: KeyPair,
             tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """complete: signed with all four attestations; smoke_failed; smoke_elsewhere (the smoke
    result names another digest); gate_blocked; no_gate; not_signed (attested, but the image
    itself unsigned)."""
    tmp = tmp_path_factory.mktemp("attested")
    made = {name: pushed(tmp, f"{namespace}/attested/{name.replace('_', '-')}:t")
            for name in ("complete", "smoke_failed", "smoke_elsewhere", "gate_blocked", "no_gate", "not_signed")}
    for name, image in made.items():
        if name != "not_signed":
            cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, our_key, made["complete"], tmp)
    attest_all(cosign_cli, our_key, made["smoke_failed"], tmp, smoke_status="failed")
    attest_all(cosign_cli, our_key, made["smoke_elsewhere"], tmp, smoke_digest=digest_of(made["complete"]))
    attest_all(cosign_cli, our_key, made["gate_blocked"], tmp, gate_decision="blocked")
    attest_all(cosign_cli, our_key, made["no_gate"], tmp, skip=("gate",))
    attest_all(cosign_cli, our_key, made["not_signed"], tmp)
    return made


@pytest.fixture(scope="module")
def attestation_policy(namespace: str, our_key: KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("attestation-policy")
    config = trust_file(folder, [our_key.public], [f"{namespace}/attested/**"], require=REQUIRE_ALL)
    return generate(config, folder / "admission")


EXPECTED_ATTESTED = {"complete": True, "smoke_failed": False, "smoke_elsewhere": False, "gate_blocked": False,
                     "no_gate": False, "not_signed": False}
# What policy-controller says when it refuses each one.
REFUSAL = {"smoke_failed": "rego policy for type smoke", "smoke_elsewhere": "rego policy for type smoke",
           "gate_blocked": "rego policy for type gate",
           "no_gate": f"no matching attestations with type {policies.PREDICATE_TYPES['gate']}",
           "not_signed": "authority sig-key-0"}


# An image that is no index fails the `idx-` authorities too, for want of an index's release record.
# policy-controller reports the first failing authority to finish, so a refusal of the whole policy
# names either reason, and each authority's own reason is read from a policy of it alone.
INDEX_REFUSAL = f"no matching attestations with type {policies.PREDICATE_TYPES['release']}"


def single_image_authorities(policy: Path) -> Path:
    """The generated policy without its `idx-` authorities (the CIP-level policy kept), beside it."""
    document = yaml.safe_load(policy.read_text())
    document["spec"]["authorities"] = [a for a in document["spec"]["authorities"]
                                       if not a["name"].startswith("idx-")]
    out = policy.with_name("single-image-authorities.yaml")
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED_ATTESTED))
def test_tester_applies_the_attestation_requirements(policy_tester: str, attestation_policy: Path,
                                                     attested: dict[str, str], name: str) -> None:
    decision = evaluate(policy_tester, attestation_policy, attested[name])
    assert decision.admitted is EXPECTED_ATTESTED[name], decision.output
    if not decision.admitted:
        assert REFUSAL[name] in decision.output or INDEX_REFUSAL in decision.output, decision.output
        alone = evaluate(policy_tester, single_image_authorities(attestation_policy), attested[name])
        assert not alone.admitted and REFUSAL[name] in alone.output, alone.output


# --- imagebuild verify gives the same answers ---------------------------------------------------


def test_verify_admits_and_refuses_the_same_images_as_the_tester(policy_tester: str, single_key_policy: Path,
                                                                 images: dict[str, str]) -> None:
    from imagebuild.trust.verify import Verifier  # the verify helper's module (imagebuild/trust/verify.py)

    config = load_trust_config(single_key_policy.parent.parent / "trust.yaml")
    verifier = Verifier(config, check_attestations=False)
    tester = {name: evaluate(policy_tester, single_key_policy, image).admitted for name, image in images.items()}
    verify = {name: verifier.verify(image).allowed for name, image in images.items()}
    assert tester == EXPECTED_SINGLE_KEY
    assert verify == tester


def test_verify_applies_the_same_attestation_requirements_as_the_tester(policy_tester: str,
                                                                        attestation_policy: Path,
                                                                        attested: dict[str, str]) -> None:
    from imagebuild.trust.verify import Verifier

    config = load_trust_config(attestation_policy.parent.parent / "trust.yaml")
    verifier = Verifier(config, check_attestations=True)
    tester = {name: evaluate(policy_tester, attestation_policy, image).admitted for name, image in attested.items()}
    verify = {name: verifier.verify(image).allowed for name, image in attested.items()}
    assert tester == EXPECTED_ATTESTED
    assert verify == tester


# --- provenance ---------------------------------------------------------------------------------


def provenance_predicate(build_type: str) -> dict:
    """A SLSA v1 provenance in the shape `imagebuild sign` attaches (the fields the policies read)."""
    from imagebuild.trust.provenance import LOCAL_BUILDER

    return {"buildDefinition": {"buildType": build_type, "externalParameters": {"variant": {"id": "tiny"}}},
            "runDetails": {"builder": {"id": LOCAL_BUILDER}, "metadata": {"invocationId": "e2e"}}}


def test_a_policy_requiring_provenance_admits_only_images_with_imagebuilds_provenance(
        policy_tester: str, namespace: str, cosign_cli: Cosign, our_key: KeyPair, tmp_path: Path) -> None:
    from imagebuild.trust.provenance import BUILD_TYPE
    from imagebuild.trust.verify import Verifier

    made = {name: pushed(tmp_path, f"{namespace}/provenance/{name}:t")
            for name in ("with-provenance", "without", "foreign-build")}
    for image in made.values():
        cosign_cli.sign(image, our_key)
    cosign_cli.attest(made["with-provenance"], our_key, COSIGN_TYPES["provenance"], provenance_predicate(BUILD_TYPE),
                      tmp_path)
    cosign_cli.attest(made["foreign-build"], our_key, COSIGN_TYPES["provenance"],
                      provenance_predicate("https://example.com/another-builder/v1"), tmp_path)
    config = trust_file(tmp_path, [our_key.public], [f"{namespace}/provenance/**"],
                        require="{attestations: [provenance]}")
    policy = generate(config, tmp_path / "admission")

    tester = {name: evaluate(policy_tester, policy, image) for name, image in made.items()}
    assert {name: d.admitted for name, d in tester.items()} == {
        "with-provenance": True, "without": False, "foreign-build": False}
    assert "no matching attestations" in tester["without"].output  # the image has no .att at all
    alone = evaluate(policy_tester, single_image_authorities(policy), made["foreign-build"])
    assert "rego policy for type provenance" in alone.output, alone.output
    verifier = Verifier(load_trust_config(config))
    assert {name: verifier.verify(image).allowed for name, image in made.items()} == \
        {name: d.admitted for name, d in tester.items()}


# --- every spelling of a covered image (issue 18) -------------------------------------------------
#
# The runtime pulls `harbor.example.com:443/p/x`, `docker.io/nginx`, `index.docker.io/library/nginx`
# and `nginx` from the same place as the trust file's spelling, and the webhook reads them as the
# same image. The tester must find each one covered (and so verify it) instead of "uncovered by
# policy". Registries other than loopback are never reached: the tester's HTTPS goes to a proxy of
# the test's own on loopback that records where it was asked to connect and refuses.

REMOTE_GLOBS = ["harbor.example.com/paddle/**", "docker.io/library/nginx", "docker.io/paddlepaddle/**"]
ANY_DIGEST = "sha256:" + "5" * 64
# spelling -> where policy-controller then goes for signatures (the proxy's CONNECT target)
COVERED_SPELLINGS = {
    f"harbor.example.com/paddle/gpu@{ANY_DIGEST}": "harbor.example.com:443",
    f"harbor.example.com:443/paddle/gpu@{ANY_DIGEST}": "harbor.example.com:443",
    f"nginx@{ANY_DIGEST}": "index.docker.io:443",
    "nginx:1.27": "index.docker.io:443",
    f"library/nginx@{ANY_DIGEST}": "index.docker.io:443",
    f"docker.io/nginx@{ANY_DIGEST}": "index.docker.io:443",
    f"index.docker.io/library/nginx@{ANY_DIGEST}": "index.docker.io:443",
    f"registry-1.docker.io/library/nginx@{ANY_DIGEST}": "registry-1.docker.io:443",
    f"docker.io:443/library/nginx@{ANY_DIGEST}": "docker.io:443",
    "paddlepaddle/paddle:3.0.0": "index.docker.io:443",
}
UNCOVERED_SPELLINGS = [f"harbor.example.com:8443/paddle/gpu@{ANY_DIGEST}", f"nginx2@{ANY_DIGEST}",
                       f"quay.io/nginx@{ANY_DIGEST}",
                       # no glob can list another host case: refused as uncovered (no-match-policy deny)
                       f"Harbor.Example.com/paddle/gpu@{ANY_DIGEST}"]


@pytest.fixture(scope="module")
def refusing_proxy() -> Iterator[RecordingServer]:
    proxy = RecordingServer(default=(403, {}, b""))
    handler = proxy.server.RequestHandlerClass
    handler.do_CONNECT = handler.do_GET  # type: ignore[attr-defined]  # record CONNECT host:port, refuse it
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def remote_policy(our_key: KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spellings")
    return generate(trust_file(folder, [our_key.public], REMOTE_GLOBS), folder / "admission")


def evaluate_via(proxy: RecordingServer, tester: str, policy: Path, image: str) -> tuple[Decision, list[str]]:
    before = len(proxy.seen)
    proxied = f"http://{proxy.host}"
    env = {**os.environ, "HTTPS_PROXY": proxied, "https_proxy": proxied, "HTTP_PROXY": proxied,
           "http_proxy": proxied, "NO_PROXY": "", "no_proxy": ""}
    result = subprocess.run([tester, "--policy", str(policy), "--image", image, "--log-level", "info"],
                            capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert "Policy was successfully validated" in output, output[-3000:]
    assert result.returncode != 0, output[-3000:]  # nothing behind the proxy can be verified
    return Decision(False, output), [seen.path for seen in proxy.seen[before:]]


@pytest.mark.parametrize("image", sorted(COVERED_SPELLINGS))
def test_tester_covers_every_spelling_of_a_covered_image(policy_tester: str, remote_policy: Path,
                                                         refusing_proxy: RecordingServer, image: str) -> None:
    decision, connects = evaluate_via(refusing_proxy, policy_tester, remote_policy, image)
    assert "uncovered by policy" not in decision.output, decision.output[-2000:]
    assert COVERED_SPELLINGS[image] in connects, (connects, decision.output[-2000:])
    assert all(target in COVERED_SPELLINGS.values() for target in connects)  # only where it belongs


@pytest.mark.parametrize("image", UNCOVERED_SPELLINGS)
def test_tester_refuses_other_repositories_as_uncovered_without_a_request(
        policy_tester: str, remote_policy: Path, refusing_proxy: RecordingServer, image: str) -> None:
    decision, connects = evaluate_via(refusing_proxy, policy_tester, remote_policy, image)
    assert "uncovered by policy" in decision.output and connects == []


def test_a_signed_image_spelled_with_its_host_in_other_case_is_never_admitted_unverified(
        policy_tester: str, staging_registry: str, cosign_cli: Cosign, our_key: KeyPair, images: dict[str, str],
        tmp_path: Path) -> None:
    """On loopback, for real: the trust file names localhost:5000; the webhook reads LOCALHOST:5000
    as the same registry and verifies the signature; policy-controller, which cannot list other
    cases, refuses it as uncovered. Neither admits it unverified."""
    from imagebuild.trust.verify import Verifier

    port = staging_registry.rsplit(":", 1)[1]
    path = images["signed"].split("/", 1)[1]  # <namespace path>/app/signed@sha256:...
    config = trust_file(tmp_path, [our_key.public], [f"localhost:{port}/{path.split('/app/')[0]}/app/**"])
    policy = generate(config, tmp_path / "admission")
    canonical, other_case = f"localhost:{port}/{path}", f"LOCALHOST:{port}/{path}"
    assert evaluate(policy_tester, policy, canonical).admitted
    decision = evaluate(policy_tester, policy, other_case)
    assert not decision.admitted and "uncovered by policy" in decision.output
    verifier = Verifier(load_trust_config(config), check_attestations=False)
    assert verifier.verify(canonical).allowed and verifier.verify(other_case).allowed
    unsigned = f"LOCALHOST:{port}/{images['unsigned'].split('/', 1)[1]}"
    assert not verifier.verify(unsigned).allowed and not evaluate(policy_tester, policy, unsigned).admitted
