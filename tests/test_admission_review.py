"""AdmissionReview v1 parsing, image extraction and answers (imagebuild/admission/review.py, pure).

The verifier is a small table of verdicts here: these tests are about how verdicts become an
answer. The real Verifier behind the real server is tested in tests/e2e/test_admission.py.
"""
from __future__ import annotations

import base64
import copy
import json
from dataclasses import dataclass

import pytest

from imagebuild.admission import review as admission
from imagebuild.admission.review import Limits, Policy, ReviewRejected, parse_review

UID = "705ab4f5-6393-11e8-b7cc-42010a800002"
GOOD = "127.0.0.1:5000/imagebuild/app@sha256:" + "a" * 64
BAD = "127.0.0.1:5000/imagebuild/unsigned:1"


@dataclass(frozen=True)
class FakeVerdict:
    image: str
    allowed: bool
    reason: str
    digest: str | None = None
    unreachable: bool = False


def table(**special: FakeVerdict):
    """A verify function: every image allowed unless `special` says otherwise; records what it was asked."""
    asked: list[list[str]] = []

    def verify(images):
        asked.append(list(images))
        return {image: special.get(image) or FakeVerdict(image, True, "signed by test-key") for image in images}

    verify.asked = asked
    return verify


def refused(image: str, reason: str = "not signed by any configured key", unreachable: bool = False) -> FakeVerdict:
    return FakeVerdict(image, False, reason, unreachable=unreachable)


def pod_spec(*containers, init=(), ephemeral=()):
    spec = {"containers": [{"name": n, "image": i} for n, i in containers]}
    if init:
        spec["initContainers"] = [{"name": n, "image": i} for n, i in init]
    if ephemeral:
        spec["ephemeralContainers"] = [{"name": n, "image": i} for n, i in ephemeral]
    return spec


def review_of(kind: str, obj: dict, group: str = "", operation: str = "CREATE", **request) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": UID, "kind": {"group": group, "version": "v1", "kind": kind},
                        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
                        "operation": operation, "namespace": "team-a", "name": obj.get("metadata", {}).get("name", ""),
                        "object": obj, "userInfo": {"username": "alice"}, **request}}


def pod_review(*containers, **kw) -> dict:
    init = kw.pop("init", ())
    ephemeral = kw.pop("ephemeral", ())
    return review_of("Pod", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
                             "spec": pod_spec(*containers, init=init, ephemeral=ephemeral)}, **kw)


def body(document) -> bytes:
    return json.dumps(document).encode()


ENFORCE = Policy()


def answer(document, verify=None, policy=ENFORCE) -> admission.Outcome:
    raw = document if isinstance(document, bytes) else body(document)
    return admission.review(raw, verify or table(), policy)


# --- images, wherever they are ---------------------------------------------------------------------------------


def test_a_pod_yields_its_containers_init_containers_and_ephemeral_containers():
    request = parse_review(body(pod_review(("app", GOOD), ("sidecar", BAD), init=[("setup", "x/init:1")],
                                           ephemeral=[("debug", "x/debug:1")])))
    assert [(c.field, c.name, c.image) for c in request.images] == [
        ("initContainer", "setup", "x/init:1"), ("container", "app", GOOD), ("container", "sidecar", BAD),
        ("ephemeralContainer", "debug", "x/debug:1")]
    assert (request.uid, request.kind, request.namespace, request.name) == (UID, "Pod", "team-a", "web")


@pytest.mark.parametrize("group,kind", [("apps", "Deployment"), ("apps", "StatefulSet"), ("apps", "DaemonSet"),
                                        ("apps", "ReplicaSet"), ("batch", "Job"), ("", "ReplicationController")])
def test_workloads_yield_the_images_of_their_pod_template(group, kind):
    obj = {"metadata": {"name": "w"}, "spec": {"template": {"spec": pod_spec(("app", GOOD), init=[("i", BAD)])}}}
    request = parse_review(body(review_of(kind, obj, group=group)))
    assert [c.image for c in request.images] == [BAD, GOOD]


