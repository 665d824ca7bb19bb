"""Flow control at the gateway, end to end on `splitserve up` (router + one prefill + one decode
worker process, the default SmolLM2-135M), in three runs on one stack, plus the gateway's idle
overhead with flow control on and off.

    python bench/flow_control.py [--duration 60] [--write docs/benchmarks.md] [--fcfs]

The stack: `splitserve up --flow-control --flow-objective interactive=10 --flow-objective
sheddable=-1 --flow-max-running R --flow-reserved-running 1` with a key file of two tenants
(team-a, team-b; weight 1 each). Every request streams, with ignore_eos so output lengths are
what was asked for. Clients that get 503 or 429 wait the Retry-After and send again.

1. Flood and chat. team-b alone sends a short chat (16 tokens, objective `interactive`, band 10)
   every 2 s for the idle phase (half before the flood, half after it has drained): its idle
   p90 TTFT. In between, team-a floods at concurrency 32 (128
   output tokens, band 0) for `duration` s while team-b keeps its 0.5 req/s: its loaded p90 TTFT.
   Pass: loaded p90 <= 1.5x idle p90. Every team-a request ends with all its tokens or a 503 with
   Retry-After; none is lost (any other outcome is counted and fails the run).
2. Fair share. team-a at concurrency 32, team-b at concurrency 4, both band 0, 64 output tokens,
   for `duration` s. Output tokens are counted by arrival time, after a warm-up of a tenth of the
   run. Pass: team-b's share is 50 % +- 10 %.
3. Shedding. Sheddable requests (objective `sheddable`, band -1) at concurrency 3R (three times
   what the worker may run) for the first half, band-0 requests at concurrency R throughout
   (every client retries a 503 after 0.2 s, so the sheddable load stays at three times capacity).
   Pass: sheddable requests get 503s, band 0 sees none while sheddable traffic runs; no 503
   arrives later than the time-in-queue bound (plus 2 s of slack); the gateway's
   splitserve_router_flow_requests_total equals the requests the clients sent, per band.
4. Overhead: `splitserve router` in front of an instant stub worker, with and without
   --flow-control, alternating with direct gRPC calls as bench/router_bench.py does; the p50
   overhead of each, measured in one run.

With --fcfs run 1 is repeated on a stack without flow control, for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, write_section  # noqa: E402
from router_bench import Proc, alternate_off_on, free_port, percentile  # noqa: E402

MODEL = "smollm2-135m"
KEYS = {"team-a": "sk-team-a", "team-b": "sk-team-b"}
CHAT = [{"role": "user", "content": "Say hello to the team in one short sentence."}]
MAX_WAIT_S = 30.0


@dataclass
class Outcome:
    """What one client request came to."""

    status: int
    ttft_s: float | None = None
    num_tokens: int = 0
    retry_after: str | None = None
    t_end: float = 0.0
    t_start: float = 0.0
    token_times: list[float] = field(default_factory=list)


async def stream_chat(
    client: httpx.AsyncClient, key: str, max_tokens: int, objective: str | None, extra_headers: dict | None = None
) -> Outcome:
    headers = {"authorization": f"Bearer {key}", **(extra_headers or {})}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    t0 = time.monotonic()
    out = Outcome(0, t_start=t0)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.retry_after = r.headers.get("retry-after")
                await r.aread()
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        out.status = 599
                        break
                    num_tokens = len(data["choices"][0].get("token_ids") or ()) if data["choices"] else 0
                    if num_tokens:
                        now = time.monotonic()
                        if out.ttft_s is None:
                            out.ttft_s = now - t0
                        out.num_tokens += num_tokens
                        out.token_times += [now] * num_tokens
    except httpx.HTTPError:
        out.status = -1
    out.t_end = time.monotonic()
    return out


async def closed_loop(
    client,
    key,
    concurrency,
    max_tokens,
    objective,
    until: float,
    sink: list,
    retry_s: float | None = None,
    extra_headers: dict | None = None,
) -> None:
    """`concurrency` clients sending back to back until `until`; a 503/429 waits its Retry-After
    (or `retry_s`) before the next."""

    async def one():
        while time.monotonic() < until:
            out = await stream_chat(client, key, max_tokens, objective, extra_headers)
            sink.append(out)
            if out.status in (429, 503):
                await asyncio.sleep(retry_s if retry_s is not None else float(out.retry_after or 1))

    await asyncio.gather(*(one() for _ in range(concurrency)))


async def paced(client, key, period_s, max_tokens, objective, until: float, sink: list) -> None:
    """One request every `period_s` (open loop), each in its own task."""
    tasks = []
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(stream_chat(client, key, max_tokens, objective)))
        await asyncio.sleep(period_s)
    sink.extend(await asyncio.gather(*tasks))


def p90(values: list[float]) -> float:
    return percentile(values, 90) if values else float("nan")


# -- the stack --------------------------------------------------------------------------------
def start_up(tmp: str, flow: bool, max_running: int) -> tuple[Proc, str]:
    keys = os.path.join(tmp, "keys.yaml")
    with open(keys, "w") as f:
        yaml.safe_dump({"keys": [{"id": name, "key": key} for name, key in KEYS.items()]}, f)
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.platform.cli", "up", "--port", str(port), "--api-keys-file", keys]
    if flow:
        argv += [
            "--flow-control",
            "--flow-objective",
            "interactive=10",
            "--flow-objective",
            "sheddable=-1",
            "--flow-max-running",
            str(max_running),
            "--flow-reserved-running",
            "1",
            "--flow-max-wait",
            str(MAX_WAIT_S),
        ]
    return Proc(argv, "splitserve up: serving"), f"http://127.0.0.1:{port}"


def client_for(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=200))


async def run_flood(url: str, duration: float, idle_s: float) -> dict:
    async with client_for(url) as client:
        await stream_chat(client, KEYS["team-b"], 4, "interactive")  # warm-up
        idle: list[Outcome] = []
        await paced(client, KEYS["team-b"], 2.0, 16, "interactive", time.monotonic() + idle_s / 2, idle)
        flood: list[Outcome] = []
        loaded: list[Outcome] = []
        until = time.monotonic() + duration
        await asyncio.gather(
            closed_loop(client, KEYS["team-a"], 32, 128, None, until, flood),
            paced(client, KEYS["team-b"], 2.0, 16, "interactive", until, loaded),
        )
        # The other half of the idle samples after the flood has drained, so a drift of the
        # machine's load during the run weighs on both sides alike.
        await paced(client, KEYS["team-b"], 2.0, 16, "interactive", time.monotonic() + idle_s / 2, idle)
    idle_ttft = [o.ttft_s for o in idle if o.ttft_s is not None]
    loaded_ttft = [o.ttft_s for o in loaded if o.ttft_s is not None]
    complete = sum(o.status == 200 and o.num_tokens == 128 for o in flood)
    shed = sum(o.status == 503 and o.retry_after is not None for o in flood)
    return {
        "idle_p90": p90(idle_ttft),
        "idle_p50": statistics.median(idle_ttft),
        "loaded_p90": p90(loaded_ttft),
        "loaded_p50": statistics.median(loaded_ttft),
        "num_idle": len(idle),
        "num_loaded": len(loaded),
        "b_failed": sum(o.status != 200 for o in idle + loaded),
        "a_sent": len(flood),
        "a_complete": complete,
        "a_503": shed,
        "a_lost": len(flood) - complete - shed,
        "a_tokens": sum(o.num_tokens for o in flood),
    }


async def run_fair(url: str, duration: float) -> dict:
    async with client_for(url) as client:
        a: list[Outcome] = []
        b: list[Outcome] = []
        t0 = time.monotonic()
        until = t0 + duration
        await asyncio.gather(
            closed_loop(client, KEYS["team-a"], 32, 64, None, until, a),
            closed_loop(client, KEYS["team-b"], 4, 64, None, until, b),
        )
    start = t0 + duration / 10
    count = lambda outs: sum(1 for o in outs for t in o.token_times if start <= t <= until)  # noqa: E731
    tokens_a, tokens_b = count(a), count(b)
    return {
        "tokens_a": tokens_a,
        "tokens_b": tokens_b,
        "share_b": tokens_b / max(1, tokens_a + tokens_b),
        "a_non200": sum(o.status != 200 for o in a),
        "b_non200": sum(o.status != 200 for o in b),
    }


def flow_counts(url: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("splitserve_router_flow_requests_total{"):
            labels = dict(p.split("=", 1) for p in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["band"].strip('"'), labels["outcome"].strip('"'))
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


async def run_shed(url: str, duration: float, max_running: int) -> dict:
    before = flow_counts(url)
    async with client_for(url) as client:
        sheddable: list[Outcome] = []
        band0: list[Outcome] = []
        t0 = time.monotonic()
        shed_until, until = t0 + duration / 2, t0 + duration
        await asyncio.gather(
            closed_loop(client, KEYS["team-a"], 3 * max_running, 16, "sheddable", shed_until, sheddable, retry_s=0.2),
            closed_loop(client, KEYS["team-b"], max_running, 16, None, until, band0, retry_s=0.2),
        )
    after = flow_counts(url)
    counted = {band: sum(v - before.get(k, 0) for k, v in after.items() if k[0] == band) for band in ("-1", "0")}
    last_shed_end = max((o.t_end for o in sheddable), default=t0)
    b503_during = sum(o.status == 503 and o.t_start < last_shed_end for o in band0)
    all_outcomes = sheddable + band0
    return {
        "shed_sent": len(sheddable),
        "shed_503": sum(o.status == 503 for o in sheddable),
        "shed_200": sum(o.status == 200 for o in sheddable),
        "band0_sent": len(band0),
        "band0_503_during": b503_during,
        "band0_503": sum(o.status == 503 for o in band0),
        "band0_200": sum(o.status == 200 for o in band0),
        "max_503_wait_s": max((o.t_end - o.t_start for o in all_outcomes if o.status == 503), default=0.0),
        "counted_shed": counted["-1"],
        "counted_band0": counted["0"],
        "other": sum(o.status not in (200, 503) for o in all_outcomes),
    }


# -- overhead ---------------------------------------------------------------------------------
def start_router(worker: str, flow: bool) -> tuple[Proc, str]:
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.platform.cli", "router", "--workers", worker, "--port", str(port)]
    proc = Proc(argv + (["--flow-control"] if flow else []), "splitserve router: serving")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not see its worker"
        time.sleep(0.1)
    return proc, url


def overhead(n: int) -> dict:
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    port = free_port()
    stub = Proc([sys.executable, os.path.join(bench_dir, "router_bench.py"), "--serve-stub", str(port)], "READY")
    address = f"127.0.0.1:{port}"
    try:
        off, url_off = start_router(address, False)
        on, url_on = start_router(address, True)
        try:
            times = alternate_off_on(address, url_off, url_on, [(i * 7919) % 40000 + 100 for i in range(64)], n)
        finally:
            off.stop()
            on.stop()
    finally:
        stub.stop()
    direct = statistics.median(times["direct"])
    return {
        "n": n,
        "direct_ms": direct * 1e3,
        "off_ms": statistics.median(times["off"]) * 1e3,
        "on_ms": statistics.median(times["on"]) * 1e3,
        "off_overhead_ms": (statistics.median(times["off"]) - direct) * 1e3,
        "on_overhead_ms": (statistics.median(times["on"]) - direct) * 1e3,
    }


# -- report -----------------------------------------------------------------------------------
def report(args, flood, fair, shed, cost, fcfs, load) -> str:
    f = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    ratio = flood["loaded_p90"] / flood["idle_p90"]
    lines = [
        "## Flow control at the gateway (issue 43)",
        "",
        f"`python bench/flow_control.py --duration {args.duration:g}` on `splitserve up` (one prefill + one "
        f"decode worker process, SmolLM2-135M), {time.strftime('%Y-%m-%d')}; flow control with "
        f"`--flow-max-running {args.max_running} --flow-reserved-running 1 --flow-max-wait {MAX_WAIT_S:g}`. "
        f"Load average at start / end: {load[0]:.1f} / {load[1]:.1f} on 2 shared cores, so the figures are "
        "noisy; the ratios are measured in one run."
        + (
            f" Runs shortened from 60 s to {args.duration:g} s (idle phases {args.idle:g} s in all)."
            if args.duration < 60
            else ""
        ),
        "",
        "**1. A flood and a chat** (team-a: band 0, concurrency 32, 128 tokens; team-b: band 10 via "
        "`x-gateway-inference-objective: interactive`, one 16-token chat every 2 s):",
        "",
        "| stack | team-b idle p50 / p90 TTFT ms | under the flood p50 / p90 ms | p90 ratio | team-a sent | "
        "complete | 503 + Retry-After | lost |",
        "|---|---|---|---|---|---|---|---|",
        f"| flow control | {f(flood['idle_p50'])} / {f(flood['idle_p90'])} | {f(flood['loaded_p50'])} / "
        f"{f(flood['loaded_p90'])} | {ratio:.2f}x (target <= 1.5x) | {flood['a_sent']} | {flood['a_complete']} | "
        f"{flood['a_503']} | {flood['a_lost']} |",
    ]
    if fcfs is not None:
        lines.append(
            f"| first come, first served | {f(fcfs['idle_p50'])} / {f(fcfs['idle_p90'])} | "
            f"{f(fcfs['loaded_p50'])} / {f(fcfs['loaded_p90'])} | "
            f"{fcfs['loaded_p90'] / fcfs['idle_p90']:.2f}x "
            f"| {fcfs['a_sent']} | {fcfs['a_complete']} | {fcfs['a_503']} | {fcfs['a_lost']} |"
        )
    lines += [
        "",
        f"team-b samples: {flood['num_idle']} idle, {flood['num_loaded']} under the flood "
        f"({flood['b_failed']} not 200).",
        "",
        "**2. Fair share** (team-a concurrency 32, team-b concurrency 4, both band 0, weight 1, 64 tokens; "
        "output tokens counted after a warm-up of a tenth of the run):",
        "",
        "| team-a tokens | team-b tokens | team-b share (target 50 % +- 10 %) | non-200 a / b |",
        "|---|---|---|---|",
        f"| {fair['tokens_a']} | {fair['tokens_b']} | {fair['share_b'] * 100:.1f} % | {fair['a_non200']} / "
        f"{fair['b_non200']} |",
        "",
        f"**3. Shedding** (band -1 at concurrency {3 * args.max_running}, three times what the worker may run, "
        f"for the first half; band 0 at concurrency {args.max_running} throughout):",
        "",
        "| band -1 sent | 503 | 200 | band 0 sent | 200 | 503 while band -1 ran | 503 after | "
        "longest wait before a 503 s | flow metrics count band -1 / band 0 |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {shed['shed_sent']} | {shed['shed_503']} | {shed['shed_200']} | {shed['band0_sent']} | "
        f"{shed['band0_200']} | {shed['band0_503_during']} | {shed['band0_503'] - shed['band0_503_during']} | "
        f"{shed['max_503_wait_s']:.2f} (bound {MAX_WAIT_S:g}) | {shed['counted_shed']:.0f} / "
        f"{shed['counted_band0']:.0f} |",
        "",
        f"**Gateway overhead, idle** (instant stub worker, {cost['n']} sequential 1-token completions, "
        "alternating direct gRPC / gateway without / gateway with flow control):",
        "",
        "| direct p50 ms | gateway p50 ms | overhead p50 ms | with flow control p50 ms | overhead p50 ms | "
        "difference |",
        "|---|---|---|---|---|---|",
        f"| {cost['direct_ms']:.2f} | {cost['off_ms']:.2f} | {cost['off_overhead_ms']:.2f} | "
        f"{cost['on_ms']:.2f} | "
        f"{cost['on_overhead_ms']:.2f} | {(cost['on_ms'] / cost['off_ms'] - 1) * 100:+.1f} % of the gateway's "
        "p50 |",
    ]
    return "\n".join(lines)


async def with_stack(flow: bool, max_running: int, coro_fn):
    with tempfile.TemporaryDirectory(prefix="flow-bench-") as tmp:
        proc, url = start_up(tmp, flow, max_running)
        try:
            return await coro_fn(url)
        finally:
            proc.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of each run (60)")
    parser.add_argument(
        "--idle", type=float, default=60.0, help="seconds of team-b alone, half before and half after the flood (60)"
    )
    parser.add_argument("--max-running", type=int, default=4, help="--flow-max-running of the stack (4)")
    parser.add_argument("--fcfs", action="store_true", help="repeat run 1 without flow control")
    parser.add_argument("--only", choices=("flood", "fair", "shed", "overhead"), default=None)
    parser.add_argument("--write", default=None, help="markdown file to put the results in")
    args = parser.parse_args(argv)
    if not 1 <= args.duration <= 3600 or not 4 <= args.idle <= 600 or not 2 <= args.max_running <= 64:
        parser.error("need --duration 1-3600, --idle 4-600 and --max-running 2-64")
    load0 = os.getloadavg()[0]

    async def flow_runs(url):
        out = {}
        if args.only in (None, "flood"):
            out["flood"] = await run_flood(url, args.duration, args.idle)
            print("flood", out["flood"], flush=True)
        if args.only in (None, "fair"):
            out["fair"] = await run_fair(url, args.duration)
            print("fair", out["fair"], flush=True)
        if args.only in (None, "shed"):
            out["shed"] = await run_shed(url, args.duration, args.max_running)
            print("shed", out["shed"], flush=True)
        return out

    results = {}
    if args.only != "overhead":
        results = asyncio.run(with_stack(True, args.max_running, flow_runs))
    fcfs = None
    if args.fcfs:
        fcfs = asyncio.run(with_stack(False, args.max_running, lambda url: run_flood(url, args.duration, args.idle)))
        print("fcfs", fcfs, flush=True)
    if args.only in (None, "overhead"):
        results["overhead"] = overhead(200)
        print("overhead", results["overhead"], flush=True)
    if args.only is None:
        text = report(
            args,
            results["flood"],
            results["fair"],
            results["shed"],
            results["overhead"],
            fcfs,
            (load0, os.getloadavg()[0]),
        )
        print(text)
        if args.write:
            begin, end = markers("flow_control")
            write_section(args.write, "flow_control", f"{begin}\n{text}\n{end}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
