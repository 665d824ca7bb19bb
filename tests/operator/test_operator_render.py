"""render(spec) -> manifests: every child for a table of specs validates against Kubernetes 1.31's
schemas (strict) or the KEDA / Prometheus-operator subsets, and the worker/router contract
(args, ports, probes, labels, owner references, replicas) is rendered exactly."""

from __future__ import annotations

import json
import pathlib
import re

import promql_parser
import pytest
import yaml
from k8s_controllers import pods_of
from opkit_schemas import admit, validate_manifest

from splitserve.operator import constants as C
from splitserve.operator.context import Context
from splitserve.operator.render import render
from splitserve.operator.render_services import config_hash
from splitserve.operator.settings import AutoscalingDefaults, OperatorSettings
from splitserve.operator.spec import parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
UID = "6f1c7c4e-0000-4000-8000-000000000001"


def example(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / "examples" / name).read_text())


def rendered(spec: dict, name: str = "svc", namespace: str = "ns", settings: OperatorSettings | None = None):
    stored, errors = admit(
        {
            "apiVersion": "serving.splitserve.io/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
    )
    assert errors == []
    return render(parse_spec(stored["spec"]), name, namespace, UID, settings)


def by_key(manifests) -> dict[tuple[str, str], dict]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


CASES = {
    "tiny-cpu": (example("smollm2-cpu.yaml")["spec"], None),
    "llama-gpu-keda": (example("llama-3-8b-gpu.yaml")["spec"], None),
    "no-disaggregation": ({"model": {"uri": "smollm2-135m"}, "disaggregation": {"mode": "never"}}, None),
    "hpa-fractional-target": (
        {
            "model": {"uri": "m"},
            "prefill": {"autoscaling": {"enabled": True, "provider": "hpa", "targetQueueDepth": 2.5}},
            "decode": {"autoscaling": {"enabled": True, "provider": "hpa", "minReplicas": 2, "maxReplicas": 9}},
        },
        None,
    ),
    "keda-scale-to-zero": (
        {
            "model": {"uri": "m"},
            "decode": {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 3}},
        },
        None,
    ),
    "routers-with-redis-secret": (
        {
            "model": {"uri": "m"},
            "router": {
                "replicas": 3,
                "redis": {"url": "redis://r:6379", "passwordSecret": {"name": "redis", "key": "password"}},
            },
        },
        None,
    ),
    "user-env-and-scheduling": (
        {
            "model": {"uri": "m"},
            "decode": {
                "env": [
                    {"name": "HOME", "value": "/work"},
                    {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                ],
                "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
                "nodeSelector": {"pool": "llm"},
            },
        },
        None,
    ),
    "image-overrides": (
        {
            "model": {"uri": "m"},
            "image": {"repository": "registry.local/ss", "tag": "dev"},
            "prefill": {"image": "registry.local/custom:1", "gpus": 2},
        },
        None,
    ),
    "chart-enables-autoscaling": (
        {"model": {"uri": "m"}},
        OperatorSettings(autoscaling=AutoscalingDefaults(enabled=True, provider="hpa")),
    ),
    "lora-adapters": (
        {
            "model": {"uri": "m", "storage": {"pvcName": "weights"}},
            "adapters": [
                {"name": "sql", "uri": "/models/adapters/sql"},
                {"name": "chat-v2", "uri": "/models/adapters/chat"},
            ],
        },
        None,
    ),
    "service-monitor-no-prefill": (
        {
            "model": {"uri": "m"},
            "disaggregation": {"mode": "never"},
            "monitoring": {"serviceMonitor": {"enabled": True, "interval": "30s"}},
        },
        None,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_every_manifest_is_valid_and_owned(case):
    spec, settings = CASES[case]
    manifests = rendered(spec, settings=settings)
    assert len(by_key(manifests)) == len(manifests), "two children share a kind and name"
    for m in manifests:
        validate_manifest(m)
        meta = m["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "serving.splitserve.io/v1alpha1",
                "kind": "InferenceService",
                "name": "svc",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][C.LABEL_INSTANCE] == "svc"
        assert meta["labels"][C.LABEL_NAME] == "splitserve"
        assert meta["labels"][C.LABEL_MANAGED_BY] == "splitserve-operator"
        assert len(meta["name"]) <= 63


def test_children_of_the_tiny_example():
    keys = list(by_key(rendered(example("smollm2-cpu.yaml")["spec"])))
    assert keys == [
        ("ConfigMap", "svc-router"),
        ("ServiceAccount", "svc-router"),
        ("Role", "svc-router"),
        ("RoleBinding", "svc-router"),
        ("Service", "svc-prefill"),
        ("Service", "svc-decode"),
        ("Service", "svc-router"),
        ("Service", "svc"),
        ("Deployment", "svc-prefill"),
        ("Deployment", "svc-decode"),
        ("Deployment", "svc-router"),
        ("PodDisruptionBudget", "svc-prefill"),
        ("PodDisruptionBudget", "svc-decode"),
        ("PodDisruptionBudget", "svc-router"),
        ("NetworkPolicy", "svc-workers"),
        ("NetworkPolicy", "svc-router"),
    ]


def test_worker_container_follows_the_worker_contract():
    deploy = by_key(rendered(example("smollm2-cpu.yaml")["spec"]))[("Deployment", "svc-decode")]
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["splitserve"]
    assert c["args"] == [
        "worker",
        "--role",
        "decode",
        "--model",
        "smollm2-135m",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--block-size",
        "16",
        "--max-num-seqs",
        "32",
        "--kv-cache-memory",
        "0.5",
        "--host",
        "0.0.0.0",
        "--advertise-host",
        "$(POD_IP)",
        "--grpc-port",
        "50051",
        "--metrics-port",
        "9090",
        "--kv-transport",
        "tcp",
        "--kv-port",
        "13337",
        # secure by default: the operator's KV secret and per-pool certificate
        "--kv-secret-file",
        "/etc/splitserve/kv/secret",
        "--tls-cert",
        "/etc/splitserve/tls/tls.crt",
        "--tls-key",
        "/etc/splitserve/tls/tls.key",
        "--tls-ca",
        "/etc/splitserve/tls/ca.crt",
        "--tls-check-peer-roles",
    ]  # per-role certificates: callers checked by role
    assert c["image"] == "ghcr.io/splitserve/splitserve:0.1.0"
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("grpc", 50051), ("metrics", 9090), ("kv", 13337)]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    assert {m["mountPath"] for m in c["volumeMounts"]} == {
        "/tmp",
        "/dev/shm",
        "/etc/splitserve/kv",
        "/etc/splitserve/tls",
    }
    assert pod["terminationGracePeriodSeconds"] == 120
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["automountServiceAccountToken"] is False
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["labelSelector"]["matchLabels"]
        == deploy["spec"]["selector"]["matchLabels"]
        == {C.LABEL_NAME: "splitserve", C.LABEL_INSTANCE: "svc", C.LABEL_COMPONENT: "decode"}
    )
    assert deploy["spec"]["template"]["metadata"]["labels"][C.LABEL_ROLE] == "decode"


def test_adapters_are_declared_to_the_router_and_kept_out_of_every_pod_template():
    """spec.adapters goes into the router ConfigMap's adapters.yaml, which is not hashed: a changed
    adapter list changes no pod template (no pod restarts), only that one ConfigMap key."""
    with_adapters = by_key(rendered(CASES["lora-adapters"][0]))
    cm = with_adapters[("ConfigMap", "svc-router")]
    assert yaml.safe_load(cm["data"][C.ROUTER_ADAPTERS_FILE]) == {
        "adapters": [
            {"name": "sql", "path": "/models/adapters/sql"},
            {"name": "chat-v2", "path": "/models/adapters/chat"},
        ]
    }
    router_yaml = yaml.safe_load(cm["data"][C.ROUTER_CONFIG_FILE])
    assert router_yaml["adapters"] == {
        "file": "/etc/splitserve/adapters.yaml",
        "report_namespace": "ns",
        "report_configmap": "svc-router",
        "report_annotation": C.ANNOTATION_ADAPTERS_LOADED,
    }
    assert {"name": "lora-affinity", "weight": 2.0} in router_yaml["placement"]["decode"]["scorers"]
    changed = dict(CASES["lora-adapters"][0], adapters=[{"name": "sql", "uri": "/models/adapters/sql-v2"}])
    for other in (by_key(rendered(changed)), by_key(rendered({**changed, "adapters": []}))):
        for key, manifest in with_adapters.items():
            if key == ("ConfigMap", "svc-router"):
                assert manifest["data"][C.ROUTER_CONFIG_FILE] == other[key]["data"][C.ROUTER_CONFIG_FILE]
                assert manifest["data"][C.ROUTER_ADAPTERS_FILE] != other[key]["data"][C.ROUTER_ADAPTERS_FILE]
            else:
                assert manifest == other[key], key
    for pool in ("prefill", "decode"):
        (c,) = with_adapters[("Deployment", f"svc-{pool}")]["spec"]["template"]["spec"]["containers"]
        assert "--lora-modules" not in c["args"]
    role = with_adapters[("Role", "svc-router")]
    assert {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": ["svc-router"],
        "verbs": ["get", "patch"],
    } in role["rules"]


def test_gpu_pool_gets_cuda_image_gpu_limit_toleration_and_device():
    manifests = by_key(rendered(example("llama-3-8b-gpu.yaml")["spec"]))
    pod = manifests[("Deployment", "svc-prefill")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/splitserve/splitserve:0.1.0-cuda"
    assert c["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 1}
    assert c["args"][-2:] == ["--device", "cuda"]
    assert c["args"][c["args"].index("--kv-cache-memory") + 1] == "40"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["terminationGracePeriodSeconds"] == 60
    assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"} in c["env"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    router = manifests[("Deployment", "svc-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["image"] == "ghcr.io/splitserve/splitserve:0.1.0"  # the router never needs CUDA
    assert manifests[("Service", "svc")]["spec"]["type"] == "LoadBalancer"


def test_router_container_and_config():
    manifests = by_key(rendered(example("smollm2-cpu.yaml")["spec"]))
    deploy = manifests[("Deployment", "svc-router")]
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == [
        "router",
        "--config",
        "/etc/splitserve/router.yaml",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--metrics-port",
        "9090",
        "--tls-cert",
        "/etc/splitserve/tls/tls.crt",
        "--tls-key",
        "/etc/splitserve/tls/tls.key",
        "--tls-ca",
        "/etc/splitserve/tls/ca.crt",
        "--api-keys-file",
        "/etc/splitserve/api-keys/keys.yaml",
    ]  # closed by default
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("http", 8000), ("metrics", 9090)]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["serviceAccountName"] == "svc-router"
    assert {"name": "config", "configMap": {"name": "svc-router"}} in pod["volumes"]
    config = yaml.safe_load(manifests[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    assert config == {
        "model": "smollm2-135m",
        "block_size": 16,
        "max_model_len": 2048,
        "gateway": {"served_model_names": ["smollm2-135m"], "num_processes": 1},
        "discovery": {"k8s_namespace": "ns", "k8s_services": ["svc-prefill", "svc-decode"], "k8s_port_name": "grpc"},
        "index": {"backend": "memory"},
        "placement": {
            "disaggregation": {"mode": "conditional", "min_prefill_tokens": 64},
            "decode": {
                "scorers": [
                    {"name": "prefix-overlap", "weight": 3.0},
                    {"name": "queue-depth", "weight": 2.0},
                    {"name": "kv-usage", "weight": 2.0},
                    {"name": "pending-assignments", "weight": 1.0},
                    {"name": "lora-affinity", "weight": 2.0},
                    {"name": "cache-room", "weight": 0.5},
                ]
            },
            "prefill": {
                "scorers": [
                    {"name": "prefix-overlap", "weight": 3.0},
                    {"name": "queued-prefill-tokens", "weight": 2.0},
                    {"name": "pending-assignments", "weight": 1.0},
                ]
            },
        },
        "adapters": {
            "file": "/etc/splitserve/adapters.yaml",
            "report_namespace": "ns",
            "report_configmap": "svc-router",
            "report_annotation": "serving.splitserve.io/adapters-loaded",
        },
    }
    # ...and the router itself accepts it.
    from splitserve.router.config.file import from_dict

    loaded = from_dict(config)
    assert loaded.discovery.k8s_services == ("svc-prefill", "svc-decode")
    assert loaded.placement.decode.scorers[1].name == "queue-depth"
    role = manifests[("Role", "svc-router")]
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["svc-router"], "verbs": ["get", "patch"]},
    ]
    binding = manifests[("RoleBinding", "svc-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "svc-router", "namespace": "ns"}]
    assert binding["roleRef"]["name"] == "svc-router"


def test_services():
    manifests = by_key(rendered(example("smollm2-cpu.yaml")["spec"]))
    for pool in ("prefill", "decode"):
        svc = manifests[("Service", f"svc-{pool}")]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == {C.LABEL_NAME: "splitserve", C.LABEL_INSTANCE: "svc", C.LABEL_COMPONENT: pool}
        assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
            ("grpc", 50051, "grpc"),
            ("metrics", 9090, "metrics"),
            ("kv", 13337, "kv"),
        ]
    gateway = manifests[("Service", "svc")]
    assert gateway["spec"]["selector"][C.LABEL_COMPONENT] == "router"
    assert gateway["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_disaggregation_never_renders_no_prefill_pool():
    manifests = rendered(CASES["no-disaggregation"][0])
    assert not [m for m in manifests if "prefill" in m["metadata"]["name"]]
    config = yaml.safe_load(by_key(manifests)[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    assert config["discovery"]["k8s_services"] == ["svc-decode"]
    assert config["placement"]["disaggregation"]["mode"] == "never"


def test_replicas_static_vs_autoscaled():
    static = by_key(rendered({"model": {"uri": "m"}, "decode": {"replicas": 5}}))[("Deployment", "svc-decode")]
    assert static["spec"]["replicas"] == 5
    assert static["metadata"]["annotations"] == {C.ANNOTATION_REPLICAS_OWNER: "operator"}
    auto = by_key(rendered(CASES["hpa-fractional-target"][0]))[("Deployment", "svc-decode")]
    assert auto["spec"]["replicas"] == 2  # created at minReplicas; the HPA owns it afterwards
    assert auto["metadata"]["annotations"] == {C.ANNOTATION_REPLICAS_OWNER: "hpa"}


def test_keda_scaled_object_queries_the_pool_queue_depth():
    manifests = by_key(rendered(example("llama-3-8b-gpu.yaml")["spec"], name="llama3-8b", namespace="llm"))
    so = manifests[("ScaledObject", "llama3-8b-decode")]
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama3-8b-decode"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (4, 12)
    assert (so["spec"]["pollingInterval"], so["spec"]["cooldownPeriod"]) == (15, 600)
    (trigger,) = so["spec"]["triggers"]
    query = 'sum(vllm:num_requests_waiting{namespace="llm",pod=~"llama3-8b-decode-[a-z0-9]+-[a-z0-9]+"})'
    assert trigger == {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {
            "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
            "query": query,
            "threshold": "16",
        },
    }
    promql_parser.parse(query)
    pod_regex = re.fullmatch(r'.*pod=~"([^"]+)".*', query).group(1)
    deploy = manifests[("Deployment", "llama3-8b-decode")]
    for pod in pods_of(deploy, ["10.0.0.1", "10.0.0.2"]):
        assert re.fullmatch(pod_regex, pod["metadata"]["name"])
    # A neighbour InferenceService named like our pool does not leak into the sum.
    assert not re.fullmatch(pod_regex, "llama3-8b-decode-decode-7d9f8c6b5-abcde")
    assert manifests[("ScaledObject", "llama3-8b-prefill")]["spec"]["triggers"][0]["metadata"]["threshold"] == "4"


def test_hpa_uses_the_adapter_metric():
    manifests = by_key(rendered(CASES["hpa-fractional-target"][0]))
    hpa = manifests[("HorizontalPodAutoscaler", "svc-prefill")]
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2500m"},
            },
        }
    ]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)  # the chart's prefill defaults
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    decode = manifests[("HorizontalPodAutoscaler", "svc-decode")]
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"]) == (2, 9)
    assert decode["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "8"


def test_chart_defaults_apply_when_the_spec_is_silent():
    spec, settings = CASES["chart-enables-autoscaling"]
    manifests = by_key(rendered(spec, settings=settings))
    assert {k for k in manifests if k[0] == "HorizontalPodAutoscaler"} == {
        ("HorizontalPodAutoscaler", "svc-prefill"),
        ("HorizontalPodAutoscaler", "svc-decode"),
    }
    spec_wins = by_key(
        rendered({"model": {"uri": "m"}, "decode": {"autoscaling": {"enabled": False}}}, settings=settings)
    )
    assert ("HorizontalPodAutoscaler", "svc-decode") not in spec_wins
    assert ("HorizontalPodAutoscaler", "svc-prefill") in spec_wins


def test_user_env_overrides_ours_and_scheduling_is_kept():
    pod = by_key(rendered(CASES["user-env-and-scheduling"][0]))[("Deployment", "svc-decode")]["spec"]["template"][
        "spec"
    ]
    env = pod["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HOME"] == [{"name": "HOME", "value": "/work"}]
    assert env[-1] == {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"pool": "llm"}


def test_image_overrides():
    manifests = by_key(rendered(CASES["image-overrides"][0]))
    image = lambda n: manifests[("Deployment", n)]["spec"]["template"]["spec"]["containers"][0]["image"]  # noqa: E731
    assert image("svc-prefill") == "registry.local/custom:1"
    assert image("svc-decode") == "registry.local/ss:dev"
    assert image("svc-router") == "registry.local/ss:dev"


def test_redis_password_comes_from_the_secret():
    manifests = by_key(rendered(CASES["routers-with-redis-secret"][0]))
    router = manifests[("Deployment", "svc-router")]
    assert router["spec"]["replicas"] == 3
    env = router["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}} in env
    config = yaml.safe_load(manifests[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    assert config["index"] == {"backend": "redis", "redis_url": "redis://r:6379"}


def test_service_monitor_selects_the_headless_services_only():
    manifests = by_key(rendered(CASES["service-monitor-no-prefill"][0]))
    monitor = manifests[("ServiceMonitor", "svc")]
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    expr = monitor["spec"]["selector"]["matchExpressions"][0]
    selected = [
        k
        for k, m in manifests.items()
        if k[0] == "Service" and m["metadata"]["labels"][C.LABEL_COMPONENT] in expr["values"]
    ]
    assert selected == [("Service", "svc-decode"), ("Service", "svc-router")]


def test_pdbs_allow_one_disruption_per_pool():
    manifests = by_key(rendered({"model": {"uri": "m"}}))
    for component in ("prefill", "decode", "router"):
        pdb = manifests[("PodDisruptionBudget", f"svc-{component}")]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"][C.LABEL_COMPONENT] == component


def test_render_is_pure_and_the_config_hash_rolls_only_the_router():
    spec = {"model": {"uri": "m"}}
    assert rendered(spec) == rendered(spec)
    hashes = {}
    for variant, change in {
        "base": {},
        "replicas": {"decode": {"replicas": 3}},
        "weights": {"router": {"scorerWeights": {"prefix": 9}}},
    }.items():
        parsed = parse_spec(
            admit(
                {"apiVersion": "x", "kind": "InferenceService", "metadata": {"name": "svc"}, "spec": {**spec, **change}}
            )[0]["spec"]
        )
        hashes[variant] = config_hash(Context(parsed, "svc", "ns", UID, OperatorSettings()))
    assert hashes["base"] == hashes["replicas"] != hashes["weights"]


def test_speculative_decoding_goes_to_the_decode_pool_only():
    spec = example("smollm2-cpu.yaml")["spec"]
    spec = {**spec, "speculative": {"numSpeculativeTokens": 3, "promptLookupMin": 1}}
    manifests = by_key(rendered(spec))
    decode = manifests[("Deployment", "svc-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    prefill = manifests[("Deployment", "svc-prefill")]["spec"]["template"]["spec"]["containers"][0]["args"]
    value = decode[decode.index("--speculative-config") + 1]
    assert json.loads(value) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    assert "--speculative-config" not in prefill
    # What the operator renders is what the worker's own flag accepts.
    from splitserve.platform.config import SpeculativeConfig

    assert SpeculativeConfig.from_json(value).num_speculative_tokens == 3


@pytest.mark.parametrize("gpus", [0, 1])
def test_kv_cache_spec_renders_the_second_tier_and_pulls(gpus):
    """spec.kvCache: a file tier in its own emptyDir on CPU pools, host memory on GPU pools; pulls
    off in both the workers' flags and the router's config; what is rendered parses as the
    worker's own flags do."""
    spec = example("smollm2-cpu.yaml")["spec"]
    spec = {**spec, "kvCache": {"tierGiB": 2, "pull": False}}
    if gpus:
        spec = {**spec, "decode": {**spec.get("decode", {}), "gpus": 1}}
    manifests = by_key(rendered(spec))
    pod = manifests[("Deployment", "svc-decode")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--kv-tier-bytes") + 1] == str(2 * 1024**3) and "--no-kv-pull" in args
    tier_volumes = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    if gpus:
        assert "--kv-tier-dir" not in args and tier_volumes == []
    else:
        assert args[args.index("--kv-tier-dir") + 1] == "/var/cache/splitserve-kv"
        assert tier_volumes == [{"name": "kv-tier", "emptyDir": {"sizeLimit": "2112Mi"}}]
        assert {"name": "kv-tier", "mountPath": "/var/cache/splitserve-kv"} in pod["containers"][0]["volumeMounts"]
    config = yaml.safe_load(manifests[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    assert config["placement"]["kv_pull"] == {"enabled": False}
    from splitserve.platform.cli import build_parser
    from splitserve.platform.settings.worker_args import WorkerArgs

    tier = WorkerArgs.from_namespace(build_parser(args).parse_args(args)).kv_tier_config(read_secret=False)
    assert tier.max_bytes == 2 * 1024**3
