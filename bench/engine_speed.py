"""Engine speed (issue 12): every --quantization mode beside this host's floors, and single-stream
serving through `splitserve up` (what `make run` starts) against llama-cpp-python on the same
GGUF and cores. One process, arms interleaved, so drifting machine load hits them alike.

    python bench/engine_speed.py [--write docs/benchmarks.md] [--threads 2] [--peer-python .venv-peer/bin/python]

1. Floors, measured here: read bandwidth (a 1 GiB float32 sum) and GEMM peaks (2048^3 matmuls
   in float32, bfloat16 and int8). A decode step cannot beat its bytes over the bandwidth nor its
   linears' multiply-adds over the peak of the arithmetic its mode computes them in (`w4a16`:
   two int8 dot products per multiply-add, so half the int8 peak). The floor of a step is the
   larger of the two, and b8/b1 and b32/b1 of the floors say what batching can cost at best here.
2. Decode step time per mode at batch 1, 2, 4, 8, 16, 32 with 256 tokens of context each:
   the median of STEPS engine steps after every sequence is prefilled, modes interleaved per batch.
   Two more arms isolate what the default's parts are worth: `auto` with a float32 KV cache, and
   `auto` with the AMX tiles off (on a host that has them).
3. Resident weight memory per mode against the GGUF file; greedy agreement with transformers
   (the float32 reference, same GGUF) on the 8 prompts of the fidelity tests, 64 tokens each.
4. Single stream: one chat request of 128 tokens (EOS banned on both servers) streamed at a
   time, alternating between `splitserve up --threads 1`, `--threads 2` and llama-cpp-python's
   server (2 threads); TTFT and decode tokens/s (tokens after the first over the time after it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.model_source import resolve_model
from splitserve.platform.quant.cpu import cpu_model, isa_summary
from splitserve.platform.quant.report import describe_kernels, weight_nbytes
from splitserve.platform.sampling.params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402

MODES = ("none", "int4", "w4a16", "w4a8", "int8", "fp16", "auto")
# arm -> (--quantization, --kv-cache-dtype, AMX allowed)
ARMS = {
    **{mode: (mode, "auto", True) for mode in MODES},
    "auto, float32 KV": ("auto", "float32", True),
    "auto, no AMX": ("auto", "auto", False),
}
BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXT = 256
STEPS = 12
STREAM_TOKENS = 128
STREAM_ROUNDS = 3
PROMPTS = [  # the fidelity tests' prompts (tests/platform/test_engine_vs_transformers.py)
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Translate to French: I love cheese.",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\nx = np.",
]
CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]


# ---- floors ------------------------------------------------------------------------------------
def timed(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def floors() -> dict:
    x = torch.ones(256 * 1024**2)  # 1 GiB
    bandwidth = x.nbytes / timed(x.sum)
    a = torch.randn(2048, 2048)
    fp32 = 2 * 2048**3 / timed(lambda: a @ a)
    b = a.bfloat16()
    bf16 = 2 * 2048**3 / timed(lambda: b @ b)
    q = torch.randint(-128, 128, (2048, 2048), dtype=torch.int8)
    try:  # oneDNN's int8 GEMM: VNNI, AMX or AVX2's pairwise multiply-adds, whatever the host has
        int8 = 2 * 2048**3 / timed(lambda: torch._int_mm(q, q)) / 1e9
    except RuntimeError:
        int8 = None
    return {"read_gb_s": bandwidth / 1e9, "fp32_gflops": fp32 / 1e9, "bf16_gflops": bf16 / 1e9, "int8_gops": int8}


def kernel_kinds(engine: LLMEngine) -> tuple[str, str]:
    """The kernel the decoder layers' linears mostly run in and the LM head's, as the model reports
    them (e.g. `w4a16`, `w8a16`; `none` where a linear or the head is a float matmul)."""
    from collections import Counter

    from splitserve.platform.models.layers import MergedLinear

    kinds = Counter(m.kernel.name for m in engine.model.modules() if isinstance(m, MergedLinear) and m.kernel)
    head = getattr(engine.model, "lm_head_kernel", None)
    return (kinds.most_common(1)[0][0] if kinds else "none"), (head.name if head is not None else "none")


def arithmetic_peak(kind: str, fl: dict) -> float | None:
    """Operations per second (G) of the arithmetic a kernel computes in, from the measured GEMM
    peaks: two int8 digits per activation (`w4a16`, the `w8a16` head) make two int8 dot products
    per multiply-add, one digit (`w4a8`) one; float matmuls (`none`, fbgemm's `fp16`) run in
    float32; torch's `int4`/`int8` kernels take the faster of float32 and bfloat16 (bfloat16 falls
    to a 0.3 GFLOP/s reference path on an AVX2 EPYC). None: no int8 GEMM to measure here."""
    int8 = fl.get("int8_gops")
    if kind in ("w4a16", "w8a16", "w4a8"):
        return None if int8 is None else int8 / (1 if kind == "w4a8" else 2)
    if kind in ("none", "fp16"):
        return fl["fp32_gflops"]
    return max(fl["bf16_gflops"], fl["fp32_gflops"])


def step_floor_ms(engine: LLMEngine, batch: int, fl: dict) -> tuple[float, float | None]:
    """(read floor, compute floor) of one decode step in ms: weight bytes plus `batch` sequences'
    KV over the read bandwidth; the linears' and LM head's operations over their arithmetic's
    peak. Attention's arithmetic and everything else is left out, so both are lower bounds."""
    read = (step_bytes(engine) + batch * kv_bytes_per_sequence(engine)) / (fl["read_gb_s"] * 1e9) * 1e3
    linear_peak, head_peak = (arithmetic_peak(kind, fl) for kind in kernel_kinds(engine))
    if linear_peak is None or head_peak is None:
        return read, None
    linear, head = linear_macs(engine)
    return read, 2.0 * batch * (linear / linear_peak + head / head_peak) / 1e9 * 1e3


