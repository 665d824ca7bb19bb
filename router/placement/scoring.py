"""The scorer interface: what a scorer reads about a request (`ScoringContext`), what it
returns (a score in [0, 1] per worker, 1 = best) and the rules every scorer keeps.

A placement profile sums `weight * score` over its scorers (weights from the config file) and
picks the maximum. Each scorer has a stable `name` (the config refers to it), parses its own
`params` over its `DEFAULTS`, and never fails a request: a worker it has no data for (no load
report yet) gets the neutral score 0.5 (`missing`) and one log line per worker per minute.

Load terms use a fixed saturation point (`headroom`) rather than min-max normalisation across
workers: with min-max, one extra queued request swings a score from 1 to 0 and outweighs any
prefix hit; with a saturation point the weight says how many queued requests a full prefix hit
is worth. The scorers themselves are in scorers.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError
from splitserve.router.placement.pool import WorkerState

log = logging.getLogger(__name__)

NEUTRAL = 0.5


@dataclass
class ScoringContext:
    """What a scorer may read about the request being placed."""

    num_prompt_tokens: int
    num_prompt_blocks: int  # full blocks of the prompt
    matched_blocks: dict[str, int] = field(default_factory=dict)  # per worker address
    now: float = 0.0
    lora_name: str | None = None  # the LoRA adapter the request runs (None: base model)
    block_size: int = 16  # tokens per KV block (the pool's)


class Scorer:
    name = ""
    DEFAULTS: dict = {}

    def __init__(self, params: dict | None = None):
        self.params = parse_params(self.name, self.DEFAULTS, params or {})

    def score(self, ctx: ScoringContext, workers: list[WorkerState]) -> dict[str, float]:
        """Scores in [0, 1] for every worker in `workers`, by address."""
        raise NotImplementedError


def parse_params(owner: str, defaults: dict, params: dict) -> dict:
    """`params` over `defaults`; ConfigError for an unknown key or a value of the wrong type."""
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ConfigError(f"{owner}: unknown parameter(s) {unknown}; allowed: {', '.join(defaults) or 'none'}")
    out = dict(defaults)
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{owner}: {key}={value!r} is invalid; allowed: a number > 0")
        out[key] = value
    return out


_last_logged: dict[tuple[str, str], float] = {}


def missing(scorer: str, worker: str, what: str) -> float:
    """The neutral score, logging why at most once a minute per scorer and worker."""
    now = time.monotonic()
    if now - _last_logged.get((scorer, worker), -1e9) > 60:
        _last_logged[(scorer, worker)] = now
        log.info("scorer %s: no %s for worker %s yet; neutral score %.1f", scorer, what, worker, NEUTRAL)
    return NEUTRAL


def headroom(value: float, saturation: float) -> float:
    """1 at 0, falling linearly to 0 at `saturation` and beyond (clamped to [0, 1])."""
    score = 1.0 - value / saturation
    return 0.0 if score < 0.0 else 1.0 if score > 1.0 else score
