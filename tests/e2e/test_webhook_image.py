"""`policies generate` names the webhook's image by digest: a tag in the trust file is resolved through the real
staging registry, the way every replica then pulls it. A tag that moves later is drift for `--check`; a tag that
does not exist, or a registry that cannot be asked, ends the command in one line."""
from __future__ import annotations

from pathlib import Path

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.admission import policies

from .conftest import imagebuild
from .rollout_harness import free_port


def trust_file(folder: Path, image: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    (folder / "k.pub").write_bytes(key.public_bytes(serialization.Encoding.PEM,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo))
    path = folder / "trust.yaml"
    path.write_text("keys:\n  - {name: k, path: k.pub}\nimages: ['127.0.0.1:5000/**']\n"
                    f"webhook:\n  name: hook\n  image: {image}\n")
    return path


def deployed(out: Path) -> tuple[str, str]:
    """The Deployment's image, and the one its ConfigMap's trust file names."""
    docs = {d["kind"]: d for d in yaml.safe_load_all((out / policies.WEBHOOK_MANIFESTS).read_text())}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container["image"], yaml.safe_load(docs["ConfigMap"]["data"]["trust.yaml"])["webhook"]["image"]


def test_a_tag_is_pinned_to_its_digest_and_a_moved_tag_is_drift(push, tmp_path):
    first = push(tag="v1")
    config, out = trust_file(tmp_path / "cfg", first.by_tag), tmp_path / "out"
    run = imagebuild("policies", "generate", "--config", str(config), "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert deployed(out) == (f"{first.by_tag}@{first.digest}",) * 2  # repo:tag@digest, as /mutate pins
    assert imagebuild("policies", "generate", "--config", str(config), "--out", str(out), "--check").returncode == 0

    moved = push(repository=first.repository, tag="v1")  # the same tag, another image
    assert moved.digest != first.digest
    check = imagebuild("policies", "generate", "--config", str(config), "--out", str(out), "--check")
    assert check.returncode == 1 and f"changed   {policies.WEBHOOK_MANIFESTS}" in check.stderr
    assert deployed(out)[0] == f"{first.by_tag}@{first.digest}"  # --check wrote nothing


def test_a_tag_the_registry_does_not_have_is_bad_input_naming_the_line(push, tmp_path):
    image = push(tag="v1")
    missing = f"{image.repository}:no-such-tag"
    config, out = trust_file(tmp_path / "cfg", missing), tmp_path / "out"
    run = imagebuild("policies", "generate", "--config", str(config), "--out", str(out))
    assert run.returncode == 2 and not out.exists()
    assert run.stderr.strip().splitlines() == [
        f"error: {config}:6: webhook.image: {missing}: no such tag in 127.0.0.1:5000; push the image, name it by "
        "digest, or pass --keep-webhook-tag"]


def test_a_registry_that_cannot_be_asked_is_exit_3_in_one_line_unless_the_tag_is_kept(tmp_path):
    image = f"127.0.0.1:{free_port()}/team/admission:1"  # nothing listens there
    config, out = trust_file(tmp_path / "cfg", image), tmp_path / "out"
    run = imagebuild("policies", "generate", "--config", str(config), "--out", str(out))
    assert run.returncode == 3 and not out.exists()
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"error: registry: cannot pin webhook.image {image} ({config}:6) to a digest: ")
    assert line.endswith("; name it by digest, or pass --keep-webhook-tag")
    kept = imagebuild("policies", "generate", "--config", str(config), "--out", str(out), "--keep-webhook-tag")
    assert kept.returncode == 0, kept.stderr
    assert deployed(out) == (image, image)
