"""The sampler's device path: every row's token picked on the logits' device, one copy back.

The CPU sampler (sampler.py) finds a truncated row's kept set in a short list of its largest
logits that grows until it holds the set: cheap on a CPU, but each growth test is a host
decision, so on a GPU every step would synchronise several times. Here nothing waits for the
device until the one transfer of the results:

- The per-row parameters (greedy flag, temperature, top-k, top-p, min-p) and the rows' uniform
  numbers travel in one host-to-device copy. The uniforms are drawn on the host exactly as the
  CPU sampler draws them (each seeded row from its own generator), so seeded requests get the
  same tokens on either path.
- Truncation runs on whole rows sorted once, descending (when any row truncates): the
  thresholds of top-k, top-p and min-p are gathered per row with `torch.where` selecting the rows
  whose filter is on, never a boolean index (a host sync). The definitions are sampler.py's and
  logits_ops.truncate's, on a list that is the whole row, so it is always exact.
- The draw inverts the cumulative distribution of the kept probabilities in token-id order
  (logits_ops.sample_from_probs). Dropped tokens are zeros in that order; adding zeros changes no
  partial sum, so the token drawn equals the CPU path's, which drew from its short list in
  token-id order.
- Greedy rows take the argmax; the result is one [R] tensor, and with logprobs the sampled
  logprobs and top-n lists are packed beside it, so a step copies to the host once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.platform.sampling import logits_ops


def pack_params(rows: Sequence, uniforms: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[5, R] float64 on `device`: greedy flag, temperature, top_k, top_p, min_p; plus the uniforms
    as a sixth row. One host-to-device copy (float64 holds every int top_k exactly)."""
    host = torch.tensor(
        [
            [float(r.params.is_greedy) for r in rows],
            [r.params.temperature for r in rows],
            [float(r.params.top_k) for r in rows],
            [r.params.top_p for r in rows],
            [r.params.min_p for r in rows],
        ],
        dtype=torch.float64,
    )
    return torch.cat([host, uniforms.to(torch.float64)[None]]).to(device, non_blocking=True)


def pick_tokens(logits: torch.Tensor, packed: torch.Tensor, any_truncated: bool) -> torch.Tensor:
    """One token id per row of the (penalised, constrained) float32 `logits` [R, V]; `packed` from
    pack_params. `any_truncated` (known on the host from the params) skips the sort when no row
    has top-k, top-p or min-p. Sync-free."""
    greedy, temperature, top_k, top_p, min_p, uniforms = packed
    greedy = greedy.bool()
    scaled = logits / torch.where(greedy, 1.0, temperature).to(logits.dtype)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    drawn = logits_ops.sample_from_probs(probs, uniforms)
    if any_truncated:
        vocab = logits.shape[1]
        top_k = top_k.long()
        truncated = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0) | (min_p > 0.0)
        values, ids = scaled.sort(dim=-1, descending=True)
        kept = _truncate_sorted(values, probs.gather(1, ids), top_k, top_p, min_p)
        by_id = torch.empty_like(kept).scatter_(1, ids, kept)  # back to token-id order
        drawn = torch.where(truncated, logits_ops.sample_from_probs(by_id, uniforms), drawn)
    return torch.where(greedy, logits.max(dim=-1).indices, drawn)


def _truncate_sorted(
    values: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """logits_ops.truncate on whole rows sorted descending, without host syncs: the kept
    probabilities (0 where dropped), in the sorted order."""
    vocab = values.shape[1]
    has_top_k = ((top_k > 0) & (top_k < vocab))[:, None]
    kth = values.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
    probs = torch.where(~has_top_k | (values >= kth), probs, 0.0)  # ties with the k-th stay
    mass = probs.cumsum(dim=-1)[:, -1:]
    nucleus = torch.where(has_top_k, probs / mass, probs)  # still descending
    reach = (top_p - logits_ops.TOP_P_TOLERANCE).to(probs.dtype)[:, None]
    num_before = (nucleus.cumsum(dim=-1) < reach).sum(dim=-1, keepdim=True)
    threshold = torch.where((top_p < 1.0)[:, None], nucleus.gather(1, num_before.clamp(max=vocab - 1)), 0.0)
    kept = torch.where(nucleus >= threshold, probs, 0.0)
    floor = min_p.to(probs.dtype)[:, None] * kept.amax(dim=-1, keepdim=True)
    return torch.where((min_p > 0.0)[:, None] & (kept < floor), 0.0, kept)


def to_host(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, num_top: Sequence[int | None]):
    """(token ids, sampled logprobs or None, top-n lists or None) as Python lists, in one copy."""
    if raw_logprobs is None:
        return token_ids.tolist(), None, None
    most = max((n for n in num_top if n is not None), default=0)
    sampled = raw_logprobs.gather(1, token_ids[:, None])
    top_values, top_ids = logits_ops.largest(raw_logprobs, most)
    packed = torch.cat([token_ids[:, None].double(), sampled.double(), top_values.double(), top_ids.double()], dim=1)
    rows = packed.cpu().tolist()
    ids = [int(r[0]) for r in rows]
    logprobs = [r[1] for r in rows]
    tops = [
        None if n is None else [(int(t), v) for v, t in zip(r[2 : 2 + n], r[2 + most : 2 + most + n])]
        for r, n in zip(rows, num_top)
    ]
    return ids, logprobs, tops
