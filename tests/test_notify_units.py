"""Notifications: release.yaml's `notify:`, the CloudEvent built, secrets by reference, retries through
oci.retry, a dead receiver costing at most its timeout, and the reconciler telling each way a run ends.

Receivers are loopback servers of the tests' own (tests/notify_receiver.py); nothing sleeps.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import click
import pytest

from imagebuild.cli.rollout_command import _runtime
from imagebuild.config.release_file import (
    NOTIFY_EVENTS,
    HttpGate,
    InputError,
    NotifyTarget,
    Region,
    ReleaseConfig,
    SoakGate,
    Wave,
    load_release,
    notify_url_problem,
)
from imagebuild.core.errors import ExitCode
from imagebuild.notify import events
from imagebuild.notify.send import Notifier
from imagebuild.rollout.plan import StepKind, plan_rollout
from imagebuild.rollout.reconciler import Journal, Reconciler, Runtime, Timing, abort, new_record

from .conftest import run_imagebuild
from .notify_receiver import Receiver, refused_url, silent_receiver

DIGEST = "sha256:" + "5e" * 32
TOKEN = "tok-3f9a-SECRET-never-logged"
BASE = ("schema: 1\ntrust: trust.yaml\nstate: {registry: 127.0.0.1:5000, repository: r/rollouts}\n"
        "regions:\n  - {name: eu-west, registry: 127.0.0.1:5001, repository: r/paddle}\n"
        "channels: [stable]\nwaves:\n  - {name: canary, regions: [eu-west]}\n")
SLACK = 0.75  # what a send may overrun its timeout by on a busy 2-core machine (thread start, TLS, close)


def release_with(tmp_path: Path, notify: str) -> Path:
    path = tmp_path / "release.yaml"
    path.write_text(BASE + "notify:\n" + notify)
    return path


# --- release.yaml ---------------------------------------------------------------------------------------


def test_notify_reads_into_targets_with_defaults_and_headers_by_reference(tmp_path):
    path = release_with(tmp_path, (
        "  - url: https://events.example.com/imagebuild\n"
        "    events: [rollout.halted, gate.failed]\n"
        "    timeout: 2s\n"
        "    ca_file: ca.pem\n"
        "    headers: {authorization: {env: NOTIFY_TOKEN}}\n"
        "  - {url: {env: SLACK_WEBHOOK_URL}, format: slack}\n"
        "  - url: http://127.0.0.1:9/local\n"))
    first, slack, local = load_release(path).notify
    assert first == NotifyTarget(url="https://events.example.com/imagebuild", events=("rollout.halted", "gate.failed"),
                                 timeout_s=2.0, ca_file=tmp_path / "ca.pem",
                                 headers=(("authorization", "NOTIFY_TOKEN"),))
    assert slack == NotifyTarget(url=None, url_env="SLACK_WEBHOOK_URL", format="slack")
    assert local.events == NOTIFY_EVENTS and local.timeout_s == 5.0 and local.format == "cloudevents"
    (tmp_path / "plain.yaml").write_text(BASE)
    assert load_release(tmp_path / "plain.yaml").notify == ()


@pytest.mark.parametrize("entry, line, key, message", [
    ("  - url: http://events.example.com/x\n", 10, "notify[0].url", "must be https (http only to a loopback address)"),
    ("  - url: https://user:pw@events.example.com/x\n", 10, "notify[0].url", "credentials in a URL are not allowed"),
    ("  - url: ftp://events.example.com/x\n", 10, "notify[0].url", "is not an http(s) URL"),
    ("  - url: https://e.example.com\n    events: [rollout.halt]\n", 11, "notify[0].events[0]",
     "unknown event 'rollout.halt' (did you mean 'rollout.halted'?)"),
    ("  - url: https://e.example.com\n    events: [gate.failed, gate.failed]\n", 11, "notify[0].events[1]",
     "listed twice"),
    ("  - url: https://e.example.com\n    format: teams\n", 11, "notify[0].format", "unknown format 'teams'"),
    ("  - url: https://e.example.com\n    timeout: soon\n", 11, "notify[0].timeout", "'soon' is not a duration"),
    ("  - url: https://e.example.com\n    headers: {content-type: {env: X}}\n", 11, "notify[0].headers.content-type",
     "written by imagebuild itself"),
    ("  - url: https://e.example.com\n    headers: {x-team: {file: /etc/x}}\n", 11, "notify[0].headers.x-team.file",
     "unknown key"),
    ("  - url: https://e.example.com\n    headers: {x-team: {env: 1BAD}}\n", 11, "notify[0].headers.x-team.env",
     "not an environment variable name"),
    ("  - {url: https://e.example.com, retries: 3}\n", 10, "notify[0].retries", "unknown key"),
    ("  - {events: [gate.failed]}\n", 10, "notify[0]", "missing required key 'url'"),
    ("  url: https://e.example.com\n", 9, "notify", "expected a list"),
])
def test_a_malformed_notify_entry_is_one_line_naming_file_line_and_key(tmp_path, entry, line, key, message):
    path = release_with(tmp_path, entry)
    with pytest.raises(InputError, match=re.escape(message)) as caught:
        load_release(path)
    assert (caught.value.file, caught.value.line, caught.value.key) == (str(path), line, key)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert str(caught.value).startswith(f"{path}:{line}: {key}: ") and "\n" not in str(caught.value)


@pytest.mark.parametrize("entry, key", [
    (f"  - url: https://e.example.com\n    headers: {{authorization: 'Bearer {TOKEN}'}}\n",
     "notify[0].headers.authorization"),
    (f"  - url: https://e.example.com\n    token: {TOKEN}\n", "notify[0].token"),
    (f"  - url: https://e.example.com\n    headers: {{x-api-key: {{env: X, value: {TOKEN}}}}}\n",
     "notify[0].headers.x-api-key.value"),
])
def test_a_literal_secret_is_refused_without_quoting_it(tmp_path, entry, key):
    path = release_with(tmp_path, entry)
    with pytest.raises(InputError, match="by reference only|unknown key") as caught:
        load_release(path)
    assert caught.value.key == key and TOKEN not in str(caught.value)


def test_the_cli_exits_2_with_the_one_line_error(tmp_path):
    path = release_with(tmp_path, "  - url: http://events.example.com/x\n")
    run = run_imagebuild("rollout", "status", "--release", path)
    assert run.returncode == 2, run.stderr
    assert f"{path}:10: notify[0].url: " in run.stderr and len(run.stderr.strip().splitlines()) == 1


def test_http_is_for_loopback_only():
    assert notify_url_problem("http://127.0.0.1:8080/x") is None
    assert notify_url_problem("http://[::1]:8080/x") is None
    assert notify_url_problem("http://localhost/x") is None
    assert notify_url_problem("https://hooks.example.com/services/T/B/X") is None
    assert notify_url_problem("http://10.0.0.1/x") == "must be https (http only to a loopback address)"


# --- the CloudEvent ---------------------------------------------------------------------------------------


def test_the_cloud_event_has_the_structured_mode_fields_and_drops_empty_data():
    notice = events.Notice("rollout.halted", "imagebuild/rollout/20261204t200000-abcdef", DIGEST,
                           {"rollout": "20261204t200000-abcdef", "wave": "canary", "region": None})
    event = events.cloud_event(notice, now=dt.datetime(2026, 12, 4, 20, 0, 1, 250000, tzinfo=dt.timezone.utc))
    other = events.cloud_event(notice)
    assert {key: event[key] for key in event if key != "id"} == {
        "specversion": "1.0", "source": "imagebuild/rollout/20261204t200000-abcdef",
        "type": "dev.imagebuild.rollout.halted", "subject": DIGEST, "time": "2026-12-04T20:00:01.250Z",
        "datacontenttype": "application/json", "data": {"rollout": "20261204t200000-abcdef", "wave": "canary"}}
    assert event["id"] != other["id"] and len(event["id"]) >= 32
    assert dt.datetime.fromisoformat(other["time"].replace("Z", "+00:00")).tzinfo is not None
    body, content_type = events.body(event, "cloudevents")
    assert content_type == "application/cloudevents+json" and json.loads(body) == event


def test_slack_text_is_one_escaped_line():
    event = events.cloud_event(events.Notice("gate.failed", "imagebuild/rollout/x", DIGEST, {
        "rollout": "x", "wave": "canary", "region": "eu-west", "gate": "http", "channels": ["stable"],
        "reason": "GET <http://h/healthz>: 500 & more\nsecond line"}))
    body, content_type = events.body(event, "slack")
    text = json.loads(body)["text"]
    assert content_type == "application/json" and "\n" not in text
    assert text.startswith(f"imagebuild gate.failed: {DIGEST} (rollout x; wave canary; region eu-west; gate http; "
                           f"channels stable): GET &lt;http://h/healthz&gt;: 500 &amp; more")


# --- sending ---------------------------------------------------------------------------------------------


class Failures:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def __call__(self, host: str, kind: str, why: str) -> None:
        self.seen.append((host, kind, why))


def test_each_target_gets_the_kinds_it_asked_for_with_its_header_from_the_environment():
    receiver = Receiver()
    try:
        targets = (NotifyTarget(url=receiver.url, headers=(("Authorization", "NOTIFY_TOKEN"),)),
                   NotifyTarget(url=receiver.url + "?only=quarantine", events=("image.quarantined",)))
        notifier = Notifier(targets, environ={"NOTIFY_TOKEN": f"Bearer {TOKEN}"})
        failures = Failures()
        notifier.emit("rollout.completed", "imagebuild/rollout/r1", DIGEST, {"rollout": "r1"}, failures)
        notifier.drain()
        (got,) = receiver.received
        assert got.path == "/events" and got.headers["authorization"] == f"Bearer {TOKEN}"
        assert got.headers["content-type"] == "application/cloudevents+json"
        assert got.json()["type"] == "dev.imagebuild.rollout.completed" and failures.seen == []
        assert TOKEN not in got.body.decode()  # the header goes to the receiver; never into the event
    finally:
        receiver.stop()


def test_a_503_is_tried_again_with_the_same_event_then_delivered():
    receiver = Receiver(statuses=(503, 503), extra_headers={"Retry-After": "0"})
    try:
        notifier = Notifier((NotifyTarget(url=receiver.url, timeout_s=5.0),))
        failures = Failures()
        notifier.emit("gate.failed", "imagebuild/rollout/r1", DIGEST, {"rollout": "r1"}, failures)
        notifier.drain()
        assert len(receiver.received) == 3 and failures.seen == []
        assert len({r.json()["id"] for r in receiver.received}) == 1  # one event: a receiver may drop repeats
    finally:
        receiver.stop()


def test_a_target_answering_503_until_its_timeout_is_a_failure_naming_only_its_host():
    receiver = Receiver(statuses=(503,) * 100, extra_headers={"Retry-After": "0"})
    try:
        target = NotifyTarget(url=receiver.url + "/T0/B0/hook-secret", timeout_s=0.5,
                              headers=(("Authorization", "NOTIFY_TOKEN"),))
        failures = Failures()
        notifier = Notifier((target,), environ={"NOTIFY_TOKEN": TOKEN})
        started = time.monotonic()
        notifier.emit("rollout.halted", "imagebuild/rollout/r1", DIGEST, {"rollout": "r1"}, failures)
        notifier.drain()
        assert time.monotonic() - started < 0.5 + SLACK
        host = receiver.url.split("/")[2]
        assert failures.seen == [(host, "rollout.halted", "HTTP 503")]
        assert len(receiver.received) >= 2
    finally:
        receiver.stop()


def test_a_redirect_is_not_followed_so_the_token_goes_nowhere_else():
    elsewhere = Receiver()
    receiver = Receiver(statuses=(307,), extra_headers={"Location": elsewhere.url})
    try:
        failures = Failures()
        notifier = Notifier((NotifyTarget(url=receiver.url, headers=(("Authorization", "NOTIFY_TOKEN"),)),),
                            environ={"NOTIFY_TOKEN": TOKEN})
        notifier.emit("rollout.halted", "imagebuild/rollout/r1", DIGEST, {"rollout": "r1"}, failures)
        notifier.drain()
        assert [why for _, _, why in failures.seen] == ["HTTP 307"]
        assert len(receiver.received) == 1 and elsewhere.received == []
    finally:
        receiver.stop()
        elsewhere.stop()


@pytest.mark.parametrize("dead", ["refused", "silent"])
def test_a_dead_receiver_costs_the_emitter_nothing_and_the_drain_at_most_its_timeout(dead):
    with silent_receiver() as silent:
        url = refused_url() if dead == "refused" else silent
        failures = Failures()
        notifier = Notifier((NotifyTarget(url=url, timeout_s=1.0),))
        started = time.monotonic()
        notifier.emit("rollout.halted", "imagebuild/rollout/r1", DIGEST, {"rollout": "r1"}, failures)
        emitted = time.monotonic() - started
        notifier.drain()
        drained = time.monotonic() - started
    assert emitted < 0.2, emitted
    assert drained < 1.0 + SLACK, drained
    (failure,) = failures.seen
    assert failure[0] == url.split("/")[2] and failure[1] == "rollout.halted"
    # The send's own timeout, or the drain giving up on it at the same deadline: whichever is first.
    assert re.search("ConnectError" if dead == "refused" else "Timeout|no answer within 1s", failure[2]), failure


def test_a_drain_that_finds_a_send_reporting_its_failure_waits_for_that_report():
    # The send's thread has settled and is writing its report (an audit line) when drain gives up on it:
    # drain must not return before the report is written, or the caller reads an audit without it.
    entered, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def slow_report(host: str, kind: str, why: str) -> None:
        entered.set()
        release.wait(10)
        seen.append(why)

    notifier = Notifier((NotifyTarget(url=None, url_env="UNSET_NOTIFY_URL", timeout_s=0.1),), environ={})
    notifier.emit("rollout.halted", "imagebuild/rollout/r1", DIGEST, {"rollout": "r1"}, slow_report)
    assert entered.wait(10)
    drainer = threading.Thread(target=notifier.drain)
    drainer.start()
    drainer.join(1.0)  # past the send's deadline: drain has given up on the thread and is settling it
    still_waiting = drainer.is_alive()
    release.set()
    drainer.join(10)
    assert still_waiting, "drain returned while the send's failure was still being reported"
    assert seen == ["environment variable UNSET_NOTIFY_URL (its URL) is not set"]


def test_each_sends_http_connections_are_closed_with_its_client():
    # The client closes the retrying transport, which closes the deadline wrapper, which must close the
    # pool under it: otherwise every notification leaves its connections open until the process ends.
    import httpx

    from imagebuild.notify.send import _Send, _WithinDeadline

    class Pool(httpx.BaseTransport):
        closed = False

        def close(self) -> None:
            self.closed = True

    pool = Pool()
    send = _Send(kind="rollout.halted", target=NotifyTarget(url="https://127.0.0.1:9/x"), deadline=0.0,
                 on_failure=None)
    _WithinDeadline(pool, send, time.monotonic).close()
    assert pool.closed


def test_an_unset_variable_or_unreadable_ca_file_is_a_failed_send_not_an_exception(tmp_path):
    failures = Failures()
    notifier = Notifier((NotifyTarget(url=None, url_env="SLACK_WEBHOOK_URL"),
                         NotifyTarget(url="https://127.0.0.1:9/x", headers=(("Authorization", "NOTIFY_TOKEN"),)),
                         NotifyTarget(url="https://127.0.0.1:9/x", ca_file=tmp_path / "missing.pem")), environ={})
    notifier.emit("rollout.aborted", "imagebuild/rollout/r1", DIGEST, {}, failures)
    notifier.drain()
    assert sorted(why for _, _, why in failures.seen) == [
        f"ca_file {tmp_path / 'missing.pem'}: No such file or directory",
        "environment variable SLACK_WEBHOOK_URL (its URL) is not set",
        "header Authorization: environment variable NOTIFY_TOKEN is not set"]


def test_the_cli_gives_a_rollout_the_release_files_targets_unless_a_caller_injected_a_notifier(tmp_path):
    config = load_release(release_with(tmp_path, "  - url: https://events.example.com/x\n"))
    with click.Context(click.Command("rollout")):
        runtime = _runtime(config)
    assert isinstance(runtime.notify, Notifier) and runtime.notify.targets == config.notify
    injected = Runtime(notify=Notifier(()))
    with click.Context(click.Command("rollout"), obj=injected):
        assert _runtime(config) is injected


# --- the reconciler tells ----------------------------------------------------------------------------


class Store:
    """The state repository's two calls a run makes here: markers read (an abort, when asked) and the record written."""

    def __init__(self, aborted: bool = False) -> None:
        self.aborted = aborted
        self.written: list[str] = []

    def read(self, tag: str, media_type: str | None = None) -> dict[str, Any] | None:
        return {"by": "someone", "at": "now"} if self.aborted and tag.endswith(".abort") else None

    def write(self, tag: str, document: Any, media_type: str | None = None) -> None:
        self.written.append(json.dumps(document))


