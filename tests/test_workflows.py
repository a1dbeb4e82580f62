"""The GitHub Actions workflows: valid, safe with untrusted pull requests, and wired to the CLI's plan.

Each workflow only calls imagebuild; these tests read the YAML and hold it to what the commands
print (the 1,000-variant benchmark matrix for the fan-out).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from bench.bench_plan import synthetic_matrix

from .conftest import run_imagebuild

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / ".github" / "workflows"
ACTIONLINT = Path("/opt/imagebuild-tools/bin/actionlint")
MAX_MATRIX = 256
BUILDER = ["self-hosted", "linux", "x64", "imagebuild"]


def load(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def triggers(workflow: dict) -> dict:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    return {name: None for name in on} if isinstance(on, list) else dict(on)


def runs(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def step_env(job: dict) -> dict:
    return {k: v for step in job["steps"] for k, v in (step.get("env") or {}).items()}


@pytest.fixture(scope="module")
def bench_matrix(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "matrix.yaml"
    path.write_text(synthetic_matrix(), encoding="utf-8")
    return path


# --- every workflow -------------------------------------------------------------------------------


def test_workflows_pass_actionlint():
    tool = shutil.which("actionlint") or str(ACTIONLINT)
    assert Path(tool).exists(), "actionlint is missing: run scripts/bootstrap.sh"
    proc = subprocess.run([tool, "-color=false"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in WORKFLOWS.glob("*.yml")) == \
        ["images.yml", "nightly-rescan.yml", "pull-request.yml", "rollout.yml"]


def test_actionlint_refuses_untrusted_input_spliced_into_shell(tmp_path):
    """The check above can fail: a pull request's title inside `run:` is a script injection to actionlint."""
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    (workflows / "bad.yml").write_text(
        "on: pull_request\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
        "      - run: echo \"${{ github.event.pull_request.title }}\"\n")
    tool = shutil.which("actionlint") or str(ACTIONLINT)
    proc = subprocess.run([tool, "-color=false", str(workflows / "bad.yml")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "potentially untrusted" in proc.stdout


@pytest.mark.parametrize("name", ["images.yml", "nightly-rescan.yml", "pull-request.yml", "rollout.yml"])
def test_no_expression_is_spliced_into_shell(name):
    """Inputs, matrix values and outputs reach `run:` through env vars, never as shell text."""
    workflow = load(name)
    for job_id, job in workflow["jobs"].items():
        for step in job["steps"]:
            assert "${{" not in step.get("run", ""), f"{name}: {job_id}: {step.get('name') or step['run'][:40]}"


@pytest.mark.parametrize("name", ["images.yml", "nightly-rescan.yml", "pull-request.yml", "rollout.yml"])
def test_tokens_are_read_only_unless_a_job_says_why(name):
    workflow = load(name)
    assert workflow["permissions"] == {"contents": "read"}
    widened = {job_id: job["permissions"] for job_id, job in workflow["jobs"].items() if "permissions" in job}
    if name == "nightly-rescan.yml":
        assert widened == {"rescan": {"contents": "read", "issues": "write"}}, "issues: to open the alert"
    else:
        assert widened == {}
    for job in workflow["jobs"].values():
        for step in job["steps"]:
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False, "no token left in .git/config"


def test_no_workflow_runs_pull_request_code_with_the_base_repositorys_rights():
    for path in WORKFLOWS.glob("*.yml"):
        on = triggers(load(path.name))
        assert "pull_request_target" not in on and "workflow_run" not in on, path.name


# --- pull requests --------------------------------------------------------------------------------


def test_pull_requests_get_no_secrets_and_no_self_hosted_runner():
    text = (WORKFLOWS / "pull-request.yml").read_text()
    workflow = yaml.safe_load(text)
    assert list(triggers(workflow)) == ["pull_request"]
    assert "secrets." not in text and "vars." not in text
    for job_id, job in workflow["jobs"].items():
        assert job["runs-on"] == "ubuntu-latest", f"{job_id}: a fork's code must not reach our builders"
        assert "environment" not in job


def test_pull_requests_run_the_checks_the_tests_and_the_plan():
    commands = "\n".join(runs(job) for job in load("pull-request.yml")["jobs"].values())
    for command in ("imagebuild render --check", "imagebuild policies generate --check", "scripts/test.sh",
                    "imagebuild plan\n", "imagebuild plan --format github-fanout"):
        assert command in commands + "\n", command


def test_the_merge_workflow_holds_no_pull_request_trigger():
    assert set(triggers(load("images.yml"))) == {"push", "workflow_dispatch"}
    assert triggers(load("images.yml"))["push"] == {"branches": ["main"]}


# --- the fan-out on merge -------------------------------------------------------------------------


def fanout_jobs(workflow: dict) -> dict[str, str]:
    """job id -> the plan output its matrix reads."""
    found = {}
    for job_id, job in workflow["jobs"].items():
        matrix = (job.get("strategy") or {}).get("matrix")
        if isinstance(matrix, str):
            match = re.fullmatch(r"\$\{\{ fromJSON\(needs\.plan\.outputs\.(\w+)\) \}\}", matrix)
            assert match, f"{job_id}: {matrix}"
            found[job_id] = match.group(1)
    return found


def plan_outputs(matrix: Path) -> dict[str, str]:
    proc = run_imagebuild("plan", "--matrix", matrix, "--format", "github-output")
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


def test_every_shard_the_plan_prints_has_its_job_and_every_job_its_shard(bench_matrix):
    workflow = load("images.yml")
    outputs = plan_outputs(bench_matrix)
    declared = workflow["jobs"]["plan"]["outputs"]
    assert set(declared) == set(outputs)
    assert all(value == f"${{{{ steps.plan.outputs.{name} }}}}" for name, value in declared.items())
    jobs = fanout_jobs(workflow)
    assert sorted(jobs.values()) == sorted(name for name in outputs if name != "variants")
    for job_id, output in jobs.items():
        job = workflow["jobs"][job_id]
        assert f"needs.plan.outputs.{output} != ''" in job["if"], f"{job_id}: an empty shard must skip, not fail"
        assert job["strategy"]["fail-fast"] is False, "one variant's failure stops no other"


def test_the_plan_job_prints_the_fanout_the_other_jobs_read():
    plan = load("images.yml")["jobs"]["plan"]
    commands = runs(plan)
    assert 'imagebuild plan --matrix "$IMAGEBUILD_MATRIX" --registry --format github-output >> "$GITHUB_OUTPUT"' \
        in commands
    assert "--layer-levels" not in commands and "--shards" not in commands, "the defaults fit this job graph"
    assert plan["runs-on"] == BUILDER, "it asks the cache registry"


def test_the_1000_variant_matrix_fits_githubs_limits_and_builds_each_shared_layer_once(bench_matrix):
    outputs = plan_outputs(bench_matrix)
    proc = run_imagebuild("plan", "--matrix", bench_matrix, "--format", "json")
    plan = json.loads(proc.stdout)
    shards = {name: json.loads(value)["include"] for name, value in outputs.items()
              if name != "variants" and value}
    assert all(len(entries) <= MAX_MATRIX for entries in shards.values())
    layer_keys = [k for name, entries in shards.items() if name.startswith("layers")
                  for entry in entries for k in entry["layers"].split(",")]
    assert sorted(layer_keys) == sorted(layer["key"] for layer in plan["layers"] if layer["shared"])
    released = [v for name, entries in shards.items() if name.startswith("variants_")
                for entry in entries for v in entry["variants"].split(",")]
    assert sorted(released) == sorted(v["id"] for v in plan["variants"])
    assert outputs["variants"] == "1000"
    before = json.loads(run_imagebuild("plan", "--matrix", bench_matrix, "--format", "github-matrix").stdout)
    assert len(before["include"]) == 1000 > MAX_MATRIX, "one matrix of every variant: what this replaces"


def test_levels_wait_for_every_earlier_level():
    workflow = load("images.yml")
    jobs = fanout_jobs(workflow)
    order = sorted(jobs, key=lambda job_id: (not job_id.startswith("layers"), job_id))
    layer_levels = [job_id for job_id in order if job_id.startswith("layers")]
    for job_id in order:
        needs = workflow["jobs"][job_id]["needs"]
        needs = [needs] if isinstance(needs, str) else needs
        earlier = layer_levels[:layer_levels.index(job_id)] if job_id in layer_levels else layer_levels
        assert set(needs) == {"plan", *earlier}, job_id
        if earlier:
            assert workflow["jobs"][job_id]["if"].startswith("${{ !cancelled() && !failure() &&"), \
                f"{job_id}: runs after a skipped (empty) level, not after a failed one"


def test_layer_jobs_build_their_layers_and_variant_jobs_release_their_variants():
    workflow = load("images.yml")
    for job_id in fanout_jobs(workflow):
        job = workflow["jobs"][job_id]
        env = step_env(job)
        if job_id.startswith("layers"):
            assert env["LAYERS"] == "${{ matrix.layers }}"
            assert 'imagebuild build --matrix "$IMAGEBUILD_MATRIX" --layers "$LAYERS"' in runs(job)
            assert job["runs-on"] == BUILDER
        else:
            assert env["VARIANTS"] == "${{ matrix.variants }}"
            assert 'imagebuild release --matrix "$IMAGEBUILD_MATRIX" --only "id=$VARIANTS" --registry' in runs(job)
            assert "fromJSON('[\"self-hosted\",\"linux\",\"gpu\"]')" in job["runs-on"], "GPU smoke tier"
            assert job["runs-on"].startswith("${{ matrix.device == 'gpu' && ")


def test_a_variant_batch_holds_one_device_so_its_runner_fits(bench_matrix):
    proc = run_imagebuild("plan", "--matrix", bench_matrix, "--format", "github-fanout", "--shards", "1")
    assert proc.returncode == 0, proc.stderr
    level = json.loads(proc.stdout)["levels"][-1]
    devices = {v["id"]: v["device"] for v in json.loads(
        run_imagebuild("plan", "--matrix", bench_matrix, "--format", "json").stdout)["variants"]}
    entries = level["shards"][0]["include"]
    assert len(entries) <= MAX_MATRIX < 1000
    for entry in entries:
        assert {devices[v] for v in entry["variants"].split(",")} == {entry["device"]}


# --- rollout and nightly ----------------------------------------------------------------------------


def test_a_rollout_starts_by_hand_and_each_wave_waits_for_its_environment():
    workflow = load("rollout.yml")
    on = triggers(workflow)
    assert list(on) == ["workflow_dispatch"]
    inputs = on["workflow_dispatch"]["inputs"]
    assert {name: spec["required"] for name, spec in inputs.items()} == {"release_id": True, "channel": True}
    start = workflow["jobs"]["start"]
    assert 'imagebuild rollout start --release "$IMAGEBUILD_RELEASE" --image "$IMAGE" --channel "$CHANNEL"' \
        in runs(start)
    assert step_env(start) == {"IMAGE": "${{ inputs.release_id }}", "CHANNEL": "${{ inputs.channel }}"}
    waves = {job_id: job for job_id, job in workflow["jobs"].items() if job_id != "start"}
    assert sorted(waves) == ["approve_canary", "approve_rest"]
    for job_id, job in waves.items():
        wave = job_id.removeprefix("approve_")
        assert job["environment"] == wave, "the environment's reviewers approve the wave"
        assert step_env(job)["WAVE"] == wave
        assert runs(job).strip().endswith("scripts/ci-approve-wave.sh")
    script = (REPO / "scripts" / "ci-approve-wave.sh").read_text()
    assert 'imagebuild rollout approve "$id" --wave "$WAVE"' in script
    assert 'imagebuild rollout resume "$id"' in script


def test_the_nightly_rescan_quarantines_and_alerts():
    workflow = load("nightly-rescan.yml")
    on = triggers(workflow)
    assert set(on) == {"schedule", "workflow_dispatch"} and on["schedule"][0]["cron"]
    job = workflow["jobs"]["rescan"]
    rescan = next(step for step in job["steps"] if step.get("id") == "rescan")
    assert 'imagebuild rescan --release "$IMAGEBUILD_RELEASE" --format json' in rescan["run"]
    assert rescan["run"].rstrip().endswith('exit "$status"'), "a quarantine (exit 1) fails the job"
    assert rescan["env"]["XDG_CACHE_HOME"].startswith("${{ runner.temp }}"), "a fresh DB each night"
    alert = next(step for step in job["steps"] if step.get("name") == "Alert")
    assert alert["if"] == "failure()" and "gh issue create" in alert["run"]
    assert alert["env"]["GH_TOKEN"] == "${{ github.token }}"
