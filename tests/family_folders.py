"""Tiny random checkpoints of the 2026 families (GLM-4.5, gpt-oss, DeepSeek-V3, a Kimi-K2-shaped
DeepSeek-V3), written by transformers' `save_pretrained` next to SmolLM2's tokenizer.json, for
the engine tests (tests/platform/test_families_2026.py) and the worker tests over TCP
(tests/workers/test_families_2026_pd.py).

Every weight but the norms is drawn at std 0.15 (biases, sinks and the routers' correction
biases included), so greedy references do not sit on near-ties and every term is exercised.
"""

import torch

MAX_TOKENS = 24  # tokens generated per prompt
WINDOW = 16  # gpt-oss's sliding layers: most prompts and all generations run past it
PROMPTS = [[(7 * i + 3 * j) % 49000 + 100 for j in range(5 + 12 * i)] for i in range(6)]
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SIGMOID_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True)
FAMILIES = {
    # name: (config class, model class, options)
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            SIGMOID_MOE,
            head_dim=16,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=1.5,  # low enough that the clamps bite at std 0.15
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            SIGMOID_MOE,
            num_key_value_heads=4,  # the reference expands K/V to every head, as the releases say
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                mscale=1.0,
                mscale_all_dim=0.8,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
        ),
    ),
    # Kimi K2's shape: more experts in one group; and no q_lora_rank (DeepSeek-V2-Lite's q_proj)
    "kimi_k2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            SIGMOID_MOE,
            num_key_value_heads=4,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            kv_lora_rank=24,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_interleave=False,
        ),
    ),
}


def save_family(folder, name: str, gguf_path: str, families: dict = FAMILIES):
    """A random transformers model of family `name` (a key of `families`) saved in `folder` with
    SmolLM2's tokenizer."""
    import transformers

    from splitserve.platform.tokenizer import Tokenizer

    config_name, model_name, options = families[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**COMMON, **options})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" not in key and tensor.is_floating_point() and "inv_freq" not in key:
                tensor.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    Tokenizer.from_gguf(gguf_path).save_tokenizer_json(str(folder / "tokenizer.json"))
    return model
