"""The trust file: which keys, which images, which attestations. Untrusted input, one-line errors."""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from imagebuild.config.trust import (
    FailurePolicy,
    Mode,
    QuarantineSource,
    WorkloadNamespace,
    glob_matches,
    load_trust_config,
    trust_config_for_keys,
)
from imagebuild.core.source import InputError


def public_pem(private) -> str:
    return private.public_key().public_bytes(serialization.Encoding.PEM,
                                             serialization.PublicFormat.SubjectPublicKeyInfo).decode()


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, private in (("old", ec.generate_private_key(ec.SECP256R1())), ("new", ed25519.Ed25519PrivateKey.generate())):
        out[name] = tmp_path / f"{name}.pub"
        out[name].write_text(public_pem(private))
    return out


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trust.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, expected: str) -> str:
    """The one-line InputError that loading `path` raises, which must say `expected`."""
    with pytest.raises(InputError, match=re.escape(expected)) as caught:
        load_trust_config(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_full_configuration_reads_back_as_written(tmp_path, keys):
    config = load_trust_config(write(tmp_path, """\
        schema: 1
        mode: warn
        keys:
          - {name: old, path: old.pub}
          - {name: new, path: new.pub}
        images: ["registry.example.com/paddle/**"]
        require: {attestations: [sbom], smoke_passed: true, block_severity: high}
        failure_policy: ignore
        cache_ttl_seconds: 5
        webhook: {namespace: admission, port: 9443}
    """))
    assert config.mode is Mode.WARN and config.failure_policy is FailurePolicy.IGNORE
    assert [k.name for k in config.keys] == ["old", "new"]
    assert config.keys[0].pem == keys["old"].read_text()
    assert config.keys[0].source == str(tmp_path / "old.pub")
    # Content requirements bring the attestations they read: smoke, vuln, and gate for its exceptions.
    assert config.require.attestations == ("sbom", "smoke", "vuln", "gate")
    assert config.require.block_severity == "HIGH"
    assert (config.cache_ttl_seconds, config.webhook.namespace, config.webhook.port) == (5, "admission", 9443)


def test_the_example_configuration_is_valid():
    config = load_trust_config(Path(__file__).parent.parent / "examples/local/trust.yaml")
    assert config.covers("127.0.0.1:5000/imagebuild/paddle")
    assert set(config.require.attestations) == {"sbom", "vuln", "smoke", "gate"}


def test_provenance_and_the_release_record_can_be_required(tmp_path, keys):
    config = load_trust_config(write(tmp_path, """\
        keys: [{name: old, path: old.pub}]
        images: ["**"]
        require: {attestations: [provenance, release], gate_passed: true}
        """))
    assert config.require.attestations == ("provenance", "release", "gate")


def test_a_misspelt_provenance_requirement_is_refused_with_the_right_word(tmp_path, keys):
    message = error_of(write(tmp_path, "keys:\n  - {name: a, path: old.pub}\nimages: ['**']\n"
                                       "require: {attestations: [provenence]}\n"),
                       "unknown attestation 'provenence' (did you mean 'provenance'?)")
    assert message.startswith(f"{tmp_path / 'trust.yaml'}:4:"), message


def test_an_inline_key_is_accepted(tmp_path, keys):
    pem = textwrap.indent(keys["old"].read_text(), "      ")
    config = load_trust_config(write(tmp_path, f"keys:\n  - name: k\n    pem: |\n{pem}images: ['**']\n"))
    assert config.keys[0].source == "inline" and "BEGIN PUBLIC KEY" in config.keys[0].pem


@pytest.mark.parametrize(("pattern", "repository", "matches"), [
    ("127.0.0.1:5000/imagebuild/**", "127.0.0.1:5000/imagebuild/paddle", True),
    ("127.0.0.1:5000/imagebuild/**", "127.0.0.1:5000/imagebuild/a/b/c", True),
    ("127.0.0.1:5000/imagebuild/**", "127.0.0.1:5000/imagebuildx/paddle", False),
    ("127.0.0.1:5000/imagebuild/**", "127.0.0.1:5001/imagebuild/paddle", False),
    ("registry.example.com/*/paddle", "registry.example.com/team/paddle", True),
    ("registry.example.com/*/paddle", "registry.example.com/a/b/paddle", False),
    ("registry.example.com/paddle", "registry.example.com/paddle", True),
    ("registry.example.com/paddle", "registry.example.com/paddle-evil", False),
    ("registry.example.com/pad.le", "registry.example.com/padXle", False),  # dots are literal
])
def test_globs_cover_repositories(pattern, repository, matches):
    assert glob_matches(pattern, repository) is matches


@pytest.mark.parametrize(("body", "line", "expected"), [
    ("images: ['**']\n", 1, "missing required key 'keys'"),
    ("keys: []\nimages: ['**']\n", 1, "keys: must not be empty"),
    ("keys:\n  - {name: a, path: old.pub}\n  - {name: a, path: new.pub}\nimages: ['**']\n", 3, "duplicate key name"),
    ("keys:\n  - {name: a}\nimages: ['**']\n", 2, "exactly one of 'path'"),
    ("keys:\n  - {name: a, path: missing.pub}\nimages: ['**']\n", 2, "public key file not found"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['reg.io/x:1.0']\n", 3, "leave out tags"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['reg.io/x y']\n", 3, "not a repository glob"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['**']\nmode: enforcing\n", 4, "unknown value 'enforcing'"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['**']\nrequire: {attestations: [sbom, slsa]}\n", 4, "unknown attestation 'slsa'"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['**']\nrequire: {block_severity: urgent}\n", 4,
     "unknown severity 'urgent'"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['**']\nfailure_policy: maybe\n", 4, "one of fail, ignore"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['**']\nwebhook: {name: Bad_Name}\n", 4, "not a Kubernetes name"),
    ("keys:\n  - {name: a, path: old.pub}\nimages: ['**']\nkeyz: 1\n", 4, "keyz: unknown key (did you mean 'keys'?)"),
    ("schema: 2\nkeys:\n  - {name: a, path: old.pub}\nimages: ['**']\n", 1, "unsupported schema 2"),
])
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, keys, body, line, expected):
    message = error_of(write(tmp_path, body), expected)
    assert message.startswith(f"{tmp_path / 'trust.yaml'}:{line}:"), message


