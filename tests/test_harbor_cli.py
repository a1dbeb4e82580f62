"""`imagebuild harbor` end to end: the real CLI, in its own process, against the Harbor stand-in.

The stand-in (tests/harbor_standin) is a real HTTP(S) server that checks every request and
response against Harbor's OpenAPI spec; each test ends by asserting it recorded no violation,
so these tests also prove the client speaks Harbor's API as Harbor describes it.
"""
from __future__ import annotations

import http.server
import json
import socket
import stat
import threading
from pathlib import Path

import pytest

from .conftest import run_imagebuild
from .harbor_standin import HarborSpec, HarborStandIn
from .harbor_standin.tls import make_pki

ADMIN_PASSWORD = "Canary-Admin-Pw-7f3a9"  # a canary: it must never show in any output
DIGEST = "sha256:" + "5e" * 32
WRITES = ("POST", "PUT", "PATCH", "DELETE")


@pytest.fixture(scope="module")
def spec() -> HarborSpec:
    return HarborSpec()


@pytest.fixture
def standin(spec):
    server = HarborStandIn(spec, users={"admin": ADMIN_PASSWORD, "dev": "Dev-Pw-1234"}).start()
    yield server
    server.stop()


def harbor_cli(*args: str | Path, password: str | None = ADMIN_PASSWORD, username: str = "admin", env=None):
    environment = {"HARBOR_USERNAME": username, "HARBOR_PASSWORD": password or "", **(env or {})}
    result = run_imagebuild("harbor", *args, env=environment, timeout=60)
    assert ADMIN_PASSWORD not in result.stdout + result.stderr
    return result


def ensure(standin: HarborStandIn, *args: str | Path, **kwargs):
    return harbor_cli("ensure", "--url", standin.url, "--project", "paddle", *args, **kwargs)


def no_violations(standin: HarborStandIn) -> None:
    assert standin.violations == [], "the client sent, or the stand-in answered, what Harbor's spec does not allow"


def writes(standin: HarborStandIn, since: int = 0) -> list[str]:
    return [f"{r.method} {r.operation}" for r in standin.requests[since:] if r.method in WRITES]


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    return lines[0]


# -- the project ---------------------------------------------------------------------------


def test_ensure_creates_a_private_release_project_that_scans_and_requires_cosign_signatures(standin):
    result = ensure(standin)
    assert result.returncode == 0, result.stderr
    project = standin.project("paddle")
    assert project is not None
    assert project["metadata"] == {"public": "false", "auto_scan": "true", "prevent_vul": "true", "severity": "high",
                                   "enable_content_trust_cosign": "true", "reuse_sys_cve_allowlist": "true"}
    assert "project paddle: created" in result.stdout
    no_violations(standin)


def test_a_second_run_changes_nothing_and_says_so(standin, tmp_path):
    assert ensure(standin, "--robot", "ci").returncode == 0
    mark = len(standin.requests)
    again = ensure(standin, "--robot", "ci", "--format", "json", "--secret-file", tmp_path / "unused.secret")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["changed"] is False and report["harbor_version"] == "v2.14.0-standin"
    assert report["project"]["action"] == "unchanged"
    assert [r["action"] for r in report["immutable_rules"]] == ["unchanged"]
    assert report["robot"]["action"] == "unchanged" and report["robot"]["secret_issued"] is False
    assert writes(standin, mark) == []
    assert not (tmp_path / "unused.secret").exists()
    table = ensure(standin)
    assert "Harbor v2.14.0-standin at http://127.0.0.1:" in table.stdout and "nothing changed" in table.stdout
    no_violations(standin)


