"""Tensor-parallel and multi-node pools (spec.<pool>.tensorParallelSize and nodes): what the operator
renders, that it is valid, and what it does on a cluster.

Validity: every rendered object for tp in {1, 2, 8} x nodes in {1, 2} passes Kubernetes' own
schemas (kubernetes-validate, strict) or, for a LeaderWorkerSet, the LeaderWorkerSet CRD shipped in
tests/operator/schemas (admitted as the API server would: defaults, closed schema) with both pod
templates checked strictly as core/v1 PodTemplateSpecs. On a cluster: kmock's in-memory Kubernetes
API emulator (opkit_emulator; an emulator, not Kubernetes: no controllers run, the tests play the
LeaderWorkerSet controller by writing its status). Bad combinations end in the status condition
Ready=False/InvalidSpec with a message naming the numbers and the remedy, and, under kopf, in an
Event on the InferenceService."""

from __future__ import annotations

import re

import pytest
from k8s_controllers import endpoint_slice, group_pods
from opkit_emulator import ClusterThread
from opkit_kube import condition, create_isvc, isvc_body, mark_ready, wait_for
from opkit_schemas import admit, validate_manifest

from splitserve.operator import constants as C
from splitserve.operator import kube as K
from splitserve.operator.apply import patch_body
from splitserve.operator.checks import InvalidSpecError, check_spec
from splitserve.operator.context import Context
from splitserve.operator.reconcile import reconcile
from splitserve.operator.render import render
from splitserve.operator.render_pods import serving_template
from splitserve.operator.render_scaling import serving_pods
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.planner.kube import KubeClient, load_configuration
from splitserve.planner.plan_loop import ServicePlan

LWS = K.KIND_BY_NAME["LeaderWorkerSet"]
BASE = {"model": {"uri": "smollm2-135m"}, "kvTransfer": {"transport": "tcp"}}
COMBOS = [(tp, nodes) for tp in (1, 2, 8) for nodes in (1, 2)]
VALID = [(tp, nodes) for tp, nodes in COMBOS if tp % nodes == 0]  # one rank cannot span two pods: (1, 2) is refused


