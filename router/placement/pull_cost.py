"""When pulling a prefix's KV from another worker beats computing it (docs/kv-tiers.md).

    pull_s      = num_blocks * block_transfer_s          (ask, copy out, send, write in)
    recompute_s = num_blocks * block_size * prefill_token_s
    pull when num_blocks >= min_blocks and pull_s < recompute_s

Both rates start at the configured constants (measured once on the reference host, see
docs/kv-tiers.md) and follow exponential moving averages of what the workers report: a pull's
duration per block (Timings.kv_pull_s / pulled blocks) and a local prefill's duration per
computed token (first_token_s - queue_s - kv_pull_s over the tokens neither cached nor pulled).
A rate measured on one worker stands for all: the pool is assumed to be one hardware kind.
"""

from __future__ import annotations

from splitserve.router.config.placement import KVPullConfig

ALPHA = 0.2  # weight of each new observation
MIN_PREFILL_TOKENS = 16  # shorter prefills are dominated by fixed costs: not observed


class PullCost:
    def __init__(self, config: KVPullConfig, block_size: int):
        self.config = config
        self.block_size = block_size
        self.block_transfer_s = config.block_transfer_s
        self.prefill_token_s = config.prefill_token_s

    def is_worth(self, num_blocks: int) -> bool:
        if not self.config.enabled or num_blocks < self.config.min_blocks:
            return False
        return num_blocks * self.block_transfer_s < num_blocks * self.block_size * self.prefill_token_s

    def observe_pull(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0 and seconds > 0:
            self.block_transfer_s += ALPHA * (seconds / num_blocks - self.block_transfer_s)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_token_s += ALPHA * (seconds / num_tokens - self.prefill_token_s)

    def observe(self, num_prompt_tokens: int, msg) -> None:
        """Learn from the first GenerateResponse of a request (its usage and timings)."""
        t, u = msg.timings, msg.usage
        if u.pulled_tokens:
            self.observe_pull(u.pulled_tokens // self.block_size, t.kv_pull_s)
        if not msg.prefill_worker and t.first_token_s > 0:
            computed = num_prompt_tokens - u.cached_tokens - u.pulled_tokens
            self.observe_prefill(computed, t.first_token_s - t.queue_s - t.kv_pull_s)
