"""Benchmark workloads: seeded request sets with exact token lengths (definitions in docs/bench.md).

A workload is a list of sessions; a session is a tuple of turns sent one after another (turn k+1
leaves when turn k has finished and its think time has passed). Single-turn workloads are
sessions of one turn. The arrival process (arrivals.py) schedules session starts.

Prompts are token ids drawn uniformly from [TOKEN_LOW, TOKEN_HIGH): ordinary BPE pieces of
SmolLM2's 49,152-token vocabulary, clear of the special tokens at its start. The server never
tokenizes, so every prompt length is exact; output lengths are exact through ignore_eos and
max_tokens.

- w1: `groups` system prompts of `system_len` tokens; a request is its group's system prompt
  plus a unique question of uniform [question_min, question_max] tokens; `per_group` requests
  per group, shuffled, or (zipf > 0) each request's group drawn with P(g) ∝ 1/(g+1)^zipf.
  `warm_prefixes=1`: the warm-ups carry the groups' system prompts (with fresh questions), so
  the measured phase sees a server in steady state instead of paying one cold miss per group.
- shared-prefix: llm-d's shared-prefix generator (inference-perf's `shared_prefix` data): `groups`
  system prompts of exactly `system_len` tokens; a request is its group's system prompt plus a
  unique question of exactly `question_len` tokens, answered with exactly `output_len` tokens.
  `group_skew` 0: every group gets `per_group` requests, shuffled; > 0: each request's group is
  drawn with P(g) ∝ 1/(g+1)^group_skew (group 0 the most popular). The warm-ups carry the groups'
  system prompts (as w1's `warm_prefixes=1`), so a run measures the cache in steady state. The
  defaults are the CPU shape; GPU_SHAPE is llm-d's full one (docs/bench.md states both).
- w2: `sessions` chats of `turns` turns. Turn k's prompt = system + (user_1 + reply_1) + … +
  user_k. The replies are pre-drawn tokens standing for the assistant's answers (the client
  cannot know the ids the server generated; pre-drawing keeps every prompt fixed and seeded),
  so turn k's prompt is a prefix of turn k+1's. Each later turn waits an exponential think time
  (mean `think_s`) after the previous one finished. Category "turn-k" gives TTFT per turn.
- w3: round(N·long_fraction) "long" requests (prompt uniform [long_min, long_max], output
  `long_output`) shuffled among "interactive" ones (prompt `interactive_len`, output
  `interactive_output`): a Poisson stream at rate R thinned into two at p·R and (1−p)·R.
- w4: unique prompts of uniform [input_min, input_max] tokens, outputs uniform [output_min,
  output_max]: the negative control.
- random: vLLM's random dataset: lengths uniform in [len·(1−range_ratio), len·(1+range_ratio)]
  after an optional prefix of `prefix_len` tokens shared by every request.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import numpy as np

from splitserve.platform.errors import ConfigError

TOKEN_LOW, TOKEN_HIGH = 100, 40_000


@dataclass(frozen=True)
class BenchRequest:
    """One request as sent: `category` groups it in the report, `tag` only labels its record."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    category: str = ""
    tag: str = ""
    think_s: float = 0.0  # wait after the previous turn of its session finished
    prompt_text: str | None = None  # --prompt-format text: sent instead of the ids (see as_text)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


Session = tuple[BenchRequest, ...]


