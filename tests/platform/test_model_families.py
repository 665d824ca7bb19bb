"""Each model family against transformers, on a tiny random checkpoint that transformers writes.

Per family a randomly initialised transformers model (weights drawn at std 0.15, wider than the
default, so greedy references do not sit on near-ties) is saved with `save_pretrained` next to
SmolLM2's tokenizer.json and loaded by our engine from that folder, fp32, quantization "none".
The families cover what differs from Llama: Qwen3's q/k norm with a mix of full and
sliding-window layers, Mistral's and Phi-3's window on every layer (Phi-3 with fused qkv and
gate_up tensors), Qwen3-MoE's experts with a dense layer among the sparse ones, Gemma 3's
block (its final norm re-centred, see save_family) with a global layer between two local ones. Windows are
24 tokens, so most of the 8 prompts (5 to 68 tokens) and all of their 32 generated tokens run
past them.
"""

import pytest
import torch
from test_disaggregation_engine import disaggregated
from test_engine_vs_transformers import hf_greedy

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.model_source import resolve_model
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.weights import load_model_config

pytestmark = pytest.mark.slow

WINDOW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 49000 + 100 for j in range(5 + 9 * i)] for i in range(8)]
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    # model_type: (config class, model class, options)
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, pad_token_id=0)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, pad_token_id=0),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}
ARCHITECTURE = {"gemma3_text": "gemma3"}  # model_type -> ModelConfig.architecture where they differ


def save_family(folder, model_type: str, gguf_path: str, families: dict = FAMILIES):
    """A random transformers model of `model_type` (a key of `families`) saved in `folder` with
    SmolLM2's tokenizer."""
    import transformers

    from splitserve.platform.tokenizer import Tokenizer

    config_name, model_name, options = families[model_type]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **options})
    if model_type == "gemma3_text":
        config.tie_word_embeddings = True
    model = getattr(transformers, model_name)(config).eval()
    if model_type == "gemma3_text":
        # With a tied head and an embedding scaled by sqrt(hidden), a random Gemma's final state
        # is mostly its input token's embedding, so it echoes its input: centre the final norm's
        # scale (1 + w) on 0 instead of 1.
        with torch.no_grad():
            model.model.norm.weight.normal_(-1.0, 1.0)
    model.save_pretrained(folder)
    Tokenizer.from_gguf(gguf_path).save_tokenizer_json(str(folder / "tokenizer.json"))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, smollm2_gguf_path):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_family(folder, request.param, smollm2_gguf_path)


def engine_for(folder, **sched) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(**sched),
            device=DeviceConfig(dtype="float32", quantization="none"),
        )
    )


def test_greedy_equals_transformers_batched_chunked_and_cached(family):
    model_type, folder, hf_model = family
    engine = engine_for(folder)
    config = engine.model_config
    assert config.architecture == ARCHITECTURE.get(model_type, model_type) and config.max_position_embeddings == 512
    if model_type != "qwen3_moe":
        assert config.sliding_window == WINDOW and "sliding_attention" in config.layer_types
    assert sum(len(p) > WINDOW for p in PROMPTS) >= 5
    reference = [hf_greedy(hf_model, ids, 32) for ids in PROMPTS]

    batched = [out.output_token_ids for out in engine.generate(PROMPTS, GREEDY)]
    assert batched == reference
    alone = [engine.generate([ids], GREEDY)[0].output_token_ids for ids in PROMPTS[::3]]
    assert alone == reference[::3], "batch invariance"

    chunked = engine_for(folder, max_num_batched_tokens=16)
    assert [out.output_token_ids for out in chunked.generate(PROMPTS[4:], GREEDY)] == reference[4:]
    hits = chunked.scheduler.stats.num_prefix_hit_tokens
    again = chunked.generate([PROMPTS[7]], GREEDY)[0]  # every full block of it is cached now
    assert chunked.scheduler.stats.num_prefix_hit_tokens - hits >= 64
    assert again.output_token_ids == reference[7]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_disaggregated_equals_colocated(tmp_path, smollm2_gguf_path, model_type):
    save_family(tmp_path, model_type, smollm2_gguf_path)
    p_engine, d_engine, local = engine_for(tmp_path), engine_for(tmp_path), engine_for(tmp_path)
    prompt = PROMPTS[6]
    [ref] = local.generate([prompt], GREEDY)
    outs, received, _ = disaggregated(p_engine, d_engine, prompt, params=GREEDY)
    assert outs[-1].finished and outs[-1].output_token_ids == ref.output_token_ids
    assert sorted({layer for _, layer, _, _ in received}) == [0, 1, 2]
    for e in (p_engine, d_engine):
        e.kv.check_invariants()
        assert e.pool.num_free_blocks == e.pool.num_blocks


@pytest.mark.parametrize(
    "preset", ["tiny-qwen3", "tiny-mistral", "tiny-phi3", "tiny-qwen3-moe", "tiny-gemma3", "tiny-mixtral"]
)
def test_random_presets_of_each_family_generate(preset):
    engine = LLMEngine(
        EngineConfig(
            model=f"random:{preset}",
            cache=CacheConfig(num_blocks=160),
            device=DeviceConfig(dtype="float32", quantization="none"),
        )
    )
    [out] = engine.generate([PROMPTS[7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.output_token_ids) == 4


def test_missing_tensor_and_unknown_architecture_are_clear_errors(tmp_path, smollm2_gguf_path):
    import json

    from safetensors.torch import load_file, save_file

    save_family(tmp_path, "phi3", smollm2_gguf_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.2.mlp.gate_up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="1 weight\\(s\\) missing, first: model.layers.2.mlp.gate_up_proj.weight"):
        engine_for(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"model_type": "falcon"}))
    with pytest.raises(UnsupportedModelError, match="'falcon' is not supported; supported: llama, mistral, qwen2"):
        load_model_config(resolve_model(str(tmp_path)))
