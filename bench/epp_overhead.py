"""What the EPP path costs per request beside the splitserve gateway, both in one run.

    python bench/epp_overhead.py [--requests 24] [--rounds 2] [--rate R] [--py-spy DIR]

Two arms on the same two pinned colocated workers (bench/serving_suite.py's worker sizing and the
sweep's shared-prefix workload and KV budget), a fresh cluster per arm and round, the arms
alternating (gateway, epp, gateway, epp, ...):

    gateway   `splitserve router` with the default decode profile (the sweep's prefix+queue)
    epp       Envoy -> ext_proc `splitserve epp` -> one `splitserve sidecar` per worker
              (bench/epp_w1.py's GatewayCluster, the sweep's epp arm)

Each round sends the workload one request at a time (concurrency 1, or --rate R for a Poisson
stream), and reads every process's CPU time (user + system, its threads and children, psutil)
before and after, and over an idle 5 s before the load: so the table says, per request, how many
CPU milliseconds the routing layer (router; or Envoy + EPP + sidecars) took from the two cores
the workers share, and how much of it is idle polling. On a 2-core host every routing
millisecond is a millisecond a worker does not compute, which is what the sweep's goodput reads.
With --py-spy DIR the EPP and one sidecar are sampled (py-spy record: collapsed stacks, which
flamegraph.pl or speedscope draw) during the last epp round.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from epp_w1 import GatewayCluster  # noqa: E402
from serving_suite import Arm, Cluster, Run, bench  # noqa: E402
from sweep import kv_budget  # noqa: E402

PARAMS = {"groups": "8", "per_group": "6", "system_len": "64", "question_len": "16", "output_len": "16"}
IDLE_S = 5.0
MAX_MODEL_LEN = 256  # the sweep's: the prompt and output (96 tokens) rounded up to 256


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live children."""
    total = 0.0
    try:
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    except psutil.NoSuchProcess:
        pass
    return total


def components(arm: str, cluster) -> dict[str, list[int]]:
    """The pids of each part: workers, and the routing layer's processes."""
    procs = {p.name: p.proc.pid for p in cluster.procs}
    workers = [pid for name, pid in procs.items() if "worker" in name]
    if arm == "gateway":
        return {"workers": workers, "router": [procs["router"]]}
    sidecars = [pid for name, pid in procs.items() if name.startswith("sidecar")]
    return {"workers": workers, "envoy": [cluster.envoy.pid], "epp": [procs["epp"]], "sidecars": sidecars}


def sample(parts: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_s(pid) for pid in pids) for name, pids in parts.items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def start(arm: str, kv: int, workdir: pathlib.Path):
    if arm == "epp":
        return GatewayCluster("epp", workdir, kv, MAX_MODEL_LEN)
    return Cluster(Arm("prefix+queue", scorers="prefix+queue"), workdir, kv, MAX_MODEL_LEN)


def py_spy(pid: int, out: pathlib.Path, seconds: int) -> subprocess.Popen:
    spy = pathlib.Path(sys.executable).with_name("py-spy")
    argv = [
        str(spy),
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(seconds),
        "--subprocesses",
        "--format",
        "raw",
        "-o",
        str(out),
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def one_round(arm: str, args, workdir: pathlib.Path, tag: str, spy_dir: pathlib.Path | None) -> dict:
    kv = kv_budget(64, 16, 16, 5)
    cluster = start(arm, kv, workdir)
    try:
        parts = components(arm, cluster)
        before_idle = sample(parts)
        time.sleep(IDLE_S)
        idle = delta(sample(parts), before_idle)
        load = {"rate": args.rate} if args.rate else {"concurrency": 1}
        run = Run("shared-prefix", None, args.requests, warmup=8, params=tuple(PARAMS.items()), **load)
        spies = []
        if spy_dir is not None:
            spy_dir.mkdir(parents=True, exist_ok=True)
            for name in ("epp", "sidecars"):
                spies.append(py_spy(parts[name][0], spy_dir / f"{name}.stacks.txt", args.spy_seconds))
        before = sample(parts)
        t0 = time.monotonic()
        doc = bench(run, cluster.url, workdir, tag)
        wall = time.monotonic() - t0
        busy = delta(sample(parts), before)
        for spy in spies:
            spy.wait(args.spy_seconds + 30)
    finally:
        cluster.stop()
    s = doc["summary"]
    n = s["completed"] + 8  # the warm-up requests ran inside the measured window too
    return {
        "arm": arm,
        "requests": n,
        "wall_s": wall,
        "idle_cpu_ms_per_s": {k: 1000 * v / IDLE_S for k, v in idle.items()},
        "cpu_ms_per_request": {k: 1000 * v / n for k, v in busy.items()},
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "e2e_p50_ms": s["e2e_ms"]["p50"],
        "itl_p50_ms": s["itl_ms"]["p50"] if s.get("itl_ms") else None,
        "failed": s["failed"],
    }


def render(results: list[dict]) -> str:
    lines = [
        "| round | arm | TTFT p50 | ITL p50 | E2E p50 | CPU ms / request: workers | routing layer (by part) | idle CPU ms/s of the routing layer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results):
        cpu = r["cpu_ms_per_request"]
        routing = {k: v for k, v in cpu.items() if k != "workers"}
        idle = {k: v for k, v in r["idle_cpu_ms_per_s"].items() if k != "workers"}
        by = ", ".join(f"{k} {v:.0f}" for k, v in routing.items())
        lines.append(
            f"| {i // 2 + 1} | {r['arm']} | {r['ttft_p50_ms']:.0f} | {r['itl_p50_ms'] or 0:.0f} | {r['e2e_p50_ms']:.0f} | "
            f"{cpu['workers']:.0f} | {sum(routing.values()):.0f} ({by}) | {sum(idle.values()):.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals at R req/s (default: one at a time)")
    ap.add_argument("--py-spy", type=pathlib.Path, default=None, help="flame graphs of the EPP and a sidecar here")
    ap.add_argument("--spy-seconds", type=int, default=30)
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write the rounds' results here")
    args = ap.parse_args()
    if args.requests < 1 or args.rounds < 1 or (args.rate is not None and not args.rate > 0):
        ap.error("--requests and --rounds must be >= 1, --rate > 0")
    print(f"load average at the start: {open('/proc/loadavg').read().strip()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for arm in ("gateway", "epp"):
                last = k == args.rounds - 1 and arm == "epp"
                spy = args.py_spy if last else None
                results.append(one_round(arm, args, pathlib.Path(tmp), f"overhead-{arm}-{k}", spy))
    print(f"load average at the end: {open('/proc/loadavg').read().strip()}")
    print(render(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
