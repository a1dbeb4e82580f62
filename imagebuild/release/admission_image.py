"""`imagebuild admission image`: the webhook's own image, built by imagebuild and taken through the
same stages as the Paddle images, into a build report of its own.

The image (templates/admission.Dockerfile.j2) starts from the local Debian base, resolved to a
digest at build time as the matrix's bases are, and holds Debian's python3 and a virtual
environment with the imagebuild package and exactly the webhook's pinned, hash-checked
dependencies (WEBHOOK_REQUIREMENTS). It runs as uid 65532 (the Deployment's runAsUser), works on a
read-only root, has no shell (every shell /etc/shells names is removed in the last step; the entry
point is exec form) and no setuid or setgid file. The build reaches PyPI through the host's CA
bundle, mounted as the BuildKit secret `ca-bundle` for the steps that download, never a layer.

The build context is what the package is made of, from the checkout (`--source`, default this
one): pyproject.toml and imagebuild/ (no caches), plus the two requirements files written from
the pins below. Its tree hash goes into the layer's content key and into the image's
`io.imagebuild.source.sha256` label. The image carries no revision or build time on purpose: a
commit that touches neither file nor pin keeps the key, so a rerun builds, tests, scans and
signs nothing.

The image is the one layer of a one-variant plan (build.plan's Layer, Variant, Plan), so every
stage is that stage's own code: build.scheduler.Builder builds, pushes and tags it, and
ReleaseRun's scan, gate and sign run on it as on a matrix variant; only what the smoke suite
checks differs (smoke_tests/admission/, run by the same runner). The report is
WORKDIR/build-report.json; there `matrix` names pyproject.toml, the file the package and its
dependency ranges come from, and `matrix_sha256` is that file's hash (the provenance says so).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imagebuild.build import scheduler as building
from imagebuild.build.plan import Layer, Plan, PlatformChain, Root, Variant, content_key
from imagebuild.build.render import render_template, write_tree
from imagebuild.checks import smoke_run
from imagebuild.checks.smoke import Expectations, Target
from imagebuild.config.support import DEFAULT_PLATFORM
from imagebuild.config.trust import TrustConfig
from imagebuild.core.source import InputError
from imagebuild.oci import reference
from imagebuild.oci.client import ImageRef, Registry, RegistryError
from imagebuild.oci.platforms import platform_digest
from imagebuild.release.pipeline import ReleaseRun, VariantRelease
from imagebuild.trust.verify import covered_names

KIND = "admission"  # the layer kind (templates/admission.Dockerfile.j2)
VARIANT_ID = "imagebuild-admission"
DEFAULT_BASE = "127.0.0.1:5000/imagebuild/debian:12"  # what scripts/bootstrap.sh builds


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


# The Deployment's runAsUser (admission.policies.RUN_AS_USER; a test holds them equal): the image's
# USER is the same, so it runs as that user under plain docker too.
USER = User("nonroot", 65532, 65532)
SECRET_IDS = ("ca-bundle",)  # the only secret its Dockerfile mounts: pip behind a TLS-intercepting proxy
REQUIREMENTS = {"runtime": "requirements.txt", "build": "requirements-build.txt"}
SMOKE_TESTS = "admission"  # its folder of smoke_tests/
SOURCE_FILES = ("pyproject.toml",)
SOURCE_DIRS = ("imagebuild",)
SKIPPED_DIRS = ("__pycache__",)
SKIPPED_SUFFIXES = (".pyc", ".pyo")
_NAME_PART = re.compile(r"[^a-z0-9._-]+")


@dataclass(frozen=True)
class Pin:
    """One wheel, by version and the sha256 of its file: pip --require-hashes takes nothing else."""

    name: str
    version: str
    sha256: str

    def line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}\n"


# What `imagebuild admission serve` imports besides the standard library, and what those need:
# pyproject.toml's click, pyyaml, httpx, cryptography, h11 and prometheus-client, at versions inside its ranges, with
# the packages pip resolves for them (tests/test_admission_image.py checks both). Hashes are of the
# wheels for Debian 12's CPython 3.11 on x86-64 (manylinux) or of the pure-Python wheel. Not here:
# docker, jinja2, rich and isal, which only the build, scan and sign side of imagebuild imports.
WEBHOOK_REQUIREMENTS = (
    Pin("anyio", "4.16.0", "c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026"),
    Pin("certifi", "2026.10.19.post1", "1324c476b4811eff41a8bc2122cd0bbd4d9c7234c725446d99ab1612b3a7fdd2"),
    Pin("cffi", "2.1.1", "34e261f78cb6ceaaa36f42f2613f4380d94d9c759a9c73c769ee6e0247364632"),
    Pin("click", "8.5.1", "8bb5376d2006950386f8c6427613334a2acadc5f559cb80e638d00b4df957e37"),
    Pin("cryptography", "50.0.2", "630ebfea3bf689d075f82316324ff7433dc447fe6bc1bfc76524b74b4a9567d2"),
    Pin("h11", "0.16.0", "63cf8bbe7522de3bf65932fda1d9c2772064ffb3dae62d55932da54b31cb6c86"),
    Pin("httpcore", "1.0.9", "2d400746a40668fc9dec9810239072b40b4484b640a8c38fd654a024c7a1bf55"),
    Pin("httpx", "0.28.1", "d909fcccc110f8c7faf814ca82a9a4d816bc5a6dbfea25d6591d6985b8ba59ad"),
    Pin("idna", "3.20", "ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c"),
    Pin("pycparser", "3.12", "a076f3f489b39b43ed13563a1dafe42447445bec2e294154ec5c57fcdda4c85e"),
    Pin("prometheus-client", "0.26.0", "fa93d06737aa02bacd05794768508bb97d2fbee28cb3bca04eaae92f0ca953d6"),
    Pin("pyyaml", "6.0.4", "622aa875fa6533f25fedcffe23079357d65a690d462200afed5d8e9d0e01ebee"),
    Pin("typing-extensions", "4.16.0", "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8"),
)
# The build backend pyproject.toml asks for (setuptools>=68), in the build stage only.
BUILD_REQUIREMENTS = (
    Pin("setuptools", "75.8.2", "558e47c15f1811c1fa7adbd0096669bf76c1d3f433f58324df69f3f5ecac4e8f"),
)


def requirements_text(pins: tuple[Pin, ...]) -> str:
    return "".join(pin.line() for pin in pins)


# --- what to build (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class WebhookImage:
    """Where the image goes: the trust file's `webhook.image`, split as a plan names it."""

    registry: str
    project: str  # the repository path but its last part
    name: str  # the last part: the repository of the plan; its layer goes to `<name>-layers`
    tag: str

    @property
    def reference(self) -> str:
        return f"{self.registry}/{self.project}/{self.name}:{self.tag}"


