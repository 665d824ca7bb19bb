"""Qwen3 (dense): the Llama block with RMSNorm over each head of q and k before rotary
(ModelConfig.qk_norm, checkpoint tensors `self_attn.q_norm` / `self_attn.k_norm`), no biases,
an explicit head_dim that need not be hidden / heads, and optional sliding-window layers
(`use_sliding_window`, from `max_window_layers` on)."""

from splitserve.platform.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; the config's qk_norm=True gives the attention its q/k norms."""
