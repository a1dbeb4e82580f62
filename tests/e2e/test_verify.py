"""imagebuild verify end to end: real cosign signatures and attestations in the real local registries.

Every refusal is proven on a small image of its own (pushed with crane), and for each case plain
`cosign verify --key` (or `cosign verify-attestation`), run independently, admits or refuses the
same image. Nothing is mocked.
"""
from __future__ import annotations

import threading
import uuid
from pathlib import Path

import httpx

from .conftest import REPO, STAGING, imagebuild, require_registry, trust_config
from .tools import TYPES, Cosign, Image, KeyPair, crane

OUTSIDE = "127.0.0.1:5001"  # another local registry, outside the test policies' images


def covering(image: Image) -> list[str]:
    return [image.repository.rsplit("/", 1)[0] + "/*"]


def verify(*args: str):
    return imagebuild("verify", *args, timeout=120)


def refused_line(run, image_ref: str) -> str:
    lines = [line for line in run.stderr.splitlines() if line.startswith(f"{image_ref}: refused: ")]
    assert len(lines) == 1, f"no refusal line for {image_ref} in:\n{run.stdout}\n{run.stderr}"
    return lines[0]


def delete_manifest(image: Image, tag: str) -> None:
    """DELETE /v2/<repo>/manifests/<digest>: the tag goes with the manifest (Distribution deletes by digest)."""
    registry, repository = image.repository.split("/", 1)
    head = httpx.head(f"http://{registry}/v2/{repository}/manifests/{tag}",
                      headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    head.raise_for_status()
    response = httpx.delete(f"http://{registry}/v2/{repository}/manifests/{head.headers['docker-content-digest']}")
    assert response.status_code == 202, response.text
    assert httpx.head(f"http://{registry}/v2/{repository}/manifests/{tag}").status_code == 404


# --- signatures ---------------------------------------------------------------------------------


def test_a_signed_image_verifies_by_tag_and_by_digest_and_cosign_agrees(push, cosign_cli, our_key):
    image = push()
    cosign_cli.sign(image, our_key)
    run = verify("--key", str(our_key.public), image.by_tag, image.by_digest, "--format", "json")
    assert run.returncode == 0, run.stderr
    verdicts = run.json()["images"]
    assert [(v["image"], v["digest"], v["allowed"]) for v in verdicts] == [
        (image.by_tag, image.digest, True), (image.by_digest, image.digest, True)]
    assert cosign_cli.admits(image.by_tag, our_key.public) and cosign_cli.admits(image.by_digest, our_key.public)


def test_an_unsigned_image_is_refused_and_cosign_agrees(push, cosign_cli, our_key):
    image = push()
    run = verify("--key", str(our_key.public), image.by_tag)
    assert run.returncode == 1
    assert f"not signed: no signature {image.repository}:{image.signature_tag()}" in refused_line(run, image.by_tag)
    assert not cosign_cli.admits(image.by_tag, our_key.public)


def test_an_image_signed_with_another_key_is_refused_and_cosign_agrees(push, cosign_cli, our_key, other_key):
    image = push()
    cosign_cli.sign(image, other_key)
    run = verify("--key", str(our_key.public), image.by_tag)
    assert run.returncode == 1
    assert "the signature does not verify with any configured key" in refused_line(run, image.by_tag)
    assert not cosign_cli.admits(image.by_tag, our_key.public)
    assert cosign_cli.admits(image.by_tag, other_key.public)  # it is a good signature, by a key we do not trust


def test_a_tag_moved_to_an_unsigned_digest_after_signing_is_refused_and_cosign_agrees(push, cosign_cli, our_key):
    signed = push()
    cosign_cli.sign(signed, our_key)
    assert verify("--key", str(our_key.public), signed.by_tag).returncode == 0
    moved = push(tag=signed.tag)  # same tag, new content: the tag now names an unsigned digest
    assert moved.digest != signed.digest
    run = verify("--key", str(our_key.public), moved.by_tag, "--format", "json")
    assert run.returncode == 1
    [verdict] = run.json()["images"]
    assert verdict["digest"] == moved.digest and not verdict["allowed"]
    assert verdict["reason"].startswith("not signed: no signature")
    assert not cosign_cli.admits(moved.by_tag, our_key.public)
    # The signed digest itself still verifies: it is the tag that moved.
    assert verify("--key", str(our_key.public), signed.by_digest).returncode == 0


def test_a_deleted_signature_is_refused_and_cosign_agrees(push, cosign_cli, our_key):
    image = push()
    cosign_cli.sign(image, our_key)
    assert verify("--key", str(our_key.public), image.by_digest).returncode == 0
    delete_manifest(image, image.signature_tag())
    run = verify("--key", str(our_key.public), image.by_digest)
    assert run.returncode == 1
    assert "not signed: no signature" in refused_line(run, image.by_digest)
    assert not cosign_cli.admits(image.by_digest, our_key.public)


def test_a_signature_copied_from_another_image_is_refused_and_cosign_agrees(push, cosign_cli, our_key):
    signed = push(tag="a")
    cosign_cli.sign(signed, our_key)
    unsigned = push(tag="b")
    crane("copy", f"{signed.repository}:{signed.signature_tag()}", f"{unsigned.repository}:{unsigned.signature_tag()}")
    run = verify("--key", str(our_key.public), unsigned.by_tag)
    assert run.returncode == 1
    line = refused_line(run, unsigned.by_tag)
    assert f"the signature is for {signed.digest}, not this image's digest {unsigned.digest}" in line
    assert not cosign_cli.admits(unsigned.by_tag, our_key.public)


def test_an_image_in_a_registry_outside_the_policy_is_refused_though_its_signature_is_good(
        push, cosign_cli, our_key, tmp_path):
    require_registry(OUTSIDE)
    image = push(repository=f"{OUTSIDE}/verify-e2e/{uuid.uuid4().hex[:10]}")
    cosign_cli.sign(image, our_key)
    config = trust_config(tmp_path, [our_key.public], [f"{STAGING}/verify-e2e/**"])
    run = verify("--config", str(config), image.by_tag)
    assert run.returncode == 1
    assert f"not covered by the policy: {image.repository} matches none of its images" in refused_line(run, image.by_tag)
    # The signature itself is good: cosign (which has no notion of covered registries) admits it, and
    # so does imagebuild with an ad-hoc --key config that covers every registry.
    assert cosign_cli.admits(image.by_tag, our_key.public)
    assert verify("--key", str(our_key.public), image.by_tag).returncode == 0


def test_during_a_key_rotation_an_image_signed_with_either_key_verifies_naming_the_key(
        push, cosign_cli, our_key, other_key, tmp_path):
    old, new, neither = push(tag="old"), push(tag="new"), push(tag="neither")
    cosign_cli.sign(old, our_key)
    cosign_cli.sign(new, other_key)
    config = trust_config(tmp_path, [our_key.public, other_key.public], covering(old))
    run = verify("--config", str(config), old.by_tag, new.by_tag, "--format", "json")
    assert run.returncode == 0, run.stdout + run.stderr
    assert [v["key"] for v in run.json()["images"]] == ["imagebuild-local", "other"]
    run = verify("--key", str(our_key.public), "--key", str(other_key.public), old.by_tag, new.by_tag, neither.by_tag)
    assert run.returncode == 1
    assert "not signed" in refused_line(run, neither.by_tag)
    assert cosign_cli.admits(old.by_tag, our_key.public) and cosign_cli.admits(new.by_tag, other_key.public)
    assert not cosign_cli.admits(neither.by_tag, our_key.public) and not cosign_cli.admits(neither.by_tag, other_key.public)


def test_an_unreachable_registry_exits_3_saying_so(our_key):
    run = verify("--key", str(our_key.public), "127.0.0.1:1/nothing/here:v1")
    assert run.returncode == 3
    assert run.stderr.startswith("127.0.0.1:1/nothing/here:v1: registry unreachable: 127.0.0.1:1")



# --- attestations ---------------------------------------------------------------------------------

STRICT = {"attestations": ["sbom", "vuln", "smoke", "gate"], "smoke_passed": True, "gate_passed": True,
          "block_severity": "CRITICAL"}


def vuln_predicate(*findings: tuple[str, str, str]) -> dict:
    """cosign's vuln predicate around a (small) Trivy JSON report."""
    return {"invocation": {"parameters": None, "uri": "", "event_id": "", "builder.id": ""},
            "scanner": {"uri": "pkg:github/aquasecurity/trivy@0.76.0", "version": "0.76.0",
                        "db": {"uri": "", "version": ""},
                        "result": {"SchemaVersion": 2, "Results": [{"Target": "debian 12", "Vulnerabilities": [
                            {"VulnerabilityID": v, "PkgName": p, "Severity": s} for v, p, s in findings]}]}},
            "metadata": {"scanStartedOn": "2026-12-01T05:00:00Z", "scanFinishedOn": "2026-12-01T05:01:00Z"}}


def attest_all(cosign_cli: Cosign, image: Image, key: KeyPair, tmp_path: Path, **overrides: dict) -> None:
    predicates = {
        "sbom": {"bomFormat": "CycloneDX", "specVersion": "1.5", "version": 1, "components": []},
        "vuln": vuln_predicate(("CVE-2026-0002", "zlib1g", "HIGH")),
        "smoke": {"digest": image.digest, "variant": "cpu", "status": "passed",
                  "counts": {"passed": 3, "failed": 0, "skipped": 1}},
        "gate": {"digest": image.digest, "variant": "cpu", "decision": "passed", "policy": {},
                 "exceptions_applied": []},
    }
    predicates.update(overrides)
    for kind, predicate in predicates.items():
        if predicate is not None:
            cosign_cli.attest(image, key, kind, predicate, tmp_path)


def rego(tmp_path: Path, name: str, rule: str) -> Path:
    """A cosign verify-attestation policy (Rego over the in-toto statement) expressing the same requirement."""
    path = tmp_path / f"{name}.rego"
    path.write_text(f"package signature\n\ndefault allow = false\n\nallow {{\n{rule}\n}}\n")
    return path


def test_an_image_with_all_four_attestations_passing_is_allowed_and_cosign_agrees(push, cosign_cli, our_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, image, our_key, tmp_path)
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    run = verify("--config", str(config), image.by_tag)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (f"{image.by_tag}: verified: {image.digest}: signed by imagebuild-local; "
                                  "4 attestations (sbom, vuln, smoke, gate)")
    for kind in TYPES:
        assert cosign_cli.admits_attestation(image.by_digest, our_key.public, kind), kind


def test_missing_attestations_are_refused_naming_them_and_cosign_agrees(push, cosign_cli, our_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, image, our_key, tmp_path, smoke=None, gate=None)
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    run = verify("--config", str(config), image.by_tag)
    assert run.returncode == 1
    assert refused_line(run, image.by_tag).endswith("refused: attestations missing: smoke, gate")
    assert not cosign_cli.admits_attestation(image.by_digest, our_key.public, "smoke")
    assert verify("--config", str(config), "--no-attestations", image.by_tag).returncode == 0


def test_attestations_signed_with_another_key_do_not_count(push, cosign_cli, our_key, other_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, image, other_key, tmp_path)
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    run = verify("--config", str(config), image.by_tag)
    assert run.returncode == 1
    line = refused_line(run, image.by_tag)
    assert "attestations missing: sbom, vuln, smoke, gate" in line
    assert "an attestation is not signed by any configured key" in line
    assert not cosign_cli.admits_attestation(image.by_digest, our_key.public, "gate")


def test_smoke_results_for_another_digest_are_refused_and_cosign_agrees(push, cosign_cli, our_key, tmp_path):
    image, other = push(tag="image"), push(tag="other")
    cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, image, our_key, tmp_path,
               smoke={"digest": other.digest, "variant": "cpu", "status": "passed", "counts": {}})
    config = trust_config(tmp_path, [our_key.public], covering(image), **STRICT)
    run = verify("--config", str(config), image.by_tag)
    assert run.returncode == 1
    assert f"the smoke attestation's results are for {other.digest}, not {image.digest}" in refused_line(run, image.by_tag)
    policy = rego(tmp_path, "smoke", f'  input.predicate.status == "passed"\n  input.predicate.digest == "{image.digest}"')
    assert not cosign_cli.admits_attestation(image.by_digest, our_key.public, "smoke", policy)


