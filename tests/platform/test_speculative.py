"""Speculative decoding with n-gram proposals (platform/spec/): exact for greedy, distribution-
preserving for sampling, rolled back cleanly, and validated at every entry point."""

import pathlib
import subprocess
import sys

import pytest
import torch
from test_engine import assert_no_leak

from splitserve.platform.config import SpeculativeConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.sampler import Sampler, SamplingRow, make_generator
from splitserve.platform.spec import verify as verify_mod
from splitserve.platform.spec.ngram import propose
from splitserve.platform.spec.speculator import next_k

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
# Held-in prompts: copy-heavy (a list to repeat, code to edit, JSON to fill) and plain chat.
PROMPTS = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape.\nList: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# The same two functions again:\ndef add(a, b):",
    'Fill in the JSON: {"name": "Ada", "city": "London", "job": "engineer"}\nJSON: {"name": "Ada", "city":',
    "The capital of France is",
]


@pytest.mark.parametrize(
    "token_ids,k,expected",
    [
        ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),  # the longest n (3) that matches
        ([5, 6, 7, 8, 9, 5, 6], 4, [7, 8, 9, 5]),
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, [8, 1]),  # the most recent occurrence wins
        ([1, 2, 3], 2, []),  # no earlier occurrence
        ([7, 7, 7, 7], 2, [7]),  # only what follows the occurrence
    ],
)
def test_ngram_proposals(token_ids, k, expected):
    assert propose(token_ids, k, 2, 4) == expected


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 is invalid; allowed: an integer >= 1"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "allowed: min <= max"),
        ({"method": "eagle"}, "speculative method 'eagle' is not supported; allowed: ngram"),
    ],
)
def test_bad_config_names_what_is_allowed(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig(**fields)


def test_bad_config_on_the_command_line_exits_2():
    cli = str(pathlib.Path(sys.executable).parent / "splitserve")
    for text, says in [
        ('{"method": "eagle"}', "allowed: ngram"),
        ('{"num_speculative_tokens": 0}', ">= 1"),
        ('{"k": 3}', "unknown keys ['k']"),
        ("not json", "not valid JSON"),
    ]:
        proc = subprocess.run(
            [cli, "generate", "--speculative-config", text, "hi"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and says in proc.stderr, (text, proc.returncode, proc.stderr[-300:])


def run(engine, prompts, params):
    return [o.output_token_ids for o in engine.generate(prompts, params)]


def test_greedy_with_speculation_equals_without_alone_and_in_a_batch(make_engine):
    plain = make_engine()
    spec = make_engine(speculative=SPEC)
    want = run(plain, PROMPTS, GREEDY)  # batch invariance is pinned in test_engine.py
    assert [run(spec, [p], GREEDY)[0] for p in PROMPTS[:2]] == want[:2]  # alone
    assert run(spec, PROMPTS, GREEDY) == want  # in one batch
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0  # it really speculated
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and really rejected some
    assert_no_leak(spec)


def test_fused_cpu_decode_verifies_in_one_call_and_equals_plain(make_engine):
    """Under w4a16 a decode step is one call of the fused C kernel (kernels/cpu_decode.c); a step
    with proposals stays that one call, its verification rows beside the plain decodes, and the
    greedy output equals w4a16 without speculation token for token."""
    plain = make_engine(quantization="w4a16")
    if plain.model.decode_plan is None:
        pytest.skip("the fused CPU kernels could not be built on this host (no C compiler)")
    want = run(plain, PROMPTS, GREEDY)
    spec = make_engine(quantization="w4a16", speculative=SPEC)
    plan = spec.model.decode_plan
    rows = []
    real = plan.run
    plan.run = lambda x, *args, **kwargs: rows.append(x.shape[0]) or real(x, *args, **kwargs)
    try:
        got = run(spec, PROMPTS, GREEDY)
    finally:
        del plan.run
    assert got == want
    assert spec.speculator.stats.num_accepted_tokens > 0
    assert max(rows) > len(PROMPTS), f"no fused call carried verification rows: {sorted(set(rows))}"
    assert_no_leak(spec)


@pytest.mark.parametrize(
    "k,proposed,accepted,expected",
    [
        (4, 4, 4, 4),  # all accepted at the maximum: stays there
        (2, 2, 2, 4),  # all accepted: doubles
        (4, 1, 1, 4),  # a short proposal (the n-gram's continuation ended) fully accepted: no shrink
        (4, 4, 0, 1),  # rejected at once: one proposal next
        (4, 4, 2, 3),  # two accepted: three next
        (1, 1, 1, 2),
    ],
)
def test_proposal_budget_follows_the_last_verification(k, proposed, accepted, expected):
    assert next_k(k, proposed, accepted, max_k=4) == expected


def test_switch_offs_by_batch_size_and_by_a_requests_acceptance():
    """A request stops speculating once, after min_proposals verification rounds, it accepted
    less than min_acceptance_rate of what it proposed; a step with more running requests than
    max_batch_size speculates for none of them; k follows the request's last verification."""
    from types import SimpleNamespace

    from splitserve.platform.spec.speculator import Speculator

    cfg = SpeculativeConfig(num_speculative_tokens=4, max_batch_size=2, min_proposals=3, min_acceptance_rate=0.25)
    spec = Speculator(cfg, max_model_len=1000)
    copy = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # "1, 2" occurred before: proposes 3, 4, 5, 6

    def request(name):
        return SimpleNamespace(
            req_id=name,
            num_computed_tokens=len(copy) - 1,
            num_tokens=len(copy),
            num_output_tokens=2,
            params=SimpleNamespace(max_tokens=100),
            all_token_ids=copy,
            spec_token_ids=[],
        )

    good, bad = request("good"), request("bad")
    states = {
        r.req_id: SimpleNamespace(matcher=None, spec_k=0, num_spec_proposed=0, num_spec_accepted=0, num_spec_rounds=0)
        for r in (good, bad)
    }
    spec.propose([good, bad], states)
    assert good.spec_token_ids == [3, 4, 5, 6] and bad.spec_token_ids == [3, 4, 5, 6]
    for rounds in range(3):  # bad: nothing accepted; good: everything
        plan = SimpleNamespace(
            seqs=[
                SimpleNamespace(req_id="good", num_draft_tokens=len(good.spec_token_ids)),
                SimpleNamespace(req_id="bad", num_draft_tokens=len(bad.spec_token_ids)),
            ]
        )
        result = SimpleNamespace(spec_tokens={"good": [0] * (len(good.spec_token_ids) + 1), "bad": [0]})
        spec.record(plan, result, states)
        spec.propose([good, bad], states)
        assert states["bad"].spec_k == 1 and states["good"].spec_k == 4
        if rounds < 2:
            assert len(bad.spec_token_ids) == 1, "a rejected request proposes one token next"
    assert bad.spec_token_ids == [], "0 of 6 accepted after 3 rounds: below 25 %, switched off"
    assert good.spec_token_ids == [3, 4, 5, 6]
    spec.propose([good, bad, request("third")], {**states, "third": states["good"]})
    assert good.spec_token_ids == [], "3 running requests: above max_batch_size 2"


def test_greedy_equal_with_chunked_prefill_stop_strings_and_max_tokens(make_engine):
    plain = make_engine(max_num_batched_tokens=32)
    spec = make_engine(max_num_batched_tokens=32, speculative=SPEC)
    for max_tokens in (1, 3, 7):  # boundaries inside and at the end of a proposal
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert run(spec, PROMPTS[:3], params) == run(plain, PROMPTS[:3], params), max_tokens
    stop = SamplingParams(temperature=0, max_tokens=48, stop=["grape", "a - b"], ignore_eos=True)
    want = plain.generate(PROMPTS[:2], stop)
    got = spec.generate(PROMPTS[:2], stop)
    assert [(o.text, o.finish_reason, o.stop_reason) for o in got] == [
        (o.text, o.finish_reason, o.stop_reason) for o in want
    ]
    assert_no_leak(spec)


def test_logprobs_of_accepted_tokens_match_plain_decoding(make_engine):
    plain = make_engine()
    spec = make_engine(speculative=SPEC)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    want, got = plain.generate(PROMPTS[:1], params)[0], spec.generate(PROMPTS[:1], params)[0]
    assert got.output_token_ids == want.output_token_ids
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_abort_while_speculating_frees_every_block(make_engine):
    spec = make_engine(speculative=SPEC)
    ids = [spec.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(6):
        spec.step()
    assert spec.speculator.stats.num_drafts > 0
    for req_id in ids[:2]:
        spec.abort(req_id)
    while spec.has_unfinished_requests():
        spec.step()
    assert_no_leak(spec)


def test_seeded_sampling_with_speculation_is_reproducible(make_engine):
    spec = make_engine(speculative=SPEC)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
    assert run(spec, PROMPTS[:2], params) == run(spec, PROMPTS[:2], params)
    assert_no_leak(spec)


# -- the acceptance rule keeps the target distribution ----------------------------------------
# Synthetic logits over 8 tokens, the same distribution at every position, so every emitted
# token must be distributed as p whatever the proposals. 6,000 verifications of a fixed
# 2-token proposal with seeded generators; Pearson's chi-square with 7 degrees of freedom has a
# 0.1 % false-alarm rate above 24.32 (the table value). The seed fixes the draws, so the test is
# deterministic; the mutation below shows the statistic does move when the rule is wrong.
CHI2_DF7_P001 = 24.32
P = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
DRAFTS = [6, 1]  # an unlikely and a likely proposal


def _chi2_of_emitted_tokens(n: int = 6_000) -> tuple[float, float]:
    logits = torch.log(P).repeat(len(DRAFTS) + 1, 1)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=64)
    row = SamplingRow(params, [0], [], make_generator(7))
    first, second = torch.zeros(8), torch.zeros(8)
    sampler = Sampler()
    for _ in range(n):
        tokens, _ = verify_mod.verify(sampler, logits, DRAFTS, row, eos_token_ids=())
        first[tokens[0]] += 1
        if len(tokens) > 1:  # the first proposal was accepted: the next token is again ~ p
            second[tokens[1]] += 1

    def chi2(counts):
        expected = P * counts.sum()
        return float(((counts - expected) ** 2 / expected).sum())

    return chi2(first), chi2(second)


def test_rejection_sampling_keeps_the_target_distribution():
    first, second = _chi2_of_emitted_tokens()
    assert first < CHI2_DF7_P001 and second < CHI2_DF7_P001, (first, second)


def test_a_wrong_acceptance_rule_is_detected(monkeypatch):
    # Mutation of the acceptance rule only: accept a proposal with probability min(1, 2 p(d))
    # instead of p(d); the residual and bonus draws stay as they are.
    def lenient(probs, drafts, row):
        tokens = []
        for i, draft in enumerate(drafts):
            if verify_mod.draw_uniform(row) < min(1.0, 2 * float(probs[i, draft])):
                tokens.append(draft)
                continue
            residual = probs[i].clone()
            residual[draft] = 0.0
            return tokens + [verify_mod._draw(residual, row)]
        return tokens + [verify_mod._draw(probs[len(drafts)].clone(), row)]

    monkeypatch.setattr(verify_mod, "_rejection_sample", lenient)
    first, _ = _chi2_of_emitted_tokens()
    assert first > CHI2_DF7_P001, first


def test_disaggregated_decode_worker_speculates_and_equals_colocated(make_engine, smollm2_models):
    from test_disaggregation_engine import disaggregated

    from splitserve.platform.sampling.params import SamplingParams as SP

    local = make_engine()
    p_engine, d_engine = make_engine(), make_engine(speculative=SPEC)
    params = SP(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = local.tokenizer.encode(PROMPTS[0])
    [ref] = local.generate([prompt], params)
    outs, _, _ = disaggregated(p_engine, d_engine, prompt, params=params)
    assert outs[-1].finished and outs[-1].output_token_ids == ref.output_token_ids
    assert d_engine.speculator.stats.num_accepted_tokens > 0
    for e in (p_engine, d_engine):
        assert_no_leak(e)