class Lease:
    def acquire(self) -> None:
        pass

    def renew(self, force: bool = False) -> None:
        pass

    def release(self) -> None:
        pass


class Told:
    """A Notify that keeps what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str, str, dict[str, Any]]] = []
        self.drained = 0

    def emit(self, kind: str, source: str, subject: str, data: dict[str, Any], on_failure: Any = None) -> None:
        self.told.append((kind, source, subject, data))

    def drain(self) -> None:
        self.drained += 1


def release(gate_url: str | None) -> ReleaseConfig:
    regions = (Region("eu-west", "127.0.0.1:5001", "r/paddle"), Region("us-east", "127.0.0.1:5002", "r/paddle"))
    canary = (HttpGate(gate_url, 200, 2.0),) if gate_url else (SoakGate(0.0),)
    return ReleaseConfig(path=Path("release.yaml"), trust_path=Path("trust.yaml"), state_registry="127.0.0.1:5000",
                         state_repository="r/rollouts", lease_ttl_s=600.0, regions=regions, channels=("stable",),
                         waves=(Wave("canary", ("eu-west",), canary), Wave("rest", ("us-east",), ())))


def at_canary_gates(tmp_path: Path, config: ReleaseConfig, store: Store, done: bool = False) -> Journal:
    """A journal whose rollout is at the canary's gates (the steps before them done), or with `done` past its last step."""
    steps = plan_rollout(config, DIGEST, ("stable",))
    record = new_record(config, "20261204t200000-abcdef", f"127.0.0.1:5000/r/paddle@{DIGEST}", DIGEST, ("stable",),
                        steps)
    record["next_step"] = len(steps) if done else next(s.index for s in steps if s.kind is StepKind.GATES)
    return Journal(store, tmp_path / "state", record)  # type: ignore[arg-type]