def webhook_image(config: TrustConfig, where: str, line: int | None) -> WebhookImage:
    """`webhook.image` of the trust file, which must be a tag imagebuild can build to and which the file's own
    `images` must cover (else the webhook would refuse its own Pods); InputError naming the key otherwise."""
    text = config.webhook.image

    def bad(message: str) -> InputError:
        return InputError(where, line, "webhook.image", f"{reference.shown(text)} {message}")

    try:
        ref = ImageRef.parse(text)
    except ValueError as exc:
        raise bad(f"is not an image reference ({exc})") from None
    if ref.digest is not None:
        raise bad("names a digest; imagebuild builds the webhook's image to a tag (the webhook pins it "
                  "to its digest at admission)")
    project, _, name = ref.repository.rpartition("/")
    if not project:
        raise bad("needs a project in its path (REGISTRY/PROJECT/NAME:TAG): the layer goes to PROJECT/NAME-layers")
    if not any(config.covers(candidate) for candidate in covered_names(ref)):
        raise bad(f"is not covered by the file's images ({', '.join(config.images)}): "
                  "the webhook would refuse its own image")
    return WebhookImage(ref.registry, project, name, ref.tag or "latest")


def base_root(base: str, resolved: str | None) -> Root:
    """The image FROM which both stages start; `resolved`: the digest its tag has now (None: pinned)."""
    parts = reference.split(base)
    if parts.digest is not None:
        return Root(parts.name + (f":{parts.tag}" if parts.tag else ""), parts.digest, pinned=True)
    return Root(base, resolved, pinned=False)


def layer_name(root: Root) -> str:
    """The layer's folder after its base, as the matrix names an OS: debian:12 -> debian12."""
    parts = reference.split(root.image)
    last = parts.name.rsplit("/", 1)[-1] + (parts.tag or "")
    return _NAME_PART.sub("-", last.lower()).strip("-.") or "base"


