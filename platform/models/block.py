"""The pre-norm residual block the 2026 families share: Llama's
x + attention(norm(x)), then x + mlp(norm(x)), with the attention and the MLP chosen by the
family (`ATTENTION`, `mlp_for`), so a family file names only what differs."""

from __future__ import annotations

from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.layers import RMSNorm
from splitserve.platform.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP


class FamilyDecoderLayer(LlamaDecoderLayer):
    ATTENTION: type[nn.Module] = LlamaAttention

    def __init__(self, config: ModelConfig, quantization: str = "none", layer: int = 0):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.ATTENTION(config, quantization, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.mlp_for(config, quantization, layer)

    def mlp_for(self, config: ModelConfig, quantization: str, layer: int) -> nn.Module:
        """Layer `layer`'s MLP (Llama's dense SwiGLU unless the family says otherwise)."""
        return LlamaMLP(config, quantization)
