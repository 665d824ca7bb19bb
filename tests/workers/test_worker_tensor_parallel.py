"""A tensor-parallel worker group as users run it: `splitserve worker --tensor-parallel-size 2`.

The worker process is rank 0 (scheduler, block table, gRPC, /ready, /metrics, KV ports: one of each
for the group) and starts rank 1 itself. Through the real gRPC API its greedy tokens equal a
one-process engine's on the same random weights; and when a rank dies (SIGKILL) or hangs (SIGSTOP)
under load, the request in flight ends in a clean error, the worker exits non-zero within 30 s
(so its supervisor restarts it) and no rank process is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import psutil
import pytest
from test_worker_disaggregation import generate, prompt, run
from workerproc import WorkerProc, rank_processes, worker_channel

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

MODEL = "random:tiny"
TP_ARGS = ("--model", MODEL, "--quantization", "none", "--tensor-parallel-size", "2", "--threads", "1")
PROMPTS = [prompt(n, salt=n) for n in (5, 17, 40)]


def ranks_of(worker: WorkerProc) -> list[psutil.Process]:
    """The live rank processes the worker started."""
    return rank_processes(psutil.Process(worker.proc.pid))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(
        EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=256), device=DeviceConfig(quantization="none"))
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [out.output_token_ids for out in engine.generate(PROMPTS, params)]


def test_a_tp2_worker_is_one_worker_whose_tokens_equal_one_process(reference):
    worker = WorkerProc("both", "tcp", *TP_ARGS).start()
    try:
        ranks = ranks_of(worker)
        assert len(ranks) == 1  # rank 1; rank 0 is the worker itself
        assert worker.get("/ready")[0] == 200
        got = [run(generate(worker.address, p))[0] for p in PROMPTS]
        assert got == reference
        assert worker.wait_idle()["num_requests_holding_blocks"] == 0
    finally:
        assert worker.terminate() == 0
    assert all(gone(r.pid) for r in ranks), "a rank outlived its worker's shutdown"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_failed_rank_takes_the_worker_down_cleanly(sig):
    worker = WorkerProc("both", "tcp", *TP_ARGS).start()
    rank1 = None
    try:
        [rank1] = ranks_of(worker)

        async def under_load():
            async with worker_channel(worker.address) as channel:
                stream = pb_grpc.WorkerStub(channel).Generate(
                    pb.GenerateRequest(
                        request_id="long",
                        prompt_token_ids=prompt(30),
                        params=pb.SamplingParams(temperature=0, max_tokens=5000, ignore_eos=True),
                    )
                )
                tokens, last = 0, None
                try:
                    async for msg in stream:
                        tokens += len(msg.token_ids)
                        last = msg
                        if tokens >= 3 and rank1.is_running():
                            os.kill(rank1.pid, sig)
                except grpc.aio.AioRpcError as exc:  # the worker went away: a clean error, not a hang
                    return tokens, exc.code()
                return tokens, last.finish_reason

        t0 = time.monotonic()
        tokens, ending = asyncio.run(asyncio.wait_for(under_load(), 60))
        assert tokens < 5000  # the request did not run on as if nothing happened
        assert ending in (pb.FINISH_REASON_ABORT, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), ending
        code = worker.proc.wait(30 - (time.monotonic() - t0))
        assert code != 0, "a worker whose group failed must exit non-zero"
        assert gone(rank1.pid), "no rank outlives its group"
    finally:
        worker.kill()
        if rank1 is not None and not gone(rank1.pid):  # only after a failed assertion above: leave nothing behind
            os.kill(rank1.pid, signal.SIGKILL)