def test_drifted_metadata_is_put_back_and_the_rest_kept(standin):
    standin.add_project("paddle", {"auto_scan": "false", "prevent_vul": "false", "severity": "low",
                                   "retention_id": "12", "enable_content_trust_cosign": "true"})
    result = ensure(standin, "--severity", "critical", "--format", "json")
    assert result.returncode == 0, result.stderr
    changes = json.loads(result.stdout)["project"]["changes"]
    assert changes == {"auto_scan": {"before": "false", "after": "true"},
                       "prevent_vul": {"before": "false", "after": "true"},
                       "severity": {"before": "low", "after": "critical"},
                       "reuse_sys_cve_allowlist": {"before": None, "after": "true"}}
    metadata = standin.project("paddle")["metadata"]
    assert metadata["retention_id"] == "12" and metadata["severity"] == "critical" and metadata["auto_scan"] == "true"
    (update,) = [r for r in standin.requests if r.operation == "updateProject"]
    assert set(update.body["metadata"]) == set(changes)  # only what drifted is sent
    no_violations(standin)


# -- immutable tags ------------------------------------------------------------------------


def test_release_tags_become_immutable_once_and_cosign_tags_stay_writable(standin):
    first = ensure(standin, "--immutable-tag", "[0-9]*", "--immutable-tag", "v*")
    assert first.returncode == 0, first.stderr
    assert ensure(standin, "--immutable-tag", "[0-9]*", "--immutable-tag", "v*").returncode == 0
    rules = standin.rules[standin.project("paddle")["project_id"]]
    assert len(rules) == 2
    for tag in ("3.0.0-gpu-cuda12.6-cudnn9.5", "2.6.2-py3.10", "v3.0.0"):
        assert standin.is_immutable("paddle", "paddle/gpu", tag), tag
    hex_digest = DIGEST.removeprefix("sha256:")
    for tag in (f"sha256-{hex_digest}.sig", f"sha256-{hex_digest}.att", f"sha256-{hex_digest}", "latest"):
        assert not standin.is_immutable("paddle", "paddle/gpu", tag), tag
    no_violations(standin)


def test_a_disabled_release_rule_is_enabled_again(standin):
    assert ensure(standin).returncode == 0
    rule = standin.rules[standin.project("paddle")["project_id"]][0]
    rule["disabled"] = True
    result = ensure(standin)
    assert result.returncode == 0 and "immutable tags [0-9]*: enabled" in result.stdout
    assert standin.is_immutable("paddle", "gpu", "3.0.0")
    assert len(standin.rules[standin.project("paddle")["project_id"]]) == 1
    no_violations(standin)


def test_a_pattern_that_would_freeze_signature_tags_is_refused_before_harbor_is_asked(standin):
    result = ensure(standin, "--immutable-tag", "v*", "--immutable-tag", "*")
    assert result.returncode == 2
    line = one_error_line(result.stderr)
    assert "--immutable-tag" in line and "cosign's signature" in line
    assert standin.requests == []
    no_violations(standin)


# -- the robot account ---------------------------------------------------------------------


def test_the_ci_robot_is_created_with_push_rights_and_its_secret_shown_once(standin):
    result = ensure(standin, "--robot", "ci", "--robot-duration", "30")
    assert result.returncode == 0, result.stderr
    robot = standin.robot_named("robot$paddle+ci")
    assert robot is not None and robot["duration"] == 30 and robot["level"] == "project"
    access = {(a["resource"], a["action"]) for a in robot["permissions"][0]["access"]}
    assert {("repository", "push"), ("repository", "pull"), ("artifact", "read")} <= access
    assert robot["permissions"][0]["namespace"] == "paddle"
    secret = robot["secret"]
    assert result.stdout.count(secret) == 1 and result.stdout.strip().splitlines()[-1] == secret
    assert secret not in result.stderr and "shown once" in result.stderr
    again = ensure(standin, "--robot", "ci")
    assert again.returncode == 0 and secret not in again.stdout + again.stderr
    assert "robot robot$paddle+ci: unchanged" in again.stdout
    assert standin.robot_named("robot$paddle+ci")["secret"] == secret  # not rotated behind the user's back
    no_violations(standin)


def test_with_format_json_the_secret_goes_only_to_a_0600_file(standin, tmp_path):
    secret_file = tmp_path / "ci.secret"
    result = ensure(standin, "--robot", "ci", "--format", "json", "--secret-file", secret_file)
    assert result.returncode == 0, result.stderr
    secret = standin.robot_named("robot$paddle+ci")["secret"]
    assert secret_file.read_text() == secret + "\n"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert secret not in result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["robot"] == {"name": "robot$paddle+ci", "id": report["robot"]["id"], "action": "created",
                               "expires_at": report["robot"]["expires_at"], "secret_issued": True}
    assert report["secret_file"] == str(secret_file)
    no_violations(standin)


