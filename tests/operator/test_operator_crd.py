"""The InferenceService CRD: generated from the spec model, committed without drift, structural,
and admitting exactly the specs it should (API-server admission emulated by opkit_schemas:
defaulting, strict OpenAPI validation, CEL rules evaluated with cel-python)."""

from __future__ import annotations

import pathlib

import celpy
import pytest
import yaml
from opkit_schemas import admit, validate_manifest

from splitserve.operator.crd import CRD_FILE, crd_manifest, crd_yaml
from splitserve.operator.spec import parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "helm" / "splitserve" / "crds" / CRD_FILE
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def isvc(spec: dict, name: str = "svc") -> dict:
    return {
        "apiVersion": "serving.splitserve.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def test_committed_crd_is_the_generated_one():
    assert COMMITTED.read_text() == crd_yaml(), (
        "helm/splitserve/crds drifted from operator/spec.py: run "
        f"`splitserve operator --print-crd > helm/splitserve/crds/{CRD_FILE}`"
    )


def test_crd_is_a_valid_kubernetes_object():
    validate_manifest(yaml.safe_load(COMMITTED.read_text()))


def _walk(node: dict, where: str = "$"):
    yield where, node
    for key, child in node.get("properties", {}).items():
        yield from _walk(child, f"{where}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _walk(node[key], f"{where}.{key}")


def test_schema_is_structural():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for where, node in _walk(schema):
        assert "$ref" not in node and "$defs" not in node, where
        assert "title" not in node, where
        assert not ("properties" in node and "additionalProperties" in node), where
        if not node.get("x-kubernetes-int-or-string"):
            assert node.get("type") in ("object", "array", "string", "integer", "number", "boolean"), where
        if node.get("type") == "object" and "properties" not in node and where != "$.metadata":
            assert "additionalProperties" in node or node.get("x-kubernetes-preserve-unknown-fields"), where


def test_every_cel_rule_compiles_and_has_a_message():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [r for _, node in _walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len({r["rule"] for r in rules}) == 15  # some repeat: prefill and decode share PoolSpec
    env = celpy.Environment()
    for r in rules:
        env.compile(r["rule"])
        assert r["message"]


def test_crd_shape():
    crd = crd_manifest()
    version = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "inferenceservices.serving.splitserve.io"
    assert (crd["spec"]["group"], version["name"], crd["spec"]["scope"]) == (
        "serving.splitserve.io",
        "v1alpha1",
        "Namespaced",
    )
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Model",
        "Prefill",
        "Decode",
        "Ready",
        "URL",
        "Age",
    ]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert set(status) == {"observedGeneration", "url", "prefill", "decode", "router", "conditions"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_and_parse(path):
    obj = yaml.safe_load(path.read_text())
    stored, errors = admit(obj)
    assert errors == []
    parse_spec(stored["spec"])  # what the operator reads after the API server defaulted it


def test_defaults_are_filled_by_the_schema():
    stored, errors = admit(isvc({"model": {"uri": "smollm2-135m"}}))
    assert errors == []
    spec = stored["spec"]
    assert spec["engine"] == {"blockSize": 16, "maxNumSeqs": 64, "kvCacheMemoryGiB": 0.5}
    assert spec["decode"]["replicas"] == 1 and spec["decode"]["terminationGracePeriodSeconds"] == 120
    assert spec["disaggregation"] == {"mode": "conditional", "minPrefillTokens": 256}
    assert spec["kvTransfer"] == {"transport": "ucx"}
    assert spec["decode"]["autoscaling"] == {}  # no defaults: the chart's values apply
    assert spec["kvCache"] == {}  # no defaults either: the chart's kvCache values apply
    assert spec["router"]["scorerWeights"] == {
        "prefix": 3.0,
        "queue": 2.0,
        "kvUsage": 2.0,
        "pending": 1.0,
        "lora": 2.0,
        "cacheRoom": 0.5,
    }
    # The operator's model sees the same defaults as the API server stored.
    assert parse_spec(stored["spec"]) == parse_spec({"model": {"uri": "smollm2-135m"}})


INVALID = [
    (
        {"model": {"uri": "m"}, "speculative": {"promptLookupMin": 5, "promptLookupMax": 3}},
        "spec.speculative: speculative.promptLookupMin must be at most promptLookupMax",
    ),
    (
        {"model": {"uri": "m"}, "speculative": {"numSpeculativeTokens": 0}},
        "spec.speculative.numSpeculativeTokens: 0 is less than the minimum of 1",
    ),
    (
        {"model": {"uri": "m"}, "speculative": {"method": "eagle"}},
        "spec.speculative.method: 'eagle' is not one of ['ngram']",
    ),
    ({"model": {}}, "spec.model: 'uri' is a required property"),
    (
        {"model": {"uri": "m", "dtype": "int8"}},
        "spec.model.dtype: 'int8' is not one of ['float32', 'bfloat16', 'float16']",
    ),
    (
        {"model": {"uri": "m"}, "engine": {"blockSize": 24}},
        "spec.engine.blockSize: 24 is not one of [8, 16, 32, 64, 128]",
    ),
    (
        {"model": {"uri": "m"}, "engine": {"kvCacheMemoryGiB": 0}},
        "spec.engine.kvCacheMemoryGiB: 0 is less than or equal to the minimum of 0",
    ),
    (
        {"model": {"uri": "m"}, "decode": {"replica": 2}},
        "spec.decode: Additional properties are not allowed ('replica' was unexpected)",
    ),
    (
        {"model": {"uri": "m"}, "decode": {"resources": {"limits": {"memory": "2 GB"}}}},
        "spec.decode.resources.limits.memory: '2 GB' does not match",
    ),
    (
        {"model": {"uri": "m"}, "router": {"replicas": 2, "redis": {"url": "http://redis:6379"}}},
        "spec.router.redis.url: 'http://redis:6379' does not match '^rediss?://[^@]+$'",
    ),
    (
        {"model": {"uri": "m"}, "decode": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
        "spec.decode.autoscaling: autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
    ),
    (
        {"model": {"uri": "m"}, "prefill": {"autoscaling": {"provider": "hpa", "minReplicas": 0}}},
        "spec.prefill.autoscaling: autoscaling.minReplicas 0 (scale to zero) needs provider keda",
    ),
    (
        {"model": {"uri": "m"}, "router": {"replicas": 3}},
        "spec.router: router.redis is required when router.replicas > 1",
    ),
    (
        {"model": {"uri": "m"}, "kvTransfer": {"transport": "tcp", "ucx": {"tls": "tcp"}}},
        "spec.kvTransfer: kvTransfer.ucx applies only to transport ucx",
    ),
    (
        {"model": {"uri": "m"}, "disaggregation": {"mode": "always"}, "prefill": {"replicas": 0}},
        "spec: disaggregation.mode always needs a prefill pool",
    ),
    (
        {"model": {"uri": "m"}, "decode": {"replicas": 0}},
        "spec: decode.replicas must be at least 1 unless an autoscaler owns the pool",
    ),
    (
        {"model": {"uri": "m"}, "decode": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]}},
        "spec.decode.env[0]: env: set value or valueFrom, not both",
    ),
    (
        {"model": {"uri": "m"}, "adapters": [{"name": "sql", "uri": "adapters/sql"}]},
        "spec.adapters.0.uri: 'adapters/sql' does not match '^/'",
    ),
    (
        {"model": {"uri": "m"}, "adapters": [{"name": "has space", "uri": "/a"}]},
        "spec.adapters.0.name: 'has space' does not match",
    ),
]


@pytest.mark.parametrize("spec,message", INVALID, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(INVALID)])
def test_invalid_specs_are_rejected_with_their_message(spec, message):
    _, errors = admit(isvc(spec))
    assert len(errors) == 1, errors
    assert errors[0].startswith(message), errors


def test_valid_edge_cases_are_admitted():
    for spec in [
        {
            "model": {"uri": "m"},
            "disaggregation": {"mode": "always"},
            "prefill": {"replicas": 0, "autoscaling": {"enabled": True}},
        },
        {
            "model": {"uri": "m"},
            "decode": {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "provider": "keda"}},
        },
        {"model": {"uri": "m"}, "router": {"replicas": 3, "redis": {"url": "rediss://r:6380/1"}}},
        {"model": {"uri": "m"}, "decode": {"resources": {"limits": {"memory": "1.5Gi", "cpu": 2}}}},
    ]:
        assert admit(isvc(spec))[1] == [], spec


@pytest.mark.parametrize(
    "kv_cache, message",
    [
        ({"tierGiB": -1}, "spec.kvCache.tierGiB: -1 is less than the minimum of 0"),
        ({"maxPullBlocks": 0}, "spec.kvCache.maxPullBlocks: 0 is less than the minimum of 1"),
        ({"tierMedium": "ssd"}, "spec.kvCache.tierMedium: 'ssd' is not one of ['disk', 'memory']"),
    ],
)
def test_kv_cache_spec_is_validated(kv_cache, message):
    _, errors = admit(isvc({"model": {"uri": "m"}, "kvCache": kv_cache}))
    assert len(errors) == 1 and errors[0].startswith(message), errors
