"""Attention with sinks (gpt-oss): a learned logit per query head joins the softmax's
denominator and nothing else, so a head can attend to "nothing" when no key fits.

For head h with sink s_h and scores z_j = scale * q . k_j over the visible keys j:
    p_j = exp(z_j) / (exp(s_h) + sum_i exp(z_i)),    out = sum_j p_j v_j,
computed as the reference does: the sink appended as one more column of the scores, a softmax
over the row in float32, the sink's column dropped. Explicit scores (no fused SDPA kernel, which
has no sink term), so a prefill chunk costs Lq x Lk floats per head: the torch reference path,
for CPU and any device. Queries are grouped per KV head, GQA without repeating K/V.
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [B, Lq, H, D], k/v [B, Lk, Hkv, D], mask [B, Lq, Lk] bool (True = attend), sinks [H]
    -> [B, Lq, H, D] in q's dtype."""
    b, lq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, lq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4).float()  # [B, Hkv, G, Lq, D]
    keys = k.permute(0, 2, 3, 1).float()[:, :, None]  # [B, Hkv, 1, D, Lk]
    scores = torch.matmul(qg, keys) * scale  # [B, Hkv, G, Lq, Lk]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    sink = sinks.float().view(1, hkv, h // hkv, 1, 1).expand(b, -1, -1, lq, 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float()[:, :, None])  # [B, Hkv, G, Lq, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, lq, h, d).to(q.dtype)


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] bool: the last q_len of k_len positions, each seeing itself and before."""
    pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    return torch.arange(k_len, device=device)[None, :] <= pos
