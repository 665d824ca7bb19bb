"""Workloads: exact token lengths, the sharing structure each one promises, seeds."""

import collections
import re

import numpy as np
import pytest

from splitserve.bench.loadgen import workloads
from splitserve.bench.loadgen.workloads import TOKEN_HIGH, TOKEN_LOW
from splitserve.platform.errors import ConfigError


def flat(wl):
    return [r for s in wl.sessions for r in s]


@pytest.mark.parametrize(
    "name, num_requests, prompt_range, output_range",
    [
        ("w1", 128, (384 + 16, 384 + 48), (16, 16)),
        ("w2", 48, (160, 480), (32, 32)),
        ("w3", 100, (32, 448), (8, 64)),
        ("w4", 64, (32, 64), (128, 256)),
        ("random", 100, (128, 128), (32, 32)),
    ],
)
def test_defaults_have_exact_lengths_and_safe_token_ids(name, num_requests, prompt_range, output_range):
    wl = workloads.build(name, seed=3)
    reqs = flat(wl)
    assert wl.num_requests == len(reqs) == num_requests
    assert all(prompt_range[0] <= r.num_prompt_tokens <= prompt_range[1] for r in reqs)
    assert all(output_range[0] <= r.max_tokens <= output_range[1] for r in reqs)
    ids = np.concatenate([r.prompt_token_ids for r in reqs])
    assert ids.min() >= TOKEN_LOW and ids.max() < TOKEN_HIGH
    assert flat(workloads.build(name, seed=3)) == reqs
    assert flat(workloads.build(name, seed=4)) != reqs


def test_w1_groups_share_exactly_their_system_prompt():
    wl = workloads.build("w1")
    by_group = collections.defaultdict(list)
    for r in flat(wl):
        by_group[r.tag].append(r.prompt_token_ids)
    assert sorted(len(v) for v in by_group.values()) == [16] * 8
    systems = set()
    for prompts in by_group.values():
        system = prompts[0][:384]
        assert all(p[:384] == system for p in prompts)
        assert len({p[384] for p in prompts}) > 1  # questions differ right after the system prompt
        assert all(16 <= len(p) - 384 <= 48 for p in prompts)
        systems.add(system[:16])  # groups differ from their first block
    assert len(systems) == 8
    assert [r.tag for r in flat(wl)][:16] != [f"group-{i % 8}" for i in range(16)]  # shuffled


def test_w1_zipf_skews_group_popularity():
    counts = collections.Counter(r.tag for r in flat(workloads.build("w1", {"zipf": "1.1"}, num_requests=800)))
    assert counts["group-0"] > counts["group-1"] > counts["group-7"]
    assert counts["group-0"] / 800 == pytest.approx(1 / sum(1 / k**1.1 for k in range(1, 9)), abs=0.04)


def test_w2_turns_extend_the_previous_prompt():
    wl = workloads.build("w2", seed=1)
    assert len(wl.sessions) == 8
    for s in wl.sessions:
        assert [r.category for r in s] == [f"turn-{k}" for k in range(1, 7)]
        assert [r.num_prompt_tokens for r in s] == [128 + 64 * (k - 1) + 32 for k in range(1, 7)]
        for prev, turn in zip(s, s[1:]):
            assert turn.prompt_token_ids[: prev.num_prompt_tokens] == prev.prompt_token_ids
        assert s[0].think_s == 0 and all(r.think_s > 0 for r in s[1:])
    assert len({s[0].prompt_token_ids[:16] for s in wl.sessions}) == 8  # own system prompts
    shared = workloads.build("w2", {"shared_system": "1"})
    assert len({s[0].prompt_token_ids[:128] for s in shared.sessions}) == 1
    thinks = [r.think_s for s in workloads.build("w2", {"sessions": "200"}).sessions for r in s[1:]]
    assert np.mean(thinks) == pytest.approx(2.0, rel=0.1)


def test_w3_mixes_long_and_interactive_requests():
    reqs = flat(workloads.build("w3", num_requests=50))
    long = [r for r in reqs if r.category == "long"]
    short = [r for r in reqs if r.category == "interactive"]
    assert len(long) == 10 and len(short) == 40
    assert all(320 <= r.num_prompt_tokens <= 448 and r.max_tokens == 8 for r in long)
    assert all(r.num_prompt_tokens == 32 and r.max_tokens == 64 for r in short)
    assert [r.category for r in reqs][:10] != ["long"] * 10


def test_w4_prompts_are_unique_and_random_follows_vllm_range_ratio():
    assert len({r.prompt_token_ids[:16] for r in flat(workloads.build("w4"))}) == 64
    reqs = flat(
        workloads.build(
            "random",
            {"input_len": "100", "range_ratio": "0.5", "prefix_len": "20", "output_len": "10"},
            num_requests=300,
        )
    )
    assert len({r.prompt_token_ids[:20] for r in reqs}) == 1
    assert min(r.num_prompt_tokens for r in reqs) == 20 + 50 and max(r.num_prompt_tokens for r in reqs) == 20 + 150
    assert {r.max_tokens for r in reqs} == set(range(5, 16))


def test_warmup_requests_are_fresh_and_leave_measured_requests_unchanged():
    with_warmup = workloads.build("w1", num_warmup=3)
    assert flat(with_warmup) == flat(workloads.build("w1"))
    assert [r.category for r in with_warmup.warmup] == ["warmup"] * 3
    measured_starts = {r.prompt_token_ids[:16] for r in flat(with_warmup)}
    assert not measured_starts & {r.prompt_token_ids[:16] for r in with_warmup.warmup}


