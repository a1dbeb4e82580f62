"""Rendered Dockerfiles: `render --check` guards them, and the hardening is in every one.

The hardening properties are checked on three sets of Dockerfiles: the committed
dockerfiles/ of matrix.yaml and of examples/local/matrix.yaml, and HARDENED below, a
matrix that turns every knob (its own uid, three secrets, digests, an unpinned base,
per-layer packages, an extra layer), rendered by the tests.
"""
from __future__ import annotations

import contextlib
import re
import shutil
from importlib import resources
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.build.render import GENERATED_HEADER, TEMPLATES, check_tree, write_tree
from imagebuild.config.matrix import load_matrix

REPO_ROOT = Path(__file__).resolve().parent.parent
DEBIAN_DIGEST = "sha256:" + "d" * 64
CUDA_DIGEST = "sha256:" + "c" * 64
HARDENED = f"""\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle-hardened
source: https://example.com/paddle-images
labels: {{io.example.team: ml-platform}}
user: {{name: builder, uid: 4242, gid: 4343}}
setuid_allowlist: [/usr/bin/su]
secrets:
  ca-bundle: {{file: /etc/pki/corp-ca.pem}}
  pip-conf: {{env: CORP_PIP_CONF}}
  netrc: {{env: CORP_NETRC}}
os:
  debian12: {{image: docker.io/library/debian:12, digest: "{DEBIAN_DIGEST}", family: debian}}
  ubuntu22.04: {{image: docker.io/library/ubuntu:22.04, family: ubuntu, python_ppa: deadsnakes/ppa}}
cuda:
  "11.8": {{version: "11.8", cudnn: "8.6", provider: wheels,
           wheels: [nvidia-cuda-runtime-cu11==11.8.89, nvidia-cudnn-cu11==8.6.0.163]}}
  "12.6": {{version: "12.6", cudnn: "9.5", provider: image,
           image: nvidia/cuda:12.6.3-cudnn-runtime-ubuntu22.04, digest: "{CUDA_DIGEST}"}}
layers:
  base: {{packages: [tzdata], env: {{TZ: UTC}}}}
  cuda: {{packages: [libnuma1]}}
  python: {{pip: {{packages: [wheel==0.45.1]}}}}
  paddle: {{packages: [libgl1], pip: {{packages: [numpy==1.26.4]}}}}
extra_layers:
  - {{name: tools, packages: [git], pip: {{packages: [onnx==1.17.0]}}, run: ["git --version"]}}
tags:
  gpu: ["{{paddle}}-gpu-cuda{{cuda}}-cudnn{{cudnn}}-{{os}}{{py_suffix}}"]
  cpu: ["{{paddle}}-{{os}}{{py_suffix}}"]
matrix:
  os: [debian12, ubuntu22.04]
  cuda: [cpu, "11.8"]
  python: ["3.11"]
  paddle: ["2.6.2"]
  include:
    - {{os: ubuntu22.04, cuda: "12.6", python: "3.11", paddle: "3.2.2"}}
"""
SECRET_SOURCES = ("/etc/pki/corp-ca.pem", "CORP_PIP_CONF", "CORP_NETRC")


# --- reading Dockerfiles ------------------------------------------------------------------


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction; continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in dockerfile.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        out.append((keyword.upper(), rest))
        pending = ""
    assert not pending, "a continuation line ends the file"
    return out


def final_stage(dockerfile: str) -> list[tuple[str, str]]:
    steps = instructions(dockerfile)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def runs(dockerfile: str) -> list[str]:
    return [rest for keyword, rest in instructions(dockerfile) if keyword == "RUN"]


def labels(dockerfile: str) -> dict[str, str]:
    [label] = [rest for keyword, rest in instructions(dockerfile) if keyword == "LABEL"]
    return dict(re.findall(r'([a-z0-9.-]+)="((?:[^"\\]|\\.)*)"', label))


# --- the three sets of Dockerfiles --------------------------------------------------------


def committed(matrix_path: Path):
    root = matrix_path.parent / "dockerfiles"
    files = {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in root.rglob("Dockerfile")}
    return load_matrix(matrix_path), files


def hardened(tmp_path_factory):
    path = tmp_path_factory.mktemp("hardened") / "matrix.yaml"
    path.write_text(HARDENED, encoding="utf-8")
    matrix = load_matrix(path)
    return matrix, {path: text for path, text in build_plan(matrix).rendered_files().items()
                    if path.endswith("/Dockerfile")}


