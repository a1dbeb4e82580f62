"""What `imagebuild gc cache` keeps in the build side's repositories: the layer cache and the staging release
repository of a matrix. Pure: the plan is computed and the reports read before, the registry read and changed
by retention.gc.

The cache repository holds one `<kind>-<32 hex of the content key>` tag per layer image ever built
(names.LAYER_CACHE_TAG). Kept there:
- every content-key tag the current plan computes (every layer of every variant, root first);
- every layer, and each variant's chain, that a given build report names, with the digests it recorded;
- every tag that is not a content key nor cosign's: a person's, theirs to delete.
Kept in the staging release repository: every tag but cosign's, and the digests (with their index children)
that a given report's variants name. From there retention.live.collect follows children, signatures,
attestations, SBOMs and referrers; the rest is dead and goes in retention.live.order.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from imagebuild.core.report import BuildReport
from imagebuild.core.source import InputError
from imagebuild.oci import names
from imagebuild.retention.live import cosign_tag_subject, short

_KEY = names.DIGEST_HEX["sha256"]  # a content key: 64 hex digits, as a sha256


@dataclass
class CacheLive:
    """The roots of both repositories: content-key tags that stay, and digests that stay (each with why)."""

    tags: dict[str, str] = field(default_factory=dict)  # content-key tag -> why
    layers: dict[str, str] = field(default_factory=dict)  # layer image digest (cache repository) -> why
    releases: dict[str, str] = field(default_factory=dict)  # variant digest (staging repository) -> why

    @property
    def digests(self) -> dict[str, str]:
        """Every digest a report names, for both repositories: a digest not there keeps nothing."""
        return {**self.releases, **self.layers}

    def root_tag(self) -> Callable[[str], bool]:
        """For retention.live.collect over the cache repository: which tags keep what they name."""
        return lambda tag: cosign_tag_subject(tag) is None and (not names.is_layer_cache_tag(tag)
                                                                or tag in self.tags)


def _digest(value: object, where: str, key: str) -> str | None:
    if value is None:
        return None
    if not names.is_sha256_digest(value):
        raise InputError(where, None, key, f"'{names.escaped(value, 80)}' is not a sha256 digest")
    return value


def cache_live(plan_tags: Mapping[str, str], reports: Iterable[tuple[str, BuildReport]]) -> CacheLive:
    """`plan_tags`: the current plan's content-key tags -> why; `reports`: (its path, the report) each. A
    report's layer, key or digest of the wrong shape is an InputError naming the report and the field."""
    live = CacheLive(tags=dict(plan_tags))
    for where, report in reports:
        kinds: dict[str, str] = {}
        for n, layer in enumerate(report.layers):
            if layer.kind not in names.LAYER_CACHE_KINDS:
                raise InputError(where, None, f"layers[{n}].kind", f"'{names.escaped(layer.kind, 40)}' is not a "
                                 f"layer kind ({', '.join(names.LAYER_CACHE_KINDS)})")
            if not isinstance(layer.key, str) or not _KEY.fullmatch(layer.key):
                raise InputError(where, None, f"layers[{n}].key", "is not a content key (64 hex digits)")
            kinds[layer.key] = layer.kind
            why = f"layer {names.escaped(layer.path, 80)} in {where}"
            live.tags.setdefault(names.layer_cache_tag(layer.kind, layer.key), why)
            digest = _digest(layer.digest, where, f"layers[{n}].digest")
            if digest is not None:
                live.layers.setdefault(digest, why)
            base = _digest(layer.base_digest, where, f"layers[{n}].base_digest")
            if base is not None:
                live.layers.setdefault(base, f"built on by {why}")  # a parent in the cache (a root's is elsewhere)
        for n, variant in enumerate(report.variants):
            why = f"variant {names.escaped(variant.id, 80)} in {where}"
            if not isinstance(variant.chain, list):
                raise InputError(where, None, f"variants[{n}].chain", "is not a list of layer keys")
            for m, key in enumerate(variant.chain):
                if not isinstance(key, str) or key not in kinds:
                    raise InputError(where, None, f"variants[{n}].chain[{m}]", "names no layer of the report")
                live.tags.setdefault(names.layer_cache_tag(kinds[key], key), f"chain of {why}")
            digest = _digest(variant.digest, where, f"variants[{n}].digest")
            if digest is not None:
                live.releases.setdefault(digest, why)
            for m, child in enumerate(variant.children):
                child_digest = _digest(child.digest, where, f"variants[{n}].children[{m}].digest")
                if child_digest is not None:
                    live.releases.setdefault(child_digest, f"{names.escaped(child.platform, 40)} of {why} ({short(digest or '')})")
    return live
