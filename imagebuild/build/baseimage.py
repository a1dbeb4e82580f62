"""The local Debian base image, built so that the same package set gives the same digest.

`docker import` stamps the import time into the image config, so every machine got its own
base digest and with it its own layer keys. Here the image is assembled by hand instead:
mmdebstrap writes the rootfs tar (byte for byte the same for the same packages, because
SOURCE_DATE_EPOCH clamps every time in it), gzip without a name or time compresses it, and
the config carries that same fixed time. Blobs go to the registry first, the manifest last,
so a tag never points at an unfinished image.

The packages come from the suite and its -updates and -security suites, found in the
machine's own apt configuration (a site with its own mirror needs no change here), or from
IMAGEBUILD_BASE_MIRROR / IMAGEBUILD_BASE_SECURITY_MIRROR.

    python -m imagebuild.build.baseimage build --workdir DIR [--platform linux/arm64 ...] [--push REGISTRY/REPO:TAG]

One `--platform` (default: this machine's) makes one image. Several make one image per platform,
each in its own folder of DIR (another architecture's rootfs is made under qemu-user-static's binfmt
handler), and the push sends every image by digest before the OCI index that names them goes under
the tag: the tag never names an index with a child missing.

Everything up to the push uses the standard library only, so the same build runs inside a
bare container with nothing but python3 and mmdebstrap.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from imagebuild.core.errors import ExitCode, ImagebuildError
from imagebuild.core.runner import Runner

if TYPE_CHECKING:
    from imagebuild.oci.client import Registry

MIRROR_ENV = "IMAGEBUILD_BASE_MIRROR"
SECURITY_MIRROR_ENV = "IMAGEBUILD_BASE_SECURITY_MIRROR"

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
LAYER_TYPE = "application/vnd.docker.image.rootfs.diff.tar.gzip"

# The host's /etc/hostname and /etc/resolv.conf would be copied into the rootfs; they differ
# per machine (docker supplies both at run time).
ROOTFS_HOOK = 'rm -f "$1/etc/hostname" "$1/etc/resolv.conf"'
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# zlib's default level: every zlib gives the same bytes for the same input and level.
GZIP_LEVEL = 6


class BaseImageError(ImagebuildError):
    """The base image could not be built or pushed; the message says why."""


class SourcesError(BaseImageError):
    """The apt configuration does not name what the base image needs (bad input: exit 2)."""

    exit_code = ExitCode.BAD_INPUT


class ToolMissingError(BaseImageError):
    """A program the build needs is not installed (exit 3)."""

    exit_code = ExitCode.ENVIRONMENT


# --- apt sources (pure) -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    components: tuple[str, ...]
    origin: str  # file:line it came from, for messages

    def line(self) -> str:
        """The one-line form mmdebstrap takes, and writes into the image's sources.list."""
        return f"deb {self.uri} {self.suite} {' '.join(self.components)}"


def parse_one_line(text: str, origin: str) -> list[AptSource]:
    """sources.list format: `deb [options] URI SUITE COMPONENT...`; deb-src and comments skipped."""
    found = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith(("deb ", "deb\t")):
            rest = line[3:].strip()
            if rest.startswith("["):
                rest = rest.partition("]")[2].strip()
            words = rest.split()
            if len(words) >= 3:
                found.append(AptSource(words[0].rstrip("/"), words[1], tuple(words[2:]), f"{origin}:{number}"))
    return found


def parse_deb822(text: str, origin: str) -> list[AptSource]:
    """deb822 format (*.sources): paragraphs of Types/URIs/Suites/Components; Enabled: no skipped."""
    found = []
    for start, fields in _paragraphs(text):
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
            continue
        components = tuple(fields.get("components", "").split())
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                found.append(AptSource(uri.rstrip("/"), suite, components, f"{origin}:{start}"))
    return found


def _paragraphs(text: str) -> list[tuple[int, dict[str, str]]]:
    paragraphs: list[tuple[int, dict[str, str]]] = []
    fields: dict[str, str] = {}
    start, key = 0, ""
    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                paragraphs.append((start, fields))
            fields, key = {}, ""
            continue
        if line[0] in " \t":
            if key:  # a continuation line (e.g. an inline Signed-By key): kept, never used here
                fields[key] += "\n" + line.strip()
            continue
        name, _, value = line.partition(":")
        if not fields:
            start = number
        key = name.strip().lower()
        fields[key] = value.strip()
    return paragraphs


