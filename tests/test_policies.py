"""imagebuild policies generate: CRD-valid policies, rotation, modes, the webhook's manifests, drift."""
from __future__ import annotations

import base64
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.admission import policies
from imagebuild.config.trust import WebhookSettings, load_trust_config
from imagebuild.oci import reference
from tests.conftest import run_imagebuild
from tests.crd_schema import crd_schema
from tests.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parent.parent

CRD_OF = {
    policies.CLUSTER_IMAGE_POLICY: ("policy-controller-clusterimagepolicy-crd.yaml", "v1beta1"),
    policies.KYVERNO_CLUSTER_POLICY: ("kyverno-clusterpolicies-crd.yaml", "v1"),
    policies.KYVERNO_IMAGE_VALIDATING_POLICY: ("kyverno-imagevalidatingpolicies-crd.yaml", "v1beta1"),
}


def public_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo).decode()


WEBHOOK_IMAGE = "registry.test/team/admission:1@sha256:" + "ab" * 32  # by digest (generate would verify it)


def write_config(folder: Path, *, keys: int = 1, mode: str = "enforce", failure_policy: str = "fail",
                 require: str = "{attestations: [sbom, vuln, smoke, gate], smoke_passed: true, gate_passed: true, "
                                "block_severity: HIGH}", image: str | None = WEBHOOK_IMAGE, more: str = "") -> Path:
    """image: webhook.image (None: not named, the placeholder, which the CLI writes with --keep-webhook-tag)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for n in range(keys):
        (folder / f"key{n}.pub").write_text(public_pem())
        entries.append(f"  - name: release-{2026 + n}\n    path: key{n}.pub\n")
    path = folder / "trust.yaml"
    path.write_text(
        "schema: 1\n"
        f"mode: {mode}\n"
        "keys:\n" + "".join(entries) +
        "images:\n  - \"registry.test/team/**\"\n  - \"127.0.0.1:5000/solo/*\"\n"
        f"require: {require}\n"
        f"failure_policy: {failure_policy}\n"
        "webhook: {namespace: admit-ns, name: admit, " + (f'image: "{image}", ' if image else "") + "port: 9443}\n"
        + more)
    return path


def generated(config_path: Path, ca_bundle: bytes | None = None, webhook_image: str | None = None) -> dict[str, str]:
    config = load_trust_config(config_path)
    return {f.name: f.text for f in policies.generate(config, policies.Options("trust.yaml", ca_bundle, webhook_image))}


def document(files: dict[str, str], name: str) -> dict[str, Any]:
    return yaml.safe_load(files[name])


def webhook_documents(files: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(files[policies.WEBHOOK_MANIFESTS])}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_imagebuild(*args, cwd=ROOT)


def placeholder_generate(config_path: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`policies generate` of a trust file naming no webhook image (write_config(image=None)): no registry
    is asked, nothing verified (a named image is: tests/test_webhook_image.py, tests/e2e/test_webhook_image.py)."""
    return run_cli("policies", "generate", "--config", str(config_path), "--out", str(out), "--keep-webhook-tag",
                   *args)


# --- CRD schemas ----------------------------------------------------------------------------


@pytest.mark.parametrize("keys", [1, 2])
@pytest.mark.parametrize("name", sorted(CRD_OF))
def test_each_policy_validates_against_its_crd_schema(tmp_path: Path, name: str, keys: int) -> None:
    files = generated(write_config(tmp_path, keys=keys))
    jsonschema.validate(document(files, name), crd_schema(*CRD_OF[name]))


@pytest.mark.parametrize("name", sorted(CRD_OF))
def test_policies_without_attestation_requirements_validate_too(tmp_path: Path, name: str) -> None:
    files = generated(write_config(tmp_path, mode="warn", require="{}"))
    jsonschema.validate(document(files, name), crd_schema(*CRD_OF[name]))


@pytest.mark.parametrize("name", sorted(CRD_OF))
def test_committed_production_policies_validate_against_their_crds(name: str) -> None:
    doc = yaml.safe_load((ROOT / "policies" / "admission" / name).read_text())
    jsonschema.validate(doc, crd_schema(*CRD_OF[name]))


@pytest.mark.parametrize("name, path", [
    (policies.CLUSTER_IMAGE_POLICY, ("spec", "authorities", 0, "key")),
    (policies.KYVERNO_CLUSTER_POLICY, ("spec", "rules", 0, "verifyImages", 0)),
    (policies.KYVERNO_IMAGE_VALIDATING_POLICY, ("spec", "validationConfigurations")),
])
def test_schema_check_refuses_a_field_the_crd_would_prune(tmp_path: Path, name: str, path: tuple[Any, ...]) -> None:
    doc = document(generated(write_config(tmp_path)), name)
    node = doc
    for part in path:
        node = node[part]
    node["verifyDigests"] = True  # a plausible typo the API server would drop without a word
    with pytest.raises(jsonschema.ValidationError, match="verifyDigests"):
        jsonschema.validate(doc, crd_schema(*CRD_OF[name]))


def test_schema_check_refuses_a_wrong_enum_value(tmp_path: Path) -> None:
    doc = document(generated(write_config(tmp_path)), policies.KYVERNO_CLUSTER_POLICY)
    doc["spec"]["validationFailureAction"] = "Block"
    with pytest.raises(jsonschema.ValidationError, match="Block"):
        jsonschema.validate(doc, crd_schema(*CRD_OF[policies.KYVERNO_CLUSTER_POLICY]))


# --- what the policies say -------------------------------------------------------------------


