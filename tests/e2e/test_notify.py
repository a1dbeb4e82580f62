"""Notifications end to end: a real HTTPS receiver of the test's own (a test CA's certificate, trusted through
release.yaml's `ca_file`) gets one CloudEvent per kind; a real rollout halting at a failing gate tells it
gate.failed and rollout.halted, its rollback rollout.rolledback, while a receiver that never answers costs the
rollout no more than its timeout and is audited by host, without the token."""
from __future__ import annotations

import json
import ssl
import time
import uuid
from pathlib import Path

import pytest

from imagebuild.config.release_file import NOTIFY_EVENTS, load_release
from imagebuild.notify.send import Notifier

from ..conftest import run_imagebuild
from ..notify_receiver import Receiver, silent_receiver
from .certs import Authority
from .conftest import REGIONS, STAGING, require_registry
from .rollout_harness import HealthServer
from .test_rollout import Setup, rollout_id_of
from .tools import bootstrap_key

pytestmark = pytest.mark.e2e

TOKEN = "Bearer tok-e2e-7c1d-SECRET"
DIGEST = "sha256:" + "7e" * 32


def https_receiver(folder: Path) -> tuple[Receiver, Path]:
    """A receiver on https://127.0.0.1 with a certificate of a fresh test CA; and that CA's file."""
    tls = Authority.new().issue(folder, "127.0.0.1", ("127.0.0.1",))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert, tls.key)
    return Receiver(tls=context), tls.ca


def test_every_kind_of_event_reaches_an_https_receiver_as_a_cloud_event(tmp_path):
    receiver, ca = https_receiver(tmp_path / "tls")
    try:
        release = tmp_path / "release.yaml"
        release.write_text(
            "schema: 1\ntrust: trust.yaml\nstate: {registry: 127.0.0.1:5000, repository: r/rollouts}\n"
            "regions:\n  - {name: eu-west, registry: 127.0.0.1:5001, repository: r/paddle}\n"
            "channels: [stable]\nwaves:\n  - {name: canary, regions: [eu-west]}\n"
            f"notify:\n  - url: {receiver.url}\n    ca_file: {ca.name}\n    timeout: 5s\n"
            "    headers: {Authorization: {env: NOTIFY_TOKEN}}\n"
            f"  - {{url: '{receiver.url}?slack', format: slack, ca_file: {ca.relative_to(tmp_path)},"
            " events: [image.quarantined]}\n"
            f"  - {{url: '{receiver.url}?untrusted', events: [gate.failed], timeout: 3s}}\n")
        (release.parent / ca.name).write_bytes(ca.read_bytes())
        failures: list[tuple[str, str, str]] = []
        notifier = Notifier(load_release(release).notify, environ={"NOTIFY_TOKEN": TOKEN})
        started = time.monotonic()
        for kind in NOTIFY_EVENTS:
            notifier.emit(kind, "imagebuild/rollout/20261204t200000-abcdef", DIGEST,
                          {"rollout": "20261204t200000-abcdef", "wave": "canary", "region": "eu-west",
                           "channels": ["stable"], "digest": DIGEST, "reason": f"{kind} in the test"},
                          lambda *failure: failures.append(failure))
        notifier.drain()
        # A certificate nobody trusts is not retried: the untrusted target fails at once, well within its 3s.
        assert time.monotonic() - started < 3
        received = receiver.wait_for(len(NOTIFY_EVENTS) + 1)
    finally:
        receiver.stop()
    cloud = [r for r in received if r.path == "/events"]
    assert sorted(r.json()["type"] for r in cloud) == sorted(f"dev.imagebuild.{kind}" for kind in NOTIFY_EVENTS)
    for request in cloud:
        event = request.json()
        assert request.headers["content-type"] == "application/cloudevents+json"
        assert request.headers["authorization"] == TOKEN
        assert event["specversion"] == "1.0" and event["subject"] == DIGEST and event["data"]["region"] == "eu-west"
        assert TOKEN not in request.body.decode()
    assert len({r.json()["id"] for r in cloud}) == len(NOTIFY_EVENTS)
    (slack,) = [r for r in received if r.path == "/events?slack"]
    assert slack.json()["text"].startswith(f"imagebuild image.quarantined: {DIGEST}") and "authorization" not in slack.headers
    (untrusted,) = failures
    assert untrusted[:2] == (receiver.url.split("/")[2], "gate.failed") and "CERTIFICATE_VERIFY_FAILED" in untrusted[2]


