"""The cluster planner (planner/cluster.py) against the operator's real output, on an emulated
Kubernetes API: kmock (no API server can run here; opkit_emulator.py adds label selectors,
Leases, Pods and the Deployment scale subresource). The operator renders and applies the
InferenceService's children; the tests play the missing controllers (they create the pods);
the routers' and workers' /metrics are the real metrics classes' expositions.

Covered: two planner replicas on one Lease, only the leader decides and writes; when the
leader's lease lapses the standby takes over and continues from the Deployments' counts; scale
writes without KEDA and the operator leaving those replicas alone; pending pods read from the
API; measured TTFT/ITL and per-replica throughput reaching the law, with the warm-up exclusion.
"""

from __future__ import annotations

import datetime
import urllib.error
import urllib.request

import pytest
from opkit_kube import create_isvc
from prometheus_client import generate_latest
from workerproc import free_port

from splitserve.operator import kube as K
from splitserve.operator.apply import apply_all
from splitserve.operator.constants import LABEL_LWS_WORKER_INDEX as LWS_INDEX
from splitserve.operator.context import Context, instance_selector
from splitserve.operator.render import render
from splitserve.operator.settings import OperatorSettings
from splitserve.operator.spec import parse_spec
from splitserve.planner.cluster import ClusterPlanner
from splitserve.planner.config import PlannerConfig
from splitserve.planner.kube import KubeClient, KubeError, load_configuration
from splitserve.planner.lease import LeaderElector, LeaseConfig
from splitserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from splitserve.planner.server import DesiredStore, serve
from splitserve.router.metrics import RouterMetrics
from splitserve.workers.metrics import WorkerMetrics

