"""Tensor parallelism on the CPU (gloo): every family at TP 2 gives TP 1's greedy tokens, TP 4
does on Llama, the features that sample on rank 0 (seeded, structured output, n-gram
speculation, prefix-cache hits) give TP 1's tokens, a rank killed or stopped under load takes
the group down with a clean error and no process left, and bad sizes are refused at start.

The models are the tiny random transformers checkpoints of test_model_families (4 heads, 2 KV
heads, weights at std 0.15 so greedy tokens do not sit on near-ties), fp32. Each TP engine
starts real rank processes; TP 1 runs in this process. Summation order differs between TP 1 and
TP 2 (each all-reduce adds two partial sums), so logits differ in the last bits: what must be
equal is the tokens.
"""

import json
import os
import signal
import time

import psutil
import pytest
import torch
from test_model_families import FAMILIES, save_family
from workerproc import rank_processes

from splitserve.platform.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
)
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError, TensorParallelError
from splitserve.platform.parallel.layout import ShardLayout, check_tensor_parallel
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.structured import StructuredSpec

TP_FAMILIES = {
    **FAMILIES,
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}
PROMPTS = [[(7 * i + 3 * j) % 49000 + 100 for j in range(5 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model: str, tp: int, num_blocks: int = 96, **options) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            cache=CacheConfig(num_blocks=num_blocks),
            device=DeviceConfig(dtype="float32", quantization="none"),
            parallel=ParallelConfig(tensor_parallel_size=tp),
            **options,
        )
    )


def tokens(eng: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [out.output_token_ids for out in eng.generate(prompts, params)]


def children() -> list[psutil.Process]:
    """Rank processes of this test process (multiprocessing's resource tracker, which the shared
    memory segment starts once per process, is not one)."""
    return rank_processes(psutil.Process())


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_gguf_path):
    made = {}

    def get(model_type: str) -> str:
        if model_type not in made:
            folder = tmp_path_factory.mktemp(f"tp-{model_type}")
            save_family(folder, model_type, smollm2_gguf_path, TP_FAMILIES)
            made[model_type] = str(folder)
        return made[model_type]

    return get


def run_tp(model: str, tp: int, prompts=PROMPTS, params=GREEDY, **options) -> list[list[int]]:
    eng = engine(model, tp, **options)
    try:
        assert eng.executor is not None and len(eng.executor.pids) == tp - 1
        return tokens(eng, prompts, params)
    finally:
        eng.close()
        assert not children(), "a rank outlived close()"


@pytest.mark.parametrize("model_type", sorted(TP_FAMILIES))
def test_tp2_greedy_equals_tp1_on_every_family(folders, model_type):
    model = folders(model_type)
    reference = tokens(engine(model, 1), PROMPTS)
    assert run_tp(model, 2) == reference


def test_tp4_greedy_equals_tp1_with_replicated_kv_heads(folders):
    model = folders("llama")
    single = engine(model, 1)
    reference = tokens(single, PROMPTS[:3])
    assert ShardLayout(single.model_config, 3, 4).kv_head_start == 1  # 2 KV heads over 4 ranks
    assert run_tp(model, 4, PROMPTS[:3]) == reference


def prompt_logprobs(eng: LLMEngine, prompt: list[int]) -> list:
    """The prompt logprobs (top 2) of `prompt`, from the request's first output."""
    req_id = eng.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=2, prompt_logprobs=2))
    found = None
    while eng.has_unfinished_requests():
        found = next((o.prompt_logprobs for o in eng.step() if o.req_id == req_id and o.prompt_logprobs), found)
    assert found is not None and len(found) == len(prompt)
    return found


def test_seeded_structured_ngram_and_prefix_hits_under_tp2_equal_tp1(folders):
    """One TP 2 and one TP 1 engine with n-gram speculation: greedy with proposals, seeded
    sampling, a regex-constrained request, prompt logprobs, then a prompt again from the
    prefix cache."""
    model = folders("llama")
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    repetitive = [[100 + j % 7 for j in range(40)], PROMPTS[0]]  # their greedy outputs repeat tokens
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=8, ignore_eos=True) for s in (1, 2)]
    structured = SamplingParams(
        temperature=0, max_tokens=12, structured=StructuredSpec("regex", r"[a-z]{2,6}-[0-9]{2}")
    )
    prompts = repetitive + PROMPTS[:2] + [PROMPTS[3]]
    longer = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    params = [longer, longer, *seeded, structured]
    runs = {}
    for tp in (1, 2):
        eng = engine(model, tp, speculative=spec)
        try:
            outs = eng.generate(prompts, params)
            hits = eng.scheduler.stats.num_prefix_hit_tokens
            again = eng.generate([PROMPTS[4], PROMPTS[4]], GREEDY)
            scored = prompt_logprobs(eng, PROMPTS[5])  # each scored piece gathers logits too
            runs[tp] = (
                [o.output_token_ids for o in outs] + [[t.top[0][0] for t in scored[1:]]],
                outs[-1].text,
                [o.output_token_ids for o in again],
                eng.scheduler.stats.num_prefix_hit_tokens - hits,
                eng.speculator.stats.num_draft_tokens,
            )
        finally:
            eng.close()
    assert runs[2][:3] == runs[1][:3]
    assert runs[2][3] >= 32, "the second copy of the prompt hit the prefix cache"
    assert runs[2][4] > 0, "n-gram proposals were verified under TP 2"
    assert len(runs[2][1]) > 0 and runs[2][1].split("-")[0].isalpha()


