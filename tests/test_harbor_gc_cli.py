"""`imagebuild gc sweep --harbor`: the real CLI, in its own process, against the Harbor stand-in over real HTTP.

The stand-in moves a GC run on at each read (Pending, Running, then its end), so the hidden --poll-s 0
keeps these tests to the time the requests take. Each test ends with no spec violation recorded.
"""
from __future__ import annotations

import json
import re
import socket

import pytest

from .conftest import run_imagebuild
from .harbor_standin import HarborSpec, HarborStandIn

ADMIN_PASSWORD = "Canary-Admin-Pw-Gc-8b2c"  # a canary: it must never show in any output
REDIS_PASSWORD = "Redis-Canary-Pw-31"  # the stand-in's job_parameters and log carry it, as Harbor's may


@pytest.fixture(scope="module")
def spec() -> HarborSpec:
    return HarborSpec()


@pytest.fixture
def standin(spec):
    server = HarborStandIn(spec, users={"admin": ADMIN_PASSWORD}).start()
    server.gc_log_extra = [f"connecting to redis://:{REDIS_PASSWORD}@redis:6379/1",
                           f"auth admin:{ADMIN_PASSWORD} for the registry"]
    yield server
    assert server.violations == [], "the client sent, or the stand-in answered, what Harbor's spec does not allow"
    server.stop()


def sweep(*args: str, password: str = ADMIN_PASSWORD):
    result = run_imagebuild("gc", "sweep", *args, env={"HARBOR_USERNAME": "admin", "HARBOR_PASSWORD": password},
                            timeout=60)
    output = result.stdout + result.stderr
    assert ADMIN_PASSWORD not in output and REDIS_PASSWORD not in output
    return result


def harbor_sweep(standin: HarborStandIn, *args: str, **kwargs: str):
    return sweep("--harbor", standin.url, "--poll-s", "0", "--retries", "0", *args, **kwargs)


def test_a_sweep_runs_harbors_gc_to_success_and_reports_its_run(standin):
    result = harbor_sweep(standin, "--format", "json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "Success" and report["started"] is True and report["dry_run"] is False
    assert report["gc_id"] in standin.gc_runs and report["polls"] == 4
    assert any("frees up 12 MB" in line for line in report["log"])
    assert any("redis://***@redis" in line for line in report["log"])
    assert "job_parameters" not in report
    assert f"Harbor GC run {report['gc_id']}: started" in result.stderr


def test_dry_run_and_delete_untagged_reach_harbor_and_the_table_says_so(standin):
    result = harbor_sweep(standin, "--dry-run", "--delete-untagged")
    assert result.returncode == 0, result.stderr
    posted = [r.body for r in standin.requests if r.operation == "createGCSchedule"]
    assert posted == [{"schedule": {"type": "Manual"}, "parameters": {"delete_untagged": True, "dry_run": True}}]
    assert "(dry run) started: Success" in result.stdout
    assert "dry run: nothing was deleted" in result.stdout


@pytest.mark.parametrize("outcome", ["Error", "Stopped"])
def test_a_run_that_ends_in_error_or_stopped_exits_1_after_reporting_it(standin, outcome):
    standin.gc_outcome = outcome
    result = harbor_sweep(standin, "--format", "json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == outcome
    if outcome == "Error":
        assert any("storage error" in line for line in report["log"])


def test_a_gc_already_running_is_waited_on_and_reported(standin):
    running = standin.start_gc(dry_run=True)
    result = harbor_sweep(standin)
    assert result.returncode == 0, result.stderr
    assert f"GC run {running} (dry run) was already running; waited on it: Success" in result.stdout
    assert len(standin.gc_runs) == 1
    assert [r.status for r in standin.requests if r.operation == "createGCSchedule"] == [409]
    assert "note: the run waited on was a dry run; sweep again for a real one" in result.stderr


def test_gcs_own_format_option_applies_to_the_harbor_sweep(standin):
    result = run_imagebuild("gc", "--format", "json", "sweep", "--harbor", standin.url, "--poll-s", "0",
                            env={"HARBOR_USERNAME": "admin", "HARBOR_PASSWORD": ADMIN_PASSWORD}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "Success"


def test_harbor_unreachable_exits_3_in_one_line():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = sweep("--harbor", f"http://127.0.0.1:{port}", "--retries", "0", "--poll-s", "0")
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: harbor: cannot reach Harbor"), result.stderr


def test_wrong_credentials_exit_3_without_showing_the_password(standin):
    result = harbor_sweep(standin, password="Wrong-Pw-Canary-77")
    assert result.returncode == 3
    assert "Wrong-Pw-Canary-77" not in result.stdout + result.stderr
    assert "wrong user name or password for 'admin'" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    ((), r"give exactly one of --config CONFIG \(Distribution\) or --harbor URL"),
    (("--config", "config.yml", "--harbor", "https://harbor.example.com"), "give exactly one of"),
    (("--config", "config.yml", "--dry-run"), "--dry-run: is for --harbor, not --config"),
    (("--config", "config.yml", "--password-file", "pw"), "--password-file: is for --harbor"),
    (("--harbor", "https://harbor.example.com", "--registry-binary", "registry"), "--registry-binary: is for --config"),
    (("--harbor", "http://harbor.example.com"), "--harbor: .*plain http"),
    (("--harbor", "https://harbor.example.com/api"), "--harbor: .*without a path"),
])
def test_a_bad_combination_exits_2_in_one_line(args, message):
    result = sweep(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), result.stderr