def test_an_unexcepted_critical_in_the_vuln_attestation_is_refused_and_an_excepted_one_is_not(
        push, cosign_cli, our_key, tmp_path):
    blocked, excepted = push(tag="blocked"), push(tag="excepted")
    critical = vuln_predicate(("CVE-2026-0001", "openssl", "CRITICAL"), ("CVE-2026-0002", "zlib1g", "HIGH"))
    for image in (blocked, excepted):
        cosign_cli.sign(image, our_key)
    attest_all(cosign_cli, blocked, our_key, tmp_path, vuln=critical)
    attest_all(cosign_cli, excepted, our_key, tmp_path, vuln=critical, gate={
        "digest": excepted.digest, "variant": "cpu", "decision": "passed", "policy": {},
        "exceptions_applied": [{"id": "CVE-2026-0001", "package": "openssl", "owner": "security",
                                "reason": "not reachable", "expires": "2099-01-01"}]})
    config = trust_config(tmp_path, [our_key.public], covering(blocked), **STRICT)
    run = verify("--config", str(config), blocked.by_tag, excepted.by_tag)
    assert run.returncode == 1
    assert refused_line(run, blocked.by_tag).endswith(
        "unexcepted vulnerabilities at or above CRITICAL in the vuln attestation: CVE-2026-0001 (openssl, CRITICAL)")
    assert f"{excepted.by_tag}: verified: " in run.stdout
    no_critical = rego(tmp_path, "vuln", '  count([v | v := input.predicate.scanner.result.Results[_].Vulnerabilities[_]; '
                                         'v.Severity == "CRITICAL"]) == 0')
    assert not cosign_cli.admits_attestation(blocked.by_digest, our_key.public, "vuln", no_critical)


