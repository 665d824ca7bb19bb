"""The key file's format: API keys as data, hashed, with per-key model scopes, limits and flow fields.

Parsing only (the router's bottom layer, so the config loader can read what flow control needs);
the reloading KeyFile and the scope check live in router/tenancy/keyfile.py.

The file (YAML, `gateway.api_keys_file`, e.g. a mounted Secret), reloaded when its stat
(inode, size, mtime) changes, so a Secret update or an edit needs no restart:

    keys:
      - id: team-a                # logs, metrics and usage name the key by its id, never the key
        sha256: 9f86d0...         # hex SHA-256 of the key (or `key: sk-...`, hashed on load)
        models: [smollm2-135m]    # allowed models (base names and adapters); absent: all
        rpm: 60                   # requests per window (window: gateway.quota_window_s, 60 s)
        tpm: 20000                # prompt + completion tokens per window
        monthly_tokens: 5000000   # prompt + completion tokens per calendar month (UTC)
        max_concurrent: 8         # requests (streams) of this key in flight at once, per router replica
        role: admin               # may load/unload LoRA adapters at run time (default: user, may not)
        priority: 0               # flow-control band of its requests without an objective (negative: sheddable)
        max_priority: 10          # the highest band an objective header may ask for (default: priority)
        weight: 1                 # its share in fair queuing against other keys of the same band
        min_request_priority: 0   # body `priority` below this is raised to it (default 0: none ahead of others)

A presented key is hashed and compared with every digest by hmac.compare_digest.

A model outside the key's scope is 404 `model_not_found`, as OpenAI answers for a model a key
cannot see: the answer does not tell a caller which models exist.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any

import yaml

from splitserve.router.config import KEY_ROLES, ApiKey, ConfigError, GatewayConfig

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
KEY_FIELDS = {
    "id",
    "sha256",
    "key",
    "models",
    "rpm",
    "tpm",
    "monthly_tokens",
    "max_concurrent",
    "role",
    "priority",
    "max_priority",
    "weight",
    "min_request_priority",
}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _positive(entry: dict, name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where}.{name}={value!r}: need a positive integer (or leave it out for no limit)")
    return value


def _band(entry: dict, name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or abs(value) > 1_000_000):
        raise ConfigError(
            f"{where}.{name}={value!r}: need an integer from -1000000 to 1000000 "
            "(higher is more important, negative is sheddable)"
        )
    return value


def _flow_fields(entry: dict, where: str) -> dict:
    """The key's flow-control `priority` and `max_priority` (bands: integers, the ceiling not below
    the band), `weight` (a positive number) and `min_request_priority` (the body priority's floor)."""
    priority, max_priority = _band(entry, "priority", where), _band(entry, "max_priority", where)
    if max_priority is not None and max_priority < (priority or 0):
        raise ConfigError(f"{where}.max_priority={max_priority} is below its priority ({priority or 0})")
    floor = entry.get("min_request_priority", 0)
    if not isinstance(floor, int) or isinstance(floor, bool) or not -(2**31) <= floor < 2**31:
        raise ConfigError(f"{where}.min_request_priority={floor!r}: need a 32-bit integer (default 0)")
    weight = entry.get("weight")
    if weight is not None and (
        not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight <= 1_000_000
    ):
        raise ConfigError(f"{where}.weight={weight!r}: need a number above 0 (1 is an equal share)")
    return {
        "priority": priority,
        "max_priority": max_priority,
        "weight": float(weight) if weight is not None else None,
        "min_request_priority": floor,
    }


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
            raise ConfigError(
                f"{where}.id={key_id!r}: need an id of 1-64 letters, digits, '.', '_' or '-', unique in the file"
            )
        ids.add(key_id)
        if ("sha256" in entry) == ("key" in entry):
            raise ConfigError(f"{where}: give exactly one of sha256 (hex digest of the key) or key")
        hexdigest = str(entry["sha256"]).lower() if "sha256" in entry else digest(str(entry["key"]))
        if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
            raise ConfigError(f"{where}.sha256: need 64 hex digits")
        models = entry.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ConfigError(f"{where}.models: need a list of model names")
        role = entry.get("role", "user")
        if role not in KEY_ROLES:
            raise ConfigError(f"{where}.role={role!r}: allowed: {', '.join(KEY_ROLES)}")
        out.append(
            (
                hexdigest,
                ApiKey(
                    key="",
                    name=key_id,
                    models=tuple(models) if models is not None else None,
                    role=role,
                    rpm=_positive(entry, "rpm", where),
                    tpm=_positive(entry, "tpm", where),
                    monthly_tokens=_positive(entry, "monthly_tokens", where),
                    max_concurrent=_positive(entry, "max_concurrent", where),
                    **_flow_fields(entry, where),
                ),
            )
        )
    return tuple(out)


def sets_flow_fields(path: str) -> bool:
    """Does the key file give any key a `priority`, `max_priority` or `weight` (flow control's)?
    An unreadable or invalid file is False here: the gateway reports it when it loads the keys."""
    return any(k.priority is not None or k.max_priority is not None or k.weight is not None for k in read_keys(path))


def read_keys(path: str) -> tuple[ApiKey, ...]:
    """The keys of a key file, or () when it cannot be read or parsed: the gateway reports that
    when it loads the keys (router/tenancy/keyfile.py)."""
    try:
        with open(path, encoding="utf-8") as f:
            return tuple(k for _, k in parse_keys(yaml.safe_load(f), path))
    except (ConfigError, yaml.YAMLError, OSError):
        return ()


def check_shared_quotas(gateway: GatewayConfig, keys: Iterable[ApiKey]) -> None:
    """ConfigError when keys with rpm, tpm or monthly_tokens are served by more than one gateway
    process (`gateway.num_processes`) without a shared quota store: each would count them alone."""
    if gateway.num_processes <= 1 or gateway.rate_limit_redis_url:
        return
    limited = [k.name or "an inline key" for k in keys if k.rpm or k.tpm or k.monthly_tokens]
    if not limited:
        return
    n = gateway.num_processes
    raise ConfigError(
        f"{n} gateway processes (gateway.num_processes) serve keys with rpm, tpm or monthly_tokens "
        f"({', '.join(limited[:5])}{', ...' if len(limited) > 5 else ''}) without a shared quota store: each "
        f"process would count them alone, so a key would get up to {n}x its limits and its usage would reset "
        "on every restart. Set gateway.rate_limit_redis_url (splitserve router --redis-url; in Kubernetes "
        "spec.router.redis), or gateway.num_processes: 1 when this process alone serves these keys"
    )
