"""Harbor's Swagger 2.0 description as a validator of requests and responses.

The stand-in (server.py) passes every request it receives and every response it sends through
`HarborSpec`, so a client that drifts from Harbor's API (a misspelt field, a query parameter
Harbor does not know, a wrong type) fails its test instead of passing against a lenient double.

Swagger 2.0 schema objects are a subset of JSON Schema draft 4, so the definitions are
converted once and checked with jsonschema's Draft4Validator. The conversion:
- `x-nullable: true` lets the value be null as well (go-swagger serialises nil pointers so);
- `readOnly` properties may appear in responses but not in requests (Swagger 2.0's rule);
- objects that list `properties` and say nothing about others are closed in both directions:
  Harbor ignores unknown fields silently, which is exactly the drift these tests must catch;
- vendor extensions (`x-...`) and `example` are dropped.
Parameters (path, query, header) are checked by type, format, bounds and enum; a query
parameter the operation does not declare is a violation too.
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import jsonschema
import yaml

SPEC_PATH = Path(__file__).resolve().parent.parent / "fixtures" / "harbor" / "harbor-api-v2.0-swagger.yaml"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch")

# Harbor's middleware answers 401 (no or wrong credentials) and 403 (not allowed) before an
# operation's handler runs, so every operation can send them, declared or not (ListRobot and
# headProject, for instance, do not declare them). Their body is still Harbor's Errors shape.
MIDDLEWARE_STATUSES = {401, 403}


# Where Harbor's description is narrower than Harbor itself, named with the reason; each loosened value
# may hold any JSON value, and nothing else about its definition changes.
LOOSE_VALUES = {
    ("Schedule", "parameters"): "go-swagger reads `additionalProperties: {type: object}` as interface{}, and "
                                "Harbor's GC handler wants booleans there (parameters[\"dry_run\"].(bool)), as its UI sends",
}


class SpecViolation(Exception):
    """A request or response that Harbor's API description does not allow."""


@dataclass(frozen=True)
class Operation:
    method: str
    template: str  # the spec's path, e.g. /projects/{project_name_or_id}
    operation_id: str
    parameters: tuple[dict[str, Any], ...]
    responses: Mapping[str, dict[str, Any]]
    produces: tuple[str, ...]

    def params_in(self, where: str) -> list[dict[str, Any]]:
        return [p for p in self.parameters if p["in"] == where]

    def body_param(self) -> dict[str, Any] | None:
        bodies = self.params_in("body")
        return bodies[0] if bodies else None


@dataclass
class _Route:
    template: str
    pattern: re.Pattern[str]
    names: list[str]
    literal_chars: int  # more literal text wins: /projects/x/summary before /projects/{id}
    operations: dict[str, Operation] = field(default_factory=dict)