PROFILE = CapacityProfile(
    prefill=(PrefillPoint(512, 1000.0),),
    decode=(DecodePoint(512, 1, 20.0, 0.05), DecodePoint(512, 8, 80.0, 0.1)),
    kv_tokens=100_000,
)
AUTO = {"enabled": True, "provider": "planner", "minReplicas": 1, "maxReplicas": 6}
SPEC = {
    "model": {"uri": "smollm2-135m"},
    "kvTransfer": {"transport": "tcp"},
    "slo": {"ttftP90Ms": 2000, "itlP90Ms": 100},
    "prefill": {"autoscaling": AUTO},
    "decode": {"autoscaling": AUTO},
}
# tick 10 s; a scale-down window longer than any test, so only scale-up happens here; pod ages come
# from the wall clock, so the warm-up (1 h) is far from both the young (5 s) and the warm (1 day) pods
BASE = PlannerConfig(tick_s=10.0, scale_down_window_s=3600.0, warmup_s=3600.0)
DEPLOYMENTS = "apps/v1/deployments"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Service:
    """One InferenceService applied by the operator's code, plus fake pods with real metrics."""

    def __init__(self, cluster, kube, namespace, export="scale", settings=None, spec=None):
        self.cluster, self.kube, self.ns, self.spec = cluster, kube, namespace, spec or SPEC
        self.settings = settings or OperatorSettings.model_validate(
            {"autoscaling": {"plannerExport": export, "plannerProfile": PROFILE.to_json()}}
        )
        self.owner = create_isvc(kube, "svc", namespace, self.spec)
        self.apply()
        self.metrics: dict[str, object] = {}  # pod IP -> metrics object
        self.router = RouterMetrics()
        self.add_pod("router", "svc-router-0", self.router, ready_since_s=3600)
        self.workers = {p: WorkerMetrics(p, "smollm2") for p in ("prefill", "decode")}
        for pool, m in self.workers.items():
            if self.context().spec.decode.is_multi_node and pool == "decode":  # a group: a leader and a worker pod
                self.add_pod(pool, "svc-decode-group-0", m, ready_since_s=86400, labels={LWS_INDEX: "0"})
                self.add_pod(pool, "svc-decode-group-0-1", ready_since_s=86400, labels={LWS_INDEX: "1"})
            else:
                self.add_pod(pool, f"svc-{pool}-0", m, ready_since_s=86400)

    def apply(self):
        manifests = render(parse_spec(self.spec), "svc", self.ns, self.owner["metadata"]["uid"], self.settings)
        return apply_all(self.kube, manifests, self.ns, instance_selector("svc"), self.owner["metadata"]["uid"])

    def context(self) -> Context:
        return Context(parse_spec(self.spec), "svc", self.ns, self.owner["metadata"]["uid"], self.settings)

    def add_pod(self, component, name, metrics=None, ready_since_s=None, created_s_ago=0.0, labels=None):
        now = datetime.datetime.now(datetime.UTC)
        ip = f"10.0.0.{len(self.metrics) + 1}"
        labels = {
            "app.kubernetes.io/name": "splitserve",
            "app.kubernetes.io/instance": "svc",
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "splitserve-operator",
            **(labels or {}),
        }
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": self.ns, "labels": labels},
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]},
        }
        url = K.path(K.KindInfo("v1", "Pod", "pods"), self.ns)
        self.kube.create(url, body)
        created = (now - datetime.timedelta(seconds=created_s_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
        patch = {"metadata": {"creationTimestamp": created}}
        if ready_since_s is not None:
            since = (now - datetime.timedelta(seconds=ready_since_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
            patch["status"] = {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": since}],
            }
            self.metrics[ip] = metrics
        self.kube.merge_patch(f"{url}/{name}", patch)

    def fetch(self, url: str) -> str:
        ip = url.split("//")[1].split(":")[0]
        m = self.metrics[ip]
        return (m.render() if isinstance(m, WorkerMetrics) else generate_latest(m.registry)).decode()

    def replicas(self, pool: str) -> int:
        api_version, kind, name = self.context().workload(pool)
        resource = DEPLOYMENTS if kind == "Deployment" else f"{api_version}/leaderworkersets"
        return self.cluster.get(resource, self.ns, name)["spec"]["replicas"]

    def load(self, seconds: float, prompt_per_s: float, output_per_s: float) -> None:
        self.router.count_tokens(int(prompt_per_s * seconds), int(output_per_s * seconds), True)


def planner_replica(cluster, identity, svc, clock, lease_ns="planner-system"):
    kube = KubeClient(load_configuration(cluster.kubeconfig_path))
    elector = LeaderElector(kube, LeaseConfig(lease_ns, "splitserve-planner", identity, 15.0, 10.0, 2.0), clock=clock)
    return ClusterPlanner(kube, elector, DesiredStore(), BASE, fetch=svc.fetch, clock=clock)


def run_for(planners_and_clocks, seconds, step_s=2.0):
    """Advance every clock by `seconds` in steps, stepping each planner once per step."""
    for _ in range(int(seconds / step_s)):
        for planner, clock in planners_and_clocks:
            clock.t += step_s
            planner.step()


def scale_writes(cluster, namespace):
    return [w for w in cluster.writes_since(0, namespace) if w.subresource == "scale"]


def test_two_replicas_one_decides_and_the_standby_takes_over_when_the_lease_lapses(cluster, kube, namespace):
    svc = Service(cluster, kube, namespace)
    ca, cb = Clock(), Clock()
    a, b = planner_replica(cluster, "planner-a", svc, ca), planner_replica(cluster, "planner-b", svc, cb)
    assert a.step() is True and b.step() is False
    server_a, server_b = serve(a.store, "127.0.0.1", free_port()), serve(b.store, "127.0.0.1", free_port())
    try:
        run_for([(a, ca), (b, cb)], 10)  # baseline scrape, then a tick of load
        svc.load(10, 3000, 64)
        run_for([(a, ca), (b, cb)], 10)
        # prefill: ceil(3,300 / 800) = 5, at most doubling from 1 → 2, written by the leader alone
        assert svc.replicas("prefill") == 2
        assert a.scale_writes >= 1 and b.scale_writes == 0
        svc.add_pod("prefill", "svc-prefill-1", WorkerMetrics("prefill", "smollm2"), ready_since_s=1)
        assert len(scale_writes(cluster, namespace)) == a.scale_writes
        for server, code in ((server_a, 200), (server_b, 503)):
            for path in ("/ready", f"/v1/desired/{namespace}/svc"):
                try:
                    status = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}{path}", timeout=30).status
                except urllib.error.HTTPError as e:
                    status = e.code
                assert status == code, (server is server_a, path)
        lease = cluster.get("coordination.k8s.io/v1/leases", "planner-system", "splitserve-planner")
        assert lease["spec"]["holderIdentity"] == "planner-a" and lease["spec"]["leaseTransitions"] == 0

        # planner-a stops (its node is gone): no renewals. planner-b waits out the lease and takes over.
        run_for([(b, cb)], 14)
        assert b.elector.is_leader is False
        run_for([(b, cb)], 4)
        assert b.elector.is_leader is True
        lease = cluster.get("coordination.k8s.io/v1/leases", "planner-system", "splitserve-planner")
        assert lease["spec"]["holderIdentity"] == "planner-b" and lease["spec"]["leaseTransitions"] == 1
        # planner-b continues from the Deployments' counts (not the floor): its first tick holds 2
        assert b.store.desired(namespace, "svc")["prefill"] == 2 and svc.replicas("prefill") == 2
        svc.load(10, 3000, 64)
        run_for([(b, cb)], 10)
        assert svc.replicas("prefill") == 4 and b.scale_writes >= 1  # 2 → min(5, 2×2)
        # planner-a comes back: it sees planner-b's live lease and stays a follower
        ca.t = cb.t
        assert a.step() is False and a.store.leader is False and not a.loops
        written = a.scale_writes
        run_for([(a, ca), (b, cb)], 20)
        assert a.scale_writes == written
        assert len(scale_writes(cluster, namespace)) == a.scale_writes + b.scale_writes
    finally:
        for s in (server_a, server_b):
            s.shutdown()
            s.server_close()


def test_released_lease_is_taken_at_once_and_a_lost_race_leaves_one_leader(cluster, kube, namespace):
    svc = Service(cluster, kube, namespace)
    ca, cb = Clock(), Clock()
    a, b = planner_replica(cluster, "planner-a", svc, ca), planner_replica(cluster, "planner-b", svc, cb)
    assert a.step() and not b.step()
    a.elector.release()  # planner-a shuts down cleanly
    assert not a.elector.is_leader and b.step()  # no lease duration to wait out
    # A stale view: planner-a patches with the resourceVersion it saw before planner-b's write.
    lease_url = "/apis/coordination.k8s.io/v1/namespaces/planner-system/leases/splitserve-planner"
    stale = a.elector.kube.get(lease_url)["metadata"]["resourceVersion"]
    cb.t += 2
    assert b.step()  # planner-b renews: the version moves on
    with pytest.raises(KubeError) as e:
        a.elector.kube.json_patch(
            lease_url,
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": stale},
                {"op": "replace", "path": "/spec/holderIdentity", "value": "planner-a"},
            ],
        )
    assert e.value.status in (409, 422)
    assert (
        cluster.get("coordination.k8s.io/v1/leases", "planner-system", "splitserve-planner")["spec"]["holderIdentity"]
        == "planner-b"
    )


def test_scale_export_renders_no_autoscaler_and_the_operator_leaves_planner_replicas_alone(cluster, kube, namespace):
    svc = Service(cluster, kube, namespace, export="scale")
    assert cluster.get("keda.sh/v1alpha1/scaledobjects", namespace, "svc-prefill") is None
    assert cluster.get("keda.sh/v1alpha1/scaledobjects", namespace, "svc-decode") is None
    clock = Clock()
    p = planner_replica(cluster, "planner-a", svc, clock)
    run_for([(p, clock)], 10)
    svc.load(10, 0, 250)  # decode: ceil(275 / 64) = 5 → at most ×2 = 2
    run_for([(p, clock)], 10)
    assert svc.replicas("decode") == 2 and svc.replicas("prefill") == 1
    mark = len(cluster.cluster.writes)
    result = svc.apply()  # the operator's resync
    assert svc.replicas("decode") == 2, "the operator must not reset a planner-owned pool's replicas"
    assert not [w for w in cluster.writes_since(mark, namespace) if w.plural == "deployments"], result
    # and with export keda, the same service gets KEDA ScaledObjects instead of scale writes
    keda = OperatorSettings.model_validate(
        {"autoscaling": {"plannerExport": "keda", "plannerProfile": PROFILE.to_json()}}
    )
    svc.settings = keda
    svc.apply()
    assert cluster.get("keda.sh/v1alpha1/scaledobjects", namespace, "svc-decode") is not None


def test_pending_pods_from_the_api_hold_scale_up_and_a_stuck_one_caps_it(cluster, kube, namespace):
    svc = Service(cluster, kube, namespace)
    clock = Clock()
    p = planner_replica(cluster, "planner-a", svc, clock)
    run_for([(p, clock)], 10)
    svc.load(10, 0, 250)
    run_for([(p, clock)], 10)
    assert svc.replicas("decode") == 2
    svc.add_pod("decode", "svc-decode-1")  # the second pod: created, not Ready yet
    svc.load(10, 0, 500)  # more load while it is Pending
    run_for([(p, clock)], 10)
    assert svc.replicas("decode") == 2
    assert p.store.desired(namespace, "svc")["reasons"]["decode"] == "wait_pending"
    svc.kube.merge_patch(
        K.path(K.KindInfo("v1", "Pod", "pods"), namespace, "svc-decode-1"),  # it turns Ready
        {
            "status": {
                "phase": "Running",
                "podIP": "10.0.1.1",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}],
            }
        },
    )
    svc.metrics["10.0.1.1"] = WorkerMetrics("decode", "smollm2")
    svc.load(10, 0, 500)
    run_for([(p, clock)], 10)
    assert svc.replicas("decode") == 4  # 2 ready → ×2
    # two new pods stay Pending past the timeout (no room in the cluster): at most ready + 1
    svc.add_pod("decode", "svc-decode-2", created_s_ago=1000)
    svc.add_pod("decode", "svc-decode-3", created_s_ago=1000)
    svc.load(10, 0, 500)
    run_for([(p, clock)], 10)
    assert p.store.desired(namespace, "svc")["reasons"]["decode"] == "capped_pending"
    assert svc.replicas("decode") == 3


