"""The release record (imagebuild/trust/provenance.py): SLSA v1 provenance and the release predicate, from a build report."""
from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path

import jsonschema
import pytest

from imagebuild.config.trust import Requirements
from imagebuild.core.report import BuildReport, GateStage, ScanStage, SmokeStage, VariantRecord
from imagebuild.trust import attest, provenance, sign
from imagebuild.trust.verify import ATTESTATION_TYPES, Attestation, requirement_failures

SCHEMA = json.loads((Path(__file__).parent / "fixtures" / "schemas" / "slsa-provenance-v1.schema.json").read_text())

DIGEST = "sha256:" + "b4" * 32
OTHER = "sha256:" + "c5" * 32
BASE_DIGEST = "sha256:" + "df" * 32
REVISION = "98ed2f1ce835062528bcdfacfe62327348dc7bcb"
REPOSITORY = "127.0.0.1:5000/imagebuild-example/paddle"
CACHE = "127.0.0.1:5000/imagebuild-example/layers"
VARIANT = "paddle3.3.1-cpu-py3.11-debian12"
CHAIN = [("base", "base/debian12", "9c" * 32, "e2" * 32), ("python", "python/debian12-py3.11", "bf" * 32, "28" * 32),
         ("paddle", "paddle/debian12-py3.11-paddle3.3.1", "30" * 32, "3f" * 32),
         ("release", f"release/{VARIANT}", "9e" * 32, "b4" * 32)]
LABELS = {
    "org.opencontainers.image.base.name": "127.0.0.1:5000/imagebuild/debian:12",
    "org.opencontainers.image.base.digest": BASE_DIGEST,
    "org.opencontainers.image.revision": REVISION,
    "org.opencontainers.image.source": "https://example.com/imagebuild",
    "io.imagebuild.variant": VARIANT,
}
BUILDER = provenance.Builder("https://imagebuild.dev/builder/local", "0.1.0")


def report_data() -> dict:
    """A report as `imagebuild build` writes it for the example's CPU variant (values from a real run)."""
    return {
        "matrix": "examples/local/matrix.yaml", "revision": REVISION, "registry": "127.0.0.1:5000",
        "repository": REPOSITORY, "cache_repository": CACHE, "created": "2026-12-01T05:07:41Z",
        "finished": "2026-12-01T05:09:02Z", "matrix_sha256": "sha256:" + "4a" * 32, "status": "ok",
        "schema": "imagebuild.build-report/v1", "run_id": "1575e62ee7dc4fb1a55e4dd12b7707bc",
        "variants": [{
            "id": VARIANT, "tags": ["3.3.1"], "images": [f"{REPOSITORY}:3.3.1"], "chain": [c[2] for c in CHAIN],
            "device": "cpu", "paddle": "3.3.1", "python": "3.11", "cuda": None, "cudnn": None, "os": "debian12",
            "status": "built", "digest": DIGEST, "image": f"{REPOSITORY}@{DIGEST}", "stages": {},
        }],
        "layers": [{"key": key, "kind": kind, "path": path, "image": f"{CACHE}:{kind}-{key[:32]}",
                    "status": "reused", "digest": f"sha256:{digest}"} for kind, path, key, digest in CHAIN],
    }


def statement(data: dict | None = None, labels: dict | None = None, builder: provenance.Builder = BUILDER) -> dict:
    report = BuildReport.from_dict(data or report_data())
    return provenance.provenance_statement(report, report.variants[0], labels=LABELS if labels is None else labels,
                                           builder=builder)


SMOKE = {"status": "passed", "digest": DIGEST, "image": f"{REPOSITORY}@{DIGEST}", "passed": 9, "failed": 0,
         "errors": 0, "skipped": 6, "tiers": ["abi", "gpu"], "gpu_requested": False, "suite_digest": "sha256:" + "5e" * 32,
         "duration_s": 11.3, "exit_code": 0, "failures": [], "skip_reasons": [],
         "log": "/tmp/work/smoke/output.log", "junit": "/tmp/work/smoke/junit.xml"}
SCAN = {"status": "ok", "digest": DIGEST, "trivy_version": "0.76.0", "db_updated_at": "2026-12-01T05:07:42Z",
        "scanned_at": "2026-12-01T05:07:44Z", "duration_s": 22.9}
