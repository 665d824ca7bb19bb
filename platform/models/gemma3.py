"""Gemma 3 (text): the shared attention and linears in a different block.

What differs from Llama, each as the reference computes it:
- the token embedding is multiplied by sqrt(hidden_size) (in the model dtype);
- every RMSNorm scales by (1 + weight) (layers.OffsetRMSNorm), including q_norm and k_norm,
  which normalise each head of q and k before rotary;
- four norms per block: input -> attention -> post-attention norm -> residual add, then
  pre-feedforward norm -> GeGLU MLP (tanh GELU) -> post-feedforward norm -> residual add;
- attention is scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers (ModelConfig.layer_types; five of every six in Gemma 3) use a rope base
  of rope_local_theta (10 000), the global layers rope_theta (1 000 000), so the model keeps
  one rotary table per layer type and gives each layer its own.
The head is tied to the embedding (unscaled). No logit soft-capping (Gemma 3 has none).

`--quantization auto` builds every linear in the kernel that keeps its stored codes
(quant/kernels.exact_kernel: Q4_K -> w4a16, Q5_0/Q8_0 -> w8a16, Q6_K -> fp16) and the tied
head as a w4a8 pass re-scored exactly at the top, rather than auto's per-type choice, whose
re-quantized weights (and int8 with bfloat16 activations) left transformers' greedy answers on
6 of 8 prompts (docs/models.md has the agreement table).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.attention import AttentionMetadata
from splitserve.platform.models.layers import OffsetRMSNorm, RotaryEmbedding
from splitserve.platform.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from splitserve.platform.quant.kernels import AUTO_EXACT

AUTO_MODE = AUTO_EXACT  # what `--quantization auto` builds for this family (module docstring)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str = "none", layer: int = 0):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_window(layer) is not None
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, quantization, layer, norm_class=OffsetRMSNorm)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config, quantization)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps)

    def forward(self, x, cos, sin, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    DECODER_LAYER = Gemma3DecoderLayer
    NORM = OffsetRMSNorm

    def __init__(self, config: ModelConfig, quantization: str = "none"):
        super().__init__(config, AUTO_MODE if quantization == "auto" else quantization)
        self.local_rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_local_theta or config.rope_theta, None
        )
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5), persistent=False)

    def use_fused_ops(self, ops) -> None:
        """Gemma's block is not the fused graph's (is_plain_llama_graph), but its norms take the
        C kernel (layers.OffsetRMSNorm.use_ops)."""
        super().use_fused_ops(ops)
        for module in self.modules():
            if isinstance(module, OffsetRMSNorm):
                module.use_ops(ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_hook=None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * self.embed_scale.to(x.dtype)
        rotary = {False: self.rotary.cos_sin(positions, x.dtype), True: self.local_rotary.cos_sin(positions, x.dtype)}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, *rotary[layer.is_sliding], kv_cache, meta.for_layer(i))
            if layer_hook is not None:
                layer_hook(i)
        return self.norm(x)