def write_adapter(folder, seed: int) -> str:
    """A PEFT adapter on all seven projections of the tiny Llama (hidden 64, 4 heads and 2 KV
    heads of 16, MLP 128, 3 layers), drawn wide enough to change greedy tokens."""
    from safetensors.torch import save_file

    folder.mkdir()
    out = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 128, "up_proj": 128, "down_proj": 64}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(3):
        for proj, rows in out.items():
            base = f"base_model.model.model.layers.{layer}.{'mlp' if 'p_proj' in proj or 'wn' in proj else 'self_attn'}"
            tensors[f"{base}.{proj}.lora_A.weight"] = (
                torch.randn(4, 128 if proj == "down_proj" else 64, generator=gen) * 0.3
            )
            tensors[f"{base}.{proj}.lora_B.weight"] = torch.randn(rows, 4, generator=gen) * 0.3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": list(out)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def test_lora_adapters_sharded_like_their_base_layers_give_tp1_tokens(folders, tmp_path):
    """Two adapters and the base model mixed in one batch; A and B cut per rank (lora/adapter.py)."""
    model = folders("llama")
    adapters = (("a", write_adapter(tmp_path / "a", 1)), ("b", write_adapter(tmp_path / "b", 2)))
    names = ["a", "b", None, "a"]
    runs = {}
    for tp in (1, 2):
        eng = engine(model, tp, lora=LoraConfig(modules=adapters))
        try:
            ids = [eng.add_request(prompt_token_ids=p, params=GREEDY, lora_name=n) for p, n in zip(PROMPTS, names)]
            final = {}
            while eng.has_unfinished_requests():
                final |= {o.req_id: o.output_token_ids for o in eng.step() if o.finished}
            runs[tp] = [final[i] for i in ids]
            base = tokens(eng, PROMPTS[:1])
        finally:
            eng.close()
    assert runs[2] == runs[1]
    assert runs[1][0] != base[0], "the adapter changes the tokens"


def rank_gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_rank_killed_under_load_ends_every_request_with_an_error(folders):
    """SIGKILL of rank 1 mid-generation: the step in flight raises TensorParallelError, every
    request ends (abort), the engine refuses new ones, no rank process is left."""
    eng = engine(folders("llama"), 2)
    ids = [eng.add_request(params=SamplingParams(max_tokens=400, ignore_eos=True), prompt_token_ids=p) for p in PROMPTS]
    for _ in range(3):
        eng.step()
    [rank1] = eng.executor.pids
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="tensor-parallel group is down"):
        while eng.has_unfinished_requests() and time.monotonic() - t0 < 60:
            eng.step()
    assert time.monotonic() - t0 < 30 and rank_gone(rank1)
    finals = eng.abort_all()
    assert sorted(o.req_id for o in finals) == sorted(ids)
    assert all(o.finished and o.finish_reason == "abort" for o in finals)
    with pytest.raises(TensorParallelError):
        eng.add_request(prompt_token_ids=PROMPTS[0], params=GREEDY)
    eng.close()
    assert not children()


def test_a_rank_stopped_under_load_fails_every_stream_and_calls_on_fatal(folders):
    """SIGSTOP of rank 1 (a hung rank) under the AsyncEngine a worker runs: the watchdog ends
    the group within seconds, every stream ends with finish reason abort (none hangs), on_fatal
    fires once, and the stopped rank is killed, not left behind."""
    import asyncio

    from splitserve.platform.engine.async_engine import AsyncEngine

    async_engine = AsyncEngine(engine(folders("llama"), 2))
    fatal = []
    async_engine.on_fatal = fatal.append
    [rank1] = async_engine._engine.executor.pids
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def stream(prompt):
        outs = [o async for o in async_engine.generate(params=params, prompt_token_ids=prompt)]
        return outs[-1]

    async def run():
        tasks = [asyncio.create_task(stream(p)) for p in PROMPTS]
        await asyncio.sleep(3)
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        finals = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        return finals, time.monotonic() - t0

    try:
        finals, elapsed = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert elapsed < 30
    assert all(o.finished and o.finish_reason == "abort" for o in finals)
    assert len(fatal) == 1 and isinstance(fatal[0], TensorParallelError) and "stopped" in str(fatal[0])
    assert rank_gone(rank1) and not children()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(tp=3), "does not divide the 4 attention heads.*allowed: \\[1, 2, 4\\]"),
        (dict(tp=2, quantization="w4a16"), "--quantization w4a16 .*use --quantization none"),
    ],
)
def test_bad_sizes_and_combinations_fail_at_start_within_10s(folders, options, message):
    model = folders("llama")
    tp = options.pop("tp")
    parallel = ParallelConfig(tensor_parallel_size=tp, nnodes=options.pop("nnodes", 1), master_port=29999)
    device = DeviceConfig(dtype="float32", quantization=options.pop("quantization", "none"))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=message):
        LLMEngine(
            EngineConfig(model=model, cache=CacheConfig(num_blocks=96), device=device, parallel=parallel, **options)
        )
    assert time.monotonic() - t0 < 10
    assert not children()