TRIVY = {"ArtifactName": f"{REPOSITORY}@{DIGEST}", "Results": [{"Target": "debian 12", "Vulnerabilities": [
    {"VulnerabilityID": "CVE-2023-45853", "PkgName": "zlib1g", "Severity": "CRITICAL"}]}]}
EXCEPTION = {"id": "CVE-2023-45853", "owner": "imagebuild-maintainers@example.com",
             "reason": "minizip is not shipped", "expires": "2027-06-30", "line": 22}
GATE = {"status": "passed", "digest": DIGEST, "image": f"{REPOSITORY}@{DIGEST}", "policy": "examples/local/policy.yaml",
        "evaluated_on": "2026-12-01", "severity": "HIGH", "counts": {"blocked": 0, "excepted": 1},
        "excepted": [{"kind": "vulnerability", "id": "CVE-2023-45853", "severity": "CRITICAL", "package": "zlib1g",
                      "exception": EXCEPTION}]}
LAYOUT = provenance.SignatureLayout(layout="tag", signature=f"{REPOSITORY}:sha256-{'b4' * 32}.sig",
                                    attestations=f"{REPOSITORY}:sha256-{'b4' * 32}.att",
                                    key="/var/lib/imagebuild/keys/cosign.key", keyless=False, tlog=False,
                                    cosign_version="v2.6.5")


def predicates(digest: str = DIGEST) -> dict:
    """The four predicates as sign builds them, with attest.py's builders."""
    return {
        "smoke": attest.smoke_predicate(SmokeStage.from_dict({**SMOKE, "digest": digest}), digest=digest,
                                        variant=VARIANT),
        "vuln": attest.vuln_predicate({**TRIVY, "ArtifactName": f"{REPOSITORY}@{digest}"}, digest=digest,
                                      variant=VARIANT, image=f"{REPOSITORY}@{digest}",
                                      scan=ScanStage.from_dict({**SCAN, "digest": digest}),
                                      db={"source": "trivy-db (fixture)", "updated_at": "2026-12-01T05:07:42Z"}),
        "gate": attest.gate_predicate(GateStage.from_dict({**GATE, "digest": digest}), digest=digest, variant=VARIANT),
    }


def release(prov: dict | None = None, preds: dict | None = None, variant: VariantRecord | None = None) -> dict:
    preds = preds or predicates()
    variant = variant or BuildReport.from_dict(report_data()).variants[0]
    return provenance.release_predicate(variant, provenance=prov or statement()["predicate"], smoke=preds["smoke"],
                                        vuln=preds["vuln"], gate=preds["gate"], signature=LAYOUT)


# --- the provenance -----------------------------------------------------------------------------


def test_the_provenance_is_an_in_toto_v1_statement_valid_against_the_slsa_v1_fields():
    document = statement()
    jsonschema.validate(document, SCHEMA)
    assert document["_type"] == "https://in-toto.io/Statement/v1"
    assert document["predicateType"] == "https://slsa.dev/provenance/v1" == attest.PROVENANCE.predicate_type
    assert document["subject"] == [{"name": REPOSITORY, "digest": {"sha256": "b4" * 32}}]


def test_the_schema_refuses_what_slsa_v1_does_not_have():
    """The schema is strict enough to catch a misspelt field (cosign's struct writes invocationID)."""
    document = statement()
    document["predicate"]["runDetails"]["metadata"]["invocationID"] = "x"
    with pytest.raises(jsonschema.ValidationError, match=r"\('invocationID' was unexpected\)"):
        jsonschema.validate(document, SCHEMA)
    document = statement()
    del document["predicate"]["buildDefinition"]["buildType"]
    with pytest.raises(jsonschema.ValidationError, match="'buildType' is a required property"):
        jsonschema.validate(document, SCHEMA)


def test_the_build_definition_holds_the_matrix_cell_the_matrix_file_and_the_layer_keys():
    build = statement()["predicate"]["buildDefinition"]
    assert build["buildType"] == provenance.BUILD_TYPE == "https://imagebuild.dev/build/v1"
    assert build["externalParameters"] == {
        "variant": {"id": VARIANT, "os": "debian12", "device": "cpu", "cuda": None, "cudnn": None,
                    "python": "3.11", "paddle": "3.3.1"},
        "matrix": {"path": "examples/local/matrix.yaml", "sha256": "sha256:" + "4a" * 32},
    }
    assert build["internalParameters"]["imagebuild"] == "0.1.0"
    assert [(layer["kind"], layer["key"]) for layer in build["internalParameters"]["layers"]] == \
        [(kind, key) for kind, _, key, _ in CHAIN]


