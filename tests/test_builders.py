"""The builders file (config/builders.py): what a valid one means, and one line for each malformed one.

A builders file names daemons that run the matrix's steps as root and receive its build secrets,
and may come with a pull request or a shared CI config, so it is hostile input like the matrix:
every problem is `file:line: key: message`, exit 2, and nothing in it that looks like key
material is ever repeated. Each bad case starts from VALID and breaks one thing; the CLI cases run
`imagebuild build --builders FILE --dry-run` in a fresh process, before anything reaches a registry.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from imagebuild.config.builders import BUILDKIT, LOCAL, load_builders
from imagebuild.core.errors import ExitCode
from imagebuild.core.source import InputError
from imagebuild.oci.platforms import Platform

VALID = """\
schema: 1
builders:
  - name: amd64-a
    endpoint: tcp://127.0.0.1:1234
    tls: {ca: certs/ca.pem, cert: certs/client.pem, key: certs/client-key.pem}
    platforms: [linux/amd64]
    concurrency: 2
  - name: arm
    endpoint: unix:///run/buildkit/buildkitd.sock
  - name: here
    kind: local
"""
#  1 schema   3 builders[0]   4 endpoint   5 tls   6 platforms   7 concurrency
#  8 builders[1] (arm)   9 endpoint   10 builders[2] (here)   11 kind

KEY_MATERIAL = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----\n"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    certs = tmp_path / "certs"
    certs.mkdir()
    for name in ("ca.pem", "client.pem", "client-key.pem"):
        (certs / name).write_text(KEY_MATERIAL)
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "builders.yaml"
    path.write_text(text)
    return path


def test_a_valid_file_lists_each_builder_with_its_endpoint_tls_files_platforms_and_concurrency(folder):
    config = load_builders(write(folder, VALID))
    first, unix, local = config.builders
    assert (first.name, first.kind, first.endpoint, first.concurrency) == ("amd64-a", BUILDKIT, "tcp://127.0.0.1:1234", 2)
    assert first.platforms == (Platform("linux", "amd64"),)
    assert first.tls is not None and first.tls.key == folder / "certs" / "client-key.pem"  # beside the file
    assert (unix.endpoint, unix.tls, unix.platforms, unix.concurrency) == ("unix:///run/buildkit/buildkitd.sock",
                                                                            None, (), 1)
    assert (local.kind, local.endpoint) == (LOCAL, None)
    assert config.capacity == 4  # build --jobs's default with this file


def test_a_builder_serves_its_listed_platforms_and_one_without_a_list_serves_any(folder):
    first, unix, _ = load_builders(write(folder, VALID)).builders
    assert first.serves("linux/amd64") and not first.serves("linux/arm64")
    assert unix.serves("linux/arm64")  # the probe narrows it to what the daemon reports


BAD = [
    # (what, replace this, with this, line, key, message part)
    ("no schema", "schema: 1\n", "", 1, "", "missing required key 'schema'"),
    ("another schema", "schema: 1", "schema: 2", 1, "schema", "unsupported schema 2"),
    ("unknown key", "    concurrency: 2\n", "    concurency: 2\n", 7, "builders[0].concurency",
     "did you mean 'concurrency'"),
    ("bad name", "name: amd64-a", "name: AMD64_A", 3, "builders[0].name", "is not a builder name"),
    ("twice", "name: arm", "name: amd64-a", 8, "builders[1].name", "declared twice (first as builders[0])"),
    ("bad kind", "kind: local", "kind: docker", 11, "builders[2].kind", "unknown kind 'docker'"),
    ("no endpoint", "    endpoint: unix:///run/buildkit/buildkitd.sock\n", "", 8, "builders[1]",
     "missing required key 'endpoint'"),
    ("http endpoint", "unix:///run/buildkit/buildkitd.sock", "http://10.0.0.1:1234", 9, "builders[1].endpoint",
     "is not an endpoint like tcp://host:port"),
    ("endpoint with credentials", "unix:///run/buildkit/buildkitd.sock", "tcp://admin:hunter2@10.0.0.1:1234", 9,
     "builders[1].endpoint", "a URL with credentials (not shown)"),
    ("port out of range", "tcp://127.0.0.1:1234", "tcp://127.0.0.1:99999", 4, "builders[0].endpoint",
     "port 99999 is out of range"),
    ("same daemon twice", "unix:///run/buildkit/buildkitd.sock", "tcp://127.0.0.1:1234\n    tls: "
     "{ca: certs/ca.pem, cert: certs/client.pem, key: certs/client-key.pem}", 9, "builders[1].endpoint",
     "is already builders[0]"),
    ("tcp without tls", "    tls: {ca: certs/ca.pem, cert: certs/client.pem, key: certs/client-key.pem}\n", "", 3,
     "builders[0]", "a tcp:// endpoint needs tls"),
    ("tls without key", ", key: certs/client-key.pem}", "}", 5, "builders[0].tls", "missing required key 'key'"),
    ("missing tls file", "certs/client.pem", "certs/nowhere.pem", 5, "builders[0].tls.cert",
     "'certs/nowhere.pem' is not a file"),
    ("bad platform", "platforms: [linux/amd64]", "platforms: [amd64]", 6, "builders[0].platforms[0]",
     "'amd64' is not a platform like linux/arm64"),
    ("platform twice", "platforms: [linux/amd64]", "platforms: [linux/amd64, linux/amd64]", 6,
     "builders[0].platforms[1]", "linux/amd64 is listed twice"),
    ("no platforms", "platforms: [linux/amd64]", "platforms: []", 6, "builders[0].platforms", "must not be empty"),
    ("zero concurrency", "concurrency: 2", "concurrency: 0", 7, "builders[0].concurrency", "must be at least 1"),
    ("text concurrency", "concurrency: 2", "concurrency: two", 7, "builders[0].concurrency", "expected an integer"),
    ("local with an endpoint", "    kind: local\n", "    kind: local\n    endpoint: tcp://1.2.3.4:5\n", 12,
     "builders[2].endpoint", "a local builder is this machine's Docker engine"),
]


@pytest.mark.parametrize(("old", "new", "line", "key", "message"), [case[1:] for case in BAD],
                         ids=[case[0] for case in BAD])
def test_a_malformed_file_is_one_error_naming_file_line_and_key(folder, old, new, line, key, message):
    assert old in VALID
    path = write(folder, VALID.replace(old, new, 1))
    with pytest.raises(InputError, match=re.escape(message)) as err:
        load_builders(path)
    assert (err.value.file, err.value.line, err.value.key) == (str(path), line, key)
    assert "hunter2" not in str(err.value)


def test_key_material_given_instead_of_a_path_is_refused_without_being_repeated(folder):
    inline = KEY_MATERIAL.replace("\n", "\\n")
    path = write(folder, VALID.replace("key: certs/client-key.pem", f'key: "{inline}"'))
    with pytest.raises(InputError, match="give the path of a PEM file, not its contents") as err:
        load_builders(path)
    assert (err.value.line, err.value.key) == (5, "builders[0].tls.key")
    assert "MIIEvQ" not in str(err.value) and "BEGIN" not in str(err.value)


def test_a_file_without_builders_is_refused(folder):
    with pytest.raises(InputError, match="must not be empty") as err:
        load_builders(write(folder, "schema: 1\nbuilders: []\n"))
    assert (err.value.line, err.value.key) == (2, "builders")


def test_a_missing_file_is_bad_input(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        load_builders(tmp_path / "builders.yaml")


def test_build_with_a_bad_builders_file_ends_in_one_line_and_exit_2_before_any_registry_request(
        folder, imagebuild, tmp_path):
    path = write(folder, VALID.replace("concurrency: 2", "concurrency: 0"))
    done = imagebuild("build", "--matrix", "examples/local/matrix.yaml", "--builders", path, "--dry-run",
                      "--workdir", tmp_path / "work")
    assert done.returncode == ExitCode.BAD_INPUT, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {path}:7: builders[0].concurrency: must be at least 1, got 0"]
    assert not (tmp_path / "work").exists()


def test_the_builders_file_may_come_from_IMAGEBUILD_BUILDERS(folder, imagebuild, tmp_path):
    path = write(folder, VALID.replace("kind: local", "kind: podman"))
    done = imagebuild("release", "--matrix", "examples/local/matrix.yaml", "--workdir", tmp_path / "work",
                      env={"IMAGEBUILD_BUILDERS": str(path)})
    assert done.returncode == ExitCode.BAD_INPUT, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {path}:11: builders[2].kind: unknown kind 'podman'")