def run(config: ReleaseConfig, journal: Journal, notify: Any, lines: list[str]) -> int:
    runtime = Runtime(Timing(settle_s=0, sleep=lambda _: None), notify=notify)
    return Reconciler(config, None, journal, Lease(), lines.append, runtime).run()  # type: ignore[arg-type]


def test_a_failing_gate_tells_gate_failed_then_rollout_halted_with_its_wave_and_region(tmp_path):
    health = Receiver()  # GET answers 500: the canary's health gate fails
    try:
        config = release(health.url)
        journal = at_canary_gates(tmp_path, config, Store())
        told = Told()
        assert run(config, journal, told, []) == ExitCode.FAILED
    finally:
        health.stop()
    kinds = [kind for kind, *_ in told.told]
    assert kinds == ["gate.failed", "rollout.halted"]
    (_, source, subject, gate), (_, _, _, halted) = told.told
    assert source == "imagebuild/rollout/20261204t200000-abcdef" and subject == DIGEST
    assert gate["gate"] == "http" and gate["wave"] == "canary" and gate["region"] == "eu-west"
    assert gate["rollout"] == "20261204t200000-abcdef" and gate["channels"] == ["stable"] and gate["digest"] == DIGEST
    assert "500 (expected 200)" in gate["reason"] and gate["gates"][0]["region"] == "eu-west"
    assert halted["status"] == "halted" and halted["wave"] == "canary"
    assert halted["reason"].startswith("wave canary: gate http failed in region eu-west")


