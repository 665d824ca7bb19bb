"""The router's placement as an Endpoint Picker: one request's headers and body in, a pick out.

    body -> the first prompt's token ids (the gateway's own prompt rendering) -> block hashes
    -> Placer.place over the decode workers whose sidecar endpoint is ready (probes.py) and in
       the gateway's subset hint, when it sends one -> Pick(endpoint, fallbacks, prefill worker)

This is the only module of the EPP that touches the router's internals (Router, Placer, the
prompt rendering), so a change of their layout changes its imports and nothing else.

Bounded work, whoever sent the body. Before anything is parsed, a body over the gateway's
`max_body_bytes` is a 413. The body is parsed off the event loop, one at a time, a large one in a
child process (bodies.py), so the EPP's health and other picks keep flowing while it is read. A
body that is not JSON (also one nested too deep to parse), not an OpenAI request, or over the
gateway's caps (prompts x n over `max_choices_per_request`, the placed prompt over
`max_prompt_tokens_per_request` or the context) is a 400 in OpenAI's error JSON, as the gateway
would answer it. Only the first
prompt is tokenized: placement hashes one prompt, and the sidecar (the gateway's own pipeline)
tokenizes and checks every prompt of the request again.

The pick holds an assignment in the pool (a pending request on the decode worker, and its
prefill tokens on the prefill worker) until `first_token` and `finish`, so a burst does not pile
onto one worker before its load reports catch up. Its `fallbacks` are the other ready endpoints,
least loaded first: where the gateway retries a failed connection (Envoy's override_host), it
goes to them, in that order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from splitserve.router.api.prompts import prepare_chat, prepare_completion
from splitserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from splitserve.router.epp.bodies import BodyReader, Refusal
from splitserve.router.epp.endpoints import EndpointMap
from splitserve.router.epp.probes import EndpointProbe
from splitserve.router.errors import APIError, NoWorkerError, bad_request
from splitserve.router.placement.placer import PlacementRequest
from splitserve.router.placement.pool import Assignment
from splitserve.router.router import Router

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_FALLBACKS = 2


@dataclass
class Pick:
    endpoint: str  # the decode worker's sidecar, host:port
    decode: str  # the decode worker's gRPC address
    prefill: str = ""  # a prefill worker's gRPC address, "" for a local prefill
    num_prompt_tokens: int = 0
    num_cached_blocks: int = 0
    assignment: Assignment | None = None
    fallbacks: list[str] = field(default_factory=list)  # other ready endpoints, for the gateway's retries


class Picker:
    def __init__(self, router: Router, endpoints: EndpointMap, probe: EndpointProbe | None = None):
        """Without `probe`, every endpoint counts as ready (a test with no sidecars)."""
        self.router = router
        self.endpoints = endpoints
        self.probe = probe
        self._bodies = BodyReader()

    def all_endpoints(self) -> set[str]:
        """The endpoints of the pool's decode workers now (what the probe asks)."""
        out = (self.endpoints.endpoint(w.address) for w in self.router.pool.decode_workers())
        return {e for e in out if e is not None}

    async def pick(self, path: str, body: bytes, subset: set[str] | None = None) -> Pick:
        """APIError (400/413) for a body the gateway would refuse; NoWorkerError when no decode
        worker with a ready endpoint (in the subset) can serve."""
        token_ids, lora_name = await self._prompt(path, body)
        hashes = self.router.hasher.hash_blocks(token_ids) if token_ids and lora_name is None else []
        exclude = self._excluded(subset)
        t0 = time.perf_counter()
        decision = await self.router.placer.place(
            PlacementRequest(
                len(token_ids),
                hashes,
                exclude,
                lora_name=lora_name,
                lora_workers=self.router.adapters.workers_with(lora_name) if lora_name else None,
            )
        )
        self.router.metrics.observe_decision(decision, len(hashes), time.perf_counter() - t0)
        prefill = decision.prefill[0] if decision.prefill else ""
        assignment = self.router.pool.assign(decision.decode, prefill, decision.num_uncached_tokens)
        return Pick(
            self.endpoints.endpoint(decision.decode),
            decision.decode,
            prefill,
            len(token_ids),
            decision.num_cached_blocks,
            assignment,
            self._fallbacks(decision.decode, exclude),
        )

    def first_token(self, pick: Pick) -> None:
        if pick.assignment is not None:
            self.router.pool.first_token(pick.assignment)

    def finish(self, pick: Pick) -> None:
        if pick.assignment is not None:
            self.router.pool.finish(pick.assignment)

    def _is_ready(self, endpoint: str | None) -> bool:
        return endpoint is not None and (self.probe is None or self.probe.is_ready(endpoint))

    def _excluded(self, subset: set[str] | None) -> frozenset[str]:
        """Decode workers the gateway cannot reach: no ready sidecar endpoint, or outside its subset."""
        out = set()
        for w in self.router.pool.decode_workers():
            endpoint = self.endpoints.endpoint(w.address)
            if not self._is_ready(endpoint) or (subset is not None and endpoint not in subset):
                out.add(w.address)
        if subset is not None and len(out) == len(self.router.pool.decode_workers()):
            raise NoWorkerError(
                f"no ready decode worker's endpoint is in the gateway's subset ({len(subset)} endpoints)"
            )
        return frozenset(out)

    def _fallbacks(self, picked: str, exclude: frozenset[str]) -> list[str]:
        now = self.router.pool.clock()
        others = [
            w
            for w in self.router.pool.decode_workers()
            if w.address != picked and w.address not in exclude and w.is_healthy(now)
        ]
        others.sort(key=lambda w: (w.num_inflight, w.address))
        return [self.endpoints.endpoint(w.address) for w in others[:MAX_FALLBACKS]]

    async def _prompt(self, path: str, body: bytes) -> tuple[list[int], str | None]:
        """The first prompt's token ids and the LoRA adapter the model names; ([], None) for a
        path placement does not read (placed by load alone)."""
        if path not in (CHAT_PATH, COMPLETIONS_PATH) or not body:
            return [], None
        gateway = self.router.config.gateway
        if len(body) > gateway.max_body_bytes:
            raise APIError(
                413, f"request body too large; the limit is {gateway.max_body_bytes} bytes (gateway.max_body_bytes)"
            )
        placed = await self._bodies.read(body, gateway.max_choices_per_request)
        if isinstance(placed, Refusal):
            raise APIError(placed.status, placed.message, param=placed.param)
        return await asyncio.to_thread(self._tokenize, path == CHAT_PATH, placed)

    def _tokenize(self, is_chat: bool, placed: dict) -> tuple[list[int], str | None]:
        """In a worker thread: validate the cut body, render and tokenize its one prompt."""
        config = self.router.config
        try:
            if is_chat:
                request = ChatCompletionRequest.model_validate(placed)
                prepared = prepare_chat(request, "epp", "epp", self.router.tokenizer, config.max_model_len)
            else:
                request = CompletionRequest.model_validate(placed)
                prepared = prepare_completion(
                    request,
                    "epp",
                    "epp",
                    self.router.tokenizer,
                    config.max_model_len,
                    config.gateway.max_prompt_tokens_per_request,
                )
        except ValidationError as exc:
            raise bad_request(_validation_message(exc)) from None
        except (ValueError, TypeError, RecursionError) as exc:
            log.debug("unreadable body: %s", exc)
            raise bad_request("the request body could not be read as an OpenAI request") from None
        model = request.model
        is_adapter = model not in config.served_model_names and model in self.router.adapters.names()
        token_ids = list(prepared.jobs[0].prompt_token_ids) if prepared.jobs else []
        return token_ids, model if is_adapter else None

    def close(self) -> None:
        self._bodies.close()


def _validation_message(exc: ValidationError) -> str:
    """The fields that are wrong and why, without the values the client sent."""
    parts = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:3]]
    return "invalid request: " + "; ".join(parts)
