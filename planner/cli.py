"""`splitserve planner`: the SLA planner as a process.

    splitserve planner --cluster [--lease-namespace NS] [knobs]     every planner-managed service
    splitserve planner --namespace NS --name SVC --router-metrics URL --profile F --ttft-slo-ms N --itl-slo-ms N

`--cluster` (what the Helm chart runs): leader-elected on a Lease, it finds every
InferenceService with autoscaling provider planner through the operator's ConfigMaps and runs one
control loop per service (planner/cluster.py); the SLO, bounds and profile come from there, the
knobs below from the command line. Without `--cluster`, one InferenceService:

Every tick it scrapes the router's /metrics (`--router-metrics`, every router replica: their
counters add up), turns `splitserve_router_demand_tokens_total` into rates and
`splitserve_router_workers{role,state="healthy"}` into ready replicas, reads measured latency
over the last `peak_window_s` (planner/window.py: the routers' TTFT histogram, minus the KV
transfer time and with the ITL histogram of the decode workers named by `--decode-metrics`),
runs planner/law.py, and serves the decision at /v1/desired/<namespace>/<name> for KEDA's metrics-api trigger and
on /metrics (planner/server.py). A scrape that fails is a missing sample: the planner holds.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from splitserve.planner import signals as S
from splitserve.planner.config import PlannerConfig, PoolBounds
from splitserve.planner.law import Observation, Planner, PoolObservation
from splitserve.planner.profile import CapacityProfile
from splitserve.planner.server import DesiredStore, serve
from splitserve.planner.window import ScrapeWindow, measured_latency

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("planner", help="the SLA planner (serves KEDA's JSON or writes scale)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="plan every InferenceService with provider planner, leader-elected on a Lease",
    )
    p.add_argument("--kubeconfig", help="--cluster outside a cluster (default: in-cluster, $KUBECONFIG)")
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", ""),
        help="namespace of the Lease (default: $POD_NAMESPACE)",
    )
    p.add_argument("--lease-name", default="splitserve-planner")
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or socket.gethostname(),
        help="this replica's name in the Lease (default: $POD_NAME, else the host name)",
    )
    p.add_argument("--lease-duration", type=float, default=15.0, help="seconds; renew deadline 2/3, retry 1/5 of it")
    p.add_argument("--namespace", help="one InferenceService's namespace (without --cluster)")
    p.add_argument("--name", help="the InferenceService (without --cluster)")
    p.add_argument(
        "--router-metrics",
        action="append",
        metavar="URL",
        help="a router replica's /metrics URL (repeatable; without --cluster)",
    )
    p.add_argument(
        "--decode-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a decode worker's /metrics URL, for measured ITL and KV-transfer time (repeatable; without --cluster)",
    )
    p.add_argument("--profile", help="capacity profile JSON (`splitserve profile`; without --cluster)")
    p.add_argument("--ttft-slo-ms", type=int, default=2000)
    p.add_argument("--itl-slo-ms", type=int, default=100)
    p.add_argument("--tick", type=float, default=15.0)
    p.add_argument("--headroom", type=float, default=0.1)
    p.add_argument("--utilization", type=float, default=0.8)
    p.add_argument("--down-threshold", type=float, default=0.7)
    p.add_argument("--scale-down-window", type=float, default=300.0)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=8)
    p.add_argument("--budget", type=int, default=0, help="most replicas of both pools (0: none)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8090)
    p.set_defaults(func=cmd_planner)


def config_from_args(args) -> PlannerConfig:
    bounds = PoolBounds(args.min_replicas, args.max_replicas)
    return PlannerConfig(
        ttft_p90_s=args.ttft_slo_ms / 1000,
        itl_p90_s=args.itl_slo_ms / 1000,
        tick_s=args.tick,
        headroom=args.headroom,
        utilization=args.utilization,
        down_threshold=args.down_threshold,
        scale_down_window_s=args.scale_down_window,
        peak_window_s=max(60.0, 4 * args.tick),
        budget=args.budget,
        prefill=bounds,
        decode=bounds,
    )


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def scrape(urls: list[str]) -> dict | None:
    """Summed router counters and healthy workers, and each router's flattened metrics ("flat":
    url -> signals.flatten); None if any router could not be read."""
    out = {"uncached_prompt": 0.0, "output": 0.0, "prefill": 0, "decode": 0, "flat": {}}
    for url in urls:
        try:
            text = _get(url)
        except OSError as e:
            log.warning("planner: cannot read %s (%s); holding", url, e)
            return None
        out["flat"][url] = S.flatten(text)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "splitserve_router_demand_tokens_total" and s.labels.get("kind") in out:
                    out[s.labels["kind"]] += s.value
                elif (
                    s.name == "splitserve_router_workers"
                    and s.labels.get("state") == "healthy"
                    and s.labels.get("role") in ("prefill", "decode")
                ):
                    out[s.labels["role"]] += int(s.value)
    return out


class PlannerProcess:
    """One tick = scrape, rates, decide, publish. `tick` is separate from the loop for tests."""

    def __init__(
        self,
        planner: Planner,
        store: DesiredStore,
        namespace: str,
        name: str,
        urls: list[str],
        decode_urls: list[str] = (),
    ):
        self.planner, self.store, self.namespace, self.name, self.urls = planner, store, namespace, name, urls
        self.decode_urls = list(decode_urls)
        self.last: tuple[float, dict] | None = None
        self.latency = ScrapeWindow(planner.cfg.peak_window_s)

    def _scrape_decode(self, now: float) -> None:
        for url in self.decode_urls:
            try:
                flat = S.flatten(_get(url))
            except (OSError, ValueError) as e:
                log.warning("planner: cannot read %s (%s)", url, e)
                flat = None
            self.latency.add(now, f"decode/{url}", flat)

    def tick(self, now: float) -> None:
        sample = scrape(self.urls)
        prompt_rate = output_rate = None
        ready = {"prefill": 0, "decode": 0}
        if sample is not None:
            ready = {k: sample[k] for k in ready}
            if self.last is not None and now > self.last[0]:
                dt = now - self.last[0]
                prompt_rate = max(0.0, sample["uncached_prompt"] - self.last[1]["uncached_prompt"]) / dt
                output_rate = max(0.0, sample["output"] - self.last[1]["output"]) / dt
            self.last = (now, sample)
            for url, flat in sample["flat"].items():
                self.latency.add(now, f"router/{url}", flat)
        self._scrape_decode(now)
        ttft, itl = measured_latency(self.latency.delta("router/"), self.latency.delta("decode/"))
        current = self.planner.targets()
        obs = Observation(
            now=now,
            uncached_prompt_tokens_per_s=prompt_rate,
            output_tokens_per_s=output_rate,
            prefill=PoolObservation(ready["prefill"], max(0, current["prefill"] - ready["prefill"])),
            decode=PoolObservation(ready["decode"], max(0, current["decode"] - ready["decode"])),
            ttft_p90_s=ttft,
            itl_p90_s=itl,
        )
        self.store.publish(self.namespace, self.name, self.planner.tick(obs))


def cmd_planner(args) -> int:
    if args.cluster:
        return cmd_cluster(args)
    missing = [
        f"--{n.replace('_', '-')}" for n in ("namespace", "name", "router_metrics", "profile") if not getattr(args, n)
    ]
    if missing:
        raise SystemExit(f"splitserve planner: without --cluster, {', '.join(missing)} are required")
    planner = Planner(config_from_args(args), CapacityProfile.load(args.profile))
    store = DesiredStore()
    server = serve(store, args.host, args.port)
    proc = PlannerProcess(planner, store, args.namespace, args.name, args.router_metrics, args.decode_metrics)
    print(f"splitserve planner: serving :{server.server_port}/v1/desired/{args.namespace}/{args.name}", flush=True)
    try:
        while True:
            proc.tick(time.monotonic())
            time.sleep(args.tick)
    except KeyboardInterrupt:
        return 0
    finally:
        server.shutdown()


def cmd_cluster(args) -> int:
    from splitserve.planner.cluster import ClusterPlanner
    from splitserve.planner.kube import KubeClient, load_configuration
    from splitserve.planner.lease import LeaderElector, LeaseConfig

    if not args.lease_namespace:
        raise SystemExit("splitserve planner --cluster: --lease-namespace (or $POD_NAMESPACE) is required")
    d = args.lease_duration
    lease = LeaseConfig(args.lease_namespace, args.lease_name, args.identity, d, d * 2 / 3, d / 5)
    store = DesiredStore()
    store.set_leader(False)
    kube = KubeClient(load_configuration(args.kubeconfig))
    cluster = ClusterPlanner(kube, LeaderElector(kube, lease), store, config_from_args(args))
    server = serve(store, args.host, args.port)
    signal.signal(signal.SIGTERM, _interrupt)  # the pod's stop: release the lease on the way out
    print(
        f"splitserve planner: cluster mode as {args.identity}, lease {args.lease_namespace}/{args.lease_name}, "
        f"serving :{server.server_port}",
        flush=True,
    )
    try:
        while True:
            try:
                cluster.step()
            except Exception:  # an API outage must not end the process; the lease logic steps down
                log.exception("planner step failed")
            time.sleep(lease.retry_s)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.elector.release()
        server.shutdown()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
