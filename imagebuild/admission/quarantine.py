"""Quarantine at admission: the webhook refuses a digest that `imagebuild rescan` or `imagebuild
quarantine` marked in the release's state repository (trust file `quarantine:`).

A mark is the tag `quarantine-sha256-<hex>` (imagebuild.rollout.quarantine) over one small JSON layer.
The state repository is untrusted input like any registry: the manifest is read with a size cap,
the layer's digest must be a sha256 digest and the blob must hash to it. A mark that is there but
cannot be read refuses the image (anyone who may write marks may quarantine it anyway); a state
registry that cannot be reached is an unreachable verdict, which the failure policy decides.
Answers are cached per digest for the source's cache_ttl_seconds, so a flood of Pods costs one
lookup per digest, and a new mark takes effect within that time.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from imagebuild.admission.review import Verdict
from imagebuild.config.trust import QuarantineSource, TrustConfig
from imagebuild.core.errors import ImagebuildError
from imagebuild.core.source import safe_text
from imagebuild.oci import names
from imagebuild.oci.client import Registry, RegistryError, RegistryUnreachable
from imagebuild.rollout.quarantine import MEDIA_TYPE, quarantine_tag
from imagebuild.trust.verify import ImageVerdict

MAX_MARK_MANIFEST_BYTES = 16 << 10  # one layer and an annotation
MAX_MARK_BYTES = 256 << 10  # a reason and the blocking findings of one scan
MAX_CACHED = 4096  # digests remembered; the oldest answers go first


class MarkUnreadable(ImagebuildError):
    """A mark is there, but it is not a quarantine mark this webhook can read."""


@dataclass(frozen=True)
class QuarantineVerdict:
    """An image that verified, refused because its digest is quarantined (or its mark cannot be read)."""

    image: str
    digest: str | None
    reason: str
    unreachable: bool = False
    allowed: bool = False


class QuarantineMarks:
    """Why a digest is quarantined (None when it is not), read from the state repository and cached briefly."""

    def __init__(self, source: QuarantineSource, registry: Registry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.registry = registry or Registry(source.registry, timeout=5.0)
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, str | None]] = {}

    def close(self) -> None:
        self.registry.close()

    def refusal(self, digest: str) -> str | None:
        """The reason a quarantined digest is refused, or None. Raises RegistryError, MarkUnreadable."""
        now = self._clock()
        with self._lock:
            cached = self._cache.get(digest)
            if cached is not None and cached[0] > now:
                return cached[1]
        try:
            answer = self._read(digest)
        except MarkUnreadable as err:
            answer = f"its quarantine mark in {self._where()} cannot be read ({err}): refused until it is fixed or cleared"
        self._remember(digest, answer, now)
        return answer

    def _remember(self, digest: str, answer: str | None, now: float) -> None:
        ttl = self.source.cache_ttl_seconds
        if ttl <= 0:
            return
        with self._lock:
            self._cache.pop(digest, None)
            while len(self._cache) >= MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            self._cache[digest] = (now + ttl, answer)

    def _where(self) -> str:
        return f"{self.source.registry}/{self.source.repository}"

    def _read(self, digest: str) -> str | None:
        tag = quarantine_tag(digest)
        raw = self._manifest(tag)
        if raw is None:
            return None
        layer = _only_layer(raw)
        blob = self.registry.get_blob_limited(self.source.repository, layer, MAX_MARK_BYTES)
        if "sha256:" + hashlib.sha256(blob).hexdigest() != layer:
            raise MarkUnreadable(f"the blob served for {layer} does not hash to it")
        try:
            record = json.loads(blob)
        except ValueError:
            raise MarkUnreadable("the mark is not JSON") from None
        if not isinstance(record, dict):
            raise MarkUnreadable("the mark is not a JSON object")
        return _describe(record, digest, self._where())

    def _manifest(self, tag: str) -> bytes | None:
        """The mark's manifest, at most MAX_MARK_MANIFEST_BYTES of it (the one registry reader: grammar
        checked, read with the cap); None when the tag is absent."""
        found = self.registry.find_manifest(self.source.repository, tag, max_bytes=MAX_MARK_MANIFEST_BYTES)
        return None if found is None else found[0]


def _only_layer(raw: bytes) -> str:
    """The digest of the mark's one layer, checked for grammar and media type before it goes into a URL."""
    try:
        manifest = json.loads(raw)
        layers = manifest["layers"]
        layer = layers[0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise MarkUnreadable("its manifest has no layer") from None
    if not isinstance(layer, dict) or len(layers) != 1:
        raise MarkUnreadable("its manifest does not hold exactly one layer")
    digest, size = layer.get("digest"), layer.get("size")
    if not names.is_sha256_digest(digest):
        raise MarkUnreadable("its layer's digest is not sha256:<64 hex digits>")
    if not isinstance(size, int) or not 0 < size <= MAX_MARK_BYTES:
        raise MarkUnreadable(f"its layer's size is not between 1 and {MAX_MARK_BYTES} bytes")
    if layer.get("mediaType") != MEDIA_TYPE:
        raise MarkUnreadable(f"its layer is not a {MEDIA_TYPE}")
    return digest


def _describe(record: dict[str, Any], digest: str, where: str) -> str:
    if record.get("digest") != digest:
        return (f"quarantined: the mark for {digest} in {where} names {safe_text(str(record.get('digest')), 80)}; "
                "refused until it is fixed or cleared")
    since, source, reason = (safe_text(str(record.get(key, "?")), limit)
                             for key, limit in (("since", 40), ("source", 40), ("reason", 200)))
    return f"quarantined since {since} ({source}): {reason}"


def with_quarantine(verify: Callable[[str], Verdict], marks: QuarantineMarks | None) -> Callable[[str], Verdict]:
    """verify(image), then refuse an image that verified when its digest is quarantined."""
    if marks is None:
        return verify

    def check(image: str) -> Verdict:
        verdict = verify(image)
        if not verdict.allowed or verdict.digest is None:
            return verdict
        # An index admits every child a node may pick: a mark on any of them refuses it.
        covered = verdict.digests if isinstance(verdict, ImageVerdict) else (verdict.digest,)
        for digest in covered:
            try:
                why = marks.refusal(digest)
            except RegistryUnreachable as err:
                return QuarantineVerdict(image, verdict.digest, f"quarantine marks unreachable: {err}",
                                         unreachable=True)
            except RegistryError as err:
                return QuarantineVerdict(image, verdict.digest, f"quarantine marks cannot be read: {err}")
            if why is not None:
                child = "" if digest == verdict.digest else f"its child {digest} is "
                return QuarantineVerdict(image, verdict.digest, child + why)
        return verdict

    return check


def webhook_checks(config: TrustConfig, verify: Callable[[str], Verdict]) -> Callable[[str], Verdict]:
    """What the webhook asks of every image (`admission serve` and `review`, and `policies generate` of the
    webhook's own): verify's verdict (a Verifier of CONFIG), then the quarantine marks of the state
    repository the config names, if any."""
    return with_quarantine(verify, QuarantineMarks(config.quarantine) if config.quarantine is not None else None)