def test_a_cronjob_yields_the_images_of_its_job_template():
    obj = {"spec": {"schedule": "* * * * *",
                    "jobTemplate": {"spec": {"template": {"spec": pod_spec(("run", BAD))}}}}}
    request = parse_review(body(review_of("CronJob", obj, group="batch")))
    assert [(c.name, c.image) for c in request.images] == [("run", BAD)]


def test_the_same_image_in_two_containers_is_verified_once_and_both_are_named():
    verify = table(**{BAD: refused(BAD)})
    outcome = answer(pod_review(("a", BAD), ("b", BAD)), verify)
    assert verify.asked == [[BAD]]
    message = outcome.body["response"]["status"]["message"]
    assert f'container "a" image {BAD}' in message and f'container "b" image {BAD}' in message


def test_a_pod_created_from_a_template_is_named_by_its_generate_name():
    document = pod_review(("app", GOOD))
    document["request"]["name"] = ""
    document["request"]["object"]["metadata"] = {"generateName": "web-7d9f-"}
    assert parse_review(body(document)).name == "web-7d9f-*"


# --- answers ---------------------------------------------------------------------------------------------------


def test_every_image_allowed_is_allowed_with_the_request_uid():
    outcome = answer(pod_review(("app", GOOD), init=[("i", GOOD)]))
    assert outcome.http_status == 200
    assert outcome.body == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                            "response": {"uid": UID, "allowed": True}}


def test_one_refused_image_denies_the_pod_and_the_message_names_it_and_its_reason():
    outcome = answer(pod_review(("app", GOOD), ("sidecar", BAD)), table(**{BAD: refused(BAD)}))
    response = outcome.body["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert response["status"]["message"] == (
        f'imagebuild refused 1 of 2 images: container "sidecar" image {BAD}: not signed by any configured key')
    assert GOOD not in response["status"]["message"]


def test_warn_mode_admits_a_refused_image_and_warns_with_the_reason():
    outcome = answer(pod_review(("app", BAD)), table(**{BAD: refused(BAD)}), Policy(enforce=False))
    response = outcome.body["response"]
    assert response["allowed"] is True
    assert response["warnings"] == [
        f'container "app" image {BAD}: not signed by any configured key (admitted: mode is warn)']
    assert outcome.log["decision"] == "warned"


def test_an_unreachable_registry_denies_under_failure_policy_fail():
    verdict = refused(BAD, "registry 127.0.0.1:1 unreachable: connection refused", unreachable=True)
    response = answer(pod_review(("app", BAD)), table(**{BAD: verdict}), Policy(fail_closed=True)).body["response"]
    assert response["allowed"] is False
    assert "registry 127.0.0.1:1 unreachable: connection refused" in response["status"]["message"]


def test_an_unreachable_registry_admits_with_a_warning_under_failure_policy_ignore():
    verdict = refused(BAD, "registry 127.0.0.1:1 unreachable", unreachable=True)
    response = answer(pod_review(("app", BAD)), table(**{BAD: verdict}), Policy(fail_closed=False)).body["response"]
    assert response["allowed"] is True
    assert response["warnings"] == [
        f'container "app" image {BAD}: registry 127.0.0.1:1 unreachable (admitted: failure_policy is ignore)']


def test_failure_policy_ignore_does_not_admit_an_image_that_was_reached_and_refused():
    other = "127.0.0.1:1/x:1"
    verify = table(**{BAD: refused(BAD), other: refused(other, "unreachable", unreachable=True)})
    response = answer(pod_review(("a", BAD), ("b", other)), verify, Policy(fail_closed=False)).body["response"]
    assert response["allowed"] is False
    assert f'container "a" image {BAD}' in response["status"]["message"]
    assert response["warnings"] == [f'container "b" image {other}: unreachable (admitted: failure_policy is ignore)']


def test_an_image_the_verifier_gave_no_verdict_for_is_refused():
    outcome = answer(pod_review(("app", BAD)), lambda images: {})
    assert outcome.body["response"]["allowed"] is False
    assert "not verified" in outcome.body["response"]["status"]["message"]


def test_a_delete_is_allowed_without_verifying_anything():
    verify = table()
    document = pod_review(("app", BAD), operation="DELETE")
    document["request"]["object"] = None
    assert answer(document, verify).body["response"]["allowed"] is True
    assert verify.asked == []


