"""The Helm chart, rendered and linted offline with the embedded Helm 4 library
(helm-python-sdk): every rendered object validates against Kubernetes 1.31 (strict), lint
is clean in strict mode, values.schema.json rejects wrong values, the values reach the
operator's settings, the RBAC covers exactly what the operator does, and the container's
arguments parse with the real `splitserve operator` command line."""

from __future__ import annotations

import argparse
import json
import pathlib

import helm_python as helm
import pytest
import yaml
from opkit_schemas import validate_manifest

from splitserve.operator import cli
from splitserve.operator.context import Context
from splitserve.operator.crd import crd_yaml
from splitserve.operator.kube import KINDS
from splitserve.operator.render_services import router_access
from splitserve.operator.settings import (
    AutoscalingDefaults,
    ImageDefaults,
    OperatorSettings,
    PoolDefaults,
    ReconcileSettings,
    load_settings,
)
from splitserve.operator.spec import parse_spec
from splitserve.planner import cli as planner_cli

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "splitserve"
VALUES = {
    "defaults": {},
    "keda": {"autoscaling": {"enabled": True, "provider": "keda"}},
    "hpa": {
        "autoscaling": {
            "enabled": True,
            "provider": "hpa",
            "cooldownPeriod": 600,
            "decode": {"minReplicas": 2, "maxReplicas": 16, "targetQueueDepth": 12.5},
        },
        "operator": {"resyncSeconds": 30},
    },
    "namespaced-locked-down": {
        "operator": {"watchNamespaces": ["llm", "llm-staging"], "logLevel": "debug"},
        "networkPolicy": {"enabled": True, "apiServerCIDRs": ["10.0.0.1/32"]},
        "serviceAccount": {"name": "ops"},
        "image": {"tag": "0.2.0"},
    },
    "external-service-account": {"serviceAccount": {"create": False, "name": "prebuilt"}, "rbac": {"create": False}},
    "planner": {
        "autoscaling": {"enabled": True, "provider": "planner", "plannerExport": "scale"},
        "planner": {
            "enabled": True,
            "profile": '{"prefill": [], "decode": [], "kv_tokens": 1}',
            "replicaBudget": 8,
            "leaseDurationSeconds": 30,
        },
    },
    "kv-cache": {"kvCache": {"tierGiB": 4, "tierMedium": "memory", "pull": False, "maxPullBlocks": 256}},
    "monitoring": {
        "monitoring": {
            "dashboards": {"enabled": True, "namespace": "grafana"},
            "rules": {
                "enabled": True,
                "ttftSloSeconds": "1.0",
                "ttftObjective": 0.995,
                "for": {"workersNotReady": "1m"},
            },
        }
    },
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def objects(chart, values: dict) -> list[dict]:
    rendered = chart.render(values, name="splitserve", namespace="splitserve-system")
    docs = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text)]
    return [d for d in docs if d]


def find(objs, kind, name=None, namespace=None):
    return [
        o
        for o in objs
        if o["kind"] == kind
        and name in (None, o["metadata"]["name"])
        and namespace in (None, o["metadata"].get("namespace"))
    ]


@pytest.mark.parametrize("case", VALUES)
def test_chart_renders_valid_objects_and_lints_clean(chart, case):
    objs = objects(chart, VALUES[case])
    for o in objs:
        validate_manifest(o)
    report = helm.lint(CHART, VALUES[case], strict=True, namespace="splitserve-system", kube_version="v1.31.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_objects(chart):
    objs = objects(chart, {})
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objs) == [
        ("ClusterRole", "splitserve-observer"),
        ("ClusterRoleBinding", "splitserve-observer"),
        ("ConfigMap", "splitserve-defaults"),
        ("Deployment", "splitserve"),
        ("Role", "splitserve"),
        ("RoleBinding", "splitserve"),
        ("ServiceAccount", "splitserve"),
    ]  # namespaced
    (deploy,) = find(objs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert c["image"] == "ghcr.io/splitserve/splitserve:0.1.0"
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "192Mi"}, "limits": {"memory": "384Mi"}}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_the_crd_ships_in_crds(chart):
    (crd,) = chart.crds
    assert crd["name"] == "crds/inferenceservices.serving.splitserve.io.yaml"
    assert crd["data"] == crd_yaml()  # Helm installs exactly the generated CRD


