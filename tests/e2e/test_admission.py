"""`imagebuild admission serve`, started for real over TLS, answering real AdmissionReview v1 requests.

Nothing is mocked: the images are pushed to the local registries with crane, signed with the
real cosign and the bootstrap's key (or a key made here), and judged by the real Verifier in
the webhook process. The test CA and the server certificate are made here with `cryptography`,
and the client trusts only that CA.
"""
from __future__ import annotations

import base64
import json
import signal
import socket
import ssl
import time
import uuid

import httpx
import pytest

from .admission_harness import (
    OUTSIDE,
    UNREACHABLE,
    Images,
    Registry,
    Webhook,
    make_images,
    start_webhook_process,
    trust_file,
    unique_repository,
)
from .certs import Authority, Tls
from .conftest import STAGING, require_registry
from .tools import KEYS, crane


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> Tls:
    """A CA of the test's own and a certificate for 127.0.0.1; the client trusts only that CA."""
    return Authority.new().issue(tmp_path_factory.mktemp("admission-tls"), "imagebuild-admission",
                                 ("localhost", "127.0.0.1"))


@pytest.fixture(scope="module")
def registry(staging_registry, cosign_cli, our_key, tmp_path_factory) -> Registry:
    require_registry(OUTSIDE)
    return Registry(tmp_path_factory.mktemp("admission-images"), cosign_cli, our_key)


@pytest.fixture(scope="module")
def images(registry, other_key) -> Images:
    return make_images(registry, other_key)


@pytest.fixture(scope="module")
def start_webhook(tls, tmp_path_factory):
    directory = tmp_path_factory.mktemp("admission-webhook")
    started: list[Webhook] = []

    def start(*flags: str, serving: Tls = tls, **config) -> Webhook:
        """The webhook as `imagebuild admission serve` runs it; flags: more of its options; serving: its TLS pair
        (and the CA bundle its client trusts)."""
        webhook = start_webhook_process(directory, serving, trust_file(directory, **config), *flags)
        started.append(webhook)
        return webhook

    yield start
    for webhook in started:
        webhook.stop()


@pytest.fixture(scope="module")
def webhook(start_webhook) -> Webhook:
    """Enforce mode, failure policy fail: the production setting."""
    return start_webhook()


# --- AdmissionReview requests, as the API server sends them -------------------------------------------------


def review_of(kind: str, obj: dict, *, group: str = "", operation: str = "CREATE", sub_resource: str | None = None):
    request = {"uid": str(uuid.uuid4()), "kind": {"group": group, "version": "v1", "kind": kind},
               "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
               "requestKind": {"group": group, "version": "v1", "kind": kind},
               "name": obj["metadata"]["name"], "namespace": "team-a", "operation": operation,
               "userInfo": {"username": "system:serviceaccount:team-a:deployer"},
               "object": obj, "oldObject": None, "dryRun": False,
               "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}
    if sub_resource:
        request["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def pod_spec(containers, init=(), ephemeral=()) -> dict:
    spec: dict = {"containers": [{"name": n, "image": i} for n, i in containers]}
    if init:
        spec["initContainers"] = [{"name": n, "image": i} for n, i in init]
    if ephemeral:
        spec["ephemeralContainers"] = [{"name": n, "image": i, "targetContainerName": containers[0][0]}
                                       for n, i in ephemeral]
    return spec


def pod(*containers, init=(), ephemeral=(), **kw) -> dict:
    obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "team-a"},
           "spec": pod_spec(containers, init, ephemeral)}
    return review_of("Pod", obj, **kw)


def deployment(*containers) -> dict:
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "team-a"},
           "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web"}}, "spec": pod_spec(containers)}}}
    return review_of("Deployment", obj, group="apps")


def cronjob(*containers) -> dict:
    obj = {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "nightly", "namespace": "team-a"},
           "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": {
               "spec": {**pod_spec(containers), "restartPolicy": "OnFailure"}}}}}}
    return review_of("CronJob", obj, group="batch")


def denial(response: dict) -> str:
    assert response["allowed"] is False, response
    return response["status"]["message"]


# --- allowed and refused images ------------------------------------------------------------------------------


def test_a_pod_with_a_signed_image_by_digest_is_allowed(webhook, images):
    response = webhook.review(pod(("app", images.signed)))
    assert response["allowed"] is True, response
    assert "warnings" not in response