def test_format_json_with_a_robot_needs_a_secret_file(standin):
    result = ensure(standin, "--robot", "ci", "--format", "json")
    assert result.returncode == 2 and "--secret-file" in one_error_line(result.stderr)
    assert standin.requests == []
    no_violations(standin)


def test_rotate_secret_gives_the_robot_a_new_secret_shown_once(standin, tmp_path):
    assert ensure(standin, "--robot", "ci", "--secret-file", tmp_path / "first").returncode == 0
    first = (tmp_path / "first").read_text().strip()
    rotated = ensure(standin, "--robot", "ci", "--rotate-secret")
    assert rotated.returncode == 0, rotated.stderr
    new = standin.robot_named("robot$paddle+ci")["secret"]
    assert new != first and rotated.stdout.count(new) == 1 and first not in rotated.stdout
    assert new not in rotated.stderr and "robot robot$paddle+ci: rotated" in rotated.stdout
    no_violations(standin)


def test_a_robot_without_push_rights_gets_them(standin):
    standin.add_project("paddle")
    standin.robots[77] = {"id": 77, "name": "robot$paddle+ci", "description": "", "secret": "Old-Secret-99",
                          "level": "project", "duration": 30, "editable": True, "disable": True, "expires_at": -1,
                          "permissions": [{"kind": "project", "namespace": "paddle",
                                           "access": [{"resource": "repository", "action": "pull"}]}],
                          "creator_type": "local", "creator_ref": 1, "creation_time": "2026-01-01T00:00:00.000Z",
                          "update_time": "2026-01-01T00:00:00.000Z"}
    result = ensure(standin, "--robot", "ci")
    assert result.returncode == 0, result.stderr
    robot = standin.robot_named("robot$paddle+ci")
    assert robot["disable"] is False and robot["secret"] == "Old-Secret-99"
    assert {("repository", "push"), ("artifact", "read")} <= {(a["resource"], a["action"])
                                                              for a in robot["permissions"][0]["access"]}
    assert "Old-Secret-99" not in result.stdout + result.stderr
    no_violations(standin)


# -- bad input, failures -------------------------------------------------------------------


@pytest.mark.parametrize("args, env, words", [
    (["--project", "Paddle GPU"], {}, "--project: 'Paddle GPU' is not a valid Harbor project name"),
    (["--project", "paddle", "--robot", "CI!"], {}, "--robot"),
    (["--project", "paddle", "--robot", "ci", "--robot-duration", "0"], {}, "--robot-duration"),
    (["--project", "paddle", "--rotate-secret"], {}, "need --robot"),
    (["--project", "paddle", "--robot", "ci", "--secret-file", "/no/such/dir/s"], {}, "--secret-file"),
    (["--project", "paddle"], {"HARBOR_PASSWORD": ""}, "HARBOR_PASSWORD"),
    (["--project", "paddle"], {"HARBOR_USERNAME": ""}, "HARBOR_USERNAME"),
])
def test_bad_input_exits_2_in_one_line_without_asking_harbor(standin, args, env, words):
    result = run_imagebuild("harbor", "ensure", "--url", standin.url, *args,
                            env={"HARBOR_USERNAME": "admin", "HARBOR_PASSWORD": ADMIN_PASSWORD, **env})
    assert result.returncode == 2
    assert words in one_error_line(result.stderr)
    assert standin.requests == []
    no_violations(standin)


@pytest.mark.parametrize("url", ["harbor.example.com", "ftp://127.0.0.1", "http://harbor.example.com",
                                 "https://harbor.example.com/api/v2.0", "https://admin:pw@harbor.example.com"])
def test_a_bad_url_exits_2(url):
    result = harbor_cli("ensure", "--url", url, "--project", "paddle")
    assert result.returncode == 2 and "--url" in one_error_line(result.stderr)


