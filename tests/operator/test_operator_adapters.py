"""spec.adapters changes in place: the operator, a real router process and real workers.

The Kubernetes API is kmock, an in-memory emulator (no API server can run here; see
opkit_emulator.py): it stores the objects and serves the API the operator and the router use,
but runs no kubelet and no controllers. The test plays the kubelet twice: it starts the pods'
processes itself (one prefill and one decode `splitserve worker` with the real SmolLM2 weights,
and one `splitserve router` reading the rendered router.yaml), and it copies the router
ConfigMap's keys into the folder the router reads, as the kubelet refreshes a mounted
ConfigMap. The router's discovery is the static list of the two workers instead of their
EndpointSlices (nothing makes slices here), and its mTLS files are the test's; every other key
of router.yaml is the operator's. The router writes its adapter report into the emulated API.

Shown: changing spec.adapters leaves every Deployment untouched (same pod templates, no
Deployment write at all), the running router loads the new adapter and unloads the removed one
on both workers, an adapter request is answered with the adapter, and the InferenceService
status lists per pool what is loaded (AdaptersLoaded follows).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from lora_folders import write_adapter
from opkit_kube import create_isvc, mark_ready, wait_for
from workerproc import CLI, ROUTER_STALE_AFTER_S, WorkerProc, free_port, security

from splitserve.operator import constants as C
from splitserve.operator import kube as K
from splitserve.operator.reconcile import reconcile
from splitserve.operator.settings import OperatorSettings

pytestmark = pytest.mark.slow

NAME = "svc"
DEPLOYMENTS = "apps/v1/deployments"
SETTINGS = OperatorSettings()


class RouterProc:
    """`splitserve router --config <folder>/router.yaml`, the folder holding the ConfigMap's keys."""

    def __init__(self, folder: pathlib.Path, kubeconfig: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [CLI, "--log-level", "INFO", "router", "--config", str(folder / "router.yaml"), "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "KUBECONFIG": kubeconfig, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.proc.stdout], daemon=True).start()

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=180) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")
        except OSError:
            return 0, {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def kubelet_sync(cluster, namespace: str, folder: pathlib.Path, workers: list[WorkerProc]) -> None:
    """Write the router ConfigMap's keys where the router reads them (the kubelet's job), with the
    test's discovery and credentials in router.yaml and the adapters file at its folder path."""
    cm = cluster.get("v1/configmaps", namespace, f"{NAME}-router")
    config = yaml.safe_load(cm["data"][C.ROUTER_CONFIG_FILE])
    tls = security().tls
    config["discovery"] = {
        "workers": [w.address for w in workers],
        "tls_cert": tls.cert,
        "tls_key": tls.key,
        "tls_ca": tls.ca,
        "stale_after_s": ROUTER_STALE_AFTER_S,
    }
    config["adapters"].update(file=str(folder / C.ROUTER_ADAPTERS_FILE), poll_s=0.5)
    (folder / "router.yaml").write_text(yaml.safe_dump(config))
    tmp = folder / "adapters.tmp"
    tmp.write_text(cm["data"][C.ROUTER_ADAPTERS_FILE])
    tmp.replace(folder / C.ROUTER_ADAPTERS_FILE)  # atomic, as the kubelet's ..data swap


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("isvc-adapters")
    return {
        "sql": write_adapter(root / "sql", alpha=128, modules=("q_proj", "v_proj", "gate_proj"), seed=31),
        "chat": write_adapter(root / "chat", r=16, alpha=256, modules=("k_proj", "o_proj"), seed=32),
    }


@pytest.fixture(scope="module")
def workers():
    procs = [WorkerProc("prefill"), WorkerProc("decode")]
    try:
        for w in procs:
            w.start()
        yield procs
    finally:
        for w in procs:
            w.terminate()


def status_of(kube, namespace: str) -> dict:
    return kube.get(K.path(K.ISVC, namespace, NAME)).get("status") or {}


def reconciled_status(kube, namespace: str) -> dict:
    """One operator run (as its resync timer does, here every 0.5 s), then the status it wrote."""
    time.sleep(0.5)
    reconcile(kube, SETTINGS, namespace, NAME)
    return status_of(kube, namespace)


def test_changing_spec_adapters_loads_and_unloads_in_place(cluster, kube, namespace, tmp_path, adapters, workers):
    spec = {
        "model": {"uri": "smollm2-135m"},
        "kvTransfer": {"transport": "tcp"},
        "adapters": [{"name": "sql", "uri": adapters["sql"]}],
    }
    create_isvc(kube, NAME, namespace, spec)
    reconcile(kube, SETTINGS, namespace, NAME)
    for pool in ("prefill", "decode", "router"):
        mark_ready(kube, namespace, f"{NAME}-{pool}")
    templates = {
        p: cluster.get(DEPLOYMENTS, namespace, f"{NAME}-{p}")["spec"]["template"]
        for p in ("prefill", "decode", "router")
    }
    kubelet_sync(cluster, namespace, tmp_path, workers)
    router = RouterProc(tmp_path, cluster.kubeconfig_path)
    try:
        # At start the router loads the declared adapter on both workers and reports it.
        status = wait_for(
            lambda: (
                (s := reconciled_status(kube, namespace)).get("decode", {}).get("adapters") == ["sql"]
                and s.get("prefill", {}).get("adapters") == ["sql"]
                and s
            ),
            timeout=600,
            what="the router up and sql loaded on both pools",
        )
        loaded = next(c for c in status["conditions"] if c["type"] == "AdaptersLoaded")
        assert loaded["status"] == "True", loaded
        code, body = router.call(
            "POST", "/v1/completions", {"model": "sql", "prompt": "SELECT", "max_tokens": 4, "temperature": 0}
        )
        assert code == 200 and body["model"] == "sql", body
        # The declared set has one writer: the API refuses to change it.
        code, body = router.call("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["chat"]})
        assert code == 409 and "spec.adapters" in body["error"]["message"]

        # The change: sql out, chat in. No Deployment is written, no template differs.
        mark = len(cluster.cluster.writes)
        kube.merge_patch(
            K.path(K.ISVC, namespace, NAME), {"spec": {"adapters": [{"name": "chat", "uri": adapters["chat"]}]}}
        )
        reconcile(kube, SETTINGS, namespace, NAME)
        writes = cluster.writes_since(mark, namespace)
        assert not [w for w in writes if w.plural == "deployments"], writes
        assert {(w.plural, w.name) for w in writes if w.subresource is None} <= {
            ("inferenceservices", NAME),
            ("configmaps", f"{NAME}-router"),
        }, writes
        for pool, template in templates.items():
            assert cluster.get(DEPLOYMENTS, namespace, f"{NAME}-{pool}")["spec"]["template"] == template
        kubelet_sync(cluster, namespace, tmp_path, workers)

        status = wait_for(
            lambda: (
                (s := reconciled_status(kube, namespace)).get("decode", {}).get("adapters") == ["chat"]
                and s.get("prefill", {}).get("adapters") == ["chat"]
                and s
            ),
            timeout=240,
            what="chat loaded and sql unloaded on both pools",
        )
        loaded = next(c for c in status["conditions"] if c["type"] == "AdaptersLoaded")
        assert loaded["status"] == "True", loaded
        code, body = router.call("GET", "/v1/models")
        assert sorted(m["id"] for m in body["data"]) == ["chat", "smollm2-135m"]
        code, body = router.call("POST", "/v1/completions", {"model": "sql", "prompt": "SELECT", "max_tokens": 4})
        assert code == 404
        assert router.proc.poll() is None and all(w.proc.poll() is None for w in workers)  # no process restarted
    finally:
        router.stop()
        print("router log (tail):\n" + "".join(router.lines[-40:]))
