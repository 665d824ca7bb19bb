"""Requests in flight per API key on this router replica."""

from __future__ import annotations

from splitserve.router.config import ApiKey
from splitserve.router.errors import APIError
from splitserve.router.tenancy.access import key_label


class Concurrency:
    """Requests in flight per key id on this router replica; over the key's `max_concurrent`
    (else the gateway's `max_concurrent_per_key`, 0 = unbounded): 429 at once."""

    def __init__(self, default: int = 0):
        self.default = default
        self.in_flight: dict[str, int] = {}

    def enter(self, key: ApiKey) -> bool:
        """True when a slot was taken (call leave() once); False when unbounded."""
        limit = key.max_concurrent or self.default
        if not limit:
            return False
        label = key_label(key)
        n = self.in_flight.get(label, 0)
        if n >= limit:
            raise APIError(
                429,
                f"{label} already has {n} requests in flight; the limit is {limit} at once",
                code="too_many_concurrent_requests",
                retry_after_s=1,
            )
        self.in_flight[label] = n + 1
        return True

    def leave(self, key: ApiKey) -> None:
        label = key_label(key)
        n = self.in_flight.get(label, 0) - 1
        if n > 0:
            self.in_flight[label] = n
        else:
            self.in_flight.pop(label, None)
