"""TTFT of a disaggregated request, broken down, with and without per-layer KV streaming.

Issue 3, acceptance 7 (second part). One decode worker and two prefill workers (one streams
each layer's KV as soon as it is computed, one sends after the whole prompt), UCX over TCP on
loopback, SmolLM2-135M fp32, one torch thread each. The workers are started as the tests start
them (tests/workerproc.py): mutual TLS on gRPC and an authenticated KV channel, so the client
here speaks mTLS with the same throwaway credentials. For a 1,500-token prompt (fresh each time,
so nothing is cached) it records, per arm, interleaved: TTFT at the client, queue time on the
decode worker, prefill compute on the prefill worker, the exposed transfer time (waiting on
KV after compute finished), and the first decode step (time from the first to the second
token). A colocated arm (the decode worker prefilling locally) is the reference.

    python bench/disagg_ttft.py [--rounds 5] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from workerproc import WorkerProc, worker_channel  # noqa: E402

from splitserve.platform.wire import worker_pb2 as pb  # noqa: E402
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc  # noqa: E402

PROMPT_LEN = 1500
BEGIN, END = "<!-- disagg-ttft:begin -->", "<!-- disagg-ttft:end -->"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_section  # noqa: E402


def prompt(salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(PROMPT_LEN)]


async def one(address: str, salt: int, prefill: list[str], mode) -> dict:
    t0 = time.perf_counter()
    times, first = [], None
    async with worker_channel(address) as ch:
        async for msg in pb_grpc.WorkerStub(ch).Generate(
            pb.GenerateRequest(
                request_id=f"bench-{salt}",
                prompt_token_ids=prompt(salt),
                prefill_workers=prefill,
                disaggregation=mode,
                params=pb.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            )
        ):
            if msg.token_ids:
                times.append(time.perf_counter() - t0)
            if first is None:
                first = msg
    assert (first.prefill_worker != "") == bool(prefill), "the arm did not run as intended"
    return dict(
        ttft=times[0],
        queue=first.timings.queue_s,
        prefill=first.timings.prefill_s,
        exposed_transfer=first.timings.transfer_wait_s,
        first_decode_step=times[1] - times[0],
    )


def summarize(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def render(result: dict, rounds: int) -> str:
    lines = [
        BEGIN,
        "",
        "Disaggregated TTFT for a 1,500-token prompt (medians of "
        f"{rounds} rounds, arms interleaved; seconds). Command: `python bench/disagg_ttft.py --rounds {rounds} "
        "--write docs/benchmarks.md`.",
        "",
        "| arm | TTFT | queue | prefill compute | exposed transfer | first decode step |",
        "|---|---|---|---|---|---|",
    ]
    for arm, r in result.items():
        lines.append(
            f"| {arm} | {r['ttft']:.3f} | {r['queue']:.3f} | {r['prefill']:.3f} | "
            f"{r['exposed_transfer']:.4f} | {r['first_decode_step']:.3f} |"
        )
    lines += ["", END]
    return "\n".join(lines)


def write(path: str, section: str) -> None:
    write_section(path, "disagg-ttft", section)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write")
    args = ap.parse_args()
    d = WorkerProc("decode", "ucx").start()
    streaming = WorkerProc("prefill", "ucx").start()
    batch = WorkerProc("prefill", "ucx", "--no-kv-layer-streaming").start()
    arms = {
        "P/D, per-layer streaming": ([streaming.address], pb.DISAGGREGATION_MODE_ALWAYS),
        "P/D, send after prefill": ([batch.address], pb.DISAGGREGATION_MODE_ALWAYS),
        "colocated (decode worker prefills)": ([], pb.DISAGGREGATION_MODE_NEVER),
    }
    rows = {arm: [] for arm in arms}
    try:
        asyncio.run(one(d.address, 0, [streaming.address], pb.DISAGGREGATION_MODE_ALWAYS))  # warm-up
        for r in range(args.rounds):
            for i, (arm, (prefill, mode)) in enumerate(arms.items()):
                rows[arm].append(asyncio.run(one(d.address, 1 + r * 10 + i, prefill, mode)))
    finally:
        for w in (d, streaming, batch):
            w.terminate()
    result = {arm: summarize(v) for arm, v in rows.items()}
    print(json.dumps(result, indent=1))
    section = render(result, args.rounds)
    print(section)
    if args.write:
        write(args.write, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