def test_w1_warm_prefixes_warms_every_group_system_prompt_with_fresh_questions():
    wl = workloads.build("w1", {"warm_prefixes": "1", "groups": "3", "per_group": "4"}, num_warmup=5)
    assert flat(wl) == flat(workloads.build("w1", {"groups": "3", "per_group": "4"}))  # measured set unchanged
    systems = {r.tag: r.prompt_token_ids[:384] for r in flat(wl)}
    assert [w.tag for w in wl.warmup] == ["group-0", "group-1", "group-2", "group-0", "group-1"]
    for w in wl.warmup:
        assert w.prompt_token_ids[:384] == systems[w.tag] and w.category == "warmup"
        assert 384 + 16 <= w.num_prompt_tokens <= 384 + 48
    measured = {r.prompt_token_ids for r in flat(wl)}
    assert not measured & {w.prompt_token_ids for w in wl.warmup}  # the questions are fresh


@pytest.mark.parametrize(
    "name, overrides, num_requests, message",
    [
        ("w1", {"zipff": "1"}, None, "w1 has no parameter 'zipff'; valid: groups, per_group"),
        ("w1", {"groups": "two"}, None, "w1 parameter groups='two' is not a int"),
        ("w1", {"zipf": "-1"}, None, "zipf must be >= 0"),
        ("w1", {"warm_prefixes": "2"}, None, "warm_prefixes must be 0 or 1"),
        ("w1", {"question_min": "50"}, None, "needs 0 <= min <= max, got min=50, max=48"),
        ("w2", {}, 50, "not a multiple of it; use 48 or 54"),
        ("w3", {"long_fraction": "1.5"}, None, "long_fraction must be in [0, 1]"),
        ("random", {}, 0, "the number of requests must be >= 1"),
        ("w9", {}, None, "unknown workload 'w9'; valid: w1, w2, w3, w4, random"),
    ],
)
def test_invalid_workload_parameters_are_explained(name, overrides, num_requests, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        workloads.build(name, overrides, num_requests)


def test_workloads_with_the_same_seed_share_no_tokens():
    """Runs of different workloads against one server must not hit each other's prefix cache."""
    starts = [
        {r.prompt_token_ids[:8] for r in flat(workloads.build(name, seed=0, num_warmup=2))}
        for name in workloads.WORKLOADS
    ]
    assert sum(map(len, starts)) == len(set().union(*starts))


def test_shared_prefix_lengths_are_exact_and_groups_share_only_their_system_prompt():
    params = {"groups": "5", "per_group": "4", "system_len": "96", "question_len": "20", "output_len": "7"}
    wl = workloads.build("shared-prefix", params, num_warmup=5, seed=1)
    reqs = flat(wl)
    assert wl.num_requests == 20 and all(r.num_prompt_tokens == 116 and r.max_tokens == 7 for r in reqs)
    by_group = collections.defaultdict(list)
    for r in reqs:
        by_group[r.tag].append(r.prompt_token_ids)
    assert sorted(by_group) == [f"group-{g}" for g in range(5)] and all(len(v) == 4 for v in by_group.values())
    for prompts in by_group.values():
        assert len({p[:96] for p in prompts}) == 1 and len({p[96:] for p in prompts}) == 4
    assert len({v[0][:16] for v in by_group.values()}) == 5  # groups differ from their first block
    # the warm-ups: each group's system prompt once, with a fresh question of the same length
    assert [w.tag for w in wl.warmup] == [f"group-{g}" for g in range(5)]
    for w in wl.warmup:
        assert w.prompt_token_ids[:96] == by_group[w.tag][0][:96] and w.num_prompt_tokens == 116
        assert all(w.prompt_token_ids[96:] != p[96:] for p in by_group[w.tag])


def test_shared_prefix_is_deterministic_by_seed():
    def build(seed):
        return flat(workloads.build("shared-prefix", {"system_len": "64", "question_len": "8"}, seed=seed))

    assert build(7) == build(7) and build(7) != build(8)
    assert [r.tag for r in build(7)] != sorted(r.tag for r in build(7))  # shuffled, not in group order


def test_shared_prefix_group_skew_follows_zipf():
    params = {"groups": "6", "system_len": "16", "question_len": "4", "group_skew": "1.5"}
    counts = collections.Counter(r.tag for r in flat(workloads.build("shared-prefix", params, num_requests=3000)))
    expected = [1 / k**1.5 for k in range(1, 7)]
    for g in range(6):
        assert counts[f"group-{g}"] / 3000 == pytest.approx(expected[g] / sum(expected), abs=0.02)
    flat_counts = collections.Counter(r.tag for r in flat(workloads.build("shared-prefix", {"groups": "6"})))
    assert set(flat_counts.values()) == {workloads.SharedPrefixParams().per_group}  # skew 0: equal shares


def test_shared_prefix_rejects_bad_parameters():
    with pytest.raises(ConfigError, match="group_skew must be >= 0"):
        workloads.build("shared-prefix", {"group_skew": "-1"})
    with pytest.raises(ConfigError, match="question_len and output_len must be >= 1"):
        workloads.build("shared-prefix", {"question_len": "0"})
    with pytest.raises(ConfigError, match="shared-prefix has no parameter 'zipf'"):
        workloads.build("shared-prefix", {"zipf": "1"})