def source_files(checkout: Path) -> dict[str, bytes]:
    """What the package is built from: pyproject.toml and every file under imagebuild/ but caches,
    by path relative to the checkout. A link or anything but a regular file is refused: the context
    must hold exactly the checkout's bytes, never what a link points at."""
    if not (checkout / "pyproject.toml").is_file() or not (checkout / "imagebuild" / "__init__.py").is_file():
        raise InputError(str(checkout), None, "--source", "is not an imagebuild checkout "
                                                          "(pyproject.toml and imagebuild/__init__.py)")
    files: dict[str, bytes] = {}

    def take(path: Path) -> None:
        rel = path.relative_to(checkout).as_posix()
        if path.is_symlink() or not path.is_file():
            raise InputError(str(path), None, "--source", "is a link or not a regular file; the webhook "
                                                          "image's context takes regular files only")
        files[rel] = path.read_bytes()

    for name in SOURCE_FILES:
        take(checkout / name)
    for top in SOURCE_DIRS:
        for folder, dirs, names in os.walk(checkout / top):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
            for link in [d for d in dirs if Path(folder, d).is_symlink()]:
                take(Path(folder, link))  # os.walk does not follow it; refuse it rather than leave it out
            for entry in sorted(names):
                if not entry.endswith(SKIPPED_SUFFIXES):
                    take(Path(folder, entry))
    return files


def context_files(checkout: Path) -> dict[str, bytes]:
    """The build context: the source and the requirements files written from the pins."""
    return {**source_files(checkout),
            REQUIREMENTS["runtime"]: requirements_text(WEBHOOK_REQUIREMENTS).encode(),
            REQUIREMENTS["build"]: requirements_text(BUILD_REQUIREMENTS).encode()}


def tree_sha256(files: Mapping[str, bytes]) -> str:
    """One hash of a set of files: each path with its content's hash, in path order."""
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).hexdigest().encode() + b"\n")
    return h.hexdigest()


def image_labels(image: WebhookImage, root: Root, source_sha256: str) -> dict[str, str]:
    """The labels the image carries; the base digest as a build argument when the tag is resolved at build time."""
    return {
        "org.opencontainers.image.title": image.name,
        "org.opencontainers.image.version": image.tag,
        "org.opencontainers.image.base.name": root.image,
        "org.opencontainers.image.base.digest": root.digest if root.pinned and root.digest else "${IMAGEBUILD_BASE_DIGEST}",
        "io.imagebuild.variant": VARIANT_ID,
        "io.imagebuild.source.sha256": source_sha256,
    }


def render_dockerfile(image: WebhookImage, root: Root, source_sha256: str) -> str:
    return render_template(KIND, {
        "root": root, "user": USER, "secrets": list(SECRET_IDS), "requirements": REQUIREMENTS,
        "labels": sorted(image_labels(image, root, source_sha256).items()),
    })


def admission_plan(image: WebhookImage, root: Root, source_sha256: str) -> Plan:
    """One variant of one layer. Its key hashes the Dockerfile (labels and pins' file names), the base
    digest and, through the label, the context's tree hash: it changes exactly when the image would."""
    files = {"Dockerfile": render_dockerfile(image, root, source_sha256)}
    args = {}
    if not root.pinned:
        args = {"IMAGEBUILD_BASE": root.reference, "IMAGEBUILD_BASE_DIGEST": root.digest or "unresolved"}
    key = content_key(KIND, files, args, None)
    name = layer_name(root)
    layer = Layer(kind=KIND, name=name, key=key, parent=None, files=tuple(sorted(files.items())),
                  build_args=tuple(sorted(args.items())), root=root)
    # Axes that do not apply say so: no Paddle, CPU only, the base's own python3.
    variant = Variant(id=VARIANT_ID, os=name, cuda=None, cudnn=None, python="system", paddle="none",
                      tags=(image.tag,), chain=(key,), platform_chains=(PlatformChain(layer.platform, (key,)),))
    return Plan(matrix_file=SOURCE_FILES[0], registry=image.registry, project=image.project, repository=image.name,
                cache_repository=f"{image.name}-layers", variants=(variant,), layers={key: layer})


def expected_distributions() -> dict[str, str]:
    """What the smoke suite must find in the venv besides imagebuild: the pins, nothing else."""
    return {pin.name: pin.version for pin in WEBHOOK_REQUIREMENTS}


# --- the run --------------------------------------------------------------------------------------


def resolve_base(base: str) -> Root:
    """--base, its tag resolved to the digest its registry has now (RegistryError when it has none)."""
    try:
        parts = reference.split(base)
    except reference.ReferenceError as exc:
        raise InputError("--base", None, base, f"is not an image reference ({exc})") from None
    if parts.digest is not None:
        return base_root(base, None)
    ref = ImageRef.parse(base)
    with Registry(ref.registry) as registry:
        # The webhook's image is one platform's (DEFAULT_PLATFORM): an index base gives that child.
        digest = platform_digest(registry, ref.repository, ref.reference, DEFAULT_PLATFORM)
    if digest is None:
        raise RegistryError(f"base image {base} is not in its registry (scripts/bootstrap.sh builds the local one)")
    return base_root(base, digest)


