"""A matrix stays in its lane: build secrets only from where the operator allows, smoke paths only
from the matrix's folder, and no credential of the job in the environment of a build.

The matrix may come from a pull request, and its `run:` steps are its author's shell: whatever a
secret mount or the build's environment holds, that author can read.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from imagebuild.build import scheduler as building
from imagebuild.config.matrix import load_matrix
from imagebuild.core import runner as tools
from imagebuild.core.source import InputError

from .conftest import run_imagebuild
from .e2e.oci_servers import RecordingServer

MATRIX = """\
schema: 1
registry: 127.0.0.1:9
project: paddle
repository: paddle
secrets:
{secrets}
os:
  debian12:
    image: docker.io/library/debian:12
    digest: sha256:{digest}
    family: debian
tags:
  gpu: ["{{paddle}}-gpu-cuda{{cuda}}-cudnn{{cudnn}}{{py_suffix}}"]
  cpu: ["{{paddle}}{{py_suffix}}"]
matrix:
  os: [debian12]
  cuda: [cpu]
  python: ["3.11"]
  paddle: ["2.6.2"]
"""
SECRETS_LINE = 6  # the first line under `secrets:`
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def write_matrix(folder: Path, secrets: str, registry: str = "127.0.0.1:9") -> Path:
    path = folder / "matrix.yaml"
    path.write_text(MATRIX.format(secrets=secrets, digest="0" * 64).replace("127.0.0.1:9", registry))
    return path


def matrix_with(folder: Path, secrets: str):
    return load_matrix(write_matrix(folder, secrets))


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file that is nobody's build secret, like /etc/shadow or ~/.docker/config.json."""
    path = tmp_path / "elsewhere" / "config.json"
    path.parent.mkdir()
    path.write_text('{"auths": {"harbor.example.com": {"auth": "c2VjcmV0"}}}')
    return path


@pytest.fixture
def lane_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ci-secrets"
    path.mkdir()
    (path / "pip.conf").write_text("[global]\nindex-url = https://ci:hunter22@pypi.example.com/simple\n")
    return path


# --- secret files ------------------------------------------------------------------------------------


def test_a_host_file_outside_the_lane_is_bad_input_naming_the_line_and_key(tmp_path, outside):
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {outside}")
    with pytest.raises(InputError, match=re.escape(f"'{outside}' is outside the lane for build secrets")) as caught:
        building.secret_files(matrix, lane=building.SecretLane())
    err = caught.value
    assert (err.line, err.key) == (SECRETS_LINE + 1, "secrets.pip-conf.file")
    assert str(err).startswith(f"{matrix.file}:{SECRETS_LINE + 1}: secrets.pip-conf.file: ")
    assert "--secret-dir" in str(err)


@pytest.mark.parametrize("path", ["/etc/passwd", "~/.docker/config.json", "/proc/self/environ"])
def test_well_known_host_files_are_outside_the_default_lane(tmp_path, path):
    matrix = matrix_with(tmp_path, f"  netrc:\n    file: {path}")
    with pytest.raises(InputError, match="outside the lane"):
        building.secret_files(matrix, lane=building.SecretLane.from_settings(environ={}))


def test_a_file_under_an_allowed_directory_is_mounted_by_its_resolved_path(tmp_path, lane_dir):
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {lane_dir}/../ci-secrets/pip.conf")
    files = building.secret_files(matrix, lane=building.SecretLane.from_settings([str(lane_dir)], environ={}))
    assert files.paths == {"pip-conf": str(lane_dir / "pip.conf")}
    assert "hunter22" in " ".join(files.values)  # and redacted from every log


def test_a_link_in_an_allowed_directory_that_points_outside_is_refused(tmp_path, lane_dir, outside):
    (lane_dir / "innocent.conf").symlink_to(outside)
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {lane_dir}/innocent.conf")
    with pytest.raises(InputError, match="outside the lane for build secrets after resolving links"):
        building.secret_files(matrix, lane=building.SecretLane.from_settings([str(lane_dir)], environ={}))


def test_dotdot_out_of_an_allowed_directory_is_refused(tmp_path, lane_dir, outside):
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {lane_dir}/../elsewhere/config.json")
    with pytest.raises(InputError, match="outside the lane"):
        building.secret_files(matrix, lane=building.SecretLane.from_settings([str(lane_dir)], environ={}))


