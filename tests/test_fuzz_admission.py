"""Fuzzing the AdmissionReview parser (admission.parse_review): anyone who can reach the webhook
can send it anything.

Whatever the body, parse_review returns a ReviewRequest or raises ReviewRejected (which the
webhook answers); and of a well-formed Pod or workload, the images it finds are exactly the
image fields placed in it, in order, with their JSON pointers, and none of the look-alikes
placed elsewhere (annotations, env values, unknown fields). Bounded to a few seconds.
"""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imagebuild.admission.review import POD_SPEC_PATHS, ReviewRejected, parse_review

# No example database: nothing written into the checkout; each run draws afresh.
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

json_scalar = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
KEYS = ["apiVersion", "kind", "request", "uid", "operation", "object", "oldObject", "spec", "template", "containers",
        "initContainers", "ephemeralContainers", "volumes", "image", "reference", "name", "group", "subResource",
        "metadata", "jobTemplate", "namespace"]
VALUES = ["admission.k8s.io/v1", "AdmissionReview", "CREATE", "UPDATE", "DELETE", "Pod", "Deployment", "apps", "",
          "batch", "CronJob", "ephemeralcontainers", "status", "u-1", "nginx:1", "\x1b[2K", "a" * 2000]
# Documents built from the webhook's own vocabulary reach deep into the parser; plain JSON does not.
review_like = st.recursive(st.sampled_from(VALUES) | json_scalar,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner,
                                                                                         max_size=6), max_leaves=40)


def _judged(body: bytes) -> None:
    try:
        parse_review(body)
    except ReviewRejected as err:
        assert isinstance(err.message, str) and (err.uid is None or isinstance(err.uid, str))


def _review(obj: object, kind: tuple[str, str] = ("", "Pod"), operation: str = "CREATE", old: object = None) -> dict:
    request = {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "kind": {"group": kind[0], "version": "v1",
                                                                       "kind": kind[1]},
               "operation": operation, "namespace": "ns", "object": obj}
    if old is not None:
        request["oldObject"] = old
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_are_judged_or_rejected(body):
    _judged(body)


@FUZZ
@given(json_value)
def test_arbitrary_json_is_judged_or_rejected(document):
    _judged(json.dumps(document).encode())


@FUZZ
@given(review_like)
def test_review_like_documents_are_judged_or_rejected(document):
    _judged(json.dumps(document).encode())


@FUZZ
@given(review_like, review_like, st.sampled_from(sorted(POD_SPEC_PATHS)), st.sampled_from(["CREATE", "UPDATE"]))
def test_review_like_objects_in_a_valid_envelope_are_judged_or_rejected(obj, old, kind, operation):
    _judged(json.dumps(_review(obj, kind, operation, old)).encode())


# --- the images found are exactly those placed --------------------------------------------------------

reference = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=80)
name = st.text(max_size=20)
container = st.fixed_dictionaries({"name": name, "image": reference},
                                  optional={"env": st.lists(st.fixed_dictionaries({"name": st.just("image"),
                                                                                   "value": reference}), max_size=2),
                                            "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent"])})
volume = st.one_of(
    st.fixed_dictionaries({"name": name, "image": st.fixed_dictionaries({"reference": reference},
                                                                        optional={"pullPolicy": st.just("Always")})}),
    st.fixed_dictionaries({"name": name, "emptyDir": st.just({})}),  # another kind: no image
)
pod_spec = st.fixed_dictionaries({}, optional={
    "containers": st.lists(container, max_size=4), "initContainers": st.lists(container, max_size=3),
    "ephemeralContainers": st.lists(container, max_size=2), "volumes": st.lists(volume, max_size=3),
    "nodeName": reference, "image": reference,  # look-alikes: a spec-level `image` is not an image field
})


def _expected(spec: dict, pointer: str) -> list[tuple[str, str, str, str]]:
    found = []
    for key, label in (("initContainers", "initContainer"), ("containers", "container"),
                       ("ephemeralContainers", "ephemeralContainer")):
        for index, c in enumerate(spec.get(key, [])):
            found.append((label, c["name"], c["image"], f"{pointer}/{key}/{index}/image"))
    for index, v in enumerate(spec.get("volumes", [])):
        if "image" in v:
            found.append(("volume", v["name"], v["image"]["reference"], f"{pointer}/volumes/{index}/image/reference"))
    return found


def _wrap(spec: dict, path: tuple[str, ...], annotations: dict) -> dict:
    obj: dict = spec
    for key in reversed(path):
        obj = {key: obj}
    obj["metadata"] = {"name": "x", "annotations": annotations}
    return obj


@FUZZ
@given(pod_spec, st.sampled_from(sorted(POD_SPEC_PATHS)), st.dictionaries(st.just("image"), reference, max_size=1))
def test_the_images_found_are_exactly_the_image_fields_placed(spec, kind, annotations):
    path = POD_SPEC_PATHS[kind]
    request = parse_review(json.dumps(_review(_wrap(spec, path, annotations), kind)).encode())
    pointer = "".join(f"/{key}" for key in path)
    assert [(i.field, i.name, i.image, i.pointer) for i in request.images] == _expected(spec, pointer)
    assert request.skipped is None