@pytest.fixture(scope="module", params=["hardened", "production", "example"])
def rendered(request, tmp_path_factory):
    """(matrix, {path under dockerfiles/: Dockerfile text})."""
    if request.param == "hardened":
        return hardened(tmp_path_factory)
    return committed(REPO_ROOT / ("matrix.yaml" if request.param == "production" else "examples/local/matrix.yaml"))


@pytest.fixture(scope="module")
def hardened_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("hardened-plan") / "matrix.yaml"
    path.write_text(HARDENED, encoding="utf-8")
    return build_plan(load_matrix(path))


def of_kind(files: dict[str, str], *kinds: str) -> dict[str, str]:
    return {path: text for path, text in files.items() if path.split("/")[0] in kinds}


# --- hardening ----------------------------------------------------------------------------


def test_the_hardened_matrix_uses_every_template(hardened_plan):
    layers = hardened_plan.layers.values()
    assert len(hardened_plan.variants) == 5
    assert {layer.kind for layer in layers} == {"base", "cuda", "python", "paddle", "extra", "release"}
    assert any("NVIDIA's runtime image" in layer.dockerfile for layer in layers)  # cuda-image
    assert any("NVIDIA's pip wheels" in layer.dockerfile for layer in layers)  # cuda-wheels


def test_the_wheels_layer_copies_only_what_paddle_opens(hardened_plan):
    """The fetch stage deletes what no Paddle loader opens before the one COPY into the layer."""
    [wheels] = {layer.dockerfile for layer in hardened_plan.layers.values() if "NVIDIA's pip wheels" in layer.dockerfile}
    steps = instructions(wheels)
    copy = next(i for i, (keyword, rest) in enumerate(steps) if keyword == "COPY" and "--from=fetch" in rest)
    fetch = " ;; ".join(rest for keyword, rest in steps[:copy] if keyword == "RUN")  # the stage's RUNs in order
    prune = next(rest for keyword, rest in steps[:copy] if keyword == "RUN" and "libcusolverMg.so*" in rest)
    assert fetch.index("pip install") < fetch.index("libcusolverMg.so*")
    for pattern in ("-name include", "-name __pycache__", "-name '*.a'", "'libcufftw.so*'", "'libnvblas.so*'"):
        assert pattern in prune, pattern
    assert "rm -rf" in prune and "cd /opt/nvidia-wheels/nvidia" in prune


def test_every_dockerfile_ends_as_the_matrixs_non_root_user(rendered):
    matrix, files = rendered
    assert matrix.user.uid != 0 and matrix.user.gid != 0
    expected = f"{matrix.user.uid}:{matrix.user.gid}"
    for path, text in files.items():
        stage = final_stage(text)
        users = [i for i, (keyword, _) in enumerate(stage) if keyword == "USER"]
        assert users and stage[users[-1]][1] == expected, path
        assert all(keyword != "RUN" for keyword, _ in stage[users[-1]:]), f"{path} runs something after USER"


def test_the_root_layers_create_that_user_with_its_fixed_uid_and_gid(rendered):
    matrix, files = rendered
    u = matrix.user
    for path, text in of_kind(files, "base", "cuda").items():
        if "FROM ${IMAGEBUILD_PARENT}" in text:
            continue  # the wheels flavour of cuda builds on a base layer
        assert f"useradd --uid {u.uid} --gid {u.gid} --create-home --shell /bin/bash {u.name}" in text, path
        assert f"groupadd --gid {u.gid} {u.name}" in text, path


def test_every_apt_get_install_removes_the_apt_lists_in_the_same_run(rendered):
    _, files = rendered
    checked = 0
    for path, text in files.items():
        for run in runs(text):
            commands = [c.strip() for c in run.split(";")]
            touching_apt = [i for i, c in enumerate(commands) if re.search(r"apt-get (install|update)", c)]
            if not touching_apt:
                continue
            checked += 1
            after = commands[touching_apt[-1] + 1:]
            assert any(c.startswith("rm -rf /var/lib/apt/lists/*") for c in after), f"{path}: {run}"
            assert after[-1].startswith("rm -rf /var/lib/apt/lists/*"), f"{path}: cleanup is not last: {run}"
    assert checked


