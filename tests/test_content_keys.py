"""Content keys: a layer's key changes exactly when the layer would change.

A key hashes the layer's rendered Dockerfile, its build args and its parent's key. So it
is the same on every run, in every process and on every machine; a template, an arg or a
parent change changes it (and, through the parent, every key above it); nothing else does.

KEYS below has three variants, each a chain of layers, root first:
  0  cpu, paddle 2.6.2, python 3.10 on debian12        base > python > paddle > release
  1  cuda 11.8 from wheels, the same on debian12       base > cuda > python > paddle > release
  2  cuda 12.6 from NVIDIA's image, paddle 3.2.2, 3.11       cuda > python > paddle > release
"""
from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest

from imagebuild.build.plan import KEY_VERSION, build_plan, content_key
from imagebuild.config.matrix import load_matrix

DEBIAN_DIGEST = "sha256:" + "1" * 64
CUDA_DIGEST = "sha256:" + "2" * 64
KEYS = f"""\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle
labels: {{io.example.team: ml-platform}}
secrets:
  ca-bundle: {{file: /etc/ssl/certs/ca-certificates.crt}}
os:
  debian12: {{image: docker.io/library/debian:12, digest: "{DEBIAN_DIGEST}", family: debian}}
  ubuntu22.04: {{image: docker.io/library/ubuntu:22.04, family: ubuntu}}
cuda:
  "11.8": {{version: "11.8", cudnn: "8.6", provider: wheels,
           wheels: [nvidia-cuda-runtime-cu11==11.8.89, nvidia-cudnn-cu11==8.6.0.163]}}
  "12.6": {{version: "12.6", cudnn: "9.5", provider: image,
           image: nvidia/cuda:12.6.3-cudnn-runtime-ubuntu22.04, digest: "{CUDA_DIGEST}"}}
layers:
  paddle: {{packages: [libgl1]}}
tags:
  gpu: ["{{paddle}}-gpu-cuda{{cuda}}-cudnn{{cudnn}}{{py_suffix}}"]
  cpu: ["{{paddle}}{{py_suffix}}"]
matrix:
  os: [debian12]
  cuda: [cpu, "11.8"]
  python: ["3.10"]
  paddle: ["2.6.2"]
  include:
    - {{os: ubuntu22.04, cuda: "12.6", python: "3.11", paddle: "3.2.2"}}
"""
ALL = {0: ["base", "python", "paddle", "release"], 1: ["base", "cuda", "python", "paddle", "release"],
       2: ["cuda", "python", "paddle", "release"]}


def edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


@pytest.fixture
def plan_of(tmp_path):
    """Plan for a matrix text, written to its own folder as matrix.yaml."""
    count = 0

    def plan_of(text: str = KEYS, **options):
        nonlocal count
        count += 1
        folder = tmp_path / f"m{count}"
        folder.mkdir()
        (folder / "matrix.yaml").write_text(text, encoding="utf-8")
        return build_plan(load_matrix(folder / "matrix.yaml"), **options)
    return plan_of


def keys_by_path(plan) -> dict[str, str]:
    return {layer.path: key for key, layer in plan.layers.items()}


def changed(before, after) -> dict[int, list[str]]:
    """Variant index -> kinds of the layers in its chain whose key differs."""
    assert len(before.variants) == len(after.variants)
    out = {}
    for i, (old, new) in enumerate(zip(before.variants, after.variants)):
        assert len(old.chain) == len(new.chain)
        kinds = [before.layers[a].kind for a, b in zip(old.chain, new.chain) if a != b]
        if kinds:
            out[i] = kinds
    return out


@pytest.fixture(scope="module")
def package_templates() -> Path:
    return Path(str(resources.files("imagebuild") / "templates"))


# --- content_key itself -------------------------------------------------------------------


def test_the_key_function_is_pinned():
    """Caches in every registry are keyed by this. Changing the function means bumping KEY_VERSION."""
    assert KEY_VERSION == 2
    key = content_key("base", {"Dockerfile": "FROM scratch\n"}, {"IMAGEBUILD_BASE": "docker.io/library/debian:12"}, None)
    assert key == "08709292c0da80a8db935bc888cff008f9f968210bba0db584932605e0fc8671"


def test_the_key_ignores_the_order_of_files_and_args():
    one = content_key("paddle", {"Dockerfile": "A", "b.txt": "B"}, {"X": "1", "Y": "2"}, "p")
    other = content_key("paddle", {"b.txt": "B", "Dockerfile": "A"}, {"Y": "2", "X": "1"}, "p")
    assert one == other


