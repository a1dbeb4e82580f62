"""imagebuild policies generate: CRD-valid policies, rotation, modes, the webhook's manifests, drift."""
from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild import policies
from imagebuild.trust import load_trust_config
from tests.conftest import run_imagebuild
from tests.crd_schema import crd_schema

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


def write_config(folder: Path, *, keys: int = 1, mode: str = "enforce", failure_policy: str = "fail",
                 require: str = "{attestations: [sbom, vuln, smoke, gate], smoke_passed: true, gate_passed: true, "
                                "block_severity: HIGH}") -> Path:
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
        "webhook: {namespace: admit-ns, name: admit, image: \"registry.test/team/admission:1\", port: 9443}\n")
    return path


def generated(config_path: Path, ca_bundle: bytes | None = None) -> dict[str, str]:
    config = load_trust_config(config_path)
    return {f.name: f.text for f in policies.generate(config, policies.Options("trust.yaml", ca_bundle))}


def document(files: dict[str, str], name: str) -> dict[str, Any]:
    return yaml.safe_load(files[name])


def webhook_documents(files: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(files[policies.WEBHOOK_MANIFESTS])}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_imagebuild(*args, cwd=ROOT)


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


def test_rotation_lists_every_key_and_any_one_suffices(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, keys=2)
    pems = [p.read_text().strip() for p in sorted(tmp_path.glob("key*.pub"))]
    files = generated(config_path)

    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    signature_keys = [a["key"]["data"].strip() for a in cip["authorities"] if a["name"].startswith("sig-")]
    attestation_keys = [a["key"]["data"].strip() for a in cip["authorities"] if a["name"].startswith("att-")]
    assert signature_keys == pems and attestation_keys == pems
    assert [a["name"] for a in cip["authorities"]] == ["sig-release-2026", "sig-release-2027",
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
    assert [g["glob"] for g in cip["images"]] == [
        "registry.test/team/**:*", "registry.test/team/**@*", "127.0.0.1:5000/solo/*:*", "127.0.0.1:5000/solo/*@*"]
    verify = document(files, policies.KYVERNO_CLUSTER_POLICY)["spec"]["rules"][0]["verifyImages"][0]
    assert verify["imageReferences"] == [
        "registry.test/team/*:*", "registry.test/team/*@*", "127.0.0.1:5000/solo/*:*", "127.0.0.1:5000/solo/*@*"]
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
    assert [a["name"] for a in cip["authorities"][1]["attestations"]] == ["gate"]


def test_block_severity_alone_requires_the_vuln_report_and_a_passed_gate(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{block_severity: CRITICAL}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    attestations = cip["authorities"][1]["attestations"]
    assert [a["name"] for a in attestations] == ["vuln", "gate"]
    assert 'input.predicate.decision == "passed"' in attestations[1]["policy"]["data"]
    ivp = document(files, policies.KYVERNO_IMAGE_VALIDATING_POLICY)["spec"]
    assert "['CRITICAL']" in ivp["validations"][-1]["expression"]


@pytest.mark.parametrize("name", sorted(CRD_OF))
def test_policies_requiring_provenance_validate_against_their_crds(tmp_path: Path, name: str) -> None:
    files = generated(write_config(tmp_path, require="{attestations: [provenance, release], gate_passed: true}"))
    jsonschema.validate(document(files, name), crd_schema(*CRD_OF[name]))


def test_required_provenance_must_be_imagebuilds_build_in_every_policy(tmp_path: Path) -> None:
    files = generated(write_config(tmp_path, require="{attestations: [provenance]}"))
    cip = document(files, policies.CLUSTER_IMAGE_POLICY)["spec"]
    [attestation] = cip["authorities"][1]["attestations"]
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


def test_webhook_serves_the_trust_config_with_tls_from_a_secret(tmp_path: Path) -> None:
    docs = webhook_documents(generated(write_config(tmp_path)))
    assert [d["kind"] for d in docs.values()] == ["Namespace", "ServiceAccount", "ConfigMap", "Deployment",
                                                  "Service", "ValidatingWebhookConfiguration"]
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.test/team/admission:1"
    args = container["args"]
    assert args[:2] == ["admission", "serve"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--port"] == "9443"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert flags["--config"] == f"{mounts['config']}/trust.yaml"
    assert volumes["config"]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert flags["--tls-cert"] == f"{mounts['tls']}/tls.crt" and flags["--tls-key"] == f"{mounts['tls']}/tls.key"
    assert volumes["tls"]["secret"]["secretName"] == "admit-tls"
    assert all(d["metadata"].get("namespace", "admit-ns") == "admit-ns" for d in docs.values()
               if d["kind"] not in ("Namespace", "ValidatingWebhookConfiguration"))
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


@pytest.mark.parametrize("failure_policy, expected", [("fail", "Fail"), ("ignore", "Ignore")])
def test_validating_webhook_configuration(tmp_path: Path, failure_policy: str, expected: str) -> None:
    docs = webhook_documents(generated(write_config(tmp_path, failure_policy=failure_policy)))
    (hook,) = docs["ValidatingWebhookConfiguration"]["webhooks"]
    assert hook["failurePolicy"] == expected
    assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
    assert 1 <= hook["timeoutSeconds"] <= 30
    service = hook["clientConfig"]["service"]
    assert (service["namespace"], service["name"], service["path"]) == ("admit-ns", "admit", "/validate")
    covered = {(g, r) for rule in hook["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if set(rule["operations"]) == {"CREATE", "UPDATE"}}
    assert {("", "pods"), ("apps", "deployments"), ("apps", "statefulsets"), ("apps", "daemonsets"),
            ("batch", "jobs"), ("batch", "cronjobs")} <= covered
    # The webhook's own namespace never waits on the webhook.
    assert "admit-ns" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert docs["Deployment"]["spec"]["replicas"] >= 2


def test_ca_bundle_is_inlined_when_given_else_cert_manager_injects_it(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    without = webhook_documents(generated(config_path))["ValidatingWebhookConfiguration"]
    assert "caBundle" not in without["webhooks"][0]["clientConfig"]
    assert without["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "admit-ns/admit-tls"
    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    with_ca = webhook_documents(generated(config_path, ca_bundle=pem))["ValidatingWebhookConfiguration"]
    assert base64.b64decode(with_ca["webhooks"][0]["clientConfig"]["caBundle"]) == pem


# --- files, headers, determinism -------------------------------------------------------------


def test_same_config_gives_the_same_bytes_and_every_file_says_where_it_came_from(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, keys=2)
    first, second = generated(config_path), generated(config_path)
    assert first == second
    assert sorted(first) == sorted([*CRD_OF, policies.WEBHOOK_MANIFESTS])
    for text in first.values():
        assert text.startswith(f"{policies.GENERATED_HEADER} from trust.yaml;")


def test_generate_writes_then_check_passes_and_finds_drift(tmp_path: Path) -> None:
    config_path = write_config(tmp_path / "cfg")
    out = tmp_path / "out"
    written = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out), "--format", "json")
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([*CRD_OF, policies.WEBHOOK_MANIFESTS])
    (out / "kustomization.yaml").write_text("resources: []\n")  # someone else's file: left alone

    clean = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out), "--check")
    assert clean.returncode == 0, clean.stderr

    target = out / policies.KYVERNO_CLUSTER_POLICY
    target.write_text(target.read_text().replace("Enforce", "Audit"))
    drifted = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out), "--check")
    assert drifted.returncode == 1
    assert f"changed   {policies.KYVERNO_CLUSTER_POLICY}" in drifted.stderr
    assert "Audit" in target.read_text()  # --check writes nothing

    rerun = run_cli("policies", "generate", "--config", str(config_path), "--out", str(out))
    assert rerun.returncode == 0 and "1 changed" in rerun.stdout
    assert (out / "kustomization.yaml").read_text() == "resources: []\n"


def test_committed_production_policies_are_up_to_date() -> None:
    result = run_cli("policies", "generate", "--check")
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
