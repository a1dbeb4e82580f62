"""How matrix.yaml expands into variants: GitHub Actions' include/exclude rules.

The rules, as GitHub documents them for `strategy.matrix`:
- the axes multiply out into every combination;
- `exclude` runs first and removes every combination that matches all the keys of an
  entry (a partial match is enough);
- each `include` entry is added to every original combination whose values it does not
  contradict; here it may only add `tags` and `labels`, never change an axis value. An
  entry that fits no original combination becomes a new combination of its own (here it
  must then name every axis). Includes look only at the original combinations.

The axes multiply in the fixed order os, cuda, python, paddle (paddle varies fastest),
then the combinations that includes add, in include order.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.config.matrix import load_matrix
from imagebuild.config.selection import Selection
from imagebuild.core.source import InputError

REPO_ROOT = Path(__file__).resolve().parent.parent

BASE = """\
schema: 1
registry: registry.example.com
project: paddle
repository: paddle
os:
  debian12: {image: docker.io/library/debian:12, family: debian}
  debian11: {image: docker.io/library/debian:11, family: debian}
cuda:
  "12.6": {version: "12.6", cudnn: "9.5", provider: wheels, wheels: [nvidia-cuda-runtime-cu12==12.6.77]}
  "11.8": {version: "11.8", cudnn: "8.9", provider: wheels, wheels: [nvidia-cuda-runtime-cu11==11.8.89]}
tags:
  gpu: ["{paddle}-gpu-cuda{cuda}-cudnn{cudnn}{py_suffix}"]
  cpu: ["{paddle}{py_suffix}"]
"""
AXES = """\
matrix:
  os: [debian12]
  cuda: [cpu, "12.6"]
  python: ["3.10", "3.11"]
  paddle: ["3.1.0", "3.2.2"]