def build_secrets(overrides: Mapping[str, str]) -> building.SecretFiles:
    """The CA bundle for pip: the system's, or --secret ca-bundle=PATH; no other secret is mounted."""
    for sid in overrides:
        if sid not in SECRET_IDS:
            raise InputError("--secret", None, sid, f"the webhook image's Dockerfile mounts only {', '.join(SECRET_IDS)}")
    given = overrides.get("ca-bundle")
    path = Path(given) if given else next((Path(p) for p in building.SYSTEM_CA_BUNDLES if Path(p).is_file()), None)
    if path is None:
        return building.SecretFiles({}, ())  # no proxy to trust: pip uses the image's own certificates
    if not path.is_file():
        raise InputError("--secret", None, f"ca-bundle={given}", "no such file")
    path = path.resolve()
    return building.SecretFiles({"ca-bundle": str(path)}, (path.read_text(errors="replace").strip(),))


def write_context(folder: Path, files: Mapping[str, bytes]) -> None:
    """The build context, afresh: exactly `files` (a file left from another checkout would go in too)."""
    if folder.exists():
        shutil.rmtree(folder)
    for rel, data in files.items():
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


@dataclass
class AdmissionImageRun(ReleaseRun):
    """ReleaseRun for the webhook's image: its own build (one layer, its own context) and smoke
    expectations; scan, gate and sign are ReleaseRun's (push stays off)."""

    expected_labels: dict[str, str] = field(default_factory=dict)

    @property
    def dockerfiles(self) -> Path:
        """The rendered Dockerfile's tree (what scan's `trivy config` reads too)."""
        return self.options.workdir / "dockerfiles"

    def run_image(self, image: WebhookImage, root: Root, source: Path, secrets: building.SecretFiles,
                  revision: str) -> list[VariantRelease]:
        started = time.monotonic()
        files = context_files(source)
        source_sha256 = tree_sha256(files)
        the_plan = admission_plan(image, root, source_sha256)
        self.expected_labels = {**image_labels(image, root, source_sha256),
                                "org.opencontainers.image.base.digest": root.digest or ""}
        report = building.registry_plan(the_plan, the_plan.variants)
        report.revision = revision
        report.matrix_sha256 = "sha256:" + hashlib.sha256(files[SOURCE_FILES[0]]).hexdigest()
        layer = next(iter(the_plan.layers.values()))
        write_tree(self.dockerfiles, the_plan.rendered_files())
        context = self.options.workdir / "context"
        write_context(context, files)
        options = building.BuildOptions(jobs=1, dockerfiles=self.dockerfiles, workdir=self.options.workdir,
                                        secrets=secrets.paths, secret_values=secrets.values,
                                        layer_timeout_s=self.options.layer_timeout_s, contexts={layer.key: context})
        self.build_layers(the_plan, report, options)
        self.after_build(started)
        return list(self.results.values())

    def smoke(self, ids: list[str]) -> list[str]:
        if not ids:
            return ids
        out = self.options.workdir / "smoke"
        options = smoke_run.RunOptions(timeout_s=self.options.smoke_timeout_s, memory="1g",
                                       cpus=min(2.0, float(os.cpu_count() or 1)))
        runner = smoke_run.SmokeRunner(smoke_run.docker_client(), options, out,
                                       smoke_run.ensure_harness(out / ".harness"), tests=(SMOKE_TESTS,))
        self.on_event(f"smoke: {len(ids)} image(s), the webhook image's suite (smoke_tests/{SMOKE_TESTS}/)")
        results = smoke_run.run_records(self.report_path, self._variants(ids), runner, self.expectations,
                                        on_result=self.smoke_progress)
        self.smoke_results(results)
        return self._going()

    def expectations(self, target: Target, labels: Mapping[str, str], gpu_requested: bool) -> Expectations:
        extra: dict[str, Any] = {"distributions": expected_distributions()}
        return Expectations(variant=target.name, image=target.image, device=target.device, paddle=target.paddle,
                            python=target.python, cuda=None, cudnn=None, labels_expected=dict(self.expected_labels),
                            labels_actual=dict(labels), uid=USER.uid, gid=USER.gid,
                            gpu_requested=gpu_requested, extra=extra)