def authority(cip: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The ClusterImagePolicy's one authority whose name starts with `prefix` (a one-key trust file)."""
    [found] = [a for a in cip["authorities"] if a["name"].startswith(prefix)]
    return found


def test_an_index_passes_only_on_its_own_release_record_of_passed_platforms(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{attestations: [provenance], smoke_passed: true, gate_passed: true}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    release, provenance = authority(cip, "idx-")["attestations"]
    assert (release["name"], provenance["name"]) == ("release", "provenance")
    rego = release["policy"]["data"]
    # a child's record names no platforms; an index's names each with its outcomes, all passed
    assert "count(input.predicate.platforms) > 0" in rego
    assert 'input.predicate.platforms[j].smoke != "passed"' in rego
    assert 'input.predicate.platforms[j].gate != "passed"' in rego
    assert 'input.predicate.digest == concat(":", ["sha256", input.subject[i].digest.sha256])' in rego
    assert "buildDefinition.buildType" in provenance["policy"]["data"]
    assert [a["name"] for a in cip["authorities"]][-1].startswith("att-")  # its reasons are the ones reported


def test_rotation_lists_every_key_and_any_one_suffices(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, keys=2)
    pems = [p.read_text().strip() for p in sorted(tmp_path.glob("key*.pub"))]
    files = generated(config_path)

    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    signature_keys = [a["key"]["data"].strip() for a in cip["authorities"] if a["name"].startswith("sig-")]
    attestation_keys = [a["key"]["data"].strip() for a in cip["authorities"] if a["name"].startswith("att-")]
    assert signature_keys == pems and attestation_keys == pems
    assert [a["name"] for a in cip["authorities"]] == ["sig-release-2026", "sig-release-2027",
                                                        "idx-release-2026", "idx-release-2027",
                                                        "att-release-2026", "att-release-2027"]

    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    for attestors in [verify["attestors"]] + [a["attestors"] for a in verify["attestations"]]:
        assert len(attestors) == 1 and attestors[0]["count"] == 1
        assert [e["keys"]["publicKeys"].strip() for e in attestors[0]["entries"]] == pems

    ivp = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]
    assert [a["cosign"]["key"]["data"].strip() for a in ivp["attestors"]] == pems
    signature_check = ivp["validations"][0]["expression"]
    assert "[attestors.release_2026, attestors.release_2027]) > 0" in signature_check

    cluster_config = yaml.safe_load(webhook_documents(files)["ConfigMap"]["data"]["trust.yaml"])
    assert [k["pem"].strip() for k in cluster_config["keys"]] == pems


def test_no_transparency_log_is_consulted(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, keys=2))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    assert all("ctlog" not in a and "keyless" not in a for a in cip["authorities"])
    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert all(e["keys"]["rekor"] == {"ignoreTlog": True} for e in verify["attestors"][0]["entries"])
    ivp = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]
    assert all(a["cosign"]["ctlog"]["insecureIgnoreTlog"] for a in ivp["attestors"])


@pytest.mark.parametrize("mode, cip_mode, kyverno_action, ivp_actions", [
    ("enforce", "enforce", "Enforce", ["Deny"]),
    ("warn", "warn", "Audit", ["Audit", "Warn"]),
])
def test_mode_enforce_refuses_and_warn_only_reports(tmp_path: Path, mode: str, cip_mode: str,
                                                    kyverno_action: str, ivp_actions: list[str]) -> None:
    files = generated(write_config(tmp_path, mode=mode))
    assert document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]["mode"] == cip_mode
    kyverno = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]
    assert kyverno["validationFailureAction"] == kyverno_action
    assert kyverno["rules"][0]["verifyImages"][0]["failureAction"] == kyverno_action
    assert document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]["validationActions"] == ivp_actions


def test_image_globs_cover_tags_and_digests_of_the_configured_repositories(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    # registry.test is reached over https, so :443 is the same registry; 127.0.0.1 over http.
    assert [g["glob"] for g in cip["images"]] == [
        "registry.test/team/**:*", "registry.test/team/**@*", "registry.test:443/team/**:*",
        "registry.test:443/team/**@*", "127.0.0.1:5000/solo/*:*", "127.0.0.1:5000/solo/*@*"]
    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert verify["imageReferences"] == [
        "registry.test/team/*:*", "registry.test/team/*@*", "registry.test:443/team/*:*",
        "registry.test:443/team/*@*", "127.0.0.1:5000/solo/*:*", "127.0.0.1:5000/solo/*@*"]
    assert verify["mutateDigest"] is True and verify["verifyDigest"] is True and verify["required"] is True


def test_attestation_requirements_reach_every_policy(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path))
    types = [policies.PREDICATE_TYPES[n] for n in ("sbom", "vuln", "smoke", "gate")]
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    attesting = [a for a in cip["authorities"] if a["name"].startswith("att-")][0]
    assert [a["predicateType"] for a in attesting["attestations"]] == types
    smoke = attesting["attestations"][2]["policy"]["data"]
    assert 'input.predicate.status == "passed"' in smoke and "input.subject[i].digest.sha256" in smoke
    assert 'input.predicate.decision == "passed"' in attesting["attestations"][3]["policy"]["data"]
    # An attestation authority does not check the image's own signature: the policy asks for both.
    assert cip["policy"]["type"] == "rego" and "signed" in cip["policy"]["data"]

    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert [a["type"] for a in verify["attestations"]] == types
    assert verify["attestations"][2]["conditions"][0]["all"][0]["key"] == "{{ status }}"

    ivp = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]
    assert [a["intoto"]["type"] for a in ivp["attestations"]] == types
    severity_rule = ivp["validations"][-1]["expression"]
    assert "['HIGH', 'CRITICAL']" in severity_rule and "exceptions_applied" in severity_rule


def test_without_requirements_a_signature_alone_admits(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    assert [a["name"] for a in cip["authorities"]] == ["sig-release-2026"] and "policy" not in cip
    assert "attestations" not in document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert "attestations" not in document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]


