"""Reading the router's config: a YAML or JSON file, or a mapping, plus dotted overrides, into the
dataclasses of router/config/, each section checked for unknown keys.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import yaml

from splitserve.platform.errors import ConfigError
from splitserve.router.config import (
    AdaptersConfig,
    ApiKey,
    DisaggregationConfig,
    DiscoveryConfig,
    GatewayConfig,
    IndexConfig,
    KVPullConfig,
    PlacementConfig,
    ProfileConfig,
    RouterConfig,
    ScorerSpec,
    default_decode_profile,
    default_prefill_profile,
)
from splitserve.router.config.flow import from_mapping as _flow_control
from splitserve.router.config.keys import check_shared_quotas, read_keys, sets_flow_fields

log = logging.getLogger(__name__)


def read_mapping(path: str, what: str) -> dict:
    """A YAML (or JSON) file holding a mapping; a ConfigError naming `what` otherwise.
    Also used by rayserve/config.py."""
    if not os.path.isfile(path):
        raise ConfigError(f"{what} file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the {what} must be a mapping, got {type(data).__name__}")
    return data


def load_config(path: str | None = None, **overrides) -> RouterConfig:
    """The file's settings (YAML or JSON; none: defaults) with `overrides` applied on top.
    Overrides use dotted section names: load_config(p, **{"gateway.port": 8001})."""
    data = read_mapping(path, "router config") if path else {}
    for dotted, value in overrides.items():
        if value is None:
            continue
        *sections, key = dotted.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[key] = value
    return from_dict(data)


def from_dict(data: dict) -> RouterConfig:
    sections = {
        "gateway": _gateway,
        "discovery": _discovery,
        "index": _index,
        "placement": _placement,
        "adapters": lambda d: AdaptersConfig(**checked_mapping(d, AdaptersConfig, "adapters")),
        "flow_control": _flow_control,
    }
    kwargs = {}
    for key, value in checked_mapping(data, RouterConfig, "").items():
        kwargs[key] = sections[key](value) if key in sections else value
    config = RouterConfig(**kwargs)
    gateway = config.gateway
    check_shared_quotas(gateway, gateway.api_keys + (read_keys(gateway.api_keys_file) if gateway.api_keys_file else ()))
    return resolve_flow_control(config)


def resolve_flow_control(config: RouterConfig) -> RouterConfig:
    """Flow control left unset (enabled None) is on when the key file sets a key's priority,
    max_priority or weight, which only flow control reads; set off explicitly, such a key file
    is warned about, since its priorities then do nothing."""
    flow, keys_file = config.flow_control, config.gateway.api_keys_file
    sets_priorities = bool(keys_file) and sets_flow_fields(keys_file)
    if flow.enabled is None:
        if sets_priorities:
            log.info("flow control is on: the key file %s sets priorities or weights", keys_file)
        return dataclasses.replace(config, flow_control=dataclasses.replace(flow, enabled=sets_priorities))
    if sets_priorities and not flow.enabled:
        log.warning(
            "the key file %s sets priorities or weights, but flow control is off "
            "(flow_control.enabled: false): they do nothing; leave it unset or pass --flow-control",
            keys_file,
        )
    return config


def checked_mapping(data, cls, where: str) -> dict:
    """`data` if it is a mapping whose keys are all fields of the dataclass `cls`; otherwise a
    ConfigError naming `where`, the unknown keys and the allowed ones. Also used by rayserve/config.py."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'router config'} must be a mapping, got {type(data).__name__}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'the router config'}; allowed: {', '.join(allowed)}")
    return data


def _tuple_fields(data: dict, *names: str) -> dict:
    out = dict(data)
    for name in names:
        if name in out:
            value = out[name]
            out[name] = tuple(value.split(",") if isinstance(value, str) else value)
    return out


def _gateway(data) -> GatewayConfig:
    data = _tuple_fields(checked_mapping(data, GatewayConfig, "gateway"), "served_model_names", "lora_roots")
    keys = data.get("api_keys", ())
    if isinstance(keys, str):
        keys = [k for k in keys.split(",") if k]
    data["api_keys"] = tuple(
        ApiKey(**_tuple_fields(checked_mapping(k, ApiKey, "gateway.api_keys[]"), "models"))
        if isinstance(k, dict)
        else ApiKey(key=str(k))
        for k in keys
    )
    if data.get("rate_limit_redis_url"):
        data["rate_limit_redis_url"] = with_password(data["rate_limit_redis_url"], os.environ.get("REDIS_PASSWORD", ""))
    return GatewayConfig(**data)


def _discovery(data) -> DiscoveryConfig:
    return DiscoveryConfig(
        **_tuple_fields(checked_mapping(data, DiscoveryConfig, "discovery"), "workers", "k8s_services")
    )


def _index(data) -> IndexConfig:
    data = dict(checked_mapping(data, IndexConfig, "index"))
    if data.get("redis_url"):
        data["redis_url"] = with_password(data["redis_url"], os.environ.get("REDIS_PASSWORD", ""))
    return IndexConfig(**data)


def with_password(url: str, password: str) -> str:
    """Put REDIS_PASSWORD (the operator mounts it from a Secret) into a redis URL that has none,
    so the password never sits in the ConfigMap."""
    scheme, sep, rest = url.partition("://")
    if not password or not sep or "@" in rest:
        return url
    from urllib.parse import quote

    return f"{scheme}://:{quote(password, safe='')}@{rest}"


def _placement(data) -> PlacementConfig:
    data = checked_mapping(data, PlacementConfig, "placement")
    kwargs = {}
    if "disaggregation" in data:
        kwargs["disaggregation"] = DisaggregationConfig(
            **checked_mapping(data["disaggregation"], DisaggregationConfig, "placement.disaggregation")
        )
    if "kv_pull" in data:
        kwargs["kv_pull"] = KVPullConfig(**checked_mapping(data["kv_pull"], KVPullConfig, "placement.kv_pull"))
    for role, default in (("decode", default_decode_profile()), ("prefill", default_prefill_profile())):
        if role in data:
            kwargs[role] = _profile(data[role], default, f"placement.{role}")
    return PlacementConfig(**kwargs)


def _profile(data, default: ProfileConfig, where: str) -> ProfileConfig:
    data = checked_mapping(data, ProfileConfig, where)
    scorers = default.scorers
    if "scorers" in data:
        if not isinstance(data["scorers"], list):
            raise ConfigError(f"{where}.scorers must be a list of {{name, weight, params}}")
        scorers = tuple(ScorerSpec(**checked_mapping(s, ScorerSpec, f"{where}.scorers[]")) for s in data["scorers"])
    return ProfileConfig(
        filters=tuple(data.get("filters", default.filters)),
        scorers=scorers,
        filter_params=dict(data.get("filter_params", default.filter_params)),
    )
