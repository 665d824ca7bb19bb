"""Validators for the operator tests: Kubernetes' own schemas, the CRD's schema, and the CRDs of
KEDA and the Prometheus operator.

- Built-in kinds: `kubernetes-validate`'s JSON schemas of Kubernetes 1.31, strict (unknown
  fields are errors, as with `kubectl apply --validate=strict`).
- KEDA's ScaledObject and the Prometheus operator's ServiceMonitor and PrometheusRule have no
  schema on this machine; SUBSET_SCHEMAS below are the parts of keda.sh/v1alpha1 ScaledObject and
  monitoring.coreos.com/v1 ServiceMonitor and PrometheusRule that the operator and chart use, with upstream's field
  names and types (trigger metadata values are strings, replica counts int32), and closed:
  any field not listed is an error.
- An InferenceService is admitted the way the API server would: structural defaulting from
  the CRD's schema, OpenAPI validation with unknown fields rejected, then every
  `x-kubernetes-validations` CEL rule evaluated (with cel-python) on the defaulted object.
"""

from __future__ import annotations

import copy
from functools import cache, lru_cache
from typing import Any

import celpy
import jsonschema
import kubernetes_validate

from splitserve.operator.crd import crd_manifest

K8S_VERSION = "1.31"
INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
META = {"type": "object", "required": ["name", "namespace"]}