def _check(cond: bool, name: str, what: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {what}")


def _check_range(name: str, lo: int, hi: int, low: int = 1) -> None:
    _check(low <= lo <= hi, name, f"needs {low} <= min <= max, got min={lo}, max={hi}")


@dataclass(frozen=True)
class W1Params:
    """Shared system prompts across groups (prefix routing vs round-robin)."""

    groups: int = 8
    per_group: int = 16
    system_len: int = 384
    question_min: int = 16
    question_max: int = 48
    output_len: int = 16
    zipf: float = 0.0  # 0: every group gets per_group requests; > 0: Zipf(zipf) popularity
    warm_prefixes: int = 0  # 1: warm-ups = each group's system prompt + a fresh question

    def __post_init__(self):
        _check(self.groups >= 1 and self.per_group >= 1, "w1", "groups and per_group must be >= 1")
        _check(self.system_len >= 1 and self.output_len >= 1, "w1", "system_len and output_len must be >= 1")
        _check_range("w1 question", self.question_min, self.question_max, low=0)
        _check(self.zipf >= 0, "w1", f"zipf must be >= 0, got {self.zipf}")
        _check(self.warm_prefixes in (0, 1), "w1", f"warm_prefixes must be 0 or 1, got {self.warm_prefixes}")

    def default_num_requests(self) -> int:
        return self.groups * self.per_group


@dataclass(frozen=True)
class SharedPrefixParams:
    """llm-d's shared-prefix workload; the defaults are its shape scaled to a quiet 2-core CPU
    host, where a lone miss (224 tokens) takes about half the sweep's 2 s SLO (docs/bench.md)."""

    groups: int = 8
    per_group: int = 6
    system_len: int = 192
    question_len: int = 32
    output_len: int = 16
    group_skew: float = 0.0  # 0: per_group requests each; > 0: Zipf(group_skew) popularity

    def __post_init__(self):
        _check(self.groups >= 1 and self.per_group >= 1, "shared-prefix", "groups and per_group must be >= 1")
        _check(
            min(self.system_len, self.question_len, self.output_len) >= 1,
            "shared-prefix",
            "system_len, question_len and output_len must be >= 1",
        )
        _check(self.group_skew >= 0, "shared-prefix", f"group_skew must be >= 0, got {self.group_skew}")

    def default_num_requests(self) -> int:
        return self.groups * self.per_group


# llm-d's precise prefix-cache routing benchmark (16 H100s): 6,000-token system prompts, 1,200-token
# questions, 1,000 output tokens. Pass as --workload-param KEY=VALUE on a GPU.
GPU_SHAPE = {"groups": 32, "per_group": 32, "system_len": 6000, "question_len": 1200, "output_len": 1000}


@dataclass(frozen=True)
class W2Params:
    """Multi-turn chat sessions (history reuse); TTFT per turn."""

    sessions: int = 8
    turns: int = 6
    system_len: int = 128
    user_len: int = 32
    reply_len: int = 32
    output_len: int = 32
    think_s: float = 2.0
    shared_system: int = 0  # 1: every session has the same system prompt

    def __post_init__(self):
        _check(
            min(self.sessions, self.turns, self.user_len, self.output_len) >= 1,
            "w2",
            "sessions, turns, user_len and output_len must be >= 1",
        )
        _check(self.system_len >= 0 and self.reply_len >= 0, "w2", "system_len and reply_len must be >= 0")
        _check(self.think_s >= 0, "w2", f"think_s must be >= 0, got {self.think_s}")
        _check(self.shared_system in (0, 1), "w2", f"shared_system must be 0 or 1, got {self.shared_system}")

    def default_num_requests(self) -> int:
        return self.sessions * self.turns


@dataclass(frozen=True)
class W3Params:
    """Long prompts with short outputs beside interactive streams (P/D vs colocated)."""

    long_fraction: float = 0.2
    long_min: int = 320
    long_max: int = 448
    long_output: int = 8
    interactive_len: int = 32
    interactive_output: int = 64
    num_requests: int = 100

    def __post_init__(self):
        _check(0 <= self.long_fraction <= 1, "w3", f"long_fraction must be in [0, 1], got {self.long_fraction}")
        _check_range("w3 long", self.long_min, self.long_max)
        _check(
            min(self.long_output, self.interactive_len, self.interactive_output, self.num_requests) >= 1,
            "w3",
            "long_output, interactive_len, interactive_output and num_requests must be >= 1",
        )

    def default_num_requests(self) -> int:
        return self.num_requests


@dataclass(frozen=True)
class W4Params:
    """Short prompts, long outputs: the negative control."""

    input_min: int = 32
    input_max: int = 64
    output_min: int = 128
    output_max: int = 256
    num_requests: int = 64

    def __post_init__(self):
        _check_range("w4 input", self.input_min, self.input_max)
        _check_range("w4 output", self.output_min, self.output_max)
        _check(self.num_requests >= 1, "w4", "num_requests must be >= 1")

    def default_num_requests(self) -> int:
        return self.num_requests


@dataclass(frozen=True)
class RandomParams:
    """vLLM's `random` dataset, scaled down for a CPU worker."""

    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_requests: int = 100

    def __post_init__(self):
        _check(self.input_len >= 1 and self.output_len >= 1, "random", "input_len and output_len must be >= 1")
        _check(0 <= self.range_ratio < 1, "random", f"range_ratio must be in [0, 1), got {self.range_ratio}")
        _check(self.prefix_len >= 0 and self.num_requests >= 1, "random", "prefix_len >= 0, num_requests >= 1")

    def default_num_requests(self) -> int:
        return self.num_requests


def _tokens(rng: np.random.Generator, n: int) -> tuple[int, ...]:
    return tuple(rng.integers(TOKEN_LOW, TOKEN_HIGH, size=int(n)).tolist())


def _uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


def group_order(num_groups: int, n: int, skew: float, rng: np.random.Generator) -> list[int]:
    """The group of each of `n` requests: round robin over the groups then shuffled (skew 0), or
    drawn with P(g) ∝ 1/(g+1)^skew."""
    if skew > 0:
        weights = 1.0 / np.arange(1, num_groups + 1) ** skew
        return rng.choice(num_groups, size=n, p=weights / weights.sum()).tolist()
    groups = [i % num_groups for i in range(n)]
    rng.shuffle(groups)
    return groups


def build_w1(p: W1Params, n: int, rng: np.random.Generator) -> list[Session]:
    systems = [_tokens(rng, p.system_len) for _ in range(p.groups)]
    groups = group_order(p.groups, n, p.zipf, rng)
    return [
        (
            BenchRequest(
                systems[g] + _tokens(rng, _uniform(rng, p.question_min, p.question_max)), p.output_len, tag=f"group-{g}"
            ),
        )
        for g in groups
    ]


def build_shared_prefix(p: SharedPrefixParams, n: int, rng: np.random.Generator) -> list[Session]:
    systems = [_tokens(rng, p.system_len) for _ in range(p.groups)]
    return [
        (BenchRequest(systems[g] + _tokens(rng, p.question_len), p.output_len, tag=f"group-{g}"),)
        for g in group_order(p.groups, n, p.group_skew, rng)
    ]


def build_w2(p: W2Params, n: int, rng: np.random.Generator) -> list[Session]:
    shared = _tokens(rng, p.system_len)
    sessions = []
    for s in range(n // p.turns):
        context = shared if p.shared_system else _tokens(rng, p.system_len)
        turns = []
        for k in range(1, p.turns + 1):
            context += _tokens(rng, p.user_len)
            think = float(rng.exponential(p.think_s)) if k > 1 and p.think_s > 0 else 0.0
            turns.append(BenchRequest(context, p.output_len, category=f"turn-{k}", tag=f"session-{s}", think_s=think))
            context += _tokens(rng, p.reply_len)
        sessions.append(tuple(turns))
    return sessions


def build_w3(p: W3Params, n: int, rng: np.random.Generator) -> list[Session]:
    num_long = round(n * p.long_fraction)
    is_long = [True] * num_long + [False] * (n - num_long)
    rng.shuffle(is_long)
    return [
        (
            BenchRequest(_tokens(rng, _uniform(rng, p.long_min, p.long_max)), p.long_output, category="long")
            if long
            else BenchRequest(_tokens(rng, p.interactive_len), p.interactive_output, category="interactive"),
        )
        for long in is_long
    ]


def build_w4(p: W4Params, n: int, rng: np.random.Generator) -> list[Session]:
    return [
        (
            BenchRequest(
                _tokens(rng, _uniform(rng, p.input_min, p.input_max)), _uniform(rng, p.output_min, p.output_max)
            ),
        )
        for _ in range(n)
    ]


def build_random(p: RandomParams, n: int, rng: np.random.Generator) -> list[Session]:
    prefix = _tokens(rng, p.prefix_len)

    def length(center: int) -> int:
        return _uniform(rng, max(1, math.floor(center * (1 - p.range_ratio))), math.ceil(center * (1 + p.range_ratio)))

    return [(BenchRequest(prefix + _tokens(rng, length(p.input_len)), length(p.output_len)),) for _ in range(n)]


WORKLOADS = {
    "w1": (W1Params, build_w1),
    "w2": (W2Params, build_w2),
    "w3": (W3Params, build_w3),
    "w4": (W4Params, build_w4),
    "random": (RandomParams, build_random),
    "shared-prefix": (SharedPrefixParams, build_shared_prefix),
}


@dataclass(frozen=True)
class Workload:
    name: str
    params: object
    sessions: list[Session]
    warmup: list[BenchRequest]

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.sessions)


def parse_params(name: str, overrides: dict[str, str]):
    """The workload's parameter dataclass with `overrides` (strings from the command line) applied."""
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    cls = WORKLOADS[name][0]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, text in overrides.items():
        if key not in fields:
            raise ConfigError(f"{name} has no parameter {key!r}; valid: {', '.join(fields)}")
        kind = float if fields[key].type in ("float", float) else int
        try:
            values[key] = kind(text)
        except ValueError:
            raise ConfigError(f"{name} parameter {key}={text!r} is not a {kind.__name__}") from None
    return cls(**values)


def build(
    name: str,
    overrides: dict[str, str] | None = None,
    num_requests: int | None = None,
    num_warmup: int = 0,
    seed: int = 0,
) -> Workload:
    """Build a workload. Its content and its warm-ups draw from separate streams seeded with
    (seed, workload name), so adding warm-ups leaves the measured requests identical, and two
    workloads with the same seed share no token sequences (no prefix-cache hits across them)."""
    params = parse_params(name, overrides or {})
    n = params.default_num_requests() if num_requests is None else num_requests
    if n < 1:
        raise ConfigError(f"the number of requests must be >= 1, got {n}")
    if name == "w2" and n % params.turns:
        lower, upper = n - n % params.turns, n - n % params.turns + params.turns
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ConfigError(
            f"w2 sends whole sessions of turns={params.turns} requests: the number of requests "
            f"({n}) is not a multiple of it; use {hint}"
        )
    stream = zlib.crc32(name.encode())
    sessions = WORKLOADS[name][1](params, n, np.random.default_rng([seed, 0, stream]))
    warm_rng = np.random.default_rng([seed, 2, stream])
    if name == "w1" and params.warm_prefixes:
        question = (params.question_min, params.question_max)
        warmup = _prefix_warmup(params.system_len, question, params.output_len, sessions, num_warmup, warm_rng)
    elif name == "shared-prefix":
        question = (params.question_len, params.question_len)
        warmup = _prefix_warmup(params.system_len, question, params.output_len, sessions, num_warmup, warm_rng)
    else:
        warmup = _warmup(sessions, num_warmup, warm_rng)
    return Workload(name, params, sessions, warmup)


def _warmup(sessions: list[Session], n: int, rng: np.random.Generator) -> list[BenchRequest]:
    """Warm-up requests shaped like the first measured ones but with fresh tokens: they warm the
    server's code paths and connections without seeding its prefix cache with measured prompts."""
    flat = [r for s in sessions for r in s]
    return [
        BenchRequest(
            _tokens(rng, flat[i % len(flat)].num_prompt_tokens), flat[i % len(flat)].max_tokens, category="warmup"
        )
        for i in range(n)
    ]


def _prefix_warmup(
    system_len: int,
    question: tuple[int, int],
    output_len: int,
    sessions: list[Session],
    n: int,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    """Group g's system prompt + a fresh question of uniform [question] tokens, cycling through the
    groups the measured requests use (in group order): the server's caches reach steady state
    before measuring."""
    systems = {}
    for (req,) in sessions:
        systems.setdefault(req.tag, req.prompt_token_ids[:system_len])
    tags = sorted(systems, key=lambda t: int(t.split("-")[1]))
    return [
        BenchRequest(
            systems[tags[i % len(tags)]] + _tokens(rng, _uniform(rng, *question)),
            output_len,
            category="warmup",
            tag=tags[i % len(tags)],
        )
        for i in range(n)
    ]


def as_text(wl: Workload, tokenizer) -> Workload:
    """For servers that take no token-id prompts (llama-cpp-python): every prompt becomes the
    text of its ids, and its ids become what the tokenizer makes of that text again, so lengths
    are those the server sees (the round trip of random ids changes a few; vLLM's random dataset
    has the same property)."""

    def convert(req: BenchRequest) -> BenchRequest:
        text = tokenizer.decode(list(req.prompt_token_ids))
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        return dataclasses.replace(req, prompt_token_ids=ids, prompt_text=text)

    return dataclasses.replace(
        wl, sessions=[tuple(convert(r) for r in s) for s in wl.sessions], warmup=[convert(r) for r in wl.warmup]
    )
