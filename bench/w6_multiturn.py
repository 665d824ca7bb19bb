"""W6: multi-turn chat whose histories outgrow one worker's KV cache (issue 35).

N conversations run at once, T turns each, with think time between turns; every turn resends
the whole history (a private document, the earlier turns and answers) plus a new question. The
distinct history of all conversations is about twice what the two workers' KV caches hold
together (small caches on purpose), so blocks are evicted and conversations meet workers that
lack their prefix. Three arms, each on its own pair of fresh `splitserve worker` processes
(real gRPC with mTLS, TCP KV transfer with the service secret), placed by the router's own
Placer, prefix index and worker pool fed by the workers' real WatchEvents streams:

    round-robin            the round-robin scorer only
    prefix-aware           the default decode profile (prefix overlap + load), no pull, no tier
    prefix-aware+pull+tier the same, plus pulls (placement.kv_pull) and a file tier per worker

Reported per arm: TTFT p50 and p90 over every turn after the first, the prompt tokens the
workers computed, pulled and restored from the tier. Then a W1-shaped check of the cost when
nothing is reused (fresh prompts behind one shared system prompt, one at a time) on the
prefix-aware and the pull+tier pairs: TTFT p50 of each. The arms run one after the other, in
one process, on the same host.

    python bench/w6_multiturn.py [--write docs/benchmarks.md] [--conversations 6] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, write_section  # noqa: E402
from workerproc import WorkerProc, worker_channel  # noqa: E402

from splitserve.platform.hashing import BlockHasher  # noqa: E402
from splitserve.platform.sampling.params import SamplingParams  # noqa: E402
from splitserve.platform.wire import worker_pb2 as pb  # noqa: E402
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc  # noqa: E402
from splitserve.router.config import (  # noqa: E402
    DisaggregationConfig,
    KVPullConfig,
    PlacementConfig,
    ProfileConfig,
    ScorerSpec,
    default_decode_profile,
)
from splitserve.router.core.worker_messages import generate_request  # noqa: E402
from splitserve.router.placement.index import InMemoryPrefixIndex  # noqa: E402
from splitserve.router.placement.placer import PlacementRequest, Placer  # noqa: E402
from splitserve.router.placement.pool import WorkerPool  # noqa: E402

MODEL, BS = "smollm2-135m", 16
DOC, QUESTION, ANSWER = 384, 96, 16  # tokens: a conversation's document, each question, each answer
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 0.03  # ~87 blocks of SmolLM2 float16 KV per worker
TIER = "256MiB"
NAME = "w6-multiturn"


def worker_args(arm: str, tier_dir: str) -> list[str]:
    args = ["--max-model-len", str(MAX_MODEL_LEN)]
    if arm == "prefix-aware+pull+tier":
        return args + ["--kv-tier-bytes", TIER, "--kv-tier-dir", tier_dir]
    return args + ["--no-kv-pull"]


def placement(arm: str) -> PlacementConfig:
    decode = (
        ProfileConfig(filters=("healthy",), scorers=(ScorerSpec("round-robin", 1.0),))
        if arm == "round-robin"
        else default_decode_profile()
    )
    return PlacementConfig(
        decode=decode,
        disaggregation=DisaggregationConfig(mode="never"),
        kv_pull=KVPullConfig(enabled=arm == "prefix-aware+pull+tier"),
    )


class Router:
    """The router's placement pieces, fed by the workers' WatchEvents like router/placement/watcher.py."""

    def __init__(self, arm: str, workers: list[WorkerProc]):
        self.pool = WorkerPool(MODEL, BS)
        self.index = InMemoryPrefixIndex()
        self.config = placement(arm)
        self.placer = Placer(self.config, self.pool, self.index, random.Random(0))
        self.hasher = BlockHasher(MODEL, BS)
        self.tasks = [asyncio.create_task(self._watch(w.address)) for w in workers]

    async def _watch(self, address: str) -> None:
        self.pool.add(address)
        async with worker_channel(address) as ch:
            async for ev in pb_grpc.WorkerStub(ch).WatchEvents(pb.WatchEventsRequest(load_interval_s=0.2)):
                kind = ev.WhichOneof("payload")
                if kind == "info":
                    self.pool.on_info(address, ev.info)
                elif kind == "kv":
                    self.index.apply_now(address, ev.kv)
                elif kind == "load":
                    self.pool.on_load(address, ev.load)

    async def ready(self, n: int) -> None:
        while sum(w.is_connected for w in self.pool.workers.values()) < n:
            await asyncio.sleep(0.1)

    async def generate(self, token_ids: list[int], max_tokens: int, req_id: str) -> tuple[float, list[int], pb.Usage]:
        decision = await self.placer.place(PlacementRequest(len(token_ids), self.hasher.hash_blocks(token_ids)))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = generate_request(req_id, token_ids, params, decision, self.config.disaggregation)
        assignment = self.pool.assign(decision.decode, "", decision.num_uncached_tokens)
        t0, ttft, out, usage = time.perf_counter(), None, [], None
        try:
            async with worker_channel(decision.decode) as ch:
                async for msg in pb_grpc.WorkerStub(ch).Generate(request):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                        self.pool.first_token(assignment)
                        self.placer.pull_cost.observe(len(token_ids), msg)
                    out += msg.token_ids
                    usage = msg.usage
        finally:
            self.pool.finish(assignment)
        return ttft, out, usage

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def conversation(router: Router, c: int, turns: int, think_s: float, rows: list) -> None:
    rng = random.Random(1000 + c)  # the same conversation in every arm
    history = tokens(rng, DOC)
    await asyncio.sleep(c * 0.3)  # staggered starts
    for t in range(turns):
        history += tokens(rng, QUESTION)
        ttft, answer, usage = await router.generate(history, ANSWER, f"c{c}-t{t}")
        rows.append(
            dict(turn=t, ttft=ttft, prompt=len(history), cached=usage.cached_tokens, pulled=usage.pulled_tokens)
        )
        history += answer
        await asyncio.sleep(think_s * (0.5 + rng.random()))


async def run_arm(arm: str, workers: list[WorkerProc], conversations: int, turns: int, think_s: float) -> dict:
    router = Router(arm, workers)
    await router.ready(len(workers))
    rows: list[dict] = []
    before = [(w.metric('splitserve_kv_tier_blocks_total{event="hit"}'),) for w in workers]
    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(router, c, turns, think_s, rows) for c in range(conversations)))
    wall = time.perf_counter() - t0
    router.close()
    later = sorted(r["ttft"] for r in rows if r["turn"] > 0)
    restored = sum(w.metric('splitserve_kv_tier_blocks_total{event="hit"}') for w in workers) - sum(
        b[0] for b in before
    )
    pull_s = sum(w.metric("splitserve_kv_pull_seconds_sum") for w in workers)
    pulls = sum(w.metric('splitserve_kv_pulls_total{outcome="ok"}') for w in workers)
    failed = sum(w.metric('splitserve_kv_pulls_total{outcome="failed"}') for w in workers)
    return dict(
        p50=statistics.median(later) * 1000,
        p90=later[int(0.9 * (len(later) - 1))] * 1000,
        computed=sum(r["prompt"] - r["cached"] - r["pulled"] for r in rows),
        pulled=sum(r["pulled"] for r in rows),
        restored=int(restored) * BS,
        prompt=sum(r["prompt"] for r in rows),
        wall=wall,
        turns=len(rows),
        pulls=int(pulls),
        failed_pulls=int(failed),
        pull_ms=pull_s * 1000,
    )


async def w1_check(workers: list[WorkerProc], arm: str, n: int) -> float:
    """Fresh prompts behind one shared system prompt, one at a time: TTFT p50 (ms)."""
    router = Router(arm, workers)
    await router.ready(len(workers))
    rng = random.Random(7)
    system = tokens(rng, 256)
    ttfts = []
    for i in range(n):
        ttft, _, _ = await router.generate(system + tokens(rng, 64), 4, f"w1-{i}")
        ttfts.append(ttft)
    router.close()
    return statistics.median(ttfts[1:]) * 1000


def render(results: dict, w1: dict, args) -> str:
    begin, end = markers(NAME)
    base = results["prefix-aware"]["p90"]
    lines = [
        begin,
        "## W6: multi-turn chat, KV pull and second tier (issue 35)",
        "",
        f"{args.conversations} conversations x {args.turns} turns at once, think time ~{args.think:g} s; each "
        f"turn resends the history ({DOC}-token document, {QUESTION}-token questions, {ANSWER}-token answers) "
        f"to 2 `splitserve worker` processes (SmolLM2-135M, 1 torch thread each, TCP KV transfer, mTLS) with "
        f"small KV caches ({KV_CACHE_GIB} GiB, ~87 blocks each): the conversations' distinct history is about "
        f"twice what both caches hold. Placement is the router's own Placer, index and pool, fed by the workers' "
        f"event streams. TTFT over every turn after the first, client side. One run, arms one after the "
        f"other on the same host; `python bench/w6_multiturn.py --write docs/benchmarks.md` "
        f"(in `make bench`).",
        "",
        "| arm | TTFT p50 (ms) | TTFT p90 (ms) | prefix-aware p90 ÷ this p90 | prompt tokens computed "
        "| pulled | restored from tier | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, r in results.items():
        lines.append(
            f"| {arm} | {r['p50']:.0f} | {r['p90']:.0f} | {base / r['p90']:.2f}x | {r['computed']} "
            f"of {r['prompt']} | {r['pulled']} | {r['restored']} | {r['wall']:.1f} |"
        )
    r = results["prefix-aware+pull+tier"]
    lines += [
        "",
        f"Pulls in the pull + tier arm: {r['pulls']} succeeded, {r['failed_pulls']} failed (recomputed)"
        + (
            f"; {r['pull_ms'] / max(r['pulled'] // BS, 1):.1f} ms per pulled block on average (asked to acknowledged)."
            if r["pulls"]
            else ": with the second tier the index shows each conversation's history on the worker that served "
            "it, so placement kept conversations there and the gain is the tier's (restored from tier)."
        ),
    ]
    lines += [
        "",
        f"No-reuse check (W1-shaped: fresh 64-token questions behind one shared 256-token system prompt, "
        f"one at a time, {args.w1_requests} requests): TTFT p50 {w1['prefix-aware']:.0f} ms prefix-aware, "
        f"{w1['prefix-aware+pull+tier']:.0f} ms with pull + tier "
        f"({w1['prefix-aware+pull+tier'] / w1['prefix-aware']:.2f}x). This is not the serving suite's W1 "
        f"(bench/serving_suite.py), which this run does not repeat.",
        "",
        end,
    ]
    return "\n".join(lines)


async def main_async(args) -> tuple[dict, dict]:
    arms = ["round-robin", "prefix-aware", "prefix-aware+pull+tier"]
    results, w1 = {}, {}
    with tempfile.TemporaryDirectory(prefix="w6-tier-") as tier_dir:
        for arm in arms:
            workers = [
                WorkerProc("both", "tcp", *worker_args(arm, tier_dir), kv_cache_gib=KV_CACHE_GIB) for _ in range(2)
            ]
            for w in workers:
                w.start()
            try:
                results[arm] = await run_arm(arm, workers, args.conversations, args.turns, args.think)
                print(arm, results[arm], flush=True)
                if arm != "round-robin":
                    w1[arm] = await w1_check(workers, arm, args.w1_requests)
                    print("w1", arm, w1[arm], flush=True)
            finally:
                for w in workers:
                    w.terminate()
    return results, w1


async def probe_pull(rounds: int = 3) -> None:
    """The pull's starting constants (router/config/placement.py KVPullConfig): worker A computes a
    300-token prompt, worker B pulls its 18 full blocks from A; prints A's prefill time per
    token, B's pull time per block and both TTFTs."""
    a, b = WorkerProc("both", "tcp").start(), WorkerProc("both", "tcp").start()
    try:
        rng = random.Random(3)
        for i in range(rounds):
            ids = tokens(rng, 300)
            for address, pull in ((a.address, None), (b.address, pb.KVPull(holder=a.address, num_blocks=18))):
                request = pb.GenerateRequest(
                    request_id=f"probe-{i}-{address}",
                    prompt_token_ids=ids,
                    params=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                    disaggregation=pb.DISAGGREGATION_MODE_NEVER,
                    kv_pull=pull,
                )
                async with worker_channel(address) as ch:
                    first = [m async for m in pb_grpc.WorkerStub(ch).Generate(request)][0]
                t = first.timings
                if pull is None:
                    print(
                        f"A prefill: {(t.first_token_s - t.queue_s) / len(ids) * 1000:.2f} ms/token, "
                        f"TTFT {t.first_token_s * 1000:.0f} ms"
                    )
                else:
                    print(
                        f"B pull: {first.usage.pulled_tokens} tokens, {t.kv_pull_s / 18 * 1000:.2f} ms/block, "
                        f"TTFT {t.first_token_s * 1000:.0f} ms"
                    )
    finally:
        a.terminate()
        b.terminate()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--think", type=float, default=1.0, help="mean think time between turns (s)")
    p.add_argument("--w1-requests", type=int, default=6)
    p.add_argument("--write", default=None, help="write the section into this markdown file")
    p.add_argument("--probe-pull", action="store_true", help="only measure one pull against one local prefill")
    args = p.parse_args()
    if args.probe_pull:
        asyncio.run(probe_pull())
        return 0
    results, w1 = asyncio.run(main_async(args))
    section = render(results, w1, args)
    print(section)
    if args.write:
        write_section(args.write, NAME, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