@pytest.mark.skipif(not CA_BUNDLE.is_file(), reason="this host has no Debian CA bundle")
def test_the_system_ca_bundle_is_in_the_lane_by_default(tmp_path):
    matrix = matrix_with(tmp_path, f"  ca-bundle:\n    file: {CA_BUNDLE}")
    files = building.secret_files(matrix, lane=building.SecretLane.from_settings(environ={}))
    assert files.paths == {"ca-bundle": str(CA_BUNDLE.resolve())}


def test_the_secret_dirs_setting_is_read_from_the_environment(tmp_path, lane_dir):
    (tmp_path / "other").mkdir()
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {lane_dir}/pip.conf")
    lane = building.SecretLane.from_settings(environ={building.SECRET_DIRS_ENV: f"{tmp_path}/other{os.pathsep}{lane_dir}"})
    assert building.secret_files(matrix, lane=lane).paths == {"pip-conf": str(lane_dir / "pip.conf")}


def test_an_operator_override_replaces_the_matrix_source_and_is_not_lane_checked(tmp_path, outside, lane_dir):
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {outside}")
    files = building.secret_files(matrix, {"pip-conf": str(lane_dir / "pip.conf")}, lane=building.SecretLane())
    assert files.paths == {"pip-conf": str(lane_dir / "pip.conf")}


@pytest.mark.parametrize("settings, message", [
    ({"dirs": ["/no/such/dir"]}, "--secret-dir: '/no/such/dir' is not a directory"),
    ({"dirs": ["/"]}, "--secret-dir: '/' is the whole file system"),
    ({"env": ["NOT-A-NAME"]}, "--secret-env: 'NOT-A-NAME' is not an environment variable name"),
    ({"env": ["COSIGN_PASSWORD"]}, "--secret-env: COSIGN_PASSWORD is a signing or registry credential"),
    ({"environ": {building.SECRET_ENV_ENV: "PIP_CONF, HARBOR_PASSWORD"}},
     "IMAGEBUILD_SECRET_ENV: HARBOR_PASSWORD is a signing or registry credential"),
])
def test_a_bad_lane_setting_is_bad_input(settings, message):
    settings.setdefault("environ", {})
    with pytest.raises(InputError, match=f"^{re.escape(message)}"):
        building.SecretLane.from_settings(**settings)


# --- environment secrets -------------------------------------------------------------------------------


def test_an_env_secret_not_on_the_allowlist_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv("COSIGN_PASSWORD", "the-signing-password")
    matrix = matrix_with(tmp_path, "  netrc:\n    env: COSIGN_PASSWORD")
    with pytest.raises(InputError, match="environment variable COSIGN_PASSWORD is not allowed as a build secret") as caught:
        building.secret_files(matrix, lane=building.SecretLane.from_settings(env=["PIP_CONF"], environ={}))
    err = caught.value
    assert (err.line, err.key) == (SECRETS_LINE + 1, "secrets.netrc.env")
    assert "the-signing-password" not in str(err)


def test_an_allowlisted_env_secret_is_mounted(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONF", "[global]\nindex-url = https://ci:s3cret-token@pypi.example.com/simple\n")
    matrix = matrix_with(tmp_path, "  pip-conf:\n    env: PIP_CONF")
    files = building.secret_files(matrix, lane=building.SecretLane.from_settings(
        environ={building.SECRET_ENV_ENV: "OTHER,PIP_CONF"}))
    try:
        assert Path(files.paths["pip-conf"]).read_text().startswith("[global]")
    finally:
        files.close()


def test_an_optional_env_secret_this_host_lacks_is_skipped_without_an_allowlist(tmp_path, monkeypatch):
    monkeypatch.delenv("IMAGEBUILD_NETRC", raising=False)
    matrix = matrix_with(tmp_path, "  netrc:\n    env: IMAGEBUILD_NETRC\n    optional: true")
    assert building.secret_files(matrix, lane=building.SecretLane()).paths == {}


def test_an_optional_env_secret_that_is_set_still_needs_the_allowlist(tmp_path, monkeypatch):
    monkeypatch.setenv("IMAGEBUILD_NETRC", "machine x login y password z")
    matrix = matrix_with(tmp_path, "  netrc:\n    env: IMAGEBUILD_NETRC\n    optional: true")
    with pytest.raises(InputError, match="--secret-env IMAGEBUILD_NETRC"):
        building.secret_files(matrix, lane=building.SecretLane())


def test_the_cli_refuses_before_any_registry_request_and_writes_nothing(tmp_path, outside):
    """The matrix's registry (a closed loopback port) is never asked: the lane is checked first."""
    path = write_matrix(tmp_path, f"  pip-conf:\n    file: {outside}")
    workdir = tmp_path / "work"
    result = run_imagebuild("build", "--matrix", path, "--workdir", workdir, cwd=tmp_path,
                            env={building.SECRET_DIRS_ENV: "", building.SECRET_ENV_ENV: ""})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: matrix.yaml:{SECRETS_LINE + 1}: secrets.pip-conf.file: '{outside}' is outside the lane "
                     f"for build secrets after resolving links (allowed: the system CA bundle and directories none); "
                     f"the operator allows a directory with --secret-dir DIR or IMAGEBUILD_SECRET_DIRS, "
                     f"or passes --secret pip-conf=PATH"]
    assert not workdir.exists()


