"""A CRD version's openAPIV3Schema as a JSON Schema the `jsonschema` library can check against.

The API server prunes fields a structural schema does not name, unless the node says
`x-kubernetes-preserve-unknown-fields: true`. A pruned field is intent silently lost, so here
every object schema that lists properties and does not preserve unknown fields refuses others
(additionalProperties: false). Kubernetes' extensions become what they mean:
`x-kubernetes-int-or-string` an integer or a string, `nullable` null allowed,
`x-kubernetes-list-type: set` unique items. CEL rules (`x-kubernetes-validations`) are not
evaluated here; the admission controllers' own checks are what the e2e tests run.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import yaml

CRDS = Path(__file__).parent / "fixtures" / "crds"

# openAPIV3Schema keywords that mean the same in JSON Schema and are copied as they are.
_SAME = ("enum", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
         "maxLength", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "multipleOf")
# Keywords that only document or default, or that this check does not evaluate.
_IGNORED = ("description", "default", "example", "externalDocs", "format", "title", "x-kubernetes-validations",
            "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-embedded-resource")


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    for key, value in node.items():
        if key == "type":
            if not node.get("x-kubernetes-int-or-string"):
                out["type"] = [value, "null"] if node.get("nullable") else value
        elif key in _SAME:
            out[key] = value
        elif key == "properties":
            out["properties"] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out["items"] = to_json_schema(value)
        elif key == "additionalProperties":
            out["additionalProperties"] = value if isinstance(value, bool) else to_json_schema(value)
        elif key in ("oneOf", "anyOf", "allOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key == "not":
            out["not"] = to_json_schema(value)
        elif key == "required":
            out["required"] = list(value)
        elif key == "x-kubernetes-int-or-string":
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        elif key == "x-kubernetes-list-type":
            if value == "set":
                out["uniqueItems"] = True
        elif key in ("nullable", "x-kubernetes-preserve-unknown-fields") or key in _IGNORED:
            continue
        else:
            raise ValueError(f"openAPIV3Schema keyword {key!r} is not handled; teach tests/crd_schema.py")
    if "properties" in node and "additionalProperties" not in node and not preserve:
        out["additionalProperties"] = False
    return out


_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,  # nothing else belongs in a manifest's metadata
}


@functools.cache
def _crd(file: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the Kyverno CRD is 1.4 MB
    crd: dict[str, Any] = yaml.load((CRDS / file).read_text(), Loader=loader)
    return crd


@functools.cache
def _cached_schema(file: str, version: str) -> str:
    return json.dumps(_crd_schema(file, version))


def crd_schema(file: str, version: str) -> dict[str, Any]:
    """The JSON Schema of one served version of the CRD in tests/fixtures/crds/FILE (a fresh copy)."""
    loaded: dict[str, Any] = json.loads(_cached_schema(file, version))
    return loaded


def _crd_schema(file: str, version: str) -> dict[str, Any]:
    crd = _crd(file)
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            assert entry.get("served"), f"{file}: {version} is not served"
            schema = to_json_schema(entry["schema"]["openAPIV3Schema"])
            # The API server adds what every object has: apiVersion and kind (exactly this CRD
            # version here) and ObjectMeta, which no CRD describes.
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
            schema["properties"]["kind"] = {"const": kind}
            schema["properties"]["metadata"] = _OBJECT_META
            schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
            return schema
    raise AssertionError(f"{file} has no version {version}")
