"""A worker's measured capacity on one machine and model, and its interpolation.

The profile (written by `splitserve profile`, stored as JSON) holds
- prefill: points (prompt_tokens, tokens_per_s) - one replica's prefill throughput for
  prompts of that length;
- decode: points (context_tokens, concurrency, tokens_per_s, itl_p90_s) - one replica's output
  tokens/s and inter-token latency with that many sequences of that context in flight;
- kv_tokens: KV capacity of one decode replica in tokens.

Interpolation is piecewise linear and clamps to the profiled range (no extrapolation: a
capacity curve extended beyond what was measured is a guess). Decode capacity at an ITL target
is the highest throughput over concurrency whose ITL meets the target, found per profiled
context and then interpolated across context, like Dynamo's scan (ITL need not be monotonic).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field

from splitserve.platform.errors import ConfigError


@dataclass(frozen=True)
class PrefillPoint:
    prompt_tokens: int
    tokens_per_s: float


@dataclass(frozen=True)
class DecodePoint:
    context_tokens: int
    concurrency: int
    tokens_per_s: float
    itl_p90_s: float


@dataclass(frozen=True)
class CapacityProfile:
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    kv_tokens: int
    notes: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("a capacity profile needs at least one prefill and one decode point")
        for p in self.prefill:
            if p.prompt_tokens <= 0 or not p.tokens_per_s > 0:
                raise ConfigError(f"prefill point {p} must have prompt_tokens > 0 and tokens_per_s > 0")
        for d in self.decode:
            if d.context_tokens <= 0 or d.concurrency <= 0 or not d.tokens_per_s > 0 or not d.itl_p90_s > 0:
                raise ConfigError(f"decode point {d} must have every field > 0")
        if self.kv_tokens <= 0:
            raise ConfigError(f"kv_tokens must be > 0, got {self.kv_tokens}")

    # -- interpolation -------------------------------------------------------------------------

    def prefill_tokens_per_s(self, prompt_tokens: float) -> float:
        pts = sorted(self.prefill, key=lambda p: p.prompt_tokens)
        return _interp([p.prompt_tokens for p in pts], [p.tokens_per_s for p in pts], prompt_tokens)

    def decode_tokens_per_s(self, itl_target_s: float, context_tokens: float) -> float:
        """Output tokens/s of one replica at the best concurrency meeting the ITL target."""
        ctxs = sorted({d.context_tokens for d in self.decode})
        best = [self._best_at_context(c, itl_target_s) for c in ctxs]
        return _interp(ctxs, best, context_tokens)

    def _best_at_context(self, ctx: int, itl_target_s: float) -> float:
        pts = sorted((d for d in self.decode if d.context_tokens == ctx), key=lambda d: d.concurrency)
        best = 0.0
        for a, b in zip(pts, pts[1:]):
            if a.itl_p90_s <= itl_target_s:
                best = max(best, a.tokens_per_s)
            if a.itl_p90_s <= itl_target_s < b.itl_p90_s:  # the target lies between: interpolate
                f = (itl_target_s - a.itl_p90_s) / (b.itl_p90_s - a.itl_p90_s)
                best = max(best, a.tokens_per_s + f * (b.tokens_per_s - a.tokens_per_s))
        if pts[-1].itl_p90_s <= itl_target_s:
            best = max(best, pts[-1].tokens_per_s)
        if best == 0.0:  # even one sequence misses the target: plan with single-stream speed
            best = pts[0].tokens_per_s / pts[0].concurrency
        return best

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CapacityProfile:
        try:
            raw = json.loads(text)
            return cls(
                prefill=tuple(PrefillPoint(**p) for p in raw["prefill"]),
                decode=tuple(DecodePoint(**d) for d in raw["decode"]),
                kv_tokens=int(raw["kv_tokens"]),
                notes=raw.get("notes", ""),
                meta=raw.get("meta", {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"not a capacity profile (need prefill, decode, kv_tokens): {e}") from e

    @classmethod
    def load(cls, path: str) -> CapacityProfile:
        with open(path) as f:
            return cls.from_json(f.read())


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + f * (ys[i] - ys[i - 1])
