"""Multi-head latent attention (DeepSeek-V3, Kimi K2) over the paged cache.

Per token the reference computes q = q_b(norm(q_a(x))) (or q_proj(x) without q_lora_rank),
split per head into q_nope and q_rot; and one compressed KV: [c, k_rot] = kv_a(x), c normed
(kv_lora_rank values) and k_rot (qk_rope_head_dim values, shared by every head). q_rot and
k_rot turn by rotary (interleaved pairs where `rope_interleave`). kv_b up-projects c into each
head's k_nope and v: k_nope_h = W_k,h c, v_h = W_v,h c. Scores are q_nope . k_nope + q_rot . k_rot.

The cache holds only e = [c, k_rot] per token: one "head" of kv_lora_rank + qk_rope_head_dim
values (576 for DeepSeek-V3, against 2 x 128 heads x 192 / 128 dims expanded), the first half
of e in the layer's K plane and the second half in its V plane (ModelConfig: num_kv_heads 1,
head_dim = half of e). So everything that moves KV blocks (P/D, the KV pull, the KV tier,
the prefix cache) moves the latent unchanged, and the layout descriptor's num_kv_heads and
head_dim say it. Under tensor parallelism e is the same for every rank (replicated, nothing to
reshard between TP sizes).

Attention runs in the latent space, the up-projections absorbed (as vLLM and SGLang decode):
q_lat,h = W_k,h^T q_nope,h, so q_nope . k_nope = q_lat . c and the score is [q_lat, q_rot] . e,
multi-query attention with one key head of width |e|; the output in latent space is
o_lat,h = sum_j p_j c_j, then out_h = W_v,h o_lat,h, and o_proj. Decodes and prefill chunks
both take this form (one path; a prefill may expand instead, which costs fewer score flops on
long prompts, not done here). The softmax scale is qk_head_dim ** -0.5, times YaRN's
mscale(factor, mscale_all_dim)^2 (models/yarn.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.platform.config import ModelConfig
from splitserve.platform.models.attention import AttentionMetadata, as_cached, gather_kv, write_kv
from splitserve.platform.models.layers import MergedLinear, RMSNorm, apply_rotary
from splitserve.platform.models.yarn import attention_mscale

LATENT_NORM_EPS = 1e-6  # the reference's q_a / kv_a norms take their default eps, not the config's


class MlaAttention(nn.Module):
    def __init__(self, config: ModelConfig, quantization: str = "none", layer: int = 0):
        super().__init__()
        heads, hidden = config.num_heads, config.hidden_size
        self.num_heads, self.nope, self.rope = heads, config.qk_nope_head_dim, config.qk_rope_head_dim
        self.kv_lora_rank, self.v_head_dim = config.kv_lora_rank, config.v_head_dim
        self.interleave = config.rope_interleave
        qk_head = self.nope + self.rope
        self.scale = qk_head**-0.5 * attention_mscale(config.rope_scaling)
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk_head, bias=False)
        else:
            self.q_dense = nn.Linear(hidden, heads * qk_head, bias=False)  # the checkpoint's q_proj
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = MergedLinear(heads * self.v_head_dim, {"o": hidden}, bias=False, quantization=quantization)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_dense(x)
        q_nope, q_rot = q.view(n, self.num_heads, -1).split((self.nope, self.rope), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope), dim=-1)
        q_rot, k_rot = self._rotate(q_rot, cos, sin), self._rotate(k_rot[:, None], cos, sin)
        entries = torch.cat((self.kv_a_layernorm(latent), k_rot[:, 0]), dim=-1)  # [T, |e|]
        half = entries.shape[-1] // 2
        write_kv(kv_cache[0], kv_cache[1], entries[:, None, :half], entries[:, None, half:], meta.slot_mapping)
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_kv[:, : self.nope])
        o_lat = latent_attention(torch.cat((q_lat, q_rot), dim=-1), entries, kv_cache, meta, self.scale)
        out = torch.einsum("thc,hvc->thv", o_lat[..., : self.kv_lora_rank], w_kv[:, self.nope :])
        return self.o_proj(out.reshape(n, -1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:  # pairs (x0, x1), (x2, x3), ... -> the rotate-half layout, as the reference
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, cos, sin)


def gather_entries(kv_cache, block_table: torch.Tensor) -> torch.Tensor:
    """[..., num_blocks] block ids -> the cached latent entries [..., num_blocks * block_size, |e|]."""
    return torch.cat((gather_kv(kv_cache[0], block_table), gather_kv(kv_cache[1], block_table)), dim=-1)[..., 0, :]


def latent_attention(
    q: torch.Tensor, entries: torch.Tensor, kv_cache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [T, H, |e|] (absorbed), this step's entries [T, |e|] -> sum_j p_j e_j [T, H, |e|] (the
    latent part is what the caller keeps). Decodes read their blocks; a prefill chunk reads its
    cached prefix plus itself, or its own fresh entries rounded as the cache holds them."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        keys = gather_entries(kv_cache, meta.decode_block_table).float()  # [B, L, |e|]
        scores = torch.einsum("bhe,ble->bhl", q[:nd].float(), keys) * scale
        scores = scores.masked_fill(~meta.decode_mask[:, None], float("-inf"))
        out[:nd] = torch.einsum("bhl,ble->bhe", torch.softmax(scores, dim=-1), keys).to(q.dtype)
    for chunk in meta.prefills:
        sl = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        if chunk.block_table is None:
            keys = as_cached(entries[sl], kv_cache[0])
        else:
            keys = gather_entries(kv_cache, chunk.block_table)[: chunk.start_pos + chunk.q_len].to(q.dtype)
        out[sl] = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1)[None],
            keys[None, None],
            keys[None, None],
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
    return out