def test_an_unsigned_image_is_denied_and_named(webhook, images):
    message = denial(webhook.review(pod(("app", images.unsigned))))
    assert message.startswith(f'imagebuild refused 1 of 1 image: container "app" image {images.unsigned}: not signed')


def test_an_image_signed_with_another_key_is_denied(webhook, images):
    message = denial(webhook.review(pod(("app", images.other_key))))
    assert f'container "app" image {images.other_key}: the signature does not verify with any configured key' in message


def test_a_tag_moved_to_an_unsigned_digest_is_denied(webhook, images):
    message = denial(webhook.review(pod(("app", images.moved_tag))))
    assert f'container "app" image {images.moved_tag}: not signed' in message


def test_an_image_from_a_registry_outside_the_policy_is_denied_though_signed(webhook, images):
    message = denial(webhook.review(pod(("app", images.outside))))
    assert f'container "app" image {images.outside}: not covered by the policy' in message


def test_a_multi_container_pod_with_one_bad_image_is_denied_naming_only_that_one(webhook, images):
    response = webhook.review(pod(("app", images.signed), ("proxy", images.signed_too), ("metrics", images.unsigned)))
    message = denial(response)
    assert message.startswith(f'imagebuild refused 1 of 3 images: container "metrics" image {images.unsigned}: ')
    assert images.signed not in message and images.signed_too not in message


def test_a_multi_container_pod_with_only_signed_images_is_allowed(webhook, images):
    response = webhook.review(pod(("app", images.signed), ("proxy", images.signed_too), init=[("setup", images.signed)]))
    assert response["allowed"] is True, response


def test_an_unsigned_init_container_denies_the_pod(webhook, images):
    message = denial(webhook.review(pod(("app", images.signed), init=[("setup", images.unsigned)])))
    assert f'initContainer "setup" image {images.unsigned}: ' in message


def test_an_unsigned_ephemeral_container_is_denied(webhook, images):
    review = pod(("app", images.signed), ephemeral=[("debugger", images.unsigned)], operation="UPDATE",
                 sub_resource="ephemeralcontainers")
    message = denial(webhook.review(review))
    assert f'ephemeralContainer "debugger" image {images.unsigned}: ' in message


def test_a_deployment_is_judged_by_its_pod_template(webhook, images):
    assert webhook.review(deployment(("app", images.signed)))["allowed"] is True
    message = denial(webhook.review(deployment(("app", images.signed), ("sidecar", images.other_key))))
    assert f'container "sidecar" image {images.other_key}: ' in message


def test_a_cronjob_is_judged_by_its_job_template(webhook, images):
    assert webhook.review(cronjob(("run", images.signed)))["allowed"] is True
    message = denial(webhook.review(cronjob(("run", images.unsigned))))
    assert f'container "run" image {images.unsigned}: ' in message


# --- warn mode and the failure policy ------------------------------------------------------------------------


def test_warn_mode_admits_an_unsigned_image_with_a_warning_that_names_it(start_webhook, images):
    warn = start_webhook(mode="warn")
    response = warn.review(pod(("app", images.signed), ("sidecar", images.unsigned)))
    assert response["allowed"] is True
    assert len(response["warnings"]) == 1
    assert response["warnings"][0].startswith(f'container "sidecar" image {images.unsigned}: ')
    assert response["warnings"][0].endswith("(admitted: mode is warn)")


def test_an_unreachable_registry_denies_under_failure_policy_fail(webhook):
    image = f"{UNREACHABLE}/admission-e2e/app:1"
    message = denial(webhook.review(pod(("app", image))))
    assert f'container "app" image {image}: registry unreachable: {UNREACHABLE}' in message


def test_an_unreachable_registry_admits_with_a_warning_under_failure_policy_ignore(start_webhook, images):
    ignore = start_webhook(failure_policy="ignore")
    image = f"{UNREACHABLE}/admission-e2e/app:1"
    response = ignore.review(pod(("app", image)))
    assert response["allowed"] is True, response
    assert response["warnings"][0].startswith(f'container "app" image {image}: registry unreachable')
    assert response["warnings"][0].endswith("(admitted: failure_policy is ignore)")
    # Failing open is for an unreachable registry only: a reachable one's refusal still stands.
    assert ignore.review(pod(("app", images.unsigned)))["allowed"] is False


