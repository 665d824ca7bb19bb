"""W1 through a real Envoy: `splitserve epp` picking the sidecar vs Envoy's round robin over the
same sidecars (docs/bench.md, W1; docs/router.md, "Inference gateways").

    python bench/epp_w1.py [--quick] [--rate 0.7] [--write docs/benchmarks.md]

Each arm gets a fresh cluster, as in the serving suite (bench/serving_suite.py, whose worker
sizing, W1 parameters and load generator this reuses): two colocated workers (`--role both`),
each pinned to one core with KV_BLOCKS blocks, one `splitserve sidecar` per worker (its pool:
the other worker, which it may pull a prefix from), one `splitserve epp` over both, one Envoy
(one thread). Only Envoy's configuration differs:

    epp           ext_proc to the EPP, ORIGINAL_DST on x-gateway-destination-endpoint
    round-robin   no ext_proc filter: round robin over the two sidecars

The EPP runs in both arms, so both pay for it alike. Results: the p90 TTFT of each arm and their
ratio, printed, and with --write the section between <!-- epp-w1:begin/end --> of that file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import yaml

from splitserve.launch.up_envoy import epp_args

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, write_section  # noqa: E402
from serving_suite import (  # noqa: E402
    KV_BLOCKS,
    MODEL,
    Proc,
    Run,
    bench,
    free_port,
    machine,
    read_kv_blocks,
    start_worker,
    wait_http,
)

from splitserve.router.epp.envoy import envoy_config  # noqa: E402
from splitserve.router.epp.envoy_process import envoy_log, start_envoy  # noqa: E402

ARMS = ("round-robin", "epp")


class GatewayCluster:
    """Two pinned colocated workers, their sidecars, the EPP and one Envoy for `arm`."""

    def __init__(self, arm: str, workdir: pathlib.Path, kv_blocks: int = KV_BLOCKS, max_model_len: int = 2048):
        self.procs: list[Proc] = []
        self.envoy = None
        self.kv_blocks_asked, self.max_model_len, self.kv_blocks = kv_blocks, max_model_len, []
        try:
            self._start(arm, workdir)
        except BaseException:
            self.stop()
            raise

    def _start(self, arm: str, workdir: pathlib.Path) -> None:
        workers, metrics = [], []
        for i in range(2):
            proc, address, metrics_port = start_worker(
                f"worker {i}", i, "both", self.kv_blocks_asked, self.max_model_len
            )
            self.procs.append(proc)
            workers.append(address)
            metrics.append(metrics_port)
        for p in self.procs:
            p.wait_ready(300)
        self.kv_blocks = read_kv_blocks(metrics)
        config = workdir / f"router-{arm}.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "model": MODEL,
                    "max_model_len": self.max_model_len,
                    "gateway": {"max_concurrent_requests": 512, "max_queued_requests": 4096},
                    "placement": {"disaggregation": {"mode": "never"}},
                    # a pinned worker on a busy host can report late; not down
                    "discovery": {"stale_after_s": 30},
                }
            )
        )
        cli = [sys.executable, "-m", "splitserve.platform.cli", "--log-level", "WARNING"]
        sidecars = []
        for i, worker in enumerate(workers):
            port = free_port()
            # the pool: the other worker, which the sidecar may tell its own to pull a prefix from
            pool = ",".join(w for w in workers if w != worker)
            argv = [
                *cli,
                "sidecar",
                "--config",
                str(config),
                "--decode",
                worker,
                "--workers",
                pool,
                "--port",
                str(port),
            ]
            proc = Proc(f"sidecar {i}", argv)
            self.procs.append(proc)
            sidecars.append(f"127.0.0.1:{port}")
        grpc_port, health_port = free_port(), free_port()
        epp = Proc(
            "epp",
            [
                *cli,
                *epp_args(
                    workers, [f"{w}={s}" for w, s in zip(workers, sidecars, strict=True)], grpc_port, health_port
                ),
                "--config",
                str(config),
            ],
        )
        self.procs.append(epp)
        for proc, sidecar in zip(self.procs[2:4], sidecars, strict=True):
            wait_http(f"http://{sidecar}/ready", 120, proc)
        wait_http(f"http://127.0.0.1:{health_port}/ready", 120, epp)
        port, admin = free_port(), free_port()
        # debug_headers: the bench records which worker served each request (x-splitserve-decode-worker)
        epp = f"127.0.0.1:{grpc_port}" if arm == "epp" else None
        bootstrap = envoy_config(port, sidecars, epp, admin, debug_headers=True)
        path = str(workdir / f"envoy-{arm}.yaml")
        self.envoy = start_envoy(bootstrap, path)
        deadline = time.monotonic() + 60
        while not _ready(f"http://127.0.0.1:{admin}/ready"):
            if self.envoy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("envoy did not start:\n" + envoy_log(path))
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.envoy is not None and self.envoy.poll() is None:
            self.envoy.terminate()
            try:
                self.envoy.wait(10)
            except subprocess.TimeoutExpired:
                self.envoy.kill()
        for p in reversed(self.procs):
            p.stop()


def _ready(url: str) -> bool:
    from serving_suite import http_get

    return http_get(url)[0] == 200


def p90_ttft_ms(doc: dict) -> float:
    return doc["summary"]["ttft_ms"]["p90"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 requests per group (16 measured) instead of 8 (64)")
    ap.add_argument("--rate", type=float, default=0.7, help="requests per second (default 0.7, the suite's first)")
    ap.add_argument("--write", default=None, help="write the results into this markdown file")
    args = ap.parse_args()
    per_group = "2" if args.quick else "8"
    params = (("warm_prefixes", "1"), ("system_len", "256"), ("groups", "8"), ("per_group", per_group))
    results = {}
    with tempfile.TemporaryDirectory(prefix="splitserve-epp-w1-") as tmp:
        workdir = pathlib.Path(tmp)
        for arm in ARMS:
            run = Run("w1", None, 16 if args.quick else 64, rate=args.rate, warmup=16, params=params)
            print(f"== w1 through envoy, {arm}", flush=True)
            cluster = GatewayCluster(arm, workdir)
            try:
                results[arm] = bench(run, cluster.url, workdir, f"w1-envoy-{arm}")
            finally:
                cluster.stop()
    rr, epp = p90_ttft_ms(results["round-robin"]), p90_ttft_ms(results["epp"])
    print(f"p90 TTFT: round-robin {rr:.0f} ms, epp {epp:.0f} ms, ratio {rr / epp:.2f}x", flush=True)
    if args.write:
        write_section(args.write, "epp-w1", render(results, args, machine()))
    return 0


def render(results: dict, args, host: str) -> str:
    begin, end = markers("epp-w1")
    lines = [
        begin,
        "## W1 through Envoy: `splitserve epp` vs round robin (issue 41)",
        "",
        f"{datetime.date.today()}, {host}. `python bench/epp_w1.py"
        f"{' --quick' if args.quick else ''} --rate {args.rate}`: W1 (8 groups, 256-token system prompts, "
        f"warm prefixes, {16 if args.quick else 64} measured requests at {args.rate} req/s) sent to one Envoy "
        "in front of two sidecars, each before one colocated worker pinned to a core with 128 KV blocks; "
        "a fresh cluster per arm, the EPP running in both.",
        "",
        "| arm | TTFT p50 (ms) | TTFT p90 (ms) | prefix cache hit rate | completed / failed |",
        "|---|---|---|---|---|",
    ]
    for arm in ARMS:
        s = results[arm]["summary"]
        hits = s.get("prefix_cache_hit_rate")
        lines.append(
            f"| {arm} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p90']:.0f} | "
            f"{'' if hits is None else f'{hits:.0%}'} | {s['completed']} / {s['failed']} |"
        )
    rr, epp = p90_ttft_ms(results["round-robin"]), p90_ttft_ms(results["epp"])
    lines += [
        "",
        f"p90 TTFT round-robin ÷ epp: **{rr / epp:.2f}×**. The same comparison behind the splitserve "
        "gateway (serving suite, round-robin ÷ prefix+queue) is W1 of the [serving suite](serving.md); the EPP "
        "places with the same scorers, so the two ratios measure the same policy.",
        end,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
