"""Building the worker protocol's messages (proto/splitserve/v1/worker.proto) from router types.

The SamplingParams mapping is shared with the workers (platform/wire/sampling.py);
tests/platform/test_wire_sampling.py checks it round-trips every field.
"""

from __future__ import annotations

from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.wire import sampling as wire_sampling
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.platform.wire.disaggregation import DISAGGREGATION_MODES as _MODES
from splitserve.router.config.placement import DisaggregationConfig

sampling_params = wire_sampling.to_proto


def generate_request(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    decision,
    disaggregation: DisaggregationConfig,
    resume_output_token_ids: list[int] = (),
    lora_name: str | None = None,
    priority: int = 0,
    band: int = 0,
) -> pb.GenerateRequest:
    """The decode worker's request. With prefill workers listed, the worker re-checks the
    conditional threshold against its exact cache (the router's index may lag by a few events).
    A resume (tokens already streamed by a failed worker) is prefilled by the decode worker, and
    so is a request for prompt logprobs or an embedding (the prompt's logits or hidden states are
    needed where the answer is made). A planned pull (decision.pull) goes along as kv_pull
    under the same conditions, for the base model only."""
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=token_ids,
        params=sampling_params(params),
        resume_output_token_ids=list(resume_output_token_ids),
        lora_name=lora_name or "",
        lora_evict_first=decision.lora_evict_first,
        priority=priority,
        band=band,
    )
    if decision.prefill and not resume_output_token_ids and params.prompt_logprobs is None and not params.embed:
        request.prefill_workers.extend(decision.prefill)
        request.disaggregation = _MODES[disaggregation.mode]
        request.min_prefill_tokens = disaggregation.min_prefill_tokens
    else:
        request.disaggregation = pb.DISAGGREGATION_MODE_NEVER
    pull = getattr(decision, "pull", None)
    if (
        pull is not None
        and not decision.prefill
        and not resume_output_token_ids
        and params.prompt_logprobs is None
        and not params.embed
        and not lora_name
    ):
        request.kv_pull.CopyFrom(pb.KVPull(holder=pull[0], num_blocks=pull[1]))
    return request