def test_gate_passed_alone_still_requires_the_gate_attestation(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{gate_passed: true}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    assert [a["name"] for a in authority(cip, "att-")["attestations"]] == ["gate"]


def test_block_severity_alone_requires_the_vuln_report_and_a_passed_gate(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{block_severity: CRITICAL}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    attestations = authority(cip, "att-")["attestations"]
    assert [a["name"] for a in attestations] == ["vuln", "gate"]
    assert 'input.predicate.decision == "passed"' in attestations[1]["policy"]["data"]
    ivp = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]
    assert "['CRITICAL']" in ivp["validations"][-1]["expression"]


@pytest.mark.parametrize("require", ["{attestations: [provenance, release], gate_passed: true}",
                                     "{vex_current: true, gate_passed: true}"])
@pytest.mark.parametrize("name", sorted(CRD_OF))
def test_policies_requiring_provenance_or_a_current_vex_validate_against_their_crds(tmp_path: Path, name: str,
                                                                                    require: str) -> None:
    files = generated(write_config(tmp_path, require=require))
    jsonschema.validate(document(files, name), crd_schema(*CRD_OF[name]))


def test_required_provenance_must_be_imagebuilds_build_in_every_policy(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{attestations: [provenance]}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    [attestation] = authority(cip, "att-")["attestations"]
    assert attestation["predicateType"] == "https://slsa.dev/provenance/v1"
    assert ('input.predicate.buildDefinition.buildType == "https://imagebuild.dev/build/v1"'
            in attestation["policy"]["data"])

    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    [entry] = verify["attestations"]
    assert entry["type"] == "https://slsa.dev/provenance/v1"
    condition = entry["conditions"][0]["all"][0]
    assert (condition["key"], condition["value"]) == ("{{ buildDefinition.buildType }}",
                                                      "https://imagebuild.dev/build/v1")

    ivp = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]
    assert [a["intoto"]["type"] for a in ivp["attestations"]] == ["https://slsa.dev/provenance/v1"]
    assert any("attestations.provenance).buildDefinition.buildType == 'https://imagebuild.dev/build/v1'"
               in v["expression"] for v in ivp["validations"])


def test_without_a_provenance_requirement_no_policy_asks_for_it(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path))
    assert all("slsa.dev/provenance" not in text for text in files.values())


# --- the webhook's manifests -----------------------------------------------------------------


def test_webhook_runs_as_non_root_with_nothing_extra(tmp_path: Path) -> None:
    deployment = webhook_documents(generated(write_config(tmp_path)))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and "memory" in container["resources"]["limits"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
        assert container[probe]["httpGet"]["port"] == container["ports"][0]["name"]
    assert container["ports"][0]["containerPort"] == 9443
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_webhook_s_namespace_enforces_restricted_and_its_pod_meets_it(tmp_path: Path) -> None:
    docs = webhook_documents(generated(write_config(tmp_path)))
    labels = docs["Namespace"]["metadata"]["labels"]
    assert {k: v for k, v in labels.items() if k.startswith("pod-security.kubernetes.io/")} == {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest",
        "pod-security.kubernetes.io/warn": "restricted", "pod-security.kubernetes.io/warn-version": "latest",
        "pod-security.kubernetes.io/audit": "restricted", "pod-security.kubernetes.io/audit-version": "latest"}
    assert restricted_violations(docs["Deployment"]["spec"]["template"]["spec"]) == []


def test_the_restricted_checklist_names_what_a_pod_lacks(tmp_path: Path) -> None:
    pod = webhook_documents(generated(write_config(tmp_path)))["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    del container["securityContext"]["allowPrivilegeEscalation"]
    container["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    del pod["securityContext"]["seccompProfile"], container["securityContext"]["seccompProfile"]
    assert restricted_violations(pod) == [
        "volume host: hostPath", "webhook: allowPrivilegeEscalation is not false",
        "webhook: seccompProfile is not RuntimeDefault or Localhost", "webhook: capabilities do not drop ALL",
        "webhook: capabilities added"]


def test_two_replicas_spread_over_nodes_and_a_disruption_budget_keeps_one(tmp_path: Path) -> None:
    docs = webhook_documents(generated(write_config(tmp_path)))
    deployment, budget = docs["Deployment"], docs["PodDisruptionBudget"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert (budget["apiVersion"], budget["metadata"]["namespace"]) == ("policy/v1", "admit-ns")
    assert budget["spec"] == {"minAvailable": 1, "selector": deployment["spec"]["selector"]}
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["maxSkew"]) == ("kubernetes.io/hostname", 1)
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # a one-node cluster still runs both
    assert spread["labelSelector"]["matchLabels"].items() <= template_labels.items()
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}


def test_the_deployment_runs_the_image_it_is_given_and_the_configmap_names_the_same(tmp_path: Path) -> None:
    pinned = "registry.test/team/admission:2@sha256:" + "cd" * 32
    docs = webhook_documents(generated(write_config(tmp_path, image="registry.test/team/admission:2"),
                                       webhook_image=pinned))
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == pinned
    assert yaml.safe_load(docs["ConfigMap"]["data"]["trust.yaml"])["webhook"]["image"] == pinned


# --- Pod Security Admission labels for the workload namespaces ------------------------------


def test_listed_namespaces_are_labelled_for_pod_security_admission(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, more="namespaces:\n  - training\n"
                                                  "  - {name: serving, pod_security: baseline, version: v1.33}\n"))
    assert files[policies.NAMESPACES].startswith(f"{policies.GENERATED_HEADER} from trust.yaml;")
    namespaces = {d["metadata"]["name"]: d for d in yaml.safe_load_all(files[policies.NAMESPACES])}
    assert list(namespaces) == ["training", "serving"]
    assert all((d["apiVersion"], d["kind"]) == ("v1", "Namespace") for d in namespaces.values())
    for name, level, version in (("training", "restricted", "latest"), ("serving", "baseline", "v1.33")):
        labels = namespaces[name]["metadata"]["labels"]
        for mode in ("enforce", "warn", "audit"):
            assert labels[f"pod-security.kubernetes.io/{mode}"] == level
            assert labels[f"pod-security.kubernetes.io/{mode}-version"] == version
    # The webhook's namespace is labelled in webhook.yaml, once: no file declares a Namespace twice.
    assert "admit-ns" not in namespaces and webhook_documents(files)["Namespace"]["metadata"]["name"] == "admit-ns"


def test_without_namespaces_no_namespaces_file_is_written_and_a_stale_one_goes(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "cfg", image=None, more="namespaces: [training]\n")
    assert policies.NAMESPACES not in generated(write_config(tmp_path / "plain"))
    out = tmp_path / "out"
    assert placeholder_generate(config_path, out).returncode == 0
    assert (out / policies.NAMESPACES).is_file()
    write_config(tmp_path / "cfg", image=None)  # the list removed
    rerun = placeholder_generate(config_path, out)
    assert rerun.returncode == 0 and f"stale     {policies.NAMESPACES}" in rerun.stdout
    assert not (out / policies.NAMESPACES).exists()


def test_a_bad_namespaces_key_is_one_line_exit_2_and_nothing_written(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "cfg", more="namespaces:\n  - {name: training, pod_security: strict}\n")
    line = config_path.read_text().splitlines().index("  - {name: training, pod_security: strict}") + 1
    out = tmp_path / "out"
    result = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {config_path}:{line}: namespaces[0].pod_security: unknown level 'strict' (did you mean 'restricted'?) "
        "(one of privileged, baseline, restricted)"]
    assert not out.exists()


