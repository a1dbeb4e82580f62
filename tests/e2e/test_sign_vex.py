"""`imagebuild sign` attaches the OpenVEX attestation with the others, for real: two small images on the local
Debian base, scanned with real Trivy (the fixture DB), judged by the real `imagebuild gate` under a policy
with one exception for one of them, then signed with the pinned cosign. Plain `cosign verify-attestation`
finds each document; `imagebuild vex show` (the rescan's reading) and `imagebuild verify` under a trust
file requiring a current openvex accept both, the one without an exception by its empty document.

The build report is written here (not built: the example's build takes minutes), as `imagebuild build`
and `imagebuild test` would leave it for these two images.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from imagebuild.checks.scan import ScanOptions, Trivy, scan_image

from .conftest import STAGING, imagebuild, require_registry, sign_workdir, trivy_cache_with_db, unique
from .tools import KEYS, Image, crane, push_tiny_image

pytestmark = pytest.mark.e2e

BASE = f"{STAGING}/imagebuild/debian:12"
OPENVEX = "https://openvex.dev/ns/v0.2.0"
EXCEPTED, PLAIN = "paddle3.3.1-cpu-py3.11-debian12", "paddle3.3.1-cpu-py3.12-debian12"
LABELS = {"org.opencontainers.image.base.name": BASE, "org.opencontainers.image.base.digest": "sha256:" + "df" * 32,
          "org.opencontainers.image.revision": "98ed2f1ce835062528bcdfacfe62327348dc7bcb",
          "org.opencontainers.image.source": "https://example.com/imagebuild"}
POLICY = """\
    schema: 1
    severity: CRITICAL
    ignore_unfixed: true
    exceptions:
      - id: CVE-2023-45853
        packages: [zlib]
        variants: [paddle3.3.1-cpu-py3.11-debian12]
        owner: ml-platform-security@example.com
        reason: The images never inflate untrusted data with minizip.
        expires: 2099-01-31
    """


def labelled_image(folder: Path, repository: str, tag: str) -> Image:
    """A tiny image on the Debian base carrying the labels the release layer writes (what provenance reads)."""
    push_tiny_image(folder, f"{repository}:{tag}", base=BASE)
    crane("mutate", f"{repository}:{tag}", *(f"--label={k}={v}" for k, v in LABELS.items()), "-t", f"{repository}:{tag}")
    return Image(repository, tag, crane("digest", f"{repository}:{tag}").strip())


def variant_entry(variant: str, image: Image, work: Path, trivy: Trivy, cache: Path) -> dict:
    """The variant as the build report holds it after build and test, scanned here with real Trivy."""
    out = work / "scan" / variant
    scan_image(trivy, image.by_digest, variant, ScanOptions(workdir=work, dockerfiles=work, cache_dir=cache,
                                                            offline=True), out)
    (out / "config.json").write_text('{"SchemaVersion": 2, "Results": []}')  # no Dockerfiles of its own to check
    return {"id": variant, "tags": [image.tag], "images": [image.by_tag], "chain": [variant], "device": "cpu",
            "paddle": "3.3.1", "python": variant.split("-py")[1].split("-")[0], "cuda": None, "cudnn": None,
            "os": "debian12", "status": "built", "digest": image.digest, "image": image.by_digest, "stages": {
                "smoke": {"status": "passed", "digest": image.digest, "image": image.by_digest, "passed": 3,
                          "tiers": ["abi"]},
                "scan": {"status": "ok", "digest": image.digest, "image": image.by_digest,
                         "trivy_version": trivy.version, "scanned_at": "2026-12-04T00:00:00Z",
                         "reports": {"image": f"scan/{variant}/image.json", "sbom": f"scan/{variant}/sbom.cdx.json",
                                     "config": f"scan/{variant}/config.json"}}}}


@pytest.fixture(scope="module")
def signed(trivy_db, our_key, tmp_path_factory) -> dict:
    require_registry(STAGING)
    folder = tmp_path_factory.mktemp("sign-vex")
    repository = f"{STAGING}/{unique('sign-vex')}/paddle"
    images = {EXCEPTED: labelled_image(folder / "a", repository, "3.3.1-py3.11"),
              PLAIN: labelled_image(folder / "b", repository, "3.3.1-py3.12")}
    work = folder / "work"
    trivy, cache = Trivy.find(), trivy_cache_with_db(trivy_db, folder / "cache")
    variants = [variant_entry(v, image, work, trivy, cache) for v, image in images.items()]
    (work / "build-report.json").write_text(json.dumps({
        "matrix": "matrix.yaml", "revision": LABELS["org.opencontainers.image.revision"], "registry": STAGING,
        "repository": repository, "cache_repository": f"{STAGING}/layers", "created": "2026-12-04T00:00:00Z",
        "schema": "imagebuild.build-report/v1", "run_id": "e2e-sign-vex", "status": "ok", "variants": variants,
        "layers": [{"key": v["id"], "kind": "release", "path": f"release/{v['id']}", "status": "built",
                    "image": v["image"], "digest": v["digest"]} for v in variants]}, indent=2))
    (folder / "policy.yaml").write_text(textwrap.dedent(POLICY))
    gate = imagebuild("gate", "--workdir", str(work), "--policy", str(folder / "policy.yaml"))
    assert gate.returncode == 0, (gate.stdout[-2000:], gate.stderr[-2000:])
    run = sign_workdir(work, our_key.private, our_key.password, "--format", "json")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    (folder / "trust.yaml").write_text(textwrap.dedent(f"""\
        schema: 1
        mode: enforce
        keys: [{{name: imagebuild-local, path: {KEYS / 'cosign.pub'}}}]
        images: ["127.0.0.1:*/**"]
        require: {{attestations: [openvex], vex_current: true}}
        cache_ttl_seconds: 0
        """))
    return {"folder": folder, "work": work, "images": images, "run": run.json()}


def report(signed: dict) -> dict:
    return json.loads((signed["work"] / "build-report.json").read_text())


def test_sign_records_the_openvex_attestation_beside_the_others(signed):
    assert {row["action"] for row in signed["run"]["variants"]} == {"signed"}
    for variant in report(signed)["variants"]:
        record = variant["stages"]["sign"]
        assert [a["type"] for a in record["attestations"]] == ["sbom", "vuln", "smoke", "gate", "openvex",
                                                              "provenance", "release"]
        assert {"type": "openvex", "predicate_type": OPENVEX} in record["attestations"]
        document = json.loads((signed["work"] / record["predicates"]["openvex"]).read_text())
        assert document["@context"] == OPENVEX and document["tooling"] == "imagebuild sign"


def test_cosign_verifies_each_document_about_its_own_digest_with_the_policys_exception_only_where_it_applies(
        signed, cosign_cli, our_key):
    for variant, image in signed["images"].items():
        (statement,) = cosign_cli.statements(image.by_digest, our_key.public, OPENVEX)
        assert [s["digest"]["sha256"] for s in statement["subject"]] == [image.digest.split(":", 1)[1]]
        vex = statement["predicate"]["statements"]
        if variant == PLAIN:
            assert vex == []  # no exception applies to it: an empty document, attached all the same
            continue
        (only,) = vex
        assert only["vulnerability"]["name"] == "CVE-2023-45853" and only["status"] == "not_affected"
        assert only["products"] == [{"@id": f"pkg:oci/paddle@sha256%3A{image.digest.split(':', 1)[1]}",
                                     "subcomponents": [{"@id": "pkg:deb/debian/zlib1g"}]}]
        assert only["imagebuild:expires"] == "2099-01-31"


def test_vex_show_and_verify_under_a_trust_file_requiring_a_current_openvex_accept_both(signed):
    trust = str(signed["folder"] / "trust.yaml")
    for variant, image in signed["images"].items():
        shown = imagebuild("vex", "show", image.by_digest, "--trust", trust, "--format", "json")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.json()["statements"] == ([] if variant == PLAIN else ["CVE-2023-45853"])
        verified = imagebuild("verify", image.by_digest, "--trust", trust)
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_rerun_skips_what_is_attested_and_vex_attest_still_replaces_the_document(signed, cosign_cli, our_key):
    again = sign_workdir(signed["work"], our_key.private, our_key.password, "--format", "json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert {row["action"] for row in again.json()["variants"]} == {"skipped"}
    # After a policy change (the exception now for every variant), `vex attest` replaces the plain one's.
    image = signed["images"][PLAIN]
    policy = signed["folder"] / "renewed.yaml"
    policy.write_text(textwrap.dedent(POLICY).replace("    variants: [paddle3.3.1-cpu-py3.11-debian12]\n", ""))
    attested = imagebuild("vex", "attest", image.by_digest, "--variant", PLAIN, "--policy", str(policy),
                          "--sbom", str(signed["work"] / "scan" / PLAIN / "sbom.cdx.json"), "--key", str(our_key.private),
                          "--out", str(signed["folder"] / "vex"), "--format", "json",
                          env={"COSIGN_PASSWORD": our_key.password}, timeout=300)
    assert attested.returncode == 0, attested.stderr[-2000:]
    (statement,) = cosign_cli.statements(image.by_digest, our_key.public, OPENVEX)  # replaced, not added
    assert [s["vulnerability"]["name"] for s in statement["predicate"]["statements"]] == ["CVE-2023-45853"]
    still = sign_workdir(signed["work"], our_key.private, our_key.password, "--only", f"id={PLAIN}", "--format", "json")
    assert [row["action"] for row in still.json()["variants"]] == ["skipped"]  # the newer document stays
