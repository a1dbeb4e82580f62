"""The GitHub Actions workflow is valid and fans out over exactly the plan's variants."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ACTIONLINT = Path("/opt/imagebuild-tools/bin/actionlint")


def test_workflows_pass_actionlint():
    tool = shutil.which("actionlint") or str(ACTIONLINT)
    assert Path(tool).exists(), "actionlint is missing: run scripts/bootstrap.sh"
    proc = subprocess.run([tool], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_build_job_gets_one_entry_per_variant():
    proc = subprocess.run([sys.executable, "-m", "imagebuild", "plan", "--format", "github-matrix"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    matrix = json.loads(proc.stdout)
    plan = json.loads(subprocess.run([sys.executable, "-m", "imagebuild", "plan", "--format", "json"],
                                     cwd=REPO, capture_output=True, text=True).stdout)
    assert [entry["variant"] for entry in matrix["include"]] == [v["id"] for v in plan["variants"]]
    assert "\n" not in proc.stdout.strip(), "GITHUB_OUTPUT needs the matrix on one line"


def test_the_workflow_builds_each_variant_with_only():
    workflow = yaml.safe_load((REPO / ".github/workflows/images.yml").read_text())
    build = workflow["jobs"]["build"]
    assert build["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    commands = " ".join(step.get("run", "") for step in build["steps"])
    assert '--only "${{ matrix.variant }}"' in commands
