"""Interactive traffic protected by default, and not by what a client claims (issue 53).

    python bench/tenancy_flow.py [--duration 60] [--idle 30] [--write docs/benchmarks.md]

The stack is `splitserve up --api-keys-file K --flow-control` with no other flow flag (one prefill
and one decode worker process, the default SmolLM2-135M), so the running cap per decode worker is
the default: derived from the step time the router measures (router/flow/latency.py). The key
file: team-a `priority: 0`, team-b `priority: 10` (weight 1 each, no max_priority).

Two runs, each on a fresh stack:

1. plain: team-b alone sends a short chat (16 tokens, no header) every 2 s for `idle` s, half
   before the flood and half after it has drained: its idle p90 TTFT. In between team-a floods
   with 32 streams (128 output tokens, ignore_eos) for `duration` s while team-b keeps its pace:
   its loaded p90 TTFT.
2. spoofing: the server also defines `--flow-objective critical=100`, and every flood request
   sends `x-gateway-inference-objective: critical` and `x-gateway-inference-fairness-id: team-b`.

Pass, per run: team-b's loaded p90 <= 1.5x its idle p90, and no team-a request lost (each ends
with all its tokens, or a 503/429 with Retry-After that its client waits and retries). The ratio
is measured in one run; team-b's idle samples straddle the flood so a drift of the host's load
weighs on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flow_control import Outcome, client_for, closed_loop, p90, paced, stream_chat  # noqa: E402
from report import cpu_model, markers, write_section  # noqa: E402
from router_bench import Proc, free_port  # noqa: E402

KEYS = {"team-a": ("sk-team-a", 0), "team-b": ("sk-team-b", 10)}
SPOOF = {"x-gateway-inference-objective": "critical", "x-gateway-inference-fairness-id": "team-b"}
TARGET = 1.5


def start_up(tmp: str, spoof: bool) -> tuple[Proc, str, list[str]]:
    keys = os.path.join(tmp, "keys.yaml")
    with open(keys, "w") as f:
        yaml.safe_dump({"keys": [{"id": n, "key": k, "priority": p} for n, (k, p) in KEYS.items()]}, f)
    port = free_port()
    flags = ["--api-keys-file", "K", "--flow-control", *(["--flow-objective", "critical=100"] if spoof else [])]
    argv = [sys.executable, "-m", "splitserve.platform.cli", "up", "--port", str(port)]
    argv += [keys if a == "K" else a for a in flags]
    return Proc(argv, "splitserve up: serving"), f"http://127.0.0.1:{port}", flags


async def flood_and_chat(url: str, duration: float, idle_s: float, spoof: bool) -> dict:
    key_a, key_b = KEYS["team-a"][0], KEYS["team-b"][0]
    async with client_for(url) as client:
        await stream_chat(client, key_b, 4, None)  # warm-up
        idle: list[Outcome] = []
        await paced(client, key_b, 2.0, 16, None, time.monotonic() + idle_s / 2, idle)
        flood: list[Outcome] = []
        loaded: list[Outcome] = []
        until = time.monotonic() + duration
        await asyncio.gather(
            closed_loop(client, key_a, 32, 128, None, until, flood, extra_headers=SPOOF if spoof else None),
            paced(client, key_b, 2.0, 16, None, until, loaded),
        )
        await paced(client, key_b, 2.0, 16, None, time.monotonic() + idle_s / 2, idle)
    idle_ttft = [o.ttft_s for o in idle if o.ttft_s is not None]
    loaded_ttft = [o.ttft_s for o in loaded if o.ttft_s is not None]
    complete = sum(o.status == 200 and o.num_tokens == 128 for o in flood)
    refused = sum(o.status in (429, 503) and o.retry_after is not None for o in flood)
    return {
        "idle_p50": statistics.median(idle_ttft),
        "idle_p90": p90(idle_ttft),
        "loaded_p50": statistics.median(loaded_ttft),
        "loaded_p90": p90(loaded_ttft),
        "b_samples": (len(idle), len(loaded)),
        "b_failed": sum(o.status != 200 for o in idle + loaded),
        "a_sent": len(flood),
        "a_complete": complete,
        "a_refused": refused,
        "a_lost": len(flood) - complete - refused,
        "a_tokens": sum(o.num_tokens for o in flood),
    }


async def one_run(duration: float, idle_s: float, spoof: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="tenancy-bench-") as tmp:
        proc, url, flags = start_up(tmp, spoof)
        try:
            result = await flood_and_chat(url, duration, idle_s, spoof)
        finally:
            proc.stop()
    result["flags"] = " ".join(flags)
    result["ratio"] = result["loaded_p90"] / result["idle_p90"]
    result["passed"] = result["ratio"] <= TARGET and result["a_lost"] == 0 and result["b_failed"] == 0
    return result


def report(runs: dict, args, load: tuple[float, float]) -> str:
    lines = [
        "## Interactive traffic protected by default (issue 53)",
        "",
        f"`python bench/tenancy_flow.py --duration {args.duration:g} --idle {args.idle:g}`, "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} x {cpu_model()}; load average at start / end "
        f"{load[0]:.1f} / {load[1]:.1f}. The stack: `splitserve up --api-keys-file K --flow-control` and no "
        "other flow flag, so each decode worker's running cap is the default one, derived from the step "
        "time the router measures (latency_slack 0.5: a step may be 1.5x a lone request's; the bands >= 1 "
        "one request more; router/flow/latency.py). Key file: team-a priority 0, team-b priority 10. "
        "team-a floods with 32 streams of 128 tokens; team-b sends a 16-token chat every 2 s, alone (half "
        "before, half after the flood) and during it.",
        "",
        "| run | flags | team-b idle p50 / p90 TTFT ms | under the flood p50 / p90 ms | p90 ratio (target <= 1.5x) "
        "| team-a sent | complete | 429/503 + Retry-After | lost | team-b samples idle / loaded (not 200) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | `{r['flags']}` | {r['idle_p50'] * 1e3:.0f} / {r['idle_p90'] * 1e3:.0f} | "
            f"{r['loaded_p50'] * 1e3:.0f} / {r['loaded_p90'] * 1e3:.0f} | {r['ratio']:.2f}x "
            f"({'met' if r['passed'] else 'missed'}) | {r['a_sent']} | {r['a_complete']} | {r['a_refused']} | "
            f"{r['a_lost']} | {r['b_samples'][0]} / {r['b_samples'][1]} ({r['b_failed']}) |"
        )
    lines += [
        "",
        "In the spoofing run every flood request names the objective `critical` (band 100) and team-b's "
        "fairness id: team-a's key has no `max_priority`, so it stays in band 0, and the fairness id is a "
        "sub-flow under team-a's own key (router/flow/classify.py).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the flood (60)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of team-b alone, split around the flood")
    parser.add_argument("--only", choices=("plain", "spoofing"), default=None)
    parser.add_argument("--write", default=None, help="markdown file to put the results in")
    args = parser.parse_args(argv)
    if not 5 <= args.duration <= 3600 or not 4 <= args.idle <= 600:
        parser.error("need --duration 5-3600 and --idle 4-600")
    load0 = os.getloadavg()[0]
    runs = {}
    for name in ("plain", "spoofing"):
        if args.only in (None, name):
            runs[name] = asyncio.run(one_run(args.duration, args.idle, spoof=name == "spoofing"))
            print(name, runs[name], flush=True)
    text = report(runs, args, (load0, os.getloadavg()[0]))
    print(text)
    if args.write:
        begin, end = markers("tenancy_flow")
        write_section(args.write, "tenancy_flow", f"{begin}\n{text}\n{end}")
    return 0 if all(r["passed"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
