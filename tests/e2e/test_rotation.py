"""The signing key's rotation, rehearsed end to end with real cosign, real registries and real rollouts.

Two rollouts leave a channel tag and a rollback target in every region, signed and attested with the old
key; a replaced seed is signed by the old key only. The new key is added to the trust file,
`imagebuild sign --resign` re-signs what gc keeps, the old key is retired: every live digest still
verifies (its attestation attested again by the new key), the old-only image is refused, and a rerun
re-signs nothing. policy-controller's own evaluator (its tester) is given the ClusterImagePolicy that
`imagebuild policies generate` writes from the trust file at each step and must agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from imagebuild.config.trust import load_trust_config
from imagebuild.retention.rotation import new_key_only
from imagebuild.trust.attest import PREDICATE_SMOKE
from imagebuild.trust.verify import Verifier

from ..conftest import REPO_ROOT
from .test_gc import ONE_WAVE, roll_out, seed
from .test_policy_tester import evaluate, generate
from .test_policy_tester import policy_tester as policy_tester  # noqa: F401 (the fixture, shared)
from .test_rollout import Setup, registries_up  # noqa: F401 - registries_up: the same autouse check
from .tools import KEYS, Cosign, bootstrap_key, tool

NEW_PASSWORD = "rotation-test-password"


def resign(setup: Setup, key: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imagebuild", "sign", "--resign", "--release", str(setup.release),
                           "--key", key, "--workdir", str(setup.tmp_path / "work"), "--format", "json"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COSIGN_PASSWORD": NEW_PASSWORD})


def trust_with(setup: Setup, *keys: str) -> None:
    trust = setup.tmp_path / "trust.yaml"
    lines = [line for line in trust.read_text().splitlines() if not line.startswith("keys:")]
    listed = ", ".join(f"{{name: key-{n}, path: {path}}}" for n, path in enumerate(keys))
    trust.write_text("\n".join([lines[0], f"keys: [{listed}]", *lines[1:]]) + "\n")


def cluster_image_policy(setup: Setup, step: str) -> Path:
    """What `imagebuild policies generate` writes from the trust file as it stands now. Its webhook image is
    left out: only the ClusterImagePolicy is evaluated, and a named one would have to exist to be pinned."""
    folder = setup.tmp_path / step
    folder.mkdir()
    kept = [line for line in (setup.tmp_path / "trust.yaml").read_text().splitlines() if not line.startswith("webhook:")]
    (folder / "trust.yaml").write_text("\n".join(kept) + "\n")
    return generate(folder / "trust.yaml", folder / "admission")


def test_a_rotation_re_signs_what_is_live_and_after_retiring_the_old_key_only_the_old_only_image_is_refused(
        tmp_path, policy_tester):  # noqa: F811 - the fixture imported above
    cosign = Cosign(tool("cosign"))
    old = bootstrap_key()
    made = cosign.run("generate-key-pair", "--output-key-prefix", str(tmp_path / "new"), password=NEW_PASSWORD)
    assert made.returncode == 0, made.stderr
    setup = Setup(tmp_path)
    setup.regions = {name: setup.regions[name] for name in ("eu-west", "us-east")}  # ONE_WAVE's
    setup.write(ONE_WAVE)
    seeded = seed(setup, size=1024)
    (c0, c1), _ = roll_out(setup, 2)
    predicate = tmp_path / "smoke.json"
    predicate.write_text(json.dumps({"passed": True, "tests": 3}))
    for host in setup.regions.values():
        attested = cosign.run("attest", "--key", str(old.private), "--tlog-upload=false", "--allow-http-registry",
                              "--allow-insecure-registry", "--yes", "--type", PREDICATE_SMOKE, "--predicate",
                              str(predicate), f"{host}/{setup.repository}@{c1}", password=old.password)
        assert attested.returncode == 0, attested.stderr

    trust_with(setup, str(KEYS / "cosign.pub"), str(tmp_path / "new.pub"))
    first = resign(setup, str(tmp_path / "new.key"))
    assert first.returncode == 0, first.stderr
    assert NEW_PASSWORD not in first.stdout + first.stderr
    done = {entry["image"]: entry for entry in json.loads(first.stdout)["images"]}
    for host in setup.regions.values():
        assert done[f"{host}/{setup.repository}@{c1}"]["signed"] is True
        assert done[f"{host}/{setup.repository}@{c1}"]["attested"] == ["smoke"]
        assert done[f"{host}/{setup.repository}@{c0}"]["signed"] is True
    assert not any(seeded[region] in image for region in seeded for image in done), "the replaced seed is not live"
    both = cluster_image_policy(setup, "both-keys")
    host = setup.regions["eu-west"]
    assert evaluate(policy_tester, both, f"{host}/{setup.repository}@{seeded['eu-west']}").admitted  # old key only
    assert evaluate(policy_tester, both, f"{host}/{setup.repository}@{c1}").admitted  # and re-signed

    trust_with(setup, str(tmp_path / "new.pub"))  # the old key retired
    trust = load_trust_config(setup.tmp_path / "trust.yaml")
    retired = cluster_image_policy(setup, "old-key-retired")
    for image in done:  # every live digest, on the new key's signature alone
        assert evaluate(policy_tester, retired, image).admitted, image
    with Verifier(trust, cache_ttl_seconds=0) as verifier:
        for region, host in setup.regions.items():
            for digest in (c1, c0):
                verdict = verifier.verify(f"{host}/{setup.repository}@{digest}")
                assert verdict.allowed and verdict.key == "key-0", verdict.reason
            old_only = f"{host}/{setup.repository}@{seeded[region]}"
            assert not verifier.verify(old_only).allowed
            refused = evaluate(policy_tester, retired, old_only)
            assert not refused.admitted and "sig-key-0" in refused.output, refused.output
            smoke = verifier.inspect(f"{host}/{setup.repository}@{c1}").attestations[PREDICATE_SMOKE]
            assert smoke.key == "key-0" and smoke.predicate == {"passed": True, "tests": 3}
    host = setup.regions["eu-west"]
    refused = subprocess.run([sys.executable, "-m", "imagebuild", "verify", "--trust", str(trust.path),
                              f"{host}/{setup.repository}@{seeded['eu-west']}"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    with Verifier(new_key_only(trust, (tmp_path / "new.pub").read_text()), cache_ttl_seconds=0) as only_new:
        assert only_new.verify(f"{host}/{setup.repository}:stable").allowed

    trust_with(setup, str(KEYS / "cosign.pub"), str(tmp_path / "new.pub"))
    again = resign(setup, str(tmp_path / "new.key"))
    assert again.returncode == 0, again.stderr
    assert all(not e["signed"] and not e["attested"] for e in json.loads(again.stdout)["images"]), "a rerun adds nothing"