def test_measured_itl_trims_and_warm_replicas_correct_capacity_young_ones_do_not(cluster, kube, namespace):
    svc = Service(cluster, kube, namespace)
    young = WorkerMetrics("decode", "smollm2")
    svc.add_pod("decode", "svc-decode-young", young, ready_since_s=5)
    clock = Clock()
    p = planner_replica(cluster, "planner-a", svc, clock)
    run_for([(p, clock)], 10)
    loop = p.loops[(namespace, "svc")]
    # the young replica is busy and fast (400 tokens/s) but within its warm-up: ignored
    young.waiting.set(3)
    for _ in range(4000):
        young.itl.observe(0.01)
    svc.load(10, 0, 10)
    run_for([(p, clock)], 10)
    assert loop.planner.online.capacity("decode", 64.0) == 64.0
    # the warm replica is busy, serves 200 tokens/s within the ITL SLO: capacity corrected up
    warm = svc.workers["decode"]
    warm.waiting.set(2)
    for _ in range(2000):
        warm.itl.observe(0.05)
    svc.load(10, 0, 10)
    run_for([(p, clock)], 10)
    assert loop.planner.online.capacity("decode", 64.0) == pytest.approx(200.0, rel=0.01)
    # measured ITL p90 above the 100 ms SLO → the law's latency trim adds a replica
    warm.waiting.set(0)
    young.waiting.set(0)
    for _ in range(100):
        warm.itl.observe(0.4)
    svc.load(10, 0, 10)
    run_for([(p, clock)], 10)
    body = p.store.desired(namespace, "svc")
    assert body["decode"] == 2 and body["reasons"]["decode"] == "scale_up" and svc.replicas("decode") == 2
    text = generate_latest(p.store.registry).decode()
    assert f'splitserve_planner_latency_trim_replicas{{name="svc",namespace="{namespace}",pool="decode"}} 1.0' in text