def test_head_splits_and_devices_are_checked_before_anything_starts():
    def shape(heads, kv, inter=96):
        return ModelConfig("m", "llama", 256, 96, inter, 2, heads, kv, 96 // heads)

    check_tensor_parallel(shape(8, 2), ParallelConfig(tensor_parallel_size=8), "cpu", "none")  # KV replicated
    with pytest.raises(ConfigError, match="the 3 KV heads .* do not split.*allowed: \\[1, 3, 6\\]"):
        check_tensor_parallel(shape(6, 3), ParallelConfig(tensor_parallel_size=2), "cpu", "none")
    with pytest.raises(ConfigError, match="the 4 KV heads .* do not split"):  # 6 ranks over 4 KV heads
        check_tensor_parallel(shape(12, 4), ParallelConfig(tensor_parallel_size=6), "cpu", "none")
    with pytest.raises(ConfigError, match="does not divide intermediate_size=90"):
        check_tensor_parallel(shape(4, 2, inter=90), ParallelConfig(tensor_parallel_size=4), "cpu", "none")
    with pytest.raises(ConfigError, match="needs 2 GPUs on this node but 0 are visible"):
        check_tensor_parallel(shape(4, 2), ParallelConfig(tensor_parallel_size=2), "cuda", "none")
    with pytest.raises(ConfigError, match="use --device cuda"):
        check_tensor_parallel(shape(4, 2), ParallelConfig(tensor_parallel_size=2), "cuda:1", "none")


def test_kv_heads_and_weight_slices_of_each_rank():
    config = ModelConfig("m", "phi3", 10, 64, 96, 2, 4, 2, 16)
    ranks = [ShardLayout(config, r, 2) for r in range(2)]
    assert [r.vocab_range for r in ranks] == [(0, 5), (5, 10)]
    assert ranks[1].slices("model.layers.0.self_attn.qkv_proj.weight") == (0, ((32, 64), (80, 96), (112, 128)))
    assert ranks[1].slices("model.layers.0.mlp.gate_up_proj.weight") == (0, ((48, 96), (144, 192)))
    assert ranks[1].slices("model.layers.0.self_attn.o_proj.weight") == (1, ((32, 64),))
    assert ranks[0].slices("model.layers.1.input_layernorm.weight") is None
    assert ranks[0].slices("model.layers.1.self_attn.q_norm.weight") is None
    odd = ShardLayout(config.replace(vocab_size=11), 1, 2)
    assert (odd.vocab_per_rank, odd.vocab_range) == (6, (6, 11))  # the last rank's table padded to 6 rows


def test_lws_environment_fills_what_the_flags_leave_unset(monkeypatch):
    """In a LeaderWorkerSet pod the worker's flags default to the controller's environment; flags win."""
    import argparse

    from splitserve.platform.settings import worker_args

    def parallel(env: dict, argv: list[str]) -> ParallelConfig:
        for name in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        parser = argparse.ArgumentParser(exit_on_error=False)
        worker_args.add_arguments(parser)
        return worker_args.WorkerArgs.from_namespace(parser.parse_args(argv)).engine_config().parallel

    env = {"LWS_LEADER_ADDRESS": "leader.svc", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    p = parallel(env, ["-tp", "8", "--master-port", "29500"])
    assert (p.tensor_parallel_size, p.nnodes, p.node_rank, p.master_addr, p.master_port) == (
        8,
        2,
        1,
        "leader.svc",
        29500,
    )
    assert p.ranks_per_node == 4
    flags_win = ["-tp", "8", "--nnodes", "1", "--node-rank", "0", "--master-port", "1"]
    assert parallel(env, flags_win).nnodes == 1
    assert parallel({}, []) == ParallelConfig()
    with pytest.raises(ConfigError, match="needs --master-port"):
        parallel(env, ["-tp", "8"])
    with pytest.raises(ConfigError, match="does not split evenly over nnodes=2"):
        parallel(env, ["-tp", "3", "--master-port", "1"])
    with pytest.raises(ConfigError, match="node_rank must be in"):
        ParallelConfig(node_rank=1)
    assert json.dumps(ParallelConfig().__dict__)  # plain values: the worker spec renders them