def test_a_private_key_is_refused_and_never_echoed(tmp_path):
    private = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    (tmp_path / "oops.pub").write_text(private)
    message = error_of(write(tmp_path, "keys:\n  - {name: a, path: oops.pub}\nimages: ['**']\n"),
                       "keys[0].path: this is a private key; give the public key (cosign.pub)")
    body = "".join(private.splitlines()[1:-1])
    assert body[:40] not in message


def test_garbage_instead_of_a_key_is_refused(tmp_path):
    (tmp_path / "bad.pub").write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    error_of(write(tmp_path, "keys:\n  - {name: a, path: bad.pub}\nimages: ['**']\n"),
             "keys[0].path: not a PEM public key (expected -----BEGIN PUBLIC KEY-----)")


def test_ad_hoc_configuration_from_key_files(keys):
    config = trust_config_for_keys([keys["old"], keys["new"]])
    assert [k.name for k in config.keys] == ["old.pub", "new.pub"]
    assert config.covers("anything.example.com/x/y") and config.require.attestations == ()


def test_ad_hoc_configuration_refuses_a_missing_key_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        trust_config_for_keys([tmp_path / "nope.pub"])


def test_a_private_key_given_as_the_trust_file_is_not_echoed(tmp_path):
    private = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    path = tmp_path / "trust.yaml"
    path.write_text(private)
    message = error_of(path, "expected a mapping, got PEM data (not shown)")
    assert private.splitlines()[1][:20] not in message


def test_the_quarantine_source_is_optional_and_reads_back_as_written(tmp_path, keys):
    base = "keys: [{name: old, path: old.pub}]\nimages: ['**']\n"
    assert load_trust_config(write(tmp_path, base)).quarantine is None
    config = load_trust_config(write(tmp_path, base + "quarantine: {registry: 'harbor.example.com:443', "
                                                      "repository: paddle/rollout-state}\n"))
    assert config.quarantine == QuarantineSource("harbor.example.com:443", "paddle/rollout-state", 10)
    config = load_trust_config(write(tmp_path, base + "quarantine: {registry: h.example, repository: s, "
                                                      "cache_ttl_seconds: 0}\n"))
    assert config.quarantine is not None and config.quarantine.cache_ttl_seconds == 0


