"""P/D between workers of different tensor-parallel sizes: `splitserve worker --tensor-parallel-size`
processes over real gRPC and real tcp and ucx transports.

Per transport four workers run side by side: a prefill and a decode worker at TP 1 and at TP 2
(each TP 2 worker starts its rank 1). Every pair (1 -> 1 as the baseline, 1 -> 2, 2 -> 1,
2 -> 2) answers each prompt with the tokens of a one-process engine on the same random weights,
prefilled remotely (the answer names the prefill worker), with the same bytes on the wire
whatever the TP sizes (the payload carries every KV head). Afterwards no worker holds a block:
every pool's free count is back to its total and its invariants hold.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_worker_disaggregation import generate, prompt, run
from workerproc import WorkerProc

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.kv.cache import bytes_per_block
from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "random:tiny"
IN_BYTES = 'splitserve_kv_transfer_bytes_sum{direction="in"}'
PAIRS = [("p1", "d1"), ("p1", "d2"), ("p2", "d1"), ("p2", "d2")]
LENGTHS = (5, 17, 40)
# other prompts per pair: a decode worker's prefix cache would keep a repeated prompt's blocks home
PROMPTS = {pair: [prompt(n, salt=10 * k + n) for n in LENGTHS] for k, pair in enumerate(PAIRS)}


def worker_args(tp: int) -> tuple[str, ...]:
    return ("--model", MODEL, "--quantization", "none", "--tensor-parallel-size", str(tp), "--threads", "1")


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(
        EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=256), device=DeviceConfig(quantization="none"))
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {pair: [out.output_token_ids for out in engine.generate(PROMPTS[pair], params)] for pair in PAIRS}
    # K and V of one block, every layer and every KV head of the model: what a transfer moves per block
    return tokens, bytes_per_block(engine.model_config, engine.config.cache.block_size, engine.kv_dtype)


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def workers(request):
    """{"p1", "p2", "d1", "d2"}: prefill and decode workers at TP 1 and 2, started together."""
    made = {
        f"{role[0]}{tp}": WorkerProc(role, request.param, *worker_args(tp), kv_cache_gib=0.05)
        for role in ("prefill", "decode")
        for tp in (1, 2)
    }
    try:
        with ThreadPoolExecutor(len(made)) as pool:
            list(pool.map(lambda w: w.start(), made.values()))
        yield made
    finally:
        for w in made.values():
            w.terminate()


def test_pd_across_tp_sizes_gives_the_colocated_tokens_and_leaks_no_block(workers, reference):
    tokens_of, block_bytes = reference
    for p, d in PAIRS:
        prefill, decode = workers[p], workers[d]
        for n, token_ids, expected in zip(LENGTHS, PROMPTS[p, d], tokens_of[p, d], strict=True):
            before = decode.metric(IN_BYTES)
            tokens, last = run(generate(decode.address, token_ids, [prefill.address]))
            assert last.prefill_worker == prefill.address, f"{p} -> {d}: prefilled locally"
            assert tokens == expected, f"{p} -> {d}, a {n}-token prompt"
            assert decode.metric(IN_BYTES) - before == -(-n // 16) * block_bytes, f"{p} -> {d}: not every head"
    for name, w in workers.items():
        state = w.wait_idle()
        assert state["invariants_ok"], (name, state)
        assert state["num_free_blocks"] == state["num_blocks"], (name, state)