def test_the_cli_flags_open_the_lane(tmp_path, lane_dir):
    """Past the lane the build asks its registry (a loopback server of this test's that has no layer)
    and then stops at the Dockerfiles, which were never rendered: bad input too, but another one."""
    registry = RecordingServer()
    try:
        path = write_matrix(tmp_path, f"  pip-conf:\n    file: {lane_dir}/pip.conf\n  netrc:\n    env: MY_NETRC",
                            registry.host)
        env = {building.SECRET_DIRS_ENV: "", building.SECRET_ENV_ENV: "", "MY_NETRC": "machine a login b password c"}
        args = ("build", "--matrix", path, "--workdir", tmp_path / "w", "--dry-run", "--secret-dir", lane_dir)
        refused = run_imagebuild(*args, cwd=tmp_path, env=env)
        assert refused.returncode == 2 and "secrets.netrc.env: environment variable MY_NETRC" in refused.stderr
        assert registry.seen == []
        allowed = run_imagebuild(*args, "--secret-env", "MY_NETRC", cwd=tmp_path, env=env)
        assert allowed.returncode == 2 and "Dockerfile(s) differ from the matrix" in allowed.stderr, allowed.stderr
        assert registry.seen  # it got past the lane to the registry
    finally:
        registry.stop()


# --- the environment of a build ------------------------------------------------------------------------


def test_the_build_environment_is_an_allowlist():
    environ = {"PATH": "/usr/bin", "HOME": "/root", "DOCKER_HOST": "unix:///run/docker.sock", "LC_ALL": "C.UTF-8",
               "COSIGN_PASSWORD": "p", "SIGSTORE_ID_TOKEN": "t", "HARBOR_USERNAME": "u", "HARBOR_PASSWORD": "p",
               "TRIVY_PASSWORD": "p", "EU_WEST_CREDENTIALS": "user:pass", "GITHUB_TOKEN": "t",
               "AWS_SECRET_ACCESS_KEY": "k", "IMAGEBUILD_NETRC": "machine x", "DOCKER_PASSWORD": "p",
               "DOCKER_AUTH_CONFIG": "{}", "PIP_INDEX_URL": "https://u:p@x/simple"}
    assert tools.child_environment(environ) == {"PATH": "/usr/bin", "HOME": "/root",
                                                "DOCKER_HOST": "unix:///run/docker.sock", "LC_ALL": "C.UTF-8"}


def test_a_runner_without_inheritance_hands_the_child_no_credential(tmp_path, monkeypatch):
    """A real child process: what it sees is what `docker build` would see."""
    monkeypatch.setenv("COSIGN_PASSWORD", "cosign-canary")
    monkeypatch.setenv("HARBOR_PASSWORD", "harbor-canary")
    seen = tools.Runner().run(["env"], inherit=False, env={"DOCKER_BUILDKIT": "1"}, timeout=30).output
    assert "cosign-canary" not in seen and "harbor-canary" not in seen
    assert "DOCKER_BUILDKIT=1" in seen and f"PATH={os.environ['PATH']}" in seen
    inherited = tools.Runner().run(["env"], timeout=30).output  # the default, for tools that need credentials
    assert "cosign-canary" in inherited


# --- extra smoke paths ---------------------------------------------------------------------------------

