"""Everything the engine keeps about one live request, in one object.

The scheduler's `Request` (token ids, progress, status) is one part of it; the rest is what the
engine's other jobs need: the sampling generator and grammar matcher (the step), the LoRA adapter
(the step and the load report), the KV export (the KV connector), and the detokenizer, stop-string
matcher and text so far (output processing). The engine keeps one `RequestState` per live
request in one dict, so forgetting a request is a single `pop` that cannot miss a field, and a
feature that needs per-request state adds a field here rather than another dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.platform.engine.detokenizer import IncrementalDetokenizer
from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.engine.prompt_logprobs import Collected
from splitserve.platform.engine.stop import StopStringMatcher
from splitserve.platform.lora.adapter import LoraAdapter
from splitserve.platform.sampling.sampler import SamplingRow
from splitserve.platform.sampling.structured import Matcher
from splitserve.platform.sched.request import Request


@dataclass(eq=False)
class RequestState:
    req: Request
    generator: torch.Generator | None  # seeded per request; None draws from the global RNG
    matcher: Matcher | None = None  # the grammar state of a constrained request
    adapter: LoraAdapter | None = None  # the LoRA adapter it runs through; None: the base model
    export: KVExport | None = None  # where its prompt KV goes (a prefill worker's request)
    num_exported_blocks: int = 0  # prompt blocks exported so far, counted from block 0
    detok: IncrementalDetokenizer | None = None  # set by OutputProcessor.start (None: no tokenizer)
    stops: StopStringMatcher | None = None
    text: str = ""  # the output text emitted so far
    num_spec_proposed: int = 0  # speculative tokens proposed for it, and accepted
    num_spec_accepted: int = 0
    num_spec_rounds: int = 0  # verification steps that carried its proposals
    spec_k: int = 0  # proposals it may carry next step (spec/speculator.py); 0: not yet set
    prompt_logprobs: Collected | None = None  # its prompt logprobs so far, if it asked (prompt_logprobs.py)

    @property
    def req_id(self) -> str:
        return self.req.req_id

    def sampling_row(self) -> SamplingRow:
        req = self.req
        return SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, self.generator, self.matcher)