@pytest.mark.parametrize("kind, files, args, parent", [
    pytest.param("python", {"Dockerfile": "A"}, {"X": "1"}, "p", id="kind"),
    pytest.param("paddle", {"Dockerfile": "A\n"}, {"X": "1"}, "p", id="file-content"),
    pytest.param("paddle", {"Dockerfile": "A", "extra.txt": ""}, {"X": "1"}, "p", id="another-file"),
    pytest.param("paddle", {"Dockerfile": "A"}, {"X": "2"}, "p", id="arg-value"),
    pytest.param("paddle", {"Dockerfile": "A"}, {"X": "1", "Y": ""}, "p", id="another-arg"),
    pytest.param("paddle", {"Dockerfile": "A"}, {"X": "1"}, "q", id="parent"),
    pytest.param("paddle", {"Dockerfile": "A"}, {"X": "1"}, None, id="no-parent"),
])
def test_the_key_changes_with_each_of_its_inputs(kind, files, args, parent):
    assert content_key(kind, files, args, parent) != content_key("paddle", {"Dockerfile": "A"}, {"X": "1"}, "p")


# --- stable across runs, processes, machines ----------------------------------------------


def test_keys_are_the_same_on_every_run(plan_of):
    assert keys_by_path(plan_of()) == keys_by_path(plan_of())


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_keys_are_the_same_in_another_process_with_another_cwd_and_hash_seed(tmp_path, plan_of, imagebuild, seed):
    (tmp_path / "matrix.yaml").write_text(KEYS, encoding="utf-8")
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    result = imagebuild("plan", "--format", "json", "--matrix", tmp_path / "matrix.yaml",
                        cwd=elsewhere, env={"PYTHONHASHSEED": seed})
    assert result.returncode == 0, result.stderr
    theirs = {layer["path"]: layer["key"] for layer in json.loads(result.stdout)["layers"]}
    assert theirs == keys_by_path(plan_of())


def test_keys_do_not_depend_on_where_the_matrix_file_lives(tmp_path):
    places = [tmp_path / "a", tmp_path / "b" / "deeper" / "still"]
    plans = []
    for folder in places:
        folder.mkdir(parents=True)
        (folder / "matrix.yaml").write_text(KEYS, encoding="utf-8")
        plans.append(build_plan(load_matrix(folder / "matrix.yaml")))
    assert keys_by_path(plans[0]) == keys_by_path(plans[1])


def test_keys_do_not_depend_on_the_matrix_files_name(tmp_path, plan_of):
    (tmp_path / "paddle-images.yaml").write_text(KEYS, encoding="utf-8")
    renamed = build_plan(load_matrix(tmp_path / "paddle-images.yaml"))
    assert keys_by_path(renamed) == keys_by_path(plan_of())


def test_identical_layers_across_variants_are_one_node(plan_of):
    plan = plan_of()
    cpu, wheels, image = plan.variants
    assert cpu.chain[0] == wheels.chain[0]  # one debian12 base for both
    assert len(plan.layers) == len({key for v in plan.variants for key in v.chain}) == 12


# --- what changes a key -------------------------------------------------------------------


def test_changing_one_variants_python_changes_its_python_paddle_and_release_layers_only(plan_of):
    after = plan_of(edit(KEYS, 'python: "3.11", paddle: "3.2.2"', 'python: "3.12", paddle: "3.2.2"'))
    assert changed(plan_of(), after) == {2: ["python", "paddle", "release"]}


def test_changing_the_paddle_layers_packages_changes_only_paddle_and_release_layers(plan_of):
    after = plan_of(edit(KEYS, "paddle: {packages: [libgl1]}", "paddle: {packages: [libgl1, libglib2.0-0]}"))
    assert changed(plan_of(), after) == {i: ["paddle", "release"] for i in range(3)}


def test_changing_the_revision_changes_only_release_layers(plan_of):
    assert changed(plan_of(revision="abc123"), plan_of(revision="def456")) == {i: ["release"] for i in range(3)}


def test_changing_the_creation_time_changes_only_release_layers(plan_of):
    after = plan_of(created="2026-11-30T12:00:00Z")
    assert changed(plan_of(), after) == {i: ["release"] for i in range(3)}