def test_harbor_down_exits_3_in_one_line():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the probe is closed
    result = harbor_cli("ensure", "--url", f"http://127.0.0.1:{port}", "--project", "paddle", "--retries", "1")
    assert result.returncode == 3
    assert "cannot reach Harbor at" in one_error_line(result.stderr)


def test_a_url_that_is_not_harbor_exits_3_before_anything_is_changed():
    class NotHarbor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotHarbor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = harbor_cli("ensure", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--project", "paddle")
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 3
    assert "does not serve Harbor's API (GET /api/v2.0/systeminfo answered 404)" in one_error_line(result.stderr)


def test_wrong_password_exits_3_in_one_line_without_echoing_it(standin):
    result = ensure(standin, password="Wrong-Pw-Canary-55")
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert "401" in line and "wrong user name or password for 'admin'" in line and "UNAUTHORIZED" in line
    assert "Wrong-Pw-Canary-55" not in result.stdout + result.stderr
    assert standin.project("paddle") is None
    no_violations(standin)


def test_a_user_without_the_right_gets_harbors_403_in_one_clear_line(standin):
    result = ensure(standin, username="dev", password="Dev-Pw-1234")
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert "403" in line and "user 'dev' lacks the permission" in line and "FORBIDDEN: forbidden" in line
    assert "request id" in line
    no_violations(standin)


def test_server_errors_and_rate_limits_are_retried_until_harbor_answers(standin):
    standin.inject(500, 2, operation="getProject")
    standin.inject(429, 1, operation="createProject", retry_after="0")
    standin.inject(503, 1, operation="CreateImmuRule")
    result = ensure(standin)
    assert result.returncode == 0, result.stderr
    statuses = [(r.operation, r.status) for r in standin.requests]
    assert [s for s in statuses if s[0] == "getProject"][:3] == [("getProject", 500), ("getProject", 500),
                                                                 ("getProject", 404)]
    assert ("createProject", 429) in statuses and ("createProject", 201) in statuses
    assert ("CreateImmuRule", 503) in statuses and ("CreateImmuRule", 201) in statuses
    assert len(standin.rules[standin.project("paddle")["project_id"]]) == 1
    no_violations(standin)


def test_a_project_created_but_its_answer_lost_is_finished_by_the_retry(standin):
    standin.inject(502, 1, operation="createProject", after_effect=True)
    result = ensure(standin, "--format", "json")
    assert result.returncode == 0, result.stderr
    statuses = [(r.operation, r.status) for r in standin.requests if r.operation == "createProject"]
    assert statuses == [("createProject", 502), ("createProject", 409)]
    assert standin.project("paddle")["metadata"]["enable_content_trust_cosign"] == "true"
    assert len([p for p in standin.projects.values() if p["name"] == "paddle"]) == 1
    no_violations(standin)


def test_a_robot_created_but_its_answer_lost_is_found_and_its_secret_can_be_rotated(standin):
    standin.inject(500, 1, operation="CreateRobot", after_effect=True)
    lost = ensure(standin, "--robot", "ci")
    assert lost.returncode == 0, lost.stderr
    assert "robot robot$paddle+ci: unchanged" in lost.stdout and "--rotate-secret issues a new one" in lost.stdout
    assert standin.robot_named("robot$paddle+ci")["secret"] not in lost.stdout
    rotated = ensure(standin, "--robot", "ci", "--rotate-secret")
    assert rotated.returncode == 0 and rotated.stdout.strip().splitlines()[-1] == standin.robot_named("robot$paddle+ci")["secret"]
    assert len(standin.robots) == 1
    no_violations(standin)


def test_harbor_failing_on_every_retry_exits_3(standin):
    standin.inject(503, 100)
    result = ensure(standin, "--retries", "2")
    assert result.returncode == 3
    line = one_error_line(result.stderr)
    assert "503" in line and "3 times" in line
    assert len(standin.requests) == 3
    no_violations(standin)


def test_password_file_replaces_the_environment(standin, tmp_path):
    password_file = tmp_path / "harbor.pw"
    password_file.write_text(ADMIN_PASSWORD + "\n")
    result = harbor_cli("ensure", "--url", standin.url, "--project", "paddle", "--password-file", password_file,
                        password=None)
    assert result.returncode == 0, result.stderr
    assert standin.project("paddle") is not None
    no_violations(standin)


# -- TLS -----------------------------------------------------------------------------------


def test_tls_with_a_private_ca(spec, tmp_path):
    pki = make_pki(tmp_path)
    server = HarborStandIn(spec, users={"admin": ADMIN_PASSWORD}, tls=pki.server_context()).start()
    try:
        assert server.url.startswith("https://")
        untrusted = ensure(server)
        assert untrusted.returncode == 3
        assert "CERTIFICATE_VERIFY_FAILED" in one_error_line(untrusted.stderr)
        assert server.requests == []  # the handshake failed: no request reached Harbor
        assert server.project("paddle") is None
        trusted = ensure(server, "--ca-bundle", pki.ca_pem, "--robot", "ci", "--secret-file", tmp_path / "ci.secret")
        assert trusted.returncode == 0, trusted.stderr
        assert server.project("paddle") is not None and server.robot_named("robot$paddle+ci") is not None
        not_pem = tmp_path / "not-a-ca.pem"
        not_pem.write_text("hello\n")
        bad = ensure(server, "--ca-bundle", not_pem)
        assert bad.returncode == 2 and "--ca-bundle" in one_error_line(bad.stderr)
        no_violations(server)
    finally:
        server.stop()


# -- scan results --------------------------------------------------------------------------


def test_scan_overview_reports_harbors_severity_summary_per_artifact(standin):
    standin.add_project("paddle")
    scanned = {"report_id": "r1", "scan_status": "Success", "severity": "High", "duration": 12,
               "start_time": "2026-11-30T10:00:00Z", "end_time": "2026-11-30T10:00:12Z", "complete_percent": 100,
               "summary": {"total": 9, "fixable": 4, "summary": {"Critical": 0, "High": 2, "Medium": 3, "Low": 4}},
               "scanner": {"name": "Trivy", "vendor": "Aqua Security", "version": "v0.50.1"}}
    other = "sha256:" + "77" * 32
    standin.add_artifact("paddle", "paddle/gpu", DIGEST, tags=("3.0.0-gpu",), scan=scanned)
    standin.add_artifact("paddle", "cpu", other)
    result = harbor_cli("scan-overview", "--url", standin.url, "--format", "json",
                        f"harbor.example.com/paddle/paddle/gpu@{DIGEST}", f"paddle/cpu@{other}")
    assert result.returncode == 0, result.stderr
    gpu, cpu = json.loads(result.stdout)["artifacts"]
    assert gpu == {"artifact": f"paddle/paddle/gpu@{DIGEST}", "found": True, "status": "Success", "severity": "High",
                   "counts": {"Critical": 0, "High": 2, "Medium": 3, "Low": 4}, "total": 9, "fixable": 4,
                   "scanner": "Trivy v0.50.1", "end_time": "2026-11-30T10:00:12Z"}
    assert cpu["found"] is True and cpu["status"] == "not scanned"
    table = harbor_cli("scan-overview", "--url", standin.url, f"paddle/paddle/gpu@{DIGEST}")
    assert "Success  severity High  C0 H2 M3 L4 U0  total 9 fixable 4" in table.stdout
    no_violations(standin)


def test_scan_overview_of_an_artifact_harbor_lacks_exits_1(standin):
    standin.add_project("paddle")
    result = harbor_cli("scan-overview", "--url", standin.url, f"paddle/gpu@{DIGEST}")
    assert result.returncode == 1 and f"paddle/gpu@{DIGEST}  not found" in result.stdout
    no_violations(standin)


def test_scan_overview_wants_images_by_digest(standin):
    result = harbor_cli("scan-overview", "--url", standin.url, "paddle/gpu:3.0.0")
    assert result.returncode == 2 and "by digest" in one_error_line(result.stderr)
    assert standin.requests == []
    no_violations(standin)
