"""Per-key quota: admission against rpm, tpm and the monthly budget, settlement and usage accounting.


Quota, per key id and fixed window of `window_s` seconds on Redis' clock: admission counts one
request and *reserves* prompt tokens + max_tokens; the end of the request settles the
reservation to the tokens actually used (prompt + completion streamed so far, so a request the
client cut is billed for what it got). Over a limit: 429 with Retry-After = seconds to the
window's end. Both steps are one Lua script each, so router replicas sharing a Redis count
every request once; a replica that dies between the two leaves its reservation in place until
the window expires (an over-count of one request's max_tokens, never a double count).

Usage per key id, model and month (requests; prompt, cached and completion tokens) goes to
Prometheus counters and to a Redis hash `<prefix>:usage:<month>:<id>:<model>` (read by
`splitserve usage`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from splitserve.router.config import ApiKey
from splitserve.router.errors import APIError
from splitserve.router.tenancy.access import key_label
from splitserve.router.tenancy.keyfile import check_scope
from splitserve.router.tenancy.quota_store import USAGE_FIELDS, MemoryQuotaStore, RedisQuotaStore, month_of
from splitserve.router.usage import Usage

log = logging.getLogger(__name__)


@dataclass
class Grant:
    """An admitted request's reservation: the headers it answers with, and how to settle it."""

    key: ApiKey
    model: str
    reserved: int
    window_key: str = ""
    month_key: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


def _headers(key: ApiKey, reset: float, req: int, tok: int) -> dict[str, str]:
    out = {}
    if key.rpm:
        out.update(
            {
                "x-ratelimit-limit-requests": str(key.rpm),
                "x-ratelimit-remaining-requests": str(max(0, key.rpm - req)),
                "x-ratelimit-reset-requests": f"{reset:.3f}s",
            }
        )
    if key.tpm:
        out.update(
            {
                "x-ratelimit-limit-tokens": str(key.tpm),
                "x-ratelimit-remaining-tokens": str(max(0, key.tpm - tok)),
                "x-ratelimit-reset-tokens": f"{reset:.3f}s",
            }
        )
    return out