def test_pip_never_keeps_a_download_cache(rendered):
    _, files = rendered
    for path, text in files.items():
        for run in runs(text):
            if "pip install" in run:
                assert "--no-cache-dir" in run, f"{path}: {run}"


def test_secrets_reach_a_build_only_through_secret_mounts(rendered):
    matrix, files = rendered
    assert matrix.secret_ids
    for path, text in files.items():
        for keyword, rest in instructions(text):
            for sid in matrix.secret_ids:
                if f"/run/secrets/{sid}" in rest:
                    assert keyword == "RUN", f"{path}: {keyword} {rest}"
                    assert f"--mount=type=secret,id={sid},target=/run/secrets/{sid}" in rest, f"{path}: {rest}"
            assert keyword not in ("COPY", "ADD") or "secret" not in rest, f"{path}: {keyword} {rest}"


def test_where_a_secret_comes_from_is_never_written_into_a_dockerfile(rendered):
    matrix, files = rendered
    for ref in matrix.secrets:
        for source in (ref.file, ref.env):
            if source:
                assert not [path for path, text in files.items() if source in text]


def test_every_run_that_downloads_packages_mounts_every_secret(hardened_plan):
    # The CA bundle must reach pip and apt for a TLS-intercepting proxy; credentials
    # must reach pip for a private index. Known gap, left out here: the python layer's
    # deadsnakes PPA step (add-apt-repository, over https) mounts no secret.
    for layer in hardened_plan.layers.values():
        for run in runs(layer.dockerfile):
            if "pip install" in run or ("apt-get install" in run and "add-apt-repository" not in run):
                for sid in ("ca-bundle", "pip-conf", "netrc"):
                    assert f"--mount=type=secret,id={sid}," in run, f"{layer.path}: {run}"


def test_setuid_bits_are_stripped_after_everything_a_layer_installs(rendered):
    matrix, files = rendered
    strip = "find / -xdev -perm /6000 -type f " + "".join(f"! -path {p} " for p in matrix.setuid_allowlist) \
        + "-exec chmod ug-s {} +"
    for path, text in files.items():
        stage_runs = [rest for keyword, rest in final_stage(text) if keyword == "RUN"]
        if path.startswith("release/"):
            assert stage_runs == [], f"{path}: the release layer adds no files"
        else:
            assert stage_runs and stage_runs[-1] == strip, path


def test_the_setuid_allowlist_comes_from_the_matrix(hardened_plan):
    assert all("! -path /usr/bin/su -exec chmod ug-s" in layer.dockerfile
               for layer in hardened_plan.layers.values() if layer.kind != "release")


def test_release_layers_have_a_healthcheck(rendered):
    _, files = rendered
    for path, text in of_kind(files, "release").items():
        [check] = [rest for keyword, rest in instructions(text) if keyword == "HEALTHCHECK"]
        assert 'CMD ["/opt/venv/bin/python", "-c", "import paddle"]' in check, path


OCI = ("title", "version", "revision", "created", "source", "base.name", "base.digest")


def test_release_layers_carry_the_oci_and_version_labels_from_the_matrix(hardened_plan):
    for variant in hardened_plan.variants:
        release = hardened_plan.layers[variant.chain[-1]]
        root = hardened_plan.layers[variant.chain[0]].root
        got = labels(release.dockerfile)
        assert {f"org.opencontainers.image.{name}" for name in OCI} <= got.keys()
        assert got["org.opencontainers.image.title"] == "paddle-hardened"
        assert got["org.opencontainers.image.version"] == variant.tags[0]
        assert got["org.opencontainers.image.revision"] == "${IMAGEBUILD_REVISION}"
        assert got["org.opencontainers.image.created"] == "${IMAGEBUILD_CREATED}"
        assert got["org.opencontainers.image.source"] == "https://example.com/paddle-images"
        assert got["org.opencontainers.image.base.name"] == root.image
        assert got["org.opencontainers.image.base.digest"] == (root.digest if root.pinned
                                                               else "${IMAGEBUILD_BASE_DIGEST}")
        assert got["io.imagebuild.paddle.version"] == variant.paddle
        assert got["io.imagebuild.python.version"] == variant.python
        assert got["io.imagebuild.cuda.version"] == (variant.cuda or "none")
        assert got["io.imagebuild.cudnn.version"] == (variant.cudnn or "none")
        assert got["io.example.team"] == "ml-platform"


