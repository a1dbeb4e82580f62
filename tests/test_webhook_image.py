"""policies generate's webhook image: which reference is verified, what is pinned, and how a refusal ends.

The registry and the verification are handed in (a fake registry, a recorded check), so these tests name
exactly which reference is verified and which is written. tests/e2e/test_webhook_image.py does it for real:
cosign signatures in the local registry, verified by imagebuild's Verifier.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from imagebuild.admission.quarantine import webhook_checks
from imagebuild.admission.webhook_image import UNVERIFIED_FLAG, WebhookImageRefused, judge, webhook_image
from imagebuild.config.trust import TrustConfig, WebhookSettings, load_trust_config
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.oci.client import RegistryUnreachable
from imagebuild.trust.verify import ImageVerdict

DIGEST = "sha256:" + "ab" * 32
REPOSITORY = "registry.test/team/admission"


def config(tmp_path: Path, image: str | None) -> TrustConfig:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    (tmp_path / "k.pub").write_bytes(key.public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    path = tmp_path / "trust.yaml"
    path.write_text("keys: [{name: k, path: k.pub}]\nimages: ['registry.test/team/**']\nwebhook:\n  name: hook\n"
                    + (f"  image: {image}\n" if image else ""))
    return load_trust_config(path)


class FakeRegistry:
    """What the registry serves for each tag, and every tag it was asked for."""

    def __init__(self, tags: dict[str, str]) -> None:
        self.tags, self.asked = tags, []

    def __call__(self, host: str) -> FakeRegistry:
        assert host == "registry.test"
        return self

    def __enter__(self) -> FakeRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def head_manifest(self, repository: str, tag: str) -> str | None:
        self.asked.append(f"{repository}:{tag}")
        return self.tags.get(tag)


class Check:
    """A verification that answers one verdict and records what it was asked."""

    def __init__(self, allowed: bool = True, reason: str = "signed by k", unreachable: bool = False) -> None:
        self.allowed, self.reason, self.unreachable = allowed, reason, unreachable
        self.asked: list[str] = []

    def __call__(self, image: str) -> ImageVerdict:
        self.asked.append(image)
        return ImageVerdict(image, DIGEST, self.allowed, self.reason, unreachable=self.unreachable)


def nowhere(host: str) -> FakeRegistry:
    raise AssertionError(f"no registry is asked ({host})")


def never(image: str) -> ImageVerdict:
    raise AssertionError(f"nothing is verified ({image})")


def test_a_tag_is_pinned_to_the_digest_it_resolves_to_and_that_very_reference_is_verified(tmp_path):
    registry, check = FakeRegistry({"1": DIGEST}), Check()
    pinned = webhook_image(config(tmp_path, f"{REPOSITORY}:1"), registry=registry, verify=check)
    assert pinned == f"{REPOSITORY}:1@{DIGEST}"
    assert registry.asked == ["team/admission:1"]
    assert check.asked == [pinned]  # the digest written, not the tag again (which could have moved since)


def test_a_digest_is_verified_as_written_without_resolving_anything(tmp_path):
    image, check = f"{REPOSITORY}@{DIGEST}", Check()
    assert webhook_image(config(tmp_path, image), registry=nowhere, verify=check) == image
    assert check.asked == [image]


def test_a_refused_digest_is_a_failure_in_one_line_naming_the_line_and_the_digest(tmp_path):
    trust = config(tmp_path, f"{REPOSITORY}:1")
    with pytest.raises(WebhookImageRefused, match=r"refused, as the webhook would refuse it") as raised:
        webhook_image(trust, registry=FakeRegistry({"1": DIGEST}),
                      verify=Check(allowed=False, reason=f"not signed: no signature {REPOSITORY}:x.sig"))
    assert str(raised.value) == (f"webhook.image {REPOSITORY}:1 ({trust.path}:5) refused, as the webhook would "
                                 f"refuse it: {DIGEST}: not signed: no signature {REPOSITORY}:x.sig")
    assert raised.value.exit_code == ExitCode.FAILED  # what `imagebuild verify` ends with for a refused image


def test_a_refused_reference_by_digest_does_not_name_its_digest_twice(tmp_path):
    image = f"{REPOSITORY}@{DIGEST}"
    with pytest.raises(WebhookImageRefused, match=r"would refuse it: signed by no key") as raised:
        webhook_image(config(tmp_path, image), verify=Check(allowed=False, reason="signed by no key"))
    assert str(raised.value).count(DIGEST) == 1


def test_a_registry_that_cannot_be_asked_to_verify_is_the_environment(tmp_path):
    trust = config(tmp_path, f"{REPOSITORY}:1")
    with pytest.raises(WebhookImageRefused, match=rf"cannot verify {DIGEST}: registry unreachable: refused") as raised:
        webhook_image(trust, registry=FakeRegistry({"1": DIGEST}),
                      verify=Check(allowed=False, reason="registry unreachable: refused", unreachable=True))
    assert str(raised.value) == (f"webhook.image {REPOSITORY}:1 ({trust.path}:5): cannot verify {DIGEST}: "
                                 "registry unreachable: refused")
    assert raised.value.exit_code == ExitCode.ENVIRONMENT
    with pytest.raises(WebhookImageRefused, match=r"\): cannot verify it: registry unreachable"):
        webhook_image(config(tmp_path, f"{REPOSITORY}@{DIGEST}"),
                      verify=Check(allowed=False, reason="registry unreachable: refused", unreachable=True))


def test_the_insecure_flag_pins_without_verifying_and_warns_naming_the_flag_and_the_repository(tmp_path):
    warnings: list[str] = []
    pinned = webhook_image(config(tmp_path, f"{REPOSITORY}:1"), unverified=True, registry=FakeRegistry({"1": DIGEST}),
                           verify=never, warn=warnings.append)
    assert pinned == f"{REPOSITORY}:1@{DIGEST}"  # still pinned: every replica runs the same image
    (warning,) = warnings
    assert warning.startswith(f"warning: webhook.image {pinned} is NOT verified ({UNVERIFIED_FLAG}): ")
    assert f"whoever can push to {REPOSITORY} may have chosen it" in warning


def test_keep_tag_writes_the_placeholder_and_asks_nothing(tmp_path):
    assert webhook_image(config(tmp_path, None), keep_tag=True, registry=nowhere, verify=never) == \
        WebhookSettings().image


def test_keep_tag_is_bad_input_when_the_file_names_an_image(tmp_path):
    with pytest.raises(InputError, match=r":5: webhook\.image: --keep-webhook-tag writes only the placeholder"):
        webhook_image(config(tmp_path, f"{REPOSITORY}:1"), keep_tag=True, registry=nowhere, verify=never)


def test_no_image_and_no_keep_tag_is_bad_input(tmp_path):
    with pytest.raises(InputError, match=r"webhook\.image: not set: name the webhook's image"):
        webhook_image(config(tmp_path, None), registry=nowhere, verify=never)


def test_a_tag_the_registry_does_not_have_is_bad_input_and_nothing_is_verified(tmp_path):
    with pytest.raises(InputError, match=r":5: webhook\.image: .*:2: no such tag in registry\.test; push and sign"):
        webhook_image(config(tmp_path, f"{REPOSITORY}:2"), registry=FakeRegistry({"1": DIGEST}), verify=never)


def test_an_allowed_verdict_passes():
    assert judge(ImageVerdict(f"{REPOSITORY}@{DIGEST}", DIGEST, True, "signed by k"), REPOSITORY, "t.yaml:1") is None


def test_an_unreachable_registry_while_resolving_stays_a_registry_error(tmp_path):
    class Down(FakeRegistry):
        def head_manifest(self, repository: str, tag: str) -> str | None:
            raise RegistryUnreachable("connection refused", registry="registry.test")

    with pytest.raises(RegistryUnreachable, match=r"^cannot pin webhook\.image .*:1 \(.*:5\) to a digest: connection"):
        webhook_image(config(tmp_path, f"{REPOSITORY}:1"), registry=Down({}), verify=never)


def test_without_quarantine_marks_the_webhook_s_check_is_the_verifier_s(tmp_path):
    check = Check()
    assert webhook_checks(config(tmp_path, None), check) is check
