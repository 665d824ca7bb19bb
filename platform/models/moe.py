"""A sparse mixture-of-experts MLP (Qwen3-MoE): top-k routing, experts run per group of tokens.

Routing, as the reference computes it: router logits = x @ gate^T; probabilities = softmax
over all experts in float32; each token keeps its `num_experts_per_tok` most probable experts;
with `norm_topk_prob` their probabilities are divided by their sum (so they add up to 1),
otherwise they stay as the softmax gave them. The output is the weighted sum of those experts'
SwiGLU MLPs.

Execution: the T x k (token, expert) pairs are sorted by expert (stable, so a token's pairs
keep their order), so each expert owns one run of rows; the experts' matmuls run over those runs,
the rows are scaled by their routing weight and summed back per token with one index_add. Three
ways to run the matmuls, all over the same sorted rows and none looping over tokens:
- CPU: torch's grouped matmul (F.grouped_mm, one call per projection over all experts' runs,
  its CPU kernel one BLAS matmul per non-empty group), then silu(gate) * up once over all rows.
  It gives the per-expert loop's bits (the same matmul per run; tested) with five ops per layer
  instead of about six per active expert.
- CUDA with triton installed: two grouped-GEMM Triton launches, no host sync
  (kernels/triton_moe.py).
- Elsewhere (`use_grouped_mm` off, or CUDA without triton, where torch's grouped matmul wants
  bf16 on recent GPUs): a Python loop over the experts that received rows, one matmul pair each.
Under tensor parallelism each rank holds every expert's slice of the intermediate rows (gate
and up rows, down columns) and the block's output is all-reduced (docs/engine.md says why not
whole experts per rank). Expert weights are stacked per layer ([E, 2 * I, hidden] gate|up and [E, hidden, I] down) and
kept in the model dtype under every quantization mode: the fast modes' packed kernels serve
the dense linears only (docs/models.md).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.kernels.dispatch import triton_available
from splitserve.platform.parallel.group import current as current_group


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tp = current_group()  # each expert's intermediate rows split over the ranks (docs/engine.md)
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size // self.tp.size
        self.num_experts, self.top_k, self.intermediate_size = experts, config.num_experts_per_tok, inter
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))
        self.use_grouped_mm = True  # on a CPU; False: the per-expert loop (bench/moe_step.py compares)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank routes the same (replicated router), runs its slice of each chosen expert,
        and the partial sums are all-reduced, as after a row-parallel down projection."""
        weights, experts = self.route(x)
        if triton_available(x.device):
            from splitserve.platform.kernels.triton_moe import moe_experts

            out = moe_experts(x, weights, experts, self.gate_up, self.down)
        else:
            out = self.experts_torch(x, weights, experts, grouped=self.use_grouped_mm and x.device.type == "cpu")
        return self.tp.all_reduce(out)

    def experts_torch(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, grouped: bool
    ) -> torch.Tensor:
        """sum_j weights[t, j] * MLP_{experts[t, j]}(x[t]) in torch: one grouped matmul per projection
        (`grouped`) or one matmul pair per expert with rows (the loop)."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k  # the token of each sorted pair
        counts = torch.bincount(flat, minlength=self.num_experts)
        rows = x.index_select(0, token_of)
        out = self._grouped_mlp(rows, counts) if grouped else self._looped_mlp(rows, counts.tolist())
        out *= weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def _grouped_mlp(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # group e: rows ends[e-1] .. ends[e]
        gate_up = nn.functional.grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return nn.functional.grouped_mm(nn.functional.silu(gate) * up, self.down.transpose(1, 2), offs=ends)

    def _looped_mlp(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                out[start : start + n] = self.expert_mlp(expert, rows[start : start + n])
                start += n
        return out

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(rows, self.gate_up[expert]).split(self.intermediate_size, dim=-1)
        return nn.functional.linear(nn.functional.silu(gate) * up, self.down[expert])

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint's `mlp.experts.<expert>.<proj>.weight` into the stacked weights."""
        inter = self.intermediate_size
        if proj == "gate_proj":
            self.gate_up.data[expert, :inter].copy_(tensor)
        elif proj == "up_proj":
            self.gate_up.data[expert, inter:].copy_(tensor)
        else:
            self.down.data[expert].copy_(tensor)

    def checkpoint_keys(self, prefix: str) -> set[str]:
        """The keys LlamaForCausalLM.load_weights expects for this block's stacked weights."""
        return {
            f"{prefix}.experts.{e}.{proj}"
            for e in range(self.num_experts)
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
