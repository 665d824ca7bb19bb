"""A prefix index that survives its store going away (a Redis restart or a network cut).

The index is a placement hint: without it a request is still served, only with worse cache
reuse. So while the store fails, `match` answers "nothing cached anywhere", writes are dropped,
and requests keep flowing instead of failing with 500s; one warning per outage is logged and one
info line when it answers again. Entries written while it was down are missing (fewer hits) or,
for a missed removal, stale (a worker computes the missing blocks itself): never a wrong answer.
A restarted Redis comes back empty and is refilled by new KV events.
"""

from __future__ import annotations

import contextlib
import logging

from splitserve.router.placement.index import PrefixIndex

log = logging.getLogger(__name__)


def _store_errors() -> tuple[type[BaseException], ...]:
    try:
        from redis.exceptions import RedisError
    except ImportError:  # redis is not installed: only OSError can come from a store
        return (OSError,)
    return (RedisError, OSError)


class ResilientIndex(PrefixIndex):
    def __init__(self, inner: PrefixIndex):
        self.inner = inner
        self.errors = _store_errors()
        self.is_down = False
        self.num_failures = 0

    def _failed(self, what: str, exc: BaseException) -> None:
        self.num_failures += 1
        if not self.is_down:
            log.warning("prefix index unavailable (%s: %s); placing without it until it answers", what, exc)
        self.is_down = True

    def _ok(self) -> None:
        if self.is_down:
            log.info("prefix index answers again")
        self.is_down = False

    async def _guarded(self, what: str, call, fallback=None):
        """`call`'s result, or `fallback` (with the outage logged) when the store fails."""
        try:
            out = await call
        except self.errors as exc:
            self._failed(what, exc)
            return fallback
        self._ok()
        return out

    async def apply(self, worker, event) -> None:
        await self._guarded("apply", self.inner.apply(worker, event))

    async def clear(self, worker) -> None:
        await self._guarded("clear", self.inner.clear(worker))

    async def add_speculative(self, worker, hashes) -> None:
        await self._guarded("add_speculative", self.inner.add_speculative(worker, hashes))

    async def match(self, workers, hashes) -> dict[str, int]:
        return await self._guarded("match", self.inner.match(workers, hashes), dict.fromkeys(workers, 0))

    async def num_blocks(self, worker) -> int:
        try:
            return await self.inner.num_blocks(worker)
        except self.errors as exc:
            self._failed("num_blocks", exc)
            return 0

    async def close(self) -> None:
        with contextlib.suppress(*self.errors):
            await self.inner.close()