def test_a_status_update_of_a_pod_is_not_checked_but_an_ephemeral_container_update_is():
    verify = table(**{BAD: refused(BAD)})
    status = pod_review(("app", BAD), operation="UPDATE", subResource="status")
    assert answer(status, verify).body["response"]["allowed"] is True
    debug = pod_review(("app", GOOD), ephemeral=[("debug", BAD)], operation="UPDATE", subResource="ephemeralcontainers")
    assert answer(debug, verify).body["response"]["allowed"] is False


def test_a_kind_without_a_pod_template_is_allowed_and_logged_as_skipped():
    outcome = answer(review_of("ConfigMap", {"data": {"image": BAD}}))
    assert outcome.body["response"]["allowed"] is True
    assert "ConfigMap" in outcome.log["skipped"]


def test_the_decision_log_names_uid_kind_object_and_each_image_but_not_the_pod_spec():
    document = pod_review(("app", BAD))
    document["request"]["object"]["spec"]["containers"][0]["env"] = [{"name": "TOKEN", "value": "canary-s3cr3t"}]
    outcome = answer(document, table(**{BAD: refused(BAD)}))
    log = outcome.log
    assert (log["uid"], log["kind"], log["object"], log["decision"]) == (UID, "Pod", "team-a/web", "denied")
    assert [(i["container"], i["image"], i["allowed"]) for i in log["images"]] == [("app", BAD, False)]
    assert "canary-s3cr3t" not in json.dumps(log)


# --- malformed bodies ------------------------------------------------------------------------------------------


def with_request(**changes):
    document = pod_review(("app", GOOD))
    for key, value in changes.items():
        if value is ...:
            del document["request"][key]
        else:
            document["request"][key] = value
    return document


def at(document, path, value):
    document = copy.deepcopy(document)
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return document