def test_committed_release_layers_carry_every_oci_label(rendered):
    _, files = rendered
    for path, text in of_kind(files, "release").items():
        assert {f"org.opencontainers.image.{name}" for name in OCI} <= labels(text).keys(), path


def test_from_is_pinned_by_digest_when_the_matrix_gives_one(hardened_plan):
    froms = {layer.path: [rest for keyword, rest in instructions(layer.dockerfile) if keyword == "FROM"]
             for layer in hardened_plan.layers.values() if layer.parent is None}
    assert froms == {
        "base/debian12": [f"docker.io/library/debian:12@{DEBIAN_DIGEST}"],
        "base/ubuntu22.04": ["${IMAGEBUILD_BASE}"],
        "cuda/cuda-12.6.3-cudnn-runtime-ubuntu22.04": [f"nvidia/cuda:12.6.3-cudnn-runtime-ubuntu22.04@{CUDA_DIGEST}"],
    }


def test_an_unpinned_base_is_named_by_a_build_arg_the_build_resolves(hardened_plan):
    [base] = [layer for layer in hardened_plan.layers.values() if layer.path == "base/ubuntu22.04"]
    assert ("ARG", "IMAGEBUILD_BASE=docker.io/library/ubuntu:22.04") in instructions(base.dockerfile)
    assert dict(base.build_args)["IMAGEBUILD_BASE"] == "docker.io/library/ubuntu:22.04"


def test_every_other_layer_builds_on_its_parent(rendered):
    _, files = rendered
    for path, text in files.items():
        if path.startswith(("python/", "paddle/", "extra/", "release/")):
            assert [rest for keyword, rest in instructions(text) if keyword == "FROM"][-1] == "${IMAGEBUILD_PARENT}"


# --- render --check -----------------------------------------------------------------------


@pytest.fixture
def production_copy(tmp_path):
    """matrix.yaml and its dockerfiles/, copied as they are committed."""
    shutil.copy(REPO_ROOT / "matrix.yaml", tmp_path / "matrix.yaml")
    shutil.copytree(REPO_ROOT / "dockerfiles", tmp_path / "dockerfiles")
    return tmp_path


def drift_lines(stderr: str) -> list[tuple[str, str]]:
    return re.findall(r"^  (changed|missing|stale)\s+(\S+)$", stderr, flags=re.M)


@pytest.mark.parametrize("matrix", ["matrix.yaml", "examples/local/matrix.yaml"])
def test_check_passes_on_the_committed_tree(imagebuild, matrix):
    result = imagebuild("render", "--check", "--matrix", matrix)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_check_fails_and_names_an_edited_dockerfile(imagebuild, production_copy):
    edited = "python/cuda-12.6.3-cudnn-runtime-ubuntu22.04-py3.11/Dockerfile"
    with (production_copy / "dockerfiles" / edited).open("a", encoding="utf-8") as f:
        f.write("RUN echo an edit by hand\n")
    result = imagebuild("render", "--check", cwd=production_copy)
    assert result.returncode == 1
    assert drift_lines(result.stderr) == [("changed", edited)]


def test_check_fails_and_names_a_stale_file(imagebuild, production_copy):
    stale = production_copy / "dockerfiles" / "python" / "cuda-10.2-py3.7" / "Dockerfile"
    stale.parent.mkdir()
    stale.write_text(f"{GENERATED_HEADER} (python layer); do not edit.\nFROM scratch\n", encoding="utf-8")
    result = imagebuild("render", "--check", cwd=production_copy)
    assert result.returncode == 1
    assert drift_lines(result.stderr) == [("stale", "python/cuda-10.2-py3.7/Dockerfile")]


def test_check_fails_and_names_a_missing_file(imagebuild, production_copy):
    gone = "release/paddle3.2.2-cuda12.9-cudnn9.9-py3.12-ubuntu22.04/Dockerfile"
    (production_copy / "dockerfiles" / gone).unlink()
    result = imagebuild("render", "--check", cwd=production_copy)
    assert result.returncode == 1
    assert drift_lines(result.stderr) == [("missing", gone)]