def test_the_planner_reads_the_profile_configmap_the_service_names_and_holds_without_one(cluster, kube, namespace):
    spec = {**SPEC, "slo": {**SPEC["slo"], "profileConfigMap": "h100-profile"}}
    settings = OperatorSettings.model_validate({"autoscaling": {"plannerExport": "scale"}})  # no chart profile
    svc = Service(cluster, kube, namespace, settings=settings, spec=spec)
    clock = Clock()
    p = planner_replica(cluster, "planner-a", svc, clock)
    p.step()
    assert p.store.desired(namespace, "svc") is None  # no profile yet: no decision, KEDA would keep its count
    fast = CapacityProfile(prefill=(PrefillPoint(512, 4000.0),), decode=PROFILE.decode, kv_tokens=100_000)
    kube.create(
        K.path(K.KIND_BY_NAME["ConfigMap"], namespace),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "h100-profile", "namespace": namespace},
            "data": {"profile.json": fast.to_json()},
        },
    )
    run_for([(p, clock)], 10)
    svc.load(10, 3000, 64)
    run_for([(p, clock)], 10)
    # prefill with the named profile: ceil(3,300 / (4,000 × 0.8)) = 2
    text = generate_latest(p.store.registry).decode()
    assert (
        f'splitserve_planner_capacity_tokens_per_second{{name="svc",namespace="{namespace}",pool="prefill"}} 4000.0'
        in text
    )
    assert p.store.desired(namespace, "svc")["prefill"] == 2


