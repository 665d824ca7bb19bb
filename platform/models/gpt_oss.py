"""gpt-oss (`GptOssForCausalLM`): Llama's block with these changes, each as the reference
computes it:
- attention with sinks (models/sink_attention.py), biases on q, k, v and o, layers alternating
  between a sliding window (`layer_types`, 128 tokens in the releases) and full attention;
- YaRN rope (models/yarn.py);
- every MLP is a mixture of experts: router logits = x @ W^T + b; each token keeps its k
  largest logits and softmaxes those k alone; each expert is
  down(act(x @ gate_up + b_gu)) + b_down with gate and up interleaved in gate_up's columns
  (gate = even columns, up = odd) and the clamped SwiGLU
  act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit).
Expert weights are stored stacked as [experts, in, out] (`mlp.experts.gate_up_proj`, ...);
MXFP4 releases are dequantized to that on load (weights/mxfp4.py). The (token, expert) pairs
are sorted by expert so each expert runs one matmul pair over its rows, and the weighted rows
are summed back per token with one index_add, in expert order as the reference sums them.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.block import FamilyDecoderLayer
from splitserve.platform.models.layers import MergedLinear
from splitserve.platform.models.llama import LlamaAttention, LlamaForCausalLM
from splitserve.platform.models.yarn import rotary_for


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, quantization: str = "none", layer: int = 0):
        super().__init__(config, quantization, layer)
        q_size = config.num_heads * config.head_dim
        self.o_proj = MergedLinear(q_size, {"o": config.hidden_size}, bias=True, quantization=quantization)
        self.sinks = nn.Parameter(torch.empty(config.num_heads))


class GptOssExperts(nn.Module):
    """The stacked experts; parameter names are the checkpoint's (`mlp.experts.*`)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def run(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(rows @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert])
        return hidden @ self.down_proj[expert] + self.down_proj_bias[expert]


class GptOssMoe(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        rows = x.index_select(0, token_of)
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(torch.bincount(flat, minlength=self.router.out_features).tolist()):
            if n:
                out[start : start + n] = self.experts.run(expert, rows[start : start + n])
                start += n
        out *= weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, out)


class GptOssDecoderLayer(FamilyDecoderLayer):
    ATTENTION = GptOssAttention

    def mlp_for(self, config: ModelConfig, quantization: str, layer: int) -> nn.Module:
        return GptOssMoe(config)


class GptOssForCausalLM(LlamaForCausalLM):
    DECODER_LAYER = GptOssDecoderLayer

    def __init__(self, config: ModelConfig, quantization: str = "none"):
        super().__init__(config, quantization)
        self.rotary = rotary_for(config, config.head_dim)