# --- the webhook's image, by digest ---------------------------------------------------------


def test_a_webhook_image_by_digest_is_verified_too_and_refused_writes_nothing(tmp_path: Path) -> None:
    """Outside the trust file's images, as the webhook would refuse it: no registry is asked to know that."""
    uncovered = "127.0.0.1:9/team/admission:1@sha256:" + "ef" * 32  # the discard port: nothing answers
    config_path, out = write_config(tmp_path / "cfg", image=uncovered), tmp_path / "out"
    line = next(n for n, text in enumerate(config_path.read_text().splitlines(), 1) if text.startswith("webhook:"))
    result = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out))
    assert result.returncode == 1 and not out.exists()
    assert result.stderr.strip().splitlines() == [
        f"error: generate: WebhookImageRefused: webhook.image {uncovered} ({config_path}:{line}) refused, as the "
        "webhook would refuse it: not covered by the policy: 127.0.0.1:9/team/admission matches none of its images "
        "(registry.test/team/**, 127.0.0.1:5000/solo/*)"]


def test_the_insecure_flag_writes_a_digest_unverified_with_a_warning_and_asks_no_registry(tmp_path: Path) -> None:
    unreachable = "127.0.0.1:9/team/admission:1@sha256:" + "ef" * 32
    out = tmp_path / "out"
    result = run_cli("policies", "generate", "--config", str(write_config(tmp_path / "cfg", image=unreachable)),
                     "--out", str(out), "--insecure-unverified-webhook-image")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"warning: webhook.image {unreachable} is NOT verified (--insecure-unverified-webhook-image): the "
        "webhook's Deployment runs it though no trusted key may vouch for it, and whoever can push to "
        "127.0.0.1:9/team/admission may have chosen it; sign it and generate again without the flag"]
    (container,) = webhook_documents({policies.WEBHOOK_MANIFESTS: (out / policies.WEBHOOK_MANIFESTS).read_text()})[
        "Deployment"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == unreachable


def test_keep_webhook_tag_is_refused_for_a_named_image(tmp_path: Path) -> None:
    """It writes the placeholder only: a tag kept unpinned and unverified is what anyone who can push it chooses."""
    config_path, out = write_config(tmp_path / "cfg", image="127.0.0.1:9/t/a:1"), tmp_path / "out"
    line = next(n for n, text in enumerate(config_path.read_text().splitlines(), 1) if text.startswith("webhook:"))
    result = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out), "--keep-webhook-tag")
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().splitlines() == [
        f"error: {config_path}:{line}: webhook.image: --keep-webhook-tag writes only the placeholder (a trust file "
        "naming no webhook image); 127.0.0.1:9/t/a:1 is verified and pinned: drop the flag"]


def test_a_webhook_image_that_is_no_reference_is_bad_input_naming_its_line(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "cfg", image="registry.test/Team/admission:1")
    line = next(n for n, text in enumerate(config_path.read_text().splitlines(), 1) if text.startswith("webhook:"))
    result = run_cli("policies", "generate", "--config", str(config_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    (message,) = result.stderr.strip().splitlines()
    assert message.startswith(f"error: {config_path}:{line}: webhook.image: not an image reference: "), message


def test_a_trust_file_naming_no_webhook_image_needs_keep_webhook_tag(tmp_path: Path) -> None:
    """which writes the placeholder as it is: no image of anyone's, nothing to resolve or verify."""
    config_path = write_config(tmp_path / "cfg")
    config_path.write_text(re.sub(r"^webhook:.*\n", "", config_path.read_text(), flags=re.M))
    out = tmp_path / "out"
    refused = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out))
    assert refused.returncode == 2 and not out.exists()
    assert refused.stderr.strip().splitlines() == [
        f"error: {config_path}: webhook.image: not set: name the webhook's image (a tag to pin, or by digest), "
        f"or pass --keep-webhook-tag for the placeholder {WebhookSettings().image}"]
    kept = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out), "--keep-webhook-tag")
    assert kept.returncode == 0, kept.stderr
    assert kept.stderr == "" and f"image: {WebhookSettings().image}\n" in (out / policies.WEBHOOK_MANIFESTS).read_text()