def test_check_writes_nothing(imagebuild, production_copy):
    edited = production_copy / "dockerfiles" / "cuda" / "cuda-12.9.1-cudnn-runtime-ubuntu22.04" / "Dockerfile"
    edited.write_text("FROM scratch\n", encoding="utf-8")
    before = {p: p.read_bytes() for p in (production_copy / "dockerfiles").rglob("*") if p.is_file()}
    assert imagebuild("render", "--check", cwd=production_copy).returncode == 1
    after = {p: p.read_bytes() for p in (production_copy / "dockerfiles").rglob("*") if p.is_file()}
    assert after == before


def test_check_fails_after_a_template_edit(imagebuild, production_copy, tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(Path(str(resources.files("imagebuild") / "templates")), templates)
    with (templates / "python.Dockerfile.j2").open("a", encoding="utf-8") as f:
        f.write("# one more line\n")
    result = imagebuild("render", "--check", cwd=production_copy, env={"IMAGEBUILD_TEMPLATES_DIR": str(templates)})
    assert result.returncode == 1
    pythons = sorted(str(p.relative_to(production_copy / "dockerfiles"))
                     for p in (production_copy / "dockerfiles" / "python").rglob("Dockerfile"))
    assert drift_lines(result.stderr) == [("changed", path) for path in pythons]


def test_render_repairs_drift_and_removes_stale_files(imagebuild, production_copy):
    root = production_copy / "dockerfiles"
    (root / "paddle" / "obsolete").mkdir()
    (root / "paddle" / "obsolete" / "Dockerfile").write_text(f"{GENERATED_HEADER}\nFROM scratch\n", encoding="utf-8")
    (root / "release" / "paddle3.2.2-cuda12.9-cudnn9.9-py3.12-ubuntu22.04" / "Dockerfile").write_text(
        f"{GENERATED_HEADER}\n", encoding="utf-8")
    assert imagebuild("render", cwd=production_copy).returncode == 0
    assert not (root / "paddle" / "obsolete").exists()
    assert imagebuild("render", "--check", cwd=production_copy).returncode == 0


# Each template, edited, drifts exactly the files rendered from it (_macros.j2: all of them).
TEMPLATE_KINDS = {"base.Dockerfile.j2": "base", "cuda-image.Dockerfile.j2": "cuda", "cuda-wheels.Dockerfile.j2": "cuda",
                  "python.Dockerfile.j2": "python", "paddle.Dockerfile.j2": "paddle", "extra.Dockerfile.j2": "extra",
                  "release.Dockerfile.j2": "release"}


def test_the_template_table_covers_every_template():
    # The webhook's image renders from no matrix (tests/test_admission_image.py holds its Dockerfile).
    assert set(TEMPLATE_KINDS) == set(TEMPLATES.values()) - {TEMPLATES["admission"]}


@pytest.mark.parametrize("template", sorted(TEMPLATE_KINDS) + ["_macros.j2"])
def test_any_template_edit_is_drift(template, hardened_plan, tmp_path):
    write_tree(tmp_path / "dockerfiles", hardened_plan.rendered_files())
    templates = tmp_path / "templates"
    shutil.copytree(Path(str(resources.files("imagebuild") / "templates")), templates)
    source = (templates / template).read_text(encoding="utf-8")
    if template == "_macros.j2":
        edited = source.replace("USER {{ user.uid }}:{{ user.gid }}", "USER {{ user.uid }}:{{ user.gid }}\n# edited")
    else:
        edited = source + "# edited\n"
    assert edited != source
    (templates / template).write_text(edited, encoding="utf-8")

    (tmp_path / "matrix.yaml").write_text(HARDENED, encoding="utf-8")
    plan = build_plan(load_matrix(tmp_path / "matrix.yaml"), templates_dir=templates)
    drift = check_tree(tmp_path / "dockerfiles", plan.rendered_files())
    files = {path: text for path, text in hardened_plan.rendered_files().items() if path.endswith("/Dockerfile")}
    if template == "_macros.j2":
        expected = set(files)
    else:
        marker = "NVIDIA's runtime image" if template.startswith("cuda-image") else \
                 "NVIDIA's pip wheels" if template.startswith("cuda-wheels") else ""
        expected = {path for path, text in of_kind(files, TEMPLATE_KINDS[template]).items() if marker in text}
    assert expected
    assert {(d.reason, d.path) for d in drift} == {("changed", path) for path in expected}


# --- the pip layers' split ----------------------------------------------------------------------


def split_layers(plan) -> list:
    """The layers whose Dockerfile installs with pip in a throw-away stage and copies the result in parts."""
    return [layer for layer in plan.layers.values()
            if layer.kind == "paddle" or "NVIDIA's pip wheels" in layer.dockerfile]


def plan_with(tmp_path, text: str):
    (tmp_path / "matrix.yaml").write_text(text, encoding="utf-8")
    return build_plan(load_matrix(tmp_path / "matrix.yaml"))


@pytest.mark.parametrize("parts", [2, 4, 16])
def test_a_split_layer_copies_in_one_part_per_layer(tmp_path, parts):
    plan = plan_with(tmp_path, HARDENED + f"pip_layers: {{parts: {parts}}}\n")
    layers = split_layers(plan)
    assert {layer.kind for layer in layers} == {"cuda", "paddle"}
    for layer in layers:
        stage = final_stage(layer.dockerfile)
        copies = [rest for keyword, rest in stage if keyword == "COPY"]
        assert copies == [f"--from=fetch /imagebuild-split/parts/{i}/ /" for i in range(1, parts + 1)], layer.path
        [split] = [run for run in runs(layer.dockerfile) if "layersplit.py split" in run]
        assert f"split --parts {parts} " in split and "--max-bytes" not in split
        assert all("pip install" not in rest for keyword, rest in stage if keyword == "RUN")


def test_the_paddle_install_is_snapshotted_and_split_in_its_own_run(hardened_plan):
    for layer in split_layers(hardened_plan):
        if layer.kind != "paddle":
            continue
        [install] = [run for run in runs(layer.dockerfile) if "pip install" in run]
        snapshot, pip, split = (install.index(s) for s in ("layersplit.py snapshot", "pip install", "layersplit.py split"))
        assert snapshot < pip < split, layer.path
        assert "--since /imagebuild-split/before.json /imagebuild-split/parts" in install
        # The throw-away stage has the layer's apt packages too (an sdist may need them to build), in the same RUN
        # text as the final stage's, so BuildKit runs it once.
        fetch_apt, final_apt = [run for run in runs(layer.dockerfile) if "apt-get install" in run]
        assert fetch_apt == final_apt and "libgl1" in final_apt


def test_the_wheels_layer_splits_the_libraries_it_used_to_copy_whole(hardened_plan):
    for wheels in [layer for layer in split_layers(hardened_plan) if layer.kind == "cuda"]:
        # One RUN installs, prunes and splits: a RUN of its own would copy each of the 3 GB up before moving it.
        [install] = [" ".join(run.split()) for run in runs(wheels.dockerfile) if "pip install" in run]
        assert "--package-root /usr/local/nvidia-wheels --tree /opt/nvidia-wheels/nvidia " \
               "--dest /usr/local/nvidia-wheels" in install
        # After the pruning of what Paddle never opens, so no part holds it.
        assert install.index("pip install") < install.index("libcusolverMg.so*") < install.index("layersplit.py split")


def test_a_bound_reaches_the_split_in_bytes(tmp_path):
    plan = plan_with(tmp_path, HARDENED + "pip_layers: {parts: 6, max_part_mib: 900}\n")
    for layer in split_layers(plan):
        [split] = [run for run in runs(layer.dockerfile) if "layersplit.py split" in run]
        assert f"split --parts 6 --max-bytes {900 << 20} " in split


def test_one_copy_of_the_split_program_serves_every_dockerfile_that_runs_it(hardened_plan):
    from imagebuild.build.render import split_script

    source = Path(str(resources.files("imagebuild") / "build" / "layersplit.py")).read_text(encoding="utf-8")
    script = split_script()
    assert script.startswith(GENERATED_HEADER) and script.split("\n", 1)[1] == source
    assert hardened_plan.rendered_files()["layersplit.py"] == script  # at the root of dockerfiles/
    for layer in hardened_plan.layers.values():
        assert set(dict(layer.files)) == {"Dockerfile"}, layer.path
        if layer in split_layers(hardened_plan):
            assert layer.shared == (("layersplit.py", script),), layer.path
            assert ("COPY", "layersplit.py /imagebuild-split/layersplit.py") in instructions(layer.dockerfile)
        else:
            assert layer.shared == () and "layersplit" not in layer.dockerfile, layer.path


def test_a_layer_that_splits_builds_from_the_root_of_the_dockerfiles(hardened_plan, tmp_path):
    from imagebuild.build.scheduler import BuildOptions, layer_inputs
    from imagebuild.core.report import LayerRecord

    options = BuildOptions(dockerfiles=tmp_path / "dockerfiles")
    for layer in hardened_plan.layers.values():
        rec = LayerRecord(key=layer.key, kind=layer.kind, path=layer.path, image="r/p/c:t", base_digest="sha256:0")
        given = layer_inputs(layer, rec, "r/p/c", options)
        assert given.dockerfile == options.dockerfiles / layer.path
        assert given.context == (options.dockerfiles if layer.shared else given.dockerfile), layer.path


def test_each_layer_that_splits_is_built_from_a_folder_of_its_own(hardened_plan, tmp_path):
    # Docker's CLI keys the context it syncs by its folder and the Dockerfile's name: two layers built side by
    # side from the one root folder (`--file <layer>/Dockerfile`) once read each other's Dockerfile (a 3.2.2
    # Paddle layer ran 3.3.1's pip install). So each gets a folder of its own for the build, then it goes.
    from imagebuild.build.scheduler import BuildOptions, DockerLayerBuilder, layer_inputs, own_context
    from imagebuild.core.report import LayerRecord

    root = tmp_path / "dockerfiles"
    write_tree(root, hardened_plan.rendered_files())
    options = BuildOptions(dockerfiles=root, workdir=tmp_path / "work")
    builder = DockerLayerBuilder.__new__(DockerLayerBuilder)
    builder.docker = "docker"
    folders = []
    with contextlib.ExitStack() as stack:
        for layer in split_layers(hardened_plan):
            rec = LayerRecord(key=layer.key, kind=layer.kind, path=layer.path, image="r/p/c:t", base_digest="sha256:0")
            given = stack.enter_context(own_context(layer, layer_inputs(layer, rec, "r/p/c", options), options))
            assert given.context == given.dockerfile != root and given.context.parent == options.workdir / "contexts"
            assert sorted(p.name for p in given.context.iterdir()) == ["Dockerfile", "layersplit.py"]
            assert (given.context / "Dockerfile").read_text() == layer.dockerfile
            assert (given.context / "layersplit.py").read_text() == dict(layer.shared)["layersplit.py"]
            command = builder.command(given, rec)
            assert "--file" not in command and command[-1] == str(given.context)
            folders.append(given.context)
        assert len(set(folders)) == len(folders) > 1
    assert not any(folder.exists() for folder in folders), "each build's folder goes with it"
    other = next(layer for layer in hardened_plan.layers.values() if not layer.shared)
    rec = LayerRecord(key=other.key, kind=other.kind, path=other.path, image="r/p/c:t", base_digest="sha256:0")
    with own_context(other, layer_inputs(other, rec, "r/p/c", options), options) as given:
        assert given.context == root / other.path  # its own folder already


def test_one_part_renders_the_one_layer_install(tmp_path):
    plan = plan_with(tmp_path, HARDENED + "pip_layers: {parts: 1}\n")
    for layer in split_layers(plan):
        assert layer.shared == () and "imagebuild-split" not in layer.dockerfile
        stage = final_stage(layer.dockerfile)
        if layer.kind == "cuda":
            assert ("COPY", "--from=fetch /opt/nvidia-wheels/nvidia /usr/local/nvidia-wheels") in stage
        else:
            assert [k for k, _ in instructions(layer.dockerfile)].count("FROM") == 1
            assert any("pip install" in rest for keyword, rest in stage if keyword == "RUN")


def test_going_back_to_one_part_removes_the_split_program(tmp_path):
    (tmp_path / "split").mkdir()
    (tmp_path / "one").mkdir()
    root = tmp_path / "dockerfiles"
    write_tree(root, plan_with(tmp_path / "split", HARDENED).rendered_files())
    assert [str(p.relative_to(root)) for p in root.rglob("layersplit.py")] == ["layersplit.py"]
    one = plan_with(tmp_path / "one", HARDENED + "pip_layers: {parts: 1}\n")
    assert [line.split()[1] for line in write_tree(root, one.rendered_files()) if line.startswith("stale")] == \
        ["layersplit.py"]
    assert not list(root.rglob("layersplit.py"))
    assert check_tree(root, one.rendered_files()) == []
