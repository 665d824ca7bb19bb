"""Which band and which flow a request belongs to (pure: headers, key and model in, numbers out).

Band (GIE's priority; higher is more important, negative is sheddable), the first that applies:
1. the objective named in the `x-gateway-inference-objective` header (config `objectives`);
2. the default objective of the requested model (config `default_objectives`);
3. the key file's `priority` for the API key;
4. 0.

Flow (the tenant fair queuing shares between): the `x-gateway-inference-fairness-id` header,
else the API key's id, else the client's address. Its weight is the key's `weight` (default 1).
The body's `priority` is not the band: it orders requests within a flow (lower first, vLLM's
meaning) and goes on to the engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.errors import APIError

FLOW_ID_PATTERN = re.compile(r"[\x21-\x7e]{1,128}")


@dataclass(frozen=True)
class FlowClass:
    band: int
    flow_id: str
    weight: float


def classify(
    config: FlowControlConfig,
    headers: Mapping[str, str],
    model: str,
    key_id: str = "",
    key_priority: int | None = None,
    key_weight: float | None = None,
    client: str = "",
) -> FlowClass:
    """The request's band, flow and weight; APIError 400 for an unknown objective or a bad flow id."""
    objective = headers.get(config.objective_header) or config.default_objectives.get(model)
    if objective:
        if objective not in config.objectives:
            allowed = ", ".join(sorted(config.objectives)) or "none are configured"
            raise APIError(
                400,
                f"objective {objective!r} (header {config.objective_header}) is unknown; allowed: {allowed}",
                param=config.objective_header,
                code="unknown_objective",
            )
        band = config.objectives[objective]
    elif key_priority is not None:
        band = key_priority
    else:
        band = 0
    flow_id = headers.get(config.fairness_header)
    if flow_id is not None and not FLOW_ID_PATTERN.fullmatch(flow_id):
        raise APIError(
            400,
            f"header {config.fairness_header} must be 1-128 printable ASCII characters without spaces",
            param=config.fairness_header,
            code="invalid_fairness_id",
        )
    return FlowClass(
        band=band,
        flow_id=flow_id or key_id or client or "anonymous",
        weight=key_weight if key_weight is not None else 1.0,
    )
