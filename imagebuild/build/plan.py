"""Expansion into variants and a layer graph with content keys (pure: no I/O).

Each variant is a chain of layers, root first:

    base (OS + hardening) -> cuda (wheels provider)  -> python -> paddle [-> extra ...] -> release
    cuda (image provider: NVIDIA's image + hardening) -> python -> paddle [-> extra ...] -> release
    base (CPU variants)                               -> python -> paddle [-> extra ...] -> release

A layer's content key hashes its rendered files, its build args and its parent's key, so
identical layers across variants collapse into one node and a key changes exactly when
the layer would.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.build.render import SPLIT_SCRIPT, render_template, split_script
from imagebuild.config.matrix import _TAG, CPU, Combination, CudaSpec, ExtraLayer, LayerSettings, Matrix, OSSpec
from imagebuild.config.support import DEFAULT_PLATFORM
from imagebuild.core.source import InputError, PathKey, suggest
from imagebuild.oci import names
from imagebuild.oci.compression import DEFAULT as DEFAULT_COMPRESSION
from imagebuild.oci.compression import Compression

KEY_VERSION = 2  # 2: the platform is part of every key


@dataclass(frozen=True)
class Root:
    """The external image a root layer starts FROM."""

    image: str
    digest: str | None  # pinned in the matrix, or resolved from the registry at build time
    pinned: bool

    @property
    def reference(self) -> str:
        return f"{self.image}@{self.digest}" if self.digest else self.image


@dataclass(frozen=True)
class Layer:
    kind: str  # base, cuda, python, paddle, extra, release
    name: str
    key: str
    parent: str | None  # parent's key; None for a root layer
    files: tuple[tuple[str, str], ...]  # (path relative to the layer folder, content)
    build_args: tuple[tuple[str, str], ...]
    root: Root | None = None
    platform: str = DEFAULT_PLATFORM
    # How this layer's image is pushed: a variant's release layer may be zstd, every other layer is gzip.
    compression: Compression = DEFAULT_COMPRESSION
    # Files at the root of dockerfiles/ that this layer's build reads too (the layer split's program: one copy
    # for every layer that runs it). The build context is then that root; they are part of the key.
    shared: tuple[tuple[str, str], ...] = ()

    @property
    def path(self) -> str:
        """Folder under dockerfiles/."""
        return f"{self.kind}/{self.name}"

    def tree_files(self) -> dict[str, str]:
        """Every file its build reads, by path under dockerfiles/."""
        return {f"{self.path}/{name}": text for name, text in self.files} | dict(self.shared)

    @property
    def dockerfile(self) -> str:
        return dict(self.files)["Dockerfile"]

    @property
    def cache_tag(self) -> str:
        """Tag of this layer's image in the cache repository."""
        return names.layer_cache_tag(self.kind, self.key)


@dataclass(frozen=True)
class PlatformChain:
    """One platform's image of a variant: its layer keys, root first, release last."""

    platform: str
    chain: tuple[str, ...]

    @property
    def release(self) -> str:
        return self.chain[-1]


@dataclass(frozen=True)
class Variant:
    id: str
    os: str
    cuda: str | None  # CUDA version; None for CPU
    cudnn: str | None
    python: str
    paddle: str
    tags: tuple[str, ...]
    chain: tuple[str, ...]  # every layer key of every platform, each platform's root first, release last
    # One per platform, in the matrix's order. With two or more, the variant's image is an OCI image
    # index of their release layers; with one, that release layer's image itself.
    platform_chains: tuple[PlatformChain, ...]
    compression: Compression = DEFAULT_COMPRESSION  # the release image's (every platform's)

    @property
    def device(self) -> str:
        return "cpu" if self.cuda is None else "gpu"

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(p.platform for p in self.platform_chains)

    @property
    def multi_platform(self) -> bool:
        return len(self.platform_chains) > 1


@dataclass(frozen=True)
class Plan:
    matrix_file: str
    registry: str
    project: str
    repository: str
    cache_repository: str
    variants: tuple[Variant, ...]
    layers: dict[str, Layer]  # by key, parents before children

    @property
    def repository_ref(self) -> str:
        return f"{self.registry}/{self.project}/{self.repository}"

    @property
    def cache_ref(self) -> str:
        return f"{self.registry}/{self.project}/{self.cache_repository}"

    def users(self, key: str) -> list[str]:
        return [v.id for v in self.variants if key in v.chain]

    def shared_keys(self) -> set[str]:
        counts: dict[str, int] = {}
        for v in self.variants:
            for key in v.chain:
                counts[key] = counts.get(key, 0) + 1
        return {k for k, n in counts.items() if n > 1}

    def rendered_files(self) -> dict[str, str]:
        """Every generated file under dockerfiles/, by relative path."""
        return {path: content for layer in self.layers.values() for path, content in layer.tree_files().items()}

    def chain_length_total(self) -> int:
        return sum(len(v.chain) for v in self.variants)