# ---- engine arms -------------------------------------------------------------------------------
def make_engine(mode: str, kv_cache_dtype: str = "auto", model=None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            device=DeviceConfig(quantization=mode, kv_cache_dtype=kv_cache_dtype),
            cache=CacheConfig(kv_cache_memory_bytes=512 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048),
        ),
        model=model,
    )


def make_arms() -> dict[str, LLMEngine]:
    """One engine per arm; arms of one mode share its weights. The AMX arm only where there are tiles."""
    ops = cpu_ops()
    has_amx = ops is not None and ops.set_amx(True)
    engines: dict[str, LLMEngine] = {}
    for arm, (mode, kv, amx) in ARMS.items():
        if not amx and not has_amx:
            continue
        engines[arm] = make_engine(mode, kv, model=engines[mode].model if mode in engines else None)
    return engines


def use_arm(arm: str) -> None:
    """Switch the process-wide AMX permission to what `arm` asks for."""
    ops = cpu_ops()
    if ops is not None:
        ops.set_amx(ARMS[arm][2])


def step_ms(engine: LLMEngine, batch: int, seed: int, clock=time.perf_counter) -> float:
    """Median time of one decode step by `clock` (bench/kernel_ab.py passes a thread's CPU clock)."""
    import random

    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=STEPS + 8, ignore_eos=True)
    ids = [
        engine.add_request(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(CONTEXT)], params=params)
        for _ in range(batch)
    ]
    while any(engine.scheduler.requests[i].num_output_tokens == 0 for i in ids):
        engine.step()
    times = []
    for _ in range(STEPS):
        t = clock()
        engine.step()
        times.append(clock() - t)
    for i in ids:
        engine.abort(i)
    while engine.has_work():
        engine.step()
    engine.pool.reset_prefix_cache()
    return statistics.median(times) * 1e3


def step_bytes(engine: LLMEngine) -> int:
    """Weight bytes one decode step reads: everything but the embedding table (a few rows)."""
    model = engine.model
    total = weight_nbytes(model)
    if engine.quantization == "none":
        tied = model.lm_head is None
        return total - (0 if tied else model.embed_tokens.weight.nbytes)
    return total - model.embed_tokens.nbytes


def kv_bytes_per_sequence(engine: LLMEngine) -> int:
    """KV-cache bytes one decode step reads per sequence at CONTEXT tokens (K and V, every layer)."""
    c = engine.model_config
    return 2 * c.num_layers * CONTEXT * c.num_kv_heads * c.head_dim * engine.kv_dtype.itemsize


def linear_macs(engine: LLMEngine) -> tuple[int, int]:
    """Multiply-adds per token in the decoder layers' linears and in the LM head."""
    c = engine.model_config
    linear = (
        c.num_layers
        * c.hidden_size
        * ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim + 3 * c.intermediate_size)
    )
    return linear, c.vocab_size * c.hidden_size


