"""The CI fan-out (imagebuild/build/fanout.py) on the 1,000-variant benchmark matrix.

What the workflow relies on: no matrix over GitHub's 256 jobs; each layer the release needs is
built by exactly one job; a layer's job runs in an earlier level than every job building on it;
the variant jobs release exactly the changed variants; a variant batch holds one device only.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from bench.bench_plan import synthetic_matrix
from imagebuild.build.fanout import (
    MAX_MATRIX,
    Fanout,
    changed_variants,
    fanout_record,
    github_outputs,
    matrix_entry,
    plan_fanout,
)
from imagebuild.build.plan import Plan, Variant, build_plan, find_layers, with_ancestors
from imagebuild.config.matrix import load_matrix
from imagebuild.core.source import InputError


@pytest.fixture(scope="module")
def bench_plan(tmp_path_factory) -> Plan:
    path = tmp_path_factory.mktemp("bench") / "matrix.yaml"
    path.write_text(synthetic_matrix(), encoding="utf-8")
    the_plan = build_plan(load_matrix(path))
    assert len(the_plan.variants) == 1000
    return the_plan


def assert_sound(the_plan: Plan, variants: list[Variant], cached: set[str], fanout: Fanout,
                 max_matrix: int = MAX_MATRIX) -> None:
    """Every property the workflow's job graph depends on."""
    for level in fanout.levels:
        for shard in level.shards:
            assert len(shard) <= max_matrix, f"{level.name}: a matrix of {len(shard)} jobs"
    # Exactly one job per layer the release needs and the cache lacks.
    needed = {k for v in variants for k in v.chain} - cached
    built = [k for job in fanout.jobs for k in job.layers]
    assert sorted(built) == sorted(needed), "a needed layer built by no job, or by two"
    # Parents first: a layer's job is in an earlier level, or it is the same job, earlier in its list.
    level_of = {k: i for i, level in enumerate(fanout.levels) for job in level.jobs for k in job.layers}
    for i, level in enumerate(fanout.levels):
        for job in level.jobs:
            for position, key in enumerate(job.layers):
                parent = the_plan.layers[key].parent
                if parent is None or parent in cached:
                    continue
                assert level_of[parent] < i or parent in job.layers[:position], \
                    f"{the_plan.layers[key].path} is built no later than its parent"
            for variant_id in job.variants:  # a variant job finds the rest of its chain built before it
                chain = next(v.chain for v in variants if v.id == variant_id)
                for key in chain:
                    assert key in cached or key in job.layers or level_of[key] < i
    # The variant level releases each changed variant once; nothing else does.
    released = [v for job in fanout.levels[-1].jobs for v in job.variants]
    assert sorted(released) == sorted(v.id for v in variants)
    assert not any(job.variants for level in fanout.levels[:-1] for job in level.jobs)
    devices = {v.id: v.device for v in variants}
    for job in fanout.levels[-1].jobs:
        assert {devices[v] for v in job.variants} == {job.device}, "a batch mixes GPU and CPU variants"


def test_the_benchmark_matrix_fits_in_four_variant_matrices_after_three_layer_levels(bench_plan):
    fanout = plan_fanout(bench_plan, bench_plan.variants)
    assert_sound(bench_plan, list(bench_plan.variants), set(), fanout)
    assert [level.name for level in fanout.levels] == ["layers1", "layers2", "layers3", "variants"]
    assert [len(shard) for shard in fanout.levels[-1].shards] == [250, 250, 250, 250]
    assert all(len(job.variants) == 1 for job in fanout.levels[-1].jobs), "1,000 fit one per job"


def test_layer_levels_build_only_the_layers_several_variants_share(bench_plan):
    fanout = plan_fanout(bench_plan, bench_plan.variants)
    in_layer_levels = {k for level in fanout.levels[:-1] for job in level.jobs for k in job.layers}
    assert in_layer_levels == bench_plan.shared_keys()
    assert len(in_layer_levels) < len(bench_plan.layers) // 10, "the benchmark shares OS, CUDA and Python layers"
    for job in fanout.levels[-1].jobs:
        assert not set(job.layers) & bench_plan.shared_keys()


def test_shared_layers_go_by_depth_and_the_last_layer_level_takes_whole_subtrees(bench_plan):
    one = plan_fanout(bench_plan, bench_plan.variants, layer_levels=1)
    assert_sound(bench_plan, list(bench_plan.variants), set(), one)
    roots = [k for k in bench_plan.shared_keys() if bench_plan.layers[k].parent is None]
    assert len(one.levels[0].jobs) == len(roots), "one job per shared root, with its shared descendants"
    three = plan_fanout(bench_plan, bench_plan.variants, layer_levels=3)
    kinds = [{bench_plan.layers[k].kind for job in level.jobs for k in job.layers} for level in three.levels[:3]]
    assert kinds == [{"base"}, {"cuda", "python"}, {"python"}]


@pytest.mark.parametrize(("layer_levels", "shards", "max_matrix"),
                         [(3, 4, MAX_MATRIX), (2, 1, MAX_MATRIX), (1, 3, 7), (4, 2, 16), (3, 64, 2)])
def test_any_shape_of_workflow_gets_a_sound_fanout(bench_plan, layer_levels, shards, max_matrix):
    fanout = plan_fanout(bench_plan, bench_plan.variants, layer_levels=layer_levels, variant_shards=shards,
                         max_matrix=max_matrix)
    assert_sound(bench_plan, list(bench_plan.variants), set(), fanout, max_matrix)
    assert len(fanout.levels) == layer_levels + 1
    assert len(fanout.levels[-1].shards) == shards


