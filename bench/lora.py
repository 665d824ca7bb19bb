"""Multi-LoRA decode throughput (issue 15, acceptance 2, first part).

16 concurrent requests (64 random prompt tokens, 64 output tokens, greedy, ignore_eos) on the
engine in this process, SmolLM2-135M in the default `--quantization auto`, run four ways in one
process on the same weights: the base model alone, and with 1, 4 and 16 distinct LoRA adapters
mixed in the batch (requests spread round-robin over the adapters; rank 8 on all seven
projections, random non-zero weights; `max_loras` 16 so every adapter has a slot). Decode
throughput counts output tokens after each request's first, over the time from the step in
which the last request got its first token to the end: prefill is excluded. Arms are
interleaved and repeated; the best repeat of each arm is reported (the machine is shared, so
the best is the least disturbed).

W5 (second part): 32 adapters with zipf popularity (s = 1.1) over 2 colocated workers
(`splitserve worker --role both`, one torch thread each, every adapter loaded, `--max-loras 8`:
8 adapter slots per worker), behind `splitserve router`, three routing arms: ours (the default
decode profile: prefix-overlap, queue-depth, kv-usage, pending-assignments, lora-affinity),
round-robin, and load-only (queue-depth + pending-assignments). Each request: its adapter's
64-token system prompt + 16 random tokens, 16 output tokens, streamed; Poisson arrivals at a
fixed rate, the same request sequence for every arm. TTFT is measured by the client. The
workers stay up across arms (each arm uses its own system prompts, so no arm reuses another's
cache); a fresh router per arm, which first serves one untimed request per adapter (each
adapter's system prompt cached where the arm's router puts it, as W1's warm_prefixes;
--w5-no-warm-prefixes skips it) and then untimed requests of the same mix (--w5-warm), so that
each arm is timed in the steady state its own routing makes.

Usage: python bench/lora.py [--write docs/benchmarks.md] [--threads 1] [--repeats 3] [--skip-w5 | --only-w5]
                            [--w5-requests 64] [--w5-adapters 32] [--w5-rate 1.0]
                            [--w5-rank 8] [--w5-resident N] [--w5-rounds 3] [--w5-warm 32]
                            [--w5-no-warm-prefixes]

The full run (`make bench` runs it with --threads 2) is the throughput part and then W5. A smoke
run of W5 alone that checks the pipeline end to end in about two minutes:
`python bench/lora.py --only-w5 --w5-requests 6 --w5-adapters 4` (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

import torch
from safetensors.torch import save_file

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, write_section  # noqa: E402

NUM_REQUESTS = 16
PROMPT_LEN = 64
OUTPUT_LEN = 64
ARMS = (0, 1, 4, 16)  # distinct adapters in the batch (0 = the base model alone)
RANK = 8
MODULES = {
    "q_proj": (576, 576),
    "k_proj": (576, 192),
    "v_proj": (576, 192),
    "o_proj": (576, 576),
    "gate_proj": (576, 1536),
    "up_proj": (576, 1536),
    "down_proj": (1536, 576),
}  # (in, out), SmolLM2-135M


def write_adapter(folder: str, seed: int, num_layers: int = 30, rank: int = RANK) -> str:
    """A PEFT adapter folder (all seven projections, random non-zero A and B)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}, f)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        for m, (fan_in, fan_out) in MODULES.items():
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return folder


