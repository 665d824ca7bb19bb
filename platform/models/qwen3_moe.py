"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse mixture-of-experts MLP (models/moe.py)
on the layers ModelConfig.is_moe_layer names; the others keep the dense SwiGLU MLP."""

from splitserve.platform.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Same graph as Qwen3; the config's experts give the sparse layers their SparseMoeBlock."""
