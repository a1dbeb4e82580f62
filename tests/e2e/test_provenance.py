"""The release record end to end: `imagebuild sign` attaches it, `imagebuild inspect` shows it verified,
plain `cosign verify-attestation` agrees, and tampering with it is reported.

The example's images are signed by the shared `signed_example` fixture (bootstrap's key). Tampering
happens on copies of an example image in repositories of their own (crane), or on small images
pushed for the test, so the shared example stays as signed.
"""
from __future__ import annotations

import base64
import hashlib
import json
import uuid
from pathlib import Path

import httpx
import jsonschema

from imagebuild.trust.attest import PREDICATE_PROVENANCE, PREDICATE_RELEASE
from imagebuild.trust.provenance import BUILD_TYPE, canonical_sha256

from .conftest import STAGING, imagebuild, trust_config
from .tools import COSIGN_VERIFY_OFFLINE, Image, crane

SCHEMA = json.loads((Path(__file__).parents[1] / "fixtures" / "schemas" / "slsa-provenance-v1.schema.json").read_text())
PREDICATE_SCHEMA = {"$defs": SCHEMA["$defs"], "$ref": "#/$defs/provenance"}


def inspect(image: str, key: Path, *args: str):
    return imagebuild("inspect", "--key", str(key), image, *args, timeout=180)


def copy_of(image: str) -> Image:
    """The image with its signature and attestations, copied by digest into a repository of its own
    (under the same image name: the signature names it, and verify refuses a copy under another)."""
    source, digest = image.split("@", 1)
    repository = f"{STAGING}/provenance-e2e/{uuid.uuid4().hex[:10]}/{source.rsplit('/', 1)[-1]}"
    crane("copy", image, f"{repository}:v1")
    for suffix in ("sig", "att"):
        crane("copy", f"{source}:{digest.replace(':', '-')}.{suffix}", f"{repository}:{digest.replace(':', '-')}.{suffix}")
    return Image(repository, "v1", digest)