def _closed(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": required}


SUBSET_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): _closed(
        {
            "apiVersion": {"const": "keda.sh/v1alpha1"},
            "kind": {"const": "ScaledObject"},
            "metadata": META,
            "spec": _closed(
                {
                    "scaleTargetRef": _closed(
                        {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"}},
                        ["name"],
                    ),
                    "pollingInterval": INT32,
                    "cooldownPeriod": INT32,
                    "minReplicaCount": INT32,
                    "maxReplicaCount": INT32,
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": _closed(
                            {
                                "type": {"type": "string"},
                                "name": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            },
                            ["type", "metadata"],
                        ),
                    },
                },
                ["scaleTargetRef", "triggers"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    ("cert-manager.io/v1", "Certificate"): _closed(
        {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": "Certificate"},
            "metadata": META,
            "spec": _closed(
                {
                    "secretName": {"type": "string"},
                    "commonName": {"type": "string", "maxLength": 64},
                    "dnsNames": {"type": "array", "items": {"type": "string"}},
                    "usages": {
                        "type": "array",
                        "items": {"enum": ["server auth", "client auth", "digital signature", "key encipherment"]},
                    },
                    "duration": {"type": "string"},
                    "renewBefore": {"type": "string"},
                    "privateKey": _closed(
                        {
                            "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                            "size": {"type": "integer"},
                            "rotationPolicy": {"enum": ["Never", "Always"]},
                        },
                        [],
                    ),
                    "issuerRef": _closed(
                        {"name": {"type": "string"}, "kind": {"type": "string"}, "group": {"type": "string"}}, ["name"]
                    ),
                },
                ["secretName", "issuerRef"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _closed(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": META,
            "spec": _closed(
                {
                    "selector": LABEL_SELECTOR,
                    "namespaceSelector": _closed(
                        {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}, []
                    ),
                    "endpoints": {
                        "type": "array",
                        "items": _closed(
                            {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": {
                                    "type": "string",
                                    "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                                },
                            },
                            [],
                        ),
                    },
                },
                ["selector", "endpoints"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _closed(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": META,
            "spec": _closed(
                {
                    "groups": {
                        "type": "array",
                        "items": _closed(
                            {
                                "name": {"type": "string", "minLength": 1},
                                "interval": {"type": "string"},
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["expr"],
                                        "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                                        "properties": {
                                            "record": {"type": "string"},
                                            "alert": {"type": "string"},
                                            "expr": {"type": "string", "minLength": 1},
                                            "for": {
                                                "type": "string",
                                                "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?)$",
                                            },
                                            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                            "annotations": {
                                                "type": "object",
                                                "additionalProperties": {"type": "string"},
                                            },
                                        },
                                    },
                                },
                            },
                            ["name", "rules"],
                        ),
                    }
                },
                ["groups"],
            ),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    ),
}


# Upstream CRDs shipped as test data (tests/operator/schemas/): GIE's InferencePool and the
# Gateway API's HTTPRoute (standard channel), and the LeaderWorkerSet's (its pod templates
# cut down to their shape: each is validated as a core/v1 PodTemplateSpec instead, see
# pod_template_errors). Their objects are admitted as an API server would (defaults, closed
# schema, CEL rules), as the InferenceService is below.
CRD_FILES = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
}


@cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    import pathlib

    import yaml

    crd = yaml.safe_load((pathlib.Path(__file__).parent / "schemas" / CRD_FILES[(api_version, kind)]).read_text())
    version = api_version.rpartition("/")[2]
    return next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def crd_errors(manifest: dict[str, Any]) -> list[str]:
    """Why the API server would refuse `manifest` under its shipped CRD (empty: accepted)."""
    schema = crd_schema(manifest["apiVersion"], manifest["kind"])
    stored = apply_defaults(schema, copy.deepcopy(manifest))
    validator = jsonschema.Draft4Validator(_closed_schema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(stored)]
    errors = errors or cel_errors(schema["properties"]["spec"], stored["spec"], "spec")
    if manifest["kind"] == "LeaderWorkerSet":
        errors += pod_template_errors(manifest)
    return errors


def pod_template_errors(lws: dict[str, Any]) -> list[str]:
    """A LeaderWorkerSet's leader and worker templates, each checked strictly as a core/v1 PodTemplateSpec (the type
    upstream's CRD inlines) by wrapping it in a PodTemplate object."""
    errors = []
    templates = lws["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key not in templates:
            continue
        wrapper = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": lws["metadata"]["name"], "namespace": lws["metadata"]["namespace"]},
            "template": templates[key],
        }
        try:
            kubernetes_validate.validate(wrapper, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"spec.leaderWorkerTemplate.{key}: {exc}")
    return errors


def validate_manifest(manifest: dict[str, Any]) -> None:
    """Raise if `manifest` is not a valid object of its kind (see the module doc)."""
    if (manifest["apiVersion"], manifest["kind"]) in CRD_FILES:
        errors = crd_errors(manifest)
        if errors:
            raise jsonschema.ValidationError("; ".join(errors))
        return
    subset = SUBSET_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    if subset is not None:
        jsonschema.Draft202012Validator(subset).validate(manifest)
    else:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


# --- the InferenceService CRD -------------------------------------------------------------


def _closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every object that lists its properties closed to other fields."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        stack += list(node.get("properties", {}).values())
        stack += [node[k] for k in ("items", "additionalProperties") if isinstance(node.get(k), dict)]
    return out


@lru_cache(maxsize=1)
def isvc_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill absent properties that have a default, recursively."""
    if isinstance(value, dict) and "properties" in schema:
        for key, prop in schema["properties"].items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                value[key] = apply_defaults(prop, value[key])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key in value:
            value[key] = apply_defaults(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and "items" in schema:
        value[:] = [apply_defaults(schema["items"], v) for v in value]
    return value


def cel_errors(schema: dict[str, Any], value: Any, where: str = "") -> list[str]:
    """Messages of the x-kubernetes-validations rules that `value` breaks, as `<path>: <message>`."""
    errors = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        result = env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(value)})
        if not bool(result):
            errors.append(f"{where or '<root>'}: {rule['message']}")
    if isinstance(value, dict) and "properties" in schema:
        for key, prop in schema["properties"].items():
            if key in value:
                errors += cel_errors(prop, value[key], f"{where}.{key}" if where else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{where}[{i}]")
    return errors


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What the API server would store for `obj`, and its rejection messages (empty: accepted)."""
    schema = isvc_schema()
    stored = apply_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(_closed_schema(schema))
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(stored)]
    if errors:
        return stored, errors
    return stored, cel_errors(schema["properties"]["spec"], stored["spec"], "spec")