SMOKE_MATRIX = MATRIX.format(secrets="  {}", digest="0" * 64).replace("secrets:\n  {}\n", "")


def smoke_matrix(folder: Path, paths: str):
    path = folder / "matrix.yaml"
    path.write_text(SMOKE_MATRIX.replace("matrix:\n", f"smoke:\n  all: {paths}\nmatrix:\n", 1))
    return load_matrix(path)


@pytest.fixture
def matrix_folder(tmp_path: Path, outside: Path) -> Path:
    folder = tmp_path / "project"
    (folder / "smoke").mkdir(parents=True)
    (folder / "smoke" / "test_ok.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "elsewhere" / "test_theirs.py").write_text("def test_theirs():\n    pass\n")
    return folder


@pytest.mark.parametrize("paths", ["[../elsewhere/test_theirs.py]", "[smoke/../../elsewhere]", "[..]"])
def test_a_smoke_path_out_of_the_matrix_folder_is_bad_input(matrix_folder, paths):
    with pytest.raises(InputError, match=re.escape(f"'{paths[1:-1]}' leads outside the matrix's folder")) as caught:
        smoke_matrix(matrix_folder, paths)
    assert caught.value.key == "smoke.all[0]" and caught.value.line == 14


def test_a_smoke_link_pointing_out_of_the_matrix_folder_is_bad_input(matrix_folder):
    (matrix_folder / "smoke" / "test_link.py").symlink_to(matrix_folder.parent / "elsewhere" / "test_theirs.py")
    with pytest.raises(InputError, match="'smoke/test_link.py' leads outside the matrix's folder"):
        smoke_matrix(matrix_folder, "[smoke/test_link.py]")


def test_a_link_inside_a_smoke_folder_pointing_out_is_bad_input(matrix_folder):
    """The folder is bind-mounted and hashed here: a link in it must not reach the host's files."""
    (matrix_folder / "smoke" / "deep").mkdir()
    (matrix_folder / "smoke" / "deep" / "keys").symlink_to("/etc")
    with pytest.raises(InputError, match="holds a link that leads outside the matrix's folder: smoke/deep/keys"):
        smoke_matrix(matrix_folder, "[smoke]")


def test_links_that_stay_in_the_matrix_folder_are_fine(matrix_folder):
    (matrix_folder / "smoke" / "test_alias.py").symlink_to(matrix_folder / "smoke" / "test_ok.py")
    m = smoke_matrix(matrix_folder, "[smoke, smoke/test_alias.py]")
    assert m.smoke["all"] == (str(matrix_folder / "smoke"), str(matrix_folder / "smoke" / "test_ok.py"))


def test_a_smoke_container_gets_a_fixed_environment_and_nothing_of_this_process(monkeypatch):
    from imagebuild.checks import smoke_run

    monkeypatch.setenv("COSIGN_PASSWORD", "cosign-canary")
    assert smoke_run.CONTAINER_ENV == {"IMAGEBUILD_SMOKE_EXPECT": "/smoke/expect.json",
                                       "IMAGEBUILD_SMOKE_HARNESS": "/smoke/pytest",
                                       "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp"}


def test_release_refuses_the_same_way_before_anything_runs(tmp_path, outside):
    path = write_matrix(tmp_path, f"  pip-conf:\n    file: {outside}")
    result = run_imagebuild("release", "--matrix", path, "--workdir", tmp_path / "w", cwd=tmp_path,
                            env={building.SECRET_DIRS_ENV: "", building.SECRET_ENV_ENV: ""})
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: matrix.yaml:{SECRETS_LINE + 1}: secrets.pip-conf.file: ")
    assert not (tmp_path / "w").exists()


def test_the_lane_a_command_passes_is_the_one_secret_files_reads(tmp_path, lane_dir, monkeypatch):
    """release hands its flags' lane to its build stage (ReleaseOptions.secret_lane); without one,
    only the environment settings count."""
    monkeypatch.delenv(building.SECRET_DIRS_ENV, raising=False)
    matrix = matrix_with(tmp_path, f"  pip-conf:\n    file: {lane_dir}/pip.conf")
    with pytest.raises(InputError, match="pip-conf"):
        building.secret_files(matrix)
    lane = building.SecretLane.from_settings([str(lane_dir)], environ={})
    assert building.secret_files(matrix, lane=lane).paths == {"pip-conf": str(lane_dir / "pip.conf")}