def test_changing_the_base_image_digest_changes_every_layer_built_on_it(plan_of):
    after = plan_of(edit(KEYS, DEBIAN_DIGEST, "sha256:" + "3" * 64))
    assert changed(plan_of(), after) == {0: ALL[0], 1: ALL[1]}


def test_changing_the_cuda_image_digest_changes_every_layer_built_on_it(plan_of):
    after = plan_of(edit(KEYS, CUDA_DIGEST, "sha256:" + "4" * 64))
    assert changed(plan_of(), after) == {2: ALL[2]}


def test_an_unpinned_base_resolving_to_a_new_digest_changes_keys_but_not_dockerfiles(plan_of):
    unpinned = edit(KEYS, f'digest: "{DEBIAN_DIGEST}", ', "")
    monday = plan_of(unpinned, resolved={("docker.io/library/debian:12", "linux/amd64"): "sha256:" + "5" * 64})
    tuesday = plan_of(unpinned, resolved={("docker.io/library/debian:12", "linux/amd64"): "sha256:" + "6" * 64})
    assert changed(monday, tuesday) == {0: ALL[0], 1: ALL[1]}
    assert monday.rendered_files() == tuesday.rendered_files()


def test_changing_a_matrix_label_changes_only_release_layers(plan_of):
    after = plan_of(edit(KEYS, "io.example.team: ml-platform", "io.example.team: search"))
    assert changed(plan_of(), after) == {i: ["release"] for i in range(3)}


def test_a_label_from_an_include_changes_only_the_release_layers_it_reaches(plan_of):
    after = plan_of(KEYS + "    - {cuda: cpu, labels: {io.example.channel: cpu}}\n")
    assert changed(plan_of(), after) == {0: ["release"]}


def test_gzip_said_or_left_unsaid_keeps_every_key_as_it_was(plan_of):
    """gzip is the default, and every cache and release tag in a registry is keyed without it."""
    assert changed(plan_of(), plan_of(KEYS + "compression: gzip\n")) == {}
    assert content_key("base", {"Dockerfile": "FROM scratch\n"}, {"IMAGEBUILD_BASE": "docker.io/library/debian:12"},
                       None) == "08709292c0da80a8db935bc888cff008f9f968210bba0db584932605e0fc8671"


def test_zstd_changes_only_the_release_layers_and_each_level_is_another_key(plan_of):
    """The layers below are built and pushed gzip whatever the release's compression (BuildKit's cache)."""
    gzip, zstd = plan_of(), plan_of(KEYS + "compression: zstd\n")
    assert changed(gzip, zstd) == {i: ["release"] for i in range(3)}
    assert changed(zstd, plan_of(KEYS + "compression: zstd:3\n")) == {}  # 3 is zstd's default level
    assert changed(zstd, plan_of(KEYS + "compression: zstd:19\n")) == {i: ["release"] for i in range(3)}
    assert {zstd.layers[v.chain[-1]].compression.spec for v in zstd.variants} == {"zstd:3"}
    assert {zstd.layers[k].compression.spec for v in zstd.variants for k in v.chain[:-1]} == {"gzip"}
    assert zstd.rendered_files() == gzip.rendered_files()  # the same Dockerfiles, built the same way


def test_an_include_entrys_compression_wins_over_the_top_levels(plan_of):
    entry = plan_of(KEYS + "    - {cuda: cpu, compression: \"zstd:7\"}\n")
    assert changed(plan_of(), entry) == {0: ["release"]}
    both = plan_of(KEYS + "    - {cuda: cpu, compression: gzip}\ncompression: zstd\n")
    assert [v.compression.spec for v in both.variants] == ["gzip", "zstd:3", "zstd:3"]
    assert changed(plan_of(), both) == {1: ["release"], 2: ["release"]}


def test_the_plan_record_shows_each_variants_and_layers_compression(plan_of):
    from imagebuild.build.plan import plan_record
    from imagebuild.build.scheduler import planned_report
    from imagebuild.core.report import BuildReport

    plan = plan_of(KEYS + "    - {cuda: cpu, compression: zstd}\n")
    record = plan_record(plan)
    assert [v["compression"] for v in record["variants"]] == ["zstd:3", "gzip", "gzip"]
    assert {layer["compression"] for layer in record["layers"] if layer["kind"] != "release"} == {"gzip"}
    report = planned_report(plan, plan.variants, {})
    assert [v.compression for v in report.variants] == ["zstd:3", "gzip", "gzip"]
    read_back = BuildReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert [v.compression for v in read_back.variants] == ["zstd:3", "gzip", "gzip"]


