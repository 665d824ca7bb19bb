"""The engine on the real SmolLM2 weights: batching, prefix caching, preemption, bad input."""

import asyncio

import pytest
import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig
from splitserve.platform.engine.async_engine import AsyncEngine
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from splitserve.platform.kv.cache import bytes_per_block
from splitserve.platform.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "List three fruits: apple,",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z, and then the alphabet starts again with",
    "Question: Why is the sky blue? Answer in one sentence. Answer:",
]


def assert_no_leak(engine):
    engine.kv.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.kv.num_requests == 0


def test_batching_does_not_change_greedy_tokens(make_engine):
    alone_engine = make_engine(max_num_batched_tokens=512)
    alone = [alone_engine.generate([p], GREEDY)[0].output_token_ids for p in PROMPTS]
    # Small token budget: prompts are prefilled in chunks while others decode.
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=8)
    batched = engine.generate(PROMPTS, GREEDY)
    assert [o.output_token_ids for o in batched] == alone
    assert_no_leak(engine)


def test_prefix_cache_computes_only_uncached_tokens(make_engine):
    tok = make_engine().tokenizer
    prefix = tok.encode("The history of the Roman Empire " * 40)[:200]
    a = prefix + tok.encode(" In summary, the empire")
    b = prefix + tok.encode(" The most famous emperor was")
    engine = make_engine()
    engine.generate([a], GREEDY)
    before = engine.scheduler.stats.num_computed_tokens
    [out] = engine.generate([b], GREEDY)
    computed = engine.scheduler.stats.num_computed_tokens - before
    cached = (200 // 16) * 16
    assert out.num_cached_tokens == cached
    # Only the uncached prompt tokens plus one per generated token (the last is never fed back).
    assert computed == len(b) - cached + GREEDY.max_tokens - 1
    no_cache = make_engine(enable_prefix_caching=False)
    no_cache.generate([a], GREEDY)
    [ref] = no_cache.generate([b], GREEDY)
    assert ref.num_cached_tokens == 0
    assert out.output_token_ids == ref.output_token_ids
    assert_no_leak(engine)


def test_preemption_keeps_outputs_identical(make_engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = make_engine().generate(PROMPTS, params)
    # 12 blocks of 16 tokens: not enough for 8 sequences of up to ~60 tokens at once.
    small = make_engine(num_blocks=12, max_model_len=192, max_num_batched_tokens=64)
    outs = small.generate(PROMPTS, params)
    assert small.scheduler.stats.num_preemptions > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in big]
    assert all(o.finish_reason == "length" for o in outs)
    assert_no_leak(small)


def test_seeded_sampling_is_reproducible_in_any_batch(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    [solo] = engine.generate(["Tell me a story about a dragon."], params)
    mixed = engine.generate(
        ["Hello there", "Tell me a story about a dragon.", "Count: 1, 2,"],
        [SamplingParams(temperature=0.7, max_tokens=20), params, SamplingParams(temperature=0, max_tokens=5)],
    )
    assert mixed[1].text == solo.text
    [other] = engine.generate(
        ["Tell me a story about a dragon."],
        SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True),
    )
    assert other.output_token_ids != solo.output_token_ids


def test_stop_strings_eos_and_text_streaming(make_engine):
    engine = make_engine()
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    [full] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=64))
    assert full.finish_reason == "stop" and full.stop_reason in engine.eos_token_ids
    assert full.text == engine.tokenizer.decode(full.output_token_ids)
    word = full.text.split()[2]
    [cut] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=64, stop=[word]))
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == full.text[: full.text.index(word)]
    assert_no_leak(engine)


