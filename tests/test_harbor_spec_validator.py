"""The Harbor stand-in's validator: it must refuse what Harbor's OpenAPI spec does not allow.

If it let a wrong request through, the stand-in tests of imagebuild's Harbor client would pass
against an API that does not exist; so each check is shown to fail on a bad input and to pass
on the good one next to it.
"""
from __future__ import annotations

import json

import httpx
import pytest

from .harbor_standin import ADMIN, HarborSpec, HarborStandIn, SpecViolation

JSON = {"content-type": "application/json"}
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def spec() -> HarborSpec:
    return HarborSpec()


def body(value: object) -> bytes:
    return json.dumps(value).encode()


def test_routes_a_request_to_its_operation_and_decodes_path_parameters_once(spec):
    operation, params = spec.match("GET", f"/api/v2.0/projects/paddle/repositories/a%252Fb/artifacts/{DIGEST}")
    assert operation.operation_id == "getArtifact"
    assert params == {"project_name": "paddle", "repository_name": "a%2Fb", "reference": DIGEST}


def test_literal_path_segments_win_over_parameters(spec):
    operation, _ = spec.match("GET", "/api/v2.0/projects/paddle/summary")
    assert operation.operation_id == "getProjectSummary"


def test_rejects_an_unknown_path(spec):
    with pytest.raises(SpecViolation, match="no such path"):
        spec.match("GET", "/api/v2.0/projects/paddle/robots")


def test_rejects_a_method_the_path_does_not_have(spec):
    with pytest.raises(SpecViolation, match="no PATCH operation"):
        spec.match("PATCH", "/api/v2.0/projects/paddle")


def test_rejects_a_path_outside_the_base_path(spec):
    with pytest.raises(SpecViolation, match="base path"):
        spec.match("GET", "/api/v2.1/projects")


def test_accepts_a_valid_project_creation(spec):
    operation, params = spec.match("POST", "/api/v2.0/projects")
    request = {"project_name": "paddle", "metadata": {"public": "false", "auto_scan": "true", "severity": "high"}}
    assert spec.check_request(operation, params, {}, JSON, body(request)) == []


def test_rejects_a_request_body_field_of_the_wrong_type(spec):
    operation, params = spec.match("POST", "/api/v2.0/projects")
    request = {"project_name": "paddle", "metadata": {"public": False}}  # Harbor's metadata values are strings
    problems = spec.check_request(operation, params, {}, JSON, body(request))
    assert len(problems) == 1
    assert "createProject" in problems[0] and ".metadata.public" in problems[0] and "'string'" in problems[0]


def test_rejects_a_request_body_field_the_definition_does_not_have(spec):
    operation, params = spec.match("POST", "/api/v2.0/projects")
    problems = spec.check_request(operation, params, {}, JSON, body({"project_name": "p", "metadata": {"auto_scna": "true"}}))
    assert len(problems) == 1 and "'auto_scna' was unexpected" in problems[0]


def test_null_is_accepted_only_where_the_spec_says_x_nullable(spec):
    operation, params = spec.match("POST", "/api/v2.0/projects")
    assert spec.check_request(operation, params, {}, JSON, body({"project_name": "p", "storage_limit": None})) == []
    problems = spec.check_request(operation, params, {}, JSON, body({"project_name": None}))
    assert len(problems) == 1 and "project_name" in problems[0]


def test_rejects_a_missing_required_body_and_a_body_where_none_is_taken(spec):
    create, params = spec.match("POST", "/api/v2.0/projects")
    assert spec.check_request(create, params, {}, JSON, b"") == ["createProject (POST /projects): request body is required"]
    read, params = spec.match("GET", "/api/v2.0/projects/paddle")
    assert "takes no request body" in spec.check_request(read, params, {}, JSON, body({}))[0]


def test_rejects_a_body_that_is_not_json_or_not_sent_as_json(spec):
    operation, params = spec.match("POST", "/api/v2.0/projects")
    assert "not JSON" in spec.check_request(operation, params, {}, JSON, b"{project_name")[0]
    assert "Content-Type" in spec.check_request(operation, params, {}, {"content-type": "text/plain"}, b"{}")[0]


def test_read_only_properties_are_refused_in_requests_but_allowed_in_responses(spec):
    assert spec.definition_errors("Schedule", {"id": 4}, request=False) == []
    assert spec.definition_errors("Schedule", {"id": 4}, request=True) != []


def test_rejects_an_undeclared_query_parameter(spec):
    operation, params = spec.match("GET", f"/api/v2.0/projects/p/repositories/r/artifacts/{DIGEST}")
    assert spec.check_request(operation, params, {"with_scan_overview": ["true"]}, {}, b"") == []
    problems = spec.check_request(operation, params, {"with_scan_overveiw": ["true"]}, {}, b"")
    assert len(problems) == 1 and "'with_scan_overveiw' is not declared" in problems[0]


