"""Trivy's own Dockerfile checks find nothing HIGH or CRITICAL in the committed Dockerfiles."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRIVY = shutil.which("trivy") or "/opt/imagebuild-tools/bin/trivy"


@pytest.mark.parametrize("tree", ["dockerfiles", "examples/local/dockerfiles"])
def test_trivy_config_finds_no_high_or_critical_misconfiguration(tree, tmp_path):
    assert Path(TRIVY).exists(), "trivy is missing: run scripts/bootstrap.sh"
    proc = subprocess.run(
        [TRIVY, "config", "--skip-check-update", "--severity", "HIGH,CRITICAL", "--format", "json",
         "--cache-dir", str(tmp_path / "cache"), str(REPO / tree)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout).get("Results") or []
    scanned = {r["Target"] for r in results}
    assert len(scanned) == len(list((REPO / tree).rglob("Dockerfile"))), "trivy did not read every Dockerfile"
    findings = [(r["Target"], m["ID"], m["Title"]) for r in results for m in (r.get("Misconfigurations") or [])]
    assert findings == []