def operator_args(objs) -> argparse.Namespace:
    (deploy,) = find(objs, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["splitserve"]
    parser = argparse.ArgumentParser(prog="splitserve")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(container["args"])


def test_container_args_parse_with_the_operator_cli(chart):
    args = operator_args(objects(chart, {}))
    assert (args.command, args.all_namespaces, args.namespace) == ("operator", False, ["splitserve-system"])
    wide = operator_args(objects(chart, {"operator": {"clusterWide": True}}))
    assert (wide.all_namespaces, wide.namespace) == (True, [])
    assert args.defaults == "/etc/splitserve-operator/defaults.yaml"
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    scoped = operator_args(objects(chart, VALUES["namespaced-locked-down"]))
    assert (scoped.all_namespaces, scoped.namespace, scoped.debug) == (False, ["llm", "llm-staging"], True)


def test_values_reach_the_operator_settings(chart, tmp_path):
    (cm,) = find(objects(chart, VALUES["hpa"]), "ConfigMap")
    path = tmp_path / "defaults.yaml"
    path.write_text(cm["data"]["defaults.yaml"])
    assert load_settings(str(path)) == OperatorSettings(
        image=ImageDefaults(tag="0.1.0"),
        autoscaling=AutoscalingDefaults(
            enabled=True,
            provider="hpa",
            cooldown_period=600,
            decode=PoolDefaults(min_replicas=2, max_replicas=16, target_queue_depth=12.5),
        ),
        reconcile=ReconcileSettings(resync_seconds=30),
    )
    (deploy,) = find(objects(chart, VALUES["hpa"]), "Deployment")
    (default_deploy,) = find(objects(chart, {}), "Deployment")
    # A values change rolls the operator so that it reads the new defaults.
    assert (
        deploy["spec"]["template"]["metadata"]["annotations"]["checksum/defaults"]
        != default_deploy["spec"]["template"]["metadata"]["annotations"]["checksum/defaults"]
    )


def needed_permissions() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the operator's code uses, from its kind table and the Role it grants."""
    group = lambda api_version: api_version.rpartition("/")[0]  # noqa: E731
    need = {(group(k.api_version), k.plural, v) for k in KINDS for v in ("get", "list", "create", "patch", "delete")}
    need |= {("serving.splitserve.io", "inferenceservices", v) for v in ("get", "list", "watch", "patch")}
    need |= {("serving.splitserve.io", "inferenceservices/status", "patch"), ("", "events", "create")}
    need |= {("", "secrets", v) for v in ("get", "create", "patch")}  # credentials.py
    ctx = Context(parse_spec({"model": {"uri": "m"}}), "svc", "ns", "uid", OperatorSettings())
    (role,) = [m for m in router_access(ctx) if m["kind"] == "Role"]
    need |= {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }  # RBAC lets one grant only what one holds
    return need


def granted(rules) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_rbac_grants_what_the_operator_does_and_no_wildcards(chart):
    (role,) = find(objects(chart, {}), "Role", "splitserve", "splitserve-system")  # the default: namespaced
    assert needed_permissions() <= granted(role["rules"])
    objs = objects(chart, {"operator": {"clusterWide": True}})  # cluster-wide only when asked for
    (role,) = find(objs, "ClusterRole", "splitserve")
    assert needed_permissions() <= granted(role["rules"])
    for r in find(objs, "ClusterRole"):
        assert "*" not in str([rule["verbs"] + rule["resources"] + rule["apiGroups"] for rule in r["rules"]])
    (observer,) = find(objs, "ClusterRole", "splitserve-observer")
    assert {v for _, _, v in granted(observer["rules"])} == {"list", "watch"}
    # Secrets: only the operator's own by name (credentials.py); never list, watch or delete them.
    assert {v for _, r, v in granted(role["rules"]) if r == "secrets"} == {"get", "create", "patch"}


def test_namespaced_rbac_uses_roles_in_the_watched_namespaces(chart):
    objs = objects(chart, VALUES["namespaced-locked-down"])
    assert not find(objs, "ClusterRole", "splitserve")
    for ns in ("llm", "llm-staging"):
        (role,) = find(objs, "Role", "splitserve", ns)
        assert needed_permissions() <= granted(role["rules"])
        (binding,) = find(objs, "RoleBinding", "splitserve", ns)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ops", "namespace": "splitserve-system"}]
    (policy,) = find(objs, "NetworkPolicy")
    assert policy["spec"]["egress"][1]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    (deploy,) = find(objs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/splitserve/splitserve:0.2.0"


def test_external_service_account_and_no_rbac(chart):
    objs = objects(chart, VALUES["external-service-account"])
    assert not find(objs, "ServiceAccount") and not find(objs, "ClusterRole") and not find(objs, "Role")
    (deploy,) = find(objs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "prebuilt"


@pytest.mark.parametrize(
    "values,message",
    [
        ({"autoscaling": {"enabled": "yes"}}, "at '/autoscaling/enabled': got string, want boolean"),
        ({"autoscaling": {"provider": "vpa"}}, "at '/autoscaling/provider': value must be one of 'keda', 'hpa'"),
        ({"autoscaling": {"decode": {"minReplicas": -1}}}, "at '/autoscaling/decode/minReplicas'"),
        (
            {"autoscaling": {"prefill": {"targetQueueDepth": "4"}}},
            "at '/autoscaling/prefill/targetQueueDepth': got string, want number",
        ),
        ({"operator": {"resyncSeconds": "60s"}}, "at '/operator/resyncSeconds': got string, want number"),
        ({"operator": {"watchNamespaces": ["Bad_NS"]}}, "at '/operator/watchNamespaces/0'"),
        ({"autoscalling": {"enabled": True}}, "additional properties 'autoscalling' not allowed"),
        ({"kvCache": {"tierGiB": -1}}, "at '/kvCache/tierGiB': minimum: got -1, want 0"),
        ({"kvCache": {"tierMedium": "ssd"}}, "at '/kvCache/tierMedium': value must be one of 'disk', 'memory'"),
        ({"kvCache": {"pull": "no"}}, "at '/kvCache/pull': got string, want boolean"),
        ({"kvCache": {"maxPullBlocks": 0}}, "at '/kvCache/maxPullBlocks': minimum: got 0, want 1"),
        ({"kvCache": {"tierGB": 4}}, "additional properties 'tierGB' not allowed"),
    ],
)
def test_values_schema_rejects_wrong_values(chart, values, message):
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert message in str(err.value)
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name="splitserve", namespace="splitserve-system")


def test_values_schema_accepts_every_documented_case(chart):
    for values in VALUES.values():
        chart.validate_schema(values)


def _schema_leaves(schema: dict, prefix: str = "") -> list[str]:
    if "properties" not in schema:
        return [prefix]
    return [leaf for key, sub in schema["properties"].items() for leaf in _schema_leaves(sub, f"{prefix}{key}.")]


def test_the_readme_explains_every_value():
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()
    leaves = [leaf.rstrip(".") for leaf in _schema_leaves(schema)]
    assert len(leaves) == 97
    assert [leaf for leaf in leaves if f"`{leaf}`" not in readme] == []
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert sorted(values) == sorted(schema["properties"])  # values.yaml and its schema list the same keys


def test_planner_is_rendered_behind_its_value_where_the_scaled_objects_look(chart, tmp_path):
    assert not [o for o in objects(chart, {}) if "planner" in o["metadata"]["name"]]
    objs = objects(chart, VALUES["planner"])
    (svc,) = find(objs, "Service", "splitserve-planner", "splitserve-system")
    url = f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{svc['spec']['ports'][0]['port']}"
    assert url == OperatorSettings().autoscaling.planner_url  # the operator's default reaches it
    (deploy,) = find(objs, "Deployment", "splitserve-planner")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    parser = argparse.ArgumentParser(prog="splitserve")
    planner_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(container["args"])
    assert args.cluster and args.lease_name == "splitserve-planner" and args.lease_duration == 30
    assert args.budget == 8 and not args.name  # every service, not one
    assert deploy["spec"]["replicas"] == 2 and container["readinessProbe"]["httpGet"]["path"] == "/ready"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    assert pod["serviceAccountName"] == "splitserve-planner" and pod["automountServiceAccountToken"] is True
    # the planner's RBAC: leases in its namespace; configmaps, pods, deployments (scale) everywhere
    granted = {
        (g, r, v)
        for o in find(objs, "ClusterRole", "splitserve-planner") + find(objs, "Role", "splitserve-planner")
        for rule in o["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    need = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")} | {
        ("", "configmaps", "list"),
        ("", "configmaps", "get"),
        ("", "pods", "list"),
        ("apps", "deployments", "get"),
        ("apps", "deployments/scale", "patch"),
    }
    assert need <= granted
    (binding,) = find(objs, "RoleBinding", "splitserve-planner")
    assert binding["subjects"][0]["name"] == "splitserve-planner"
    # the chart's default profile and export reach the operator, which copies them per service
    (cm,) = [c for c in find(objs, "ConfigMap") if "defaults.yaml" in c.get("data", {})]
    path = tmp_path / "defaults.yaml"
    path.write_text(cm["data"]["defaults.yaml"])
    settings = load_settings(str(path))
    assert settings.autoscaling.planner_profile == VALUES["planner"]["planner"]["profile"]
    assert settings.autoscaling.planner_export == "scale"
    assert settings.network_policy.workloads.planner.namespace_labels == {
        "kubernetes.io/metadata.name": "splitserve-system"
    }


def test_a_bad_planner_export_is_refused_by_the_values_schema(chart):
    with pytest.raises(Exception, match="plannerExport"):
        objects(chart, {"autoscaling": {"plannerExport": "hpa"}})


def _worker_and_router(manifests, pool: str):
    by_key = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    pod = by_key[("Deployment", f"svc-{pool}")]["spec"]["template"]["spec"]
    router = yaml.safe_load(by_key[("ConfigMap", "svc-router")]["data"]["router.yaml"])
    return pod, pod["containers"][0]["args"], router["placement"].get("kv_pull")


def test_kv_cache_values_are_every_services_defaults_and_its_own_fields_win(chart, tmp_path):
    """kvCache.* reach the operator's settings through the defaults ConfigMap; a service that
    leaves spec.kvCache unset gets them in its workers' flags, tier volume and router config;
    a service's own spec.kvCache fields win over them field by field."""
    from splitserve.operator.render import render
    from splitserve.operator.settings import KvCacheDefaults

    (cm,) = find(objects(chart, VALUES["kv-cache"]), "ConfigMap")
    path = tmp_path / "defaults.yaml"
    path.write_text(cm["data"]["defaults.yaml"])
    settings = load_settings(str(path))
    assert settings.kv_cache == KvCacheDefaults(tier_gib=4, tier_medium="memory", pull=False, max_pull_blocks=256)

    base = {"model": {"uri": "smollm2-135m"}, "decode": {"resources": {"limits": {"memory": "8Gi"}}}}
    pod, args, kv_pull = _worker_and_router(render(parse_spec(base), "svc", "ns", "uid", settings), "decode")
    assert args[args.index("--kv-tier-bytes") + 1] == str(4 * 1024**3)
    assert args[args.index("--kv-tier-dir") + 1] == "/var/cache/splitserve-kv"
    assert {"name": "kv-tier", "emptyDir": {"sizeLimit": "4160Mi", "medium": "Memory"}} in pod["volumes"]
    assert "--no-kv-pull" in args and "--max-pull-blocks" not in args and kv_pull == {"enabled": False}

    own = {**base, "kvCache": {"tierGiB": 0, "pull": True}}  # tierMedium and maxPullBlocks from the chart
    pod, args, kv_pull = _worker_and_router(render(parse_spec(own), "svc", "ns", "uid", settings), "decode")
    assert "--kv-tier-bytes" not in args and not [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    assert "--no-kv-pull" not in args and args[args.index("--max-pull-blocks") + 1] == "256" and kv_pull is None

    # The chart's defaults (no kvCache values): no tier, pulls on with the worker's own limit.
    (cm,) = find(objects(chart, {}), "ConfigMap")
    path.write_text(cm["data"]["defaults.yaml"])
    pod, args, kv_pull = _worker_and_router(
        render(parse_spec(base), "svc", "ns", "uid", load_settings(str(path))), "decode"
    )
    assert not {"--kv-tier-bytes", "--kv-tier-dir", "--no-kv-pull", "--max-pull-blocks"} & set(args)
    assert kv_pull is None
