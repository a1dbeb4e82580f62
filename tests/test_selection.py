"""`--only`: one selector, the same axes and the same answers in every command.

The pure selector over plan variants and report records, then the CLI: an unknown axis is
exit 2 in every command that takes --only, and plan and gate select the same variants from
the same matrix. (build --dry-run, scan and test on a real registry: tests/e2e/test_selection.py.)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan
from imagebuild.config.matrix import load_matrix
from imagebuild.config.selection import AXES, Selection
from imagebuild.core.report import BuildReport, LayerRecord, VariantRecord
from imagebuild.core.source import InputError

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "local" / "matrix.yaml"
PRODUCTION = REPO / "matrix.yaml"
COMMANDS_WITH_ONLY = ("plan", "build", "test", "scan", "gate")


def records_of(plan) -> list[VariantRecord]:
    """The report records a build of `plan` writes (as build.registry_plan makes them)."""
    return [VariantRecord(id=v.id, tags=list(v.tags), images=[], chain=list(v.chain), device=v.device,
                          paddle=v.paddle, python=v.python, cuda=v.cuda, cudnn=v.cudnn, os=v.os)
            for v in plan.variants]


@pytest.fixture(scope="module")
def production():
    return build_plan(load_matrix(PRODUCTION))


SELECTORS = [
    ("cudnn=8.6",), ("cuda=11.8",), ("device=gpu",), ("python=3.10,3.11",), ("os=ubuntu22.04",),
    ("paddle=2.6.2", "python=3.12"), ("id=paddle2.6.2-cuda11.8-cudnn8.6-py3.11-ubuntu22.04",),
    ("paddle2.6.2-cuda11.8-cudnn8.6-py3.11-ubuntu22.04",), (" python = 3.11 ",),
]


@pytest.mark.parametrize("only", SELECTORS)
def test_plan_variants_and_report_records_are_selected_alike(production, only):
    selection = Selection.parse(only)
    from_plan = [v.id for v in selection.apply(production.variants)]
    from_report = [r.id for r in selection.apply(records_of(production))]
    assert from_plan and from_plan == from_report


def test_each_axis_selects_exactly_the_variants_with_that_value(production):
    for v in production.variants[:5]:
        for axis, value in (("python", v.python), ("paddle", v.paddle), ("os", v.os),
                            ("cuda", v.cuda or "cpu"), ("cudnn", v.cudnn or "none"), ("device", v.device)):
            chosen = Selection.parse([f"{axis}={value}"]).apply(production.variants)
            expected = [w for w in production.variants if {"cuda": w.cuda or "cpu", "cudnn": w.cudnn or "none"}
                        .get(axis, getattr(w, axis)) == value]
            assert chosen == expected and v in chosen


def test_commas_are_alternatives_on_one_axis_and_repeats_are_a_union(production):
    both = Selection.parse(["python=3.10,3.11"]).apply(production.variants)
    assert {v.python for v in both} == {"3.10", "3.11"}
    union = Selection.parse(["python=3.10", "python=3.11"]).apply(production.variants)
    assert union == both


def test_no_selector_selects_everything_and_a_report_without_os_matches_no_os_selector(production):
    records = records_of(production)
    assert Selection.parse([]).apply(records) == records
    for r in records:
        r.os = None  # a report written before records carried their OS
    assert Selection.parse(["os=ubuntu22.04"]).apply(records) == []


@pytest.mark.parametrize("text,message", [
    ("colour=blue", "unknown axis 'colour'"),
    ("pyton=3.11", "unknown axis 'pyton' (did you mean 'python'?)"),
    ("python=", "no value for python"),
    ("python=3.10,", "no value for python"),
    ("=3.11", "unknown axis ''"),
])
def test_bad_selectors_are_input_errors_naming_the_option(text, message):
    with pytest.raises(InputError, match=f"^{re.escape(f'--only: {text}: ')}.*{re.escape(message)}") as caught:
        Selection.parse([text])
    if "axis" in message:
        assert ", ".join(AXES) in str(caught.value)


def test_a_selection_of_nothing_is_an_input_error_blaming_the_source(production):
    with pytest.raises(InputError, match=r"^matrix.yaml: --only: selects no variant \(python=2.7\)$"):
        Selection.parse(["python=2.7"]).choose(production.variants, "matrix.yaml")


# --- the CLI ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS_WITH_ONLY)
@pytest.mark.parametrize("selector", ["colour=blue", "pyhton=3.11"])
def test_an_unknown_axis_is_exit_2_in_every_command_before_anything_runs(command, selector, tmp_path, imagebuild):
    args = {"plan": ["--matrix", EXAMPLE], "build": ["--matrix", EXAMPLE, "--workdir", tmp_path / "w"],
            "test": ["--workdir", tmp_path / "w"], "scan": ["--workdir", tmp_path / "w"],
            "gate": ["--workdir", tmp_path / "w"]}[command]
    run = imagebuild(command, *args, "--only", selector)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --only: {selector}: unknown axis"), run.stderr
    assert "known: id, os, device, cuda, cudnn, python, paddle" in lines[0]
    assert not (tmp_path / "w").exists()  # nothing written


@pytest.mark.parametrize("command", COMMANDS_WITH_ONLY)
def test_every_command_lists_the_axes_in_its_help(command, imagebuild):
    run = imagebuild(command, "--help")
    assert run.returncode == 0
    assert "id, os, device, cuda, cudnn, python, paddle" in " ".join(run.stdout.split())


def write_report(workdir: Path, plan) -> Path:
    """The build report of `plan`'s variants, as a build writes it (nothing scanned yet)."""
    layers = [LayerRecord(key=k, kind=layer.kind, path=layer.path, image=f"{plan.cache_ref}:{layer.cache_tag}")
              for k, layer in plan.layers.items()]
    BuildReport(matrix=str(EXAMPLE), revision="r", registry=plan.registry, repository=plan.repository_ref,
                cache_repository=plan.cache_ref, created="2026-01-01T00:00:00Z", variants=records_of(plan),
                layers=layers).write(workdir / "build-report.json")
    return workdir