# --- the cache ----------------------------------------------------------------------------------------------


def test_a_verdict_is_served_from_the_cache_until_its_ttl_runs_out(start_webhook, registry):
    """The signature is clobbered after the first request: within the TTL the cached verdict stands, after it
    the image is verified again and refused."""
    ttl = 5
    repository = unique_repository()
    image = registry.push(repository)
    registry.sign(image)
    unrelated = registry.push(repository, "unrelated")
    hook = start_webhook(ttl=ttl)
    assert hook.review(pod(("app", image)))["allowed"] is True
    cached_at = time.monotonic()
    registry.tag(unrelated, "sha256-" + image.split("@sha256:")[1] + ".sig")  # the signature tag, overwritten
    assert hook.review(pod(("app", image)))["allowed"] is True, "not served from the cache"
    assert time.monotonic() - cached_at < ttl, "too slow to tell the cache from a fresh check"
    time.sleep(max(0.0, cached_at + ttl + 0.5 - time.monotonic()))
    message = denial(hook.review(pod(("app", image))))
    assert f'container "app" image {image}: not signed' in message


def test_a_review_whose_verdicts_are_all_cached_is_answered_on_the_event_loop_with_the_same_answer(
        start_webhook, registry, images):
    hook = start_webhook()
    signed, unsigned = registry.push(unique_repository()), images.unsigned
    registry.sign(signed)
    tag = signed.split("@", 1)[0] + ":t"
    answers = [hook.review(pod(("app", image)), path=path)
               for image, path in [(signed, "/mutate"), (signed, "/mutate"), (unsigned, "/validate"),
                                   (unsigned, "/validate"), (tag, "/validate"), (tag, "/validate")]]
    inline = [decision["inline"] for decision in hook.decisions()[-6:]]
    # A digest is verified in a worker thread once, then answered from the cache; a tag is resolved every time.
    assert inline == [False, True, False, True, False, False]
    for first, again in (answers[0:2], answers[2:4], answers[4:6]):
        assert {k: v for k, v in first.items() if k != "uid"} == {k: v for k, v in again.items() if k != "uid"}
    assert answers[0]["allowed"] is True and answers[2]["allowed"] is False


def test_with_quarantine_marks_to_read_no_review_is_answered_on_the_event_loop(start_webhook, registry):
    hook = start_webhook(quarantine=f"{STAGING}/admission-e2e/state-{uuid.uuid4().hex[:8]}")
    image = registry.push(unique_repository())
    registry.sign(image)
    for _ in range(2):
        assert hook.review(pod(("app", image)))["allowed"] is True
    assert [d["inline"] for d in hook.decisions()[-2:]] == [False, False]


def test_a_moved_tag_is_resolved_again_at_once_despite_the_cache(webhook, registry):
    repository = unique_repository()
    signed = registry.push(repository, "v1")
    registry.sign(signed)
    tagged = f"{repository}:v1"
    assert webhook.review(pod(("app", tagged)))["allowed"] is True
    registry.push(repository, "v1")  # v1 now names a new, unsigned digest
    message = denial(webhook.review(pod(("app", tagged))))
    assert f'container "app" image {tagged}: ' in message


# --- untrusted bodies, logs, shutdown ------------------------------------------------------------------------


MALFORMED_WITHOUT_UID = [b"", b"not json", b"[]", b'{"request": {}}', b"\xff\xfe\x00", b"[" * 200_000,
                         b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 7}}']


@pytest.mark.parametrize("body", MALFORMED_WITHOUT_UID, ids=lambda b: repr(b[:30]))
def test_a_body_nobody_can_be_answered_for_gets_http_400_with_the_reason(webhook, body):
    reply = webhook.post(body)
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("imagebuild: malformed AdmissionReview: ")


def test_a_malformed_review_with_a_uid_is_denied_with_a_clear_message(webhook, images):
    review = pod(("app", images.signed))
    review["request"]["object"]["spec"]["containers"] = "app"
    message = denial(webhook.review(review))
    assert message == "imagebuild: malformed AdmissionReview: request.object.spec.containers: not a list"