def pools(tp: int, nodes: int, gpus: bool = True, **extra) -> dict:
    pool = {"tensorParallelSize": tp, "nodes": nodes, "gpus": tp // nodes if gpus else 0, **extra}
    return {**BASE, "prefill": pool, "decode": pool}


def rendered(spec: dict, settings: OperatorSettings | None = None) -> dict[tuple[str, str], dict]:
    parsed = parse_spec(spec)
    check_spec(parsed, "svc", settings or OperatorSettings())
    return {(m["kind"], m["metadata"]["name"]): m for m in render(parsed, "svc", "llm", "uid-1", settings)}


def worker(workload: dict) -> dict:
    """The serving pod's worker container."""
    return serving_template(workload)["spec"]["containers"][0]


@pytest.mark.parametrize("tp,nodes", VALID)
@pytest.mark.parametrize("gateway", ["splitserve", "inferencePool"])
def test_every_rendered_object_is_valid(tp, nodes, gateway):
    spec = {**pools(tp, nodes, autoscaling={"enabled": True, "provider": "keda"}), "gateway": {"mode": gateway}}
    out = rendered(spec)
    for manifest in out.values():
        validate_manifest(manifest)  # core kinds strictly; LeaderWorkerSet by its CRD and PodTemplateSpecs
    kind = "LeaderWorkerSet" if nodes > 1 else "Deployment"
    name = "svc-decode-group" if nodes > 1 else "svc-decode"
    assert out["ScaledObject", "svc-decode"]["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1" if nodes > 1 else "apps/v1",
        "kind": kind,
        "name": name,
    }
    assert [k for k in out if k[0] in ("Deployment", "LeaderWorkerSet") and "decode" in k[1]] == [(kind, name)]


@pytest.mark.parametrize("tp,nodes", VALID)
def test_each_pod_gets_a_gpu_per_rank_shared_memory_and_the_tp_flags(tp, nodes):
    out = rendered(pools(tp, nodes))
    workload = out[("LeaderWorkerSet", "svc-prefill-group") if nodes > 1 else ("Deployment", "svc-prefill")]
    container = worker(workload)
    ranks = tp // nodes
    assert container["resources"]["limits"]["nvidia.com/gpu"] == ranks
    pod = serving_template(workload)["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{ranks}Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    args = container["args"]
    if tp == 1:
        assert "--tensor-parallel-size" not in args
    else:
        assert args[args.index("--tensor-parallel-size") + 1] == str(tp)
    if nodes == 1:
        assert "--nnodes" not in args
        return
    wanted = {
        "--nnodes": "2",
        "--node-rank": "$(LWS_WORKER_INDEX)",
        "--master-addr": "$(LWS_LEADER_ADDRESS)",
        "--master-port": "29500",
    }
    assert {flag: args[args.index(flag) + 1] for flag in wanted} == wanted


@pytest.mark.parametrize("tp,nodes", [(2, 1), (8, 2)])
def test_a_cpu_pool_runs_its_ranks_as_processes(tp, nodes):
    out = rendered(pools(tp, nodes, gpus=False))
    for manifest in out.values():
        validate_manifest(manifest)
    workload = out[("LeaderWorkerSet", "svc-decode-group") if nodes > 1 else ("Deployment", "svc-decode")]
    container = worker(workload)
    ranks = tp // nodes
    assert "nvidia.com/gpu" not in container["resources"]["limits"] and "--device" not in container["args"]
    assert container["resources"]["requests"]["cpu"] == str(ranks)  # a core per rank
    one_rank = worker(rendered(BASE)["Deployment", "svc-decode"])["resources"]
    extra_mib = int(container["resources"]["limits"]["memory"][:-2]) - int(one_rank["limits"]["memory"][:-2])
    assert extra_mib == (ranks - 1) * 1536  # 1.5 GiB per extra rank: its /dev/shm and a process's runtime


def test_a_multi_node_pool_is_a_leader_worker_set_whose_leaders_serve():
    out = rendered(pools(8, 2))
    assert ("Deployment", "svc-decode") not in out
    lws = out["LeaderWorkerSet", "svc-decode-group"]
    spec = lws["spec"]
    assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == (1, 2)
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    follower = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == follower["args"]  # one command; the node rank decides what a pod does
    assert "readinessProbe" in leader and "ports" in leader
    assert not {"readinessProbe", "livenessProbe", "startupProbe", "ports"} & set(follower)
    # The pool's Service selects the leaders only: the router sees one worker per group.
    service = out["Service", "svc-decode"]
    assert service["spec"]["selector"][C.LABEL_LWS_WORKER_INDEX] == "0"
    pods = group_pods(lws, [["10.0.0.1", "10.0.0.2"], ["10.0.1.1", "10.0.1.2"]])
    slice_ = endpoint_slice(service, pods)
    assert [e["addresses"] for e in slice_["endpoints"]] == [["10.0.0.1"], ["10.0.1.1"]]
    assert {p["name"]: p["port"] for p in slice_["ports"]}["grpc"] == C.GRPC_PORT
    # The ranks of a group reach each other on any port; the other policies stay as they were.
    ranks = out["NetworkPolicy", "svc-decode-ranks"]["spec"]
    assert ranks["podSelector"]["matchLabels"][C.LABEL_COMPONENT] == "decode"
    assert ranks["ingress"] == [{"from": [{"podSelector": ranks["podSelector"]}]}]  # no `ports`: every port


def test_the_inference_pool_and_the_sidecar_are_on_the_leaders_only():
    out = rendered({**pools(4, 2), "gateway": {"mode": "inferencePool"}})
    assert out["InferencePool", "svc"]["spec"]["selector"]["matchLabels"][C.LABEL_LWS_WORKER_INDEX] == "0"
    templates = out["LeaderWorkerSet", "svc-decode-group"]["spec"]["leaderWorkerTemplate"]
    assert [c["name"] for c in templates["leaderTemplate"]["spec"]["containers"]] == ["worker", "sidecar"]
    assert [c["name"] for c in templates["workerTemplate"]["spec"]["containers"]] == ["worker"]


def test_autoscalers_count_groups():
    spec = pools(4, 2, autoscaling={"enabled": True, "provider": "keda"})
    query = rendered(spec)["ScaledObject", "svc-prefill"]["spec"]["triggers"][0]["metadata"]["query"]
    regex = re.search(r'pod=~"([^"]+)"', query).group(1)
    names = {"svc-prefill-group-0": True, "svc-prefill-group-12": True, "svc-prefill-group-0-1": False}
    assert {n: bool(re.fullmatch(regex, n)) for n in names} == names  # Prometheus matches the whole name
    assert regex == serving_pods(_ctx(spec), "prefill")
    hpa = rendered(pools(4, 2, autoscaling={"enabled": True, "provider": "hpa"}))[
        "HorizontalPodAutoscaler", "svc-decode"
    ]
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    # An autoscaled set gets replicas only when created (apply.py leaves them to the autoscaler).
    lws = rendered(spec)["LeaderWorkerSet", "svc-decode-group"]
    assert "replicas" not in patch_body(lws)["spec"] and lws["spec"]["replicas"] == 1


def _ctx(spec):
    return Context(parse_spec(spec), "svc", "llm", "uid-1", OperatorSettings())


def test_the_planner_counts_a_group_as_one_replica():
    auto = {"enabled": True, "provider": "planner", "minReplicas": 1, "maxReplicas": 4}
    spec = {**pools(8, 2, autoscaling=auto), "slo": {"ttftP90Ms": 2000, "itlP90Ms": 100}}
    out = rendered(spec)
    plan = ServicePlan.from_configmap(out["ConfigMap", "svc-planner"])
    decode = plan.pool("decode")
    assert (decode.workload.kind, decode.workload.name) == ("LeaderWorkerSet", "svc-decode-group")
    assert (
        decode.workload.path("llm")
        == "/apis/leaderworkerset.x-k8s.io/v1/namespaces/llm/leaderworkersets/svc-decode-group"
    )
    lws = out["LeaderWorkerSet", "svc-decode-group"]
    terms = dict(t.split("=", 1) for t in decode.selector.split(","))
    pods = group_pods(lws, [["10.0.0.1", "10.0.0.2"], ["10.0.1.1", "10.0.1.2"]])
    counted = [
        p["metadata"]["name"] for p in pods if all(p["metadata"]["labels"].get(k) == v for k, v in terms.items())
    ]
    assert counted == ["svc-decode-group-0", "svc-decode-group-1"]


@pytest.mark.parametrize(
    "pool,message",
    [
        (
            {"tensorParallelSize": 6, "nodes": 4},
            "tensorParallelSize 6 is not divisible by nodes 4: each pod of a worker runs tensorParallelSize / nodes "
            "ranks; allowed nodes: 1, 2, 3, 6",
        ),
        (
            {"tensorParallelSize": 8, "nodes": 2, "gpus": 2},
            "decode.gpus is 2 but each pod runs 4 ranks (tensorParallelSize 8 / nodes 2) and every rank needs its "
            "own GPU: set it to 4 (or decode.gpus to 0 to run the ranks on CPU)",
        ),
        (
            {"tensorParallelSize": 4, "gpus": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}},
            "decode.resources nvidia.com/gpu is 2 but each pod runs 4 ranks (tensorParallelSize 4 / nodes 1)",
        ),
        (
            {
                "tensorParallelSize": 4,
                "gpus": 4,
                "resources": {"requests": {"nvidia.com/gpu": 4}, "limits": {"nvidia.com/gpu": 8}},
            },
            "decode.resources names nvidia.com/gpu 4 in requests but 8 in limits: Kubernetes needs them equal",
        ),
        (
            {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}},
            "decode.resources must not name nvidia.com/gpu: set decode.gpus instead",
        ),
    ],
)
def test_bad_combinations_say_what_is_wrong(pool, message):
    with pytest.raises((InvalidSpecError, ValueError)) as err:
        check_spec(parse_spec({**BASE, "decode": pool}), "svc", OperatorSettings())
    assert message in str(err.value)