def greedy_agreement(engines: dict[str, LLMEngine]) -> dict[str, int]:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(resolve_model("smollm2-135m").path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = next(iter(engines.values())).tokenizer
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out, past, cur = [], None, torch.tensor([ids])
            for _ in range(64):
                step = hf(input_ids=cur, past_key_values=past, use_cache=True)
                past = step.past_key_values
                out.append(int(step.logits[0, -1].argmax()))
                cur = torch.tensor([[out[-1]]])
            refs.append(out)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    agreement = {}
    for arm, e in engines.items():
        use_arm(arm)
        agreement[arm] = sum(o.output_token_ids == r for o, r in zip(e.generate(prompt_ids, params), refs))
    return agreement


# ---- single stream through the servers ---------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], url: str):
        self.name, self.url = name, url
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(line) for line in self.proc.stdout], daemon=True).start()

    def wait(self, timeout_s: float = 600) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {''.join(self.lines[-20:])}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200 and json.load(r)["data"]:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_once(server: Server, extra_body: dict) -> tuple[float, float, int]:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    t = time.perf_counter()
    first, n = None, 0
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=STREAM_TOKENS, temperature=0, stream=True, extra_body=extra_body
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            n += 1
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first - t) * 1e3, (n - 1) / (end - first), n


def single_stream(peer_python: str | None) -> dict[str, dict]:
    cli = os.path.join(os.path.dirname(sys.executable), "splitserve")
    servers = []
    for threads in (1, 2):
        port = free_port()
        servers.append(
            (
                Server(
                    f"splitserve up --threads {threads}",
                    [cli, "up", "--port", str(port), "--threads", str(threads)],
                    f"http://127.0.0.1:{port}",
                ),
                {"ignore_eos": True},
            )
        )
    if peer_python:
        port = free_port()
        servers.append(
            (
                Server(
                    "llama-cpp-python (2 threads)",
                    [
                        peer_python,
                        "-m",
                        "llama_cpp.server",
                        "--model",
                        resolve_model("smollm2-135m").path,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--n_threads",
                        "2",
                        "--n_threads_batch",
                        "2",
                        "--n_ctx",
                        "2048",
                        "--interrupt_requests",
                        "False",
                    ],
                    f"http://127.0.0.1:{port}",
                ),
                {"logit_bias": {"0": -100, "2": -100}},
            )
        )
    results: dict[str, dict] = {}
    try:
        for server, _ in servers:
            server.wait()
        for server, extra in servers:  # warm-up
            stream_once(server, extra)
        for _ in range(STREAM_ROUNDS):
            for server, extra in servers:
                ttft, rate, n = stream_once(server, extra)
                r = results.setdefault(server.name, {"ttft_ms": [], "tok_s": [], "tokens": n})
                r["ttft_ms"].append(ttft)
                r["tok_s"].append(rate)
                print(f"{server.name}: TTFT {ttft:.1f} ms, {rate:.1f} tok/s, {n} tokens", flush=True)
    finally:
        for server, _ in servers:
            server.stop()
    return {
        name: {
            "ttft_ms": statistics.median(r["ttft_ms"]),
            "tok_s": statistics.median(r["tok_s"]),
            "tokens": r["tokens"],
        }
        for name, r in results.items()
    }