class HarborSpec:
    """One loaded description; thread-safe for validation (it holds no state after loading)."""

    def __init__(self, path: Path = SPEC_PATH):
        with path.open("rb") as handle:
            loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
            self.document: dict[str, Any] = yaml.load(handle, Loader=loader)  # noqa: S506 -- a safe loader
        self.base_path: str = self.document.get("basePath", "")
        definitions = self.document["definitions"]
        for (name, prop) in LOOSE_VALUES:
            definitions[name]["properties"][prop]["additionalProperties"] = {}
        self._request_defs = {name: _convert(schema, request=True) for name, schema in definitions.items()}
        self._response_defs = {name: _convert(schema, request=False) for name, schema in definitions.items()}
        self._routes = self._build_routes()

    # -- routing -------------------------------------------------------------------------

    def _build_routes(self) -> list[_Route]:
        routes = []
        shared_params = self.document.get("parameters", {})
        shared_responses = self.document.get("responses", {})
        default_produces = tuple(self.document.get("produces", ()))
        for template, item in self.document["paths"].items():
            names = re.findall(r"\{([^}]+)\}", template)
            regex = "^" + re.sub(r"\\\{[^}]+\\\}", "([^/]+)", re.escape(template)) + "$"
            route = _Route(template, re.compile(regex), names, len(re.sub(r"\{[^}]+\}", "", template)))
            path_level = [self._resolve(p, shared_params) for p in item.get("parameters", [])]
            for method in METHODS:
                op = item.get(method)
                if op is None:
                    continue
                params = {(p["name"], p["in"]): p for p in path_level}
                for p in op.get("parameters", []):
                    p = self._resolve(p, shared_params)
                    params[(p["name"], p["in"])] = p
                responses = {str(code): self._resolve(r, shared_responses) for code, r in op["responses"].items()}
                route.operations[method.upper()] = Operation(
                    method.upper(), template, op.get("operationId", f"{method} {template}"),
                    tuple(params.values()), responses, tuple(op.get("produces", default_produces)))
            routes.append(route)
        routes.sort(key=lambda r: -r.literal_chars)
        return routes

    @staticmethod
    def _resolve(obj: dict[str, Any], table: Mapping[str, Any]) -> dict[str, Any]:
        ref = obj.get("$ref")
        if ref is None:
            return obj
        return dict(table[ref.rsplit("/", 1)[-1]])

    def match(self, method: str, raw_path: str) -> tuple[Operation, dict[str, str]]:
        """The operation serving METHOD RAW_PATH (still percent-encoded), and its path parameters.

        Segments are split before decoding, as Harbor's router does, so an encoded slash stays
        inside its parameter (repository names are sent encoded twice: a/b -> a%252Fb).
        """
        if not raw_path.startswith(self.base_path + "/"):
            raise SpecViolation(f"{method} {raw_path}: not under the API's base path {self.base_path}")
        rest = raw_path[len(self.base_path):]
        known_path = False
        for route in self._routes:
            found = route.pattern.match(rest)
            if found is None:
                continue
            known_path = True
            operation = route.operations.get(method.upper())
            if operation is None:
                continue
            values = {name: unquote(value) for name, value in zip(route.names, found.groups())}
            return operation, values
        if known_path:
            raise SpecViolation(f"{method} {raw_path}: the API has this path but no {method} operation on it")
        raise SpecViolation(f"{method} {raw_path}: no such path in Harbor's API")

    # -- requests ------------------------------------------------------------------------

    def check_request(self, operation: Operation, path_params: Mapping[str, str],
                      query: Mapping[str, list[str]], headers: Mapping[str, str], body: bytes) -> list[str]:
        """Every way the request breaks the operation's description; empty when it is valid."""
        where = f"{operation.operation_id} ({operation.method} {operation.template})"
        problems: list[str] = []
        for param in operation.params_in("path"):
            problems += _check_value(param, path_params.get(param["name"]), "path parameter")
        declared_query = {p["name"] for p in operation.params_in("query")}
        for name in query:
            if name not in declared_query:
                problems.append(f"query parameter {name!r} is not declared (declared: {sorted(declared_query)})")
        for param in operation.params_in("query"):
            values = query.get(param["name"])
            if values is not None and len(values) > 1 and param.get("type") != "array":
                problems.append(f"query parameter {param['name']!r} given {len(values)} times")
            problems += _check_value(param, values[0] if values else None, "query parameter")
        lower_headers = {k.lower(): v for k, v in headers.items()}
        for param in operation.params_in("header"):
            problems += _check_value(param, lower_headers.get(param["name"].lower()), "header")
        body_param = operation.body_param()
        if body_param is None:
            if body:
                problems.append("the operation takes no request body, but one was sent")
        else:
            problems += self._check_body(body_param, lower_headers.get("content-type"), body)
        return [f"{where}: {p}" for p in problems]

    def _check_body(self, param: dict[str, Any], content_type: str | None, body: bytes) -> list[str]:
        if not body:
            return ["request body is required"] if param.get("required") else []
        media = (content_type or "").split(";")[0].strip().lower()
        consumes = [c.lower() for c in self.document.get("consumes", ["application/json"])]
        if media not in consumes:
            return [f"request Content-Type {content_type!r} is not one the API consumes ({consumes})"]
        try:
            value = json.loads(body)
        except ValueError as err:
            return [f"request body is not JSON: {err}"]
        return [f"request body{_where(e)}: {e.message}" for e in self._schema_errors(param["schema"], value, True)]

    # -- responses -----------------------------------------------------------------------

    def check_response(self, operation: Operation, status: int, headers: Mapping[str, str],
                       body: bytes) -> list[str]:
        where = f"{operation.operation_id} ({operation.method} {operation.template})"
        response = operation.responses.get(str(status))
        if response is None:
            if status in MIDDLEWARE_STATUSES:
                response = self.document["responses"][str(status)]
            else:
                return [f"{where}: status {status} is not declared (declared: {sorted(operation.responses)})"]
        problems: list[str] = []
        lower_headers = {k.lower(): v for k, v in headers.items()}
        for name, spec in (response.get("headers") or {}).items():
            value = lower_headers.get(name.lower())
            if value is not None:
                problems += _check_value({**spec, "name": name}, value, "response header")
        schema = response.get("schema")
        if schema is None:
            if body:
                problems.append(f"status {status} declares no body, but one was sent")
        elif operation.method != "HEAD":
            media = lower_headers.get("content-type", "").split(";")[0].strip()
            if media not in operation.produces:
                problems.append(f"response Content-Type {media!r} is not one the operation produces "
                                f"({list(operation.produces)})")
            elif media == "application/json":
                try:
                    value = json.loads(body)
                except ValueError as err:
                    problems.append(f"response body is not JSON: {err}")
                else:
                    problems += [f"response {status} body{_where(e)}: {e.message}"
                                 for e in self._schema_errors(schema, value, False)]
        return [f"{where}: {p}" for p in problems]

    # -- schemas -------------------------------------------------------------------------

    def _schema_errors(self, schema: dict[str, Any], value: Any, request: bool) -> list[jsonschema.ValidationError]:
        definitions = self._request_defs if request else self._response_defs
        root = {**_convert(schema, request=request), "definitions": definitions}
        validator = jsonschema.Draft4Validator(root, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)
        return sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))

    def definition_errors(self, name: str, value: Any, *, request: bool) -> list[str]:
        """Check VALUE against one named definition (for the validator's own tests)."""
        errors = self._schema_errors({"$ref": f"#/definitions/{name}"}, value, request)
        return [f"{name}{_where(e)}: {e.message}" for e in errors]