def content_key(kind: str, files: Mapping[str, str], build_args: Mapping[str, str],
                parent: str | None, platform: str = DEFAULT_PLATFORM,
                compression: Compression = DEFAULT_COMPRESSION) -> str:
    payload: dict[str, Any] = {
        "v": KEY_VERSION,
        "kind": kind,
        "platform": platform,
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in sorted(files.items())},
        "args": dict(sorted(build_args.items())),
        "parent": parent,
    }
    if not compression.is_gzip:
        # The same build pushed otherwise is another image (other blobs, manifest and digest), so it
        # gets its own key and tag. Only then: every gzip layer keeps the key it always had.
        payload["compression"] = compression.spec
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


@dataclass
class _Builder:
    matrix: Matrix
    revision: str
    created: str
    resolved: Mapping[tuple[str, str], str]  # (image, platform) -> the digest of that platform's image
    templates_dir: str | None = None
    platform: str = DEFAULT_PLATFORM  # the platform the layers being added are for
    layers: dict[str, Layer] = field(default_factory=dict)
    names: dict[tuple[str, str], str] = field(default_factory=dict)  # (layer path, platform) -> key, to catch clashes
    # Identical inputs render identically. Most variants share their lower layers, so those
    # are rendered and keyed once per distinct (template, context, args, parent); the upper
    # ones are nearly always unique, where building the memo key would cost more than it saves.
    memo: dict[Any, str] = field(default_factory=dict)
    MEMO_KINDS = ("base", "cuda", "python")

    def __post_init__(self) -> None:
        self.matrix_file = Path(self.matrix.file).name

    def common(self, kind: str, name: str, settings: LayerSettings | None) -> dict[str, Any]:
        m = self.matrix
        return {
            "layer": {"kind": kind, "name": name, "matrix_file": self.matrix_file},
            "user": m.user,
            "secrets": m.secret_ids,
            "setuid_allowlist": m.setuid_allowlist,
            "settings": settings or LayerSettings(),
        }

    def add(self, kind: str, template: str, name: str, parent: str | None, context: dict[str, Any],
            build_args: dict[str, str] | None = None, root: Root | None = None,
            where: PathKey = ("matrix",), compression: Compression = DEFAULT_COMPRESSION,
            split: bool = False) -> str:
        """Render and key one layer; `where` is the matrix entry to blame for a folder clash; `split`: the
        Dockerfile runs the layer split, whose program it reads from the root of dockerfiles/."""
        args = dict(build_args or {})
        if root is not None and not root.pinned:
            # The Dockerfile names only the tag; the digest it resolves to is part of the key.
            args["IMAGEBUILD_BASE"] = root.reference
        memo = None
        if kind in self.MEMO_KINDS:
            memo = (template, name, parent, root, self.platform, _freeze(context), tuple(sorted(args.items())), split)
            if memo in self.memo:
                return self.memo[memo]
        files = {"Dockerfile": render_template(template, context, self.templates_dir)}
        shared = ((SPLIT_SCRIPT, split_script()),) if split else ()
        # A shared file is keyed under its path from the root ("/name"), which no file of the folder can have.
        keyed = files | {f"/{name}": text for name, text in shared}
        key = content_key(kind, keyed, args, parent, self.platform, compression)
        path = f"{kind}/{name}"
        if self.names.get((path, self.platform), key) != key:
            raise self.matrix.document.error(
                where, f"two different {kind} layers would share dockerfiles/{path}; "
                       "give the variants distinct catalog entries")
        self.names[(path, self.platform)] = key
        if key not in self.layers:
            self.layers[key] = Layer(kind=kind, name=name, key=key, parent=parent,
                                     files=tuple(sorted(files.items())),
                                     build_args=tuple(sorted(args.items())), root=root, platform=self.platform,
                                     compression=compression, shared=shared)
        if memo is not None:
            self.memo[memo] = key
        return key

    def root(self, image: str, digest: str | None) -> Root:
        """A pinned digest as written (an index names every platform's image); a tag by what it resolved
        to for this platform."""
        if digest:
            return Root(image, digest, pinned=True)
        return Root(image, self.resolved.get((image, self.platform)), pinned=False)


