"""The webhook's own image as its Deployment names it: by digest, resolved from the trust file's tag once, when
`policies generate` writes the manifests, so every replica (and every restart) runs the image that was reviewed,
whatever the tag says later. The one part of `policies generate` that asks a registry (`policies` stays pure)."""
from __future__ import annotations

from collections.abc import Callable

from imagebuild.admission.review import pinned
from imagebuild.config.trust import TrustConfig
from imagebuild.core.source import InputError
from imagebuild.oci import reference
from imagebuild.oci.client import Registry, RegistryError

KEEP_TAG_FLAG = "--keep-webhook-tag"


def webhook_image(config: TrustConfig, *, keep_tag: bool = False,
                  registry: Callable[[str], Registry] = Registry) -> str:
    """The reference the Deployment runs: a digest as written; a tag pinned (`repo:tag@sha256:...`, the
    mutating webhook's own convention, review.pinned) to what the registry serves for it now, or kept as
    written with `keep_tag`. InputError (exit 2) when the file names no image or the tag does not exist;
    the registry's RegistryError (exit 3) when it cannot be asked."""
    hook = config.webhook
    file, line, key = str(config.path), hook.image_line, "webhook.image"
    if hook.image_line is None and not keep_tag:
        raise InputError(file, None, key, "not set: name the webhook's image (a tag to pin, or by digest), "
                                          f"or pass {KEEP_TAG_FLAG} for the placeholder {hook.image}")
    try:
        parts = reference.parse(hook.image)
    except reference.ReferenceError as exc:
        raise InputError(file, line, key, f"not an image reference: {exc}") from None
    if parts.digest is not None or keep_tag:
        return hook.image
    tag = parts.tag or "latest"
    try:
        with registry(parts.registry) as client:
            digest = client.head_manifest(parts.repository, tag)
    except RegistryError as err:
        raise type(err)(f"cannot pin webhook.image {hook.image} ({file}:{line}) to a digest: {err}; "
                        f"name it by digest, or pass {KEEP_TAG_FLAG}", registry=err.registry,
                        repository=err.repository, operation=err.operation, status=err.status) from None
    if digest is None:
        raise InputError(file, line, key, f"{hook.image}: no such tag in {parts.registry}; push the image, name it "
                                          f"by digest, or pass {KEEP_TAG_FLAG}")
    target = pinned(hook.image, digest)
    if target is None:  # the client has checked the digest's grammar; a sha512 one cannot be pinned here
        raise InputError(file, line, key, f"{hook.image}: the registry names it {digest}, not a sha256 digest; "
                                          "name it by digest")
    return target
