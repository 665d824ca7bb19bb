"""Status conditions computed from observed Deployments, and the checks no schema can make."""

from __future__ import annotations

import pytest

from splitserve.operator.checks import InvalidSpecError, check_spec
from splitserve.operator.settings import AutoscalingDefaults, OperatorSettings, PoolDefaults
from splitserve.operator.spec import parse_spec
from splitserve.operator.status import (
    PoolObservation,
    blocked_status,
    build_status,
    is_ready,
    observe_workload,
    pool_condition,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
URL = "http://svc.ns.svc:8000"


def deployment(replicas: int, ready: int | None, generation: int = 2, observed: int | None = 2) -> dict:
    status = {"observedGeneration": observed} if observed is not None else {}
    if ready is not None:
        status["readyReplicas"] = ready
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas}, "status": status}


@pytest.mark.parametrize(
    "live,expected",
    [
        (None, PoolObservation(exists=False)),
        (deployment(3, 2), PoolObservation(exists=True, desired=3, ready=2, rolled_out=True)),
        (deployment(3, None, observed=None), PoolObservation(exists=True, desired=3, ready=0, rolled_out=False)),
        (
            deployment(1, 1, generation=3, observed=2),
            PoolObservation(exists=True, desired=1, ready=1, rolled_out=False),
        ),
    ],
)
def test_observe_workload(live, expected):
    assert observe_workload(live) == expected


@pytest.mark.parametrize(
    "obs,expected",
    [
        (None, (True, "NotRequired")),
        (PoolObservation(exists=False), (False, "Creating")),
        (PoolObservation(True, 2, 2, rolled_out=False), (False, "RollingOut")),
        (PoolObservation(True, 0, 0, True), (True, "ScaledToZero")),
        (PoolObservation(True, 4, 3, True), (False, "PodsNotReady")),
        (PoolObservation(True, 4, 4, True), (True, "Ready")),
    ],
)
def test_pool_condition(obs, expected):
    assert pool_condition("decode", obs)[:2] == expected


def test_status_conditions_replicas_and_transition_times():
    obs = {
        "prefill": PoolObservation(True, 2, 2, True),
        "decode": PoolObservation(True, 4, 1, True),
        "router": PoolObservation(True, 1, 1, True),
    }
    first = build_status(obs, 7, URL, None, T0)
    assert first["observedGeneration"] == 7 and first["url"] == URL
    assert first["prefill"] == {"replicas": 2, "readyReplicas": 2, "ready": "2/2"}
    assert first["decode"] == {"replicas": 4, "readyReplicas": 1, "ready": "1/4"}
    assert [(c["type"], c["status"], c["reason"]) for c in first["conditions"]] == [
        ("Ready", "False", "ComponentsNotReady"),
        ("PrefillReady", "True", "Ready"),
        ("DecodeReady", "False", "PodsNotReady"),
        ("RouterReady", "True", "Ready"),
    ]
    assert first["conditions"][0]["message"] == "decode: 1 of 4 decode replicas are ready"
    assert all(c["observedGeneration"] == 7 and c["lastTransitionTime"] == T0 for c in first["conditions"])
    assert not is_ready(first)

    obs["decode"] = PoolObservation(True, 4, 4, True)
    second = build_status(obs, 7, URL, first, T1)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times == {"Ready": T1, "PrefillReady": T0, "DecodeReady": T1, "RouterReady": T0}
    assert is_ready(second)
    assert build_status(obs, 7, URL, second, "2027-01-01T00:00:00Z") == second  # nothing flipped: same status


def test_no_prefill_pool_is_ready_and_has_no_prefill_counts():
    status = build_status(
        {"prefill": None, "decode": PoolObservation(True, 1, 1, True), "router": PoolObservation(True, 1, 1, True)},
        1,
        URL,
        None,
        T0,
    )
    assert "prefill" not in status and is_ready(status)
    assert status["conditions"][1]["reason"] == "NotRequired"


def test_blocked_status_keeps_the_last_observation():
    good = build_status(
        {"prefill": None, "decode": PoolObservation(True, 1, 1, True), "router": PoolObservation(True, 1, 1, True)},
        1,
        URL,
        None,
        T0,
    )
    blocked = blocked_status("InvalidSpec", "bad", 2, good, T1)
    assert blocked["observedGeneration"] == 2 and blocked["url"] == URL and blocked["decode"] == good["decode"]
    assert blocked["conditions"][0] == {
        "type": "Ready",
        "status": "False",
        "reason": "InvalidSpec",
        "message": "bad",
        "observedGeneration": 2,
        "lastTransitionTime": T1,
    }
    assert [c["type"] for c in blocked["conditions"]] == ["Ready", "PrefillReady", "DecodeReady", "RouterReady"]


@pytest.mark.parametrize(
    "name,spec,settings,message",
    [
        (
            "a" * 56,
            {},
            None,
            "metadata.name 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa' has 56 characters; at most 55",
        ),
        ("llama.v3", {}, None, "metadata.name 'llama.v3' must be a DNS-1035 label"),
        ("3b", {}, None, "metadata.name '3b' must be a DNS-1035 label"),
        (
            "svc",
            {"decode": {"resources": {"limits": {"memory": "1Gi"}}}},
            None,
            "engine.kvCacheMemoryGiB=1.0 plus 0.25 GiB for weights and runtime needs 1.25 GiB but "
            "decode.resources.limits.memory is 1Gi (1.00 GiB): raise the memory limit or lower kvCacheMemoryGiB",
        ),
        (
            "svc",
            {"decode": {"autoscaling": {"enabled": True, "maxReplicas": 2}}},
            OperatorSettings(autoscaling=AutoscalingDefaults(decode=PoolDefaults(min_replicas=3))),
            "decode.autoscaling: minReplicas 3 exceeds maxReplicas 2 (after the chart's defaults)",
        ),
        (
            "svc",
            {"prefill": {"autoscaling": {"enabled": True, "provider": "hpa"}}},
            OperatorSettings(autoscaling=AutoscalingDefaults(prefill=PoolDefaults(min_replicas=0))),
            "prefill.autoscaling: an HPA cannot scale to zero (minReplicas 0)",
        ),
        (
            "svc",
            {"prefill": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
            None,
            "prefill.resources must not name nvidia.com/gpu: set prefill.gpus instead",
        ),
    ],
)
def test_checks_beyond_the_schema(name, spec, settings, message):
    parsed = parse_spec({"model": {"uri": "m"}, "engine": {"kvCacheMemoryGiB": 1.0}, **spec})
    with pytest.raises(InvalidSpecError) as err:
        check_spec(parsed, name, settings or OperatorSettings())
    assert str(err.value).startswith(message)


def test_checks_pass_for_gpu_pools_and_fitting_memory():
    parsed = parse_spec(
        {
            "model": {"uri": "m"},
            "engine": {"kvCacheMemoryGiB": 40},
            "decode": {"gpus": 1, "resources": {"limits": {"memory": "16Gi"}}},
            "prefill": {"resources": {"limits": {"memory": "41Gi"}}},
        }
    )
    check_spec(parsed, "a" * 55, OperatorSettings())  # GPU KV memory is not host memory; 41 >= 40.25 GiB
