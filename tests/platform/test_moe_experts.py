"""The CPU path of the experts (models/moe.py): torch's grouped matmul over the expert-sorted rows
must give the per-expert loop's exact bits, whatever the routing leaves empty.

Cases: several expert counts, top-k 1 and 2, experts without rows (first, middle, last), one
token, no token, a token count that puts many rows on one expert, fp32 and bf16, and the block's
forward (which takes the grouped path on a CPU by default).
"""

import pytest
import torch

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.moe import SparseMoeBlock

HIDDEN, INTER = 96, 56


def _block(num_experts: int, top_k: int, dtype, seed: int) -> SparseMoeBlock:
    config = ModelConfig(
        model_id="t",
        architecture="qwen3_moe",
        vocab_size=16,
        hidden_size=HIDDEN,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=48,
        intermediate_size=64,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=INTER,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
    )
    block = SparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.data = (0.2 * torch.randn(p.shape, generator=gen)).to(dtype)
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "num_experts,top_k,num_tokens,empty",
    [(4, 1, 1, (0, 1, 3)), (4, 1, 9, (3,)), (8, 2, 13, (0, 4, 7)), (16, 2, 40, (5, 6)), (8, 2, 0, ())],
)
def test_grouped_matmul_gives_the_loops_bits(dtype, num_experts, top_k, num_tokens, empty):
    block = _block(num_experts, top_k, dtype, seed=num_experts * 100 + num_tokens)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    allowed = torch.tensor([e for e in range(num_experts) if e not in empty])
    experts = (
        torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(num_tokens)])
        if num_tokens
        else torch.zeros(0, top_k, dtype=torch.long)
    )
    weights = torch.rand(num_tokens, top_k, generator=gen).to(dtype)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    assert all(counts[e] == 0 for e in empty)

    loop = block.experts_torch(x, weights, experts, grouped=False)
    grouped = block.experts_torch(x, weights, experts, grouped=True)
    assert grouped.dtype == dtype and grouped.shape == (num_tokens, HIDDEN)
    assert torch.equal(grouped, loop)
    if num_tokens:
        assert loop.abs().max() > 0.1, "the experts contribute"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_on_cpu_runs_grouped_and_equals_the_loop(monkeypatch, dtype):
    block = _block(8, 2, dtype, seed=1)
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, experts = block.route(x)
    expected = block.experts_torch(x, weights, experts, grouped=False)
    looped = []
    monkeypatch.setattr(block, "_looped_mlp", lambda *a: looped.append(1) or SparseMoeBlock._looped_mlp(block, *a))
    with torch.inference_mode():
        out = block(x)
    assert block.use_grouped_mm and not looped, "a CPU forward takes torch's grouped matmul"
    assert torch.equal(out, expected)
    block.use_grouped_mm = False
    with torch.inference_mode():
        assert torch.equal(block(x), expected) and looped
