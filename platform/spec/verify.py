"""Verifying one request's proposals against the model's own distribution.

The step computed logits at the request's last known token and at each of its k proposals,
so position i (0..k) gives the distribution of the token after proposal i (position 0: after
the last known token). Each position is scored as if the tokens before it had been generated:
its sampling row sees the output so far plus the proposals before it (penalties, min_tokens).

- Greedy: the token at position i is the argmax, exactly what decoding one token at a time
  would pick. The proposals are accepted while they equal those argmaxes; the first argmax
  that differs (or the one after the last proposal) is the step's final token. The output is
  token for token the output without speculation.
- Sampled: rejection sampling with a deterministic draft (an n-gram proposal is one token with
  probability 1). Proposal d at position i is accepted with probability p_i(d); on rejection
  the token is drawn from p_i with d removed and renormalised, and verification stops; if all
  are accepted, one more token is drawn from p_k. Each emitted token is then distributed exactly
  as p given the tokens before it (Leviathan et al. 2023, with q a point mass), so speculation
  changes how many steps a request takes, never what it samples from. Seeded requests draw
  their uniforms from their own generator, so a seed reproduces the same output.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import torch

from splitserve.platform.sampling.sampler import Sampler, SamplingRow, draw_uniform, target_probs


def verify(
    sampler: Sampler, logits: torch.Tensor, drafts: Sequence[int], row: SamplingRow, eos_token_ids: Collection[int]
) -> tuple[list[int], list[tuple[float, list]] | None]:
    """(tokens the step emits, per-token (logprob, top-n) if the request asked for logprobs).

    `logits` [len(drafts) + 1, vocab] are the raw logits at the last known token and at each
    proposal; `row` is the request's sampling row before this step.
    """
    k = len(drafts)
    rows = [replace(row, output_token_ids=[*row.output_token_ids, *drafts[:i]]) for i in range(k + 1)]
    if row.params.is_greedy:
        picks = sampler(logits, rows, eos_token_ids).token_ids
        tokens = []
        for i in range(k + 1):
            tokens.append(picks[i])
            if i == k or picks[i] != drafts[i]:
                break
    else:
        tokens = _rejection_sample(target_probs(logits, rows, eos_token_ids), drafts, row)
    return tokens, _logprobs(logits, tokens, row)


def _rejection_sample(probs: torch.Tensor, drafts: Sequence[int], row: SamplingRow) -> list[int]:
    tokens = []
    for i, draft in enumerate(drafts):
        if draw_uniform(row) < float(probs[i, draft]):
            tokens.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        tokens.append(_draw(residual, row))
        return tokens
    tokens.append(_draw(probs[len(drafts)].clone(), row))
    return tokens


def _draw(probs: torch.Tensor, row: SamplingRow) -> int:
    """Invert the cumulative distribution of the unnormalised `probs` [vocab] at one uniform."""
    cumulative = probs.cumsum(0)
    u = draw_uniform(row) * float(cumulative[-1])
    picked = int(torch.searchsorted(cumulative, torch.tensor([u], dtype=cumulative.dtype), right=True)[0])
    last_positive = int(torch.nonzero(probs > 0)[-1, 0])
    return min(picked, last_positive)


def _logprobs(logits: torch.Tensor, tokens: list[int], row: SamplingRow):
    """The raw logprob (and top-n) of each emitted token at its position, as the sampler reports them."""
    num_top = row.params.logprobs
    if num_top is None:
        return None
    raw = torch.log_softmax(logits[: len(tokens)].to(torch.float32), dim=-1)
    out = []
    for i, token in enumerate(tokens):
        top = []
        if num_top:
            values, ids = raw[i].topk(num_top)
            top = list(zip(ids.tolist(), values.tolist()))
        out.append((float(raw[i, token]), top))
    return out