NO_UID = [
    (b"", "the body is empty"),
    (b"   \n", "the body is empty"),
    (b"not json", "the body is not JSON: Expecting value at line 1 column 1"),
    (b'{"apiVersion": ', "the body is not JSON"),
    (b"\xff\xfe{}", "the body is not UTF-8 (byte 0)"),
    (b"[]", "the body is a JSON array, not an AdmissionReview object"),
    (b'"AdmissionReview"', "the body is a JSON string"),
    (b"null", "the body is a JSON null"),
    (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', "request: missing, or not an object"),
    (b'{"request": []}', "request: missing, or not an object"),
    (b'{"request": {}}', "request.uid: missing, or not a non-empty string"),
    (b'{"request": {"uid": 42}}', "request.uid: missing, or not a non-empty string"),
    (b'{"request": {"uid": ""}}', "request.uid: missing, or not a non-empty string"),
    (b'{"request": {"uid": "a\\nb"}}', "request.uid: not a Kubernetes UID"),
    (b'{"request": {"uid": "' + b"u" * 200 + b'"}}', "request.uid: not a Kubernetes UID"),
    (b'{"request": {"uid": NaN}}', "the body is not JSON: NaN is not a JSON number"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 100 levels"),
    (b'{"a":' * 150 + b"1" + b"}" * 150, "nests deeper than 100 levels"),
    (b'{"request": {"uid": ' + b"9" * 5000 + b"}}", "the body is not JSON"),
]


@pytest.mark.parametrize("raw,expected", NO_UID, ids=[e for _, e in NO_UID])
def test_a_body_without_a_usable_uid_gets_http_400_and_says_what_is_wrong(raw, expected):
    outcome = answer(raw)
    assert outcome.http_status == 400
    assert outcome.body["error"].startswith("imagebuild: malformed AdmissionReview: ")
    assert expected in outcome.body["error"]
    assert outcome.log["decision"] == "malformed"


def test_a_body_over_the_size_cap_is_refused_before_it_is_parsed():
    limits = Limits(max_body_bytes=1000)
    with pytest.raises(ReviewRejected, match="the body is 1001 bytes, more than the 1000 allowed"):
        parse_review(b"x" * 1001, limits)


WITH_UID = [
    (at(pod_review(("a", GOOD)), ["apiVersion"], "admission.k8s.io/v1beta1"),
     'apiVersion: expected admission.k8s.io/v1, got "admission.k8s.io/v1beta1"'),
    (at(pod_review(("a", GOOD)), ["kind"], "Pod"), 'kind: expected AdmissionReview, got "Pod"'),
    (with_request(kind=...), "request.kind: missing, or not an object"),
    (with_request(kind="Pod"), "request.kind: missing, or not an object"),
    (with_request(kind={"group": "", "version": "v1"}), "request.kind.kind: missing"),
    (with_request(kind={"group": 1, "kind": "Pod"}), "request.kind.group: not a string"),
    (with_request(operation=...), "request.operation: missing"),
    (with_request(operation="PATCH"), 'request.operation: expected one of CREATE, UPDATE, DELETE, CONNECT, got "PATCH"'),
    (with_request(namespace=["a"]), "request.namespace: not a string"),
    (with_request(object=...), "request.object: missing, or not an object"),
    (with_request(object="pod"), "request.object: missing, or not an object"),
    (with_request(object={"metadata": {}}), "request.object.spec: missing, or not an object"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers"], {"a": GOOD}),
     "request.object.spec.containers: not a list"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers"], [GOOD]),
     "request.object.spec.containers[0]: not an object"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers", 0, "image"], None),
     'request.object.spec.containers[0].image: container "a" has no image'),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers", 0, "image"], ["x"]),
     'request.object.spec.containers[0].image: container "a" has no image'),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers", 0, "name"], 7),
     "request.object.spec.containers[0].name: not a string"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers", 0, "image"], "x y:1"),
     "request.object.spec.containers[0].image: 'x y:1' is not an image reference"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers", 0, "image"], "x\x1b[31m:1"),
     "'x\\x1b[31m:1' is not an image reference"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers", 0, "image"], "r/" + "x" * 2000),
     "request.object.spec.containers[0].image: longer than 1024 characters"),
    (at(pod_review(("a", GOOD)), ["request", "object", "spec", "containers"],
        [{"name": f"c{i}", "image": GOOD} for i in range(101)]),
     "request.object.spec: more than 100 images in one object"),
    (review_of("Deployment", {"spec": {"template": []}}, group="apps"),
     "request.object.spec.template: missing, or not an object"),
    (review_of("CronJob", {"spec": {"jobTemplate": {"spec": {}}}}, group="batch"),
     "request.object.spec.jobTemplate.spec.template: missing, or not an object"),
]


@pytest.mark.parametrize("document,expected", WITH_UID, ids=[e[:60] for _, e in WITH_UID])
def test_a_malformed_review_with_a_uid_is_denied_with_a_clear_message(document, expected):
    verify = table()
    outcome = answer(document, verify)
    assert outcome.http_status == 200
    response = outcome.body["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == (UID, False, 400)
    assert response["status"]["message"].startswith("imagebuild: malformed AdmissionReview: ")
    assert expected in response["status"]["message"]
    assert verify.asked == []


def test_a_container_name_with_control_characters_is_escaped_in_the_message():
    outcome = answer(pod_review(("evil\n\x1b[2J", BAD)), table(**{BAD: refused(BAD)}))
    message = outcome.body["response"]["status"]["message"]
    assert "\n" not in message and "\x1b" not in message
    assert 'container "evil\\n\\x1b[2J"' in message


def test_a_long_denial_message_is_bounded():
    images = [(f"c{i}", f"127.0.0.1:5000/x/{i}:{'t' * 100}") for i in range(100)]
    verify = lambda asked: {image: refused(image, "r" * 1000) for image in asked}  # noqa: E731
    message = answer(pod_review(*images), verify).body["response"]["status"]["message"]
    assert message.startswith("imagebuild refused 100 of 100 images: ")
    assert len(message) <= 8000


# --- the webhook's verification of a request's images (admission_server.ParallelVerifier) ----------------------


def test_an_error_while_verifying_one_image_refuses_that_image_and_the_others_are_still_judged():
    from imagebuild.admission.server import ParallelVerifier

    def verify(image):
        if image == BAD:
            raise RuntimeError("unexpected manifest")
        return FakeVerdict(image, True, "signed by test-key")

    parallel = ParallelVerifier(verify, workers=2)
    try:
        outcome = answer(pod_review(("app", GOOD), ("sidecar", BAD)), parallel)
    finally:
        parallel.close()
    response = outcome.body["response"]
    assert response["allowed"] is False
    assert response["status"]["message"] == (f'imagebuild refused 1 of 2 images: container "sidecar" image {BAD}: '
                                              "verification failed: RuntimeError: unexpected manifest")


def test_an_error_while_verifying_is_refused_even_under_failure_policy_ignore():
    from imagebuild.admission.server import ParallelVerifier

    def verify(image):
        raise ValueError("bug")

    parallel = ParallelVerifier(verify, workers=1)
    try:
        response = answer(pod_review(("app", GOOD)), parallel, Policy(fail_closed=False)).body["response"]
    finally:
        parallel.close()
    assert response["allowed"] is False


# --- image volumes ---------------------------------------------------------------------------------------------


def with_volumes(document: dict, *volumes: dict) -> dict:
    document["request"]["object"]["spec"]["volumes"] = list(volumes)
    return document


def image_volume(name: str, reference) -> dict:
    return {"name": name, "image": {"reference": reference, "pullPolicy": "IfNotPresent"}}


def test_an_image_volume_is_an_image_like_a_container_and_other_volumes_are_not():
    document = with_volumes(pod_review(("app", GOOD)), {"name": "scratch", "emptyDir": {}}, image_volume("data", BAD))
    request = parse_review(body(document))
    assert [(c.field, c.name, c.image, c.pointer) for c in request.images] == [
        ("container", "app", GOOD, "/spec/containers/0/image"),
        ("volume", "data", BAD, "/spec/volumes/1/image/reference")]


def test_a_signed_container_with_an_unsigned_image_volume_is_denied_naming_the_volume():
    document = with_volumes(pod_review(("app", GOOD)), image_volume("data", BAD))
    message = answer(document, table(**{BAD: refused(BAD)})).body["response"]["status"]["message"]
    assert message == (f'imagebuild refused 1 of 2 images: volume "data" image {BAD}: '
                       "not signed by any configured key")


def test_a_workload_template_s_image_volumes_are_checked():
    spec = {**pod_spec(("app", GOOD)), "volumes": [image_volume("model", BAD)]}
    obj = {"metadata": {"name": "w"}, "spec": {"template": {"spec": spec}}}
    request = parse_review(body(review_of("Deployment", obj, group="apps")))
    assert [(c.field, c.pointer) for c in request.images] == [
        ("container", "/spec/template/spec/containers/0/image"), ("volume", "/spec/template/spec/volumes/0/image/reference")]


@pytest.mark.parametrize("volume,expected", [
    ({"name": "data", "image": "x/y:1"}, "request.object.spec.volumes[0].image: not an object"),
    ({"name": "data", "image": {}}, 'request.object.spec.volumes[0].image.reference: volume "data" has no image reference'),
    ({"name": "data", "image": {"reference": "x/y:1\n"}},
     r"request.object.spec.volumes[0].image.reference: 'x/y:1\n' is not an image reference"),
    ("data", "request.object.spec.volumes[0]: not an object"),
])
def test_a_malformed_image_volume_is_denied_with_a_clear_message(volume, expected):
    message = answer(with_volumes(pod_review(("app", GOOD)), volume)).body["response"]["status"]["message"]
    assert message == f"imagebuild: malformed AdmissionReview: {expected}"


def test_image_volumes_count_towards_the_image_limit():
    document = with_volumes(pod_review(("app", GOOD)), *[image_volume(f"v{i}", GOOD) for i in range(3)])
    outcome = admission.review(body(document), table(), ENFORCE, Limits(max_images=3))
    assert outcome.body["response"]["status"]["message"].endswith("more than 3 images in one object")


# --- pinning (the mutating webhook) ----------------------------------------------------------------------------

DIGEST = "sha256:" + "b" * 64
TAGGED = "127.0.0.1:5000/imagebuild/app:3.3"


def digests(**special: FakeVerdict):
    """Like table(), but every allowed image was verified at DIGEST."""
    def verify(images):
        return {image: special.get(image) or FakeVerdict(image, True, "signed by test-key", DIGEST)
                for image in images}
    return verify


def apply_patch(obj: dict, patch: list[dict]) -> dict:
    """RFC 6902 `replace`, the only operation the webhook sends: the path must exist."""
    result = copy.deepcopy(obj)
    for op in patch:
        assert op["op"] == "replace", op
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        target = result
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        key = int(last) if isinstance(target, list) else last
        target[key]  # noqa: B018 -- replace needs the member to exist
        target[key] = op["value"]
    return result


def patched(document: dict, verify=None, policy=ENFORCE) -> tuple[dict, dict]:
    response = admission.review(body(document), verify or digests(), policy, pin=True).body["response"]
    if "patch" not in response:
        return response, document["request"]["object"]
    assert response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    return response, apply_patch(document["request"]["object"], patch)


def test_mutate_pins_every_admitted_tag_to_its_verified_digest_keeping_the_tag():
    bare = "127.0.0.1:5000/imagebuild/tools"
    document = with_volumes(pod_review(("app", TAGGED), init=[("setup", bare)]), image_volume("model", TAGGED))
    response, obj = patched(document)
    assert response["allowed"] is True
    assert obj["spec"]["containers"][0]["image"] == f"{TAGGED}@{DIGEST}"
    assert obj["spec"]["initContainers"][0]["image"] == f"{bare}@{DIGEST}"
    assert obj["spec"]["volumes"][0]["image"]["reference"] == f"{TAGGED}@{DIGEST}"


def test_mutate_leaves_an_image_already_pinned_to_its_verified_digest_and_validate_never_patches():
    pinned_ref = f"{TAGGED}@{DIGEST}"
    response, obj = patched(pod_review(("app", pinned_ref)))
    assert response["allowed"] is True and "patch" not in response
    validated = admission.review(body(pod_review(("app", TAGGED))), digests(), ENFORCE).body["response"]
    assert validated["allowed"] is True and "patch" not in validated and "patchType" not in validated


def test_mutate_in_enforce_mode_refuses_an_admitted_image_it_cannot_pin():
    verify = digests(**{TAGGED: FakeVerdict(TAGGED, True, "signed by test-key", None)})
    response, _ = patched(pod_review(("app", TAGGED)), verify)
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(
        f'imagebuild refused 1 of 1 image: container "app" image {TAGGED}: cannot be pinned')


def test_mutate_never_rewrites_a_digest_reference_to_another_digest():
    other = f"{TAGGED}@sha256:{'c' * 64}"
    response, _ = patched(pod_review(("app", other)))  # the verifier (wrongly) names DIGEST for it
    assert response["allowed"] is False and "cannot be pinned" in response["status"]["message"]


def test_mutate_in_warn_mode_pins_what_verified_and_leaves_the_refused_image_as_written():
    verify = digests(**{BAD: refused(BAD)})
    response, obj = patched(pod_review(("app", TAGGED), ("sidecar", BAD)), verify, Policy(enforce=False))
    assert response["allowed"] is True and len(response["warnings"]) == 1
    assert [c["image"] for c in obj["spec"]["containers"]] == [f"{TAGGED}@{DIGEST}", BAD]


def test_mutate_on_update_pins_only_the_references_the_update_changed():
    """Re-pinning an unchanged reference would restart a running Pod's container (or roll out a template)."""
    changed = "127.0.0.1:5000/imagebuild/new:1"
    document = pod_review(("app", TAGGED), ("sidecar", changed), operation="UPDATE")
    document["request"]["oldObject"] = {"spec": {"containers": [{"name": "app", "image": TAGGED},
                                                                {"name": "sidecar", "image": "x/old:1"}]}}
    response, obj = patched(document)
    assert response["allowed"] is True
    assert [c["image"] for c in obj["spec"]["containers"]] == [TAGGED, f"{changed}@{DIGEST}"]


def test_the_mutate_decision_log_names_what_was_pinned():
    outcome = admission.review(body(pod_review(("app", TAGGED))), digests(), ENFORCE, pin=True)
    assert outcome.log["pinned"] == [f"{TAGGED}@{DIGEST}"]
    assert outcome.log["images"][0]["digest"] == DIGEST
