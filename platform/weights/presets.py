"""Model shapes for `random:<preset>`: real architectures without their weights.

The shapes copy the published config.json of each model, so a random model costs the same
memory and compute as the real one (performance work where no weights can be downloaded).
`tiny` and `tiny-qwen2` keep SmolLM2's vocabulary size so its tokenizer can drive them.
"""

from __future__ import annotations

from typing import Any

from splitserve.platform.config import ModelConfig, RopeScaling
from splitserve.platform.errors import ConfigError

_LLAMA3_EOS = (128001, 128008, 128009)  # <|end_of_text|>, <|eom_id|>, <|eot_id|>

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
}


def preset_config(preset: str | None, model_id: str) -> ModelConfig:
    """The ModelConfig of `random:<preset>`; ConfigError listing the presets if unknown."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown random preset {preset!r}; allowed: {', '.join(PRESETS)}")
    return ModelConfig(model_id=model_id, **PRESETS[preset])
