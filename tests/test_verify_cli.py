"""imagebuild verify's command line: what it refuses before asking any registry (exit 2, one line)."""
from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_imagebuild

PUBLIC_KEY = Path("/var/lib/imagebuild/keys/cosign.pub")


@pytest.fixture
def public_key(tmp_path) -> Path:
    """A real P-256 public key (the unit tests need no cosign: `cryptography` makes it)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    path = tmp_path / "test.pub"
    path.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def one_error_line(run) -> str:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and not run.stdout, (run.returncode, run.stdout, run.stderr)
    return lines[0]


def test_a_malformed_image_reference_is_bad_input(public_key):
    line = one_error_line(run_imagebuild("verify", "--key", public_key, "127.0.0.1:5000/Not/Lowercase:v1"))
    # The reference grammar's own words follow (imagebuild/reference.py says which characters a path takes).
    assert line.startswith("error: 127.0.0.1:5000/Not/Lowercase:v1: not an image reference: "
                           "repository 'Not/Lowercase' is not lowercase path components")


def test_a_missing_key_file_is_bad_input(tmp_path):
    line = one_error_line(run_imagebuild("verify", "--key", tmp_path / "missing.pub", "127.0.0.1:5000/x:v1"))
    assert "missing.pub" in line and "not found" in line


def test_a_private_key_given_as_key_is_refused_without_echoing_it(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = tmp_path / "oops.pem"
    text = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    private.write_text(text)
    run = run_imagebuild("verify", "--key", private, "127.0.0.1:5000/x:v1")
    line = one_error_line(run)
    assert "private key" in line
    body = text.splitlines()[1]
    assert body not in run.stderr and body not in run.stdout


def test_a_missing_trust_config_is_bad_input(tmp_path):
    line = one_error_line(run_imagebuild("verify", "--config", tmp_path / "trust.yaml", "127.0.0.1:5000/x:v1"))
    assert "trust.yaml" in line


def test_key_and_config_together_are_bad_input(public_key, tmp_path):
    line = one_error_line(run_imagebuild("verify", "--key", public_key, "--config", tmp_path / "t.yaml",
                                         "127.0.0.1:5000/x:v1"))
    assert "give --key or --trust, not both" in line


def test_a_malformed_trust_config_names_its_file_and_line(tmp_path):
    config = tmp_path / "trust.yaml"
    config.write_text("mode: enforce\nkeys: []\nimages: ['127.0.0.1:5000/**']\n")
    line = one_error_line(run_imagebuild("verify", "--config", config, "127.0.0.1:5000/x:v1"))
    assert line.startswith(f"error: {config}:2: keys")


def test_help_shows_examples_and_exit_codes():
    run = run_imagebuild("verify", "--help")
    assert run.returncode == 0
    assert "imagebuild verify --key cosign.pub --key cosign-next.pub IMAGE" in run.stdout
    text = " ".join(run.stdout.split())  # click rewraps the paragraphs
    assert "`IMAGE: refused: reason`" in text and "3 when a registry cannot be reached" in text
