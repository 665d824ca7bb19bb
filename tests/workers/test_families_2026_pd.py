"""The 2026 families through prefill/decode disaggregation over TCP: a prefill and a decode
`splitserve worker` process per family (real gRPC, the TCP KV transport), each loading the same
tiny random checkpoint transformers wrote (tests/family_folders.py).

What a user sees: greedy tokens equal to transformers' own greedy decoding, the prompt's KV
moved from P to D in the family's cache layout (for DeepSeek-V3 one latent entry per token,
kv_lora_rank + qk_rope_head_dim values per layer), and seeded sampling through P/D equal to the
engine's colocated run of the same request.
"""

import asyncio

import pytest
from family_folders import MAX_TOKENS, PROMPTS, save_family
from gguf_reference import hf_greedy
from workerproc import WorkerProc, worker_channel

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

ENGINE_ARGS = ("--quantization", "none", "--dtype", "float32", "--max-model-len", "512")
SEED = dict(temperature=0.9, top_p=0.95, seed=77)


async def generate(d: WorkerProc, p: WorkerProc, token_ids, req_id: str, **params):
    async with worker_channel(d.address) as channel:
        request = pb.GenerateRequest(
            request_id=req_id,
            prompt_token_ids=token_ids,
            params=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params),
            prefill_workers=[p.address],
            disaggregation=pb.DISAGGREGATION_MODE_ALWAYS,
        )
        msgs = [m async for m in pb_grpc.WorkerStub(channel).Generate(request)]
    return [t for m in msgs for t in m.token_ids], msgs[-1]


@pytest.fixture(scope="module", params=["glm4_moe", "gpt_oss", "deepseek_v3"])
def family_pair(request, tmp_path_factory, smollm2_gguf_path):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_family(folder, request.param, smollm2_gguf_path)
    workers = [WorkerProc(role, "tcp", "--model", str(folder), *ENGINE_ARGS) for role in ("decode", "prefill")]
    for w in workers:
        w.start()
    yield folder, model, *workers
    for w in workers:
        w.terminate()


def test_greedy_over_tcp_equals_transformers_and_moves_the_family_layout(family_pair):
    folder, model, d, p = family_pair
    engine = LLMEngine(
        EngineConfig(model=str(folder), cache=CacheConfig(num_blocks=64), device=DeviceConfig(quantization="none"))
    )
    m = engine.model_config
    bytes_per_block_layer = 2 * 16 * m.num_kv_heads * m.head_dim * 4  # K and V planes, float32
    for i in (2, 5):
        before = d.metric('splitserve_kv_transfer_bytes_sum{direction="in"}')
        tokens, last = asyncio.run(generate(d, p, PROMPTS[i], f"g{i}", temperature=0))
        assert tokens == hf_greedy(model, PROMPTS[i], MAX_TOKENS)
        assert last.prefill_worker == p.address
        moved = d.metric('splitserve_kv_transfer_bytes_sum{direction="in"}') - before
        # every block of every layer, but a sliding-window layer (gpt-oss, KV groups) only its window
        num_blocks = -(-len(PROMPTS[i]) // 16)
        skip = engine.kv_connector.layer_skip(len(PROMPTS[i]), 0) or (0,) * m.num_layers
        assert moved == sum(num_blocks - k for k in skip) * bytes_per_block_layer
        if m.sliding_window and len(PROMPTS[i]) > m.sliding_window + 16:
            assert moved < num_blocks * m.num_layers * bytes_per_block_layer
    if m.kv_lora_rank:  # the latent entry, not per-head K and V
        assert 2 * m.num_kv_heads * m.head_dim == m.kv_lora_rank + m.qk_rope_head_dim
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SEED)
    [colocated] = engine.generate([PROMPTS[4]], params)
    tokens, _ = asyncio.run(generate(d, p, PROMPTS[4], "s4", **SEED))
    assert tokens == colocated.output_token_ids
    for w in (d, p):
        state = w.wait_idle()
        assert state["invariants_ok"] and state["num_free_blocks"] == state["num_blocks"], state
