"""Sigmoid-routed experts with shared experts (GLM-4.5, DeepSeek-V3, Kimi K2).

Routing, as the reference computes it, in float32 (the router's weight is kept in float32
whatever the model dtype): scores = sigmoid(x @ gate^T); the choice adds the learned
`e_score_correction_bias` to the scores; experts are split into n_group groups, each group
rated by the sum of its two best corrected scores, and only the topk_group best groups stay
eligible; each token then takes its k best corrected scores among them. Its weights are the
uncorrected scores of those experts, divided by their sum when norm_topk_prob, times
routed_scaling_factor. The output is the weighted sum of the chosen experts' SwiGLU MLPs
(models/moe.py runs them) plus the shared experts' MLP, which every token runs (one SwiGLU
of moe_intermediate_size * n_shared_experts).

Checkpoints name the router `mlp.gate.weight` and `mlp.gate.e_score_correction_bias`, the
shared experts `mlp.shared_experts.{gate,up,down}_proj.weight` (`load_shared` takes those).
SigmoidMoeForCausalLM is what both families' models share: the block with these experts from
layer first_k_dense_replace on, the shared experts' loading, a rotary table of the family's width.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.block import FamilyDecoderLayer
from splitserve.platform.models.llama import LlamaForCausalLM, LlamaMLP
from splitserve.platform.models.moe import SparseMoeBlock
from splitserve.platform.models.yarn import rotary_for

SHARED_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")


class GroupedTopkRouter(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf"))
        experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class SigmoidMoeBlock(SparseMoeBlock):
    """SparseMoeBlock with the grouped sigmoid router and shared experts (module docstring)."""

    def __init__(self, config: ModelConfig, quantization: str = "none"):
        super().__init__(config)
        self.gate = GroupedTopkRouter(config)
        shared = config.replace(intermediate_size=config.moe_intermediate_size * config.n_shared_experts)
        self.shared_experts = LlamaMLP(shared, quantization) if config.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = self.gate(x)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)

    def load_shared(self, proj: str, tensor: torch.Tensor) -> str:
        """Copy `mlp.shared_experts.<proj>.weight` in; returns the loaded key (below the block)."""
        if proj == "down_proj":
            self.shared_experts.down_proj.load_weight("down", "weight", tensor)
            return "shared_experts.down_proj.weight#down"
        shard = proj.removesuffix("_proj")
        self.shared_experts.gate_up_proj.load_weight(shard, "weight", tensor)
        return f"shared_experts.gate_up_proj.weight#{shard}"


class SigmoidMoeDecoderLayer(FamilyDecoderLayer):
    """The shared block with a SigmoidMoeBlock on the sparse layers, a dense MLP before them."""

    def mlp_for(self, config: ModelConfig, quantization: str, layer: int) -> nn.Module:
        if config.is_moe_layer(layer):
            return SigmoidMoeBlock(config, quantization)
        return super().mlp_for(config, quantization, layer)


class SigmoidMoeForCausalLM(LlamaForCausalLM):
    """The loading both sigmoid-routed families share: shared-expert tensors, rotary table."""

    DECODER_LAYER = SigmoidMoeDecoderLayer

    def __init__(self, config: ModelConfig, quantization: str = "none"):
        super().__init__(config, quantization)
        self.rotary = rotary_for(config, self.rotary_width(config))

    @staticmethod
    def rotary_width(config: ModelConfig) -> int:
        return config.rotary_dim

    def _load_one(self, name, tensor, params):
        m = SHARED_NAME.match(name)
        if m is None:
            return super()._load_one(name, tensor, params)
        layer, proj = m.groups()
        return [f"layers.{layer}.mlp." + self.layers[int(layer)].mlp.load_shared(proj, tensor)]
