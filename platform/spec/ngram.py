"""N-gram (prompt-lookup) proposals: the continuation of the request's own text.

For n from `max_n` down to `min_n`, take the last n tokens of the request (prompt + output) and
find their most recent earlier occurrence; the up-to-k tokens that followed it are the proposal.
The longest n that matches wins (a longer context predicts better), and among occurrences the
most recent (the nearest copy is the likeliest to continue the same way). Pure Python, torch-free:
it runs for each speculating request once per step, over token ids the scheduler already holds.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens (possibly none)."""
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens < min_n + 1:
        return []
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = list(token_ids[num_tokens - n :])
        first = suffix[0]
        # Scan right to left over starts i with token_ids[i:i+n] == suffix and i + n < num_tokens
        # (the occurrence must be followed by at least one token and not be the suffix itself).
        for i in range(num_tokens - n - 1, -1, -1):
            if token_ids[i] == first and list(token_ids[i : i + n]) == suffix:
                return list(token_ids[i + n : i + n + k])
    return []