def test_hostile_requests_leave_the_server_answering(webhook, images, tls):
    huge = webhook.post(b"{" + b" " * (4 * 1024 * 1024) + b"}")
    assert huge.status_code == 413
    chunked = webhook.post(iter([b'{"apiVersion": ', b'"admission.k8s.io/v1"}']))
    assert chunked.status_code == 411
    assert webhook.client.get(f"{webhook.url}/nothing").status_code == 404
    # Plain HTTP on the TLS port, and a client that connects and says nothing until the server gives up.
    with socket.create_connection(("127.0.0.1", int(webhook.url.rsplit(":", 1)[1])), timeout=5) as plain:
        plain.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        try:
            answered = plain.recv(100)
        except ConnectionResetError:
            answered = b""
        assert not answered.startswith(b"HTTP/")  # a TLS alert, or nothing
    silent = socket.create_connection(("127.0.0.1", int(webhook.url.rsplit(":", 1)[1])), timeout=5)
    try:
        assert webhook.client.get(f"{webhook.url}/healthz").status_code == 200
        assert webhook.review(pod(("app", images.signed)))["allowed"] is True
    finally:
        silent.close()
    assert webhook.process.poll() is None
    assert "Traceback" not in webhook.log_path.read_text()


def test_plain_http_is_not_served(webhook):
    # The TLS listener reads the request as a bad handshake and hangs up: no HTTP answer comes back.
    with pytest.raises(httpx.HTTPError, match=r"^(Server disconnected without sending a response\.|"
                                              r"\[Errno 104\] Connection reset by peer)$"):
        httpx.get(webhook.url.replace("https://", "http://") + "/healthz", timeout=5)
    assert webhook.client.get(f"{webhook.url}/healthz").status_code == 200


def test_each_decision_is_one_json_log_line_without_the_pod_spec(webhook, images):
    review = pod(("app", images.unsigned))
    canary = f"canary-{uuid.uuid4().hex}"
    review["request"]["object"]["spec"]["containers"][0]["env"] = [{"name": "API_TOKEN", "value": canary}]
    webhook.review(review)
    logged = [d for d in webhook.decisions() if d.get("uid") == review["request"]["uid"]]
    assert len(logged) == 1
    line = logged[0]
    assert (line["kind"], line["object"], line["decision"]) == ("Pod", "team-a/web", "denied")
    assert [(i["container"], i["image"], i["allowed"]) for i in line["images"]] == [("app", images.unsigned, False)]
    log_text = webhook.log_path.read_text()
    assert canary not in log_text
    assert (KEYS / "cosign.password").read_text().strip() not in log_text


def test_sigterm_stops_the_server_cleanly(start_webhook, images):
    hook = start_webhook()
    assert hook.review(pod(("app", images.signed)))["allowed"] is True
    assert hook.stop() == 0
    log = [json.loads(line) for line in hook.log_path.read_text().splitlines()]
    assert [entry["event"] for entry in log[-2:]] == ["stopping", "stopped"]


def test_sigterm_lets_a_request_in_flight_finish_and_answer(start_webhook, images, tls):
    """The review's headers are in (the server said 100 Continue) and part of its body when SIGTERM comes: the
    rest still arrives, is judged and answered (Connection: close), and only then does the server exit 0."""
    hook = start_webhook()
    body = json.dumps(pod(("app", images.signed))).encode()
    context = ssl.create_default_context(cafile=str(tls.ca))
    port = int(hook.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
        conn.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode())
        assert conn.recv(100).startswith(b"HTTP/1.1 100 ")
        conn.sendall(body[:40])
        hook.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while '"stopping"' not in hook.log_path.read_text():
            assert time.monotonic() < deadline, "the webhook never logged that it is stopping"
            time.sleep(0.05)
        assert hook.process.poll() is None, "it exited with a request in flight"
        conn.sendall(body[40:])
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert b"connection: close" in head.lower()
    assert json.loads(payload)["response"]["allowed"] is True
    assert hook.process.wait(timeout=20) == 0


# --- the mutating webhook: admitted images pinned to the digest they were verified at ------------------------


