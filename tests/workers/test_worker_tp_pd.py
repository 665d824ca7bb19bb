"""P/D between workers of different tensor-parallel sizes: `splitserve worker --tensor-parallel-size`
processes over real gRPC and real tcp and ucx transports.

Per transport four workers run side by side: a prefill and a decode worker at TP 1 and at TP 2
(each TP 2 worker starts its rank 1). Every pair (1 -> 1 as the baseline, 1 -> 2, 2 -> 1,
2 -> 2) answers each prompt with the tokens of a one-process engine on the same random weights,
prefilled remotely (the answer names the prefill worker), with the same bytes on the wire
whatever the TP sizes (the payload carries every KV head). Afterwards no worker holds a block:
every pool's free count is back to its total and its invariants hold. A KV pull between TP
sizes (a TP 2 holder to a TP 1 puller, and back) gives the computed answer too, and a TP 2
holder copies every head of a block whether it is in its cache or its KV tier.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_kv_pull import generate as pull
from test_worker_disaggregation import generate, prompt, run
from workerproc import WorkerProc

from splitserve.platform.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTierConfig,
    ParallelConfig,
    SchedulerConfig,
)
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.kv.cache import bytes_per_block
from splitserve.platform.sampling.params import SamplingParams
from splitserve.workers.kv_pull import _copy_blocks

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
def tiny():
    """(greedy tokens of a one-process engine on the workers' weights, the KV bytes of one block
    with every layer and every KV head of the model: what a transfer moves per block)."""
    engine = LLMEngine(
        EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=256), device=DeviceConfig(quantization="none"))
    )

    def ref(token_ids):
        [out] = engine.generate([token_ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        return out.output_token_ids

    return ref, bytes_per_block(engine.model_config, engine.config.cache.block_size, engine.kv_dtype)


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


def test_pd_across_tp_sizes_gives_the_colocated_tokens_and_leaks_no_block(workers, tiny):
    ref, block_bytes = tiny
    for p, d in PAIRS:
        prefill, decode = workers[p], workers[d]
        for n, token_ids in zip(LENGTHS, PROMPTS[p, d], strict=True):
            before = decode.metric(IN_BYTES)
            tokens, last = run(generate(decode.address, token_ids, [prefill.address]))
            assert last.prefill_worker == prefill.address, f"{p} -> {d}: prefilled locally"
            assert tokens == ref(token_ids), f"{p} -> {d}, a {n}-token prompt"
            assert decode.metric(IN_BYTES) - before == -(-n // 16) * block_bytes, f"{p} -> {d}: not every head"
    assert_clean(workers)


@pytest.mark.parametrize("holder, puller, via", [("p2", "d1", "d2"), ("p1", "d2", "d1")], ids=["2to1", "1to2"])
def test_a_pull_between_tp_sizes_gives_the_computed_answer(workers, tiny, holder, puller, via):
    """The holder caches a prompt by prefilling it for `via`; `puller` then pulls its full blocks."""
    ref, _ = tiny
    token_ids = prompt(70, salt=len(holder + puller) * 31 + int(holder[1]))
    run(generate(workers[via].address, token_ids, [workers[holder].address]))
    num_blocks = (len(token_ids) - 1) // 16
    tokens, last = run(pull(workers[puller].address, token_ids, workers[holder].address, num_blocks))
    assert last.usage.pulled_tokens == num_blocks * 16, "the pull failed (recomputed)"
    assert tokens == ref(token_ids)
    assert_clean(workers)


def assert_clean(workers: dict) -> None:
    for name, w in workers.items():
        state = w.wait_idle()
        assert state["invariants_ok"], (name, state)
        assert state["num_free_blocks"] == state["num_blocks"], (name, state)


def test_a_tp2_holder_copies_a_pull_from_its_cache_and_its_tier():
    """The holder's side of a pull, in this process: a TP 2 engine with 8 blocks and a KV tier
    gives every head of B's blocks (still cached: gathered from the ranks) and of A's (evicted to
    the tier by C), as a TP 1 engine that computed both has them. C is one block longer than A and
    B: the pool hands out blocks without a hash first (A's and B's last ones), so C needs 5 blocks
    to reach all of A's."""
    a, b, c = (prompt(n, salt=400 + k) for k, n in enumerate((50, 50, 66)))
    single = LLMEngine(
        EngineConfig(model=MODEL, cache=CacheConfig(num_blocks=128), device=DeviceConfig(quantization="none"))
    )
    single.generate([a, b], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tp2 = LLMEngine(
        EngineConfig(
            model=MODEL,
            cache=CacheConfig(num_blocks=8),
            device=DeviceConfig(quantization="none"),
            scheduler=SchedulerConfig(max_model_len=128),
            parallel=ParallelConfig(tensor_parallel_size=2),
            kv_tier=KVTierConfig(max_bytes=2**20),
        )
    )
    try:
        for p in (a, b, c):
            tp2.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert tp2.kv_tier.stats.num_stored >= 3 and tp2.pool.lookup(tp2.hasher.hash_blocks(a)[0]) is None
        for p in (a, b):
            hashes = tp2.hasher.hash_blocks(p[:48])
            got = _copy_blocks(tp2, p[:48], 0, hashes)
            want = _copy_blocks(single, p[:48], 0, hashes)
            assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]  # every head
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-2, atol=1e-2)  # up to summation order
    finally:
        tp2.close()