def test_completed_aborted_and_rolled_back_are_told(tmp_path):
    config = release(None)
    told = Told()
    assert run(config, at_canary_gates(tmp_path / "a", config, Store(), done=True), told, []) == ExitCode.OK
    # No tag moved in these journals, so the rollback has nothing to restore and touches no registry.
    rollback_journal = at_canary_gates(tmp_path / "b", config, Store())
    runtime = Runtime(Timing(settle_s=0, sleep=lambda _: None), notify=told)
    assert Reconciler(config, None, rollback_journal, Lease(), lambda _: None,  # type: ignore[arg-type]
                      runtime).rollback() == ExitCode.OK
    assert run(config, at_canary_gates(tmp_path / "c", config, Store(aborted=True)), told, []) == ExitCode.FAILED
    assert [(kind, data["status"]) for kind, _, _, data in told.told] == [
        ("rollout.completed", "completed"), ("rollout.rolledback", "rolled-back"), ("rollout.aborted", "aborted")]
    assert told.told[2][3]["wave"] == "canary" and "aborted before step" in told.told[2][3]["reason"]


def test_abort_of_a_halted_rollout_tells_rollout_aborted(tmp_path, monkeypatch):
    config = release(None)
    journal = at_canary_gates(tmp_path, config, Store())
    journal.record["status"] = "halted"
    from imagebuild.rollout import reconciler

    monkeypatch.setattr(reconciler, "_reopen", lambda *args, **kwargs: (journal, Lease()))
    monkeypatch.setattr(reconciler, "load_record", lambda *args, **kwargs: journal.record)
    told = Told()
    assert abort(config, journal.record["id"], tmp_path, lambda _: None, Runtime(notify=told)) == ExitCode.OK
    assert [(kind, data["reason"]) for kind, _, _, data in told.told] == [("rollout.aborted", "aborted while halted")]


