"""Keys as data: a key file, per-key model scopes, token quotas and usage accounting.

Key file (YAML, `gateway.api_keys_file`, e.g. a mounted Secret), reloaded when its stat
(inode, size, mtime) changes, so a Secret update or an edit needs no restart:

    keys:
      - id: team-a                # logs, metrics and usage name the key by its id, never the key
        sha256: 9f86d0...         # hex SHA-256 of the key (or `key: sk-...`, hashed on load)
        models: [smollm2-135m]    # allowed models (base names and adapters); absent: all
        rpm: 60                   # requests per window (window: gateway.quota_window_s, 60 s)
        tpm: 20000                # prompt + completion tokens per window
        monthly_tokens: 5000000   # prompt + completion tokens per calendar month (UTC)
        max_concurrent: 8         # requests (streams) of this key in flight at once, per router replica

A presented key is hashed and compared with every digest by hmac.compare_digest.

Quota, per key id and fixed window of `window_s` seconds on Redis' clock: admission counts one
request and *reserves* prompt tokens + max_tokens; the end of the request settles the
reservation to the tokens actually used (prompt + completion streamed so far, so a request the
client cut is billed for what it got). Over a limit: 429 with Retry-After = seconds to the
window's end. Both steps are one Lua script each, so router replicas sharing a Redis count
every request once; a replica that dies between the two leaves its reservation in place until
the window expires (an over-count of one request's max_tokens, never a double count).

A model outside the key's scope is 404 `model_not_found`, as OpenAI answers for a model a key
cannot see: the answer does not tell a caller which models exist.

Usage per key id, model and month (requests; prompt, cached and completion tokens) goes to
Prometheus counters and to a Redis hash `<prefix>:usage:<month>:<id>:<model>` (read by
`splitserve usage`).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter

from splitserve.router.config import ApiKey, ConfigError
from splitserve.router.errors import APIError
from splitserve.router.responses import usage

log = logging.getLogger(__name__)

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
KEY_FIELDS = {"id", "sha256", "key", "models", "rpm", "tpm", "monthly_tokens", "max_concurrent"}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _positive(entry: dict, name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}.{name}={value!r}: need a positive integer (or leave it out for no limit)")
    return value


def parse_keys(data: Any, source: str) -> tuple[tuple[str, ApiKey], ...]:
    """(hex digest, key) pairs of a key file's content; raises ConfigError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
        raise ConfigError(f"{source}: need a mapping with a list `keys:`")
    out, ids = [], set()
    for i, entry in enumerate(data["keys"]):
        where = f"{source}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) - KEY_FIELDS:
            raise ConfigError(f"{where}: need a mapping with fields from {sorted(KEY_FIELDS)}")
        key_id = entry.get("id")
        if not isinstance(key_id, str) or not ID_PATTERN.fullmatch(key_id) or key_id in ids:
            raise ConfigError(f"{where}.id={key_id!r}: need an id of 1-64 letters, digits, '.', '_' or '-', "
                              "unique in the file")
        ids.add(key_id)
        if ("sha256" in entry) == ("key" in entry):
            raise ConfigError(f"{where}: give exactly one of sha256 (hex digest of the key) or key")
        hexdigest = str(entry["sha256"]).lower() if "sha256" in entry else digest(str(entry["key"]))
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ConfigError(f"{where}.sha256: need 64 hex digits")
        models = entry.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ConfigError(f"{where}.models: need a list of model names")
        out.append((hexdigest, ApiKey(key="", name=key_id, models=tuple(models) if models is not None else None,
                                      rpm=_positive(entry, "rpm", where), tpm=_positive(entry, "tpm", where),
                                      monthly_tokens=_positive(entry, "monthly_tokens", where),
                                      max_concurrent=_positive(entry, "max_concurrent", where))))
    return tuple(out)