def test_logprobs_are_reported(make_engine):
    engine = make_engine()
    engine.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=3, logprobs=3))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    for out in outs:
        (lp,) = out.new_logprobs
        assert len(lp.top) == 3
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert [x[1] for x in lp.top] == sorted((x[1] for x in lp.top), reverse=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=""), "the prompt is empty"),
        (dict(prompt_token_ids=[]), "the prompt is empty"),
        (dict(prompt_token_ids=[1, 99999999]), "allowed: integers in [0, 49152)"),
        (dict(prompt_token_ids=[5] * 2048), "the prompt has 2048 tokens but max_model_len is 2048"),
        (dict(prompt="hi", prompt_token_ids=[1]), "exactly one of prompt"),
    ],
)
def test_bad_requests_are_rejected_and_engine_keeps_serving(make_engine, kwargs, message):
    engine = make_engine()
    engine.add_request("Good morning", SamplingParams(temperature=0, max_tokens=4), req_id="ok")
    engine.step()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(params=SamplingParams(max_tokens=4), **kwargs)
    assert message in str(err.value)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].req_id == "ok" and outs[-1].finished
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens=0 is invalid; allowed: an integer >= 1"),
        (dict(max_tokens=-3), "max_tokens=-3 is invalid"),
        (dict(temperature=-0.5), "temperature=-0.5 is invalid; allowed: a finite number >= 0"),
        (dict(top_p=0.0), "top_p=0.0 is invalid; allowed: a number in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5 is invalid; allowed: a number in (0, 1]"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_duplicate_request_id(make_engine):
    engine = make_engine()
    engine.add_request("a", req_id="x")
    with pytest.raises(InvalidRequestError, match="'x' is already in use"):
        engine.add_request("b", req_id="x")
    engine.abort("x")
    assert engine.step()[0].finish_reason == "abort"
    assert_no_leak(engine)


def test_unknown_model_and_oversized_kv_budget():
    with pytest.raises(ConfigError, match="unknown model 'gpt-17'; allowed: an alias \\(gemma3-270m, smollm2-135m\\)"):
        LLMEngine(EngineConfig(model="gpt-17"))
    with pytest.raises(ConfigError, match="lower --kv-cache-memory to at most"):
        LLMEngine(EngineConfig(model="random:tiny", cache=CacheConfig(kv_cache_memory_bytes=10 * 1024**5)))
    with pytest.raises(UnsupportedModelError):
        raise UnsupportedModelError("subclass of ConfigError")  # the hierarchy callers rely on


def test_kv_cache_dtype_float16_holds_twice_the_blocks_and_bad_values_say_what_is_allowed():
    """--kv-cache-dtype: auto is float16 under a fast CPU quantization (the same budget holds twice
    the blocks) and the model dtype under `none`; a bad value, or a cache dtype other than the model's
    on CUDA, is a ConfigError naming what is allowed."""
    budget = CacheConfig(kv_cache_memory_bytes=64 * 1024**2)
    fast, wide, reference = (
        LLMEngine(
            EngineConfig(model="random:tiny", cache=budget, device=DeviceConfig(quantization=quant, kv_cache_dtype=kv))
        )
        for kv, quant in (("auto", "int8"), ("float32", "int8"), ("auto", "none"))
    )
    assert (fast.kv_cache_dtype, wide.kv_cache_dtype, reference.kv_cache_dtype) == ("float16", "float32", "float32")
    assert fast.runner.kv_caches[0][0].dtype == torch.float16
    assert fast.pool.num_blocks == 2 * wide.pool.num_blocks
    assert wide.pool.num_blocks == 64 * 1024**2 // bytes_per_block(wide.model_config, 16, torch.float32)
    with pytest.raises(
        ConfigError, match="kv_cache_dtype 'fp8' is not supported; allowed: auto, float32, bfloat16, float16"
    ):
        DeviceConfig(kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match="allowed there: auto, float32"):
        DeviceConfig(device="cuda", kv_cache_dtype="float16")


def test_kv_budget_too_small_for_one_sequence():
    with pytest.raises(ConfigError) as err:
        LLMEngine(EngineConfig(model="random:tiny", cache=CacheConfig(num_blocks=4)))
    assert "fewer than one sequence of max_model_len=2048" in str(err.value)
    assert "or lower --max-model-len to 64" in str(err.value)


def test_abort_mid_generation_frees_blocks(make_engine):
    engine = make_engine()
    engine.add_request("Tell me everything about", SamplingParams(max_tokens=100, ignore_eos=True), req_id="a")
    engine.add_request("Count to ten:", SamplingParams(temperature=0, max_tokens=5), req_id="b")
    for _ in range(3):
        engine.step()
    assert engine.abort("a")
    assert not engine.abort("a")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {(o.req_id, o.finish_reason) for o in outs if o.finished} == {("a", "abort"), ("b", "length")}
    assert_no_leak(engine)


def test_async_engine_streams_and_cancellation_aborts(make_engine):
    engine = make_engine()
    aeng = AsyncEngine(engine)

    async def main():
        chunks = [
            o
            async for o in aeng.generate(
                "The capital of France is", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            )
        ]
        assert len(chunks) == 6 and chunks[-1].finished
        with pytest.raises(InvalidRequestError):
            async for _ in aeng.generate("", SamplingParams()):
                pass
        agen = aeng.generate("Once upon a time", SamplingParams(max_tokens=500, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()  # the client went away
        for _ in range(100):
            await asyncio.sleep(0.05)
            if engine.scheduler.num_unfinished == 0:
                break
        return "".join(c.new_text for c in chunks)

    try:
        text = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert text.startswith(" Paris")
    assert_no_leak(engine)


def test_resumed_request_continues_exactly_as_if_undisturbed(make_engine):
    """Resume (a router's failover mid-stream): a second engine given the prompt and the first
    k generated tokens continues with the undisturbed run's tokens — seeded sampling with
    penalties and min_tokens included — and reports only what it generated itself."""
    params = SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=11,
        max_tokens=24,
        min_tokens=16,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
    )
    prompt = [(i * 7919) % 40000 + 100 for i in range(37)]
    first, second = make_engine(), make_engine()
    [whole] = first.generate([prompt], params)
    assert len(whole.output_token_ids) == 24
    k = 9
    rid = second.add_request(params=params, prompt_token_ids=prompt, resume_output_token_ids=whole.output_token_ids[:k])
    outs = []
    while second.has_unfinished_requests():
        outs += [o for o in second.step() if o.req_id == rid]
    assert [t for o in outs for t in o.new_token_ids] == whole.output_token_ids[k:]
    assert outs[-1].output_token_ids == whole.output_token_ids and outs[-1].num_output_tokens == 24
    assert outs[-1].finish_reason == "length"
    assert (
        "".join(o.new_text for o in outs)
        == second.tokenizer.decode(whole.output_token_ids)[len(second.tokenizer.decode(whole.output_token_ids[:k])) :]
    )
    second.kv.check_invariants()
    assert second.pool.num_free_blocks == second.pool.num_blocks


@pytest.mark.parametrize(
    "resume, message",
    [
        ([5] * 8, "8 resumed tokens leave nothing to generate under max_tokens=8; allowed: fewer than max_tokens"),
        ([-1, 3], r"resume_output_token_ids has invalid ids \[-1\]; allowed: integers in \[0, 49152\)"),
    ],
)
def test_bad_resume_is_rejected(make_engine, resume, message):
    with pytest.raises(InvalidRequestError, match=message):
        make_engine().add_request(
            params=SamplingParams(max_tokens=8), prompt_token_ids=[1, 2, 3], resume_output_token_ids=resume
        )