def test_one_rank_over_two_nodes_is_refused():
    with pytest.raises(ValueError) as err:
        parse_spec(pools(1, 2))
    assert "tensorParallelSize 1 is not divisible by nodes 2" in str(err.value) and "allowed nodes: 1" in str(err.value)


def test_the_api_server_rejects_an_indivisible_tp_too():
    _, errors = admit(isvc_body("svc", "llm", {**BASE, "prefill": {"tensorParallelSize": 3, "nodes": 2}}))
    assert errors == [
        "spec.prefill: tensorParallelSize must be divisible by nodes: each pod of a worker runs "
        "tensorParallelSize / nodes ranks"
    ]


def test_gpu_override_from_resources_and_a_long_name():
    out = rendered(
        {**BASE, "decode": {"tensorParallelSize": 4, "gpus": 4, "resources": {"limits": {"nvidia.com/gpu": 8}}}}
    )
    assert worker(out["Deployment", "svc-decode"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    with pytest.raises(InvalidSpecError) as err:
        check_spec(parse_spec(pools(4, 2)), "a" * 35, OperatorSettings())
    assert f"prefill.nodes 2 makes a LeaderWorkerSet '{'a' * 35}-prefill-group' (49 characters)" in str(err.value)
    assert "metadata.name may have at most 34" in str(err.value)
    check_spec(parse_spec(pools(4, 2)), "a" * 34, OperatorSettings())  # the longest that fits


# --- on the emulated cluster ------------------------------------------------------------------


def _kube(cluster: ClusterThread, tmp_path) -> KubeClient:
    return KubeClient(load_configuration(cluster.kubeconfig(str(tmp_path / "kubeconfig"))))


def _mark_groups_ready(kube: KubeClient, namespace: str, name: str) -> None:
    """Act as the LeaderWorkerSet controller: every group of the set is up and ready."""
    url = K.path(LWS, namespace, name)
    live = kube.get(url)
    n = live["spec"]["replicas"]
    status = {"observedGeneration": live["metadata"]["generation"], "replicas": n, "readyReplicas": n}
    kube.merge_patch(url + "/status", {"status": {**status, "updatedReplicas": n}})


@pytest.mark.parametrize("tp,nodes", VALID)
def test_reconcile_on_the_emulated_cluster(tmp_path, tp, nodes):
    """kmock emulates the API (with the LeaderWorkerSet API installed): one reconcile creates the pool's
    Deployment or LeaderWorkerSet, the status counts groups once the set reports them ready, and a second
    reconcile writes nothing."""
    spec = pools(tp, nodes)
    kind, name = ("LeaderWorkerSet", "svc-decode-group") if nodes > 1 else ("Deployment", "svc-decode")
    with ClusterThread(with_leader_worker_set=True) as cluster:
        kube = _kube(cluster, tmp_path)
        create_isvc(kube, "svc", "llm", spec)
        outcome = reconcile(kube, OperatorSettings(), "llm", "svc")
        workloads = {c for c in outcome.result.created if c.startswith(("Deployment/", "LeaderWorkerSet/"))}
        assert workloads == {
            f"{kind}/svc-prefill{name[len('svc-decode') :]}",
            f"{kind}/{name}",
            "Deployment/svc-router",
        }
        assert "the decode" in outcome.waiting
        for pool in ("prefill", "decode"):
            _, k, n = _ctx(spec).workload(pool)
            (_mark_groups_ready if k == "LeaderWorkerSet" else mark_ready)(kube, "llm", n)
        mark_ready(kube, "llm", "svc-router")
        outcome = reconcile(kube, OperatorSettings(), "llm", "svc")
        assert outcome.ready and not outcome.result.changed
        status = kube.get(K.path(K.ISVC, "llm", "svc"))["status"]
        assert status["decode"] == {"replicas": 1, "readyReplicas": 1, "ready": "1/1"}


def test_going_multi_node_replaces_the_deployment_and_scales_by_groups(tmp_path):
    with ClusterThread(with_leader_worker_set=True) as cluster:
        kube = _kube(cluster, tmp_path)
        create_isvc(kube, "svc", "llm", pools(4, 1))
        reconcile(kube, OperatorSettings(), "llm", "svc")
        assert kube.get(K.path(K.KIND_BY_NAME["Deployment"], "llm", "svc-decode")) is not None
        kube.merge_patch(K.path(K.ISVC, "llm", "svc"), {"spec": {"decode": {"nodes": 2, "gpus": 2}}})
        outcome = reconcile(kube, OperatorSettings(), "llm", "svc")
        assert "Deployment/svc-decode" in outcome.result.deleted
        assert "LeaderWorkerSet/svc-decode-group" in outcome.result.created
        assert "NetworkPolicy/svc-decode-ranks" in outcome.result.created
        lws = kube.get(K.path(LWS, "llm", "svc-decode-group"))
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        # the scale subresource (what KEDA, the HPA and the planner write) counts groups
        kube.merge_patch(K.path(LWS, "llm", "svc-decode-group", "scale"), {"spec": {"replicas": 3}})
        assert kube.get(K.path(LWS, "llm", "svc-decode-group"))["spec"]["replicas"] == 3


def test_without_the_leader_worker_set_api_the_status_says_so(tmp_path):
    with ClusterThread() as cluster:
        kube = _kube(cluster, tmp_path)
        create_isvc(kube, "svc", "llm", pools(2, 2))
        outcome = reconcile(kube, OperatorSettings(), "llm", "svc")
        ready = condition(kube.get(K.path(K.ISVC, "llm", "svc")))
        assert (ready["status"], ready["reason"]) == ("False", "MissingAPI")
        assert "the cluster has no leaderworkerset.x-k8s.io/v1 LeaderWorkerSet API" in outcome.waiting


def test_a_bad_combination_is_a_status_condition_and_an_event(tmp_path):
    """Under kopf (KopfRunner) on the emulated API: the InferenceService gets Ready=False/InvalidSpec with the
    message, and the operator posts it as a Warning Event InvalidSpec on the object (handlers.py)."""
    from test_operator_kopf import operator

    bad = {**BASE, "decode": {"tensorParallelSize": 8, "nodes": 2, "gpus": 1}}
    message = "decode.gpus is 1 but each pod runs 4 ranks (tensorParallelSize 8 / nodes 2)"
    with ClusterThread(with_leader_worker_set=True) as cluster:
        cluster.kubeconfig_path = cluster.kubeconfig(str(tmp_path / "kubeconfig"))
        kube = KubeClient(load_configuration(cluster.kubeconfig_path))
        with operator(cluster):
            create_isvc(kube, "svc", "llm", bad)
            ready = wait_for(lambda: condition(kube.get(K.path(K.ISVC, "llm", "svc"))), what="a Ready condition")
            assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and message in ready["message"]
            events = K.KindInfo("v1", "Event", "events")
            event = wait_for(
                lambda: [e for e in kube.list(K.path(events, "llm")) if message in e.get("message", "")],
                what="an Event",
            )[0]
            assert (event["type"], event["reason"]) == ("Warning", "InvalidSpec")
            assert event["involvedObject"]["kind"] == "InferenceService" and event["involvedObject"]["name"] == "svc"
