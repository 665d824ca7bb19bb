"""Pure tensor operations of the sampler: penalties, truncation (top-k, top-p, min-p), drawing.

Every function takes [num_rows, width] tensors plus one parameter per row, returns new tensors
and never writes to its inputs. A row whose parameter is "off" (top_k <= 0, top_p >= 1,
min_p <= 0, penalty 1 / 0) comes back unchanged, so callers may pass a mixed batch.

Definitions (vLLM's):
- penalties: a token seen in the prompt or the output has a positive logit divided by
  repetition_penalty and a non-positive one multiplied by it; then frequency_penalty * count
  and presence_penalty * (count > 0) are subtracted, count being the token's occurrences in
  the output only. Only the seen tokens are gathered, changed and scattered back.
- top-k keeps every token whose logit is >= the k-th largest; tokens tied with the k-th are
  all kept, so a row can keep more than k (vLLM does the same).
- top-p, over the distribution left by top-k, keeps the smallest set of most probable tokens
  whose cumulative probability reaches top_p; the token that crosses the threshold is kept, and
  so is every token tied with it (the rule is a probability threshold, so ties never depend on
  token ids). A cumulative sum within `TOP_P_TOLERANCE` of top_p counts as reaching it, so
  float32 round-off does not decide exact boundaries such as 0.48 + 0.44 + 0.06 vs 0.98.
- min-p drops tokens whose probability is < min_p * (the row's largest); the ratio is the
  same before and after renormalisation, so it may follow top-p unnormalised.

Truncation without sorting the vocabulary (`sample_truncated`): each filter keeps the tokens
above a threshold, so the kept set is a prefix of the row sorted by probability. The row's K
largest logits are taken (K = 32, or top_k + 1) and the three filters run on that short list;
if the list's last token was dropped, the whole kept set is inside it and the answer is exact,
else K grows 8x for that row only, up to the whole vocabulary.

Drawing (`sample_from_probs`) inverts the cumulative distribution at one uniform number per row:
the token is the first whose cumulative probability exceeds u * total. It needs no
renormalisation, never returns a zero-probability token and consumes one random number per row.
Truncated rows are drawn from their kept tokens in token-id order, so which of several tied
tokens the list happened to hold never matters.

Batch invariance: everything here is row-wise with a per-row reduction order (softmax, cumsum,
gather, sort), never `sum` or `logsumexp`, whose CPU kernels split one long row across threads
when the batch is small and so round differently for the same row in a different batch.
"""

from __future__ import annotations

import torch

TOP_P_TOLERANCE = 1e-6
_FIRST_WIDTH = 32
_GROWTH = 8
_CHUNK = 64  # `largest` looks for the top-k among the k chunks of 64 with the largest maxima


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of `logits` [R, V].

    prompt_ids [R, Lp] and output_ids [R, Lo] are token ids padded with V (the vocab size);
    the three penalties are float tensors [R]. Lp may be 0 when no row has a repetition penalty.
    """
    vocab = logits.shape[1]
    ids = torch.cat([prompt_ids, output_ids], dim=1)
    is_real = ids != vocab
    # Padding points at token 0 and gets token 0's true penalty, so that every write to one
    # column carries the same value and the scatter below needs no mask.
    seen = is_real | (ids == 0).any(dim=1, keepdim=True)
    ids = torch.where(is_real, ids, 0)
    sorted_output = torch.where(output_ids == vocab, -1, output_ids).sort(dim=1).values
    counts = (
        torch.searchsorted(sorted_output, ids, right=True) - torch.searchsorted(sorted_output, ids, right=False)
    ).to(logits.dtype)
    values = logits.gather(1, ids)
    scale = torch.where(seen, repetition[:, None].to(logits.dtype), 1.0)
    values = torch.where(values > 0, values / scale, values * scale)
    values = values - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits.scatter(1, ids, values)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Copy of `logits` [R, W] with tokens below each row's k-th largest logit set to -inf.

    top_k is an integer tensor [R]; rows with top_k <= 0 or >= W are untouched.
    """
    width = logits.shape[1]
    active = ((top_k > 0) & (top_k < width)).nonzero().squeeze(1)
    if active.numel() == 0:
        return logits
    k = top_k[active].long()
    top_values = logits[active].topk(int(k.max()), dim=-1).values
    thresholds = torch.full((logits.shape[0], 1), -torch.inf, dtype=logits.dtype, device=logits.device)
    thresholds[active] = top_values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < thresholds, -torch.inf)


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Copy of `probs` [R, W] with the tokens outside each row's nucleus set to 0; not
    renormalised. Each row must sum to 1 (a shorter list may sum to less: a row whose list
    never reaches top_p keeps it all). top_p is a float tensor [R]; rows with top_p >= 1 are
    untouched."""
    active = (top_p < 1.0).nonzero().squeeze(1)
    if active.numel() == 0:
        return probs
    values = probs[active].sort(dim=-1, descending=True).values
    reach = (top_p[active] - TOP_P_TOLERANCE).to(probs.dtype)[:, None]
    num_before = (values.cumsum(dim=-1) < reach).sum(dim=-1, keepdim=True)
    thresholds = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    thresholds[active] = values.gather(1, num_before.clamp(max=values.shape[1] - 1))
    return probs.masked_fill(probs < thresholds, 0.0)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Copy of `probs` [R, W] with tokens below min_p times the row's largest probability set
    to 0; not renormalised. min_p is a float tensor [R]; rows with min_p <= 0 are untouched."""
    if not bool((min_p > 0).any()):
        return probs
    thresholds = min_p[:, None].to(probs.dtype) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < thresholds, 0.0)


