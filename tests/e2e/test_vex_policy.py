"""require.vex_current in the generated ClusterImagePolicy, under policy-controller's own tester, and
`imagebuild verify` agreeing: a signed OpenVEX document (`imagebuild vex attest`, real cosign) whose statements
are all current admits; one with a statement past its last day, or a current document copied from another image,
is refused. The tester judges with the real clock, so the last days are set well before and after it.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from imagebuild.admission import policies
from imagebuild.config.trust import load_trust_config
from imagebuild.trust.verify import Verifier

from .conftest import imagebuild
from .test_policy_tester import (  # noqa: F401  (shared fixtures)
    evaluate,
    generate,
    namespace,
    policy_tester,
    pushed,
    single_image_authorities,
    trust_file,
)
from .test_vex import NEWS
from .tools import Cosign, KeyPair

pytestmark = pytest.mark.e2e

ATTESTED_ON = "2026-01-01"  # the day `vex attest` is told it is: both exceptions are valid then
LAST_DAYS = {"current": "2099-12-31", "expired": "2026-01-31"}  # around the tester's real clock
EXPECTED = {"current": True, "expired": False, "elsewhere": False}


def attest_vex(image: str, last_day: str, folder: Path, key: KeyPair) -> Path:
    """`imagebuild vex attest` of one exception for the whole image (no packages, so an empty SBOM will do)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "exceptions.yaml").write_text(textwrap.dedent(f"""\
        schema: 1
        exceptions:
          - id: {NEWS['id']}
            owner: ml-platform-security@example.com
            reason: The images never inflate untrusted data with zlib.
            expires: {last_day}
        """))
    (folder / "sbom.json").write_text(json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": []}))
    run = imagebuild("vex", "attest", image, "--variant", "cpu", "--policy", str(folder / "exceptions.yaml"),
                     "--sbom", str(folder / "sbom.json"), "--key", str(key.private), "--out", str(folder / "vex"),
                     "--today", ATTESTED_ON, "--format", "json", env={"COSIGN_PASSWORD": key.password}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.json()["statements"] == [NEWS["id"]]
    return Path(run.json()["document"])


@pytest.fixture(scope="module")
def vexed(namespace: str, cosign_cli: Cosign, our_key: KeyPair,  # noqa: F811
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """current and expired: signed, each with its own VEX; elsewhere: signed, carrying current's document
    (signed by our key, but about current's digest)."""
    tmp = tmp_path_factory.mktemp("vexed")
    made = {name: pushed(tmp, f"{namespace}/vex/{name}:t") for name in EXPECTED}
    for image in made.values():
        cosign_cli.sign(image, our_key)
    documents = {name: attest_vex(made[name], last_day, tmp / name, our_key) for name, last_day in LAST_DAYS.items()}
    cosign_cli.attest(made["elsewhere"], our_key, policies.PREDICATE_TYPES["openvex"],
                      json.loads(documents["current"].read_text()), tmp)
    return made


@pytest.fixture(scope="module")
def vex_policy(namespace: str, our_key: KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    folder = tmp_path_factory.mktemp("vex-policy")
    config = trust_file(folder, [our_key.public], [f"{namespace}/vex/**"], require="{vex_current: true}")
    return generate(config, folder / "admission")


def test_tester_admits_only_a_current_vex_about_the_image_and_verify_agrees(
        policy_tester: str, vex_policy: Path, vexed: dict[str, str]) -> None:  # noqa: F811
    tester = {name: evaluate(policy_tester, vex_policy, image) for name, image in vexed.items()}
    assert {name: d.admitted for name, d in tester.items()} == EXPECTED, {n: d.output[-800:] for n, d in tester.items()}
    for name in ("expired", "elsewhere"):  # refused by the rego, not for want of the attestation
        alone = evaluate(policy_tester, single_image_authorities(vex_policy), vexed[name])
        assert not alone.admitted and "rego policy for type openvex" in alone.output, alone.output
    verifier = Verifier(load_trust_config(vex_policy.parent.parent / "trust.yaml"), cache_ttl_seconds=0)
    assert {name: verifier.verify(image).allowed for name, image in vexed.items()} == EXPECTED
