"""Model shapes for `random:<preset>`: real architectures without their weights.

The shapes copy the published config.json of each model, so a random model costs the same
memory and compute as the real one (performance work where no weights can be downloaded).
The `tiny*` presets keep SmolLM2's vocabulary size so its tokenizer can drive them.
"""

from __future__ import annotations

from typing import Any

from splitserve.platform.config import ModelConfig, RopeScaling
from splitserve.platform.errors import ConfigError

_LLAMA3_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
_QWEN3_EOS = (151645, 151643)           # <|im_end|>, <|endoftext|>
_TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
             tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    # Untied, unlike `tiny`, so the random presets cover both lm_head paths.
    "tiny-qwen2": dict(
        architecture="qwen2", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=True,
        bos_token_id=1, eos_token_ids=(2,)),
    "smollm2-135m": dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-1b": dict(
        architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "llama-3-8b": dict(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=_LLAMA3_EOS),
    "qwen2-0.5b": dict(
        architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_ids=(151645, 151643)),  # <|im_end|>, <|endoftext|>
    "tiny-qwen3": dict(_TINY, architecture="qwen3", qk_norm=True),
    "tiny-mistral": dict(_TINY, architecture="mistral", sliding_window=32,
                         layer_types=("sliding_attention",) * 2),
    "tiny-phi3": dict(_TINY, architecture="phi3", sliding_window=32, layer_types=("sliding_attention",) * 2),
    "tiny-qwen3-moe": dict(_TINY, architecture="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, norm_topk_prob=True),
    "tiny-gemma3": dict(_TINY, architecture="gemma3", tie_word_embeddings=True, qk_norm=True, hidden_act="gelu_tanh",
                        sliding_window=32, layer_types=("sliding_attention", "full_attention"),
                        query_pre_attn_scalar=16.0, rope_local_theta=10000.0),
    "gemma3-270m": dict(  # google/gemma-3-270m: 5 local layers (window 512) per global one
        architecture="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048, num_layers=18,
        num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True, qk_norm=True, hidden_act="gelu_tanh",
        sliding_window=512, layer_types=tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                              for i in range(18)),
        query_pre_attn_scalar=256.0, rope_local_theta=10000.0, bos_token_id=2, eos_token_ids=(1,)),
    "tiny-mixtral": dict(_TINY, architecture="mixtral", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=128, norm_topk_prob=True),
    "mixtral-8x7b": dict(  # Mixtral-8x7B-v0.1: 8 experts, 2 per token, full attention
        architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True, bos_token_id=1, eos_token_ids=(2,)),
    "qwen3-0.6b": dict(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=151643, eos_token_ids=_QWEN3_EOS),
    "mistral-7b": dict(  # Mistral-7B-v0.1: a 4096-token window on every layer, 32k context
        architecture="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, sliding_window=4096,
        layer_types=("sliding_attention",) * 32, bos_token_id=1, eos_token_ids=(2,)),
    "phi-3-mini": dict(  # Phi-3-mini-4k-instruct
        architecture="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=96, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False, sliding_window=2047,
        layer_types=("sliding_attention",) * 32, bos_token_id=1, eos_token_ids=(32000,)),
    "qwen3-30b-a3b": dict(  # 128 experts, 8 per token
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        bos_token_id=151643, eos_token_ids=_QWEN3_EOS),
}


def preset_config(preset: str | None, model_id: str) -> ModelConfig:
    """The ModelConfig of `random:<preset>`; ConfigError listing the presets if unknown."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown random preset {preset!r}; allowed: {', '.join(PRESETS)}")
    return ModelConfig(model_id=model_id, **PRESETS[preset])
