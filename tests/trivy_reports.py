"""Trivy reports as the pinned Trivy (0.76) writes them, for tests of the gate.

`trivy image --format json` and `trivy config --format json` (SchemaVersion 2), cut down to
the fields the gate reads plus a few it does not, built by hand so each test says exactly
what was found.
"""
from __future__ import annotations

import datetime as dt

TODAY = dt.date(2026, 6, 15)
CPU = "paddle3.3.1-cpu-py3.11-debian12"
GPU = "paddle2.6.2-cuda11.8-cudnn8.6-py3.11-debian12"
DIGEST = "sha256:" + "ab" * 32


def vuln(vid: str, pkg: str, installed: str, fixed: str = "", severity: str = "HIGH",
         status: str | None = None) -> dict:
    return {
        "VulnerabilityID": vid, "PkgID": f"{pkg}@{installed}", "PkgName": pkg,
        "PkgIdentifier": {"PURL": f"pkg:deb/debian/{pkg}@{installed}", "UID": "0123456789abcdef"},
        "InstalledVersion": installed, "FixedVersion": fixed,
        "Status": status or ("fixed" if fixed else "affected"),
        "SeveritySource": "nvd", "PrimaryURL": f"https://avd.aquasec.com/nvd/{vid.lower()}",
        "Title": f"{pkg}: something bad", "Severity": severity,
    }


def os_pkgs(*vulns: dict, sources: dict[str, str] | None = None) -> dict:
    """An os-pkgs result; `sources` maps binary package -> Debian source package."""
    packages = [{"ID": v["PkgID"], "Name": v["PkgName"], "Version": v["InstalledVersion"],
                 "SrcName": (sources or {}).get(v["PkgName"], v["PkgName"])} for v in vulns]
    return {"Target": f"127.0.0.1:5000/e/paddle@{DIGEST} (debian 12.15)", "Class": "os-pkgs", "Type": "debian",
            "Packages": packages, "Vulnerabilities": list(vulns)}


def python_pkgs(*vulns: dict) -> dict:
    return {"Target": "Python", "Class": "lang-pkgs", "Type": "python-pkg", "Vulnerabilities": list(vulns)}


def secret(rule: str = "aws-access-key-id", severity: str = "CRITICAL",
           target: str = "home/paddle/.aws/credentials", line: int = 2) -> dict:
    return {"Target": target, "Class": "secret", "Secrets": [{
        "RuleID": rule, "Category": "AWS", "Severity": severity, "Title": "AWS Access Key ID",
        "StartLine": line, "EndLine": line, "Match": "aws_access_key_id = ********************"}]}


def misconfig(check: str = "DS-0002", severity: str = "HIGH", target: str = "release/x/Dockerfile",
              status: str = "FAIL", line: int | None = 7) -> dict:
    number = check.split("-")[-1]
    entry = {"Type": "Dockerfile Security Check", "ID": check, "Title": "Image user should not be 'root'",
             "Namespace": f"builtin.dockerfile.DS{int(number):03d}", "Severity": severity, "Status": status,
             "PrimaryURL": f"https://avd.aquasec.com/misconfig/{check.lower()}",
             "CauseMetadata": {"Provider": "Dockerfile", "Service": "general"}}
    if line:
        entry["CauseMetadata"] |= {"StartLine": line, "EndLine": line}
    return {"Target": target, "Class": "config", "Type": "dockerfile", "Misconfigurations": [entry]}


def report(*results: dict) -> dict:
    return {"SchemaVersion": 2, "Trivy": {"Version": "0.76.0"}, "ArtifactName": f"127.0.0.1:5000/e/paddle@{DIGEST}",
            "ArtifactType": "container_image", "Metadata": {"DiffIDs": []}, "Results": list(results)}


