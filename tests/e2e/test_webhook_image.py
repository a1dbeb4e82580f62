"""`policies generate` names the webhook's image by digest, and only once that digest verifies: a tag in the trust
file is resolved through the real staging registry, the way every replica then pulls it, and the digest (or the one
the file names) must carry a cosign signature by one of the trust file's keys, as the webhook demands of any image.
Real registry, real cosign (offline, bootstrap's key): a test fails, never skips, without them.

A refused image writes nothing; a tag that moves later is drift for `--check`, or refused when it moved to an
image that does not verify; a tag that does not exist, or a registry that cannot be asked, ends the command in one
line."""
from __future__ import annotations

from pathlib import Path

import yaml

from imagebuild.admission import policies

from .conftest import imagebuild
from .rollout_harness import free_port
from .tools import KeyPair

UNVERIFIED_FLAG = "--insecure-unverified-webhook-image"


def trust_file(folder: Path, image: str, key: KeyPair, require: str = "{}", registry: str = "127.0.0.1:5000") -> Path:
    """Trusting `key` (bootstrap's, in these tests) for the registry's images; webhook.image on line 6."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trust.yaml"
    path.write_text(f"keys:\n  - {{name: ours, path: {key.public}}}\nimages: ['{registry}/**']\n"
                    f"webhook:\n  name: hook\n  image: {image}\nrequire: {require}\n")
    return path


def generate(config: Path, out: Path, *args: str):
    return imagebuild("policies", "generate", "--config", str(config), "--out", str(out), *args, timeout=300)


def deployed(out: Path) -> tuple[str, str]:
    """The Deployment's image, and the one its ConfigMap's trust file names."""
    docs = {d["kind"]: d for d in yaml.safe_load_all((out / policies.WEBHOOK_MANIFESTS).read_text())}
    (container,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container["image"], yaml.safe_load(docs["ConfigMap"]["data"]["trust.yaml"])["webhook"]["image"]


def refusal(run, config: Path, image: str) -> str:
    """The one line a refused webhook image ends generate with (exit 1), after its fixed start."""
    assert run.returncode == 1, (run.returncode, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    start = f"error: generate: WebhookImageRefused: webhook.image {image} ({config}:6) refused, as the webhook would refuse it: "
    assert line.startswith(start), line
    return line.removeprefix(start)


def test_a_signed_tag_is_pinned_to_its_digest_and_a_tag_moved_to_another_signed_image_is_drift(
        push, cosign_cli, our_key, tmp_path):
    first = push(tag="v1")
    cosign_cli.sign(first, our_key)
    config, out = trust_file(tmp_path / "cfg", first.by_tag, our_key), tmp_path / "out"
    run = generate(config, out)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert deployed(out) == (f"{first.by_tag}@{first.digest}",) * 2  # repo:tag@digest, as /mutate pins
    assert generate(config, out, "--check").returncode == 0

    moved = push(repository=first.repository, tag="v1")  # the same tag, another image, signed too
    cosign_cli.sign(moved, our_key)
    assert moved.digest != first.digest
    check = generate(config, out, "--check")
    assert check.returncode == 1 and f"changed   {policies.WEBHOOK_MANIFESTS}" in check.stderr
    assert deployed(out)[0] == f"{first.by_tag}@{first.digest}"  # --check wrote nothing


def test_an_unsigned_tag_is_refused_and_nothing_is_written(push, our_key, tmp_path):
    image = push(tag="v1")
    config, out = trust_file(tmp_path / "cfg", image.by_tag, our_key), tmp_path / "out"
    reason = refusal(generate(config, out), config, image.by_tag)
    assert reason == f"{image.digest}: not signed: no signature {image.repository}:{image.signature_tag()}"
    assert not (out / policies.WEBHOOK_MANIFESTS).exists() and not out.exists()
    assert refusal(generate(config, out, "--check"), config, image.by_tag) == reason  # --check verifies too


def test_a_tag_signed_with_another_key_is_refused(push, cosign_cli, our_key, other_key, tmp_path):
    image = push(tag="v1")
    cosign_cli.sign(image, other_key)
    assert cosign_cli.admits(image.by_digest, other_key.public)  # a good signature, by a key nobody trusts here
    config, out = trust_file(tmp_path / "cfg", image.by_tag, our_key), tmp_path / "out"
    reason = refusal(generate(config, out), config, image.by_tag)
    assert reason.startswith(f"{image.digest}: ") and "does not verify with any configured key" in reason
    assert not out.exists()


def test_a_digest_that_is_signed_is_written_as_it_is(push, cosign_cli, our_key, tmp_path):
    image = push(tag="v1")
    cosign_cli.sign(image, our_key)
    config, out = trust_file(tmp_path / "cfg", image.by_digest, our_key), tmp_path / "out"
    run = generate(config, out)
    assert run.returncode == 0, run.stderr
    assert deployed(out) == (image.by_digest,) * 2


def test_a_digest_that_is_unsigned_is_refused(push, cosign_cli, our_key, tmp_path):
    signed = push(tag="v1")
    cosign_cli.sign(signed, our_key)
    unsigned = push(repository=signed.repository, tag="v2")  # the repository holds signatures, not for this one
    config, out = trust_file(tmp_path / "cfg", unsigned.by_digest, our_key), tmp_path / "out"
    reason = refusal(generate(config, out), config, unsigned.by_digest)
    assert reason == f"not signed: no signature {unsigned.repository}:{unsigned.signature_tag()}"
    assert not out.exists()


def test_a_tag_moved_to_an_unsigned_image_after_signing_is_refused_and_the_files_stay(push, cosign_cli, our_key,
                                                                                    tmp_path):
    signed = push(tag="v1")
    cosign_cli.sign(signed, our_key)
    config, out = trust_file(tmp_path / "cfg", signed.by_tag, our_key), tmp_path / "out"
    assert generate(config, out).returncode == 0
    before = (out / policies.WEBHOOK_MANIFESTS).read_text()

    moved = push(repository=signed.repository, tag="v1")  # someone who may push moves the tag: no signature
    assert moved.digest != signed.digest
    reason = refusal(generate(config, out), config, signed.by_tag)
    assert reason == f"{moved.digest}: not signed: no signature {moved.repository}:{moved.signature_tag()}"
    assert (out / policies.WEBHOOK_MANIFESTS).read_text() == before  # still the signed digest
    assert deployed(out)[0] == f"{signed.by_tag}@{signed.digest}"


def test_the_trust_file_s_requirements_apply_to_the_webhook_image_too(push, cosign_cli, our_key, tmp_path):
    image = push(tag="v1")
    cosign_cli.sign(image, our_key)  # signed, but without the smoke attestation the file requires
    config, out = trust_file(tmp_path / "cfg", image.by_tag, our_key, require="{attestations: [smoke]}"), \
        tmp_path / "out"
    reason = refusal(generate(config, out), config, image.by_tag)
    assert reason == f"{image.digest}: attestations missing: smoke"
    assert not out.exists()


def test_the_insecure_flag_pins_an_unsigned_tag_with_a_warning(push, our_key, tmp_path):
    image = push(tag="v1")
    config, out = trust_file(tmp_path / "cfg", image.by_tag, our_key), tmp_path / "out"
    run = generate(config, out, UNVERIFIED_FLAG)
    assert run.returncode == 0, run.stderr
    pinned = f"{image.by_tag}@{image.digest}"
    (warning,) = run.stderr.strip().splitlines()
    assert warning.startswith(f"warning: webhook.image {pinned} is NOT verified ({UNVERIFIED_FLAG}): "), warning
    assert f"whoever can push to {image.repository} may have chosen it" in warning
    assert deployed(out) == (pinned,) * 2


def test_a_tag_the_registry_does_not_have_is_bad_input_naming_the_line(push, our_key, tmp_path):
    image = push(tag="v1")
    missing = f"{image.repository}:no-such-tag"
    config, out = trust_file(tmp_path / "cfg", missing, our_key), tmp_path / "out"
    run = generate(config, out)
    assert run.returncode == 2 and not out.exists()
    assert run.stderr.strip().splitlines() == [
        f"error: {config}:6: webhook.image: {missing}: no such tag in 127.0.0.1:5000; push and sign the image, "
        "or name it by digest"]


def test_a_registry_that_cannot_be_asked_is_exit_3_in_one_line(our_key, tmp_path):
    """Resolving the tag, or verifying the digest written."""
    registry = f"127.0.0.1:{free_port()}"  # nothing listens there
    for image, start in ((f"{registry}/team/admission:1", "error: registry: cannot pin webhook.image "),
                         (f"{registry}/team/admission@sha256:{'cd' * 32}",
                          "error: generate: WebhookImageRefused: webhook.image ")):
        config, out = trust_file(tmp_path / "cfg", image, our_key, registry=registry), tmp_path / "out"
        run = generate(config, out)
        assert run.returncode == 3 and not out.exists(), run.stderr
        (line,) = run.stderr.strip().splitlines()
        assert line.startswith(f"{start}{image} ({config}:6)"), line
        assert "Connection refused" in line or "registry unreachable" in line, line
