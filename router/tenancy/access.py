"""Who may call the gateway and how often (the first gates of admission: router/tenancy/admission.py).

- API keys (optional): with keys configured, every /v1 call needs `Authorization: Bearer KEY`
  (401 otherwise). Keys are compared in constant time; logs and metrics use the key's name.
- Admin scope: with keys configured, runtime LoRA load and unload need a key with role `admin`
  (403 otherwise), and a `lora_path` must lie under `gateway.lora_roots` (403 otherwise; no roots:
  no runtime loads). An open gateway (no keys) keeps both open, as it keeps everything open.
- /metrics (every tenant's token counts and flows) needs role `admin` or `metrics` (a scraper's
  key, which may read /metrics and call nothing else: 403 on /v1); a user key gets 403.
- Rate limits: a token bucket per key (one shared bucket when no keys are configured):
  `burst` tokens, refilled at `rate_per_s`; a request takes one token or gets 429 with
  Retry-After = seconds until the next token. In Redis (one atomic Lua script, Redis' own clock,
  so router replicas share the buckets) when a URL is configured, else in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from splitserve.router.config import ApiKey, GatewayConfig
from splitserve.router.errors import APIError

ANONYMOUS = ApiKey(key="", name="anonymous")


def key_label(key: ApiKey) -> str:
    """How logs, metrics and bucket names refer to a key: its name, or a digest (never the key)."""
    return key.name or "key-" + hashlib.sha256(key.key.encode()).hexdigest()[:12]


class Authenticator:
    """Keys from the config (plain, `--api-key`) and from a key file (hashed, reloaded on change)."""

    def __init__(self, keys: tuple[ApiKey, ...], key_file: str = "", check=None):
        from splitserve.router.tenancy.keyfile import KeyFile

        self.keys = keys
        self.key_file = KeyFile(key_file, check) if key_file else None

    @property
    def is_open(self) -> bool:
        """No keys configured: every caller is ANONYMOUS."""
        return not self.keys and self.key_file is None

    def check(self, authorization: str | None) -> ApiKey:
        if self.is_open:
            return ANONYMOUS
        if not authorization:
            raise APIError(
                401, "missing API key: send the header 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key"
            )
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer":
            for key in self.keys:
                if hmac.compare_digest(token.encode(), key.key.encode()):
                    return key
            found = self.key_file.lookup(token) if self.key_file is not None and token else None
            if found is not None:
                return found
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")


def check_admin(auth: Authenticator, key: ApiKey) -> None:
    """403 unless the gateway is open or `key` has role admin (router/config/ ApiKey)."""
    if not auth.is_open and key.role != "admin":
        raise APIError(
            403,
            f"this call needs an API key with role admin; the key {key_label(key)} has role "
            f"{key.role} (set `role: admin` on it in the key file)",
            code="permission_denied",
        )


def check_metrics_reader(auth: Authenticator, key: ApiKey) -> None:
    """403 unless the gateway is open or `key` may read /metrics (role admin or metrics)."""
    if not auth.is_open and key.role not in ("admin", "metrics"):
        raise APIError(
            403,
            f"/metrics shows every tenant's usage: it needs an API key with role admin or metrics; the key "
            f"{key_label(key)} has role {key.role} (or set gateway.public_metrics)",
            code="permission_denied",
        )


def check_api_caller(key: ApiKey) -> None:
    """403 for a `metrics` key on the /v1 API: it may only read /metrics."""
    if key.role == "metrics":
        raise APIError(
            403, f"the key {key_label(key)} has role metrics: it may read /metrics only", code="permission_denied"
        )


def check_lora_path(auth: Authenticator, roots: tuple[str, ...], lora_path: str) -> str:
    """The resolved `lora_path` when it lies under one of `roots`; 403 otherwise (see the module doc)."""
    import os

    if not roots:
        if auth.is_open:
            return lora_path
        raise APIError(
            403,
            "runtime LoRA loading is off: start the router with --lora-roots DIR[,DIR] "
            "(gateway.lora_roots) naming the folders adapters may be loaded from",
            param="lora_path",
            code="permission_denied",
        )
    resolved = os.path.realpath(lora_path)
    for root in roots:
        base = os.path.realpath(root)
        if resolved == base or resolved.startswith(base.rstrip(os.sep) + os.sep):
            return resolved
    raise APIError(
        403,
        f"lora_path {lora_path!r} is outside the allowed folders (--lora-roots): {', '.join(roots)}",
        param="lora_path",
        code="permission_denied",
    )


class MemoryBuckets:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    async def take(self, identity: str, rate: float, burst: int) -> float:
        """0 if a token was taken, else seconds until one is available."""
        now = self.clock()
        tokens, then = self._buckets.get(identity, (float(burst), now))
        tokens = min(float(burst), tokens + (now - then) * rate)
        if tokens >= 1:
            self._buckets[identity] = (tokens - 1, now)
            return 0.0
        self._buckets[identity] = (tokens, now)
        return (1 - tokens) / rate

    async def close(self) -> None:
        pass


_TAKE = """
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(state[1]), tonumber(state[2])
if tokens == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + (now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RedisBuckets:
    def __init__(self, url: str, key_prefix: str = "splitserve"):
        import redis.asyncio as aioredis

        self.redis = aioredis.from_url(url)
        self.prefix = key_prefix
        self._script = self.redis.register_script(_TAKE)

    async def take(self, identity: str, rate: float, burst: int) -> float:
        return float(await self._script(keys=[f"{self.prefix}:ratelimit:{identity}"], args=[rate, burst]))

    async def close(self) -> None:
        await self.redis.aclose()


class RateLimiter:
    def __init__(self, config: GatewayConfig, key_prefix: str = "splitserve"):
        self.config = config
        self.buckets = (
            RedisBuckets(config.rate_limit_redis_url, key_prefix) if config.rate_limit_redis_url else MemoryBuckets()
        )

    async def check(self, key: ApiKey) -> None:
        rate = key.rate_per_s if key.rate_per_s is not None else self.config.rate_per_s
        burst = key.burst if key.burst is not None else (self.config.burst or max(1, int(rate)))
        if not rate:
            return
        label = key_label(key)
        wait = await self.buckets.take(label, rate, burst)
        if wait > 0:
            raise APIError(
                429,
                f"rate limit reached for {label}: {rate:g} requests/s, burst {burst}; retry after {wait:.2f} s",
                code="rate_limit_exceeded",
                retry_after_s=wait,
            )
