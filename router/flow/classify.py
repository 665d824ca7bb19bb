"""Which band and which flow a request belongs to (pure: headers, key and model in, numbers out).

Everything that decides a request's standing comes from its API key, which the operator wrote;
the client's headers can only ask for less, or for what the key allows.

Band (GIE's priority; higher is more important, negative is sheddable):
1. the base: the default objective of the requested model (config `default_objectives`), else
   the key's `priority`, else 0;
2. the objective named in the `x-gateway-inference-objective` header (config `objectives`) moves
   it: down freely, up only as far as the key's `max_priority` (default: the base itself, so a
   header never raises a key that was not given the right to). A key set sheddable stays
   sheddable whatever it sends.

Flow (the tenant fair queuing shares between): the API key's id; a keyless request (an open
gateway) is its client's address. The `x-gateway-inference-fairness-id` header names a sub-flow
*under* the key: it takes turns with the key's other sub-flows inside the key's own queue
(router/flow/fairness.py) and is never another tenant's flow. The weight is the key's `weight`
(default 1), so a key can change only its own share.

The body's `priority` orders requests within a flow (lower first, vLLM's meaning) and goes on to
the engine, which orders a band's requests by it across tenants: it is clamped to the key's
`min_request_priority` (default 0) first, so a tenant can put its own requests later, never ahead
of another's (`clamp_priority`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.errors import APIError

if TYPE_CHECKING:
    from splitserve.router.config import ApiKey

FLOW_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,128}")
ANONYMOUS_FLOW = "anonymous"


@dataclass(frozen=True)
class FlowClass:
    band: int
    flow_id: str  # the tenant: the key's id (a keyless request: its client's address)
    weight: float
    sub_flow: str = ""  # the fairness header's id, inside the tenant's flow ("" without one)
    tenant_label: str = ANONYMOUS_FLOW  # the metrics label: a key id, never a client's string


def band_of(config: FlowControlConfig, headers: Mapping[str, str], model: str, key: ApiKey) -> int:
    """The request's band: the key's (or the model's) base, moved by the objective header down, or
    up to the key's max_priority; APIError 400 for an objective the config does not declare."""
    default = config.default_objectives.get(model)
    if default is not None:
        base = config.objectives[default]
    else:
        base = key.priority if key.priority is not None else 0
    objective = headers.get(config.objective_header)
    if not objective:
        return base
    if objective not in config.objectives:
        allowed = ", ".join(sorted(config.objectives)) or "none are configured"
        raise APIError(
            400,
            f"objective {objective!r} (header {config.objective_header}) is unknown; allowed: {allowed}",
            param=config.objective_header,
            code="unknown_objective",
        )
    ceiling = max(base, key.max_priority) if key.max_priority is not None else base
    return min(config.objectives[objective], ceiling)


def classify(
    config: FlowControlConfig, headers: Mapping[str, str], model: str, key: ApiKey, client: str = ""
) -> FlowClass:
    """The request's band, flow and weight; APIError 400 for an unknown objective or a bad flow id."""
    sub_flow = headers.get(config.fairness_header)
    if sub_flow is not None and not FLOW_ID_PATTERN.fullmatch(sub_flow):
        raise APIError(
            400,
            f"header {config.fairness_header} must be 1-128 printable ASCII characters without spaces",
            param=config.fairness_header,
            code="invalid_fairness_id",
        )
    return FlowClass(
        band=band_of(config, headers, model, key),
        flow_id=key.name or client or ANONYMOUS_FLOW,
        weight=key.weight if key.weight is not None else 1.0,
        sub_flow=sub_flow or "",
        tenant_label=key.name or ANONYMOUS_FLOW,
    )


def clamp_priority(priority: int, key: ApiKey) -> int:
    """The body priority the engine gets: never below the key's `min_request_priority`."""
    return max(priority, key.min_request_priority)
