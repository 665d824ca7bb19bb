"""Where quota counters live: the two Lua scripts of Redis (admit, settle) and their in-memory
twin for a single router, behind one interface (admit, settle, add_usage, usage_rows, close)."""

from __future__ import annotations

import datetime
import time


def month_of(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, datetime.UTC).strftime("%Y-%m")


# ARGV: window_s, rpm, tpm, reserve, budget, month_ttl_ms (0 = no limit). KEYS: window key prefix, month key.
_ADMIT = """
local window, rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local reserve, budget, month_ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local win = math.floor(now / window)
local key = KEYS[1] .. ':' .. win
local req = tonumber(redis.call('HGET', key, 'req') or '0')
local tok = tonumber(redis.call('HGET', key, 'tok') or '0')
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local reset = tostring((win + 1) * window - now)
local why = ''
if rpm > 0 and req + 1 > rpm then why = 'requests'
elseif tpm > 0 and tok + reserve > tpm then why = 'tokens'
elseif budget > 0 and used + reserve > budget then why = 'budget' end
if why ~= '' then return {0, why, reset, req, tok, used, key} end
redis.call('HINCRBY', key, 'req', 1)
redis.call('HINCRBY', key, 'tok', reserve)
redis.call('PEXPIRE', key, math.ceil(window * 2000))
redis.call('INCRBY', KEYS[2], reserve)
redis.call('PEXPIRE', KEYS[2], month_ttl)
return {1, '', reset, req + 1, tok + reserve, used + reserve, key}
"""
# KEYS: the window key admission used, the month key; ARGV: tokens used minus tokens reserved,
# window_s. Returns the window's state now (for headers): reset seconds, requests, tokens; a
# window that has ended is left alone (its counts no longer limit anyone).
_SETTLE = """
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBY', KEYS[2], ARGV[1]) end
local window = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local win = math.floor(now / window)
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HINCRBY', KEYS[1], 'tok', ARGV[1]) end
local current = KEYS[3] .. ':' .. win
local req = tonumber(redis.call('HGET', current, 'req') or '0')
local tok = tonumber(redis.call('HGET', current, 'tok') or '0')
return {tostring((win + 1) * window - now), req, tok}
"""
MONTH_TTL_MS = 40 * 24 * 3600 * 1000
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


class MemoryQuotaStore:
    """The two scripts above in Python, for a single router without Redis."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self.hashes: dict[str, dict[str, int]] = {}
        self.counters: dict[str, int] = {}

    async def admit(self, window_prefix, month_key, window_s, rpm, tpm, reserve, budget):
        now = self.clock()
        win = int(now // window_s)
        key = f"{window_prefix}:{win}"
        for old in [k for k in self.hashes if k.startswith(window_prefix + ":") and k != key]:
            del self.hashes[old]
        h = self.hashes.setdefault(key, {"req": 0, "tok": 0})
        used = self.counters.get(month_key, 0)
        reset = (win + 1) * window_s - now
        why = (
            "requests"
            if rpm and h["req"] + 1 > rpm
            else "tokens"
            if tpm and h["tok"] + reserve > tpm
            else "budget"
            if budget and used + reserve > budget
            else ""
        )
        if why:
            return False, why, reset, h["req"], h["tok"], used, key
        h["req"] += 1
        h["tok"] += reserve
        self.counters[month_key] = used + reserve
        return True, "", reset, h["req"], h["tok"], used + reserve, key

    async def settle(self, window_key, month_key, delta, window_prefix, window_s):
        if window_key in self.hashes:
            self.hashes[window_key]["tok"] += delta
        if month_key in self.counters:
            self.counters[month_key] += delta
        now = self.clock()
        win = int(now // window_s)
        h = self.hashes.get(f"{window_prefix}:{win}", {"req": 0, "tok": 0})
        return (win + 1) * window_s - now, h["req"], h["tok"]

    async def add_usage(self, hash_key: str, values: dict[str, int]) -> None:
        h = self.hashes.setdefault(hash_key, dict.fromkeys(USAGE_FIELDS, 0))
        for k, v in values.items():
            h[k] += v

    async def usage_rows(self, prefix: str) -> list[tuple[str, dict[str, int]]]:
        return [(k, dict(v)) for k, v in self.hashes.items() if k.startswith(f"{prefix}:usage:")]

    async def close(self) -> None:
        pass


class RedisQuotaStore:
    def __init__(self, url: str):
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(url)
        self._admit = self.redis.register_script(_ADMIT)
        self._settle = self.redis.register_script(_SETTLE)

    async def admit(self, window_prefix, month_key, window_s, rpm, tpm, reserve, budget):
        ok, why, reset, req, tok, used, key = await self._admit(
            keys=[window_prefix, month_key], args=[window_s, rpm or 0, tpm or 0, reserve, budget or 0, MONTH_TTL_MS]
        )
        as_str = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
        return bool(ok), as_str(why), float(as_str(reset)), int(req), int(tok), int(used), as_str(key)

    async def settle(self, window_key, month_key, delta, window_prefix, window_s):
        reset, req, tok = await self._settle(keys=[window_key, month_key, window_prefix], args=[delta, window_s])
        return float(reset.decode() if isinstance(reset, bytes) else reset), int(req), int(tok)

    async def add_usage(self, hash_key: str, values: dict[str, int]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for k, v in values.items():
                pipe.hincrby(hash_key, k, v)
            await pipe.execute()

    async def usage_rows(self, prefix: str) -> list[tuple[str, dict[str, int]]]:
        rows = []
        async for raw in self.redis.scan_iter(match=f"{prefix}:usage:*", count=500):
            values = await self.redis.hgetall(raw)
            rows.append((raw.decode(), {k.decode(): int(v) for k, v in values.items()}))
        return rows

    async def close(self) -> None:
        await self.redis.aclose()