def decode_throughput(engine: LLMEngine, prompts, adapters: list[str]) -> float:
    """Output tokens per second after the last request's first token (prefill excluded)."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    engine.pool.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        lora = adapters[i % len(adapters)] if adapters else None
        engine.add_request(params=params, prompt_token_ids=prompt, lora_name=lora)
    first_tokens, t_start, decoded = 0, None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        new = sum(len(o.new_token_ids) for o in outs)
        if t_start is None:
            first_tokens += new
            if first_tokens >= len(prompts):
                t_start = time.perf_counter()
        else:
            decoded += new
    return decoded / (time.perf_counter() - t_start)


def run(threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    folder = tempfile.mkdtemp(prefix="bench-lora-")
    paths = {f"a{i}": write_adapter(os.path.join(folder, f"a{i}"), seed=i) for i in range(max(ARMS))}
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            cache=CacheConfig(kv_cache_memory_bytes=256 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=NUM_REQUESTS, max_model_len=1024),
            device=DeviceConfig(quantization="auto", num_threads=threads),
            lora=LoraConfig(max_loras=max(ARMS), max_cpu_loras=max(ARMS), max_lora_rank=RANK),
        )
    )
    for name, path in paths.items():
        engine.load_lora_adapter(name, path)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    decode_throughput(engine, prompts, [])  # warm-up
    best = dict.fromkeys(ARMS, 0.0)
    for _ in range(repeats):
        for n in ARMS:
            best[n] = max(best[n], decode_throughput(engine, prompts, list(paths)[:n]))
    return {
        "threads": threads,
        "repeats": repeats,
        "quantization": engine.quantization,
        "tok_s": best,
        "cpu": cpu_model(),
        "torch": torch.__version__,
    }


# ---- W5: adapter-aware routing ---------------------------------------------------------------
W5_ADAPTERS = 32
W5_SLOTS = 8
W5_REQUESTS = 64
W5_RATE = 1.0  # requests per second
W5_ZIPF = 1.1
W5_ROUNDS = 3  # every arm once in every position
W5_WARM = 32  # untimed requests before each arm's timed ones, under its own router
# Before those, one untimed request per adapter (as W1's warm_prefixes): every adapter's system
# prompt is then cached on the worker the arm's router chose for it. Without it each round's
# first request for each rarer adapter computes its system prompt cold (fresh system prompts
# every round, so no arm reuses another's cache): ~15 % of every arm's requests, 0.18-0.24 s
# each on an idle worker, which set ours' p90 whatever the routing did.
W5_WARM_PREFIXES = True
W5_ARMS = {
    "adapter+prefix+load (ours)": None,  # the default decode profile
    "round-robin": [{"name": "round-robin", "weight": 1}],
    "load-only": [{"name": "queue-depth", "weight": 3}, {"name": "pending-assignments", "weight": 1}],
}


class Proc:
    """A subprocess that prints a line starting with `ready` when it serves."""

    def __init__(self, argv, ready):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(ready):
                break
        else:
            raise RuntimeError(f"{argv[:6]} exited before serving:\n" + "".join(self.lines[-20:]))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def adapter_mb(rank: int, num_layers: int = 30) -> float:
    """An adapter's size in fp32 (A and B of the seven projections)."""
    return 4 * rank * num_layers * sum(fan_in + fan_out for fan_in, fan_out in MODULES.values()) / 1e6


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def w5_requests(
    num_requests: int = W5_REQUESTS, num_adapters: int = W5_ADAPTERS, rate: float = W5_RATE, seed: int = 0
) -> list[tuple[float, int, int]]:
    """(arrival time, adapter index, random seed of the user part): the same for every arm."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** W5_ZIPF for k in range(num_adapters)]
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append((t, rng.choices(range(num_adapters), weights)[0], rng.randrange(10**9)))
    return out


def w5_each_adapter(num_adapters: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    """One request per adapter, in random order, Poisson at `rate`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for adapter in rng.sample(range(num_adapters), num_adapters):
        t += rng.expovariate(rate)
        out.append((t, adapter, rng.randrange(10**9)))
    return out


def followed_by(first: list, then: list) -> list:
    """`first`, then `then` with its arrival times shifted to start where `first` ends."""
    end = first[-1][0] if first else 0.0
    return first + [(t + end, adapter, seed) for t, adapter, seed in then]


def w5_prompt(arm_index: int, adapter: int, user_seed: int) -> list[int]:
    system = random.Random(1000 * arm_index + adapter)
    user = random.Random(user_seed)
    return [system.randrange(100, 40000) for _ in range(64)] + [user.randrange(100, 40000) for _ in range(16)]


