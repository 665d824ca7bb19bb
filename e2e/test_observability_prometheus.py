"""The chart's dashboards and alerts against a real Prometheus (Debian's `prometheus` 2.42).

One `splitserve up` (router + prefill + decode worker, KV over tcp, a rate limit) and one
`splitserve planner` run on loopback; Prometheus scrapes them every second. Each target gets the
labels a ServiceMonitor would give it in a cluster (namespace, pod named <isvc>-<pool>-<hash>-<id>,
service), so the rendered PromQL is exactly what runs in production. Under a little load (long
prompts that go through a remote prefill, streamed and not, a bad request, a burst that hits the
rate limit):

- `promtool check rules` accepts the rules rendered from the chart;
- every dashboard panel's query returns data;
- every recording and alerting rule evaluates without error;
- killing the decode worker drives SplitserveWorkersNotReady to firing (its `for` set to 0s here).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from workerproc import CLI, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="Debian's prometheus package is not installed (make setup installs it)",
    ),
]

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "splitserve"
NAMESPACE, ISVC = "splitserve-test", "demo"
GRAFANA_VARS = {"$namespace": NAMESPACE, "$isvc": ISVC, "$__rate_interval": "2m"}
LONG_PROMPT = "Summarise these notes. " + " ".join(f"Note {i}: the river rose by {i} centimetres." for i in range(40))


def render_monitoring() -> tuple[dict, dict]:
    """(the dashboard, the rule groups) rendered from the chart with monitoring on."""
    import helm_python as helm

    values = {
        "monitoring": {"dashboards": {"enabled": True}, "rules": {"enabled": True, "for": {"workersNotReady": "0s"}}}
    }
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="splitserve", namespace="splitserve-system")
    docs = [d for path, text in rendered.items() if "monitoring" in path for d in yaml.safe_load_all(text) if d]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return json.loads(configmap["data"]["splitserve.json"]), {"groups": rule["spec"]["groups"]}


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((panel["title"], expr))
    return out


class Proc:
    """A process of this test with its output kept (and searched for lines)."""

    def __init__(self, argv: list[str], **kw):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            **kw,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert self.proc.poll() is None, "".join(self.lines[-40:])
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} in {timeout_s} s:\n" + "".join(self.lines[-40:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def pod(pool: str) -> str:
    return f"{ISVC}-{pool}-6b8f9c7d5-x2x9z"


def prometheus_config(tmp: pathlib.Path, rules_file: pathlib.Path, targets: dict[str, str], planner: str) -> str:
    jobs = [
        {
            "job_name": f"{ISVC}-{pool}",
            "scrape_interval": "1s",
            "static_configs": [
                {
                    "targets": [address],
                    "labels": {"namespace": NAMESPACE, "pod": pod(pool), "service": f"{ISVC}-{pool}"},
                }
            ],
        }
        for pool, address in targets.items()
    ]
    # The planner labels its series with the InferenceService's namespace: kept (honor_labels), as
    # its ServiceMonitor does.
    jobs.append(
        {
            "job_name": "splitserve-planner",
            "scrape_interval": "1s",
            "honor_labels": True,
            "static_configs": [{"targets": [planner], "labels": {"pod": "splitserve-planner-7d4b6-q8w2e"}}],
        }
    )
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules_file)],
        "scrape_configs": jobs,
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def load(base_url: str, round_: int = 0) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    chat = client.chat.completions.create
    for i in range(4):  # long prompts: remote prefill, KV over tcp; streamed and not
        messages = [{"role": "user", "content": f"({round_}.{i}) {LONG_PROMPT}"}]  # a new prompt each round
        if i % 2:
            stream = chat(model="smollm2-135m", messages=messages, max_tokens=8, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            assert chat(model="smollm2-135m", messages=messages, max_tokens=8).choices[0].message.content
        time.sleep(0.3)
    with pytest.raises(openai.BadRequestError):
        chat(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    refused = 0
    for _ in range(12):  # a burst past the rate limit (5/s, burst 5)
        try:
            client.models.list()
        except openai.RateLimitError:
            refused += 1
    assert refused > 0


def worker_pid(metrics_port: str) -> int:
    """The pid of the `splitserve worker` (started by this test's `up`) listening on that metrics port
    (`up` starts its workers on port 0; the READY line names the port each one bound)."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == int(metrics_port) and conn.pid:
            return conn.pid
    raise AssertionError(f"no process listens on metrics port {metrics_port}")


def test_dashboards_and_alerts_against_a_real_prometheus(tmp_path):
    dashboard, groups = render_monitoring()
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(groups))
    check = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout

    port, planner_port, prom_port = free_port(), free_port(), free_port()
    procs: list[Proc] = []
    try:
        up = Proc(
            [
                CLI,
                "--log-level",
                "INFO",
                "up",
                "--port",
                str(port),
                "--kv-transport",
                "tcp",
                "--rate-limit",
                "5",
                "--kv-cache-memory",
                "0.25",
            ]
        )
        procs.append(up)
        up.wait_line(r"splitserve up: serving", 300)
        metrics = {
            role: up.wait_line(rf"\[{role}\] READY grpc=\S+ metrics=(\d+)", 5).group(1)
            for role in ("prefill", "decode")
        }
        router_metrics = f"http://127.0.0.1:{port}/metrics"
        planner = Proc(
            [
                CLI,
                "planner",
                "--namespace",
                NAMESPACE,
                "--name",
                ISVC,
                "--router-metrics",
                router_metrics,
                "--decode-metrics",
                f"http://127.0.0.1:{metrics['decode']}/metrics",
                "--profile",
                str(ROOT / "bench" / "profiles" / "smollm2-135m-cpu2.json"),
                "--tick",
                "1",
                "--max-replicas",
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                str(planner_port),
            ]
        )
        procs.append(planner)
        targets = {
            "router": f"127.0.0.1:{port}",
            "prefill": f"127.0.0.1:{metrics['prefill']}",
            "decode": f"127.0.0.1:{metrics['decode']}",
        }
        config = prometheus_config(tmp_path, rules_file, targets, f"127.0.0.1:{planner_port}")
        prom = Proc(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ]
        )
        procs.append(prom)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        prom.wait_line("Server is ready to receive web requests", 60)
        # A rate needs two samples of a series with an increase between them. A labelled histogram
        # (TTFT by model and adapter, ...) only appears with its first request, and on a quiet host
        # the whole load can fall between two scrapes: its rate is then 0 and the quantile NaN. So:
        # every target scraped, one round of load to create the series, two scrapes, the load again.
        deadline = time.monotonic() + 60
        while len(get_json(f"{api}/query?query=up%20%3D%3D%201")["data"]["result"]) < 4:
            assert time.monotonic() < deadline, get_json(f"{api}/targets")
            time.sleep(0.5)
        load(f"http://127.0.0.1:{port}/v1")
        time.sleep(2.5)
        load(f"http://127.0.0.1:{port}/v1", round_=1)
        time.sleep(3)  # a few more scrapes and rule evaluations

        def query(expr: str) -> list:
            body = get_json(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        empty = []
        for title, expr in panel_queries(dashboard):
            deadline = time.monotonic() + 20  # the planner decides every second; a scrape may lag
            while not any(math.isfinite(float(s["value"][1])) for s in query(expr)) and time.monotonic() < deadline:
                time.sleep(1)
            if not any(math.isfinite(float(s["value"][1])) for s in query(expr)):
                empty.append(f"{title}: {expr}")
        assert empty == [], "panels without data:\n" + "\n".join(empty)

        rules = [r for g in get_json(f"{api}/rules")["data"]["groups"] for r in g["rules"]]
        assert len(rules) == sum(len(g["rules"]) for g in groups["groups"])
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert bad == [], bad

        def firing() -> set[str]:
            return {
                a["labels"]["alertname"] for a in get_json(f"{api}/alerts")["data"]["alerts"] if a["state"] == "firing"
            }

        assert "SplitserveWorkersNotReady" not in firing()
        os.kill(worker_pid(metrics["decode"]), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "SplitserveWorkersNotReady" not in firing():
            assert time.monotonic() < deadline, f"SplitserveWorkersNotReady did not fire; firing: {firing()}"
            time.sleep(0.5)
        (alert,) = [
            a
            for a in get_json(f"{api}/alerts")["data"]["alerts"]
            if a["labels"]["alertname"] == "SplitserveWorkersNotReady" and a["state"] == "firing"
        ]
        assert alert["labels"]["role"] == "decode" and alert["labels"]["isvc"] == ISVC
        assert alert["labels"]["namespace"] == NAMESPACE and alert["labels"]["severity"] == "critical"
    finally:
        for p in reversed(procs):
            p.stop()