def test_a_dead_receiver_does_not_hold_the_rollout_and_its_failure_is_audited_without_the_token(tmp_path):
    health = Receiver()
    lines: list[str] = []
    try:
        with silent_receiver() as silent:
            config = release(health.url)
            journal = at_canary_gates(tmp_path, config, Store())
            notifier = Notifier((NotifyTarget(url=silent + "/T0/hook-secret-path", timeout_s=1.0, headers=(("Authorization", "NOTIFY_TOKEN"),)),),
                                environ={"NOTIFY_TOKEN": TOKEN})
            started = time.monotonic()
            assert run(config, journal, notifier, lines) == ExitCode.FAILED
            halted_in = time.monotonic() - started
            notifier.drain()
            drained_in = time.monotonic() - started
    finally:
        health.stop()
    assert halted_in < 0.9, halted_in  # the run ended without waiting on the receiver (timeout 1s) ...
    assert drained_in < 1.0 + SLACK, drained_in  # ... and its end waited at most the timeout for it
    audit = [json.loads(line) for line in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]
    failed = [entry for entry in audit if entry["what"] == "notify-failed"]
    assert sorted(entry["event"] for entry in failed) == ["gate.failed", "rollout.halted"]
    assert all(entry["target"] == silent.split("/")[2] and re.search("Timeout|no answer within 1s", entry["detail"])
               for entry in failed), failed
    everything = (tmp_path / "state" / "audit.jsonl").read_text() + "".join(journal.store.written) + "".join(lines)
    assert TOKEN not in everything
    assert "hook-secret-path" not in everything  # the target is named by its host alone
