"""Phase 3 of bench/gpu_check.py: P/D between worker processes on the one GPU, against a cold
colocated worker, over CUDA IPC and over tcp.

Per configuration (model, dtype), three worker processes (`python bench/gpu_check.py worker ...`),
all with the same KV secret (CUDA IPC needs an authenticated KV channel):

* P, role both, `--kv-transport auto`, `--no-prefix-caching`: the prefill worker of both P/D
  arms, and the colocated arm's worker. Without a prefix cache it computes every prompt whole,
  so the colocated arm is cold even though P prefilled the same prompt a moment before (the
  check of 2026-11-27 timed a warm cache instead).
* D, role decode, `--kv-transport auto`: P reaches it over CUDA IPC (the same GPU).
* T, role decode, `--kv-transport tcp`: T declines CUDA IPC, so P sends it bytes over tcp.

Each length runs a warm-up round (every shape compiles before it is timed) and then ROUNDS
timed rounds; each round draws a fresh prompt and sends it through every arm: `pd_ipc` (D asks
P), `pd_tcp` (T asks P), `colocated` (P alone). Which path a transfer took comes from P's
`splitserve_kv_transfers_total{path}` around each arm. Recorded per arm: TTFT at the client and
its breakdown from the first message's timings (queue, prefill on P, exposed transfer, first
decode step); tokens P/D = colocated (fp32: a gate; bf16: reported). Configurations run most
valuable first while the time budget lasts; one that fails records its error and the next runs.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

CHECK = pathlib.Path(__file__).resolve().parent / "gpu_check.py"
ROUNDS = 2
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120.0  # a request that hangs fails its configuration, not the whole check
ARM_KEYS = ("ttft", "queue", "prefill", "exposed_transfer", "first_decode_step")
# (name, model, dtype, prompt lengths, with the tcp decode worker, KV GiB, seconds it needs at least)
CONFIGS = [
    ("llama-3.2-1b bf16", "random:llama-3.2-1b", "bfloat16", (1024, 8192), True, 2.0, 60),
    ("llama-3-8b bf16", "random:llama-3-8b", "bfloat16", (1024, 8192), True, 3.0, 90),
    ("llama-3.2-1b fp32", "random:llama-3.2-1b", "float32", (1024, 8192), True, 2.0, 60),
    # three 8B fp32 workers (32 GB of weights each) do not fit an 80 GB GPU: no tcp worker, 1k only
    ("llama-3-8b fp32", "random:llama-3-8b", "float32", (1024,), False, 2.0, 90),
]
SMOKE = [("tiny fp32", "random:tiny", "float32", (256, 1024), True, 0.05, 0)]
# Acceptance (issue 45): P/D TTFT over cold colocated TTFT, and the exposed share of the prefill.
TARGETS = {"ipc_8k_bf16_ratio": 1.15, "tcp_8k_bf16_ratio": 1.5, "ipc_1k_bf16_ratio": 1.3, "ipc_exposed_share": 0.10}


def log(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`python bench/gpu_check.py worker ...` as a process; wait_ready() waits for its READY line."""

    def __init__(self, name: str, role: str, engine_args: list[str], extra: list[str]):
        self.name, self.role, self.port, self.metrics_port = name, role, free_port(), free_port()
        self.args = [
            sys.executable,
            str(CHECK),
            "worker",
            "--role",
            role,
            "--grpc-port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--kv-port",
            str(free_port()),
            *engine_args,
            *extra,
        ]
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Worker:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout):
            raise RuntimeError(f"{self.name} worker not ready in {timeout:.0f} s:\n" + "".join(self.lines[-40:]))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("READY"):
                self._ready.set()

    def metric(self, prefix: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    def notes(self) -> list[str]:
        """What the worker said about its KV path and any fallback from CUDA IPC."""
        return [line.strip()[-300:] for line in self.lines if re.search(r"KV path|not CUDA IPC|captured", line)][-6:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def generate(address: str, req_id: str, prompt: list[int], prefill: list[str], mode) -> dict:
    import grpc

    from splitserve.platform.wire import worker_pb2 as pb
    from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

    t0 = time.perf_counter()
    times, tokens, first = [], [], None
    async with grpc.aio.insecure_channel(address) as channel:
        async for msg in pb_grpc.WorkerStub(channel).Generate(
            pb.GenerateRequest(
                request_id=req_id,
                prompt_token_ids=prompt,
                prefill_workers=prefill,
                disaggregation=mode,
                params=pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            ),
            timeout=REQUEST_TIMEOUT_S,
        ):
            if msg.token_ids:
                times.append(time.perf_counter() - t0)
                tokens += list(msg.token_ids)
            if first is None:
                first = msg
    assert (first.prefill_worker != "") == bool(prefill), "the arm did not run as intended"
    return dict(
        tokens=tokens,
        ttft=times[0],
        queue=first.timings.queue_s,
        prefill=first.timings.prefill_s,
        exposed_transfer=first.timings.transfer_wait_s,
        first_decode_step=times[1] - times[0],
    )


def run_config(
    name: str, model: str, dtype: str, lengths, with_tcp: bool, kv_gib: float, device: str, secret: str, ready_s: float
) -> dict:
    from splitserve.platform.wire import worker_pb2 as pb

    max_len = max(lengths) + 256
    engine_args = [
        "--model",
        model,
        "--device",
        device,
        "--dtype",
        dtype,
        "--quantization",
        "none",
        "--kv-cache-memory",
        str(kv_gib),
        "--max-model-len",
        str(max_len),
        "--max-num-batched-tokens",
        str(max_len),
        "--max-num-seqs",
        "4",
        "--threads",
        "1" if device == "cpu" else "4",
        "--kv-secret-file",
        secret,
    ]
    workers = {
        "P": Worker("P", "both", engine_args, ["--kv-transport", "auto", "--no-prefix-caching"]),
        "D": Worker("D", "decode", engine_args, ["--kv-transport", "auto", "--disaggregation", "always"]),
    }
    if with_tcp:
        workers["T"] = Worker("T", "decode", engine_args, ["--kv-transport", "tcp", "--disaggregation", "always"])
    try:
        if "8b" in model:  # one after another: three 8B processes initializing at once peak too high
            for w in workers.values():
                w.start().wait_ready(ready_s)
        else:
            for w in workers.values():
                w.start()
            for w in workers.values():
                w.wait_ready(ready_s)
        p = workers["P"]
        arms = {"pd_ipc": (workers["D"].address, [p.address], pb.DISAGGREGATION_MODE_ALWAYS)}
        if with_tcp:
            arms["pd_tcp"] = (workers["T"].address, [p.address], pb.DISAGGREGATION_MODE_ALWAYS)
        arms["colocated"] = (p.address, [], pb.DISAGGREGATION_MODE_NEVER)
        vocab = 49152 if model == "random:tiny" else 128256
        rng = random.Random(7)
        result: dict = dict(model=model, dtype=dtype)
        for n in lengths:
            rows: dict[str, list[dict]] = {arm: [] for arm in arms}
            for round_ in range(1 + ROUNDS):  # round 0 warms every shape of this length up
                prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
                for arm, (address, prefill, mode) in arms.items():
                    ipc_before = p.metric('splitserve_kv_transfers_total{path="cuda_ipc"}')
                    r = asyncio.run(generate(address, f"{arm}-{n}-{round_}", prompt, prefill, mode))
                    r["path"] = (
                        (
                            "cuda_ipc"
                            if p.metric('splitserve_kv_transfers_total{path="cuda_ipc"}') > ipc_before
                            else "bytes"
                        )
                        if prefill
                        else "-"
                    )
                    if round_:
                        rows[arm].append(r)
            result[f"prompt_{n}"] = summarize(rows)
        result["notes"] = {k: w.notes() for k, w in workers.items()}
        return result
    finally:
        for w in workers.values():
            w.stop()


def summarize(rows: dict[str, list[dict]]) -> dict:
    out: dict = {
        arm: {**{k: statistics.median(r[k] for r in rs) for k in ARM_KEYS}, "paths": sorted({r["path"] for r in rs})}
        for arm, rs in rows.items()
    }
    colocated = rows["colocated"]
    for arm in (a for a in rows if a != "colocated"):
        equal = [a["tokens"] == b["tokens"] for a, b in zip(rows[arm], colocated, strict=True)]
        out[arm]["tokens_equal_colocated"] = f"{sum(equal)}/{len(equal)}"
        out[arm]["ttft_over_colocated"] = out[arm]["ttft"] / out["colocated"]["ttft"]
        out[arm]["exposed_share_of_prefill"] = out[arm]["exposed_transfer"] / max(out[arm]["prefill"], 1e-9)
    return out


def acceptance(results: dict) -> dict:
    """The issue's targets, where the configuration ran."""
    acc: dict = {}
    bf16 = results.get("llama-3.2-1b bf16", {})
    if "prompt_8192" in bf16:
        acc["ipc_8k_bf16_ratio"] = bf16["prompt_8192"]["pd_ipc"]["ttft_over_colocated"]
        acc["tcp_8k_bf16_ratio"] = bf16["prompt_8192"].get("pd_tcp", {}).get("ttft_over_colocated")
        acc["ipc_exposed_share"] = bf16["prompt_8192"]["pd_ipc"]["exposed_share_of_prefill"]
        acc["ipc_path_taken"] = bf16["prompt_8192"]["pd_ipc"]["paths"] == ["cuda_ipc"]
    if "prompt_1024" in bf16:
        acc["ipc_1k_bf16_ratio"] = bf16["prompt_1024"]["pd_ipc"]["ttft_over_colocated"]
    fp32 = [
        (name, n, arm, r[f"prompt_{n}"][arm]["tokens_equal_colocated"])
        for name, r in results.items()
        if "fp32" in name and "error" not in r
        for n in (1024, 8192)
        if f"prompt_{n}" in r
        for arm in ("pd_ipc", "pd_tcp")
        if arm in r[f"prompt_{n}"]
    ]
    acc["fp32_tokens_equal"] = {f"{name} {n} {arm}": eq for name, n, arm, eq in fp32}
    acc["fp32_gate_ok"] = bool(fp32) and all(eq.split("/")[0] == eq.split("/")[1] for *_, eq in fp32)
    acc["ok"] = (
        acc["fp32_gate_ok"]
        and all(acc.get(k) is not None and acc[k] <= v for k, v in TARGETS.items())
        and acc.get("ipc_path_taken", False)
    )
    acc["targets"] = TARGETS
    return acc


def pd(smoke: bool, seconds_left=lambda: 1e9, partial: pathlib.Path | None = None) -> dict:
    """Every configuration that fits the time left; each one's result or its error (also written
    to `partial` after each configuration)."""
    device = "cpu" if smoke else "cuda"
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        secret = pathlib.Path(tmp) / "kv-secret"
        secret.write_text("gpu-check-" + "0123456789abcdef" * 4)
        for name, model, dtype, lengths, with_tcp, kv_gib, needs_s in SMOKE if smoke else CONFIGS:
            left = seconds_left()
            if left < needs_s:
                results[name] = dict(skipped=f"{left:.0f} s left, it needs about {needs_s} s")
                continue
            log(f"-- P/D {name} ({left:.0f} s left)")
            t = time.monotonic()
            try:
                results[name] = run_config(
                    name,
                    model,
                    dtype,
                    lengths,
                    with_tcp,
                    kv_gib,
                    device,
                    str(secret),
                    ready_s=min(300.0, max(30.0, left - 20)),
                )
            except Exception as exc:  # a configuration that fails is a result too; the next one runs
                results[name] = dict(error=f"{type(exc).__name__}: {exc}"[-3000:])
            results[name]["seconds"] = round(time.monotonic() - t, 1)
            log(f"   {name}: {str(results[name])[:1500]}")
            if partial is not None:  # kept even if the process is cut before the phase ends
                partial.write_text(json.dumps(results, indent=1, default=str))
    results["acceptance"] = acceptance(results)
    return results