def with_image_volume(review: dict, name: str, reference: str) -> dict:
    spec = review["request"]["object"]["spec"]
    spec["volumes"] = [{"name": "scratch", "emptyDir": {}},
                       {"name": name, "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}]
    return review


def apply_json_patch(obj: dict, response: dict) -> dict:
    """RFC 6902 replace operations, applied as the API server would (the path must exist)."""
    assert response["patchType"] == "JSONPatch", response
    result = json.loads(json.dumps(obj))
    for op in json.loads(base64.b64decode(response["patch"])):
        assert op["op"] == "replace"
        *parents, last = op["path"].split("/")[1:]
        target = result
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        key = int(last) if isinstance(target, list) else last
        assert target[key], op
        target[key] = op["value"]
    return result


def test_mutate_pins_a_signed_tag_to_its_digest(webhook, registry):
    repository = unique_repository()
    signed = registry.push(repository, "v1")
    registry.sign(signed)
    digest = signed.split("@", 1)[1]
    review = with_image_volume(pod(("app", f"{repository}:v1"), init=[("setup", signed)]), "model", f"{repository}:v1")
    response = webhook.review(review, path="/mutate")
    assert response["allowed"] is True, response
    obj = apply_json_patch(review["request"]["object"], response)
    assert obj["spec"]["containers"][0]["image"] == f"{repository}:v1@{digest}"
    assert obj["spec"]["initContainers"][0]["image"] == signed  # already by digest: left as it is
    assert obj["spec"]["volumes"][1]["image"]["reference"] == f"{repository}:v1@{digest}"
    # What the API server stores now validates, and is what the registry holds under that digest.
    assert webhook.review(review_of("Pod", obj))["allowed"] is True
    decision = [d for d in webhook.decisions() if d.get("uid") == review["request"]["uid"]][0]
    assert (decision["endpoint"], decision["pinned"]) == ("mutate", [f"{repository}:v1@{digest}"] * 2)


def test_a_tag_moved_after_admission_cannot_run_unpinned(webhook, registry):
    repository = unique_repository()
    signed = registry.push(repository, "release")
    registry.sign(signed)
    review = pod(("app", f"{repository}:release"))
    obj = apply_json_patch(review["request"]["object"], webhook.review(review, path="/mutate"))
    moved = registry.push(repository, "release")  # the tag now names an unsigned digest
    assert crane("digest", f"{repository}:release").strip() == moved.split("@", 1)[1]
    running = obj["spec"]["containers"][0]["image"]
    assert running == f"{repository}:release@{signed.split('@', 1)[1]}"  # the runtime pulls this digest
    assert webhook.review(review_of("Pod", obj))["allowed"] is True  # validate re-checks the pinned digest
    message = denial(webhook.review(pod(("app", f"{repository}:release")), path="/mutate"))
    assert f'container "app" image {repository}:release: not signed' in message


def test_mutate_refuses_a_tag_it_cannot_pin_in_enforce_mode(webhook, images):
    message = denial(webhook.review(pod(("app", images.moved_tag)), path="/mutate"))
    assert f'container "app" image {images.moved_tag}: not signed' in message


def test_a_signed_container_with_an_unsigned_image_volume_is_refused(webhook, images):
    review = with_image_volume(pod(("app", images.signed)), "weights", images.unsigned)
    for path in ("/validate", "/mutate"):
        message = denial(webhook.review(review, path=path))
        assert message.startswith(f'imagebuild refused 1 of 2 images: volume "weights" image {images.unsigned}: '
                                  "not signed"), message


def test_a_deployment_s_image_volume_is_checked(webhook, images):
    review = deployment(("app", images.signed))
    review["request"]["object"]["spec"]["template"]["spec"]["volumes"] = [
        {"name": "weights", "image": {"reference": images.other_key}}]
    message = denial(webhook.review(review))
    assert f'volume "weights" image {images.other_key}: the signature does not verify' in message


# --- quarantine at admission --------------------------------------------------------------------------------


def test_a_quarantined_signed_digest_is_refused_with_the_reason_until_the_mark_is_cleared(start_webhook, registry):
    from imagebuild.oci.client import Registry as Client
    from imagebuild.rollout import quarantine
    from imagebuild.rollout.state import StateStore

    state = f"admission-e2e/state-{uuid.uuid4().hex[:8]}"
    hook = start_webhook(quarantine=f"{STAGING}/{state}")
    image = registry.push(unique_repository())
    registry.sign(image)
    digest = image.split("@", 1)[1]
    assert hook.review(pod(("app", image)))["allowed"] is True
    store = StateStore(Client(STAGING), state)
    try:
        quarantine.mark(store, digest, "CVE-2026-0001 in libfoo (rescan)", source="rescan")
        for path in ("/validate", "/mutate"):
            message = denial(hook.review(pod(("app", image)), path=path))
            assert message.startswith(f'imagebuild refused 1 of 1 image: container "app" image {image}: '
                                      "quarantined since "), message
            assert message.endswith("(rescan): CVE-2026-0001 in libfoo (rescan)")
        assert quarantine.clear(store, digest)
    finally:
        store.registry.close()
    assert hook.review(pod(("app", image)))["allowed"] is True


def test_a_quarantine_mark_whose_blob_does_not_hash_to_its_descriptor_refuses_the_image(start_webhook, registry):
    """Blobs of the state repository are hash-checked: a swapped one is not read as a (milder) mark, nor ignored."""
    from .hostile_registry import HostileRegistry

    hostile = HostileRegistry()
    try:
        hook = start_webhook(quarantine=f"127.0.0.1:{hostile.port}/{hostile.STATE}")
        image = registry.push(unique_repository())
        registry.sign(image)
        digest = image.split("@", 1)[1]
        assert hook.review(pod(("app", image)))["allowed"] is True
        record = {"schema": 1, "digest": digest, "reason": "CVE-2026-0002", "source": "manual",
                  "since": "2026-12-01T00:00:00Z"}
        hostile.mark(digest, record, blob=json.dumps({**record, "reason": "swapped"}).encode())
        message = denial(hook.review(pod(("app", image))))
        assert f"its quarantine mark in 127.0.0.1:{hostile.port}/{hostile.STATE} cannot be read (the blob served" \
               in message and "does not hash to it" in message, message
        hostile.mark(digest, record)
        assert denial(hook.review(pod(("app", image)))).endswith(
            "quarantined since 2026-12-01T00:00:00Z (manual): CVE-2026-0002")
    finally:
        hostile.stop()


def test_an_unreachable_state_repository_follows_the_failure_policy(start_webhook, images):
    hook = start_webhook(quarantine=f"{UNREACHABLE}/state")
    message = denial(hook.review(pod(("app", images.signed))))
    assert "quarantine marks unreachable" in message


# --- imagebuild admission review: the same answer, offline --------------------------------------------------


def test_review_judges_one_admission_review_from_a_file_like_the_webhook(imagebuild, images, tmp_path):
    config = trust_file(tmp_path)
    allowed, denied = tmp_path / "allowed.json", tmp_path / "denied.json"
    allowed.write_text(json.dumps(pod(("app", images.signed))))
    denied.write_text(json.dumps(pod(("app", images.signed), ("sidecar", images.unsigned))))
    ok = imagebuild("admission", "review", "--config", config, allowed)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["response"]["allowed"] is True
    refused = imagebuild("admission", "review", "--config", config, denied)
    assert refused.returncode == 1, refused.stderr
    message = json.loads(refused.stdout)["response"]["status"]["message"]
    assert message.startswith(f'imagebuild refused 1 of 2 images: container "sidecar" image {images.unsigned}: not signed')


def test_review_with_mutate_prints_the_patch_the_mutating_webhook_would_send(imagebuild, registry, tmp_path):
    repository = unique_repository()
    signed = registry.push(repository, "v2")
    registry.sign(signed)
    review = pod(("app", f"{repository}:v2"))
    path = tmp_path / "review.json"
    path.write_text(json.dumps(review))
    run = imagebuild("admission", "review", "--mutate", "--config", trust_file(tmp_path), path)
    assert run.returncode == 0, run.stderr
    obj = apply_json_patch(review["request"]["object"], json.loads(run.stdout)["response"])
    assert obj["spec"]["containers"][0]["image"] == f"{repository}:v2@{signed.split('@', 1)[1]}"


def test_review_of_a_body_without_a_uid_is_bad_input_in_one_line(imagebuild, tmp_path):
    body = tmp_path / "review.json"
    body.write_text('{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}')
    run = imagebuild("admission", "review", "--config", trust_file(tmp_path), body)
    assert run.returncode == 2
    assert run.stderr == (f"error: {body}: imagebuild: malformed AdmissionReview: request.uid: missing, or not a "
                          "non-empty string\n")
    assert run.stdout == ""