def test_webhook_serves_the_trust_config_with_tls_from_a_secret(tmp_path: Path) -> None:
    docs = webhook_documents(generated(write_config(tmp_path)))
    assert [d["kind"] for d in docs.values()] == ["Namespace", "ServiceAccount", "ConfigMap", "Deployment",
                                                  "PodDisruptionBudget", "Service", "MutatingWebhookConfiguration",
                                                  "ValidatingWebhookConfiguration"]
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == WEBHOOK_IMAGE
    args = container["args"]
    assert args[:2] == ["admission", "serve"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--port"] == "9443"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert flags["--trust"] == f"{mounts['config']}/trust.yaml"
    assert volumes["config"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert flags["--tls-cert"] == f"{mounts['tls']}/tls.crt" and flags["--tls-key"] == f"{mounts['tls']}/tls.key"
    assert volumes["tls"]["secret"]["secretName"] == "admit-tls"
    assert all(d["metadata"].get("namespace", "admit-ns") == "admit-ns" for d in docs.values()
               if d["kind"] not in ("Namespace", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"))
    service = docs["Service"]["spec"]
    assert service["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert service["ports"][0]["targetPort"] == "https"


def test_configmap_holds_a_config_the_webhook_loads_to_the_same_trust(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "src", keys=2)
    files = generated(config_path)
    mounted = tmp_path / "mounted" / "trust.yaml"
    mounted.parent.mkdir()
    mounted.write_text(webhook_documents(files)["ConfigMap"]["data"]["trust.yaml"])
    original, in_cluster = load_trust_config(config_path), load_trust_config(mounted)
    assert [(k.name, k.pem.strip()) for k in in_cluster.keys] == [(k.name, k.pem.strip()) for k in original.keys]
    assert in_cluster.images == original.images and in_cluster.require == original.require
    assert (in_cluster.mode, in_cluster.failure_policy, in_cluster.webhook) == \
        (original.mode, original.failure_policy, original.webhook)
    assert (in_cluster.signed_identity, in_cluster.namespaces) == (original.signed_identity, original.namespaces)


def test_the_configmap_keeps_signed_identity_and_the_namespaces(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "src", more="signed_identity: repository\nnamespaces: [training]\n")
    mounted = tmp_path / "mounted" / "trust.yaml"
    mounted.parent.mkdir()
    mounted.write_text(webhook_documents(generated(config_path))["ConfigMap"]["data"]["trust.yaml"])
    in_cluster = load_trust_config(mounted)
    assert in_cluster.signed_identity == "repository"  # the cluster's webhook is no looser than `verify`
    assert [n.name for n in in_cluster.namespaces] == ["training"]


@pytest.mark.parametrize("kind, path", [("ValidatingWebhookConfiguration", "/validate"),
                                        ("MutatingWebhookConfiguration", "/mutate")])
@pytest.mark.parametrize("failure_policy, expected", [("fail", "Fail"), ("ignore", "Ignore")])
def test_webhook_configurations(tmp_path: Path, failure_policy: str, expected: str, kind: str, path: str) -> None:
    docs = webhook_documents(generated(write_config(tmp_path, failure_policy=failure_policy)))
    assert docs[kind]["apiVersion"] == "admissionregistration.k8s.io/v1"
    (hook,) = docs[kind]["webhooks"]
    assert hook["failurePolicy"] == expected
    assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
    assert 1 <= hook["timeoutSeconds"] <= 30
    service = hook["clientConfig"]["service"]
    assert (service["namespace"], service["name"], service["path"], service["port"]) == (
        "admit-ns", "admit", path, 443)
    assert ("pods/ephemeralcontainers" in hook["rules"][0]["resources"]) and hook["rules"][0]["apiGroups"] == [""]
    covered = {(g, r) for rule in hook["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if set(rule["operations"]) == {"CREATE", "UPDATE"}}
    assert {("", "pods"), ("apps", "deployments"), ("apps", "statefulsets"), ("apps", "daemonsets"),
            ("batch", "jobs"), ("batch", "cronjobs")} <= covered
    assert docs["Deployment"]["spec"]["replicas"] >= 2


@pytest.mark.parametrize("kind", ["ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"])
def test_the_webhook_s_own_namespace_and_kube_system_never_wait_on_the_webhook(tmp_path: Path, kind: str) -> None:
    (hook,) = webhook_documents(generated(write_config(tmp_path)))[kind]["webhooks"]
    assert hook["namespaceSelector"] == {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["admit-ns", "kube-system"]}]}
    assert "objectSelector" not in hook  # nothing else is left out


@pytest.mark.parametrize("kind", ["ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"])
def test_ca_bundle_is_inlined_when_given_else_cert_manager_injects_it(tmp_path: Path, kind: str) -> None:
    config_path = write_config(tmp_path)
    without = webhook_documents(generated(config_path))[kind]
    assert "caBundle" not in without["webhooks"][0]["clientConfig"]
    assert without["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "admit-ns/admit-tls"
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    with_ca = webhook_documents(generated(config_path, ca_bundle=pem))[kind]
    assert base64.b64decode(with_ca["webhooks"][0]["clientConfig"]["caBundle"]) == pem


def test_the_mutating_webhook_is_the_validating_one_at_mutate_reinvoked_if_needed(tmp_path: Path) -> None:
    docs = webhook_documents(generated(write_config(tmp_path), ca_bundle=b"PEM"))
    (validating,) = docs["ValidatingWebhookConfiguration"]["webhooks"]
    (mutating,) = docs["MutatingWebhookConfiguration"]["webhooks"]
    assert mutating.pop("reinvocationPolicy") == "IfNeeded" and "reinvocationPolicy" not in validating
    assert mutating.pop("name") != validating.pop("name")
    assert mutating["clientConfig"]["service"].pop("path") == "/mutate"
    validating["clientConfig"]["service"].pop("path")
    # Same service, caBundle, namespace selector, rules (workloads included), failure policy, timeout.
    assert mutating == validating
    assert docs["MutatingWebhookConfiguration"]["metadata"] == docs["ValidatingWebhookConfiguration"]["metadata"]


# --- files, headers, determinism -------------------------------------------------------------


def test_same_config_gives_the_same_bytes_and_every_file_says_where_it_came_from(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, keys=2)
    first, second = generated(config_path), generated(config_path)
    assert first == second
    assert sorted(first) == sorted([*CRD_OF, policies.WEBHOOK_MANIFESTS])
    for text in first.values():
        assert text.startswith(f"{policies.GENERATED_HEADER} from trust.yaml;")


def test_generate_writes_then_check_passes_and_finds_drift(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "cfg", image=None)
    out = tmp_path / "out"
    written = placeholder_generate(config_path, out, "--format", "json")
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([*CRD_OF, policies.WEBHOOK_MANIFESTS])
    (out / "kustomization.yaml").write_text("resources: []\n")  # someone else's file: left alone

    clean = placeholder_generate(config_path, out, "--check")
    assert clean.returncode == 0, clean.stderr

    target = out / policies.KYVERNO_CLUSTER_POLICY
    target.write_text(target.read_text().replace("Enforce", "Audit"))
    drifted = placeholder_generate(config_path, out, "--check")
    assert drifted.returncode == 1
    assert f"changed   {policies.KYVERNO_CLUSTER_POLICY}" in drifted.stderr
    assert "Audit" in target.read_text()  # --check writes nothing

    rerun = placeholder_generate(config_path, out)
    assert rerun.returncode == 0 and "1 changed" in rerun.stdout
    assert (out / "kustomization.yaml").read_text() == "resources: []\n"


def test_committed_production_policies_are_up_to_date() -> None:
    """As CI checks them: policies/trust.yaml names no webhook image yet (its placeholder, like its key)."""
    result = run_cli("policies", "generate", "--check", "--keep-webhook-tag")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("content, message", [
    ("mode: block\n", "mode"),
    ("keys: []\n", "keys"),
])
def test_bad_config_is_one_line_exit_2_and_nothing_written(tmp_path: Path, content: str, message: str) -> None:
    config_path = write_config(tmp_path)
    text = config_path.read_text()
    key = content.split(":")[0]
    lines = [line for line in text.splitlines(keepends=True) if not line.startswith(f"{key}:")]
    if key == "keys":  # drop the key entries that followed `keys:` too
        lines = [line for line in lines if not line.startswith(("  - name", "    path"))]
    config_path.write_text(content + "".join(lines))
    out = tmp_path / "out"
    result = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert str(config_path) in result.stderr and message in result.stderr
    assert not out.exists()


def test_missing_config_is_exit_2(tmp_path: Path) -> None:
    result = run_cli("policies", "generate", "--config", str(tmp_path / "absent.yaml"), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_a_ca_bundle_that_is_not_pem_is_exit_2(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("not a certificate\n")
    result = run_cli("policies", "generate", "--config", str(write_config(tmp_path / "cfg")),
                     "--out", str(tmp_path / "out"), "--ca-bundle", str(bundle))
    assert result.returncode == 2 and "is not a PEM certificate bundle" in result.stderr
    assert not (tmp_path / "out").exists()


# --- every spelling the webhook reads as a covered image, against each generated policy ----------
#
# The admission controllers' matching, modelled on their sources (the Kyverno CLI is not built on
# these machines; policy-controller's own evaluator runs in tests/e2e/test_policy_tester.py):
# - Kyverno ClusterPolicy: ext/wildcard (github.com/IGLOU-EU/go-wildcard/v2: `*` any run, `.` and
#   `?` one character) against pkg/utils/image GetImageInfo(...).String();
# - Kyverno ImageValidatingPolicy: the CEL `ref.matches(RE2)` on the text as written;
# - policy-controller: pkg/apis/glob Match against go-containerregistry's Name(), then the text.

SPELLING_IMAGES = ["harbor.example.com/release/*", "docker.io/library/nginx", "docker.io/paddlepaddle/**",
                   "127.0.0.1:5000/solo/*"]
D = "sha256:" + "a" * 64
# canonical repository -> spellings the runtime pulls from the same place; "odd" ones (host case,
# zero-padded port) cannot be listed as globs or wildcards.
COVERED = {
    "harbor.example.com/release/paddle": {
        "exact": ["harbor.example.com/release/paddle", "harbor.example.com/release/paddle:3.3.1",
                  "harbor.example.com:443/release/paddle:3.3.1", "harbor.example.com/release/paddle:1@" + D,
                  "harbor.example.com:443/release/paddle@" + D],
        "odd": ["Harbor.Example.COM/release/paddle:1", "HARBOR.EXAMPLE.COM:443/release/paddle:1@" + D,
                "harbor.example.com:0443/release/paddle@" + D, "harbor.EXAMPLE.com/release/paddle"]},
    "docker.io/library/nginx": {
        "exact": ["nginx", "nginx:1.27", "nginx@" + D, "library/nginx:1", "docker.io/nginx", "docker.io/library/nginx:1",
                  "index.docker.io/nginx:1", "index.docker.io/library/nginx@" + D, "registry-1.docker.io/library/nginx:1",
                  "docker.io:443/library/nginx", "index.docker.io:443/nginx:1"],
        "odd": ["Docker.IO/library/nginx:1", "INDEX.docker.io/nginx", "docker.io:00443/nginx"]},
    "docker.io/paddlepaddle/paddle": {
        "exact": ["paddlepaddle/paddle:3.0.0", "docker.io/paddlepaddle/paddle", "index.docker.io/paddlepaddle/paddle@" + D],
        "odd": ["DOCKER.IO/paddlepaddle/paddle:3.0.0"]},
    "127.0.0.1:5000/solo/app": {"exact": ["127.0.0.1:5000/solo/app:1", "127.0.0.1:5000/solo/app@" + D], "odd": []},
}
UNCOVERED = ["harbor.example.com/other/paddle:1", "harbor.example.com:8443/release/paddle:1",
             "evil.example.com/release/paddle:1", "harbor.example.com.evil.io/release/paddle:1",
             "nginx2:1", "docker.io/library/nginx2",
             "paddlepaddle2/paddle", "quay.io/nginx:1", "127.0.0.1:5001/solo/app:1", "127.0.0.1:443/solo/app",
             "localhost:5000/solo/app", "my.registry/paddlepaddle/paddle:1", "library/nginx/x:1"]
# (harbor.example.com/release/a/b is left out: Kyverno's `*` crosses `/`, so its patterns are wider.)


def kyverno_wildcard(pattern: str, text: str) -> bool:
    regex = "".join(".*" if c == "*" else "." if c in "?." else re.escape(c) for c in pattern)
    return re.fullmatch(regex, text, re.S) is not None


def kyverno_image(raw: str, *, library: bool, mutation: bool = True) -> str:
    """GetImageInfo(raw).String(): docker.io added when the first segment is no host, host case
    kept, :latest when neither tag nor digest; newer Kyverno adds library/ to one-part paths."""
    first, slash, _ = raw.partition("/")
    implicit = not slash or not (re.search(r"[.:]", first) or first == "localhost" or first != first.lower())
    parts = reference.split(f"docker.io/{raw}" if implicit else raw)
    path = f"library/{parts.path}" if library and "/" not in parts.path else parts.path
    name = path if implicit and not mutation else f"{parts.host}/{path}"
    return f"{name}@{parts.digest}" if parts.digest else f"{name}:{parts.tag or 'latest'}"


def ggcr_name(raw: str) -> str:
    """go-containerregistry's Reference.Name(): a first segment with '.' or ':' is the registry, else
    index.docker.io; docker.io -> index.docker.io; library/ there; :latest; a digest drops the tag."""
    first, slash, rest = raw.partition("/")
    host, name = (first, rest) if slash and re.search(r"[.:]", first) else ("index.docker.io", raw)
    host = "index.docker.io" if host == "docker.io" else host
    parts = reference.split(name)
    path = f"library/{parts.path}" if host == "index.docker.io" and "/" not in parts.path else parts.path
    return f"{host}/{path}@{parts.digest}" if parts.digest else f"{host}/{path}:{parts.tag or 'latest'}"


def policy_controller_matches(globs: list[str], raw: str) -> bool:
    def compiled(glob: str) -> re.Pattern[str]:
        assert re.fullmatch(r"[a-zA-Z0-9\-_:/*.@]+", glob), glob  # pkg/apis/glob validGlob
        return re.compile("^" + re.escape(glob).replace(r"\*\*", "#").replace(r"\*", "[^/]*").replace("#", ".*") + "$")

    name = ggcr_name(raw)
    return any(compiled(g).match(name) or compiled(g).match(raw) for g in globs)


@dataclass(frozen=True)
class Generated:
    cip_globs: list[str]
    verify_patterns: list[str]
    deny_regexes: tuple[str, str]  # (any case, exact) of the ClusterPolicy's spelling rule
    ivp_regex: str

    def kyverno_verifies(self, raw: str, **how: bool) -> bool:
        return any(kyverno_wildcard(p, kyverno_image(raw, **how)) for p in self.verify_patterns)

    def kyverno_denies(self, raw: str) -> bool:
        any_case, exact = self.deny_regexes
        return bool(re.search(any_case, raw)) and not re.search(exact, raw)

    def ivp_matches(self, raw: str) -> bool:
        return re.search(self.ivp_regex, raw) is not None


@pytest.fixture(scope="module")
def spelled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Generated, Any]:
    folder = tmp_path_factory.mktemp("spellings")
    (folder / "k.pub").write_text(public_pem())
    globs = "".join(f"  - \"{g}\"\n" for g in SPELLING_IMAGES)
    path = folder / "trust.yaml"
    path.write_text(f"schema: 1\nkeys:\n  - name: k\n    path: k.pub\nimages:\n{globs}")
    files = generated(path)
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    rules = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"]
    conditions = rules[1]["validate"]["foreach"][0]["deny"]["conditions"]["all"]
    regexes = tuple(re.fullmatch(r"\{\{ regex_match\('(.*)', element\.image\) \}\}", c["key"]).group(1)  # type: ignore[union-attr]
                    for c in conditions)
    expression = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]["matchImageReferences"][0]["expression"]
    ivp = re.fullmatch(r"ref\.matches\('(.*)'\)", expression).group(1)  # type: ignore[union-attr]
    assert [c["value"] for c in conditions] == [True, False] and "\\" not in "".join(regexes) + ivp
    return Generated([g["glob"] for g in cip["images"]], rules[0]["verifyImages"][0]["imageReferences"],
                     (regexes[0], regexes[1]), ivp), load_trust_config(path)


SPELLINGS = [(canonical, kind, raw) for canonical, kinds in COVERED.items() for kind, raws in kinds.items() for raw in raws]


@pytest.mark.parametrize("canonical, kind, raw", SPELLINGS)
def test_every_spelling_of_a_covered_image_is_verified_or_refused_by_every_policy(
        spelled: tuple[Generated, Any], canonical: str, kind: str, raw: str) -> None:
    policy, config = spelled
    # The webhook reads it as the covered image (and so verifies it).
    ref = reference.parse(raw)
    assert ref.canonical_name == canonical and config.covers(ref.canonical_name)
    # The ImageValidatingPolicy matches every spelling, host in any case: Kyverno verifies it.
    assert policy.ivp_matches(raw)
    if kind == "exact":
        # policy-controller and the ClusterPolicy's verifyImages match it (Kyverno old and new,
        # and with enableDefaultRegistryMutation off); the spelling rule lets it through.
        assert policy_controller_matches(policy.cip_globs, raw), ggcr_name(raw)
        for how in ({"library": True}, {"library": False}, {"library": True, "mutation": False},
                    {"library": False, "mutation": False}):
            assert policy.kyverno_verifies(raw, **how), (kyverno_image(raw, **how), how)
        assert not policy.kyverno_denies(raw)
    else:
        # No glob can list it: policy-controller matches none (no-match-policy deny refuses it),
        # and the ClusterPolicy's spelling rule refuses it.
        assert not policy_controller_matches(policy.cip_globs, raw)
        assert policy.kyverno_denies(raw)


@pytest.mark.parametrize("raw", UNCOVERED)
def test_images_outside_the_globs_are_left_to_other_policies(spelled: tuple[Generated, Any], raw: str) -> None:
    policy, config = spelled
    assert not config.covers(reference.parse(raw).canonical_name)
    assert not policy_controller_matches(policy.cip_globs, raw)
    assert not any(policy.kyverno_verifies(raw, library=lib) for lib in (True, False))
    assert not policy.kyverno_denies(raw) and not policy.ivp_matches(raw)


def test_the_old_exact_spelling_patterns_let_the_other_spellings_through(spelled: tuple[Generated, Any]) -> None:
    """The defect: patterns from the glob as written missed :443, docker.io's other names and `nginx`."""
    old = ["harbor.example.com/release/*:*", "docker.io/library/nginx:*"]
    escaped = ["harbor.example.com:443/release/paddle:1", "index.docker.io/library/nginx:1", "docker.io/nginx:1"]
    assert not any(kyverno_wildcard(p, kyverno_image(raw, library=False)) for raw in escaped for p in old)
    policy, _ = spelled
    assert all(policy.kyverno_verifies(raw, library=False) for raw in escaped)


def test_kyverno_models_agree_with_kyvernos_own_examples() -> None:
    # pkg/utils/image/infos_test.go (Kyverno before library/ was added) and go-wildcard's rules.
    assert kyverno_image("nginx", library=False) == "docker.io/nginx:latest"
    assert kyverno_image("localhost:4443/test/nginx", library=False) == "localhost:4443/test/nginx:latest"
    assert kyverno_image("test/nginx", library=False, mutation=False) == "test/nginx:latest"
    assert kyverno_image("docker.io/test/centos@" + D, library=False) == "docker.io/test/centos@" + D
    assert kyverno_wildcard("a.b*", "aXb/c:d") and not kyverno_wildcard("a/b:*", "A/b:1")
    assert ggcr_name("ubuntu") == "index.docker.io/library/ubuntu:latest"
    assert ggcr_name("docker.io/user/app@" + D) == "index.docker.io/user/app@" + D


def test_a_glob_host_is_normalised_and_only_https_hosts_get_443() -> None:
    assert [str(s) for s in policies.spellings("Harbor.Example.com:443/p/*")] == [
        "harbor.example.com/p/*", "harbor.example.com:443/p/*"]
    assert [str(s) for s in policies.spellings("localhost:5000/p/*")] == ["localhost:5000/p/*"]
    assert [str(s) for s in policies.spellings("**")] == ["**"]
    # A hostless spelling never starts a Kyverno pattern with a wildcard (it would cover every registry).
    assert not [p for p in policies.kyverno_patterns(["docker.io/**", "*/library/*"]) if p.startswith("*:")]


# --- require.vex_current ---------------------------------------------------------------------------


def test_vex_current_judges_each_statement_s_last_day_and_image_at_admission(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{vex_current: true}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    [entry] = authority(cip, "att-")["attestations"]
    assert (entry["name"], entry["predicateType"]) == ("openvex", "https://openvex.dev/ns/v0.2.0")
    rego = entry["policy"]["data"]
    assert entry["policy"]["type"] == "rego" and rego.startswith("package sigstore\n")
    # Today is the admission's (the rego's clock), the last day counts until UTC midnight after it.
    assert 'time.parse_ns("2006-01-02", s["imagebuild:expires"]) + 86400000000000' in rego
    assert "time.now_ns() <" in rego and "not stale" in rego
    # Every statement's one product is this very image: the signed subject's digest.
    assert "@sha256%3A\", input.subject[j].digest.sha256" in rego and "not elsewhere" in rego

    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    [attestation] = verify["attestations"]
    [condition] = attestation["conditions"][0]["all"]
    assert attestation["type"] == "https://openvex.dev/ns/v0.2.0"
    assert (condition["operator"], condition["value"]) == ("Equals", 0)
    assert condition["key"] == ("{{ length(statements[?!time_before(time_now_utc(), time_add(time_parse("
                                "'2006-01-02', \"imagebuild:expires\"), '24h'))]) }}")


def test_an_openvex_attestation_required_without_vex_current_only_needs_to_be_there(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{attestations: [openvex]}"))
    [entry] = authority(document(files, policies.CLUSTER_IMAGE_POLICY)["spec"], "att-")["attestations"]
    assert entry == {"name": "openvex", "predicateType": "https://openvex.dev/ns/v0.2.0"}
    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert "conditions" not in verify["attestations"][0]
    assert all("time_now_utc" not in text and "time.now_ns" not in text for text in files.values())


def test_the_kyverno_files_say_what_of_vex_current_they_cannot_check(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{vex_current: true}"))
    assert "this very digest is not checked here" in files[policies.KYVERNO_CLUSTER_POLICY]
    assert "only that the openvex attestation is there" in files[policies.KYVERNO_IMAGE_VALIDATING_POLICY]
    without = generated(write_config(tmp_path / "without", require="{attestations: [openvex]}"))
    assert all("vex_current" not in text.split("\n---\n")[0] for name, text in without.items()
               if name != policies.WEBHOOK_MANIFESTS)