def rewrite_attestation(image: Image, predicate_type: str, change) -> None:
    """Edit one DSSE envelope of the image's .att in the registry (`change(envelope, statement)`), keeping the rest."""
    registry, repository = image.repository.split("/", 1)
    base = f"http://{registry}/v2/{repository}"
    tag = image.signature_tag(".att")
    response = httpx.get(f"{base}/manifests/{tag}", headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    response.raise_for_status()
    manifest, media_type = response.json(), response.headers["content-type"]
    layer = next(layer for layer in manifest["layers"] if layer["annotations"].get("predicateType") == predicate_type)
    envelope = httpx.get(f"{base}/blobs/{layer['digest']}", follow_redirects=True).json()
    statement = json.loads(base64.b64decode(envelope["payload"]))
    change(envelope, statement)
    blob = json.dumps(envelope).encode()
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    start = httpx.post(f"{base}/blobs/uploads/")
    assert start.status_code == 202, start.text
    location = start.headers["location"]
    location = location if location.startswith("http") else f"http://{registry}{location}"
    put = httpx.put(f"{location}{'&' if '?' in location else '?'}digest={digest}", content=blob,
                    headers={"Content-Type": "application/octet-stream"})
    assert put.status_code == 201, put.text
    layer["digest"], layer["size"] = digest, len(blob)
    put = httpx.put(f"{base}/manifests/{tag}", content=json.dumps(manifest).encode(),
                    headers={"Content-Type": media_type})
    assert put.status_code == 201, put.text


def refusals(run) -> str:
    assert run.returncode == 1, f"expected exit 1:\n{run.stdout}\n{run.stderr}"
    return run.stderr


# --- the record of the signed example ------------------------------------------------------------


def test_inspect_shows_each_example_images_verified_record_sourced_from_the_build(signed_example):
    report = signed_example.report
    layers = {layer["key"]: layer for layer in report["layers"]}
    for variant in report["variants"]:
        if len(variant["platforms"]) > 1:
            continue  # an index's record names its children's; each child's is its own (test_platform_stages.py)
        run = inspect(variant["image"], signed_example.public_key, "--format", "json")
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
        shown = run.json()
        assert shown["verified"] is True and shown["problems"] == [] and shown["key"] == "cosign.pub"
        assert shown["digest"] == variant["digest"]
        record = shown["record"]
        assert record["variant"] == variant["id"]
        assert record["matrix_cell"] == {axis: variant[axis] for axis in
                                         ("id", "os", "device", "cuda", "cudnn", "python", "paddle")}
        assert record["matrix"]["path"] == report["matrix"] and record["matrix"]["sha256"] == report["matrix_sha256"]
        assert [(layer["key"], layer["digest"]) for layer in record["layers"]] == \
            [(key, layers[key]["digest"]) for key in variant["chain"]]
        # The base and the revision are what the image's own labels say (read here with crane).
        labels = json.loads(crane("config", variant["image"]))["config"]["Labels"]
        assert record["base"]["digest"] == labels["org.opencontainers.image.base.digest"]
        assert record["source"]["revision"] == labels["org.opencontainers.image.revision"] == report["revision"]
        assert record["build_run"] == {"id": report["run_id"], "started": report["created"],
                                       "finished": report["finished"]}
        stages = variant["stages"]
        assert record["smoke"]["status"] == "passed"
        assert record["smoke"]["counts"]["passed"] == stages["smoke"]["passed"]
        assert record["scan"]["scanner"]["version"] == stages["scan"]["trivy_version"]
        assert record["gate"]["decision"] == "passed"
        assert ("CVE-2023-45853", "zlib1g") in {(e["id"], e["package"]) for e in record["gate"]["exceptions_applied"]}
        assert record["signature"]["attestations"] == stages["sign"]["attestation_ref"]
        assert record["tags"] == variant["images"]

    table = inspect(signed_example.images[0], signed_example.public_key)
    assert table.returncode == 0, table.stderr
    variant = report["variants"][0]
    for expected in ("verified", variant["id"], variant["images"][0], "CVE-2023-45853", "excepted"):
        assert expected in table.stdout


def test_cosign_verify_attestation_independently_agrees_with_inspect(signed_example, cosign_cli):
    for image in signed_example.images:
        shown = inspect(image, signed_example.public_key, "--format", "json").json()
        hex_digest = image.split("@sha256:", 1)[1]
        [provenance] = cosign_cli.statements(image, signed_example.public_key, "slsaprovenance1")
        assert provenance["predicateType"] == "https://slsa.dev/provenance/v1"
        assert [s["digest"]["sha256"] for s in provenance["subject"]] == [hex_digest]
        assert provenance["predicate"] == shown["provenance"]
        jsonschema.validate(provenance["predicate"], PREDICATE_SCHEMA)
        assert provenance["predicate"]["buildDefinition"]["buildType"] == BUILD_TYPE
        [release] = cosign_cli.statements(image, signed_example.public_key, PREDICATE_RELEASE)
        assert release["predicate"] == shown["release"]
        assert release["predicate"]["provenance"]["sha256"] == canonical_sha256(provenance["predicate"])


# --- tampering -------------------------------------------------------------------------------------


def test_a_release_record_replaced_by_one_signed_with_another_key_is_reported(
        signed_example, cosign_cli, other_key, tmp_path):
    image = copy_of(signed_example.images[0])
    release = inspect(image.by_digest, signed_example.public_key, "--format", "json").json()["release"]
    release["gate"]["exceptions_applied"] = []  # a "cleaner" record, from someone else
    cosign_cli.attest(image, other_key, PREDICATE_RELEASE, release, tmp_path, "--replace")
    stderr = refusals(inspect(image.by_digest, signed_example.public_key))
    assert "no verified release attestation" in stderr
    assert "not signed by any configured key (it claims to be release)" in stderr
    # cosign sees the same: nothing of that type verifies with our key.
    run = cosign_cli.run("verify-attestation", "--key", str(signed_example.public_key), *COSIGN_VERIFY_OFFLINE,
                         "--type", PREDICATE_RELEASE, image.by_digest)
    assert run.returncode != 0


def test_a_provenance_edited_after_signing_or_stripped_of_its_signature_is_reported(signed_example, cosign_cli):
    def edit(envelope, statement):
        statement["predicate"]["buildDefinition"]["externalParameters"]["variant"]["paddle"] = "9.9.9"
        envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()

    def strip(envelope, statement):
        envelope["signatures"] = []

    for change in (edit, strip):
        image = copy_of(signed_example.images[0])
        rewrite_attestation(image, PREDICATE_PROVENANCE, change)
        stderr = refusals(inspect(image.by_digest, signed_example.public_key))
        assert "no verified provenance attestation" in stderr
        assert "not signed by any configured key (it claims to be provenance)" in stderr
        assert "9.9.9" not in stderr
        run = cosign_cli.run("verify-attestation", "--key", str(signed_example.public_key), *COSIGN_VERIFY_OFFLINE,
                             "--type", "slsaprovenance1", image.by_digest)
        assert run.returncode != 0, f"cosign accepted the {change.__name__} provenance"
        # A verifier that requires provenance refuses it too.
        verify = imagebuild("verify", "--key", str(signed_example.public_key), "--require-provenance", image.by_digest)
        assert verify.returncode == 1 and "attestations missing: provenance" in verify.stderr


def test_records_copied_from_another_image_are_reported_as_about_that_image(signed_example, push, cosign_cli, our_key):
    donor = copy_of(signed_example.images[0])
    image = push()
    cosign_cli.sign(image, our_key)  # signed for real, so only the records are wrong
    crane("copy", f"{donor.repository}:{donor.signature_tag('.att')}", f"{image.repository}:{image.signature_tag('.att')}")
    stderr = refusals(inspect(image.by_tag, our_key.public))
    assert f"is about sha256:{donor.digest.split(':', 1)[1]}, not {image.digest}" in stderr
    assert "no verified provenance attestation" in stderr and "no verified release attestation" in stderr


def test_an_image_signed_without_a_record_is_reported_and_refused_when_provenance_is_required(
        signed_example, push, cosign_cli, our_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    stderr = refusals(inspect(image.by_tag, our_key.public))
    assert "no verified provenance attestation" in stderr

    assert imagebuild("verify", "--key", str(our_key.public), image.by_tag).returncode == 0  # the signature alone
    refused = imagebuild("verify", "--key", str(our_key.public), "--require-provenance", image.by_tag)
    assert refused.returncode == 1 and "attestations missing: provenance" in refused.stderr
    config = trust_config(tmp_path, [our_key.public], [f"{STAGING}/**"], attestations=["provenance"])
    by_config = imagebuild("verify", "--config", str(config), image.by_tag)
    assert by_config.returncode == 1 and "attestations missing: provenance" in by_config.stderr

    admitted = imagebuild("verify", "--key", str(our_key.public), "--require-provenance", *signed_example.images)
    assert admitted.returncode == 0, admitted.stderr


def test_a_signed_provenance_of_another_build_system_is_refused_when_provenance_is_required(
        signed_example, push, cosign_cli, our_key, tmp_path):
    image = push()
    cosign_cli.sign(image, our_key)
    foreign = inspect(signed_example.images[0], our_key.public, "--format", "json").json()["provenance"]
    foreign["buildDefinition"]["buildType"] = "https://example.com/another-builder/v1"
    cosign_cli.attest(image, our_key, PREDICATE_PROVENANCE, foreign, tmp_path, "--replace")
    # cosign only checks the signature: it accepts the statement...
    assert cosign_cli.statements(image.by_digest, our_key.public, "slsaprovenance1")
    # ...imagebuild also requires imagebuild's build type.
    refused = imagebuild("verify", "--key", str(our_key.public), "--require-provenance", image.by_digest)
    assert refused.returncode == 1 and "buildType" in refused.stderr and BUILD_TYPE in refused.stderr


def test_inspect_and_require_provenance_reject_bad_input_with_exit_2(our_key):
    for args in (("inspect", "--key", str(our_key.public), "not a reference"),
                 ("verify", "--key", str(our_key.public), "--require-provenance", "--no-attestations",
                  f"{STAGING}/x/y:1")):
        run = imagebuild(*args)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
