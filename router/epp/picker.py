"""The router's placement as an Endpoint Picker: one request's headers and body in, a pick out.

    body -> the prompt's token ids (the gateway's own prompt rendering) -> block hashes
    -> Placer.place over the decode workers that have a sidecar endpoint (and are in the
       gateway's subset hint, when it sends one) -> Pick(endpoint, prefill worker)

This is the only module of the EPP that touches the router's internals (Router, Placer, the
prompt rendering), so a change of their layout changes its imports and nothing else.

A body the EPP cannot read (not JSON, not an OpenAI request, a prompt the tokenizer refuses) is
still placed, by load alone: the sidecar answers it with the gateway's own error. The pick holds
an assignment in the pool (a pending request on the decode worker, and its prefill tokens on the
prefill worker) until `first_token` and `finish`, so a burst does not pile onto one worker
before its load reports catch up.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from splitserve.router.api.prompts import prepare_chat, prepare_completion
from splitserve.router.api.schemas import ChatCompletionRequest, CompletionRequest
from splitserve.router.epp.endpoints import EndpointMap
from splitserve.router.errors import APIError, NoWorkerError
from splitserve.router.placement.placer import PlacementRequest
from splitserve.router.placement.pool import Assignment
from splitserve.router.router import Router

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass
class Pick:
    endpoint: str  # the decode worker's sidecar, host:port
    decode: str  # the decode worker's gRPC address
    prefill: str = ""  # a prefill worker's gRPC address, "" for a local prefill
    num_prompt_tokens: int = 0
    num_cached_blocks: int = 0
    assignment: Assignment | None = None


class Picker:
    def __init__(self, router: Router, endpoints: EndpointMap):
        self.router = router
        self.endpoints = endpoints

    async def pick(self, path: str, body: bytes, subset: set[str] | None = None) -> Pick:
        """NoWorkerError when no decode worker with an endpoint (in the subset) can serve."""
        token_ids, lora_name = self._prompt(path, body)
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
        )

    def first_token(self, pick: Pick) -> None:
        if pick.assignment is not None:
            self.router.pool.first_token(pick.assignment)

    def finish(self, pick: Pick) -> None:
        if pick.assignment is not None:
            self.router.pool.finish(pick.assignment)

    def _excluded(self, subset: set[str] | None) -> frozenset[str]:
        """Decode workers the gateway cannot reach: no sidecar endpoint, or outside its subset."""
        out = set()
        for w in self.router.pool.decode_workers():
            endpoint = self.endpoints.endpoint(w.address)
            if endpoint is None or (subset is not None and endpoint not in subset):
                out.add(w.address)
        if subset is not None and len(out) == len(self.router.pool.decode_workers()):
            raise NoWorkerError(f"no decode worker's endpoint is in the gateway's subset ({len(subset)} endpoints)")
        return frozenset(out)

    def _prompt(self, path: str, body: bytes) -> tuple[list[int], str | None]:
        """The first prompt's token ids and the LoRA adapter the model names; ([], None) if unreadable."""
        if path not in (CHAT_PATH, COMPLETIONS_PATH) or not body:
            return [], None
        is_chat = path == CHAT_PATH
        try:
            data = json.loads(body)
            request = ChatCompletionRequest.model_validate(data) if is_chat else CompletionRequest.model_validate(data)
            prepare = prepare_chat if is_chat else prepare_completion
            prepared = prepare(request, "epp", "epp", self.router.tokenizer, self.router.config.max_model_len)
        except (ValueError, ValidationError, APIError) as exc:
            log.info("placing an unreadable %s body by load alone: %s", path, str(exc)[:200])
            return [], None
        model = request.model
        lora_name = (
            model
            if model not in self.router.config.served_model_names and model in self.router.adapters.names()
            else None
        )
        return list(prepared.jobs[0].prompt_token_ids) if prepared.jobs else [], lora_name