EXAMPLE_SELECTORS = [("cudnn=8.6",), ("cuda=cpu",), ("device=gpu",), ("os=debian12",), ("python=3.11",),
                     ("paddle=3.3.1", "cudnn=8.6"), ("paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12",)]


@pytest.mark.parametrize("only", EXAMPLE_SELECTORS)
def test_plan_and_gate_select_the_same_variants(only, tmp_path, imagebuild):
    options = [arg for selector in only for arg in ("--only", selector)]
    planned = imagebuild("plan", "--matrix", EXAMPLE, "--format", "json", *options)
    assert planned.returncode == 0, planned.stderr
    expected = [v["id"] for v in json.loads(planned.stdout)["variants"]]
    assert expected == [v.id for v in Selection.parse(only).apply(build_plan(load_matrix(EXAMPLE)).variants)]

    workdir = write_report(tmp_path / "w", build_plan(load_matrix(EXAMPLE)))
    gated = imagebuild("gate", "--workdir", workdir, "--policy", REPO / "policies" / "vulnerabilities.yaml",
                       "--format", "json", *options)
    assert gated.returncode == 1, gated.stderr  # nothing was scanned: each selected image is blocked
    assert [image["variant"] for image in json.loads(gated.stdout)["images"]] == expected


@pytest.mark.parametrize("command", ["gate", "scan", "test"])
def test_a_selector_matching_no_variant_of_the_report_is_exit_2(command, tmp_path, imagebuild):
    workdir = write_report(tmp_path / "w", build_plan(load_matrix(EXAMPLE)))
    before = (workdir / "build-report.json").read_text()
    run = imagebuild(command, "--workdir", workdir, "--only", "python=2.7")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == f"error: {workdir / 'build-report.json'}: --only: selects no variant (python=2.7)"
    assert (workdir / "build-report.json").read_text() == before