# ---- report ------------------------------------------------------------------------------------
def render(fl: dict, steps: dict, engines: dict, agreement: dict, stream: dict, cmd: str, threads: int) -> str:
    file_bytes = os.path.getsize(resolve_model("smollm2-135m").path)
    out = [
        "<!-- engine-speed:begin -->",
        "## Engine speed: quantization modes, floors, single stream (issue 12)",
        "",
        f"Host: {os.cpu_count()} vCPU {cpu_model()} ({isa_summary()}); torch {torch.__version__}, "
        f"{threads} torch threads. Floors measured in the same run: read bandwidth "
        f"{fl['read_gb_s']:.1f} GB/s, GEMM {fl['fp32_gflops']:.0f} GFLOP/s float32, "
        f"{fl['bf16_gflops']:.0f} GFLOP/s bfloat16 and "
        + ("no int8 GEMM" if fl.get("int8_gops") is None else f"{fl['int8_gops']:.0f} GOP/s int8")
        + ".",
        "",
        f"Command: `{cmd}`",
        "",
        "### Decode step (ms), 256 tokens of context per sequence",
        "",
        "A step's floor is the larger of its read floor (weight bytes plus the KV cache it attends "
        "over, in the arm's KV dtype, 256 tokens per sequence, over the measured bandwidth) and its "
        "compute floor (the linears' and LM head's operations over the measured peak of the arithmetic "
        "the mode computes them in; int8 GEMM for the a8 modes, halved for two digits). Attention's "
        "arithmetic is left out, so the floors are lower bounds. Where the floors' own b8/b1 or b32/b1 "
        "exceeds a target, no kernel computing in that arithmetic meets it once batch 1 is at its "
        "floor. The default is `auto`: float16 KV, and AMX tiles for steps of 8+ rows where the CPU "
        "has them.",
        "",
        "| mode | " + " | ".join(f"batch {b}" for b in BATCHES) + " | b8/b1 | b32/b1 | floor b1 | floor b8 | "
        "floor b32 | floors b8/b1 | floors b32/b1 |",
        "|---" * (len(BATCHES) + 8) + "|",
    ]
    parts = {arm: {b: step_floor_ms(e, b, fl) for b in (1, 8, 32)} for arm, e in engines.items()}
    floors_ms = {
        arm: {b: max(read, compute or 0.0) for b, (read, compute) in by_batch.items()}
        for arm, by_batch in parts.items()
    }
    for arm in engines:
        row = [f"{steps[(arm, b)]:.1f}" for b in BATCHES]
        floor = floors_ms[arm]
        read_only = " (read only)" if parts[arm][1][1] is None else ""
        out.append(
            f"| {arm} | " + " | ".join(row) + f" | {steps[(arm, 8)] / steps[(arm, 1)]:.2f}× "
            f"| {steps[(arm, 32)] / steps[(arm, 1)]:.2f}× | {floor[1]:.1f} ms "
            f"({steps[(arm, 1)] / floor[1]:.1f}× above){read_only} | {floor[8]:.1f} ms | {floor[32]:.1f} ms "
            f"| {floor[8] / floor[1]:.2f}× | {floor[32] / floor[1]:.2f}× |"
        )
    e, b1 = engines["auto"], steps[("auto", 1)]
    for batch, target in ((8, 1.5), (32, 3.0)):
        read, compute = parts["auto"][batch]
        floor = floors_ms["auto"][batch]
        verdict = (
            "below that floor: no kernel computing in this arithmetic reaches it on this host"
            if target * b1 < floor
            else f"{floor / (target * b1):.0%} of it is the floor"
        )
        out.append(
            f"\n`auto` ({kernel_kinds(e)[0]}), target batch {batch} ≤ {target:g}× batch 1: "
            f"{target * b1:.1f} ms against a floor of {floor:.1f} ms "
            f"({'compute' if compute and compute > read else 'read'}-bound): {verdict}."
        )
    out += [
        "",
        "### Weights per mode",
        "",
        "| mode | kernels | resident weights (MB) | × GGUF file | greedy = transformers (8 prompts × 64 tokens) |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        e = engines[mode]
        nbytes = weight_nbytes(e.model)
        kernels = describe_kernels(e.model) if e.quantization != "none" else "float32 dense"
        out.append(f"| {mode} | {kernels} | {nbytes / 1e6:.0f} | {nbytes / file_bytes:.2f}× | {agreement[mode]}/8 |")
    if stream:
        peer = next((v for k, v in stream.items() if k.startswith("llama")), None)
        out += [
            "",
            f"### Single stream: one chat request, {STREAM_TOKENS} tokens, streamed (median of "
            f"{STREAM_ROUNDS}, servers alternating)",
            "",
            "| server | TTFT (ms) | decode tok/s | × llama-cpp-python |",
            "|---|---|---|---|",
        ]
        for name, r in stream.items():
            ratio = f"{r['tok_s'] / peer['tok_s']:.2f}×" if peer else "—"
            out.append(f"| {name} | {r['ttft_ms']:.1f} | {r['tok_s']:.1f} | {ratio} |")
    out += ["", "<!-- engine-speed:end -->"]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="update this markdown file's engine-speed section")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-python", default=".venv-peer/bin/python", help="llama-cpp-python's Python ('' to skip)")
    ap.add_argument("--no-stream", action="store_true", help="skip the single-stream server comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fl = floors()
    print(json.dumps(fl), flush=True)
    engines = make_arms()
    torch.set_num_threads(args.threads)
    for arm, e in engines.items():
        use_arm(arm)
        step_ms(e, 1, seed=0)  # warm-up
    steps = {}
    for b in BATCHES:
        for arm, e in engines.items():  # interleaved per batch size
            use_arm(arm)
            steps[(arm, b)] = step_ms(e, b, seed=b)
            print(f"{arm} batch {b}: {steps[(arm, b)]:.1f} ms", flush=True)
    agreement = greedy_agreement(engines)
    use_arm("auto")
    print(json.dumps(agreement), flush=True)
    peer = args.peer_python if args.peer_python and os.access(args.peer_python, os.X_OK) else None
    stream = {} if args.no_stream else single_stream(peer)
    cmd = "make bench  # = python bench/engine_speed.py --write docs/benchmarks.md --threads 2"
    section = render(fl, steps, engines, agreement, stream, cmd, args.threads)
    print(section)
    if args.write:
        write_section(args.write, "engine-speed", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
