"""The base image's apt sources (read from the machine's apt configuration) and its deterministic
assembly: the same rootfs tar always gives the same blobs and the same manifest digest."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from imagebuild.build.baseimage import (
    MIRROR_ENV,
    SECURITY_MIRROR_ENV,
    SourcesError,
    base_sources,
    compose,
    debian_architecture,
    host_sources,
    index_of,
    installed_packages,
    parse_deb822,
    parse_one_line,
)

DEBIAN_SOURCES = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security/
Suites: bookworm-security
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def lines(sources):
    return [s.line() for s in sources]


def test_deb822_paragraphs_give_one_source_per_uri_and_suite():
    found = parse_deb822(DEBIAN_SOURCES, "debian.sources")
    assert lines(found) == ["deb http://deb.debian.org/debian bookworm main",
                            "deb http://deb.debian.org/debian bookworm-updates main",
                            "deb http://deb.debian.org/debian-security bookworm-security main contrib"]
    assert found[2].origin == "debian.sources:8"


def test_deb822_skips_disabled_paragraphs_deb_src_and_inline_keys():
    text = ("Types: deb-src\nURIs: http://a/debian\nSuites: bookworm\nComponents: main\n\n"
            "Enabled: no\nTypes: deb\nURIs: http://b/debian\nSuites: bookworm\nComponents: main\n\n"
            "Types: deb\nURIs: http://c/debian\nSuites: bookworm\nComponents: main\n"
            "Signed-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n abc\n")
    assert lines(parse_deb822(text, "x.sources")) == ["deb http://c/debian bookworm main"]


def test_one_line_sources_with_options_and_comments():
    text = ("# a comment\ndeb-src http://a/debian bookworm main\n"
            "deb [arch=amd64 signed-by=/k.gpg] http://m/debian/ bookworm main non-free  # trailing\n")
    (source,) = parse_one_line(text, "sources.list")
    assert source.line() == "deb http://m/debian bookworm main non-free" and source.origin == "sources.list:3"


def test_the_base_takes_the_suite_its_updates_and_its_security_suite_main_only(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(DEBIAN_SOURCES)
    # apt reads neither of these, so neither may count
    (tmp_path / "sources.list.d" / "other.list.disabled-by-farm").write_text("deb http://x/ bookworm main\n")
    (tmp_path / "sources.list.d" / "notes.txt").write_text("deb http://y/ bookworm-security main\n")
    chosen = base_sources(host_sources(tmp_path), "bookworm", env={})
    assert lines(chosen) == ["deb http://deb.debian.org/debian bookworm main",
                             "deb http://deb.debian.org/debian bookworm-updates main",
                             "deb http://deb.debian.org/debian-security bookworm-security main"]


def test_a_site_mirror_replaces_the_hosts_without_editing_anything(tmp_path):
    found = parse_deb822(DEBIAN_SOURCES, "debian.sources")
    chosen = base_sources(found, "bookworm", env={MIRROR_ENV: "http://mirror.corp/debian/",
                                                  SECURITY_MIRROR_ENV: "http://mirror.corp/security"})
    assert lines(chosen) == ["deb http://mirror.corp/debian bookworm main",
                             "deb http://mirror.corp/debian bookworm-updates main",
                             "deb http://mirror.corp/security bookworm-security main"]


def test_a_machine_without_the_security_suite_is_refused_with_the_variable_to_set():
    without = [s for s in parse_deb822(DEBIAN_SOURCES, "d.sources") if s.suite != "bookworm-security"]
    with pytest.raises(SourcesError, match=f"no apt source for 'bookworm-security'.*{SECURITY_MIRROR_ENV}"):
        base_sources(without, "bookworm", env={})


def rootfs_tar(path: Path, status: str) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("./etc/debian_version", b"12.12\n"), ("./var/lib/dpkg/status", status.encode())):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1747699200
            tar.addfile(info, io.BytesIO(data))
    return path


STATUS = ("Package: tar\nStatus: install ok installed\nVersion: 1.34+dfsg-1.2+deb12u1\n\n"
          "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\n\n"
          "Package: apt\nStatus: install ok installed\nVersion: 2.6.1\nDescription: x\n more\n")


def test_the_package_list_names_installed_packages_only_with_their_versions(tmp_path):
    assert installed_packages(rootfs_tar(tmp_path / "rootfs.tar", STATUS)) == [
        "apt=2.6.1", "tar=1.34+dfsg-1.2+deb12u1"]


def test_composing_the_same_rootfs_twice_gives_the_same_digest(tmp_path):
    rootfs = rootfs_tar(tmp_path / "rootfs.tar", STATUS)
    first = compose(rootfs, tmp_path / "one", 1747699200, "amd64", "mmdebstrap bookworm")
    second = compose(rootfs, tmp_path / "two", 1747699200, "amd64", "mmdebstrap bookworm")
    assert first.digest == second.digest
    assert first.layer.path.read_bytes() == second.layer.path.read_bytes()
    assert first.digest == "sha256:" + hashlib.sha256((tmp_path / "one" / "manifest.json").read_bytes()).hexdigest()


def test_the_layer_is_the_rootfs_gzipped_without_name_or_time_and_the_config_names_it(tmp_path):
    rootfs = rootfs_tar(tmp_path / "rootfs.tar", STATUS)
    image = compose(rootfs, tmp_path / "image", 1747699200, "amd64", "mmdebstrap bookworm")
    layer = image.layer.path.read_bytes()
    assert layer[4:8] == b"\0\0\0\0" and not layer[3] & 0x08  # MTIME 0, no FNAME flag
    assert gzip.decompress(layer) == rootfs.read_bytes()
    assert image.layer.digest == "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.loads(image.config.path.read_bytes())
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(rootfs.read_bytes()).hexdigest()]
    assert config["created"] == "2025-05-20T00:00:00Z" == config["history"][0]["created"]
    assert config["config"]["Cmd"] == ["/bin/bash"]
    manifest = json.loads(image.manifest)
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert manifest["config"]["digest"] == image.config.digest
    assert manifest["layers"][0]["size"] == len(layer)


def test_another_epoch_or_package_set_gives_another_digest(tmp_path):
    rootfs = rootfs_tar(tmp_path / "rootfs.tar", STATUS)
    base = compose(rootfs, tmp_path / "a", 1747699200, "amd64", "x").digest
    assert compose(rootfs, tmp_path / "b", 1747699201, "amd64", "x").digest != base
    other = rootfs_tar(tmp_path / "other.tar", STATUS.replace("deb12u1", "deb12u2"))
    assert compose(other, tmp_path / "c", 1747699200, "amd64", "x").digest != base


@pytest.mark.parametrize("platform, debian", [("linux/amd64", "amd64"), ("linux/arm64", "arm64"),
                                              ("linux/arm64/v8", "arm64"), ("linux/arm/v7", "armhf"),
                                              ("linux/ppc64le", "ppc64el"), ("linux/386", "i386")])
def test_a_platform_names_the_debian_architecture_mmdebstrap_builds(platform, debian):
    assert debian_architecture(platform) == debian


@pytest.mark.parametrize("platform", ["windows/amd64", "arm64", "linux/", ""])
def test_a_platform_that_is_not_linux_is_refused_as_bad_input(platform):
    with pytest.raises(SourcesError, match="not a Linux platform"):
        debian_architecture(platform)


def test_the_index_of_several_platforms_names_each_image_in_order_with_its_platform(tmp_path):
    rootfs = rootfs_tar(tmp_path / "rootfs.tar", STATUS)
    amd64 = compose(rootfs, tmp_path / "amd64", 1747699200, "amd64", "x")
    arm64 = compose(rootfs, tmp_path / "arm64", 1747699200, "arm64", "x")
    assert amd64.digest != arm64.digest  # the config names the architecture
    raw = index_of({"linux/amd64": amd64, "linux/arm64": arm64})
    assert raw == index_of({"linux/amd64": amd64, "linux/arm64": arm64})
    index = json.loads(raw)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert [(m["digest"], m["size"], m["platform"]) for m in index["manifests"]] == [
        (amd64.digest, len(amd64.manifest), {"architecture": "amd64", "os": "linux"}),
        (arm64.digest, len(arm64.manifest), {"architecture": "arm64", "os": "linux"})]
    assert {m["mediaType"] for m in index["manifests"]} == {"application/vnd.docker.distribution.manifest.v2+json"}