def test_more_variants_than_the_matrices_hold_are_batched_per_device(bench_plan):
    fanout = plan_fanout(bench_plan, bench_plan.variants, variant_shards=2, max_matrix=100)
    assert_sound(bench_plan, list(bench_plan.variants), set(), fanout, 100)
    jobs = fanout.levels[-1].jobs
    assert 100 < len(jobs) <= 200
    assert max(len(job.variants) for job in jobs) == 5


def test_layers_in_the_cache_get_no_job(bench_plan):
    cached = {k for k, layer in bench_plan.layers.items() if layer.kind in ("base", "cuda")}
    fanout = plan_fanout(bench_plan, bench_plan.variants, cached)
    assert_sound(bench_plan, list(bench_plan.variants), cached, fanout)
    assert [len(level.jobs) for level in fanout.levels[:3]] == [125, 0, 0], "the Python layers move up a level"


def test_a_subset_of_variants_shares_only_among_itself(bench_plan):
    chosen = [v for v in bench_plan.variants if v.os == "debian12" and v.python == "3.11" and v.paddle == "3.3.1"]
    fanout = plan_fanout(bench_plan, chosen)
    assert_sound(bench_plan, chosen, set(), fanout)
    assert [len(level.jobs) for level in fanout.levels] == [1, 0, 0, 5], "only the debian12 base is shared"
    assert [len(shard) for shard in fanout.levels[-1].shards] == [2, 2, 1, 0]


def test_no_variants_give_empty_levels(bench_plan):
    fanout = plan_fanout(bench_plan, [])
    assert fanout.jobs == ()
    assert all(line.endswith("=") for line in github_outputs(fanout)[:-1])


def test_changed_variants_are_those_missing_a_tag_or_a_layer_below_the_release_layer(bench_plan):
    variants = list(bench_plan.variants[:3])
    everything = {k for v in variants for k in v.chain}
    tags = {t for v in variants for t in v.tags}
    assert changed_variants(bench_plan, variants, everything, tags) == []
    release_only = everything - {v.chain[-1] for v in variants}
    assert changed_variants(bench_plan, variants, release_only, tags) == [], \
        "a new revision alone (the release layer's labels) releases nothing"
    assert changed_variants(bench_plan, variants, everything - {variants[1].chain[-2]}, tags) == [variants[1]]
    assert changed_variants(bench_plan, variants, everything, tags - {variants[2].tags[0]}) == [variants[2]]


def test_github_outputs_are_one_line_per_shard_and_empty_shards_are_empty(bench_plan):
    chosen = [v for v in bench_plan.variants if v.os == "debian12" and v.python == "3.11" and v.paddle == "3.3.1"]
    fanout = plan_fanout(bench_plan, chosen)
    lines = github_outputs(fanout)
    names = [name for level in fanout.levels for name in level.output_names()] + ["variants"]
    assert [line.split("=", 1)[0] for line in lines] == names
    values = dict(line.split("=", 1) for line in lines)
    assert values["layers2_1"] == "" and values["variants_4"] == "" and values["variants"] == "5"
    assert json.loads(values["layers1_1"]) == {"include": [matrix_entry(fanout.levels[0].jobs[0])]}
    assert all("\n" not in line for line in lines)


def test_the_outputs_for_1000_variants_stay_far_below_githubs_1_mb(bench_plan):
    lines = github_outputs(plan_fanout(bench_plan, bench_plan.variants))
    assert sum(len(line) + 1 for line in lines) < 512 * 1024


def test_the_record_lists_every_level_with_its_matrices(bench_plan):
    fanout = plan_fanout(bench_plan, bench_plan.variants)
    record = fanout_record(bench_plan, fanout)
    assert [(level["name"], level["jobs"]) for level in record["levels"]] == \
        [("layers1", 5), ("layers2", 45), ("layers3", 100), ("variants", 1000)]
    first = record["levels"][-1]["shards"][0]["include"][0]
    assert set(first) == {"name", "variants", "device"}
    assert record["levels"][0]["shards"][0]["include"][0]["layers"] in bench_plan.layers


def test_layers_are_found_by_key_prefix_or_path(bench_plan):
    gpu = next(v for v in bench_plan.variants if v.device == "gpu")
    key = gpu.chain[3]  # base > cuda > python > paddle
    assert bench_plan.layers[key].kind == "paddle"
    assert find_layers(bench_plan, [key, key[:12], bench_plan.layers[key].path]) == [key]
    assert with_ancestors(bench_plan, [key, gpu.chain[1]]) == list(gpu.chain[:4])


@pytest.mark.parametrize(("ref", "message"), [("base/debian13", "did you mean 'base/debian12'"),
                                              ("abc", "names no layer"), ("", "names no layer")])
def test_unknown_layers_are_bad_input(bench_plan, ref, message):
    with pytest.raises(InputError, match=message) as err:
        find_layers(bench_plan, [ref])
    assert str(err.value).startswith("--layers: ")


def test_an_ambiguous_prefix_is_bad_input(bench_plan):
    layer = next(iter(bench_plan.layers.values()))
    twins = {key: dataclasses.replace(layer, key=key) for key in ("deadbeef00" + "0" * 54, "deadbeef01" + "1" * 54)}
    the_plan = dataclasses.replace(bench_plan, layers=twins)
    with pytest.raises(InputError, match="matches 2 layers; give more of the key"):
        find_layers(the_plan, ["deadbeef0"])
    assert find_layers(the_plan, ["deadbeef01"]) == ["deadbeef01" + "1" * 54]
    with pytest.raises(InputError, match="names no layer"):
        find_layers(the_plan, ["deadbee"]), "under 8 digits is never a prefix"