def test_the_resolved_dependencies_are_the_base_image_the_source_revision_and_each_layer_by_digest():
    deps = statement()["predicate"]["buildDefinition"]["resolvedDependencies"]
    base, source, *layers = deps
    assert base == {"name": "base", "uri": f"oci://127.0.0.1:5000/imagebuild/debian@{BASE_DIGEST}",
                    "digest": {"sha256": "df" * 32}, "annotations": {"reference": "127.0.0.1:5000/imagebuild/debian:12"}}
    assert source == {"name": "source", "uri": "git+https://example.com/imagebuild", "digest": {"gitCommit": REVISION}}
    assert [(d["name"], d["uri"], d["digest"]["sha256"], d["annotations"]["key"]) for d in layers] == [
        (f"layer/{kind}", f"oci://{CACHE}@sha256:{digest}", digest, key) for kind, _, key, digest in CHAIN]


def test_the_run_details_name_the_builder_the_build_run_and_its_times():
    run = statement()["predicate"]["runDetails"]
    assert run["builder"] == {"id": "https://imagebuild.dev/builder/local", "version": {"imagebuild": "0.1.0"}}
    assert run["metadata"] == {"invocationId": "1575e62ee7dc4fb1a55e4dd12b7707bc",
                               "startedOn": "2026-12-01T05:07:41Z", "finishedOn": "2026-12-01T05:09:02Z"}


@pytest.mark.parametrize("change, where", [
    (lambda d, labels: labels.update({"org.opencontainers.image.revision": "1" * 40}), "1" * 40),
    (lambda d, labels: labels.update({"org.opencontainers.image.base.digest": "sha256:" + "ee" * 32}), "ee" * 32),
    (lambda d, labels: d.update(run_id="feedfacecafe"), "feedfacecafe"),
    (lambda d, labels: d.update(created="2026-12-02T01:02:03Z"), "2026-12-02T01:02:03Z"),
    (lambda d, labels: d.update(finished="2026-12-02T04:05:06Z"), "2026-12-02T04:05:06Z"),
    (lambda d, labels: d.update(matrix_sha256="sha256:" + "77" * 32), "77" * 32),
    (lambda d, labels: d["layers"][2].update(digest="sha256:" + "ab" * 32), "ab" * 32),
    (lambda d, labels: d["variants"][0].update(python="3.12"), '"3.12"'),
    (lambda d, labels: d["variants"][0].update(device="gpu", cuda="11.8", cudnn="8.6"), '"8.6"'),
], ids=["revision", "base-digest", "run-id", "started", "finished", "matrix-sha256", "layer-digest", "python", "cuda"])
def test_every_field_comes_from_the_report_or_the_image_labels(change, where):
    data, labels = report_data(), dict(LABELS)
    before = json.dumps(statement(data, labels))
    change(data, labels)
    after = json.dumps(statement(data, labels))
    assert where not in before and where in after


def test_the_same_inputs_give_the_same_bytes():
    assert json.dumps(statement()) == json.dumps(statement())
    assert provenance.canonical_sha256(statement()["predicate"]) == provenance.canonical_sha256(
        json.loads(json.dumps(statement()["predicate"], sort_keys=True)))