async def w5_arm(url: str, arm_index: int, requests) -> list[float]:
    """Each request's TTFT, sent at its arrival time through the load generator's client, which
    reads every stream to its end (a client that left at the first token would have the gateway
    abort the rest of the request, and the workers would never decode it)."""
    import asyncio

    import httpx

    from splitserve.bench.loadgen.client import RequestResult, encode_payload, send
    from splitserve.bench.loadgen.workloads import BenchRequest

    async def one(client, t, adapter, user_seed):
        req = BenchRequest(tuple(w5_prompt(arm_index, adapter, user_seed)), max_tokens=16)
        body = encode_payload(f"a{adapter}", req, {"temperature": 0})
        await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
        result = RequestResult(index=0, category="", tag="", num_prompt_tokens=req.num_prompt_tokens, max_tokens=16)
        out = await send(client, "/v1/completions", body, result, start)
        if not out.success or out.output_tokens != 16:
            raise RuntimeError(f"a W5 request failed: {out.error or f'{out.output_tokens} tokens of 16'}")
        return out.ttft_s

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(*(one(client, *r) for r in requests)))


def run_w5(
    threads: int,
    num_requests: int = W5_REQUESTS,
    num_adapters: int = W5_ADAPTERS,
    resident: int | None = None,
    rate: float = W5_RATE,
    rank: int = RANK,
    rounds: int = W5_ROUNDS,
    warm: int = W5_WARM,
    warm_prefixes: bool = W5_WARM_PREFIXES,
) -> dict:
    """The arms take turns over `rounds` rounds, the order rotated each round (with 3 rounds every
    arm runs once first, once second, once last), each arm's requests complete before the next
    arm starts, and an untimed warm-up round goes first: a machine's drift and the adapters'
    first reads fall on every arm alike. Each round draws a fresh request sequence (the same for
    every arm in it) and fresh system prompts (no arm reuses another's cache).

    Before its timed requests each arm serves `warm` untimed ones of the same mix under its own
    router: what the workers hold when the timed requests come (adapters in memory, prefixes
    cached) is then that arm's own steady state, not what the arm before it left. Without this,
    an arm that keeps each adapter on one worker (so that together the workers hold them all)
    was timed right after round-robin had put the same popular adapters in both workers' memory
    and evicted the rare ones from both."""
    import yaml

    folder = tempfile.mkdtemp(prefix="bench-lora-w5-")
    modules = [
        f"a{i}={write_adapter(os.path.join(folder, f'a{i}'), seed=100 + i, rank=rank)}" for i in range(num_adapters)
    ]
    os.sync()  # the adapters' write-back must not fall on the first arm
    cli = [sys.executable, "-m", "splitserve.platform.cli"]
    workers, addresses, metrics_ports = [], [], []
    try:
        for _ in range(2):
            grpc_port = free_port()
            metrics_ports.append(free_port())
            workers.append(
                Proc(
                    cli
                    + [
                        "worker",
                        "--role",
                        "both",
                        "--threads",
                        str(threads),
                        "--grpc-port",
                        str(grpc_port),
                        "--metrics-port",
                        str(metrics_ports[-1]),
                        "--kv-port",
                        str(free_port()),
                        "--kv-transport",
                        "tcp",
                        "--kv-cache-memory",
                        "0.25",
                        "--max-model-len",
                        "1024",
                        "--max-loras",
                        str(W5_SLOTS),
                        "--max-cpu-loras",
                        str(resident or max(num_adapters, W5_SLOTS)),
                        "--max-lora-rank",
                        str(rank),
                        "--lora-modules",
                        *modules,
                    ],
                    "READY",
                )
            )
            addresses.append(f"127.0.0.1:{grpc_port}")

        def arm_run(arm: str, scorers, tag: int, requests, warm_requests=()) -> tuple[list[float], list[float]]:
            port = free_port()
            placement = {"disaggregation": {"mode": "never"}}
            if scorers is not None:
                placement["decode"] = {"scorers": scorers}
            config = {
                "model": "smollm2-135m",
                "max_model_len": 1024,
                "discovery": {"workers": addresses},
                "gateway": {
                    "host": "127.0.0.1",
                    "port": port,
                    "max_concurrent_requests": 512,
                    "max_queued_requests": 4096,
                },
                "placement": placement,
            }
            path = os.path.join(folder, f"router-{tag}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            router = Proc(cli + ["router", "--config", path], "splitserve router: serving")
            try:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 120
                while len(httpx.get(f"{url}/v1/models").json()["data"]) < 1 + num_adapters:
                    assert time.monotonic() < deadline, "the router did not see the workers' adapters"
                    time.sleep(0.2)
                if warm_requests:
                    asyncio.run(w5_arm(url, tag, warm_requests))
                before = [worker_counter(port, PROMPT_TOKENS) for port in metrics_ports]
                reads = sum(worker_counter(port, ADAPTER_READS) for port in metrics_ports)
                ttfts = asyncio.run(w5_arm(url, tag, requests))
                reads = sum(worker_counter(port, ADAPTER_READS) for port in metrics_ports) - reads
                return ttfts, [worker_counter(port, PROMPT_TOKENS) - b for port, b in zip(metrics_ports, before)], reads
            finally:
                router.stop()

        import asyncio

        import httpx

        names = list(W5_ARMS)
        arm_run("warm-up", W5_ARMS["round-robin"], 999, w5_requests(num_requests, num_adapters, rate, seed=999))
        ttfts = {arm: [] for arm in names}
        seen = {arm: [0.0, 0.0] for arm in names}
        reads = {arm: 0 for arm in names}
        per_round = {arm: [] for arm in names}
        for r in range(rounds):
            requests = w5_requests(num_requests, num_adapters, rate, seed=r)
            warm_requests = w5_requests(warm, num_adapters, rate, seed=100 + r) if warm else []
            if warm_prefixes:
                warm_requests = followed_by(w5_each_adapter(num_adapters, rate, seed=200 + r), warm_requests)
            for k in range(len(names)):
                arm = names[(r + k) % len(names)]
                got, tokens, arm_reads = arm_run(
                    arm, W5_ARMS[arm], r * len(names) + names.index(arm), requests, warm_requests
                )
                reads[arm] += int(arm_reads)
                ttfts[arm] += got
                seen[arm] = [a + b for a, b in zip(seen[arm], tokens)]
                per_round[arm].append(percentile(got, 0.9))
                print(
                    f"W5 round {r + 1} {arm}: p50 {percentile(got, 0.5):.2f} s, p90 {percentile(got, 0.9):.2f} s, "
                    f"prompt tokens per worker {'/'.join(f'{100 * x / max(sum(tokens), 1):.0f}' for x in tokens)} %, "
                    f"adapter reads {int(arm_reads)}",
                    file=sys.stderr,
                )
        arms = {
            arm: {
                "p50": percentile(ttfts[arm], 0.5),
                "p90": percentile(ttfts[arm], 0.9),
                "share": [x / max(sum(seen[arm]), 1) for x in seen[arm]],
                "round_p90": per_round[arm],
                "reads": reads[arm],
            }
            for arm in names
        }
        return {
            "arms": arms,
            "threads": threads,
            "requests": num_requests,
            "adapters": num_adapters,
            "rate": rate,
            "resident": resident or num_adapters,
            "rank": rank,
            "mb": adapter_mb(rank),
            "rounds": rounds,
            "warm": warm,
            "warm_prefixes": warm_prefixes,
        }
    finally:
        for w in workers:
            w.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


# a worker's prompt tokens looked up in its prefix cache (one count per request's prompt: how the
# router split the work), and the adapter folders it read again for requests (evicted adapters)
PROMPT_TOKENS, ADAPTER_READS = "vllm:prefix_cache_queries_total", "splitserve_lora_adapter_reads_total"


def worker_counter(metrics_port: int, name: str) -> float:
    import httpx

    for line in httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise RuntimeError(f"the worker's metrics on port {metrics_port} have no {name}")


def _warm_text(w5: dict) -> str:
    warm = w5.get("warm", 0)
    parts = (
        ["one untimed request per adapter (its system prompt cached where the arm's router put it)"]
        if w5.get("warm_prefixes")
        else []
    )
    parts += [f"{warm} untimed requests of the same mix"] if warm else []
    if not parts:
        return "each arm timed in the state the arm before it left"
    return f"each arm first serves {', then '.join(parts)} under its own router"


def render_w5(w5: dict) -> str:
    arms = w5["arms"]
    ours, rr = arms["adapter+prefix+load (ours)"]["p90"], arms["round-robin"]["p90"]
    rows = "\n".join(
        f"| {arm} | {v['p50']:.2f} | {v['p90']:.2f} | {rr / v['p90']:.2f}x | "
        f"{' / '.join(f'{100 * x:.0f}' for x in v.get('share', []))} | "
        f"{', '.join(f'{x:.2f}' for x in v.get('round_p90', []))} | {v.get('reads', '–')} |"
        for arm, v in arms.items()
    )
    return f"""
### W5: {w5["adapters"]} adapters, zipf popularity, 2 workers with {W5_SLOTS} adapter slots each

{w5.get("rounds", 1)} rounds of {w5["requests"]} requests per arm at {w5["rate"]}/s (Poisson; the arms' order rotated
each round, after an untimed warm-up round; {_warm_text(w5)}), adapter drawn from zipf (s = {W5_ZIPF}) \
over {w5["adapters"]}
adapters (rank {w5.get("rank", RANK)}, all projections: {w5.get("mb", adapter_mb(RANK)):.0f} MB each in fp32, \
loaded on both workers), each prompt the adapter's 64-token
system prompt + 16 random tokens, 16 output tokens streamed; two `--role both` workers with
{w5["threads"]} torch thread each, `--max-loras {W5_SLOTS}` and \
`--max-cpu-loras {w5.get("resident", w5["adapters"])}` (adapters beyond
that are read again from their folder when asked for), one router per arm, same request sequence.

| routing | p50 TTFT s | p90 TTFT s | p90 of round-robin / this | prompt tokens per worker % | p90 per round s \
| adapter reads from disk |
|---|---|---|---|---|---|---|
{rows}

Target: at least 2x lower p90 TTFT than round-robin — measured {rr / ours:.2f}x
({"met" if rr / ours >= 2 else "not met"}).
"""


def render(result: dict) -> str:
    base = result["tok_s"][0]
    rows = "\n".join(
        f"| {'base model alone' if n == 0 else f'{n} adapter' + ('s' if n > 1 else '')} | "
        f"{tok_s:.1f} | {tok_s / base:.2f}x |"
        for n, tok_s in result["tok_s"].items()
    )
    four = result["tok_s"][4] / base
    return f"""<!-- lora:begin -->
## Multi-LoRA decode throughput (bench/lora.py)

16 concurrent requests (64 prompt tokens, 64 output tokens, greedy) on one engine, SmolLM2-135M,
`--quantization {result["quantization"]}`, {result["threads"]} torch thread(s); LoRA adapters of rank 8
on all seven projections (q, k, v, o, gate, up, down), requests spread round-robin over the
adapters, `max_loras` 16. Decode tokens/s after the last request's first token (prefill
excluded); best of {result["repeats"]} interleaved repeats, on a {result["cpu"]}; the ratios come from
one run.

| batch | decode tok/s | vs base |
|---|---|---|
{rows}

Target: at least 0.8x the base model with 4 distinct adapters — measured {four:.2f}x
({"met" if four >= 0.8 else "not met"}). Each fused linear adds its adapters' deltas in one C call
(`ss_lora_delta`, kernels/cpu_ops.c: each adapter's rows gathered, its own A and B shards, fixed
order, so a row's bits do not depend on its batch), inside the one-call decode step
(kernels/cpu_decode.c); what grows with the number of distinct adapters is reading their weights
(rank 8 on all projections: 2.4 M parameters, 9.8 MB in fp32, per adapter per step).
{result.get("w5_text", "")}
<!-- lora:end -->"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", default=None, help="update this markdown file's lora section")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-w5", action="store_true", help="only the in-process decode throughput part")
    ap.add_argument("--only-w5", action="store_true", help="only W5 (prints its table; --write needs both parts)")
    ap.add_argument("--w5-requests", type=int, default=W5_REQUESTS, help="W5 requests per arm (>= 2)")
    ap.add_argument("--w5-adapters", type=int, default=W5_ADAPTERS, help="W5 adapters (>= 1)")
    ap.add_argument("--w5-rate", type=float, default=W5_RATE, help="W5 arrivals per second (> 0)")
    ap.add_argument(
        "--w5-rounds", type=int, default=W5_ROUNDS, help="W5 rounds; each runs every arm once, the order rotated (>= 1)"
    )
    ap.add_argument(
        "--w5-rank",
        type=int,
        default=RANK,
        help="W5 adapters' rank (all seven projections; 64 is QLoRA's usual choice: 78 MB per adapter)",
    )
    ap.add_argument(
        "--w5-warm",
        type=int,
        default=W5_WARM,
        help="untimed W5 requests each arm serves under its own router before its timed ones (>= 0)",
    )
    ap.add_argument(
        "--w5-no-warm-prefixes",
        action="store_true",
        help="skip the untimed request per adapter before each arm (the sixth session's method)",
    )
    ap.add_argument(
        "--w5-resident",
        type=int,
        default=None,
        help=f"adapters a W5 worker keeps in memory (--max-cpu-loras, >= {W5_SLOTS}; default: all); "
        "the others are read again from their folder when asked for",
    )
    args = ap.parse_args()
    if args.skip_w5 and args.only_w5:
        ap.error("--skip-w5 and --only-w5 exclude each other")
    if args.only_w5 and args.write:
        ap.error("--write updates the whole lora section: run both parts (drop --only-w5)")
    if args.w5_requests < 2 or args.w5_adapters < 1 or args.w5_rate <= 0 or args.threads < 1 or args.repeats < 1:
        ap.error("need --w5-requests >= 2, --w5-adapters >= 1, --w5-rate > 0, --threads >= 1 and --repeats >= 1")
    if args.w5_warm < 0:
        ap.error(f"--w5-warm must be >= 0, got {args.w5_warm}")
    if args.w5_rounds < 1:
        ap.error(f"--w5-rounds must be >= 1, got {args.w5_rounds}")
    if not 1 <= args.w5_rank <= 256:
        ap.error(f"--w5-rank must be in 1..256, got {args.w5_rank}")
    if args.w5_resident is not None and args.w5_resident < W5_SLOTS:
        ap.error(f"--w5-resident must be >= {W5_SLOTS} (the adapter slots per step), got {args.w5_resident}")
    w5 = (
        None
        if args.skip_w5
        else run_w5(
            1,
            args.w5_requests,
            args.w5_adapters,
            args.w5_resident,
            rate=args.w5_rate,
            rank=args.w5_rank,
            rounds=args.w5_rounds,
            warm=args.w5_warm,
            warm_prefixes=not args.w5_no_warm_prefixes,
        )
    )
    if args.only_w5:
        print(render_w5(w5))
        return 0
    result = run(args.threads, args.repeats)
    if w5 is not None:
        result["w5_text"] = render_w5(w5)
    section = render(result)
    print(section)
    if args.write:
        write_section(args.write, "lora", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
