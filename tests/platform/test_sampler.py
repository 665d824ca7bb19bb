"""The batched sampler: exact token sets of each truncation, exact penalised logits, min_tokens,
seeded reproducibility across batches, the sampled distribution, and raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.sampling import logits_ops
from splitserve.platform.sampling.params import MAX_LOGPROBS, SamplingParams
from splitserve.platform.sampling.sampler import Sampler, SamplerOutput, SamplingRow, make_generator

PROBS = [0.5, 0.3, 0.15, 0.05]
INF = float("inf")


def kept(row: torch.Tensor, dropped_value: float) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if v != dropped_value}


def row(params: SamplingParams, output=(), prompt=(), seeded: bool = True) -> SamplingRow:
    generator = make_generator(params.seed) if seeded else None
    return SamplingRow(params, list(prompt), list(output), generator)


# ---------------------------------------------------------------- truncation, one op at a time


@pytest.mark.parametrize(
    "probs, top_p, expected",
    [
        (PROBS, 0.3, {0}),
        (PROBS, 0.5, {0}),
        (PROBS, 0.51, {0, 1}),
        (PROBS, 0.8, {0, 1}),
        (PROBS, 0.81, {0, 1, 2}),
        (PROBS, 0.95, {0, 1, 2}),
        (PROBS, 0.951, {0, 1, 2, 3}),
        (PROBS, 1.0, {0, 1, 2, 3}),
        # exact sums that float32 rounds below top_p: the tolerance keeps the boundary exact
        ([0.48, 0.44, 0.06, 0.02], 0.98, {0, 1, 2}),
        ([0.39, 0.32, 0.29], 0.71, {0, 1}),
        ([0.71, 0.22, 0.07], 0.93, {0, 1}),
    ],
)
@pytest.mark.parametrize("via_softmax", [False, True])
def test_top_p_keeps_smallest_set_reaching_top_p(probs, top_p, expected, via_softmax):
    probs = torch.tensor([probs])
    if via_softmax:  # the round-off a real softmax brings must not move the boundary
        probs = torch.softmax(probs.log(), dim=-1)
    out = logits_ops.apply_top_p(probs, torch.tensor([top_p]))
    assert kept(out[0], 0.0) == expected
    assert torch.equal(out[0][list(expected)], probs[0][list(expected)])  # not renormalised


def test_top_p_depends_on_probabilities_not_positions():
    order = [2, 0, 3, 1]  # token j gets PROBS[order[j]]
    probs = torch.tensor([[PROBS[i] for i in order]])
    out = logits_ops.apply_top_p(probs, torch.tensor([0.8]))
    assert kept(out[0], 0.0) == {1, 3}


@pytest.mark.parametrize(
    "probs, top_p, expected",
    [
        ([0.4, 0.3, 0.3], 0.5, {0, 1, 2}),  # the crossing token ties with token 2: both kept
        ([0.3, 0.4, 0.3], 0.5, {0, 1, 2}),
        ([0.25, 0.25, 0.25, 0.25], 0.1, {0, 1, 2, 3}),
        ([0.4, 0.2, 0.2, 0.2], 0.4, {0}),
    ],
)
def test_top_p_keeps_ties_with_the_crossing_token(probs, top_p, expected):
    out = logits_ops.apply_top_p(torch.tensor([probs]), torch.tensor([top_p]))
    assert kept(out[0], 0.0) == expected


def test_largest_matches_topk():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16384, generator=generator)
    x[1] = torch.randint(0, 3, (16384,), generator=generator).float()  # mostly ties
    x[2, 5000:] = -INF
    for k in (1, 7, 32, 64, 65, 300):
        values, ids = logits_ops.largest(x, k)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values) and all(len(set(r)) == k for r in ids.tolist())


TRUNCATIONS = [  # (top_k, top_p, min_p)
    (0, 0.9, 0.0),
    (0, 0.5, 0.0),
    (0, 0.99, 0.0),
    (5, 1.0, 0.0),
    (40, 0.9, 0.0),
    (300, 0.95, 0.0),
    (2000, 1.0, 0.0),
    (0, 1.0, 0.05),
    (0, 1.0, 0.001),
    (50, 0.8, 0.1),
    (0, 0.95, 0.01),
]


@pytest.mark.parametrize("scale", [0.0, 0.3, 1.0, 3.0, 8.0])  # 0.0: a uniform row
def test_sample_truncated_equals_dense_definition(scale):
    """The short-list search keeps exactly the tokens the dense filters keep: drawing both
    in token-id order with the same uniform numbers gives the same token."""
    vocab, num_draws = 16384, 16
    generator = torch.Generator().manual_seed(int(scale * 10))
    row_logits = torch.randn(vocab, generator=generator) * scale
    top_k, top_p, min_p = (torch.tensor(c).repeat_interleave(num_draws) for c in zip(*TRUNCATIONS))
    num_rows = len(top_k)
    logits = row_logits.expand(num_rows, vocab).contiguous()
    probs = torch.softmax(logits, dim=-1)
    uniforms = torch.rand(num_rows, generator=generator)
    fast = logits_ops.sample_truncated(logits, probs, top_k, top_p, min_p, uniforms)
    kept, is_exact = logits_ops.truncate(logits, probs, top_k, top_p, min_p, vocab)
    assert bool(is_exact.all())
    assert fast.tolist() == logits_ops.sample_from_probs(kept, uniforms).tolist()


@pytest.mark.parametrize(
    "top_k, top_p, min_p", [(2, 1.0, 0.0), (2, 0.6, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.1), (150, 0.9, 0.0)]
)
def test_sample_truncated_keeps_ties_past_the_first_list(top_k, top_p, min_p):
    """200 tokens tie for second place, far more than the first short list holds."""
    vocab = 16384
    logits = torch.full((64, vocab), -5.0)
    logits[:, 7] = 2.0
    logits[:, 1000:1200] = 0.0
    probs = torch.softmax(logits, dim=-1)
    args = [torch.tensor([x] * 64) for x in (top_k, top_p, min_p)]
    uniforms = torch.linspace(0, 0.999, 64)
    fast = logits_ops.sample_truncated(logits, probs, *args, uniforms=uniforms)
    kept, _ = logits_ops.truncate(logits, probs, *args, vocab=vocab)
    assert fast.tolist() == logits_ops.sample_from_probs(kept, uniforms).tolist()
    assert set(fast.tolist()) - {7} <= set(range(1000, 1200)) and len(set(fast.tolist())) > 40


@pytest.mark.parametrize(
    "top_k, expected",
    [
        (1, {1}),
        (2, {1, 2}),
        (3, {1, 2, 3}),
        (4, {0, 1, 2, 3}),
        (5, {0, 1, 2, 3}),
        (0, {0, 1, 2, 3}),
        (-1, {0, 1, 2, 3}),
    ],
)
def test_top_k_keeps_the_k_largest(top_k, expected):
    out = logits_ops.apply_top_k(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), torch.tensor([top_k]))
    assert kept(out[0], -INF) == expected


def test_top_k_keeps_ties_and_only_touches_rows_that_ask():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, 3.0, 3.0, 2.0], [5.0, 1.0, 2.0, 0.0]])
    out = logits_ops.apply_top_k(logits, torch.tensor([1, 0, 2]))
    assert kept(out[0], -INF) == {1, 2}
    assert torch.equal(out[1], logits[1])
    assert kept(out[2], -INF) == {0, 2}


@pytest.mark.parametrize(
    "min_p, expected",
    [
        (0.0, {0, 1, 2, 3}),
        (0.05, {0, 1, 2, 3}),
        (0.2, {0, 1, 2}),
        (0.6, {0, 1}),
        (1.0, {0}),
    ],
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p, expected):
    out = logits_ops.apply_min_p(torch.tensor([PROBS]), torch.tensor([min_p]))
    assert kept(out[0], 0.0) == expected


# ---------------------------------------------------------------- penalties

LOGITS = [2.0, -2.0, 1.0, 0.5, -1.0]


@pytest.mark.parametrize(
    "repetition, frequency, presence, expected",
    [
        (1.0, 0.0, 0.0, LOGITS),
        # seen = prompt {0} | output {1, 3}: positive logits divided, negative multiplied
        (2.0, 0.0, 0.0, [1.0, -4.0, 1.0, 0.25, -1.0]),
        # output counts: token 1 once, token 3 twice; the prompt token 0 is not counted
        (1.0, 0.5, 0.0, [2.0, -2.5, 1.0, -0.5, -1.0]),
        (1.0, 0.0, 0.25, [2.0, -2.25, 1.0, 0.25, -1.0]),
        (2.0, 0.5, 0.25, [1.0, -4.75, 1.0, -1.0, -1.0]),
        (1.0, -1.0, 0.0, [2.0, -1.0, 1.0, 2.5, -1.0]),
    ],
)
def test_penalties_change_logits_exactly(repetition, frequency, presence, expected):
    out = logits_ops.apply_penalties(
        torch.tensor([LOGITS, LOGITS]),
        prompt_ids=torch.tensor([[0, 5], [5, 5]]),
        output_ids=torch.tensor([[1, 3, 3], [5, 5, 5]]),
        repetition=torch.tensor([repetition, repetition]),
        frequency=torch.tensor([frequency, frequency]),
        presence=torch.tensor([presence, presence]),
    )
    assert out[0].tolist() == expected
    assert out[1].tolist() == LOGITS  # nothing seen: untouched whatever the penalties


def test_sampler_penalises_only_rows_that_asked():
    logits = torch.tensor([[5.0, 4.9, 0.0]] * 3)
    rows = [
        row(SamplingParams(temperature=0, presence_penalty=0.5), output=[0]),
        row(SamplingParams(temperature=0), output=[0]),
        row(SamplingParams(temperature=0, repetition_penalty=1.1), prompt=[0]),
    ]
    assert Sampler()(logits, rows, eos_token_ids=[]).token_ids == [1, 0, 1]


# ---------------------------------------------------------------- drawing


@pytest.mark.parametrize(
    "probs, u, expected",
    [
        ([0.0, 0.5, 0.0, 0.5], 0.0, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.49, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.5, 3),
        ([0.0, 0.5, 0.0, 0.5], 0.9999999, 3),
        ([0.0, 2.0, 0.0, 2.0], 0.75, 3),  # unnormalised
        ([0.5, 0.5, 0.0], 0.99999994, 1),  # the largest float32 below 1: never the 0-prob tail
        ([0.5, 0.5, 0.0], 1.0, 1),  # u * total reaching total still stops at the last positive
    ],
)
def test_sample_from_probs_inverts_the_cumulative_distribution(probs, u, expected):
    uniforms = torch.tensor([u], dtype=torch.float32)
    assert logits_ops.sample_from_probs(torch.tensor([probs]), uniforms).tolist() == [expected]


# ---------------------------------------------------------------- the sampler


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 5.0, 2.0]])
    rows = [row(SamplingParams(temperature=0)) for _ in range(3)]
    for dtype in (torch.float32, torch.bfloat16):
        out = Sampler()(logits.to(dtype), rows, eos_token_ids=[])
        assert out == SamplerOutput([1, 0, 2], None, None)


def test_tiny_temperature_is_greedy():
    params = SamplingParams(temperature=1e-6, seed=3)
    assert params.is_greedy
    logits = torch.tensor([[0.0, 300.0, 1.0]])
    assert Sampler()(logits, [row(params)], eos_token_ids=[]).token_ids == [1]


def test_sampler_does_not_modify_the_logits():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = [
        row(
            SamplingParams(
                temperature=0.7, top_p=0.5, repetition_penalty=1.3, min_tokens=3, stop_token_ids=(4,), seed=1
            ),
            output=[1, 2],
            prompt=[3],
        ),
        row(SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=2), output=[5]),
    ]
    Sampler()(logits, rows, eos_token_ids=[7])
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "ignore_eos, num_output, expected",
    [
        (False, 0, 1),
        (False, 2, 1),
        (False, 3, 3),  # EOS (3) and stop (2) blocked until 3 tokens
        (True, 0, 3),  # ignore_eos: EOS ends nothing, so min_tokens leaves it alone
    ],
)
def test_min_tokens_blocks_eos_and_stop_ids_until_reached(ignore_eos, num_output, expected):
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(2, 99), ignore_eos=ignore_eos)
    rows = [row(params, output=[0] * num_output)]
    assert Sampler()(logits, rows, eos_token_ids={3}).token_ids == [expected]


def test_min_tokens_with_ignore_eos_still_blocks_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 9.0, 5.0]])
    params = SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(2,), ignore_eos=True)
    assert Sampler()(logits, [row(params)], eos_token_ids={3}).token_ids == [3]


def test_min_tokens_blocks_stop_ids_when_sampling():
    logits = torch.tensor([[0.0, 0.0, 8.0, 8.0]] * 200)  # 2 and 3 carry ~all the mass
    rows = [row(SamplingParams(min_tokens=1, stop_token_ids=(2,), seed=i)) for i in range(200)]
    tokens = Sampler()(logits, rows, eos_token_ids={3}).token_ids
    assert set(tokens) == {0, 1}


def sample_sequence(seed: int | None, position: int, others: list[SamplingRow], num_steps: int = 10) -> list[int]:
    """Tokens a row with `seed` draws over `num_steps` steps at `position` among `others`."""
    vocab = 49152  # long rows: CPU kernels may split a row across threads when the batch is small
    target_logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(42))
    other_logits = torch.randn(len(others), vocab, generator=torch.Generator().manual_seed(43))
    logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=500, min_p=0.01, seed=seed)
    rows = others[:position] + [row(params, seeded=seed is not None)] + others[position:]
    sampler = Sampler()
    return [sampler(logits, rows, eos_token_ids=[]).token_ids[position] for _ in range(num_steps)]


def other_rows() -> list[SamplingRow]:
    return [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(seed=5, top_k=3)),
        row(SamplingParams(temperature=1.5), seeded=False),
        row(SamplingParams(seed=9, repetition_penalty=1.2, logprobs=3), output=[1], prompt=[2]),
    ]


def test_same_seed_reproduces_regardless_of_batch():
    alone = sample_sequence(seed=1234, position=0, others=[])
    assert len(set(alone)) > 5  # a real sequence of draws, not one token repeated
    for position in (0, 2, 4):
        assert sample_sequence(seed=1234, position=position, others=other_rows()) == alone


def test_different_seeds_give_different_sequences():
    sequences = {tuple(sample_sequence(seed=s, position=0, others=[])) for s in range(10)}
    assert len(sequences) == 10


def test_unseeded_rows_follow_the_global_rng():
    torch.manual_seed(0)
    first = sample_sequence(seed=None, position=1, others=other_rows())
    torch.manual_seed(0)
    assert sample_sequence(seed=None, position=1, others=other_rows()) == first
    assert len(set(first)) > 5


def test_make_generator():
    assert make_generator(None) is None
    draws = [torch.rand(1, generator=make_generator(s)).item() for s in (-1, 2**64 - 1, 2**70)]
    assert draws[0] == draws[1]  # -1 is 2**64 - 1, as torch reads it
    assert 0.0 <= draws[2] < 1.0  # out of torch's range: reduced, not an error


def empirical_frequencies(logits: list[float], params: SamplingParams, num_draws: int):
    rows = [SamplingRow(params, [], [], make_generator(i)) for i in range(num_draws)]
    tokens = Sampler()(torch.tensor([logits] * num_draws), rows, eos_token_ids=[]).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    nonzero = expected > 0
    assert counts[~nonzero].sum() == 0
    return float(((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum())


def test_temperature_sampling_matches_softmax():
    logits = [1.0, 0.5, 0.0, -0.5, -1.0]
    counts = empirical_frequencies(logits, SamplingParams(temperature=0.7), num_draws=20000)
    expected = torch.softmax(torch.tensor(logits) / 0.7, dim=-1)
    assert chi_square(counts, expected) < 18.47  # 4 degrees of freedom, p = 0.001


def test_truncated_sampling_matches_renormalised_nucleus():
    logits = torch.tensor(PROBS).log().tolist()
    counts = empirical_frequencies(logits, SamplingParams(top_p=0.8), num_draws=20000)
    assert counts[2:].tolist() == [0, 0]
    assert chi_square(counts, torch.tensor([0.625, 0.375, 0.0, 0.0])) < 10.83  # 1 dof, p = 0.001


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_sorted():
    vocab = MAX_LOGPROBS
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    rows = [
        row(SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=vocab, seed=0), prompt=list(range(10))),
        row(SamplingParams(temperature=0, logprobs=0, frequency_penalty=2.0), output=[3, 3]),
        row(SamplingParams(temperature=0, logprobs=None)),
    ]
    out = Sampler()(logits, rows, eos_token_ids=[])
    raw = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-6)
    top = out.top_logprobs[0]
    assert len(top) == vocab and sorted(top, key=lambda t: -t[1]) == top
    assert sorted(token for token, _ in top) == list(range(vocab))
    assert math.fsum(math.exp(lp) for _, lp in top) == pytest.approx(1.0, abs=1e-5)
    assert [lp for _, lp in top] == pytest.approx(raw[0].sort(descending=True).values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None


def test_top_n_logprobs_are_the_n_best():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    out = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=2))], eos_token_ids=[])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [1]
    assert [t for t, _ in out.top_logprobs[0]] == [1, 3]
    assert out.top_logprobs[0][1][1] == pytest.approx(raw[3].item(), abs=1e-6)


def test_no_logprobs_when_no_row_asks():
    logits = torch.randn(2, 10)
    rows = [row(SamplingParams(seed=1)), row(SamplingParams(temperature=0, presence_penalty=1))]
    out = Sampler()(logits, rows, eos_token_ids=[])
    assert out.logprobs is None and out.top_logprobs is None


# ---------------------------------------------------------------- params validation fixed here


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", INF),
        ("temperature", float("nan")),
        ("repetition_penalty", INF),
    ],
)
def test_params_reject_non_finite_values(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})