def _where(error: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return f" {path}" if path else ""


def _convert(schema: Any, *, request: bool) -> Any:
    """A Swagger 2.0 schema object as a draft-4 schema (see the module's docstring)."""
    if isinstance(schema, list):
        return [_convert(s, request=request) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-") or key in ("example", "readOnly", "discriminator", "description"):
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, request=request) for name, sub in value.items()
                        if not (request and isinstance(sub, dict) and sub.get("readOnly"))}
            if request:
                for name, sub in value.items():
                    if isinstance(sub, dict) and sub.get("readOnly"):
                        out[key][name] = {"not": {}}  # read-only: a response may hold it, a request may not
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = _convert(value, request=request)
        elif key == "items":
            out[key] = _convert(value, request=request)
        elif key == "format" and value in ("int", "int32", "int64", "uuid", "password", "binary", "byte"):
            continue  # only date-time is worth checking; the integer widths are Go's business
        else:
            out[key] = copy.deepcopy(value)
    if "$ref" in out:
        # draft 4 ignores a $ref's siblings; Swagger adds only descriptions and x-nullable there
        ref = {"$ref": out["$ref"]}
        return {"anyOf": [ref, {"type": "null"}]} if schema.get("x-nullable") else ref
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if schema.get("x-nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    return out


def _check_value(param: Mapping[str, Any], raw: str | None, kind: str) -> list[str]:
    """A path/query/header value (always text on the wire) against its parameter's description."""
    name = param["name"]
    if raw is None:
        return [f"{kind} {name!r} is required"] if param.get("required") else []
    kind_type = param.get("type", "string")
    value: Any = raw
    if kind_type == "integer":
        if not re.fullmatch(r"-?[0-9]+", raw):
            return [f"{kind} {name!r}: {raw!r} is not an integer"]
        value = int(raw)
    elif kind_type == "number":
        try:
            value = float(raw)
        except ValueError:
            return [f"{kind} {name!r}: {raw!r} is not a number"]
    elif kind_type == "boolean":
        if raw not in ("true", "false"):
            return [f"{kind} {name!r}: {raw!r} is not a boolean (true or false)"]
        value = raw == "true"
    problems = []
    if "enum" in param and value not in param["enum"]:
        problems.append(f"{kind} {name!r}: {raw!r} is not one of {param['enum']}")
    if "maximum" in param and isinstance(value, (int, float)) and value > param["maximum"]:
        problems.append(f"{kind} {name!r}: {value} is above the maximum {param['maximum']}")
    if "minimum" in param and isinstance(value, (int, float)) and value < param["minimum"]:
        problems.append(f"{kind} {name!r}: {value} is below the minimum {param['minimum']}")
    if isinstance(value, str):
        if "minLength" in param and len(value) < param["minLength"]:
            problems.append(f"{kind} {name!r}: shorter than {param['minLength']} characters")
        if "maxLength" in param and len(value) > param["maxLength"]:
            problems.append(f"{kind} {name!r}: longer than {param['maxLength']} characters")
    return problems