def test_an_unknown_revision_leaves_out_the_source_rather_than_invent_one():
    data, labels = report_data(), {**LABELS, "org.opencontainers.image.revision": "unknown"}
    data["revision"] = "unknown"
    names = [d["name"] for d in statement(data, labels)["predicate"]["buildDefinition"]["resolvedDependencies"]]
    assert "source" not in names
    # The label wins over the report: it is what the image itself was built from.
    data["revision"] = "2" * 40
    deps = statement(data, labels)["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert deps[1]["digest"] == {"gitCommit": "2" * 40}


def test_a_report_written_before_matrix_hashes_and_finish_times_still_gives_valid_provenance():
    data = report_data()
    del data["matrix_sha256"], data["finished"]
    document = statement(data)
    jsonschema.validate(document, SCHEMA)
    assert document["predicate"]["buildDefinition"]["externalParameters"]["matrix"] == {"path": "examples/local/matrix.yaml"}
    assert "finishedOn" not in document["predicate"]["runDetails"]["metadata"]


@pytest.mark.parametrize("change, message", [
    (lambda d, labels: labels.pop("org.opencontainers.image.base.digest"), "no base image digest"),
    (lambda d, labels: labels.update({"org.opencontainers.image.base.digest": "unresolved"}), "no base image digest"),
    (lambda d, labels: d["layers"][1].update(digest=None), "has no digest"),
    (lambda d, labels: d["variants"][0].update(digest=None), "not built"),
    (lambda d, labels: d["variants"][0]["chain"].append("ff" * 32), "no layer"),
])
def test_provenance_the_report_cannot_support_is_refused(change, message):
    data, labels = report_data(), dict(LABELS)
    change(data, labels)
    with pytest.raises(attest.PredicateError, match=message):
        statement(data, labels)


def test_nothing_secret_reaches_the_record():
    """Only named fields are copied: other labels, CI tokens and the report's log paths stay out."""
    secret = "ghp_canary0123456789abcdefghijklmnopqrstuv"
    labels = {**LABELS, "io.example.token": secret}
    env = {"GITHUB_ACTIONS": "true", "GITHUB_TOKEN": secret, "ACTIONS_ID_TOKEN_REQUEST_TOKEN": secret,
           "RUNNER_ENVIRONMENT": "github-hosted"}
    data = report_data()
    data["variants"][0]["stages"] = {"smoke": {**SMOKE, "log": f"/tmp/{secret}.log"}}
    builder = provenance.builder_from_environment(env, "0.1.0")
    text = json.dumps(statement(data, labels, builder)) + json.dumps(release())
    assert secret not in text


@pytest.mark.parametrize("env, builder_id", [
    ({}, "https://imagebuild.dev/builder/local"),
    ({"GITHUB_ACTIONS": "true", "RUNNER_ENVIRONMENT": "github-hosted"}, "https://github.com/actions/runner/github-hosted"),
    ({"GITHUB_ACTIONS": "true", "RUNNER_ENVIRONMENT": "self-hosted"}, "https://github.com/actions/runner/self-hosted"),
])
def test_the_builder_is_the_ci_runner_or_imagebuild_on_this_machine(env, builder_id):
    assert provenance.builder_from_environment(env, "1.2.3") == provenance.Builder(builder_id, "1.2.3")


# --- the release predicate -------------------------------------------------------------------------


def test_the_release_record_holds_smoke_scanner_gate_signature_layout_tags_and_a_pointer_to_the_provenance():
    record = release()
    assert (record["digest"], record["variant"], record["tags"]) == (DIGEST, VARIANT, [f"{REPOSITORY}:3.3.1"])
    assert record["smoke"]["status"] == "passed" and record["smoke"]["counts"] == {
        "passed": 9, "failed": 0, "errors": 0, "skipped": 6}
    assert record["scan"]["scanner"] == {"uri": "https://github.com/aquasecurity/trivy", "version": "0.76.0"}
    assert record["scan"]["db"] == {"uri": "trivy-db (fixture)", "version": "2026-12-01T05:07:42Z"}
    assert record["gate"]["decision"] == "passed"
    assert record["gate"]["exceptions_applied"] == [{
        "id": "CVE-2023-45853", "package": "zlib1g", "severity": "CRITICAL", "exception": "CVE-2023-45853",
        "owner": "imagebuild-maintainers@example.com", "reason": "minizip is not shipped", "expires": "2027-06-30"}]
    assert record["signature"]["layout"] == "tag" and record["signature"]["attestations"].endswith(".att")
    assert set(record["signature"]["predicate_types"]) == {k.predicate_type for k in attest.KINDS}
    assert record["provenance"] == {"predicateType": "https://slsa.dev/provenance/v1",
                                    "buildType": provenance.BUILD_TYPE,
                                    "sha256": provenance.canonical_sha256(statement()["predicate"])}
    assert "log" not in record["smoke"] and "junit" not in json.dumps(record)


def test_the_release_record_refuses_results_about_another_digest():
    for name in ("smoke", "vuln", "gate"):
        preds = predicates()
        preds[name] = predicates(OTHER)[name]
        with pytest.raises(attest.PredicateError, match=f"the {name} predicate is about {OTHER}"):
            release(preds=preds)


def test_a_release_record_read_back_must_match_its_digest_and_its_provenance():
    prov = statement()["predicate"]
    record = release(prov)
    assert provenance.release_problems(record, prov, DIGEST) == []
    assert provenance.release_problems(record, prov, OTHER) == [f"the release record is about {DIGEST}, not {OTHER}"]
    tampered = copy.deepcopy(prov)
    tampered["buildDefinition"]["resolvedDependencies"][0]["digest"]["sha256"] = "00" * 32
    assert provenance.release_problems(record, tampered, DIGEST) == [
        "the release record points to another provenance (sha256 differs)"]
    assert "the release record is of" in " ".join(provenance.release_problems({**record, "variant": "x"}, prov, DIGEST))


def test_a_provenance_of_another_build_type_is_not_imagebuilds():
    prov = statement()["predicate"]
    assert provenance.provenance_problems(prov) == []
    prov["buildDefinition"]["buildType"] = "https://example.com/other-builder/v1"
    assert "not imagebuild's" in provenance.provenance_problems(prov)[0]
    assert provenance.provenance_problems("text") == ["the provenance predicate is not a JSON object"]


def test_required_provenance_in_verify_checks_presence_and_build_type():
    today = dt.date(2026, 12, 1)
    require = Requirements(attestations=("provenance",))
    prov = statement()["predicate"]
    found = {ATTESTATION_TYPES["provenance"]: Attestation(ATTESTATION_TYPES["provenance"], prov, "k")}
    assert requirement_failures(require, found, DIGEST, today) == []
    assert requirement_failures(require, {}, DIGEST, today) == ["attestations missing: provenance"]
    other = copy.deepcopy(prov)
    other["buildDefinition"]["buildType"] = "https://example.com/other/v1"
    found = {ATTESTATION_TYPES["provenance"]: Attestation(ATTESTATION_TYPES["provenance"], other, "k")}
    assert "buildType" in requirement_failures(require, found, DIGEST, today)[0]


def test_sign_builds_both_from_the_report_the_labels_and_the_other_predicates():
    report = BuildReport.from_dict(report_data())
    built = sign.release_record(report, report.variants[0], predicates(), LABELS, LAYOUT, env={})
    assert set(built) == {"provenance", "release"}
    assert built["provenance"] == statement(builder=provenance.Builder(provenance.LOCAL_BUILDER,
                                                                        built["provenance"]["runDetails"]["builder"]
                                                                        ["version"]["imagebuild"]))["predicate"]
    assert built["release"]["provenance"]["sha256"] == provenance.canonical_sha256(built["provenance"])
    with pytest.raises(sign.SignError, match="no base image digest"):
        sign.release_record(report, report.variants[0], predicates(), {}, LAYOUT, env={})


def test_the_six_kinds_sign_attaches_and_their_cosign_types():
    assert [k.name for k in attest.KINDS] == ["sbom", "vuln", "smoke", "gate", "provenance", "release"]
    # A URI, not cosign's `slsaprovenance1`, which would rename invocationId to invocationID.
    assert attest.PROVENANCE.cosign_type == attest.PROVENANCE.predicate_type == "https://slsa.dev/provenance/v1"
    assert attest.RELEASE.predicate_type == "https://imagebuild.dev/attestations/release/v1"
    assert set(sign.PREDICATE_FILES) == {k.name for k in sign.IMAGE_KINDS}  # the six and the OpenVEX document


# --- the command line's bad input (no registry needed) ----------------------------------------------


@pytest.mark.parametrize("args, expected", [
    (("inspect", "--key", "k.pub", "--config", "t.yaml", "127.0.0.1:5000/a/b:1"), "give --key or --trust"),
    (("inspect", "--config", "missing-trust.yaml", "127.0.0.1:5000/a/b:1"), "no such trust config"),
    (("inspect", "--config", "missing-trust.yaml", "Not A Reference"), "not an image reference"),
    (("verify", "--key", "k.pub", "--require-provenance", "--no-attestations", "127.0.0.1:5000/a/b:1"),
     "drop --no-attestations"),
])
def test_bad_command_lines_exit_2_with_one_line(imagebuild, args, expected):
    run = imagebuild(*args)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and expected in run.stderr and "Traceback" not in run.stderr