def build_plan(matrix: Matrix, revision: str = "unknown", created: str = "1970-01-01T00:00:00Z",
               resolved: Mapping[tuple[str, str], str] | None = None,
               templates_dir: str | Path | None = None) -> Plan:
    """Expand the matrix into variants and a deduplicated layer graph.

    `revision` and `created` go into the release layers' labels; `resolved` maps an unpinned base
    image and a platform to the digest the registry gave that platform's image (keys are
    provisional without).
    `templates_dir` renders from a folder of templates instead of the package's own.
    """
    b = _Builder(matrix, revision, created, resolved or {},
                 templates_dir=str(templates_dir) if templates_dir is not None else None)
    suffixes = _python_suffixes(matrix)
    variants = []
    ids: dict[str, Any] = {}
    for combo in matrix.combinations:
        os_spec = matrix.os[combo.os]
        cuda = None if combo.cuda == CPU else matrix.cuda[combo.cuda]
        variant_id = _variant_id(combo.paddle, cuda, combo.python, combo.os)
        lower = []
        for platform in combo.platforms:
            b.platform = platform
            lower.append((platform, *_chain(b, os_spec, cuda, combo.python, combo.paddle, combo.axes)))
        if variant_id in ids:
            raise matrix.document.error(combo.origin, f"gives variant '{variant_id}' twice")
        ids[variant_id] = combo
        tags = _tags(matrix, combo, cuda, suffixes[(combo.os, combo.cuda, combo.paddle)])
        chains = []
        for platform, chain, root in lower:
            b.platform = platform
            release = _release(b, variant_id, chain[-1], os_spec, cuda, root, combo, tags)
            chains.append(PlatformChain(platform, (*chain, release)))
        variants.append(Variant(id=variant_id, os=combo.os, cuda=cuda.version if cuda else None,
                                cudnn=cuda.cudnn if cuda else None, python=combo.python,
                                paddle=combo.paddle, tags=tags, chain=tuple(k for c in chains for k in c.chain),
                                platform_chains=tuple(chains), compression=combo.compression))
    _check_unique_tags(matrix, variants)
    return Plan(matrix_file=matrix.file, registry=matrix.registry, project=matrix.project,
                repository=matrix.repository, cache_repository=matrix.cache_repository,
                variants=tuple(variants), layers=b.layers)


def _chain(b: _Builder, os_spec: OSSpec, cuda: CudaSpec | None, python: str, paddle: str,
           axes: dict[str, str]) -> tuple[list[str], Root]:
    m = b.matrix
    chain: list[str] = []
    if cuda is not None and cuda.provider == "image":
        root = b.root(cuda.image or "", cuda.digest)
        # Named after the image, not the cuDNN label: two catalog entries on one image share it.
        name = (cuda.image or "").rsplit("/", 1)[-1].replace(":", "-")
        where: PathKey = ("cuda", cuda.name)
        ctx = b.common("cuda", name, m.layers["cuda"]) | {"root": root, "cuda": cuda}
        chain.append(b.add("cuda", "cuda-image", name, None, ctx, root=root, where=where))
    else:
        root = b.root(os_spec.image, os_spec.digest)
        name = os_spec.name
        where = ("os", os_spec.name)
        ctx = b.common("base", name, m.layers["base"]) | {"root": root}
        chain.append(b.add("base", "base", name, None, ctx, root=root, where=where))
        if cuda is not None:
            where = ("cuda", cuda.name)
            name = f"{name}-cuda{cuda.version}-cudnn{cuda.cudnn}-wheels"
            ctx = b.common("cuda", name, m.layers["cuda"]) | {"cuda": cuda, "split": m.pip_layers}
            chain.append(b.add("cuda", "cuda-wheels", name, chain[-1], ctx, where=where,
                               split=m.pip_layers.parts > 1))

    name = f"{name}-py{python}"
    ctx = b.common("python", name, m.layers["python"]) | {"python": python, "os": os_spec}
    chain.append(b.add("python", "python", name, chain[-1], ctx, where=where))

    name = f"{name}-paddle{paddle}"
    settings = m.layers["paddle"]
    pip_settings = settings
    if cuda is not None and cuda.paddle_index_url and not settings.index_url:
        pip_settings = LayerSettings(index_url=cuda.paddle_index_url,
                                     extra_index_urls=settings.extra_index_urls)
    ctx = b.common("paddle", name, settings) | {
        "paddle": paddle, "cuda": cuda, "pip_settings": pip_settings,
        "package": "paddlepaddle" if cuda is None else "paddlepaddle-gpu", "split": m.pip_layers,
    }
    chain.append(b.add("paddle", "paddle", name, chain[-1], ctx, where=where, split=m.pip_layers.parts > 1))

    for extra in m.extra_layers:
        if extra.applies_to(axes):
            chain.append(_extra(b, extra, f"{name}-{extra.name}", chain[-1], where))
            name = f"{name}-{extra.name}"
    return chain, root