def test_a_rollout_halting_at_a_failing_gate_tells_gate_failed_and_halted_and_its_rollback_rolledback(
        tmp_path, monkeypatch):
    for host in [STAGING, *REGIONS.values()]:
        require_registry(host)
    bootstrap_key()
    monkeypatch.setenv("NOTIFY_TOKEN", TOKEN)
    receiver, ca = https_receiver(tmp_path / "tls")
    health = HealthServer()
    health.set("eu-west", 500)  # the canary is unhealthy: its http gate fails
    try:
        with silent_receiver() as silent:
            setup = Setup(tmp_path)
            setup.write(f"""\
                - name: canary
                  regions: [eu-west]
                  gates:
                    signature: true
                    http: {{url: "{health.url}", expect_status: 200, timeout: 2s}}
                - name: rest
                  regions: [us-east, ap-south]
                """)
            with setup.release.open("a") as release:
                release.write(f"notify:\n  - url: {receiver.url}\n    ca_file: {ca}\n"
                              "    headers: {Authorization: {env: NOTIFY_TOKEN}}\n"
                              f"  - {{url: '{silent}/T0/hook-secret-path', timeout: 1s}}\n")
            setup.seed("stable")
            image = setup.source()
            digest = image.split("@")[1]

            run = setup.start(image)
            assert run.returncode == 1, run.stderr
            assert "gate http failed in region eu-west" in run.stderr
            rollout_id = rollout_id_of(run)
            halted = {r.json()["type"]: r for r in receiver.wait_for(2)}
            assert sorted(halted) == ["dev.imagebuild.gate.failed", "dev.imagebuild.rollout.halted"]

            back = setup.cli("rollback", rollout_id)
            assert back.returncode == 0, back.stderr
            received = receiver.wait_for(3)
    finally:
        receiver.stop()
        health.stop()
    assert [r.json()["type"] for r in received][2:] == ["dev.imagebuild.rollout.rolledback"]
    for request in received:
        event = request.json()
        assert event["source"] == f"imagebuild/rollout/{rollout_id}" and event["subject"] == digest
        assert event["data"]["rollout"] == rollout_id and event["data"]["channels"] == ["stable"]
        assert request.headers["authorization"] == TOKEN
    gate = halted["dev.imagebuild.gate.failed"].json()["data"]
    assert (gate["wave"], gate["region"], gate["gate"]) == ("canary", "eu-west", "http")
    assert "500 (expected 200)" in gate["reason"]
    assert halted["dev.imagebuild.rollout.halted"].json()["data"]["wave"] == "canary"

    # The receiver that never answered: audited per event by its host alone; the token nowhere.
    audit = setup.audit()
    failed = sorted(e["event"] for e in audit if e["what"] == "notify-failed")
    assert failed == ["gate.failed", "rollout.halted", "rollout.rolledback"]
    assert {e["target"] for e in audit if e["what"] == "notify-failed"} == {silent.split("/")[2]}
    shown = (run.stdout + run.stderr + back.stdout + back.stderr + (setup.state_dir / "audit.jsonl").read_text()
             + json.dumps(setup.record(rollout_id)))
    assert TOKEN not in shown and "tok-e2e" not in shown and "hook-secret-path" not in shown


def test_quarantining_by_hand_tells_image_quarantined_and_lifting_it_tells_nothing(tmp_path):
    require_registry(STAGING)
    receiver = Receiver()
    try:
        release = tmp_path / "release.yaml"
        release.write_text(
            f"schema: 1\ntrust: trust.yaml\nstate: {{registry: '{STAGING}', repository: notify-e2e/{uuid.uuid4().hex[:10]}}}\n"
            "regions:\n  - {name: eu-west, registry: '127.0.0.1:5001', repository: r/paddle}\n"
            "channels: [stable]\nwaves:\n  - {name: canary, regions: [eu-west]}\n"
            f"notify:\n  - {{url: '{receiver.url}', events: [image.quarantined]}}\n")
        state = ["--release", str(release), "--state-dir", str(tmp_path / "state")]
        marked = run_imagebuild("quarantine", DIGEST, "--reason", "CVE-2026-0001 in libfoo", *state)
        assert marked.returncode == 0, marked.stderr
        (got,) = receiver.wait_for(1)
        cleared = run_imagebuild("quarantine", DIGEST, "--clear", *state)
        assert cleared.returncode == 0, cleared.stderr
    finally:
        receiver.stop()
    event = got.json()
    assert (event["type"], event["source"], event["subject"]) == ("dev.imagebuild.image.quarantined",
                                                                  "imagebuild/quarantine", DIGEST)
    assert event["data"]["reason"] == "CVE-2026-0001 in libfoo" and event["data"]["source"] == "manual"
    assert len(receiver.received) == 1
