"""The batched token sampler: one next token per row of a [num_rows, vocab] logits tensor.

Called by the engine once per step with the logits of the rows that sample. The definitions
are vLLM's; the steps, in order:

0. Constraints (`structured.apply_constraints`): each row's logit_bias is added and the tokens
   its grammar forbids are set to -inf; everything below sees the constrained logits.
1. Logprobs, if any row asked, are vLLM's default "raw logprobs": log_softmax in float32 of the
   logits as passed in, before min_tokens, penalties and temperature.
2. min_tokens: while a row has generated fewer than min_tokens tokens, the logits of its
   stop_token_ids, and of the EOS ids unless ignore_eos, are set to -inf. (With ignore_eos,
   EOS ends nothing, so there is nothing to hold back; as in vLLM.) Ids >= vocab are ignored.
3. Penalties (repetition over prompt + output; frequency and presence over the output only),
   only for rows that set one; see `logits_ops.apply_penalties`.
4. ignore_eos changes nothing here: the engine simply does not stop at EOS.
5. Greedy rows (temperature < 1e-5, `SamplingParams.is_greedy`) take the argmax of the
   penalised logits; on ties, the lowest token id.
6. Sampled rows: divide by temperature and take the softmax; rows with top-k, top-p or min-p
   then keep vLLM's truncated set, found in a short sorted list of their largest logits rather
   than by sorting the vocabulary (`logits_ops.sample_truncated`). The token is drawn by
   inverting the cumulative distribution at one uniform number, from the row's own generator
   (`make_generator(params.seed)`) or from torch's global RNG for unseeded rows. Each sampled
   row consumes exactly one number per step, greedy rows none, and every operation is
   row-wise, so a seeded request gets the same tokens whatever else is in the batch and at
   whatever row.

When any row asks for logprobs, every row's sampled-token logprob is returned (one
log_softmax over the batch); top-n lists only for the rows that asked.
Fast path: when every row is greedy and no row has penalties, min_tokens in effect or
logprobs, the whole call is one argmax over the logits as passed in.

On a GPU (logits on CUDA, or `on_device` set) steps 5 and 6 run in device_sampler.py instead:
the same definitions and the same uniform numbers, with no host synchronisation before the one
copy of the results back (the CPU path's short lists need host decisions).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from splitserve.platform.sampling import device_sampler, logits_ops, structured
from splitserve.platform.sampling.params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence in the batch; built by the engine each step. The sampler only reads it,
    except that it advances `generator`, which belongs to the request."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (for penalties and min_tokens)
    generator: torch.Generator | None  # from make_generator(params.seed); None = global RNG
    matcher: structured.Matcher | None = None  # the request's grammar state, if constrained


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[float] | None  # raw logprob of each row's token; None if no row asked
    # per row: the top-n (id, logprob) by logprob, descending; None where the row did not ask
    top_logprobs: list[list[tuple[int, float]] | None] | None


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """The per-request generator for `seed` (None for unseeded requests). Any int is accepted:
    it is taken modulo 2**64, which is how torch itself reads negative seeds."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed % 2**64)


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _is_min_tokens_active(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


def _is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return (
        params.is_greedy
        and params.logprobs is None
        and not _has_penalties(params)
        and not _is_min_tokens_active(row)
        and not structured.needs_constraints(row)
    )


class Sampler:
    """Stateless; one instance serves every step. See the module docstring for the algorithm."""

    stats: structured.CompileStats | None = None  # set by the engine to count mask time
    on_device: bool | None = None  # the device path; None: when the logits are on CUDA

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Collection[int]
    ) -> SamplerOutput:
        """Pick one token per row. `logits` [len(rows), vocab] is not modified."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        if all(_is_plain_greedy(row) for row in rows):
            return SamplerOutput(_argmax(logits).tolist(), None, None)
        logits = structured.apply_constraints(logits.to(torch.float32), rows, self.stats)
        wants_logprobs = any(row.params.logprobs is not None for row in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        logits = _apply_min_tokens(logits, rows, eos_token_ids)
        logits = _apply_penalties(logits, rows)
        if self.on_device or (self.on_device is None and logits.is_cuda):
            return SamplerOutput(*_pick_on_device(logits, rows, raw_logprobs))
        token_ids = _pick_tokens(logits, rows)
        if raw_logprobs is None:
            return SamplerOutput(token_ids.tolist(), None, None)
        return _with_logprobs(token_ids, raw_logprobs, rows)


def _pick_on_device(logits: torch.Tensor, rows: Sequence[SamplingRow], raw_logprobs: torch.Tensor | None):
    """Steps 5 and 6 on the logits' device (device_sampler.py); the uniforms are drawn here, for
    the sampled rows in order, exactly as _sample draws them."""
    vocab = logits.shape[1]
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    uniforms = torch.zeros(len(rows))
    if sampled:
        uniforms[sampled] = _uniforms([rows[i] for i in sampled])
    packed = device_sampler.pack_params(rows, uniforms, logits.device)
    any_truncated = any(_is_truncated(rows[i].params, vocab) for i in sampled)
    token_ids = device_sampler.pick_tokens(logits, packed, any_truncated)
    return device_sampler.to_host(token_ids, raw_logprobs, [row.params.logprobs for row in rows])


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    # max(dim).indices is the first maximal index, like argmax, and about 1.7x faster on CPU.
    return logits.max(dim=-1).indices


def _apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Collection[int]
) -> torch.Tensor:
    vocab = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        if not _is_min_tokens_active(row):
            continue
        blocked = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            blocked.update(eos_token_ids)
        blocked = sorted(t for t in blocked if t < vocab)
        row_index += [i] * len(blocked)
        token_index += blocked
    if not row_index:
        return logits
    logits = logits.clone()
    rows = torch.tensor(row_index, device=logits.device)
    logits[rows, torch.tensor(token_index, device=logits.device)] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    picked = [i for i, row in enumerate(rows) if _has_penalties(row.params)]
    if not picked:
        return logits
    vocab = logits.shape[1]
    params = [rows[i].params for i in picked]
    has_repetition = any(p.repetition_penalty != 1.0 for p in params)
    prompts = [rows[i].prompt_token_ids if has_repetition else () for i in picked]
    outputs = [rows[i].output_token_ids for i in picked]
    dev = logits.device
    penalised = logits_ops.apply_penalties(
        _select(logits, picked),
        _pad(prompts, vocab).to(dev),
        _pad(outputs, vocab).to(dev),
        repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
        presence=torch.tensor([p.presence_penalty for p in params], device=dev),
    )
    if len(picked) == len(rows):
        return penalised
    return logits.index_copy(0, torch.tensor(picked, device=dev), penalised)


def _pad(sequences: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """[len(sequences), longest] int64 tensor, short rows filled with pad_id."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    longest = int(lengths.max()) if len(sequences) else 0
    padded = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    flat = [token_id for ids in sequences for token_id in ids]  # one conversion, not one per row
    padded[torch.arange(longest) < lengths[:, None]] = torch.tensor(flat, dtype=torch.long)
    return padded