def host_sources(apt_dir: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every `deb` entry apt itself would read: sources.list, sources.list.d/*.list and *.sources."""
    found: list[AptSource] = []
    main = apt_dir / "sources.list"
    if main.is_file():
        found += parse_one_line(main.read_text(), str(main))
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        for path in sorted(parts.iterdir()):
            if path.suffix == ".list":
                found += parse_one_line(path.read_text(), str(path))
            elif path.suffix == ".sources":
                found += parse_deb822(path.read_text(), str(path))
    return found


def base_sources(available: list[AptSource], suite: str, env: dict[str, str] | None = None,
                 component: str = "main") -> list[AptSource]:
    """The suite, its point-release updates and its security updates, `component` only, in that order.

    IMAGEBUILD_BASE_MIRROR replaces the URI of the first two, IMAGEBUILD_BASE_SECURITY_MIRROR
    that of the security suite. Every one of the three must be found (or given)."""
    env = dict(os.environ if env is None else env)
    wanted = [(suite, MIRROR_ENV), (f"{suite}-updates", MIRROR_ENV), (f"{suite}-security", SECURITY_MIRROR_ENV)]
    chosen = []
    for name, variable in wanted:
        override = env.get(variable, "").strip()
        if override:
            chosen.append(AptSource(override.rstrip("/"), name, (component,), f"${variable}"))
            continue
        match = next((s for s in available if s.suite == name and component in s.components), None)
        if match is None:
            raise SourcesError(
                f"no apt source for '{name}' ({component}) in the machine's apt configuration "
                f"(/etc/apt/sources.list, /etc/apt/sources.list.d/): the base image needs {suite}, "
                f"{suite}-updates and {suite}-security; add them there or set {variable}")
        chosen.append(AptSource(match.uri, name, (component,), match.origin))
    return chosen


# --- the rootfs -------------------------------------------------------------------------------------


def mmdebstrap(sources: list[AptSource], suite: str, include: str, epoch: int, target: Path, log: Path,
               arch: str | None = None) -> None:
    """A minimal Debian rootfs tar. No device nodes: the container runtime supplies /dev. `arch`: a Debian
    architecture other than this machine's (its maintainer scripts run under qemu's binfmt handler)."""
    exe = shutil.which("mmdebstrap")
    if exe is None:
        raise ToolMissingError("mmdebstrap is not installed (Debian: apt-get install mmdebstrap; "
                               "scripts/bootstrap.sh installs it)")
    partial = target.with_name(target.name + ".partial")
    # No --arch for this machine's own architecture: the command (and so the rootfs) stays what it
    # always was, and the native image keeps its digest.
    foreign = [f"--architectures={arch}"] if arch else []
    command = [exe, "--variant=minbase", "--format=tar", "--skip=output/dev", *foreign, f"--include={include}",
               f"--customize-hook={ROOTFS_HOOK}", suite, str(partial), *(s.line() for s in sources)]
    proc = Runner().run(command, log=log, env={"SOURCE_DATE_EPOCH": str(epoch)})
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BaseImageError(f"mmdebstrap failed (log: {log}):\n" + "\n".join(tail))
    partial.replace(target)


def installed_packages(rootfs: Path) -> list[str]:
    """`name=version` of every installed package, from the rootfs's dpkg status, sorted."""
    with tarfile.open(rootfs) as tar:
        member = next((m for m in tar if m.name.lstrip("./") == "var/lib/dpkg/status"), None)
        if member is None:
            raise BaseImageError(f"{rootfs} holds no var/lib/dpkg/status")
        data = tar.extractfile(member)
        text = data.read().decode() if data else ""
    packages = []
    for _, fields in _paragraphs(text):
        if fields.get("status", "").endswith(" installed"):
            packages.append(f"{fields['package']}={fields['version']}")
    return sorted(packages)


# --- the image (deterministic) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Blob:
    digest: str
    size: int
    path: Path


@dataclass(frozen=True)
class Image:
    manifest: bytes
    config: Blob
    layer: Blob
    diff_id: str  # sha256 of the uncompressed rootfs tar

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()


def canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def image_config(diff_id: str, epoch: int, architecture: str, created_by: str) -> dict[str, Any]:
    created = dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "architecture": architecture,
        "os": "linux",
        "created": created,
        "config": {"Cmd": ["/bin/bash"], "Env": [PATH_ENV]},
        "history": [{"created": created, "created_by": created_by}],
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }


def manifest(config: Blob, layer: Blob) -> bytes:
    return canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "size": config.size, "digest": config.digest},
        "layers": [{"mediaType": LAYER_TYPE, "size": layer.size, "digest": layer.digest}],
    })


def compress(rootfs: Path, target: Path) -> tuple[str, Blob]:
    """gzip with no file name and time 0; returns (diff_id of the tar, the compressed blob)."""
    tar_hash, gz_hash = hashlib.sha256(), hashlib.sha256()

    class Hashing(io.RawIOBase):
        def __init__(self, out: BinaryIO) -> None:
            self.out = out

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            gz_hash.update(data)
            return self.out.write(data)

    with rootfs.open("rb") as src, target.open("wb") as raw:
        sink = Hashing(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=sink, compresslevel=GZIP_LEVEL, mtime=0) as gz:
            while chunk := src.read(1 << 20):
                tar_hash.update(chunk)
                gz.write(chunk)
    return "sha256:" + tar_hash.hexdigest(), Blob("sha256:" + gz_hash.hexdigest(), target.stat().st_size, target)


def compose(rootfs: Path, out_dir: Path, epoch: int, architecture: str, created_by: str) -> Image:
    """The image's blobs and manifest in out_dir (layer.tar.gz, config.json, manifest.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    diff_id, layer = compress(rootfs, out_dir / "layer.tar.gz")
    config_bytes = canonical_json(image_config(diff_id, epoch, architecture, created_by))
    config_path = out_dir / "config.json"
    config_path.write_bytes(config_bytes)
    config = Blob("sha256:" + hashlib.sha256(config_bytes).hexdigest(), len(config_bytes), config_path)
    raw = manifest(config, layer)
    (out_dir / "manifest.json").write_bytes(raw)
    return Image(raw, config, layer, diff_id)


def dpkg_architecture() -> str:
    command = ["dpkg", "--print-architecture"]
    try:
        done = Runner().run(command, separate_stderr=True)
    except OSError as exc:
        raise ToolMissingError(f"dpkg --print-architecture failed: {exc}") from None
    if done.returncode != 0:
        raise ToolMissingError(f"dpkg --print-architecture failed: Command '{command!r}' returned non-zero "
                               f"exit status {done.returncode}.")
    return done.output.strip()


# OCI/Docker names of Debian architectures that differ (the rest are the same word).
_OCI_ARCH = {"armhf": "arm", "i386": "386", "ppc64el": "ppc64le"}
_DEBIAN_ARCH = {oci: debian for debian, oci in _OCI_ARCH.items()}


def native_platform() -> str:
    """This machine's platform as OCI names it (`linux/amd64`)."""
    arch = dpkg_architecture()
    return f"linux/{_OCI_ARCH.get(arch, arch)}"


def debian_architecture(platform: str) -> str:
    """The Debian architecture of an OCI platform: linux/arm64 -> arm64, linux/arm/v7 -> armhf."""
    parts = platform.split("/")
    if len(parts) not in (2, 3) or parts[0] != "linux" or not parts[1]:
        raise SourcesError(f"'{platform}' is not a Linux platform like linux/arm64")
    return _DEBIAN_ARCH.get(parts[1], parts[1])


@dataclass(frozen=True)
class BuildResult:
    image: Image
    sources: list[AptSource]
    packages: list[str]
    rootfs: Path


def build(workdir: Path, suite: str, include: str, epoch: int, sources: list[AptSource],
          arch: str | None = None) -> BuildResult:
    """mmdebstrap, then the deterministic image, all inside workdir (kept: a rerun reuses the rootfs).
    `arch`: the Debian architecture to build for (default and same as None: this machine's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    rootfs = workdir / "rootfs.tar"
    native = dpkg_architecture()
    if arch == native:
        arch = None
    if not rootfs.is_file():
        mmdebstrap(sources, suite, include, epoch, rootfs, workdir / "mmdebstrap.log", arch)
    packages = installed_packages(rootfs)
    (workdir / "packages.txt").write_text("".join(f"{p}\n" for p in packages))
    arch = arch or native
    created_by = (f"mmdebstrap --variant=minbase --include={include} {suite} "
                  f"({', '.join(s.suite for s in sources)}; {len(packages)} packages)")
    image = compose(rootfs, workdir / "image", epoch, _OCI_ARCH.get(arch, arch), created_by)
    return BuildResult(image, sources, packages, rootfs)


# --- the push ---------------------------------------------------------------------------------------


def push(image: Image, reference: str) -> str:
    """Blobs first (skipped when present), then the manifest under the tag; returns the digest."""
    return push_all({"": image}, reference)


def index_of(images: dict[str, Image]) -> bytes:
    """The OCI index of one image per platform, in the order given (the same bytes on every machine)."""
    from imagebuild.oci.platforms import Child, index_document  # needs httpx: see push_all

    return index_document(Child(platform, image.digest, MANIFEST_TYPE, len(image.manifest))
                          for platform, image in images.items())


def push_all(images: dict[str, Image], reference: str) -> str:
    """Push every image's blobs and manifest; returns the digest the tag names. One image (platform key
    ignored) goes under the tag itself; several go by digest, then their OCI index under the tag."""
    # Here, not at the top: the build runs in a bare container with the standard library alone (the
    # reproducibility test), and only the push needs the registry client and its httpx.
    from imagebuild.oci.client import OCI_INDEX, ImageRef, Registry, RegistryError

    ref = ImageRef.parse(reference)
    tag = ref.tag or "latest"
    try:
        with Registry(ref.registry, timeout=300) as registry:
            for platform, image in images.items():
                for blob in (image.layer, image.config):
                    _upload(registry, ref.repository, blob)
                where = tag if len(images) == 1 else image.digest
                stored = registry.put_manifest(ref.repository, where, image.manifest, MANIFEST_TYPE)
                if stored and stored != image.digest:
                    raise BaseImageError(f"the registry stored {reference} ({platform or 'image'}) as {stored}, "
                                         f"not {image.digest}")
            if len(images) == 1:
                return next(iter(images.values())).digest
            raw = index_of(images)
            expected = "sha256:" + hashlib.sha256(raw).hexdigest()
            stored = registry.put_manifest(ref.repository, tag, raw, OCI_INDEX)
    except RegistryError as exc:
        raise BaseImageError(f"pushing {reference}: {exc}") from None
    if stored and stored != expected:
        raise BaseImageError(f"the registry stored the index {reference} as {stored}, not {expected}")
    return expected


def _upload(registry: Registry, repository: str, blob: Blob) -> None:
    from imagebuild.oci.client import RegistryError

    if registry._request("HEAD", f"/v2/{repository}/blobs/{blob.digest}").status_code == 200:
        return
    start = registry._request("POST", f"/v2/{repository}/blobs/uploads/")
    if start.status_code != 202:
        raise RegistryError(f"starting an upload to {repository} answered {start.status_code}")
    location = start.headers["location"]  # carries the upload's state in its query: keep it
    done = registry._request("PUT", f"{location}{'&' if '?' in location else '?'}digest={blob.digest}",
                             content=blob.path.read_bytes(), headers={"Content-Type": "application/octet-stream"})
    if done.status_code != 201:
        raise RegistryError(f"uploading {blob.digest} to {repository} answered {done.status_code}")


# --- command line -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imagebuild.build.baseimage",
                                     description="Build the local Debian base image reproducibly.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="mmdebstrap + a deterministic image; --push sends it to a registry")
    b.add_argument("--workdir", type=Path, required=True, help="rootfs, blobs and package list go here")
    b.add_argument("--suite", default="bookworm")
    b.add_argument("--include", default="ca-certificates")
    b.add_argument("--epoch", type=int, default=int(os.environ.get("SOURCE_DATE_EPOCH", "0")),
                   help="SOURCE_DATE_EPOCH: every time in the rootfs and the config")
    b.add_argument("--apt-dir", type=Path, default=Path("/etc/apt"), help="where the mirror is read from")
    b.add_argument("--platform", action="append", metavar="OS/ARCH",
                   help="build for this platform (repeat for several: one image each, joined by an OCI "
                        "index); default: this machine's")
    b.add_argument("--push", metavar="REGISTRY/REPO:TAG", help="push the image here (blobs, then manifest)")
    s = sub.add_parser("sources", help="print the apt sources the base image would use")
    s.add_argument("--suite", default="bookworm")
    s.add_argument("--apt-dir", type=Path, default=Path("/etc/apt"))
    args = parser.parse_args(argv)
    try:
        sources = base_sources(host_sources(args.apt_dir), args.suite)
        if args.command == "sources":
            for source in sources:
                print(f"{source.line()}    # {source.origin}")
            return 0
        platforms = list(dict.fromkeys(args.platform or [native_platform()]))
        results: dict[str, BuildResult] = {}
        for platform in platforms:
            # One platform keeps the folder's layout of old; several get a folder each (linux-arm64).
            workdir = args.workdir if len(platforms) == 1 else args.workdir / platform.replace("/", "-")
            results[platform] = build(workdir, args.suite, args.include, args.epoch, sources,
                                      debian_architecture(platform))
        images = {platform: result.image for platform, result in results.items()}
        if args.push:
            digest = push_all(images, args.push)
        elif len(images) == 1:
            digest = next(iter(images.values())).digest
        else:  # no push: the digest the index push_all would send will have
            digest = "sha256:" + hashlib.sha256(index_of(images)).hexdigest()
    except BaseImageError as exc:  # SourcesError 2, ToolMissingError 3, any other 1
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    first = next(iter(results.values()))
    print(json.dumps({"digest": digest, "reference": args.push, "packages": len(first.packages),
                      "sources": [s.line() for s in first.sources],
                      "diff_id": first.image.diff_id,
                      "children": {platform: result.image.digest for platform, result in results.items()},
                      "workdir": str(args.workdir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