class Quota:
    """Per-key admission (scope, rpm, tpm, monthly budget), settlement and usage accounting."""

    def __init__(
        self,
        registry: CollectorRegistry,
        redis_url: str = "",
        prefix: str = "splitserve",
        window_s: float = 60.0,
        clock=time.time,
    ):
        self.store = RedisQuotaStore(redis_url) if redis_url else MemoryQuotaStore(clock)
        self.prefix, self.window_s, self.clock = prefix, window_s, clock
        self.requests = Counter(
            "splitserve_key_requests",
            "Finished requests per API key id and model",
            ["key_id", "model"],
            registry=registry,
        )
        self.tokens = Counter(
            "splitserve_key_tokens",
            "Tokens per API key id, model and kind (prompt, cached, completion)",
            ["key_id", "model", "kind"],
            registry=registry,
        )
        self.store_errors = Counter(
            "splitserve_router_quota_store_errors",
            "Quota or usage operations the store (Redis) could not take; the request went on",
            ["op"],
            registry=registry,
        )

    async def _store(self, op: str, call, fallback=None):
        """A store call that never fails a request: while Redis is unreachable (a restart, an
        outage) limits are not enforced and usage reaches only the Prometheus counters, with a
        warning and splitserve_router_quota_store_errors_total{op} counting each miss. Failing
        open keeps serving through a store outage, as Envoy's rate-limit filter does by default
        (docs/security.md)."""
        try:
            return await call
        except (OSError, ConnectionError, TimeoutError) as exc:
            self._store_failed(op, exc)
        except Exception as exc:  # redis.exceptions.RedisError and its ConnectionError
            if type(exc).__module__.split(".")[0] != "redis":
                raise
            self._store_failed(op, exc)
        return fallback

    def _store_failed(self, op: str, exc: BaseException) -> None:
        self.store_errors.labels(op).inc()
        log.warning("quota store unreachable during %s (%s); the request goes on without it", op, exc)

    def needed(self, key: ApiKey) -> bool:
        return bool(key.rpm or key.tpm or key.monthly_tokens)

    async def admit(self, key: ApiKey, model: str, reserve: int) -> Grant:
        check_scope(key, model)
        grant = Grant(key, model, reserve)
        if not self.needed(key):
            return grant
        month = month_of(self.clock())
        admitted = await self._store(
            "admit",
            self.store.admit(
                f"{self.prefix}:quota:{key_label(key)}",
                f"{self.prefix}:budget:{month}:{key_label(key)}",
                self.window_s,
                key.rpm,
                key.tpm,
                reserve,
                key.monthly_tokens,
            ),
        )
        if admitted is None:  # the store is unreachable: admitted without limits, nothing to settle
            return grant
        ok, why, reset, req, tok, used, window_key = admitted
        headers = _headers(key, reset, req, tok)
        if not ok:
            if why == "tokens" and reserve > (key.tpm or 0):
                raise APIError(
                    429,
                    f"request too large for {key_label(key)}: prompt + max_tokens = {reserve} tokens, "
                    f"the limit is {key.tpm} tokens per {self.window_s:g} s; lower max_tokens",
                    code="rate_limit_exceeded",
                    retry_after_s=reset,
                    headers=headers,
                )
            what = {"requests": f"{key.rpm} requests", "tokens": f"{key.tpm} tokens"}.get(why)
            if what is None:
                raise APIError(
                    429,
                    f"monthly token budget of {key_label(key)} ({key.monthly_tokens}) is used up "
                    f"({used} used, this request needs {reserve})",
                    code="insufficient_quota",
                    headers=headers,
                )
            raise APIError(
                429,
                f"rate limit reached for {key_label(key)}: {what} per {self.window_s:g} s; retry after {reset:.2f} s",
                code="rate_limit_exceeded",
                retry_after_s=reset,
                headers=headers,
            )
        grant.window_key, grant.headers = window_key, headers
        grant.month_key = f"{self.prefix}:budget:{month}:{key_label(key)}"
        return grant

    async def settle(self, grant: Grant, usage: Usage) -> None:
        """Account a finished (or cut) request for what it used (the pipeline's Usage record)."""
        if grant.settled:
            return
        grant.settled = True
        prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
        key_id = key_label(grant.key)
        self.requests.labels(key_id, grant.model).inc()
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            self.tokens.labels(key_id, grant.model, kind).inc(n)
        await self._store(
            "usage",
            self.store.add_usage(
                f"{self.prefix}:usage:{month_of(self.clock())}:{key_id}:{grant.model}",
                {"requests": 1, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion},
            ),
        )
        await self._settle_window(grant, prompt + completion - grant.reserved)

    async def _settle_window(self, grant: Grant, delta: int) -> None:
        """Move the reservation to the tokens used; the headers then show the window as it is now
        (a whole answer carries these; a stream sent its headers at admission)."""
        if grant.window_key:
            settled = await self._store(
                "settle",
                self.store.settle(
                    grant.window_key,
                    grant.month_key,
                    delta,
                    f"{self.prefix}:quota:{key_label(grant.key)}",
                    self.window_s,
                ),
            )
            if settled is not None:
                grant.headers.update(_headers(grant.key, *settled))

    async def release(self, grant: Grant) -> None:
        """Give an admitted request's reservation back without billing it (it never ran)."""
        if not grant.settled:
            grant.settled = True
            await self._settle_window(grant, -grant.reserved)

    async def usage_table(self) -> list[dict[str, Any]]:
        """Rows {period, key_id, model, requests, prompt/cached/completion tokens}, sorted."""
        rows = []
        for hash_key, values in await self.store.usage_rows(self.prefix):
            period, rest = hash_key[len(self.prefix) + len(":usage:") :].split(":", 1)
            key_id, model = rest.split(":", 1)
            rows.append(
                {"period": period, "key_id": key_id, "model": model, **{f: values.get(f, 0) for f in USAGE_FIELDS}}
            )
        return sorted(rows, key=lambda r: (r["period"], r["key_id"], r["model"]))

    async def close(self) -> None:
        await self.store.close()