@pytest.mark.parametrize(("value", "expected"), [
    ("{registry: 'h/x', repository: s}", "quarantine.registry: 'h/x' is not a registry host[:port]"),
    ("{registry: h, repository: '../s'}", "quarantine.repository: '../s' is not a repository name"),
    ("{registry: h}", "quarantine: missing required key 'repository'"),
    ("{registry: h, repository: s, cache_ttl_seconds: 99999}", "quarantine.cache_ttl_seconds: must be at most 3600, got 99999"),
    ("{registry: h, repository: s, tag: x}", "quarantine.tag: unknown key"),
])
def test_a_bad_quarantine_source_is_one_line_naming_its_key(tmp_path, keys, value, expected):
    message = error_of(write(tmp_path, f"keys: [{{name: old, path: old.pub}}]\nimages: ['**']\nquarantine: {value}\n"),
                       expected)
    assert message.startswith(f"{tmp_path / 'trust.yaml'}:3"), message


def test_workload_namespaces_are_names_or_entries_restricted_at_the_latest_version_by_default(tmp_path, keys):
    base = "keys: [{name: old, path: old.pub}]\nimages: ['**']\n"
    assert load_trust_config(write(tmp_path, base)).namespaces == ()
    config = load_trust_config(write(tmp_path, base + textwrap.dedent("""\
        namespaces:
          - training
          - {name: serving, pod_security: baseline, version: v1.33}
          - {name: notebooks, pod_security: privileged}
        """)))
    assert config.namespaces == (WorkloadNamespace("training", "restricted", "latest"),
                                 WorkloadNamespace("serving", "baseline", "v1.33"),
                                 WorkloadNamespace("notebooks", "privileged", "latest"))


@pytest.mark.parametrize(("value", "line", "expected"), [
    ("[Training]", 3, "namespaces[0]: 'Training' is not a Kubernetes name"),
    ("[kube-system]", 3, "namespaces[0]: 'kube-system' is one of Kubernetes' own namespaces"),
    ("[ok, imagebuild-system]", 3, "namespaces[1]: 'imagebuild-system' is the webhook's own namespace"),
    ("\n  - a\n  - a", 5, "namespaces[1]: 'a' is listed twice"),
    ("\n  - {name: a, pod_security: strict}", 4,
     "namespaces[0].pod_security: unknown level 'strict' (did you mean 'restricted'?) (one of privileged, baseline, restricted)"),
    ("\n  - {name: a, version: '1.30'}", 4, "namespaces[0].version: '1.30' is not a Pod Security version"),
    ("\n  - {name: a, level: baseline}", 4, "namespaces[0].level: unknown key"),
    ("\n  - {pod_security: baseline}", 4, "namespaces[0]: missing required key 'name'"),
    ("training", 3, "namespaces: expected a list"),
    ("[[a]]", 3, "namespaces[0]: expected a string, got a list"),
])
def test_a_bad_namespace_entry_is_one_line_naming_file_line_and_key(tmp_path, keys, value, line, expected):
    message = error_of(write(tmp_path, f"keys: [{{name: old, path: old.pub}}]\nimages: ['**']\nnamespaces: {value}\n"),
                       expected)
    assert message.startswith(f"{tmp_path / 'trust.yaml'}:{line}: "), message


def test_the_line_naming_the_webhook_image_is_kept_for_the_command_that_resolves_it(tmp_path, keys):
    base = "keys: [{name: old, path: old.pub}]\nimages: ['**']\n"
    config = load_trust_config(write(tmp_path, base + "webhook:\n  name: hook\n  image: r.example/hook:1\n"))
    assert (config.webhook.image, config.webhook.image_line) == ("r.example/hook:1", 5)
    assert load_trust_config(write(tmp_path, base)).webhook.image_line is None  # the placeholder, not named
