"""The webhook's own image as its Deployment names it: by digest, resolved from the trust file's tag once, when
`policies generate` writes the manifests, so every replica (and every restart) runs the image that was reviewed,
whatever the tag says later. The one part of `policies generate` that asks a registry (`policies` stays pure).

The webhook leaves its own namespace out of admission (so that it can always be repaired), so nothing in the
cluster checks the image it runs: that digest is verified here, before any file names it, as the webhook
verifies every image (the trust file's keys, images and requirements, then its quarantine marks). Otherwise
whoever can push to the webhook's repository would choose what the Deployment runs."""
from __future__ import annotations

from collections.abc import Callable

from imagebuild.admission.quarantine import webhook_checks
from imagebuild.admission.review import Verdict, pinned
from imagebuild.config.trust import TrustConfig
from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.source import InputError
from imagebuild.oci import reference
from imagebuild.oci.client import Registry, RegistryError
from imagebuild.trust.verify import Verifier

KEEP_TAG_FLAG = "--keep-webhook-tag"
UNVERIFIED_FLAG = "--insecure-unverified-webhook-image"

Verify = Callable[[str], Verdict]


class WebhookImageRefused(ImagebuildError):
    """webhook.image does not verify as the webhook verifies any image, so no file names it: exit 1, as
    `imagebuild verify` refusing it; 3 (on the instance) when its registry cannot be asked to verify it."""


def webhook_image(config: TrustConfig, *, keep_tag: bool = False, unverified: bool = False,
                  registry: Callable[[str], Registry] = Registry, verify: Verify | None = None,
                  warn: Callable[[str], None] = lambda line: None) -> str:
    """The reference the Deployment runs, once it verified: a digest as written; a tag pinned
    (`repo:tag@sha256:...`, the mutating webhook's own convention, review.pinned) to what the registry
    serves for it now. `keep_tag`: the placeholder written as it is, when the trust file names no image.
    `unverified`: the reference without verifying it, with a warning (`warn`, one line).

    InputError (exit 2) when the file names no image (without `keep_tag`), names one with `keep_tag`, or
    its tag does not exist; the registry's RegistryError (exit 3) when the tag cannot be resolved;
    WebhookImageRefused (exit 1, or 3 when unreachable) when the digest does not verify. `verify`: the
    check (default: a Verifier of this config and its quarantine marks, as the webhook builds them)."""
    hook = config.webhook
    file, line, key = str(config.path), hook.image_line, "webhook.image"
    if hook.image_line is None:
        if not keep_tag:
            raise InputError(file, None, key, "not set: name the webhook's image (a tag to pin, or by digest), "
                                              f"or pass {KEEP_TAG_FLAG} for the placeholder {hook.image}")
        return hook.image  # under example.com (reserved: no registry serves it): nothing to resolve or verify
    if keep_tag:
        raise InputError(file, line, key, f"{KEEP_TAG_FLAG} writes only the placeholder (a trust file naming no "
                                          f"webhook image); {hook.image} is verified and pinned: drop the flag")
    try:
        parts = reference.parse(hook.image)
    except reference.ReferenceError as exc:
        raise InputError(file, line, key, f"not an image reference: {exc}") from None
    target = hook.image if parts.digest is not None else _pin(hook.image, parts, registry, file, line)
    if unverified:
        warn(unverified_warning(target, f"{parts.registry}/{parts.repository}"))
        return target
    if verify is None:
        with Verifier(config, cache_ttl_seconds=0) as verifier:
            verdict = webhook_checks(config, verifier.verify)(target)
    else:
        verdict = verify(target)
    judge(verdict, hook.image, f"{file}:{line}")
    return target


def _pin(image: str, parts: reference.Reference, registry: Callable[[str], Registry], file: str,
         line: int | None) -> str:
    """image pinned to the digest its registry serves for its tag now."""
    tag = parts.tag or "latest"
    try:
        with registry(parts.registry) as client:
            digest = client.head_manifest(parts.repository, tag)
    except RegistryError as err:
        raise type(err)(f"cannot pin webhook.image {image} ({file}:{line}) to a digest: {err}",
                        registry=err.registry, repository=err.repository, operation=err.operation,
                        status=err.status) from None
    if digest is None:
        raise InputError(file, line, "webhook.image", f"{image}: no such tag in {parts.registry}; push and sign "
                                                      "the image, or name it by digest")
    target = pinned(image, digest)
    if target is None:  # the client has checked the digest's grammar; a sha512 one cannot be pinned here
        raise InputError(file, line, "webhook.image", f"{image}: the registry names it {digest}, not a sha256 "
                                                      "digest; name it by digest")
    return target


def judge(verdict: Verdict, image: str, where: str) -> None:
    """Nothing when the verdict allows the image; else WebhookImageRefused, in one line naming the trust
    file's line and, for a tag, the digest that was refused (exit 3 when its registry could not be asked)."""
    if verdict.allowed:
        return
    named = verdict.digest is None or verdict.digest in image  # by digest: the line names it already
    if verdict.unreachable:
        raise WebhookImageRefused(f"webhook.image {image} ({where}): cannot verify {'it' if named else verdict.digest}: "
                                  f"{verdict.reason}", exit_code=ExitCode.ENVIRONMENT)
    raise WebhookImageRefused(f"webhook.image {image} ({where}) refused, as the webhook would refuse it: "
                              f"{'' if named else f'{verdict.digest}: '}{verdict.reason}")


def unverified_warning(target: str, repository: str) -> str:
    return (f"warning: webhook.image {target} is NOT verified ({UNVERIFIED_FLAG}): the webhook's Deployment "
            f"runs it though no trusted key may vouch for it, and whoever can push to {repository} may have "
            "chosen it; sign it and generate again without the flag")