# --- the Verifier in-process (what the webhook calls) --------------------------------------------


def test_a_cached_verdict_never_outlives_a_moved_tag(push, cosign_cli, our_key):
    from imagebuild.config.trust import trust_config_for_keys
    from imagebuild.trust.verify import Verifier

    signed = push()
    cosign_cli.sign(signed, our_key)
    with Verifier(trust_config_for_keys([our_key.public]), cache_ttl_seconds=3600) as verifier:
        assert verifier.verify(signed.by_tag).allowed
        push(tag=signed.tag)
        after = verifier.verify(signed.by_tag)
        assert not after.allowed and after.digest != signed.digest
        assert verifier.verify(signed.by_digest).allowed


def test_verdicts_are_cached_by_digest_for_the_ttl(push, cosign_cli, our_key):
    from imagebuild.config.trust import trust_config_for_keys
    from imagebuild.trust.verify import Verifier

    image = push()
    cosign_cli.sign(image, our_key)
    config = trust_config_for_keys([our_key.public])
    with Verifier(config, cache_ttl_seconds=3600) as cached, Verifier(config, cache_ttl_seconds=0) as uncached:
        assert cached.verify(image.by_digest).allowed and uncached.verify(image.by_digest).allowed
        delete_manifest(image, image.signature_tag())
        assert cached.verify(image.by_digest).allowed  # within the TTL: no registry round
        assert not uncached.verify(image.by_digest).allowed