def test_the_planner_command_leads_serves_ready_and_releases_its_lease_on_sigterm(cluster, tmp_path):
    """`splitserve planner --cluster` as a process, on the emulated API."""
    import signal
    import subprocess
    import sys
    import time

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "splitserve.platform.cli",
        "planner",
        "--cluster",
        "--kubeconfig",
        cluster.kubeconfig_path,
        "--lease-namespace",
        "planner-system",
        "--identity",
        "planner-p1",
        "--lease-duration",
        "6",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            time.sleep(0.2)
        lease = cluster.get("coordination.k8s.io/v1/leases", "planner-system", "splitserve-planner")
        assert lease["spec"]["holderIdentity"] == "planner-p1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        lease = cluster.get("coordination.k8s.io/v1/leases", "planner-system", "splitserve-planner")
        assert lease["spec"]["holderIdentity"] == ""  # released: a standby need not wait
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_multi_node_pool_is_planned_and_scaled_in_groups(tmp_path):
    """A decode pool of 2-pod workers (a LeaderWorkerSet) on kmock's emulated API with the LeaderWorkerSet API
    installed: the planner reads the set's replicas, counts its leader pod (not the other pod of the group) as
    the one ready decode replica, and writes the set's scale subresource."""
    from opkit_emulator import ClusterThread

    spec = {**SPEC, "decode": {"autoscaling": AUTO, "tensorParallelSize": 2, "nodes": 2}}
    with ClusterThread(with_leader_worker_set=True) as cluster:
        cluster.kubeconfig_path = cluster.kubeconfig(str(tmp_path / "kubeconfig"))
        kube = KubeClient(load_configuration(cluster.kubeconfig_path))
        svc = Service(cluster, kube, "llm", export="scale", spec=spec)
        clock = Clock()
        p = planner_replica(cluster, "planner-a", svc, clock)
        run_for([(p, clock)], 10)
        selector = p.loops[("llm", "svc")].plan.decode.selector  # what the planner lists as decode replicas
        listed = kube.list(K.path(K.KindInfo("v1", "Pod", "pods"), "llm"), selector)
        assert [pod["metadata"]["name"] for pod in listed] == ["svc-decode-group-0"]
        svc.load(10, 0, 250)  # decode: ceil(275 / 64) = 5 → at most ×2 = 2 groups
        run_for([(p, clock)], 10)
        assert svc.replicas("decode") == 2 and svc.replicas("prefill") == 1
        writes = [(w.plural, w.name) for w in scale_writes(cluster, "llm")]
        assert writes and set(writes) == {("leaderworkersets", "svc-decode-group")}
