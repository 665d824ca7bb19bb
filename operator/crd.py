"""Generate the InferenceService CRD from the pydantic models in spec.py and status.py.

pydantic emits JSON Schema (2020-12); a CRD wants a *structural* OpenAPI v3.0 schema. The
conversion walks the pydantic schema once:

- `$ref`s are inlined (a structural schema has no references); the field's own description
  wins over the referenced model's docstring;
- `Optional[X]` (`anyOf: [X, null]`) becomes X, and a `null` default is dropped: absent is
  how Kubernetes says "unset";
- a sub-object whose Python default is a model instance gets `default: {}`, so the API server
  fills its nested defaults (structural defaulting recurses into defaulted objects);
- `exclusiveMinimum: n` (2020-12) becomes `minimum: n, exclusiveMinimum: true` (OpenAPI 3.0);
- `dict[str, Any]` becomes an object with `x-kubernetes-preserve-unknown-fields`;
- `additionalProperties: false` and titles are dropped (not allowed beside `properties` /
  noise); unknown fields are pruned by the API server instead;
- a description is the docstring's prose: the line breaks of its source wrapping become spaces
  (a blank line still separates paragraphs), as `kubectl explain` wraps text itself.

The committed file under helm/splitserve/crds/ is this module's output; a test fails on drift.
Regenerate it with `splitserve operator --print-crd > helm/splitserve/crds/<file>`.
"""

from __future__ import annotations

from typing import Any

import yaml

from splitserve.operator import constants as C
from splitserve.operator.spec import InferenceServiceSpec
from splitserve.operator.status import InferenceServiceStatus

CRD_NAME = f"{C.PLURAL}.{C.API_GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
KEEP = (
    "description",
    "type",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "x-kubernetes-validations",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "anyOf",
)
HEADER = (
    "# Generated from operator/spec.py and operator/status.py by `splitserve operator --print-crd`.\n"
    "# Do not edit: change the models and regenerate (a test fails when this file drifts).\n"
)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = dict(defs[node["$ref"].split("/")[-1]])
        target.update({k: v for k, v in node.items() if k != "$ref"})
        return target
    branches = node.get("anyOf")
    if branches and any(b.get("type") == "null" for b in branches):
        rest = [b for b in branches if b.get("type") != "null"]
        merged = dict(_resolve(rest[0], defs)) if len(rest) == 1 else {"anyOf": rest}
        merged.update({k: v for k, v in node.items() if k != "anyOf" and not (k == "default" and v is None)})
        return merged
    return node


def _prose(text: str) -> str:
    """Join each paragraph's source lines into one line; paragraphs stay apart."""
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The structural-schema equivalent of one pydantic JSON-schema node."""
    node = _resolve(node, defs)
    if "enum" in node and "type" not in node:
        node = {**node, "type": "integer" if all(isinstance(v, int) for v in node["enum"]) else "string"}
    out = {k: node[k] for k in KEEP if k in node}
    if "description" in out:
        out["description"] = _prose(out["description"])
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if node.get("type") == "object":
        _object(node, out, defs)
    elif node.get("type") == "array":
        out["items"] = structural(node["items"], defs)
    return out


def _object(node: dict[str, Any], out: dict[str, Any], defs: dict[str, Any]) -> None:
    if "properties" in node:
        out["properties"] = {}
        for key, prop in node["properties"].items():
            child = structural(prop, defs)
            if child.get("default") in ({}, []) and "properties" not in child:
                del child["default"]  # an empty map or list: absent says the same
            elif child.get("type") == "object" and isinstance(child.get("default"), dict):
                child["default"] = {}
            out["properties"][key] = child
        if node.get("required"):
            out["required"] = list(node["required"])
    elif node.get("additionalProperties") in (True, None) or node.get("additionalProperties") == {}:
        out["x-kubernetes-preserve-unknown-fields"] = True
    else:
        out["additionalProperties"] = structural(node["additionalProperties"], defs)


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def printer_columns() -> list[dict[str, Any]]:
    col = lambda name, path, typ="string", **kw: {"name": name, "type": typ, "jsonPath": path, **kw}  # noqa: E731
    return [
        col("Model", ".spec.model.uri"),
        col("Prefill", ".status.prefill.ready", description="ready/desired prefill workers"),
        col("Decode", ".status.decode.ready", description="ready/desired decode workers"),
        col("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        col("URL", ".status.url"),
        col("Age", ".metadata.creationTimestamp", "date"),
    ]


def crd_manifest() -> dict[str, Any]:
    spec_schema = model_schema(InferenceServiceSpec)
    status_schema = model_schema(InferenceServiceStatus)
    root = {
        "type": "object",
        "description": spec_schema.pop("description", ""),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {C.LABEL_NAME: C.APP_NAME}},
        "spec": {
            "group": C.API_GROUP,
            "names": {
                "kind": C.KIND,
                "listKind": f"{C.KIND}List",
                "plural": C.PLURAL,
                "singular": C.SINGULAR,
                "shortNames": list(C.SHORT_NAMES),
                "categories": [C.APP_NAME],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": C.API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    return HEADER + yaml.dump(crd_manifest(), Dumper=_Dumper, sort_keys=False, width=120)