class KeyFile:
    """The keys of one file, re-read whenever the file changes (a bad new file keeps the old keys)."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple | None = None
        self.keys: tuple[tuple[str, ApiKey], ...] = ()
        self.reload_error: str | None = None
        self._maybe_reload(strict=True)

    def _maybe_reload(self, strict: bool = False) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if strict:
                raise ConfigError(f"gateway.api_keys_file={self.path!r}: {exc.strerror}") from None
            return
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                keys = parse_keys(yaml.safe_load(f), self.path)
        except (ConfigError, yaml.YAMLError, OSError) as exc:
            if strict:
                raise ConfigError(str(exc)) from None
            self.reload_error = str(exc)
            return
        self.keys, self._stamp, self.reload_error = keys, stamp, None

    def lookup(self, token: str) -> ApiKey | None:
        self._maybe_reload()
        presented = digest(token).encode()
        found = None
        for hexdigest, key in self.keys:   # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(presented, hexdigest.encode()):
                found = key
        return found


def check_scope(key: ApiKey, model: str) -> None:
    if key.models is not None and model not in key.models:
        raise APIError(404, f"the model {model!r} does not exist or this API key has no access to it",
                       param="model", code="model_not_found")


def month_of(now: float) -> str:
    return datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m")


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
        out.update({"x-ratelimit-limit-requests": str(key.rpm), "x-ratelimit-remaining-requests": str(max(0, key.rpm - req)),
                    "x-ratelimit-reset-requests": f"{reset:.3f}s"})
    if key.tpm:
        out.update({"x-ratelimit-limit-tokens": str(key.tpm), "x-ratelimit-remaining-tokens": str(max(0, key.tpm - tok)),
                    "x-ratelimit-reset-tokens": f"{reset:.3f}s"})
    return out


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
        why = ("requests" if rpm and h["req"] + 1 > rpm else "tokens" if tpm and h["tok"] + reserve > tpm
               else "budget" if budget and used + reserve > budget else "")
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
            keys=[window_prefix, month_key], args=[window_s, rpm or 0, tpm or 0, reserve, budget or 0, MONTH_TTL_MS])
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
        label = key.name or "anonymous"
        n = self.in_flight.get(label, 0)
        if n >= limit:
            raise APIError(429, f"{label} already has {n} requests in flight; the limit is {limit} at once",
                           code="too_many_concurrent_requests", retry_after_s=1)
        self.in_flight[label] = n + 1
        return True

    def leave(self, key: ApiKey) -> None:
        label = key.name or "anonymous"
        n = self.in_flight.get(label, 0) - 1
        if n > 0:
            self.in_flight[label] = n
        else:
            self.in_flight.pop(label, None)


class Quota:
    """Per-key admission (scope, rpm, tpm, monthly budget), settlement and usage accounting."""

    def __init__(self, registry: CollectorRegistry, redis_url: str = "", prefix: str = "splitserve",
                 window_s: float = 60.0, clock=time.time):
        self.store = RedisQuotaStore(redis_url) if redis_url else MemoryQuotaStore(clock)
        self.prefix, self.window_s, self.clock = prefix, window_s, clock
        self.requests = Counter("splitserve_key_requests", "Finished requests per API key id and model",
                                ["key_id", "model"], registry=registry)
        self.tokens = Counter("splitserve_key_tokens", "Tokens per API key id, model and kind "
                              "(prompt, cached, completion)", ["key_id", "model", "kind"], registry=registry)
        self.store_errors = Counter("splitserve_router_quota_store_errors", "Quota or usage operations the "
                                    "store (Redis) could not take; the request went on", ["op"], registry=registry)

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
        admitted = await self._store("admit", self.store.admit(
            f"{self.prefix}:quota:{key.name}", f"{self.prefix}:budget:{month}:{key.name}", self.window_s,
            key.rpm, key.tpm, reserve, key.monthly_tokens))
        if admitted is None:   # the store is unreachable: admitted without limits, nothing to settle
            return grant
        ok, why, reset, req, tok, used, window_key = admitted
        headers = _headers(key, reset, req, tok)
        if not ok:
            if why == "tokens" and reserve > (key.tpm or 0):
                raise APIError(429, f"request too large for {key.name}: prompt + max_tokens = {reserve} tokens, "
                               f"the limit is {key.tpm} tokens per {self.window_s:g} s; lower max_tokens",
                               code="rate_limit_exceeded", retry_after_s=reset, headers=headers)
            what = {"requests": f"{key.rpm} requests", "tokens": f"{key.tpm} tokens"}.get(why)
            if what is None:
                raise APIError(429, f"monthly token budget of {key.name} ({key.monthly_tokens}) is used up "
                               f"({used} used, this request needs {reserve})", code="insufficient_quota",
                               headers=headers)
            raise APIError(429, f"rate limit reached for {key.name}: {what} per {self.window_s:g} s; "
                           f"retry after {reset:.2f} s", code="rate_limit_exceeded", retry_after_s=reset,
                           headers=headers)
        grant.window_key, grant.month_key, grant.headers = window_key, f"{self.prefix}:budget:{month}:{key.name}", headers
        return grant

    async def settle(self, grant: Grant, usage: dict[str, Any]) -> None:
        """Account a finished (or cut) request: `usage` is the OpenAI usage object it earned."""
        if grant.settled:
            return
        grant.settled = True
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        key_id = grant.key.name or "anonymous"
        self.requests.labels(key_id, grant.model).inc()
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            self.tokens.labels(key_id, grant.model, kind).inc(n)
        await self._store("usage", self.store.add_usage(
            f"{self.prefix}:usage:{month_of(self.clock())}:{key_id}:{grant.model}",
            {"requests": 1, "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}))
        await self._settle_window(grant, prompt + completion - grant.reserved)

    async def _settle_window(self, grant: Grant, delta: int) -> None:
        """Move the reservation to the tokens used; the headers then show the window as it is now
        (a whole answer carries these; a stream sent its headers at admission)."""
        if grant.window_key:
            settled = await self._store("settle", self.store.settle(
                grant.window_key, grant.month_key, delta, f"{self.prefix}:quota:{grant.key.name}", self.window_s))
            if settled is not None:
                grant.headers.update(_headers(grant.key, *settled))

    async def release(self, grant: Grant) -> None:
        """Give an admitted request's reservation back without billing it (it never ran)."""
        if not grant.settled:
            grant.settled = True
            await self._settle_window(grant, -grant.reserved)

    async def finish(self, grant: Grant, prepared, choices) -> None:
        """Settle at the end of a request: billed for what its choices got (nothing came: released)."""
        if any(c.last is not None for c in choices):
            await self.settle(grant, usage(prepared, choices))
        else:
            await self.release(grant)

    async def usage_table(self) -> list[dict[str, Any]]:
        """Rows {period, key_id, model, requests, prompt/cached/completion tokens}, sorted."""
        rows = []
        for hash_key, values in await self.store.usage_rows(self.prefix):
            period, rest = hash_key[len(self.prefix) + len(":usage:"):].split(":", 1)
            key_id, model = rest.split(":", 1)
            rows.append({"period": period, "key_id": key_id, "model": model,
                         **{f: values.get(f, 0) for f in USAGE_FIELDS}})
        return sorted(rows, key=lambda r: (r["period"], r["key_id"], r["model"]))

    async def close(self) -> None:
        await self.store.close()
