"""matrix.yaml: the model, loading, and validation with file:line errors.

Loading is pure apart from reading the one file: no registry, no docker. The result is
a validated `Matrix` whose `combinations` are already expanded with GitHub Actions
include/exclude semantics and checked against the support table.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.config.support import DEFAULT_PLATFORM, PLATFORMS, CudaPair, SupportTable, load_support_table
from imagebuild.core.source import Document, PathKey, Reader, known_list, load_document, suggest
from imagebuild.oci.compression import DEFAULT as DEFAULT_COMPRESSION
from imagebuild.oci.compression import Compression, parse_compression

SCHEMA_VERSION = 1
AXES = ("os", "cuda", "python", "paddle")
CPU = "cpu"  # the cuda axis value for a CPU-only variant

# Build secrets the templates know how to mount, and where.
SECRET_KINDS = {
    "ca-bundle": "PEM CA bundle for a TLS-intercepting proxy (pip, apt over https)",
    "pip-conf": "a pip configuration file, e.g. an index-url with credentials",
    "netrc": "a .netrc with package-index credentials",
}
LAYER_KINDS = ("base", "cuda", "python", "paddle")
CUDA_PROVIDERS = ("image", "wheels")
OS_FAMILIES = ("debian", "ubuntu")

_NAME = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$")
_VERSION = re.compile(r"^\d+(?:\.\d+){0,3}$")
_PYTHON = re.compile(r"^3\.\d{1,2}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(?::\d{1,5})?$")
_IMAGE = re.compile(r"^[a-z0-9]+(?:[._/:-][a-zA-Z0-9]+)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
_LABEL_KEY = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$")
# A Debian package spec as apt-get install takes it: name[:arch][=version | /release].
_APT_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(?::[a-z0-9-]+)?(?:=[A-Za-z0-9.+~:-]+|/[a-z0-9.-]+)?$")
# A PEP 508 requirement without a URL: name[extras] specifiers ; marker. It reaches pip as one
# quoted shell word, so operators and markers are data; this only keeps out what pip can't read.
_PIP_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PIP_SPEC = r"(?:===|==|!=|<=|>=|~=|<|>)[ \t]*[A-Za-z0-9.*+!_-]+"
_MARKER_VALUE = r"""(?:[a-z_]+|'[A-Za-z0-9 ._*+!<>=~-]*'|"[A-Za-z0-9 ._*+!<>=~-]*")"""
# Whitespace sits only between tokens, never in two quantifiers side by side: no backtracking blow-up.
_MARKER_TEST = (rf"(?:\([ \t]*)*{_MARKER_VALUE}[ \t]*(?:<=|<|!=|===|==|>=|>|~=|not[ \t]+in|in)[ \t]*"
                rf"{_MARKER_VALUE}(?:[ \t]*\))*")
_PIP_MARKER = rf"{_MARKER_TEST}(?:[ \t]+(?:and|or)[ \t]+{_MARKER_TEST})*[ \t]*"
_PIP_REQUIREMENT = re.compile(
    rf"(?P<name>{_PIP_NAME})(?:[ \t]*\[[ \t]*{_PIP_NAME}(?:[ \t]*,[ \t]*{_PIP_NAME})*[ \t]*\])?"
    rf"(?:[ \t]*(?P<specs>\(?[ \t]*{_PIP_SPEC}(?:[ \t]*,[ \t]*{_PIP_SPEC})*(?:[ \t]*\))?))?"
    rf"(?:[ \t]*;[ \t]*{_PIP_MARKER})?[ \t]*")
PIP_REQUIREMENT_MAX = 300  # characters; also bounds the pattern's work on a hostile string
# Launchpad's ppa:<owner>/<archive>.
_PPA = re.compile(r"^[a-z0-9][a-z0-9.+-]*/[a-z0-9][a-z0-9.+-]*$")
_USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_URL = re.compile(r"^https?://[^\s/@]+(/\S*)?$")
# Line breaks (including the Unicode ones) and other control characters: in a Dockerfile a
# line break ends the instruction, so a value holding one could write instructions of its own.
_NOT_ONE_LINE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
# BuildKit reads `<<WORD` in a RUN line as a heredoc whose body is the following lines.
_HEREDOC = re.compile(r"(?<!<)<<(?!<)")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TAG_FIELDS = ("paddle", "cuda", "cudnn", "python", "python_nodot", "os", "device", "py_suffix")


@dataclass(frozen=True)
class OSSpec:
    name: str
    image: str
    digest: str | None
    family: str
    python_ppa: str | None = None

    @property
    def reference(self) -> str:
        return f"{self.image}@{self.digest}" if self.digest else self.image


@dataclass(frozen=True)
class CudaSpec:
    name: str
    version: str
    cudnn: str
    provider: str
    image: str | None = None
    digest: str | None = None
    wheels: tuple[str, ...] = ()
    paddle_index_url: str | None = None

    @property
    def pair(self) -> CudaPair:
        return CudaPair(self.version, self.cudnn)

    @property
    def reference(self) -> str | None:
        if self.image is None:
            return None
        return f"{self.image}@{self.digest}" if self.digest else self.image


@dataclass(frozen=True)
class SecretRef:
    id: str
    file: str | None = None
    env: str | None = None
    optional: bool = False  # build without it when this host lacks it


@dataclass(frozen=True)
class LayerSettings:
    packages: tuple[str, ...] = ()
    pip_packages: tuple[str, ...] = ()
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    run: tuple[str, ...] = ()


# How many layers the CUDA wheels' and Paddle's pip installs are each spread over by default: a puller
# fetches about three layers at once (containerd's and Docker's default), and a 3 GB install in four
# parts keeps each stream under a gigabyte.
DEFAULT_PIP_LAYER_PARTS = 4
MAX_PIP_LAYER_PARTS = 16


@dataclass(frozen=True)
class PipLayers:
    """`pip_layers`: the big pip installs (CUDA wheels, Paddle) as several layers (imagebuild/build/layersplit.py)."""

    parts: int = DEFAULT_PIP_LAYER_PARTS  # 1: one layer each, as before the split
    max_part_mib: int | None = None  # the build fails when a part would hold more (unpacked)

    @property
    def max_bytes(self) -> int | None:
        return None if self.max_part_mib is None else self.max_part_mib << 20


@dataclass(frozen=True)
class ExtraLayer:
    name: str
    settings: LayerSettings
    when: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def applies_to(self, axes: dict[str, str]) -> bool:
        return all(axes[axis] in values for axis, values in self.when)


@dataclass(frozen=True)
class UserSpec:
    name: str = "paddle"
    uid: int = 1000
    gid: int = 1000


@dataclass(frozen=True)
class Combination:
    """One expanded matrix cell: an axis value per axis, plus what include entries added."""

    os: str
    cuda: str
    python: str
    paddle: str
    tags: tuple[str, ...] | None = None
    labels: tuple[tuple[str, str], ...] = ()
    origin: PathKey = ()  # where it came from, for error lines
    tags_origin: PathKey = ()  # the include entry's `tags`, when one gave this cell its tags
    # Extra smoke tests an include entry adds (absolute paths). Tests, not image content:
    # nothing in plan.py reads them, so they never change a layer's content key.
    smoke: tuple[str, ...] = ()
    # The platforms this variant is built for (one image per platform; with two or more, an OCI
    # image index of them). Not an axis: every platform of a variant shares its tags.
    platforms: tuple[str, ...] = (DEFAULT_PLATFORM,)
    platforms_origin: PathKey = ()  # where the platforms were given, for error lines
    # How the release image's layers are pushed (the lower layers stay gzip: BuildKit's cache follows
    # their blobs). Part of the release layer's content key when not gzip.
    compression: Compression = DEFAULT_COMPRESSION

    @property
    def device(self) -> str:
        return "cpu" if self.cuda == CPU else "gpu"

    @property
    def axes(self) -> dict[str, str]:
        return {"os": self.os, "cuda": self.cuda, "python": self.python, "paddle": self.paddle}


@dataclass(frozen=True)
class Matrix:
    file: str
    registry: str
    project: str
    repository: str
    cache_repository: str
    source: str | None
    labels: tuple[tuple[str, str], ...]
    secrets: tuple[SecretRef, ...]
    user: UserSpec
    setuid_allowlist: tuple[str, ...]
    os: dict[str, OSSpec]
    cuda: dict[str, CudaSpec]
    layers: dict[str, LayerSettings]
    extra_layers: tuple[ExtraLayer, ...]
    tags: dict[str, tuple[str, ...]]
    combinations: tuple[Combination, ...]
    # Extra smoke tests by layer kind, extra layer name or 'all' (absolute paths); see SMOKE_ALL.
    smoke: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pip_layers: PipLayers = PipLayers()
    document: Document = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @property
    def secret_ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.secrets)

    def line_of(self, path: PathKey) -> int | None:
        return self.document.line(path) if self.document else None


def load_matrix(path: str | Path, support: SupportTable | None = None) -> Matrix:
    doc = load_document(path, display_name=_display(path), merge_keys=True)  # os entries may share settings
    return MatrixParser(doc, support or load_support_table()).parse()


def _display(path: str | Path) -> str:
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


TOP_LEVEL = ("schema", "name", "registry", "project", "repository", "cache_repository", "source",
             "labels", "secrets", "user", "setuid_allowlist", "os", "cuda", "matrix", "tags",
             "layers", "extra_layers", "allow_unsupported", "smoke", "platforms", "compression",
             "pip_layers")
SMOKE_ALL = "all"  # the `smoke` key whose tests run in every variant


# The most combinations one matrix may expand to (the plan benchmark's scale is 1,000 variants).
MAX_COMBINATIONS = 5_000


class MatrixParser:
    def __init__(self, doc: Document, support: SupportTable):
        self.doc = doc
        self.r = Reader(doc)
        self.support = support

    def parse(self) -> Matrix:
        r, data = self.r, self.doc.data
        top = r.mapping(data, (), allowed=TOP_LEVEL,
                        required=("schema", "registry", "project", "repository", "os", "matrix", "tags"))
        schema = r.integer(top["schema"], ("schema",))
        if schema != SCHEMA_VERSION:
            raise r.error(("schema",), f"unsupported schema {schema} (this imagebuild reads schema {SCHEMA_VERSION})")
        registry = self._line(top["registry"], ("registry",))
        if not _REGISTRY.fullmatch(registry):
            raise r.error(("registry",), f"'{registry}' is not a registry host[:port]")
        project = self._name(top["project"], ("project",))
        repository = self._name(top["repository"], ("repository",))
        cache_repository = self._name(top.get("cache_repository", "layers"), ("cache_repository",))
        source = self._url(top["source"], ("source",)) if "source" in top else None
        labels = self._labels(top.get("labels", {}), ("labels",))
        secrets = self._secrets(top.get("secrets", {}), ("secrets",))
        user = self._user(top.get("user", {}), ("user",))
        allowlist = self._setuid_allowlist(top.get("setuid_allowlist", []), ("setuid_allowlist",))
        os_specs = self._os_catalog(top["os"], ("os",))
        cuda_specs = self._cuda_catalog(top.get("cuda", {}), ("cuda",))
        layers = self._layers(top.get("layers", {}), ("layers",))
        extra = self._extra_layers(top.get("extra_layers", []), ("extra_layers",))
        smoke = self._smoke(top.get("smoke", {}), ("smoke",), extra)
        tags = self._tags(top["tags"], ("tags",))
        allowed = self._allow_unsupported(top.get("allow_unsupported", []), ("allow_unsupported",))
        platforms = self._platforms_by_device(top.get("platforms", {}), ("platforms",))
        compression = self._compression(top["compression"], ("compression",)) if "compression" in top \
            else DEFAULT_COMPRESSION
        pip_layers = self._pip_layers(top.get("pip_layers", {}), ("pip_layers",))
        combos = self._expand(top["matrix"], ("matrix",), os_specs, cuda_specs, platforms, compression)
        self._check_extra_layers_apply(extra, combos)
        self._check_support(combos, cuda_specs, allowed)
        return Matrix(
            file=self.doc.file, registry=registry, project=project, repository=repository,
            cache_repository=cache_repository, source=source, labels=labels, secrets=secrets,
            user=user, setuid_allowlist=allowlist, os=os_specs, cuda=cuda_specs, layers=layers,
            extra_layers=extra, tags=tags, combinations=tuple(combos), smoke=smoke, pip_layers=pip_layers,
            document=self.doc,
        )

    # --- scalar kinds ---------------------------------------------------------------

    def _name(self, value: Any, path: PathKey) -> str:
        text = self._line(value, path)
        if not _NAME.fullmatch(text):
            raise self.r.error(path, f"'{text}' must be lowercase letters, digits and . _ - (like a Harbor project or repository)")
        return text

    def _url(self, value: Any, path: PathKey) -> str:
        text = self._line(value, path)
        if not _URL.fullmatch(text):
            shown = re.sub(r"//\S*@", "//***@", text)  # never echo credentials into a CI log
            raise self.r.error(path, f"'{shown}' is not an http(s) URL without credentials")
        return text

    def _image(self, value: Any, path: PathKey) -> str:
        text = self._line(value, path)
        if "@" in text:
            raise self.r.error(path, "give the digest in its own 'digest' key, not after '@'")
        if not _IMAGE.fullmatch(text):
            raise self.r.error(path, f"'{text}' is not an image reference")
        return text

    def _digest(self, value: Any, path: PathKey) -> str:
        text = self._line(value, path)
        if not _DIGEST.fullmatch(text):
            raise self.r.error(path, f"'{text}' is not a digest (sha256: followed by 64 hex digits)")
        return text

    def _version(self, value: Any, path: PathKey, what: str) -> str:
        text = self._line(value, path)
        if not _VERSION.fullmatch(text):
            raise self.r.error(path, f"'{text}' is not a {what} version like 11.8")
        return text

    def _python(self, value: Any, path: PathKey) -> str:
        text = self._line(value, path)
        if not _PYTHON.fullmatch(text):
            raise self.r.error(path, f"'{text}' is not a Python version like 3.11")
        return text

    def _pip_layers(self, value: Any, path: PathKey) -> PipLayers:
        spec = self.r.mapping(value, path, allowed=("parts", "max_part_mib"))
        parts = self.r.integer(spec.get("parts", DEFAULT_PIP_LAYER_PARTS), path + ("parts",),
                               minimum=1, maximum=MAX_PIP_LAYER_PARTS)
        limit = None
        if "max_part_mib" in spec:
            # 1 TiB: beyond any layer a registry takes, and the bytes stay a plain integer in the RUN line.
            limit = self.r.integer(spec["max_part_mib"], path + ("max_part_mib",), minimum=1, maximum=1 << 20)
            if parts == 1:
                raise self.r.error(path + ("max_part_mib",), "bounds a part, and parts: 1 splits nothing "
                                                             "(the install stays one layer, as before)")
        return PipLayers(parts, limit)

    def _compression(self, value: Any, path: PathKey) -> Compression:
        text = self._line(value, path)
        try:
            return parse_compression(text)
        except ValueError as exc:
            raise self.r.error(path, str(exc)) from None

    def _line(self, value: Any, path: PathKey, non_empty: bool = True,
              hint: str = "a value written into a Dockerfile must be one line") -> str:
        """A string that goes into a Dockerfile: no line break or control character in it."""
        text = self.r.string(value, path, non_empty=non_empty)
        bad = _NOT_ONE_LINE.search(text)
        if bad:
            raise self.r.error(path, f"contains a line break or control character "
                                     f"(U+{ord(bad.group()):04X}); {hint}")
        return text

    def _lines(self, value: Any, path: PathKey, hint: str | None = None) -> tuple[str, ...]:
        items = self.r.sequence(value, path)
        if hint is None:
            return tuple(self._line(item, path + (i,)) for i, item in enumerate(items))
        return tuple(self._line(item, path + (i,), hint=hint) for i, item in enumerate(items))

    # --- sections -------------------------------------------------------------------

    def _labels(self, value: Any, path: PathKey) -> tuple[tuple[str, str], ...]:
        labels = self.r.mapping(value, path)
        out = []
        for key, val in labels.items():
            if not _LABEL_KEY.fullmatch(key):
                raise self.r.error(path + (key,), "label keys are lowercase reverse-DNS names like org.example.team")
            if key.startswith("org.opencontainers.image."):
                raise self.r.error(path + (key,), "OCI labels are set by imagebuild from the matrix; use your own namespace")
            out.append((key, self._line(val, path + (key,), non_empty=False)))
        return tuple(sorted(out))

    def _secrets(self, value: Any, path: PathKey) -> tuple[SecretRef, ...]:
        secrets = self.r.mapping(value, path)
        out = []
        for sid, ref in secrets.items():
            p = path + (sid,)
            if sid not in SECRET_KINDS:
                raise self.r.error(p, f"unknown build secret{suggest(sid, SECRET_KINDS)} (known: {', '.join(SECRET_KINDS)})")
            if isinstance(ref, dict) and "value" in ref:
                raise self.r.error(p + ("value",), "secrets are referenced by 'file' or 'env', never written into the matrix")
            if not isinstance(ref, dict):
                # Never echo it: a scalar here is most likely the secret itself.
                raise self.r.error(p, "expected a mapping with 'file' or 'env'; secrets are referenced, "
                                      "never written into the matrix")
            ref = self.r.mapping(ref, p, allowed=("file", "env", "optional", "description"))
            if ("file" in ref) == ("env" in ref):
                raise self.r.error(p, "give exactly one of 'file' (a path) or 'env' (a variable name)")
            optional = self.r.boolean(ref.get("optional", False), p + ("optional",))
            if "env" in ref:
                env = self.r.string(ref["env"], p + ("env",))
                if not _ENV_NAME.fullmatch(env):
                    raise self.r.error(p + ("env",), f"'{env}' is not an environment variable name")
                out.append(SecretRef(sid, env=env, optional=optional))
            else:
                out.append(SecretRef(sid, file=self.r.string(ref["file"], p + ("file",)), optional=optional))
        return tuple(out)

    def _user(self, value: Any, path: PathKey) -> UserSpec:
        spec = self.r.mapping(value, path, allowed=("name", "uid", "gid"))
        name = spec.get("name", "paddle")
        name = self._line(name, path + ("name",))
        if not _USER_NAME.fullmatch(name):
            raise self.r.error(path + ("name",), f"'{name}' is not a valid user name")
        uid = self.r.integer(spec.get("uid", 1000), path + ("uid",), minimum=1, maximum=2**31 - 2)
        gid = self.r.integer(spec.get("gid", 1000), path + ("gid",), minimum=1, maximum=2**31 - 2)
        return UserSpec(name, uid, gid)

    def _setuid_allowlist(self, value: Any, path: PathKey) -> tuple[str, ...]:
        # find(1) -path patterns: each reaches find as one quoted word, so * and ? are find's.
        items = self._lines(value, path)
        for i, item in enumerate(items):
            if not item.startswith("/"):
                raise self.r.error(path + (i,), f"'{item}' is not an absolute path")
        return items

    def _os_catalog(self, value: Any, path: PathKey) -> dict[str, OSSpec]:
        catalog = self.r.mapping(value, path)
        if not catalog:
            raise self.r.error(path, "must name at least one OS base image")
        out = {}
        for name, spec in catalog.items():
            p = path + (name,)
            self._name(name, p)
            spec = self.r.mapping(spec, p, allowed=("image", "digest", "family", "python_ppa"),
                                  required=("image", "family"))
            family = self.r.string(spec["family"], p + ("family",))
            if family not in OS_FAMILIES:
                raise self.r.error(p + ("family",), f"'{family}' is not one of {', '.join(OS_FAMILIES)}")
            ppa = None
            if "python_ppa" in spec:
                ppa = self._line(spec["python_ppa"], p + ("python_ppa",))
                if not _PPA.fullmatch(ppa):
                    raise self.r.error(p + ("python_ppa",), f"'{ppa}' is not a Launchpad PPA like deadsnakes/ppa")
                if family != "ubuntu":
                    raise self.r.error(p + ("python_ppa",), "PPAs exist only on ubuntu")
            out[name] = OSSpec(
                name=name, image=self._image(spec["image"], p + ("image",)),
                digest=self._digest(spec["digest"], p + ("digest",)) if "digest" in spec else None,
                family=family, python_ppa=ppa,
            )
        return out

    def _cuda_catalog(self, value: Any, path: PathKey) -> dict[str, CudaSpec]:
        catalog = self.r.mapping(value, path)
        out = {}
        for name, spec in catalog.items():
            p = path + (name,)
            if name == CPU:
                raise self.r.error(p, f"'{CPU}' is reserved for CPU-only variants")
            spec = self.r.mapping(spec, p, allowed=("version", "cudnn", "provider", "image", "digest",
                                                   "wheels", "paddle_index_url"),
                                  required=("version", "cudnn", "provider"))
            provider = self.r.string(spec["provider"], p + ("provider",))
            if provider not in CUDA_PROVIDERS:
                raise self.r.error(p + ("provider",), f"'{provider}' is not one of {', '.join(CUDA_PROVIDERS)}")
            image = digest = None
            wheels: tuple[str, ...] = ()
            if provider == "image":
                if "image" not in spec:
                    raise self.r.error(p, "provider 'image' needs 'image' (e.g. nvidia/cuda:11.8.0-cudnn8-runtime-ubuntu22.04)")
                if "wheels" in spec:
                    raise self.r.error(p + ("wheels",), "'wheels' is for provider 'wheels'")
                image = self._image(spec["image"], p + ("image",))
                if "digest" in spec:
                    digest = self._digest(spec["digest"], p + ("digest",))
            else:
                for key in ("image", "digest"):
                    if key in spec:
                        raise self.r.error(p + (key,), f"'{key}' is for provider 'image'; provider 'wheels' builds on the OS base")
                if "wheels" not in spec:
                    raise self.r.error(p, "provider 'wheels' needs 'wheels' (pinned NVIDIA pip packages)")
                wheels = self._pip_requirements(spec["wheels"], p + ("wheels",), pinned=True, non_empty=True)
            out[name] = CudaSpec(
                name=name, version=self._version(spec["version"], p + ("version",), "CUDA"),
                cudnn=self._version(spec["cudnn"], p + ("cudnn",), "cuDNN"), provider=provider,
                image=image, digest=digest, wheels=wheels,
                paddle_index_url=self._url(spec["paddle_index_url"], p + ("paddle_index_url",))
                if "paddle_index_url" in spec else None,
            )
        return out

    def _apt_packages(self, value: Any, path: PathKey) -> tuple[str, ...]:
        items = self._lines(value, path)
        for i, item in enumerate(items):
            if not _APT_PACKAGE.fullmatch(item):
                raise self.r.error(path + (i,), f"'{item}' is not a Debian package name "
                                                "(name, name:arch, name=version or name/release)")
        return items

    def _pip_requirements(self, value: Any, path: PathKey, pinned: bool = False,
                          non_empty: bool = False) -> tuple[str, ...]:
        items = self._lines(value, path)
        if non_empty and not items:
            raise self.r.error(path, "must not be empty")
        for i, item in enumerate(items):
            if len(item) > PIP_REQUIREMENT_MAX:
                raise self.r.error(path + (i,), f"longer than {PIP_REQUIREMENT_MAX} characters; "
                                                "not a pip requirement")
            requirement = _PIP_REQUIREMENT.fullmatch(item)
            if not requirement:
                raise self.r.error(path + (i,), f"'{item}' is not a pip requirement like name==1.2.3 "
                                                "or name[extra]>=1.2,<2; python_version < \"3.12\"")
            if pinned and "==" not in (requirement.group("specs") or ""):
                raise self.r.error(path + (i,), f"'{item}' must be pinned with ==")
        return items

    def _layer_settings(self, value: Any, path: PathKey, allowed: tuple[str, ...]) -> LayerSettings:
        spec = self.r.mapping(value, path, allowed=allowed)
        env = self.r.mapping(spec.get("env", {}), path + ("env",))
        env_items = []
        for key, val in env.items():
            if not _ENV_NAME.fullmatch(key):
                raise self.r.error(path + ("env", key), f"'{key}' is not an environment variable name")
            text = self._line(val, path + ("env", key), non_empty=False)
            if re.search(r"(?i)(password|token|secret|credential)", key):
                raise self.r.error(path + ("env", key), "credentials never go into ENV (they persist in the image); use a build secret")
            env_items.append((key, text))
        pip = self.r.mapping(spec.get("pip", {}), path + ("pip",),
                             allowed=("index_url", "extra_index_urls", "packages"))
        return LayerSettings(
            packages=self._apt_packages(spec.get("packages", []), path + ("packages",)),
            pip_packages=self._pip_requirements(pip.get("packages", []), path + ("pip", "packages")),
            index_url=self._url(pip["index_url"], path + ("pip", "index_url")) if "index_url" in pip else None,
            extra_index_urls=tuple(self._url(u, path + ("pip", "extra_index_urls", i))
                                   for i, u in enumerate(self.r.sequence(pip.get("extra_index_urls", []),
                                                                         path + ("pip", "extra_index_urls")))),
            env=tuple(sorted(env_items)),
            run=self._run_steps(spec.get("run", []), path + ("run",)),
        )

    def _run_steps(self, value: Any, path: PathKey) -> tuple[str, ...]:
        """`run:` is the deliberate escape hatch: each step is shell, rendered verbatim, so a
        matrix (from a pull request too) runs whatever it says in the build. It must still be
        one Dockerfile line, or it would end its RUN and write instructions of its own."""
        steps = self._lines(value, path, hint="a run step is one line of shell; "
                                              "split it into several steps or join commands with &&")
        for i, step in enumerate(steps):
            if step.rstrip().endswith("\\"):
                raise self.r.error(path + (i,), "a run step must not end in a backslash "
                                                "(it would continue into the next Dockerfile line)")
            if _HEREDOC.search(step):
                raise self.r.error(path + (i,), "a heredoc (<<) in a run step would take the Dockerfile "
                                                "lines after it as its body; use a here-string (<<<)")
        return steps

    def _layers(self, value: Any, path: PathKey) -> dict[str, LayerSettings]:
        spec = self.r.mapping(value, path, allowed=LAYER_KINDS)
        return {kind: self._layer_settings(spec.get(kind, {}), path + (kind,),
                                           ("packages", "pip", "env", "run"))
                for kind in LAYER_KINDS}

    def _extra_layers(self, value: Any, path: PathKey) -> tuple[ExtraLayer, ...]:
        items = self.r.sequence(value, path)
        out, seen = [], set()
        for i, item in enumerate(items):
            p = path + (i,)
            spec = self.r.mapping(item, p, allowed=("name", "packages", "pip", "env", "run", "when"),
                                  required=("name",))
            name = self._name(spec["name"], p + ("name",))
            if name in seen:
                raise self.r.error(p + ("name",), f"extra layer '{name}' is defined twice")
            seen.add(name)
            when = self.r.mapping(spec.get("when", {}), p + ("when",), allowed=AXES)
            conditions = []
            for axis, values in when.items():
                vals = values if isinstance(values, list) else [values]
                conditions.append((axis, tuple(self.r.string(v, p + ("when", axis)) for v in vals)))
            settings = self._layer_settings({k: v for k, v in spec.items() if k not in ("name", "when")},
                                            p, ("packages", "pip", "env", "run"))
            if not (settings.packages or settings.pip_packages or settings.run):
                raise self.r.error(p, f"extra layer '{name}' installs nothing (give packages, pip.packages or run)")
            out.append(ExtraLayer(name=name, settings=settings, when=tuple(conditions)))
        return tuple(out)

    def _smoke(self, value: Any, path: PathKey, extra: tuple[ExtraLayer, ...]) -> dict[str, tuple[str, ...]]:
        """`smoke: {<layer kind | extra layer name | all>: [paths]}`: extra smoke tests to run in
        every variant whose chain has that layer (or in all variants)."""
        spec = self.r.mapping(value, path, allowed=(SMOKE_ALL, *LAYER_KINDS, *(e.name for e in extra)))
        return {kind: self._smoke_paths(paths, path + (kind,)) for kind, paths in spec.items()}

    def _smoke_paths(self, value: Any, path: PathKey) -> tuple[str, ...]:
        """Test files or folders relative to the matrix file; each must exist now, because a
        missing one would otherwise surface only as 'no tests ran' inside an image."""
        items = self.r.strings(value, path)
        if not items:
            raise self.r.error(path, "must list at least one test file or folder")
        base = Path(self.doc.file).parent.resolve()
        out: list[str] = []
        for i, item in enumerate(items):
            if Path(item).is_absolute():
                raise self.r.error(path + (i,), f"'{item}' must be relative to the matrix file")
            # Confined to the matrix's folder after resolving links: the paths are bind-mounted
            # into containers and read here, and the matrix may come from a pull request.
            target = (base / item).resolve()
            if not target.is_relative_to(base):
                raise self.r.error(path + (i,), f"'{item}' leads outside the matrix's folder "
                                                "(after resolving '..' and links)")
            if not target.exists():
                raise self.r.error(path + (i,), f"'{item}' does not exist (looked for {target})")
            problem = _link_out_of(target, base)
            if problem is not None:
                raise self.r.error(path + (i,), f"'{item}' {problem}")
            if target.is_file() and target.suffix != ".py":
                raise self.r.error(path + (i,), f"'{item}' is not a Python test file or a folder")
            if not (target.is_file() or target.is_dir()):
                raise self.r.error(path + (i,), f"'{item}' is not a file or a folder")
            if str(target) in out:
                raise self.r.error(path + (i,), f"'{item}' is listed twice")
            out.append(str(target))
        return tuple(out)

    def _tag_templates(self, value: Any, path: PathKey) -> tuple[str, ...]:
        items = self._lines(value, path)
        if not items:
            raise self.r.error(path, "must list at least one tag template")
        sample = {f: "x" for f in TAG_FIELDS} | {"py_suffix": ""}
        for i, template in enumerate(items):
            try:
                rendered = template.format_map(_StrictFields(sample))
            except KeyError as exc:
                field_name = exc.args[0]
                raise self.r.error(path + (i,), f"unknown field {{{field_name}}}{suggest(field_name, TAG_FIELDS)} "
                                                 f"(known: {', '.join(TAG_FIELDS)})") from None
            except (ValueError, IndexError, AttributeError) as exc:
                raise self.r.error(path + (i,), f"bad tag template: {exc}") from None
            if not _TAG.fullmatch(rendered):
                raise self.r.error(path + (i,), f"'{template}' cannot give a valid tag (letters, digits, _ . -)")
        return items

    def _tags(self, value: Any, path: PathKey) -> dict[str, tuple[str, ...]]:
        spec = self.r.mapping(value, path, allowed=("gpu", "cpu"), required=("gpu", "cpu"))
        return {device: self._tag_templates(spec[device], path + (device,)) for device in ("gpu", "cpu")}

    def _allow_unsupported(self, value: Any, path: PathKey) -> list[tuple[dict[str, str], PathKey]]:
        items = self.r.sequence(value, path)
        out = []
        for i, item in enumerate(items):
            p = path + (i,)
            spec = self.r.mapping(item, p, allowed=AXES + ("platform", "reason"), required=("reason",))
            reason = self.r.string(spec["reason"], p + ("reason",))
            if len(reason.strip()) < 10:
                raise self.r.error(p + ("reason",), "say why in a sentence (at least 10 characters)")
            match = {k: self.r.string(v, p + (k,)) for k, v in spec.items() if k in AXES + ("platform",)}
            if not match:
                raise self.r.error(p, "name at least one of os, cuda, python, paddle, platform")
            out.append((match, p))
        return out

    # --- expansion ------------------------------------------------------------------

    def _axis_values(self, matrix: dict[str, Any], path: PathKey, axis: str, os_specs: dict[str, OSSpec], cuda_specs: dict[str, CudaSpec]) -> list[str]:
        p = path + (axis,)
        values = self.r.sequence(matrix[axis], p, non_empty=True)
        out = []
        for i, value in enumerate(values):
            text = self._axis_value(axis, value, p + (i,), os_specs, cuda_specs)
            if text in out:
                raise self.r.error(p + (i,), f"'{text}' is listed twice")
            out.append(text)
        return out

    def _axis_value(self, axis: str, value: Any, path: PathKey, os_specs: dict[str, OSSpec],
                    cuda_specs: dict[str, CudaSpec]) -> str:
        if axis == "python":
            return self._python(value, path)
        text = self._line(value, path)
        if axis == "os" and text not in os_specs:
            raise self.r.error(path, f"'{text}' is not in the os catalog{suggest(text, os_specs)} (known: {known_list(os_specs)})")
        if axis == "cuda" and text != CPU and text not in cuda_specs:
            known = [CPU, *cuda_specs]
            raise self.r.error(path, f"'{text}' is not in the cuda catalog{suggest(text, known)} (known: {known_list(known)})")
        if axis == "paddle":
            if not _VERSION.fullmatch(text):
                raise self.r.error(path, f"'{text}' is not a Paddle version like 3.0.0")
            if text not in self.support.paddle:
                raise self.r.error(path, f"'{text}' is not in the support table (known: {known_list(self.support.paddle_versions(), 6)})")
        return text

    def _platform_list(self, value: Any, path: PathKey) -> tuple[str, ...]:
        items = self.r.sequence(value, path, non_empty=True)
        out: list[str] = []
        for i, item in enumerate(items):
            text = self._line(item, path + (i,))
            if text not in PLATFORMS:
                raise self.r.error(path + (i,), f"'{text}' is not a platform imagebuild builds"
                                                f"{suggest(text, PLATFORMS)} (known: {', '.join(PLATFORMS)})")
            if text in out:
                raise self.r.error(path + (i,), f"'{text}' is listed twice")
            out.append(text)
        return tuple(out)

    def _platforms_by_device(self, value: Any, path: PathKey) -> dict[str, tuple[tuple[str, ...], PathKey]]:
        """`platforms: {cpu: [...], gpu: [...]}`: each device's platforms and where they were given."""
        spec = self.r.mapping(value, path, allowed=("cpu", "gpu"))
        default: tuple[tuple[str, ...], PathKey] = ((DEFAULT_PLATFORM,), ())
        out = {device: default for device in ("cpu", "gpu")}
        for device, listed in spec.items():
            out[device] = (self._platform_list(listed, path + (device,)), path + (device,))
        return out

    def _expand(self, value: Any, path: PathKey, os_specs: dict[str, OSSpec],
                cuda_specs: dict[str, CudaSpec], platforms: dict[str, tuple[tuple[str, ...], PathKey]],
                compression: Compression = DEFAULT_COMPRESSION) -> list[Combination]:
        matrix = self.r.mapping(value, path, allowed=AXES + ("exclude", "include"), required=AXES)
        axes = {axis: self._axis_values(matrix, path, axis, os_specs, cuda_specs) for axis in AXES}
        product = 1
        for axis in AXES:
            product *= len(axes[axis])
        # Counted before the product is built: a small file must not expand into minutes of work.
        if product > MAX_COMBINATIONS:
            raise self.r.error(path, f"the axes expand to {product:,} combinations, more than the "
                                     f"{MAX_COMBINATIONS:,} one matrix may hold; split it into several matrices")
        originals = [dict(zip(AXES, values)) for values in itertools.product(*(axes[a] for a in AXES))]

        for i, entry in enumerate(self.r.sequence(matrix.get("exclude", []), path + ("exclude",))):
            p = path + ("exclude", i)
            entry = self.r.mapping(entry, p, allowed=AXES)
            if not entry:
                raise self.r.error(p, "an empty exclude entry would remove every combination")
            wanted = {}
            for axis, val in entry.items():
                text = self._axis_value(axis, val, p + (axis,), os_specs, cuda_specs)
                if text not in axes[axis]:
                    raise self.r.error(p + (axis,), f"'{text}' is not among the matrix's {axis} values ({', '.join(axes[axis])})")
                wanted[axis] = text
            before = len(originals)
            originals = [c for c in originals if any(c[a] != v for a, v in wanted.items())]
            if len(originals) == before:
                raise self.r.error(p, "excludes no combination (already excluded above?)")

        combos = [_Cell(axes=c, origin=path) for c in originals]
        added: list[_Cell] = []
        for i, entry in enumerate(self.r.sequence(matrix.get("include", []), path + ("include",))):
            p = path + ("include", i)
            entry = self.r.mapping(entry, p, allowed=AXES + ("tags", "labels", "smoke", "platforms", "compression"))
            axis_part = {a: self._axis_value(a, entry[a], p + (a,), os_specs, cuda_specs)
                         for a in AXES if a in entry}
            extras: dict[str, Any] = {}
            if "tags" in entry:
                extras["tags"] = self._tag_templates(entry["tags"], p + ("tags",))
                extras["tags_origin"] = p + ("tags",)
            if "labels" in entry:
                extras["labels"] = self._labels(entry["labels"], p + ("labels",))
            if "smoke" in entry:
                extras["smoke"] = self._smoke_paths(entry["smoke"], p + ("smoke",))
            if "platforms" in entry:
                extras["platforms"] = self._platform_list(entry["platforms"], p + ("platforms",))
                extras["platforms_origin"] = p + ("platforms",)
            if "compression" in entry:
                extras["compression"] = self._compression(entry["compression"], p + ("compression",))
            # GitHub semantics: extend every original combination it does not contradict...
            matched = [c for c in combos if all(c.axes[a] == v for a, v in axis_part.items())]
            if matched:
                if not extras:
                    raise self.r.error(p, "matches existing combinations but adds nothing to them")
                for cell in matched:
                    cell.extras.update(extras)
                continue
            # ...otherwise it is a new combination of its own, and must name every axis.
            missing = [a for a in AXES if a not in axis_part]
            if missing:
                raise self.r.error(p, f"matches no combination, so it adds a new one, which needs {', '.join(missing)}")
            added.append(_Cell(axes=axis_part, origin=p, extras=dict(extras)))

        cells = combos + added
        if not cells:
            raise self.r.error(path, "expands to no combination at all")
        out = []
        for c in cells:
            device_platforms, device_origin = platforms["cpu" if c.axes["cuda"] == CPU else "gpu"]
            out.append(Combination(
                os=c.axes["os"], cuda=c.axes["cuda"], python=c.axes["python"], paddle=c.axes["paddle"],
                tags=c.extras.get("tags"), labels=c.extras.get("labels", ()), origin=c.origin,
                tags_origin=c.extras.get("tags_origin", ()), smoke=c.extras.get("smoke", ()),
                platforms=c.extras.get("platforms", device_platforms),
                platforms_origin=c.extras.get("platforms_origin", device_origin),
                compression=c.extras.get("compression", compression)))
        return out

    def _check_extra_layers_apply(self, extra: tuple[ExtraLayer, ...], combos: list[Combination]) -> None:
        """Like an exclude that excludes nothing, a `when` that matches no variant is a mistake."""
        for i, layer in enumerate(extra):
            if not any(layer.applies_to(c.axes) for c in combos):
                raise self.r.error(("extra_layers", i, "when"),
                                   f"extra layer '{layer.name}' applies to no variant of the matrix")

    def _check_support(self, combos: list[Combination], cuda_specs: dict[str, CudaSpec],
                       allowed: list[tuple[dict[str, str], PathKey]]) -> None:
        used = set()
        for combo in combos:
            pair = None if combo.cuda == CPU else cuda_specs[combo.cuda].pair
            for index, platform in enumerate(combo.platforms):
                problem = self.support.problem(combo.paddle, combo.python, pair, platform)
                if problem is None:
                    continue
                cell = combo.axes | {"platform": platform}
                waiver = next((i for i, (m, _) in enumerate(allowed)
                               if all(cell.get(k) == v for k, v in m.items())), None)
                if waiver is not None:
                    used.add(waiver)
                    continue
                raise self.r.error(self._blame(combo, pair, index),
                                   f"{problem}; exclude it or list it under allow_unsupported with a reason")
        for i, (_, p) in enumerate(allowed):
            if i not in used:
                raise self.r.error(p, "allows nothing: every combination it matches is supported or absent (remove it)")

    def _blame(self, combo: Combination, pair: CudaPair | None, index: int) -> PathKey:
        """Point an unsupported cell at what makes it unsupported: the platform entry when the rest
        of the cell is supported, else a product cell's axis value or the include entry that added it."""
        entry = self.support.paddle[combo.paddle]
        rest_supported = combo.python in entry.python and (entry.cpu if pair is None else pair in entry.gpu)
        if rest_supported and combo.platforms_origin:
            return combo.platforms_origin + (index,)
        if combo.origin != ("matrix",):
            return combo.origin
        matrix = self.doc.data["matrix"]
        axis = "python" if combo.python not in entry.python else "cuda"
        values = [str(v) for v in matrix[axis]]
        return ("matrix", axis, values.index(getattr(combo, axis)))


# The most entries one smoke folder may hold: it is walked for links at every load.
MAX_SMOKE_ENTRIES = 10_000


def _link_out_of(target: Path, base: Path) -> str | None:
    """What is wrong with folder `target`: a symbolic link in it resolving outside `base`, or too many entries."""
    if not target.is_dir():
        return None
    seen = 0
    for folder, dirs, files in os.walk(target):  # does not descend into linked folders
        for name in [*dirs, *files]:
            seen += 1
            if seen > MAX_SMOKE_ENTRIES:
                return f"holds more than {MAX_SMOKE_ENTRIES:,} files and folders; point at the tests themselves"
            entry = Path(folder) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(base):
                return f"holds a link that leads outside the matrix's folder: {entry.relative_to(base)}"
    return None


@dataclass
class _Cell:
    axes: dict[str, str]
    origin: PathKey
    extras: dict[str, Any] = field(default_factory=dict)


class _StrictFields(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        raise KeyError(key)