def test_a_template_edit_changes_the_layers_from_that_template_and_all_above_them(plan_of, package_templates, tmp_path):
    edited = tmp_path / "templates"
    shutil.copytree(package_templates, edited)
    with (edited / "python.Dockerfile.j2").open("a", encoding="utf-8") as template:
        template.write("# one more line\n")
    assert changed(plan_of(), plan_of(templates_dir=edited)) == {
        0: ["python", "paddle", "release"], 1: ["python", "paddle", "release"], 2: ["python", "paddle", "release"]}


def test_rendering_from_an_unedited_copy_of_the_templates_changes_nothing(plan_of, package_templates, tmp_path):
    shutil.copytree(package_templates, tmp_path / "templates")
    assert changed(plan_of(), plan_of(templates_dir=tmp_path / "templates")) == {}


def test_adding_a_variant_leaves_the_other_variants_keys_alone(plan_of):
    after = plan_of(KEYS + '    - {os: ubuntu22.04, cuda: "12.6", python: "3.11", paddle: "3.1.0"}\n')
    before = plan_of()
    assert [v.chain for v in after.variants[:3]] == [v.chain for v in before.variants]
    assert after.variants[3].chain[:2] == before.variants[2].chain[:2]  # shares cuda and python layers


# --- what does not change a key -----------------------------------------------------------


def test_a_comment_in_the_matrix_changes_nothing(plan_of):
    commented = "# The team's images.\n" + edit(KEYS, "layers:\n", "layers:  # more to come\n# spare line\n")
    assert keys_by_path(plan_of(commented)) == keys_by_path(plan_of())


def test_reordering_the_matrix_sections_changes_nothing(plan_of):
    tags = 'tags:\n  gpu: ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}{py_suffix}"]\n  cpu: ["{paddle}{py_suffix}"]\n'
    reordered = tags + edit(KEYS, tags, "")
    assert keys_by_path(plan_of(reordered)) == keys_by_path(plan_of())


def test_moving_to_another_registry_or_project_changes_nothing(plan_of):
    moved = edit(edit(KEYS, "registry: registry.example.com", "registry: harbor.internal:8443"),
                 "project: paddle", "project: ml-images")
    assert keys_by_path(plan_of(moved)) == keys_by_path(plan_of())


def test_where_a_secret_comes_from_changes_nothing(plan_of):
    """Secrets are mounted for one RUN; their source is not part of any layer."""
    elsewhere = edit(KEYS, "ca-bundle: {file: /etc/ssl/certs/ca-certificates.crt}", "ca-bundle: {env: CORP_CA_PEM}")
    assert keys_by_path(plan_of(elsewhere)) == keys_by_path(plan_of())


# --- the pip layers' split (pip_layers) ---------------------------------------------------------


def test_the_number_of_parts_changes_only_the_layers_that_split_and_what_stands_on_them(plan_of):
    """The wheels layer and every Paddle layer split; the base, the image-provider CUDA layer and the
    python layers do not (the wheels chain's python layer changes only because its parent did)."""
    after = plan_of(KEYS + "pip_layers: {parts: 2}\n")
    assert changed(plan_of(), after) == {0: ["paddle", "release"], 1: ["cuda", "python", "paddle", "release"],
                                         2: ["paddle", "release"]}
    assert changed(after, plan_of(KEYS + "pip_layers: {parts: 2, max_part_mib: 900}\n")) == \
        changed(plan_of(), after)


def test_the_default_is_four_parts_said_or_unsaid(plan_of):
    assert changed(plan_of(), plan_of(KEYS + "pip_layers: {parts: 4}\n")) == {}


def test_the_split_program_is_part_of_the_key_of_every_layer_that_runs_it(plan_of, monkeypatch):
    """An edit to imagebuild/build/layersplit.py rebuilds the layers that split, and nothing else."""
    from imagebuild.build import plan as planning

    before = plan_of()
    monkeypatch.setattr(planning, "split_script", lambda: "# Generated by `imagebuild render`\n# edited\n")
    assert changed(before, plan_of()) == {0: ["paddle", "release"], 1: ["cuda", "python", "paddle", "release"],
                                          2: ["paddle", "release"]}
    assert changed(plan_of(KEYS + "pip_layers: {parts: 1}\n"), plan_of(KEYS + "pip_layers: {parts: 1}\n")) == {}