def truncate(
    logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities [R, W] of the tokens left by top-k, top-p then min-p (0 where dropped), and
    whether each row's answer is exact ([R] bool).

    logits and probs [R, W] are either whole rows of `vocab` tokens or each row's W largest
    logits, sorted descending, with their probabilities over the whole vocabulary. A short
    list is exact when it holds the whole top-k set (for a row with top-k), else the whole
    kept set: in both cases its last token was dropped.
    """
    has_top_k = (top_k > 0) & (top_k < vocab)
    kept_by_k = apply_top_k(logits, torch.where(has_top_k, top_k, 0)) > -torch.inf
    probs = torch.where(kept_by_k, probs, 0.0)
    mass = probs.cumsum(dim=-1)[:, -1:]  # cumsum, not sum: see "batch invariance" above
    nucleus = apply_top_p(torch.where(has_top_k[:, None], probs / mass, probs), top_p)
    kept = apply_min_p(torch.where(nucleus > 0, probs, 0.0), min_p)
    is_exact = torch.where(has_top_k, ~kept_by_k[:, -1], kept[:, -1] == 0)
    return kept, is_exact | (logits.shape[1] == vocab)


def largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest entries per row of `x` [R, V], values descending.

    Same values as `x.topk(k)`; among tied entries the ids may differ. When k is small the
    search runs in the k chunks of 64 with the largest maxima (which hold the top k), which is
    several times faster on CPU than a topk over the whole row.
    """
    num_rows, width = x.shape
    if width % _CHUNK or k * _CHUNK * 4 > width:
        return x.topk(k, dim=-1)
    chunks = x.reshape(num_rows, width // _CHUNK, _CHUNK)
    chunk_ids = chunks.amax(dim=-1).topk(k, dim=-1).indices
    ids = (chunk_ids[:, :, None] * _CHUNK + torch.arange(_CHUNK, device=x.device)).flatten(1)
    values, picked = x.gather(1, ids).topk(k, dim=-1)
    return values, ids.gather(1, picked)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One column per row of the unnormalised, non-negative `probs` [R, W], chosen by the
    uniform numbers in [0, 1) `uniforms` [R]: the first whose cumulative probability exceeds
    u * total. Should u * total reach total (u = 1), the last column with a positive
    probability is taken rather than the 0-probability tail."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    picked = torch.searchsorted(cumulative, uniforms[:, None].to(probs.dtype) * total, right=True)
    last_positive = torch.searchsorted(cumulative, total, right=False)
    return torch.minimum(picked, last_positive).squeeze(1)


def sample_truncated(
    logits: torch.Tensor,
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """One token id per row, drawn from `probs` [R, V] (softmax of `logits`) after top-k,
    top-p and min-p, each row with its uniform number; see the module docstring."""
    num_rows, vocab = logits.shape
    token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    need = torch.where((top_k > 0) & (top_k < vocab), top_k + 1, _FIRST_WIDTH).clamp(max=vocab)
    todo = torch.arange(num_rows, device=logits.device)
    while todo.numel() > 0:
        width = int(need[todo].max())
        values, ids = largest(logits if len(todo) == num_rows else logits[todo], width)
        kept, done = truncate(values, probs[todo[:, None], ids], top_k[todo], top_p[todo], min_p[todo], vocab)
        ids, order = ids[done].sort(dim=-1)  # draw in token-id order: see the module docstring
        picked = sample_from_probs(kept[done].gather(1, order), uniforms[todo[done]])
        token_ids[todo[done]] = ids.gather(1, picked[:, None]).squeeze(1)
        todo = todo[~done]
        need[todo] = (need[todo] * _GROWTH).clamp(max=vocab)
    return token_ids
