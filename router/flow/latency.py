"""The running cap per decode worker, derived from the step time the router sees there.

Without an explicit `max_running_per_worker`, flow control caps each decode worker by latency:

1. Measure. Every token message of a running stream after the first arrives one engine step after
   the previous one, so the gap divided by the tokens it carried is the worker's step time at the
   batch it ran (n: the requests running there, the larger of the router's own count and the
   worker's report). `StepFit.observe` keeps an exponentially weighted least-squares line
   t(n) = a + b*n over these samples (each new sample weighs 1, older ones decay by `DECAY`),
   so it follows the worker as its load and the machine change.
2. Target. A request that joins the batch makes every running stream's next step t(n+1). The
   target is `(1 + latency_slack) * t(1)`: an interactive request's step may be at most that much
   slower than on an idle worker (`itl_target_s`, when set, is an absolute target instead).
3. Cap. n_max is the largest n with t(n) <= target (a + b*n against the target, b clamped to >= 0,
   so a worker whose step hardly grows with the batch, a GPU, gets a large cap). Bands below
   `reserved_min_band` may run n_max - 1 (at least 1) and the bands at or above it one more: the
   interactive request that arrives while the worker is at its cap starts at once, at a step time
   within the target.
4. Explore. Until the samples span two batch sizes (their weighted variance of n is below
   `MIN_SPREAD`) the line is unknown: n_max is then two above the largest batch seen, so the
   bands below the reserved ones may run one more than was seen and the cap climbs until the fit
   can tell. A fitted cap is kept within twice the largest batch seen:
   the line is trusted only a little beyond where it was measured.

An explicit `max_running_per_worker` turns all of this off (docs/router.md, "Flow control").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY = 0.995  # per sample: ~200 samples of memory, a few seconds of a busy worker
MIN_SPREAD = 0.05  # weighted variance of n below which the slope is unknown
STEPS_PER_LEVEL = 8  # steps measured at a batch size before the cap may pass it
MAX_CAP = 1024


@dataclass
class StepFit:
    """Weighted sums of one worker's (n, step seconds) samples, and the line through them."""

    s0: float = 0.0  # sum of weights
    s1: float = 0.0  # weighted sum of n
    s2: float = 0.0  # of n^2
    sy: float = 0.0  # of step seconds
    sny: float = 0.0  # of n * step seconds
    max_n: int = 0  # the largest batch measured for STEPS_PER_LEVEL steps
    num_samples_at: dict[int, int] = field(default_factory=dict)  # batch -> samples, up to max_n + 1

    def observe(self, num_running: int, step_s: float) -> None:
        if num_running < 1 or not math.isfinite(step_s) or step_s <= 0:
            return
        self.s0, self.s1, self.s2 = self.s0 * DECAY + 1, self.s1 * DECAY + num_running, self.s2 * DECAY + num_running**2
        self.sy, self.sny = self.sy * DECAY + step_s, self.sny * DECAY + num_running * step_s
        if num_running > self.max_n:
            count = self.num_samples_at[num_running] = self.num_samples_at.get(num_running, 0) + 1
            if count >= STEPS_PER_LEVEL * num_running:  # each step yields one sample per running stream
                self.max_n = num_running
                self.num_samples_at = {n: c for n, c in self.num_samples_at.items() if n > num_running}

    def line(self) -> tuple[float, float] | None:
        """(a, b) of t(n) = a + b*n, or None while the samples do not span two batch sizes."""
        if self.s0 <= 0:
            return None
        mean_n = self.s1 / self.s0
        spread = self.s2 / self.s0 - mean_n**2
        if spread < MIN_SPREAD:
            return None
        b = max(0.0, (self.sny / self.s0 - mean_n * self.sy / self.s0) / spread)
        a = self.sy / self.s0 - b * mean_n
        if a < 0:  # noise tilted the line past the origin: a step costs at least nothing at n = 0
            return 0.0, self.sny / self.s2
        return a, b

    def max_running(self, slack: float, itl_target_s: float = 0.0) -> int:
        """n_max: the largest batch whose step stays within the target (rule 2, 3 and 4)."""
        explore = self.max_n + 2
        fit = self.line()
        if fit is None:
            return explore
        a, b = fit
        target = itl_target_s if itl_target_s > 0 else (1.0 + slack) * (a + b)
        if b <= 0:
            n = MAX_CAP
        else:
            n = math.floor((target - a) / b + 1e-9)
        return max(1, min(n, explore, MAX_CAP))


def band_limit(max_running: int, is_reserved_band: bool) -> int:
    """The running limit of a band on a worker whose latency cap is `max_running` (rule 3)."""
    batch = max(1, max_running - 1)
    return batch + 1 if is_reserved_band else batch