def test_many_threads_verifying_at_once_get_the_same_verdicts(push, cosign_cli, our_key):
    from imagebuild.config.trust import trust_config_for_keys
    from imagebuild.trust.verify import Verifier

    signed, unsigned = push(tag="signed"), push(tag="unsigned")
    cosign_cli.sign(signed, our_key)
    refs = [signed.by_tag, unsigned.by_tag, signed.by_digest, unsigned.by_digest] * 25
    results: dict[int, bool] = {}
    with Verifier(trust_config_for_keys([our_key.public]), cache_ttl_seconds=60) as verifier:
        def work(index: int) -> None:
            results[index] = verifier.verify(refs[index]).allowed

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(refs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [results[i] for i in range(len(refs))] == [True, False, True, False] * 25


# --- the example, signed by `imagebuild sign` -------------------------------------------------------


def test_the_signed_example_verifies_with_all_seven_attestations_under_the_example_trust_config_and_cosign_agrees(
        signed_example, cosign_cli):
    run = verify("--config", str(REPO / "examples" / "local" / "trust.yaml"), "--format", "json",
                 *signed_example.images, *signed_example.tags)
    assert run.returncode == 0, run.stdout + run.stderr
    verdicts = run.json()["images"]
    assert len(verdicts) == len(signed_example.images) + len(signed_example.tags) > 0
    indexes = {v["digest"] for v in signed_example.report["variants"] if len(v["platforms"]) > 1}
    assert indexes, "the example has a two-platform variant"
    for verdict in verdicts:
        assert verdict["allowed"] and verdict["key"] == "imagebuild-local", verdict
        if verdict["digest"] in indexes:  # verified whole: each child held to all seven on its own digest
            assert "index of 2 platforms, each verified (linux/amd64, linux/arm64)" in verdict["reason"], verdict
            continue
        assert "; 7 attestations (" in verdict["reason"]  # sign's four, the OpenVEX, the release record's two
        assert set(verdict["reason"].split(" attestations (")[1].rstrip(")").split(", ")) == {
            *TYPES, "openvex", "provenance", "release"}
    for image in signed_example.images:
        assert cosign_cli.admits(image, signed_example.public_key), image
        if image.split("@")[-1] in indexes:
            continue  # its per-kind attestations are its children's
        for kind in TYPES:
            assert cosign_cli.admits_attestation(image, signed_example.public_key, kind), (image, kind)