"""
PRODUCT = [  # (os, cuda, python, paddle) in expansion order
    ("debian12", "cpu", "3.10", "3.1.0"), ("debian12", "cpu", "3.10", "3.2.2"),
    ("debian12", "cpu", "3.11", "3.1.0"), ("debian12", "cpu", "3.11", "3.2.2"),
    ("debian12", "12.6", "3.10", "3.1.0"), ("debian12", "12.6", "3.10", "3.2.2"),
    ("debian12", "12.6", "3.11", "3.1.0"), ("debian12", "12.6", "3.11", "3.2.2"),
]


@pytest.fixture
def load(tmp_path):
    def load(*matrix_lines: str, text: str | None = None):
        path = tmp_path / "matrix.yaml"
        path.write_text(text if text is not None else BASE + AXES + "".join(f"{line}\n" for line in matrix_lines),
                        encoding="utf-8")
        return load_matrix(path)
    return load


def cells(matrix) -> list[tuple[str, str, str, str]]:
    return [(c.os, c.cuda, c.python, c.paddle) for c in matrix.combinations]


def labelled(matrix, key: str) -> list[tuple[str, str, str, str]]:
    return [(c.os, c.cuda, c.python, c.paddle) for c in matrix.combinations if key in dict(c.labels)]


# --- the product --------------------------------------------------------------------------


def test_the_axes_multiply_out_with_paddle_varying_fastest(load):
    assert cells(load()) == PRODUCT


def test_the_order_of_the_axes_in_the_file_does_not_change_the_order(load):
    reordered = BASE + 'matrix:\n  paddle: ["3.1.0", "3.2.2"]\n  python: ["3.10", "3.11"]\n' \
                       '  cuda: [cpu, "12.6"]\n  os: [debian12]\n'
    assert cells(load(text=reordered)) == PRODUCT


def test_the_order_of_values_within_an_axis_is_kept(load):
    text = (BASE + AXES).replace('python: ["3.10", "3.11"]', 'python: ["3.11", "3.10"]')
    assert [c[2] for c in cells(load(text=text))][:4] == ["3.11", "3.11", "3.10", "3.10"]


# --- exclude -------------------------------------------------------------------------------


def test_exclude_removes_every_combination_matching_all_its_keys(load):
    matrix = load("  exclude:", '    - {cuda: "12.6", python: "3.10"}')
    assert cells(matrix) == [c for c in PRODUCT if not (c[1] == "12.6" and c[2] == "3.10")]


def test_exclude_with_one_key_removes_every_combination_with_that_value(load):
    matrix = load("  exclude:", "    - {cuda: cpu}")
    assert cells(matrix) == [c for c in PRODUCT if c[1] != "cpu"]


def test_exclude_naming_every_axis_removes_one_combination(load):
    matrix = load("  exclude:", '    - {os: debian12, cuda: cpu, python: "3.11", paddle: "3.1.0"}')
    assert cells(matrix) == [c for c in PRODUCT if c != ("debian12", "cpu", "3.11", "3.1.0")]


def test_exclude_entries_add_up(load):
    matrix = load("  exclude:", "    - {cuda: cpu}", '    - {paddle: "3.1.0"}')
    assert cells(matrix) == [("debian12", "12.6", "3.10", "3.2.2"), ("debian12", "12.6", "3.11", "3.2.2")]


# --- include -------------------------------------------------------------------------------


def test_include_extends_every_original_combination_it_matches(load):
    matrix = load("  include:", '    - {cuda: "12.6", labels: {io.example.channel: gpu}}')
    assert cells(matrix) == PRODUCT
    assert labelled(matrix, "io.example.channel") == [c for c in PRODUCT if c[1] == "12.6"]


def test_include_without_axis_keys_extends_every_combination(load):
    matrix = load("  include:", "    - {labels: {io.example.team: ml}}")
    assert labelled(matrix, "io.example.team") == PRODUCT


def test_include_adds_its_tags_to_the_combinations_it_matches(load):
    matrix = load("  include:", '    - {cuda: cpu, python: "3.11", tags: ["{paddle}-cpu-latest"]}')
    tagged = {(c.cuda, c.python, c.paddle): c.tags for c in matrix.combinations if c.tags}
    assert tagged == {("cpu", "3.11", "3.1.0"): ("{paddle}-cpu-latest",),
                      ("cpu", "3.11", "3.2.2"): ("{paddle}-cpu-latest",)}


def test_include_that_fits_no_original_adds_a_new_combination_after_the_product(load):
    matrix = load("  include:", '    - {os: debian11, cuda: "11.8", python: "3.12", paddle: "3.2.2"}')
    assert cells(matrix) == PRODUCT + [("debian11", "11.8", "3.12", "3.2.2")]


def test_include_never_overwrites_an_original_axis_value(load):
    # Agrees with the cpu/3.1.0 cells on three axes but not on python: it is a new
    # combination, and no original combination turns into python 3.12.
    matrix = load("  include:", '    - {os: debian12, cuda: cpu, python: "3.12", paddle: "3.1.0"}')
    assert cells(matrix) == PRODUCT + [("debian12", "cpu", "3.12", "3.1.0")]


def test_new_combinations_keep_the_order_of_their_include_entries(load):
    matrix = load("  include:",
                  '    - {os: debian11, cuda: cpu, python: "3.12", paddle: "3.2.2"}',
                  '    - {os: debian11, cuda: cpu, python: "3.9", paddle: "3.2.2"}')
    assert cells(matrix)[len(PRODUCT):] == [("debian11", "cpu", "3.12", "3.2.2"), ("debian11", "cpu", "3.9", "3.2.2")]


def test_a_later_include_overrides_what_an_earlier_one_added(load):
    matrix = load("  include:",
                  '    - {cuda: "12.6", tags: ["{paddle}-gpu{py_suffix}"]}',
                  '    - {cuda: "12.6", python: "3.10", tags: ["{paddle}-gpu-legacy"]}')
    tags = {(c.python, c.paddle): c.tags for c in matrix.combinations if c.cuda == "12.6"}
    assert tags == {("3.10", "3.1.0"): ("{paddle}-gpu-legacy",), ("3.10", "3.2.2"): ("{paddle}-gpu-legacy",),
                    ("3.11", "3.1.0"): ("{paddle}-gpu{py_suffix}",), ("3.11", "3.2.2"): ("{paddle}-gpu{py_suffix}",)}


def test_includes_match_only_the_original_combinations_not_added_ones(load):
    # GitHub: {fruit: banana, animal: cat} does not extend the {fruit: banana} an earlier
    # include added. Here the second entry fits no original, so it would be a new
    # combination, and one that does not name every axis is refused.
    with pytest.raises(InputError, match="matches no combination, so it adds a new one, which needs os, cuda, paddle") as error:
        load("  include:",
             '    - {os: debian12, cuda: cpu, python: "3.12", paddle: "3.2.2"}',
             '    - {python: "3.12", labels: {io.example.preview: "yes"}}')
    assert error.value.key == "matrix.include[1]"
    assert "needs os, cuda, paddle" in error.value.message


def test_exclude_runs_before_include_so_include_can_bring_a_combination_back(load):
    matrix = load("  exclude:", "    - {cuda: cpu}",
                  "  include:", '    - {os: debian12, cuda: cpu, python: "3.11", paddle: "3.2.2"}')
    assert cells(matrix) == [c for c in PRODUCT if c[1] != "cpu"] + [("debian12", "cpu", "3.11", "3.2.2")]


def test_expansion_order_is_the_same_in_every_process(tmp_path, imagebuild):
    path = tmp_path / "matrix.yaml"
    path.write_text(BASE + AXES + '  include:\n    - {os: debian11, cuda: "11.8", python: "3.12", paddle: "3.2.2"}\n',
                    encoding="utf-8")
    runs = [imagebuild("plan", "--format", "json", "--matrix", path, env={"PYTHONHASHSEED": seed})
            for seed in ("1", "2")]
    orders = [[v["id"] for v in json.loads(run.stdout)["variants"]] for run in runs]
    assert orders[0] == orders[1] == [v.id for v in build_plan(load_matrix(path)).variants]


# --- the support table --------------------------------------------------------------------


def test_allow_unsupported_with_a_reason_admits_the_combination(load):
    text = BASE + AXES.replace('python: ["3.10", "3.11"]', 'python: ["3.10", "3.14"]') + \
        'allow_unsupported:\n  - {python: "3.14", reason: "preview images for the platform team"}\n'
    assert ("debian12", "cpu", "3.14", "3.2.2") in cells(load(text=text))


# --- tags ----------------------------------------------------------------------------------


def test_python_suffix_only_where_a_paddle_cuda_pair_ships_for_several_pythons(load):
    # cpu ships only for 3.10 (3.11 is excluded); 12.6 ships for 3.10 and 3.11.
    matrix = load("  exclude:", '    - {cuda: cpu, python: "3.11"}')
    tags = {v.id: v.tags for v in build_plan(matrix).variants if v.paddle == "3.2.2"}
    assert tags == {
        "paddle3.2.2-cpu-py3.10-debian12": ("3.2.2",),
        "paddle3.2.2-cuda12.6-cudnn9.5-py3.10-debian12": ("3.2.2-gpu-cuda12.6-cudnn9.5-py310",),
        "paddle3.2.2-cuda12.6-cudnn9.5-py3.11-debian12": ("3.2.2-gpu-cuda12.6-cudnn9.5-py311",),
    }


def test_python_suffix_is_decided_per_paddle_version(load):
    matrix = load("  exclude:", '    - {paddle: "3.1.0", python: "3.11"}')
    tags = {(v.cuda, v.python, v.paddle): v.tags[0] for v in build_plan(matrix).variants}
    assert tags[(None, "3.10", "3.1.0")] == "3.1.0"
    assert tags[(None, "3.10", "3.2.2")] == "3.2.2-py310"


# --- unquoted versions --------------------------------------------------------------------


def test_unquoted_python_3_10_means_3_10_not_3_1(load):
    matrix = load(text=BASE + AXES.replace('python: ["3.10", "3.11"]', "python: [3.10, 3.11]"))
    assert sorted({c.python for c in matrix.combinations}) == ["3.10", "3.11"]


def test_unquoted_versions_are_read_as_written_everywhere(load):
    text = (BASE + AXES).replace('"12.6": {version: "12.6", cudnn: "9.5"', "12.6: {version: 12.6, cudnn: 9.5") \
                        .replace('cuda: [cpu, "12.6"]', "cuda: [cpu, 12.6]")
    text += "  exclude:\n    - {python: 3.10, cuda: 12.6}\n"
    matrix = load(text=text)
    assert matrix.cuda["12.6"].version == "12.6" and matrix.cuda["12.6"].cudnn == "9.5"
    assert cells(matrix) == [c for c in PRODUCT if not (c[1] == "12.6" and c[2] == "3.10")]


# --- the two committed matrices ------------------------------------------------------------


@pytest.fixture(scope="module")
def production():
    return build_plan(load_matrix(REPO_ROOT / "matrix.yaml"))


@pytest.fixture(scope="module")
def example():
    return load_matrix(REPO_ROOT / "examples" / "local" / "matrix.yaml")


def test_production_has_at_least_12_variants(production):
    assert len(production.variants) >= 12


def test_production_gives_no_two_variants_the_same_tag(production):
    tags = [tag for v in production.variants for tag in v.tags]
    assert len(tags) == len(set(tags))


def test_production_shares_layers_between_variants(production):
    assert len(production.layers) < production.chain_length_total() * 3 / 4


def test_production_tags_follow_paddles_own_scheme(production):
    for v in production.variants:
        assert re.fullmatch(r"\d+\.\d+\.\d+-gpu-cuda\d+\.\d+-cudnn\d+\.\d+(-py3\d+)?", v.tags[0]), v.tags


def test_production_covers_paddle_2_6_and_3_on_cuda_11_8_12_6_12_9_and_python_3_10_to_3_12(production):
    assert {v.paddle.rsplit(".", 1)[0] for v in production.variants} >= {"2.6", "3.0"}
    assert {v.cuda for v in production.variants} == {"11.8", "12.6", "12.9"}
    assert {v.python for v in production.variants} == {"3.10", "3.11", "3.12"}


def test_production_takes_cuda_from_nvidias_images(production):
    roots = [layer for layer in production.layers.values() if layer.parent is None]
    assert roots and all(layer.kind == "cuda" and layer.root.image.startswith("nvidia/cuda:") for layer in roots)


def test_example_has_exactly_three_variants(example):
    assert len(example.combinations) == 3


def test_example_cpu_variants_run_the_newest_paddle_and_the_newest_with_arm64_wheels(example):
    plan = build_plan(example)
    cpu = {v.paddle: v for v in plan.variants if v.device == "cpu"}
    assert sorted(cpu) == ["3.2.2", "3.3.1"]
    assert cpu["3.3.1"].platforms == ("linux/amd64",)
    assert "paddlepaddle==3.3.1" in plan.layers[cpu["3.3.1"].chain[-2]].dockerfile
    assert cpu["3.2.2"].platforms == ("linux/amd64", "linux/arm64")
    for platform in cpu["3.2.2"].platform_chains:
        assert "paddlepaddle==3.2.2" in plan.layers[platform.chain[-2]].dockerfile


def test_example_gpu_variant_runs_paddle_2_6_2_on_cuda_11_8_cudnn_8_6_from_nvidias_wheels(example):
    plan = build_plan(example)
    [gpu] = [v for v in plan.variants if v.device == "gpu"]
    [combo] = [c for c in example.combinations if c.cuda != "cpu"]
    assert (gpu.paddle, gpu.cuda, gpu.cudnn) == ("2.6.2", "11.8", "8.6")
    assert example.cuda[combo.cuda].provider == "wheels"
    assert [plan.layers[k].kind for k in gpu.chain] == ["base", "cuda", "python", "paddle", "release"]
    assert "nvidia-cudnn-cu11==8.6" in plan.layers[gpu.chain[1]].dockerfile
    assert "paddlepaddle-gpu==2.6.2" in plan.layers[gpu.chain[3]].dockerfile


def test_example_variants_share_their_base_layer_per_platform(example):
    plan = build_plan(example)
    amd64 = {v.platform_chains[0].chain[0] for v in plan.variants}
    assert len(amd64) == 1
    [arm64] = [p for v in plan.variants for p in v.platform_chains if p.platform == "linux/arm64"]
    assert arm64.chain[0] not in amd64 and plan.layers[arm64.chain[0]].path == plan.layers[next(iter(amd64))].path


# --- --only on plan variants (imagebuild.config.selection) --------------------------------------------------------------


@pytest.fixture
def plan(load):
    return build_plan(load())


def select(plan, selectors: tuple[str, ...]):
    return Selection.parse(selectors).apply(plan.variants)


def ids(variants) -> list[str]:
    return [v.id for v in variants]


def test_no_selector_selects_every_variant(plan):
    assert select(plan, ()) == list(plan.variants)


def test_a_variant_id_selects_that_variant(plan):
    assert ids(select(plan, ("paddle3.2.2-cpu-py3.11-debian12",))) == ["paddle3.2.2-cpu-py3.11-debian12"]


def test_an_axis_value_selects_every_variant_with_it(plan):
    assert ids(select(plan, ("python=3.10",))) == [v.id for v in plan.variants if v.python == "3.10"]


def test_device_and_cuda_cpu_select_the_cpu_variants(plan):
    cpu = [v.id for v in plan.variants if v.cuda is None]
    assert ids(select(plan, ("device=cpu",))) == cpu
    assert ids(select(plan, ("cuda=cpu",))) == cpu


def test_several_selectors_select_the_union_in_plan_order(plan):
    chosen = select(plan, ("paddle=3.1.0", "paddle3.2.2-cpu-py3.10-debian12"))
    assert ids(chosen) == [v.id for v in plan.variants if v.paddle == "3.1.0" or v.id == "paddle3.2.2-cpu-py3.10-debian12"]


def test_cuda_selects_by_cuda_version_and_cudnn_narrows_it(production):
    on_11_8 = select(production, ("cuda=11.8",))
    assert {v.cudnn for v in on_11_8} == {"8.6", "8.9"}
    assert {v.paddle for v in select(production, ("cudnn=8.6",))} == {"2.6.2"}


def test_a_selector_matching_nothing_selects_nothing(plan):
    assert select(plan, ("python=2.7", "paddle9.9.9-cpu-py3.10-debian12")) == []
