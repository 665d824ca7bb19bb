"""Phase 3 of bench/gpu_check.py: P/D between two worker processes on the one GPU.

A prefill and a decode worker (`python bench/gpu_check.py worker ...`, KV over the tcp transport)
serve greedy requests for 1k and 8k prompts, each length first as a warm-up round (every shape
compiles its kernels before it is timed), then two timed rounds per arm: disaggregated (the
decode worker asks the prefill worker) and colocated (the decode worker prefills). Tokens must be
equal; the TTFT breakdown comes from the first message's timings.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

CHECK = pathlib.Path(__file__).resolve().parent / "gpu_check.py"


def log(msg: str) -> None:
    print(msg, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`python bench/gpu_check.py worker ...` as a process; wait_ready() waits for its READY line."""

    def __init__(self, role: str, engine_args: list[str], extra: list[str]):
        self.role, self.port = role, free_port()
        self.args = [sys.executable, str(CHECK), "worker", "--role", role,
                     "--grpc-port", str(self.port), "--metrics-port", str(free_port()), "--kv-port", str(free_port()),
                     "--kv-transport", "tcp", *engine_args, *extra]
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Worker":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout):
            raise RuntimeError(f"{self.role} worker not ready in {timeout:.0f} s:\n" + "".join(self.lines[-40:]))

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("READY"):
                self._ready.set()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def generate(address: str, req_id: str, prompt: list[int], prefill: list[str], mode, max_tokens: int) -> dict:
    import grpc

    from splitserve.platform.wire import worker_pb2 as pb
    from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

    t0 = time.perf_counter()
    times, tokens, first = [], [], None
    async with grpc.aio.insecure_channel(address) as channel:
        async for msg in pb_grpc.WorkerStub(channel).Generate(pb.GenerateRequest(
                request_id=req_id, prompt_token_ids=prompt, prefill_workers=prefill, disaggregation=mode,
                params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))):
            if msg.token_ids:
                times.append(time.perf_counter() - t0)
                tokens += list(msg.token_ids)
            if first is None:
                first = msg
    assert (first.prefill_worker != "") == bool(prefill), "the arm did not run as intended"
    return dict(tokens=tokens, ttft=times[0], queue=first.timings.queue_s, prefill=first.timings.prefill_s,
                exposed_transfer=first.timings.transfer_wait_s, first_decode_step=times[1] - times[0])


def pd(smoke: bool) -> dict:
    from splitserve.platform.wire import worker_pb2 as pb

    model, device, dtype, lengths, max_len = (("random:tiny", "cpu", "float32", (256, 1024), 1100) if smoke else
                                              ("random:llama-3.2-1b", "cuda", "bfloat16", (1024, 8192), 8448))
    engine_args = ["--model", model, "--device", device, "--dtype", dtype, "--quantization", "none",
                   "--kv-cache-memory", "0.05" if smoke else "2", "--max-model-len", str(max_len),
                   "--max-num-batched-tokens", str(max_len), "--max-num-seqs", "4", "--threads", "1" if smoke else "4"]
    prefill = Worker("prefill", engine_args, ["--enforce-eager"]).start()
    decode = Worker("decode", engine_args, ["--disaggregation", "always"]).start()
    try:
        prefill.wait_ready(300)
        decode.wait_ready(300)
        vocab = 49152 if smoke else 128256
        rng = random.Random(7)
        arms = {"pd": ([prefill.address], pb.DISAGGREGATION_MODE_ALWAYS),
                "colocated": ([], pb.DISAGGREGATION_MODE_NEVER)}
        result: dict = dict(model=model, dtype=dtype, transport="tcp")
        for n in lengths:
            rows = {arm: [] for arm in arms}
            for round_ in range(3):                       # round 0 warms up every shape of this length
                prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
                for arm, (workers, mode) in arms.items():
                    r = asyncio.run(generate(decode.address, f"{arm}-{n}-{round_}", prompt, workers, mode, 16))
                    if round_:
                        rows[arm].append(r)
            equal = [a["tokens"] == b["tokens"] for a, b in zip(rows["pd"], rows["colocated"])]
            result[f"prompt_{n}"] = dict(
                pd_equals_colocated=f"{sum(equal)}/{len(equal)}",
                **{arm: {k: statistics.median(r[k] for r in rs) for k in
                         ("ttft", "queue", "prefill", "exposed_transfer", "first_decode_step")}
                   for arm, rs in rows.items()})
        result["ok"] = all(result[f"prompt_{n}"]["pd_equals_colocated"].split("/")[0] ==
                           result[f"prompt_{n}"]["pd_equals_colocated"].split("/")[1] for n in lengths)
        return result
    finally:
        prefill.stop()
        decode.stop()
        result_logs = {w.role: "".join(w.lines[-15:]) for w in (prefill, decode)}
        log(json.dumps(result_logs)[:3000])
