"""`--only`: one selector, the same axes and the same answers in every command.

The pure selector over plan variants and report records; then, in this process, what each command
selects with it: plan from the matrix, build into its report, scan, gate and test from that report.
Then the CLI: an unknown axis is exit 2 in every command that takes --only, and one run of plan and
of gate shows the flag reaches them. (build --dry-run, scan, gate and test on a real registry, one
run each: tests/e2e/test_selection.py.)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from imagebuild.build.plan import build_plan, plan_record
from imagebuild.build.scheduler import planned_report
from imagebuild.checks.gate_run import run_gate
from imagebuild.checks.smoke_run import RunOptions, run_report
from imagebuild.config.matrix import load_matrix
from imagebuild.config.selection import AXES, Selection
from imagebuild.core.report import BuildReport, VariantRecord
from imagebuild.core.source import InputError

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "local" / "matrix.yaml"
PRODUCTION = REPO / "matrix.yaml"
POLICY = REPO / "policies" / "vulnerabilities.yaml"
COMMANDS_WITH_ONLY = ("plan", "build", "test", "scan", "gate")


def records_of(plan) -> list[VariantRecord]:
    """The report records a build of every variant of `plan` writes (before anything is built)."""
    return planned_report(plan, plan.variants, {}).variants


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
    """The build report of every variant of `plan`, as a dry run writes it (nothing built or scanned)."""
    planned_report(plan, plan.variants, {}).write(workdir / "build-report.json")
    return workdir


@pytest.fixture(scope="module")
def example():
    return build_plan(load_matrix(EXAMPLE))


EXAMPLE_SELECTORS = [("cudnn=8.6",), ("cuda=cpu",), ("device=gpu",), ("os=debian12",), ("python=3.11",),
                     ("paddle=3.3.1", "cudnn=8.6"), ("python=3.11,3.12", "device=gpu"),
                     ("paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12",)]


class NoContainers:
    """The smoke runner `test` makes, for a report of which nothing was built: it is asked which tiers it
    would run (the records say so), never to run or remove a container."""

    options = RunOptions()

    def __getattr__(self, name: str):
        raise AssertionError(f"the smoke runner was asked for {name}: nothing was built")


@pytest.mark.parametrize("only", EXAMPLE_SELECTORS)
def test_every_command_selects_the_same_variants_and_records_only_those(only, example, tmp_path):
    selection = Selection.parse(only)
    expected = [v["id"] for v in plan_record(example, {v.id for v in selection.apply(example.variants)})["variants"]]
    assert expected  # what plan --only prints

    built = planned_report(example, selection.choose(example.variants, str(EXAMPLE)), {})
    assert [v.id for v in built.variants] == expected  # what build --only writes into its report

    # scan, gate and test select from the report of a build of every variant
    workdir = write_report(tmp_path / "w", example)
    report_path = workdir / "build-report.json"
    assert [v.id for v in selection.choose(BuildReport.read(report_path).variants, str(report_path))] == expected
    gated = run_gate(workdir, POLICY, selection)
    assert not gated.passed  # nothing was scanned: each selected image is blocked
    # One entry per image judged: each child of a multi-platform variant's index has its own.
    assert list(dict.fromkeys(image["variant"] for image in gated.record["images"])) == expected
    tested = run_report(report_path, None, selection, NoContainers)
    assert [r.variant for r in tested] == expected
    assert {(r.record.status, r.record.reason) for r in tested} == {("error", "not built (build status: pending)")}
    recorded = [v.id for v in BuildReport.read(report_path).variants if {"gate", "smoke"} <= set(v.stages)]
    assert recorded == expected  # and only those got results


def test_plan_and_gate_take_only(tmp_path, imagebuild, example):
    """The flag reaches both commands: the GPU variant alone, of the example's three."""
    expected = [v.id for v in Selection.parse(["cuda=11.8"]).apply(example.variants)]
    assert len(expected) == 1 and len(example.variants) == 3
    planned = imagebuild("plan", "--matrix", EXAMPLE, "--format", "json", "--only", "cuda=11.8")
    assert planned.returncode == 0, planned.stderr
    assert [v["id"] for v in json.loads(planned.stdout)["variants"]] == expected

    workdir = write_report(tmp_path / "w", example)
    gated = imagebuild("gate", "--workdir", workdir, "--policy", POLICY, "--format", "json", "--only", "cuda=11.8")
    assert gated.returncode == 1, gated.stderr  # nothing was scanned: the selected image is blocked
    assert [image["variant"] for image in json.loads(gated.stdout)["images"]] == expected


@pytest.mark.parametrize("command", ["gate", "scan", "test"])
def test_a_selector_matching_no_variant_of_the_report_is_exit_2(command, tmp_path, imagebuild, example):
    workdir = write_report(tmp_path / "w", example)
    before = (workdir / "build-report.json").read_text()
    run = imagebuild(command, "--workdir", workdir, "--only", "python=2.7")
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip() == f"error: {workdir / 'build-report.json'}: --only: selects no variant (python=2.7)"
    assert (workdir / "build-report.json").read_text() == before
