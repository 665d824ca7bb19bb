"""The weights a model of a given ModelConfig has: Hugging Face names and [out, in] shapes.

This is the contract between the loaders (GGUF, HF folder, random) and the model classes:
every loader yields exactly `expected_weight_shapes(config)`, each name once, and
`check_weights` enforces it while streaming, so a model never sees a missing, extra or
misshapen tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from splitserve.platform.config import ModelConfig
from splitserve.platform.errors import ConfigError, UnsupportedModelError
from splitserve.platform.parallel.layout import Slices, sliced_shape


def layer_weight_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of decoder layer `layer`, as the family's checkpoints name them."""
    prefix = f"model.layers.{layer}."
    if config.architecture in _FAMILY_LAYER_SHAPES:
        shapes = _FAMILY_LAYER_SHAPES[config.architecture](config, layer)
        return {prefix + name: shape for name, shape in shapes.items()}
    shapes = {
        "input_layernorm.weight": (config.hidden_size,),
        **_attention_shapes(config),
        "post_attention_layernorm.weight": (config.hidden_size,),
        **_mlp_shapes(config, layer),
    }
    if config.architecture == "gemma3":  # norms before and after the MLP too
        shapes["pre_feedforward_layernorm.weight"] = (config.hidden_size,)
        shapes["post_feedforward_layernorm.weight"] = (config.hidden_size,)
    return {prefix + name: shape for name, shape in shapes.items()}


def _attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    if config.architecture == "phi3":  # Phi-3 stores q|k|v as one matrix
        shapes = {"self_attn.qkv_proj.weight": (q_size + 2 * kv_size, config.hidden_size)}
    else:
        shapes = {
            "self_attn.q_proj.weight": (q_size, config.hidden_size),
            "self_attn.k_proj.weight": (kv_size, config.hidden_size),
            "self_attn.v_proj.weight": (kv_size, config.hidden_size),
        }
    shapes["self_attn.o_proj.weight"] = (config.hidden_size, q_size)
    if config.attention_bias:
        shapes["self_attn.q_proj.bias"] = (q_size,)
        shapes["self_attn.k_proj.bias"] = (kv_size,)
        shapes["self_attn.v_proj.bias"] = (kv_size,)
    if config.qk_norm:
        shapes["self_attn.q_norm.weight"] = (config.head_dim,)
        shapes["self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    hidden = config.hidden_size
    if config.is_moe_layer(layer):
        inter = config.moe_intermediate_size
        if config.architecture == "mixtral":  # Mixtral's names: w1 gate, w3 up, w2 down
            shapes = {"block_sparse_moe.gate.weight": (config.num_experts, hidden)}
            for e in range(config.num_experts):
                shapes[f"block_sparse_moe.experts.{e}.w1.weight"] = (inter, hidden)
                shapes[f"block_sparse_moe.experts.{e}.w3.weight"] = (inter, hidden)
                shapes[f"block_sparse_moe.experts.{e}.w2.weight"] = (hidden, inter)
            return shapes
        shapes = {"mlp.gate.weight": (config.num_experts, hidden)}
        for e in range(config.num_experts):
            shapes[f"mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
            shapes[f"mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
            shapes[f"mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
        return shapes
    inter = config.intermediate_size
    if config.architecture == "phi3":  # Phi-3 stores gate|up as one matrix
        return {"mlp.gate_up_proj.weight": (2 * inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
    return {
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def _norms(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"input_layernorm.weight": (config.hidden_size,), "post_attention_layernorm.weight": (config.hidden_size,)}


def _sigmoid_moe_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """GLM-4.5's and DeepSeek-V3's MLP: dense below first_k_dense_replace, else routed experts
    (with the router's e_score_correction_bias) plus the shared experts."""
    shapes = _mlp_shapes(config, layer)
    if config.is_moe_layer(layer):
        shared, hidden = config.moe_intermediate_size * config.n_shared_experts, config.hidden_size
        shapes["mlp.gate.e_score_correction_bias"] = (config.num_experts,)
        shapes["mlp.shared_experts.gate_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_experts.up_proj.weight"] = (shared, hidden)
        shapes["mlp.shared_experts.down_proj.weight"] = (hidden, shared)
    return shapes


def _glm4_moe_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    return {**_norms(config), **_attention_shapes(config), **_sigmoid_moe_shapes(config, layer)}


def _gpt_oss_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss: q/k/v/o with biases, a sink logit per head, experts stored stacked as [E, in, out]
    (gate and up interleaved) with biases; MXFP4 checkpoints arrive here dequantized."""
    hidden, experts, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
    return {
        **_norms(config),
        **_attention_shapes(config),
        "self_attn.o_proj.bias": (hidden,),
        "self_attn.sinks": (config.num_heads,),
        "mlp.router.weight": (experts, hidden),
        "mlp.router.bias": (experts,),
        "mlp.experts.gate_up_proj": (experts, hidden, 2 * inter),
        "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
        "mlp.experts.down_proj": (experts, inter, hidden),
        "mlp.experts.down_proj_bias": (experts, hidden),
    }


def _deepseek_v3_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's latent attention (q through a low-rank q_a/q_b pair when q_lora_rank is set)."""
    hidden, heads = config.hidden_size, config.num_heads
    qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.q_lora_rank:
        q = {
            "self_attn.q_a_proj.weight": (config.q_lora_rank, hidden),
            "self_attn.q_a_layernorm.weight": (config.q_lora_rank,),
            "self_attn.q_b_proj.weight": (heads * qk_head, config.q_lora_rank),
        }
    else:
        q = {"self_attn.q_proj.weight": (heads * qk_head, hidden)}
    return {
        **_norms(config),
        **q,
        "self_attn.kv_a_proj_with_mqa.weight": (config.kv_lora_rank + config.qk_rope_head_dim, hidden),
        "self_attn.kv_a_layernorm.weight": (config.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
        "self_attn.o_proj.weight": (hidden, heads * config.v_head_dim),
        **_sigmoid_moe_shapes(config, layer),
    }


_FAMILY_LAYER_SHAPES = {
    "glm4_moe": _glm4_moe_shapes,
    "gpt_oss": _gpt_oss_shapes,
    "deepseek_v3": _deepseek_v3_shapes,
}


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor `iter_weights` yields for `config`; nothing is allocated.

    `lm_head.weight` is absent when `config.tie_word_embeddings` (the model reuses
    `model.embed_tokens.weight`).
    """
    shapes = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for layer in range(config.num_layers):
        shapes.update(layer_weight_shapes(config, layer))
    shapes["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def check_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    source: str,
    shard: Callable[[str], Slices | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the tensors through, raising as soon as one is unexpected, misshapen or repeated,
    and at the end if any expected one never came. `source` names the file for the message;
    `shard`: the tensors are a rank's slices (parallel/layout.py), checked against those shapes."""
    expected = expected_weight_shapes(config)
    if shard is not None:
        expected = {name: sliced_shape(shape, shard(name)) for name, shape in expected.items()}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name not in expected:
            raise UnsupportedModelError(f"{source}: unexpected tensor {name!r} for a {config.architecture} model")
        if name in seen:
            raise ConfigError(f"{source}: tensor {name!r} appears twice")
        if tuple(tensor.shape) != expected[name]:
            raise ConfigError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {expected[name]}"
            )
        seen.add(name)
        yield name, tensor
    missing = [name for name in expected if name not in seen]
    if missing:
        raise ConfigError(f"{source}: {len(missing)} weight(s) missing, first: {', '.join(missing[:5])}")