def _pick_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if len(greedy) == len(rows):
        return _argmax(logits)
    if not greedy:
        return _sample(logits, rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    token_ids = torch.empty(len(rows), dtype=torch.long)
    token_ids[greedy] = _argmax(_select(logits, greedy))
    token_ids[sampled] = _sample(_select(logits, sampled), [rows[i] for i in sampled])
    return token_ids


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, then a draw from the softmax, truncated for the rows that ask;
    `logits` holds only these rows."""
    params = [row.params for row in rows]
    logits = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    probs = torch.softmax(logits, dim=-1)
    uniforms = _uniforms(rows)
    vocab = logits.shape[1]
    truncated = [i for i, p in enumerate(params) if _is_truncated(p, vocab)]
    if not truncated:
        return logits_ops.sample_from_probs(probs, uniforms)
    token_ids = torch.empty(len(rows), dtype=torch.long)
    whole = [i for i, p in enumerate(params) if not _is_truncated(p, vocab)]
    if whole:
        token_ids[whole] = logits_ops.sample_from_probs(_select(probs, whole), uniforms[whole])
    token_ids[truncated] = logits_ops.sample_truncated(
        _select(logits, truncated),
        _select(probs, truncated),
        top_k=torch.tensor([params[i].top_k for i in truncated]),
        top_p=torch.tensor([params[i].top_p for i in truncated]),
        min_p=torch.tensor([params[i].min_p for i in truncated]),
        uniforms=uniforms[truncated],
    )
    return token_ids


def _is_truncated(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0


def _select(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    """tensor[index] for a sorted index, without the copy when it names every row."""
    if len(index) == tensor.shape[0]:
        return tensor
    return tensor.index_select(0, torch.tensor(index, device=tensor.device))


def _uniforms(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One uniform number in [0, 1) per row: from the row's generator, else the global RNG."""
    uniforms = torch.empty(len(rows))
    unseeded = [i for i, row in enumerate(rows) if row.generator is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded))
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniforms[i] = torch.rand((), generator=row.generator, device=row.generator.device)
    return uniforms


def _with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    sampled = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    num_top = [row.params.logprobs for row in rows]
    most = max((n for n in num_top if n is not None), default=0)
    top_values, top_ids = (t.tolist() for t in logits_ops.largest(raw_logprobs, most))
    top_logprobs = [None if n is None else list(zip(top_ids[i][:n], top_values[i][:n])) for i, n in enumerate(num_top)]
    return SamplerOutput(token_ids.tolist(), sampled.tolist(), top_logprobs)


def skip_draw(params: SamplingParams, generator: torch.Generator | None) -> None:
    """Advance a request's generator past one sampled token drawn elsewhere.

    A decode worker continuing a request whose first token was sampled by a prefill worker
    calls this, so a seeded request yields the same tokens disaggregated as colocated.
    """
    if generator is not None and not params.is_greedy:
        torch.rand((), generator=generator, device=generator.device)


def target_probs(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Collection[int]) -> torch.Tensor:
    """The distribution each sampled (non-greedy) row draws its token from, [len(rows), vocab]:
    steps 0, 2, 3 and 6 of the module docstring, without the draw. Speculative decoding's
    rejection sampling (platform/spec/verify.py) accepts or replaces proposals against it."""
    logits = structured.apply_constraints(logits.to(torch.float32), rows, None)
    logits = _apply_penalties(_apply_min_tokens(logits, rows, eos_token_ids), rows)
    params = [row.params for row in rows]
    logits = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    probs = torch.softmax(logits, dim=-1)
    vocab = logits.shape[1]
    truncated = [i for i, p in enumerate(params) if _is_truncated(p, vocab)]
    if truncated:
        values, ids = _select(logits, truncated).sort(dim=-1, descending=True)
        kept, _ = logits_ops.truncate(
            values,
            _select(probs, truncated).gather(1, ids),
            top_k=torch.tensor([params[i].top_k for i in truncated]),
            top_p=torch.tensor([params[i].top_p for i in truncated]),
            min_p=torch.tensor([params[i].min_p for i in truncated]),
            vocab=vocab,
        )
        probs = probs.clone()
        probs[truncated] = torch.zeros_like(kept).scatter(1, ids, kept)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw_uniform(row: SamplingRow) -> float:
    """One uniform number in [0, 1) from the row's generator (else torch's global RNG)."""
    return float(_uniforms([row])[0])
