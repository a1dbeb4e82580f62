"""`imagebuild sign` without a registry: the cosign command lines it builds, its checks of the key options."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from imagebuild.core.runner import ToolMissing
from imagebuild.core.source import InputError
from imagebuild.trust import attest, sign

from .conftest import REPO_ROOT, run_imagebuild
from .test_scan_units import versions_env

DIGEST = "sha256:" + "d" * 64
LOCAL = f"127.0.0.1:5000/imagebuild-example/paddle@{DIGEST}"
REMOTE = f"registry.example.com/ml/paddle@{DIGEST}"
COSIGN = "/opt/imagebuild-tools/bin/cosign"


def test_the_pinned_cosign_is_the_one_bootstrap_installs():
    assert sign.COSIGN_VERSION == versions_env()["COSIGN_VERSION"]


def stand_in(tmp_path: Path, answer: str) -> Path:
    """An executable that prints ANSWER whatever it is asked (as `cosign version --json` would)."""
    path = tmp_path / "cosign"
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("answer, message", [
    ('{"gitVersion": "v2.4.1"}', r"is cosign v2\.4\.1, but imagebuild is pinned to cosign v2\.6\.5 .*IMAGEBUILD_COSIGN"),
    ("cosign: unknown flag --json", r"does not answer `cosign version` \(cosign: unknown flag --json\)"),
], ids=["another-version", "no-json"])
def test_another_or_a_mute_cosign_is_refused_with_the_pin_named(tmp_path, monkeypatch, answer, message):
    monkeypatch.setenv("IMAGEBUILD_COSIGN", str(stand_in(tmp_path, answer)))
    with pytest.raises(ToolMissing, match=message):
        sign.Cosign.find()


def test_key_based_signing_of_a_loopback_image_is_offline_by_digest():
    options = sign.SignOptions(key="/keys/cosign.key")
    assert sign.sign_argv(COSIGN, LOCAL, options) == [
        COSIGN, "sign", "--key", "/keys/cosign.key", "--tlog-upload=false",
        "--allow-http-registry", "--allow-insecure-registry", "--yes", LOCAL]


def test_a_remote_registry_gets_https_unless_named_insecure():
    assert "--allow-http-registry" not in sign.sign_argv(COSIGN, REMOTE, sign.SignOptions(key="/k"))
    insecure = sign.SignOptions(key="/k", insecure_registries=("registry.example.com",))
    assert "--allow-http-registry" in sign.sign_argv(COSIGN, REMOTE, insecure)


@pytest.mark.parametrize("uri", ["awskms:///alias/imagebuild", "gcpkms://projects/p/locations/l/keyRings/r/cryptoKeys/k",
                                 "azurekms://vault.vault.azure.net/imagebuild", "hashivault://imagebuild",
                                 "k8s://imagebuild-system/cosign"])
def test_a_kms_uri_is_passed_to_cosign_as_given(uri):
    assert sign.check_key(uri) == uri
    argv = sign.sign_argv(COSIGN, REMOTE, sign.SignOptions(key=uri))
    assert argv[argv.index("--key") + 1] == uri


def test_tlog_upload_is_a_choice_and_names_the_rekor_given():
    argv = sign.sign_argv(COSIGN, REMOTE, sign.SignOptions(key="/k", tlog=True, rekor_url="https://rekor.example.com"))
    assert "--tlog-upload=true" in argv
    assert argv[argv.index("--rekor-url") + 1] == "https://rekor.example.com"
    assert "--rekor-url" not in sign.sign_argv(COSIGN, REMOTE, sign.SignOptions(key="/k", rekor_url="https://r"))


def test_keyless_signing_passes_the_oidc_flags_and_no_key(tmp_path):
    token = tmp_path / "token"
    keyless = sign.Keyless(oidc_issuer="https://token.actions.githubusercontent.com", oidc_provider="github-actions",
                           identity_token=str(token), fulcio_url="https://fulcio.example.com")
    argv = sign.sign_argv(COSIGN, REMOTE, sign.SignOptions(keyless=keyless, rekor_url="https://rekor.example.com"))
    assert argv == [COSIGN, "sign", "--oidc-issuer", "https://token.actions.githubusercontent.com",
                    "--oidc-provider", "github-actions", "--identity-token", str(token),
                    "--fulcio-url", "https://fulcio.example.com", "--tlog-upload=true",
                    "--rekor-url", "https://rekor.example.com", "--yes", REMOTE]


def test_each_attestation_replaces_the_earlier_one_of_its_type(tmp_path):
    predicate = tmp_path / "gate.json"
    argv = sign.attest_argv(COSIGN, LOCAL, attest.GATE, predicate, sign.SignOptions(key="/k"))
    assert argv[:2] == [COSIGN, "attest"] and argv[-1] == LOCAL
    assert argv[argv.index("--type") + 1] == attest.PREDICATE_GATE
    assert argv[argv.index("--predicate") + 1] == str(predicate)
    assert "--replace" in argv


def test_only_digests_are_signed():
    with pytest.raises(ValueError, match="not addressed by digest"):
        sign.sign_argv(COSIGN, "127.0.0.1:5000/imagebuild-example/paddle:3.3.1", sign.SignOptions(key="/k"))


def test_the_password_is_never_on_the_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv("COSIGN_PASSWORD", "canary-password-0123")
    options = sign.SignOptions(key="/k")
    argvs = [sign.sign_argv(COSIGN, LOCAL, options)] + [
        sign.attest_argv(COSIGN, LOCAL, kind, tmp_path / "p.json", options) for kind in attest.KINDS]
    assert not any("canary-password-0123" in arg for argv in argvs for arg in argv)
    assert sign.secret_values(options) == ["canary-password-0123"]


def test_a_keyless_identity_token_is_redacted_from_logs(monkeypatch, tmp_path):
    monkeypatch.delenv("COSIGN_PASSWORD", raising=False)
    monkeypatch.setenv("SIGSTORE_ID_TOKEN", "eyJ-ambient-token")
    token = tmp_path / "token"
    token.write_text("eyJ-file-token\n")
    options = sign.SignOptions(keyless=sign.Keyless(identity_token=str(token)))
    assert sorted(sign.secret_values(options)) == ["eyJ-ambient-token", "eyJ-file-token"]


def test_the_signature_tags_are_cosign_v2s():
    assert sign.signature_tag(DIGEST) == f"sha256-{'d' * 64}.sig"
    assert sign.tag_ref(LOCAL, DIGEST, "att") == f"127.0.0.1:5000/imagebuild-example/paddle:sha256-{'d' * 64}.att"


def test_a_key_file_is_made_absolute_and_a_missing_one_is_bad_input(tmp_path, monkeypatch):
    (tmp_path / "cosign.key").write_text("not read by imagebuild")
    monkeypatch.chdir(tmp_path)
    assert sign.check_key("cosign.key") == str(tmp_path / "cosign.key")
    with pytest.raises(InputError, match="no such key file"):
        sign.check_key("missing.key")
    with pytest.raises(InputError, match="unknown key scheme"):
        sign.check_key("vault://imagebuild")
    with pytest.raises(InputError, match="needs the key's name"):
        sign.check_key("awskms://")


# --- the command line: bad key options are exit 2, one line, before anything is read --------------


def run_sign(*args: str | Path, env: dict[str, str] | None = None):
    return run_imagebuild("sign", "--workdir", "/nonexistent-workdir", *args, env=env)


@pytest.mark.parametrize("args, env, message", [
    ((), {}, "--key: missing: a key file or KMS URI (or --keyless)"),
    (("--key", "/nonexistent.key"), {"COSIGN_PASSWORD": "x"}, "no such key file"),
    (("--key", "awskms:///a", "--keyless"), {}, "sign with --key or --keyless, not both"),
    (("--key", "awskms:///a", "--oidc-issuer", "https://issuer"), {}, "is a keyless option"),
    (("--keyless", "--identity-token", "/nonexistent-token"), {}, "pass a file holding the token"),
], ids=["no-key", "missing-key-file", "key-and-keyless", "oidc-without-keyless", "token-not-a-file"])
def test_bad_key_options_are_one_line_exit_2(args, env, message):
    run = run_sign(*args, env=env)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_a_key_file_without_cosign_password_is_bad_input(tmp_path):
    key = tmp_path / "cosign.key"
    key.write_text("-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n")
    env = {k: v for k, v in os.environ.items() if k != "COSIGN_PASSWORD"}
    run = subprocess.run([sys.executable, "-m", "imagebuild", "sign", "--workdir", str(tmp_path), "--key", str(key)],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "set COSIGN_PASSWORD" in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_a_missing_report_is_bad_input(tmp_path):
    run = run_sign("--key", "awskms:///alias/x")
    assert run.returncode == 2
    assert "build report not found" in run.stderr


def test_sign_comes_after_gate_in_the_help():
    run = run_imagebuild("--help")
    commands = [line.split()[0] for line in run.stdout.split("Commands:")[1].splitlines() if line.strip()]
    assert commands.index("sign") == commands.index("gate") + 1


def test_the_sign_record_reads_back_typed_and_keeps_what_a_newer_imagebuild_added(tmp_path):
    from imagebuild.core.report import STAGE_RECORDS, SignStage, StageStatus, parse_stage

    assert STAGE_RECORDS["sign"] is SignStage
    data = {"status": "passed", "digest": DIGEST, "key": "awskms:///alias/x", "layout": "tag",
            "signature": f"r/p:sha256-{'d' * 64}.sig", "attestations": [k.record() for k in attest.KINDS],
            "cosign_version": "v2.6.5", "signed_at": "2026-12-01T05:00:00Z", "bundle": "from a newer imagebuild"}
    record = parse_stage("sign", data)
    assert isinstance(record, SignStage) and record.status is StageStatus.PASSED
    assert record.extra == {"bundle": "from a newer imagebuild"}
    assert {k: v for k, v in record.to_dict().items() if k in data} == data
    assert parse_stage("sign", {"status": "refused", "reason": "x: the gate did not pass"}).status is StageStatus.REFUSED
