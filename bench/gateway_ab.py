"""The gateway's overhead before and after a change: a git revision's `splitserve router` against
the working tree's, arms interleaved.

Each round starts, for each arm in turn, that arm's own bench/router_bench.py measurement in a
fresh process tree (bench/revision_arms.py: the arm's code, the same interpreter and packages):
a stub worker that answers at once, `splitserve router` in front of it, and N one-token requests
of the same token-id prompt, alternating direct gRPC and through the gateway. An arm's overhead in
a round is the difference of those medians; the report gives each arm's median over the rounds
and the ratio, per prompt length. Rounds alternate the arms' order, so drifting machine load
hits both alike.

    python bench/gateway_ab.py --base c4e850d [--rounds 10] [--requests 400] [--prompt-lens 64,2000]
        [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from report import cpu_model, write_section  # noqa: E402
from revision_arms import Arm, alternating, arm_env, base_and_head, head_revision  # noqa: E402

# Runs in the arm's tree, with the arm's router_bench (whose helpers every revision since the
# gateway benchmark has had): prints the medians of direct and gateway latency, in seconds.
ARM = r"""
import json, statistics, sys
sys.path.insert(0, "bench")
import router_bench as rb
n, prompt_len = int(sys.argv[1]), int(sys.argv[2])
port = rb.free_port()
stub = rb.Proc([sys.executable, "bench/router_bench.py", "--serve-stub", str(port)], "READY")
try:
    gateway, url = rb.start_gateway(f"127.0.0.1:{port}")
    try:
        prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
        r = rb.alternate(f"127.0.0.1:{port}", url, prompt, 1, n)
    finally:
        gateway.stop()
finally:
    stub.stop()
print(json.dumps({"direct": statistics.median(r["direct"]), "via": statistics.median(r["via"])}))
"""


def overhead_ms(arm: Arm, requests: int, prompt_len: int) -> float:
    proc = subprocess.run(
        [sys.executable, "-S", "-c", ARM, str(requests), str(prompt_len)],
        cwd=arm.tree,  # the arm's own bench/router_bench.py
        env=arm_env(arm.path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    medians = json.loads(proc.stdout.strip().splitlines()[-1])
    return (medians["via"] - medians["direct"]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=400, help="requests each way per arm and round")
    ap.add_argument("--prompt-lens", default="64", help="comma-separated prompt lengths in tokens (at most 2047)")
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    lens = [int(n) for n in args.prompt_lens.split(",")]
    results = {name: {n: [] for n in lens} for name in ("base", "head")}
    with base_and_head(args.base) as arms:
        for r, name in alternating(args.rounds):
            for n in lens:
                results[name][n].append(overhead_ms(arms[name], args.requests, n))
            print(f"round {r + 1} {name}: {results[name]}", file=sys.stderr, flush=True)
    report = render(results, args, lens)
    print(report)
    if args.write:
        write_section(args.write, "gateway-ab", report)


def render(results, args, lens: list[int]) -> str:
    head = head_revision()
    lines = [
        "<!-- gateway-ab:begin -->",
        "## Gateway overhead: a revision against the working tree",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} vCPU {cpu_model()}. Overhead = median "
        f"latency through `splitserve router` minus median latency calling the stub worker directly, "
        f"{args.requests} one-token requests each way per arm and round, {args.rounds} rounds alternating the "
        f"arms. Base `{args.base}`, head `{head}` (and its uncommitted changes). Command: "
        f"`python bench/gateway_ab.py --base {args.base} --rounds {args.rounds} --requests {args.requests} "
        f"--prompt-lens {args.prompt_lens}`.",
        "",
        "| prompt tokens | base overhead p50 ms | head overhead p50 ms | head / base | head rounds (ms) |",
        "|---|---|---|---|---|",
    ]
    for n in lens:
        base, head_ms = statistics.median(results["base"][n]), statistics.median(results["head"][n])
        spread = " ".join(f"{x:.3f}" for x in results["head"][n])
        lines.append(f"| {n} | {base:.3f} | {head_ms:.3f} | {head_ms / base:.3f} | {spread} |")
    lines += ["", "<!-- gateway-ab:end -->"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