def _extra(b: _Builder, extra: ExtraLayer, name: str, parent: str, where: PathKey) -> str:
    ctx = b.common("extra", name, extra.settings) | {"extra_name": extra.name}
    return b.add("extra", "extra", name, parent, ctx, where=where)


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a template context: dicts and lists become tuples.

    Every call site builds its context with the same keys in the same order, holding
    strings, tuples and frozen dataclasses, so equal stand-ins mean equal renders.
    """
    if isinstance(value, dict):
        return tuple((k, _freeze(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _release(b: _Builder, variant_id: str, parent: str, os_spec: OSSpec, cuda: CudaSpec | None,
             root: Root, combo: Combination, tags: tuple[str, ...]) -> str:
    m = b.matrix
    base_digest = root.digest if root.pinned else "${IMAGEBUILD_BASE_DIGEST}"
    labels = {
        "org.opencontainers.image.title": m.repository,
        "org.opencontainers.image.version": tags[0],
        "org.opencontainers.image.revision": "${IMAGEBUILD_REVISION}",
        "org.opencontainers.image.created": "${IMAGEBUILD_CREATED}",
        "org.opencontainers.image.base.name": root.image,
        "org.opencontainers.image.base.digest": base_digest,
        "io.imagebuild.variant": variant_id,
        "io.imagebuild.os": os_spec.name,
        "io.imagebuild.paddle.version": combo.paddle,
        "io.imagebuild.python.version": combo.python,
        "io.imagebuild.cuda.version": cuda.version if cuda else "none",
        "io.imagebuild.cudnn.version": cuda.cudnn if cuda else "none",
    }
    if m.source:
        labels["org.opencontainers.image.source"] = m.source
    labels.update(dict(m.labels))
    labels.update(dict(combo.labels))
    ctx = b.common("release", variant_id, None) | {
        "variant_id": variant_id, "root": root, "labels": sorted(labels.items()),
    }
    args = {"IMAGEBUILD_REVISION": b.revision, "IMAGEBUILD_CREATED": b.created}
    if not root.pinned:
        args["IMAGEBUILD_BASE_DIGEST"] = root.digest or "unresolved"
    return b.add("release", "release", variant_id, parent, ctx, build_args=args, compression=combo.compression)


def _variant_id(paddle: str, cuda: CudaSpec | None, python: str, os_name: str) -> str:
    device = "cpu" if cuda is None else f"cuda{cuda.version}-cudnn{cuda.cudnn}"
    return f"paddle{paddle}-{device}-py{python}-{os_name}"


def _python_suffixes(matrix: Matrix) -> dict[tuple[str, str, str], bool]:
    """A Python suffix goes on the tag only where one Paddle/CUDA pair ships for several Pythons."""
    pythons: dict[tuple[str, str, str], set[str]] = {}
    for c in matrix.combinations:
        pythons.setdefault((c.os, c.cuda, c.paddle), set()).add(c.python)
    return {k: len(v) > 1 for k, v in pythons.items()}


def _tags(matrix: Matrix, combo: Combination, cuda: CudaSpec | None, needs_suffix: bool) -> tuple[str, ...]:
    device = "cpu" if cuda is None else "gpu"
    templates = combo.tags or matrix.tags[device]
    fields = {
        "paddle": combo.paddle, "cuda": cuda.version if cuda else "", "cudnn": cuda.cudnn if cuda else "",
        "python": combo.python, "python_nodot": combo.python.replace(".", ""), "os": combo.os,
        "device": device, "py_suffix": f"-py{combo.python.replace('.', '')}" if needs_suffix else "",
    }
    tags = []
    for i, template in enumerate(templates):
        tag = template.format_map(fields)
        if not _TAG.match(tag):
            # The template checks passed on sample values; the real ones (an empty {cuda} on
            # a CPU variant, a {py_suffix} up front) can still give something no registry takes.
            where = combo.tags_origin + (i,) if combo.tags else ("tags", device, i)
            variant = _variant_id(combo.paddle, cuda, combo.python, combo.os)
            raise matrix.document.error(where, f"'{template}' gives the tag '{tag}' for {variant}, "
                                               "which is not a valid tag (letters, digits, _ . -, "
                                               "not starting with . or -)")
        tags.append(tag)
    return tuple(dict.fromkeys(tags))


def _check_unique_tags(matrix: Matrix, variants: list[Variant]) -> None:
    owner: dict[str, str] = {}
    for v, combo in zip(variants, matrix.combinations):
        for tag in v.tags:
            if tag in owner:
                raise matrix.document.error(combo.tags_origin if combo.tags else ("tags", v.device),
                                            f"tag '{tag}' is given to both {owner[tag]} and {v.id}; "
                                            "add {py_suffix} or {os} to the template")
            owner[tag] = v.id


MIN_KEY_PREFIX = 8


def find_layers(the_plan: Plan, refs: Iterable[str], option: str = "--layers") -> list[str]:
    """The keys `refs` name (a key, a unique key prefix of 8+ hex digits, or a path like base/debian12).

    Bad input (unknown, ambiguous, too short) raises InputError naming `option`.
    """
    by_path = {layer.path: key for key, layer in the_plan.layers.items()}
    keys: list[str] = []
    for ref in refs:
        if ref in by_path:
            keys.append(by_path[ref])
            continue
        matches = [k for k in the_plan.layers if k.startswith(ref)] if len(ref) >= MIN_KEY_PREFIX else []
        if len(matches) == 1:
            keys.append(matches[0])
        elif matches:
            raise InputError(option, None, ref, f"matches {len(matches)} layers; give more of the key")
        else:
            raise InputError(option, None, ref, "names no layer of the plan (a content key, a prefix of "
                                                f"{MIN_KEY_PREFIX}+ of its digits, or a path){suggest(ref, by_path)}")
    return list(dict.fromkeys(keys))


def with_ancestors(the_plan: Plan, keys: Iterable[str]) -> list[str]:
    """`keys` and every layer they are built on, parents first (the plan's order)."""
    wanted: set[str] = set()
    for key in keys:
        current: str | None = key
        while current is not None and current not in wanted:
            wanted.add(current)
            current = the_plan.layers[current].parent
    return [k for k in the_plan.layers if k in wanted]


# --- what `plan --format json|github-matrix` prints ---------------------------------------


def plan_record(the_plan: Plan, selected: set[str] | None = None) -> dict[str, Any]:
    """The plan as JSON (`plan --format json`): variants (those in `selected`, default all) and every layer."""
    shared = the_plan.shared_keys()
    return {
        "schema": "imagebuild.plan/v1",
        "matrix": the_plan.matrix_file,
        "repository": the_plan.repository_ref,
        "cache_repository": the_plan.cache_ref,
        "variants": [
            {
                "id": v.id, "os": v.os, "device": v.device, "cuda": v.cuda, "cudnn": v.cudnn,
                "python": v.python, "paddle": v.paddle, "tags": list(v.tags),
                "images": [f"{the_plan.repository_ref}:{t}" for t in v.tags],
                # Every platform's chain has the same folders (one Dockerfile builds each platform).
                "layers": [the_plan.layers[k].path for k in v.platform_chains[0].chain],
                "platforms": list(v.platforms),
                "index": v.multi_platform,
                "compression": v.compression.spec,
            }
            for v in the_plan.variants if selected is None or v.id in selected
        ],
        "layers": [
            {
                "key": layer.key, "kind": layer.kind, "path": layer.path, "platform": layer.platform,
                "parent": layer.parent,
                "cache_tag": layer.cache_tag, "shared": layer.key in shared, "compression": layer.compression.spec,
                "used_by": the_plan.users(layer.key),
                "from": layer.root.reference if layer.root else None,
                "from_pinned": layer.root.pinned if layer.root else None,
            }
            for layer in the_plan.layers.values()
        ],
        "summary": {
            "variants": len(the_plan.variants),
            "distinct_layers": len(the_plan.layers),
            "chain_layers_total": the_plan.chain_length_total(),
            "shared_layers": len(shared),
        },
    }


def github_matrix(the_plan: Plan, selected: set[str] | None = None) -> dict[str, Any]:
    """GitHub Actions strategy.matrix: one job per (selected) variant."""
    return {"include": [
        {"variant": v.id, "device": v.device, "paddle": v.paddle, "python": v.python,
         "cuda": v.cuda or "cpu", "tags": ",".join(v.tags), "platforms": ",".join(v.platforms)}
        for v in the_plan.variants if selected is None or v.id in selected
    ]}