@pytest.mark.parametrize("query, words", [
    ({"with_scan_overview": ["yes"]}, "not a boolean"),
    ({"page_size": ["500"]}, "above the maximum 100"),
    ({"page": ["first"]}, "not an integer"),
    ({"page": ["1", "2"]}, "given 2 times"),
])
def test_rejects_query_values_of_the_wrong_type_or_range(spec, query, words):
    operation, params = spec.match("GET", f"/api/v2.0/projects/p/repositories/r/artifacts/{DIGEST}")
    problems = spec.check_request(operation, params, query, {}, b"")
    assert len(problems) == 1 and words in problems[0]


def test_rejects_missing_required_query_parameters_and_bad_path_and_header_values(spec):
    head, params = spec.match("HEAD", "/api/v2.0/projects")
    assert "'project_name' is required" in spec.check_request(head, params, {}, {}, b"")[0]
    robot, params = spec.match("GET", "/api/v2.0/robots/ci")
    assert "'robot_id': 'ci' is not an integer" in spec.check_request(robot, params, {}, {}, b"")[0]
    project, params = spec.match("GET", "/api/v2.0/projects/paddle")
    problems = spec.check_request(project, params, {}, {"x-is-resource-name": "yes", "x-request-id": ""}, b"")
    assert len(problems) == 2


def test_rejects_a_status_code_the_operation_does_not_declare(spec):
    operation, _ = spec.match("GET", "/api/v2.0/projects/paddle")
    error = body({"errors": [{"code": "CONFLICT", "message": "no"}]})
    problems = spec.check_response(operation, 409, JSON, error)
    assert problems == ["getProject (GET /projects/{project_name_or_id}): status 409 is not declared "
                        "(declared: ['200', '401', '403', '404', '500'])"]
    assert spec.check_response(operation, 404, JSON, error) == []


def test_401_and_403_are_allowed_everywhere_with_harbors_error_body(spec):
    operation, _ = spec.match("GET", "/api/v2.0/robots")  # declares neither
    assert spec.check_response(operation, 401, JSON, body({"errors": [{"code": "UNAUTHORIZED", "message": "x"}]})) == []
    assert spec.check_response(operation, 403, JSON, body({"errors": "forbidden"})) != []


def test_rejects_a_response_body_that_breaks_the_response_schema(spec):
    operation, _ = spec.match("GET", "/api/v2.0/projects/paddle")
    good = {"project_id": 1, "name": "paddle", "metadata": {"public": "false"}}
    assert spec.check_response(operation, 200, JSON, body(good)) == []
    problems = spec.check_response(operation, 200, JSON, body({**good, "project_id": "1"}))
    assert len(problems) == 1 and ".project_id" in problems[0]
    assert "Content-Type" in spec.check_response(operation, 200, {"content-type": "text/html"}, body(good))[0]


def test_rejects_a_body_on_a_status_that_declares_none_and_bad_header_values(spec):
    operation, _ = spec.match("POST", "/api/v2.0/projects")
    assert "declares no body" in spec.check_response(operation, 201, JSON, body({"id": 1}))[0]
    listing, _ = spec.match("GET", "/api/v2.0/projects")
    assert "X-Total-Count" in spec.check_response(listing, 200, {**JSON, "x-total-count": "many"}, b"[]")[0]


def test_the_stand_in_answers_an_invalid_request_400_and_records_it():
    standin = HarborStandIn(HarborSpec()).start()
    try:
        response = httpx.post(f"{standin.url}/api/v2.0/projects", auth=ADMIN,
                              json={"project_name": "paddle", "metadata": {"public": False}})
        assert response.status_code == 400
        assert ".metadata.public" in response.json()["errors"][0]["message"]
        assert standin.project("paddle") is None
        assert len(standin.violations) == 1 and ".metadata.public" in standin.violations[0]
        httpx.get(f"{standin.url}/api/v2.0/nowhere", auth=ADMIN)
        assert len(standin.violations) == 2 and "no such path" in standin.violations[1]
    finally:
        standin.stop()


def test_gc_parameters_may_hold_booleans_but_the_schedule_stays_closed(spec):
    # LOOSE_VALUES: Harbor's GC handler reads booleans from Schedule.parameters, which its description types as objects.
    manual = {"schedule": {"type": "Manual"}, "parameters": {"dry_run": True, "delete_untagged": False}}
    assert spec.definition_errors("Schedule", manual, request=True) == []
    assert spec.definition_errors("Schedule", {**manual, "parameters": [True]}, request=True) != []
    assert spec.definition_errors("Schedule", {**manual, "dry_run": True}, request=True) != []
    assert spec.definition_errors("Schedule", {"schedule": {"type": "Now"}}, request=True) != []
    assert spec.definition_errors("Schedule", {**manual, "id": 3}, request=True) != []  # read-only
