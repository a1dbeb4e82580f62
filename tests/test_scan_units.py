"""The parts of `imagebuild scan` that need no image: the Trivy pin, layer accounting, selection.

Scanning the real images with the real Trivy is in tests/e2e/test_scan.py.
"""
from __future__ import annotations

import stat
from pathlib import Path

import pytest

from imagebuild.checks import scan
from imagebuild.core.runner import ToolMissing

REPO = Path(__file__).resolve().parent.parent
A, B, C = ("sha256:" + ch * 64 for ch in "abc")


def versions_env() -> dict[str, str]:
    pairs = {}
    for line in (REPO / "scripts" / "versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip().strip('"')
    return pairs


def test_the_pinned_trivy_is_the_one_bootstrap_installs():
    assert scan.TRIVY_VERSION == versions_env()["TRIVY_VERSION"]


def test_another_trivy_version_is_refused_with_the_pin_named(tmp_path, monkeypatch):
    # A stand-in that answers `trivy version` as another release would; nothing else is asked of it.
    other = tmp_path / "trivy"
    other.write_text('#!/bin/sh\necho \'{"Version":"0.70.0"}\'\n')
    other.chmod(other.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("IMAGEBUILD_TRIVY", str(other))
    with pytest.raises(ToolMissing, match=r"is trivy 0\.70\.0, but imagebuild is pinned to trivy 0\.76\.0"):
        scan.Trivy.find()


def test_the_installed_trivy_is_the_pinned_one():
    trivy = scan.Trivy.find()
    assert trivy.version == scan.TRIVY_VERSION


def log(*lines: str) -> str:
    return "".join(f"2026-11-30T08:10:47Z\tDEBUG\t{line}\n" for line in lines)


def test_layers_trivy_did_not_report_missing_were_reused():
    report = {"Metadata": {"DiffIDs": [A, B, C]}}
    use = scan.layer_use(report, log(f"[image] Detected diff ID\tdiff_ids=[{A} {B} {C}]",
                                     f'[image] Missing diff ID in cache\tdiff_id="{C}"'))
    assert (use.total, use.analysed, use.reused, use.image_config_cached) == (3, 1, 2, True)


def test_a_cold_cache_reuses_nothing():
    report = {"Metadata": {"DiffIDs": [A, B]}}
    use = scan.layer_use(report, log(f"[image] Detected diff ID\tdiff_ids=[{A} {B}]",
                                     '[image] Missing image ID in cache\timage_id="sha256:00"',
                                     f'[image] Missing diff ID in cache\tdiff_id="{A}"',
                                     f'[image] Missing diff ID in cache\tdiff_id="{B}"'))
    assert (use.analysed, use.reused, use.image_config_cached) == (2, 0, False)


def test_an_empty_layer_repeated_in_an_image_counts_once():
    report = {"Metadata": {"DiffIDs": [A, B, A]}}
    use = scan.layer_use(report, log(f"[image] Detected diff ID\tdiff_ids=[{A} {B} {A}]"))
    assert (use.total, use.reused) == (2, 2)


def test_without_trivys_word_on_layers_no_reuse_is_claimed():
    use = scan.layer_use({"Metadata": {"DiffIDs": [A, B]}}, "2026-11-30T08:10:47Z\tINFO\tDetected OS\n")
    assert use.analysed is None and use.reused is None


def test_only_trivys_layer_lines_and_non_debug_lines_are_kept():
    assert scan._keep_log_line("2026\tDEBUG\t[image] Missing diff ID in cache\tdiff_id=x\n")
    assert scan._keep_log_line("2026\tINFO\t[vuln] Vulnerability scanning is enabled\n")
    assert scan._keep_log_line("2026\tFATAL\tFatal error\n")
    assert not scan._keep_log_line("2026\tDEBUG\t[secret] scanChunk called\tfile_path=/etc/passwd\n")


@pytest.mark.parametrize("image,insecure", [
    ("127.0.0.1:5000/e/paddle@" + A, True),
    ("localhost:5000/e/paddle@" + A, True),
    ("registry.example.com/e/paddle@" + A, False),
    ("harbor.internal:8080/e/paddle@" + A, True),  # listed with --insecure-registry below
])
def test_loopback_and_listed_registries_are_reached_insecurely(image, insecure, tmp_path):
    options = scan.ScanOptions(workdir=tmp_path, dockerfiles=tmp_path, insecure_registries=("harbor.internal:8080",))
    assert scan.is_insecure(image, options) is insecure


def test_trivy_settings_from_the_environment_are_dropped_but_credentials_kept(monkeypatch):
    monkeypatch.setenv("TRIVY_SEVERITY", "CRITICAL")
    monkeypatch.setenv("TRIVY_IGNORE_UNFIXED", "true")
    monkeypatch.setenv("TRIVY_PASSWORD", "s3cret-token")
    env = scan._clean_env()
    assert env["TRIVY_SEVERITY"] is None and env["TRIVY_IGNORE_UNFIXED"] is None
    assert "TRIVY_PASSWORD" not in env  # not overridden: passes through


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("1h30m", 5400), ("90s", 90), ("", 1800)])
def test_trivy_durations(text, seconds):
    assert scan._seconds(text) == seconds

