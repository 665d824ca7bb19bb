"""The engine: requests in, tokens and text out, one `step()` at a time.

    add_request():  InputProcessor validates -> a RequestState -> the scheduler's queue
    step():         plan = scheduler.schedule()        # which tokens of which requests, no tensors
                    result = runner.execute(plan)      # model forward + sampling (+ KV export hook)
                    updates = scheduler.update(plan, result)
                    outputs = OutputProcessor: detokenize + stop strings (may finish requests early)

Each job has its own module: input_processor (validation), kv_connector (the engine's half of
P/D), output_processor (text), load_snapshot (what a worker reports), model_loader. This class
wires them and owns the one dict of per-request state (request_state.RequestState): forgetting a
request is one `pop`.

The engine is single-threaded: one caller drives add_request / abort / step (the async wrapper
does that from its own thread). A bad request raises InvalidRequestError from add_request and
never enters the scheduler, so the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from splitserve.platform.config import EngineConfig
from splitserve.platform.engine import prompt_logprobs
from splitserve.platform.engine.assembly import assemble
from splitserve.platform.engine.kv_handoff import KVExport
from splitserve.platform.engine.load_snapshot import LoadSnapshot, take_snapshot
from splitserve.platform.engine.outputs import RequestOutput, TokenLogprob
from splitserve.platform.engine.request_state import RequestState
from splitserve.platform.errors import InvalidRequestError
from splitserve.platform.hashing import lora_extra_keys
from splitserve.platform.kv.block_pool import KVEvent
from splitserve.platform.lora.adapter import LoraAdapter
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.sampler import skip_draw
from splitserve.platform.sched.plan import StepResult
from splitserve.platform.sched.request import RequestStatus
from splitserve.platform.spec.speculator import token_result

__all__ = ["LLMEngine", "LoadSnapshot"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None):
        """Load the model named by `config` (or reuse `model`, already loaded for the same
        config.model, dtype and device: tests and benchmarks share weights between engines).
        assembly.py builds the parts; this class wires them."""
        self.config = config
        parts = assemble(config, model)
        s = parts.sizing
        self.device, self.dtype, self.model_config = s.device, s.dtype, s.model_config
        self.quantization, self.kv_cache_dtype, self.kv_dtype = s.quantization, s.kv_cache_dtype, s.kv_dtype
        self.tokenizer, self.eos_token_ids, self.max_model_len = s.tokenizer, s.eos_token_ids, s.max_model_len
        self.executor, self._threads_before = parts.executor, parts.threads_before
        self.model, self.pool, self.kv, self.hasher = parts.model, parts.pool, parts.kv, parts.hasher
        self.scheduler, self.kv_tier, self.loras = parts.scheduler, parts.kv_tier, parts.loras
        self.runner, self.kv_connector = parts.runner, parts.kv_connector
        self.inputs, self.outputs = parts.inputs, parts.outputs
        self.speculator = parts.speculator
        self.kv_layout = s.kv_layout  # the KV groups (kv/groups.py)
        self._states: dict[str, RequestState] = {}  # every live request's engine state, by req_id
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    def close(self) -> None:
        """End the other ranks of a tensor-parallel group (idempotent; nothing to do for one
        process). The engine cannot step afterwards."""
        if self.executor is not None:
            self.executor.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    @property
    def grammar_stats(self):
        """The grammar backend's CompileStats, or None before the first constrained request."""
        return self.inputs.grammar_stats

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        req_id: str | None = None,
        arrival_time: float | None = None,
        remote_prefill: bool = False,
        kv_export: KVExport | None = None,
        resume_output_token_ids: Sequence[int] = (),
        lora_name: str | None = None,
        priority: int = 0,
        band: int = 0,
    ) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError.

        `remote_prefill`: the prompt's KV will be written from outside (see kv_connector);
        `kv_export`: export the prompt's KV layer by layer while it is computed;
        `resume_output_token_ids`: continue a request after these tokens, generated by an earlier
        attempt (on another worker), exactly as if this engine had generated them: they count as
        output (max_tokens, min_tokens, penalties; in `output_token_ids`/`num_output_tokens`), a
        seeded generator skips their draws, and new tokens and text are only those after them;
        `lora_name`: run the request through this loaded adapter (AdapterNotFoundError if unknown);
        `priority` / `band`: its place under the "priority" scheduling policy (platform/sched).
        """
        if self.executor is not None:
            self.executor.check()  # TensorParallelError once the group is down
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        state = self.inputs.process(
            req_id,
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            arrival_time=arrival_time,
            remote_prefill=remote_prefill,
            kv_export=kv_export,
            resume_output_token_ids=resume_output_token_ids,
            lora_name=lora_name,
            priority=priority,
            band=band,
        )
        self.outputs.start(state)
        self._states[req_id] = state
        self.scheduler.add_request(state.req)
        return req_id

    def abort(self, req_id: str) -> bool:
        """Stop a request now and free its KV blocks; its final output comes from the next step()."""
        req = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return False
        state = self._states.pop(req_id, None)
        self._aborted.append(self.outputs.finish_aborted(req, state.text if state else ""))
        return True

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request now (after a failed step); returns their final outputs."""
        outputs, self._aborted = self._aborted, []
        for req_id in list(self.scheduler.requests):
            self.abort(req_id)
        outputs += self._aborted
        self._aborted = []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    def has_work(self) -> bool:
        """Whether step() would do anything now (requests waiting for remote KV do not count)."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._aborted)

    def load(self) -> LoadSnapshot:
        """Queue depth and KV usage now (call on the engine thread; the snapshot is immutable)."""
        return take_snapshot(
            self.scheduler,
            self.pool,
            self._states,
            self.loras,
            self.config.lora.max_loras,
            self.speculator.stats if self.speculator else None,
        )

    # -- adapters (platform/lora) ----------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str) -> LoraAdapter:
        """Load (or replace) adapter `name` from a PEFT folder; AdapterError says what is wrong."""
        return self.loras.add(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Refuse new requests for `name`; running ones finish with the weights they started with."""
        self.loras.remove(name)

    def lora_extra_keys(self, lora_name: str | None) -> tuple:
        """The block-hash extra keys of a request for `lora_name` (None: base; unknown: 404 error).
        Reads only the registry's digests, so the worker may call it off the engine thread."""
        if lora_name is None:
            return ()
        return lora_extra_keys(lora_name, self.loras.digest(lora_name))

    # -- the prefix cache --------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        """BlockStored / BlockRemoved / AllCleared since the last call, in order."""
        return self.pool.take_events()

    def num_cached_prefix_tokens(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """How many leading tokens this engine's prefix cache holds (a read-only estimate)."""
        if not self.pool.enable_caching:
            return 0
        return self.kv.num_cached_prefix_tokens(
            len(token_ids), self.hasher.hash_blocks(token_ids, self.lora_extra_keys(lora_name))
        )

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self._states)
        plan = self.scheduler.schedule()
        outputs += [
            self.outputs.kv_ready(req, self.kv_connector.kv_ready(req)) for req in self.scheduler.take_kv_ready()
        ]
        if plan.is_empty:
            return outputs
        states = self._states
        rows = {s.req_id: states[s.req_id].sampling_row() for s in plan.seqs if s.do_sample}
        loras = {s.req_id: states[s.req_id].adapter for s in plan.seqs if states[s.req_id].adapter is not None}
        scoring = {rid: st.prompt_logprobs for rid, st in states.items() if st.prompt_logprobs is not None}
        wants = prompt_logprobs.wants(plan.seqs, scoring) if scoring else None
        self.kv_connector.before_step()  # after the KV copies in flight, on the device (kv_staging.py)
        result = self.runner.execute(
            plan, rows, self.eos_token_ids, self.kv_connector.export_hook(plan, states), loras, wants
        )
        prompt_logprobs.absorb(plan.seqs, result.prompt_logprobs, scoring)
        self._advance_matchers(result.sampled)
        if self.speculator is not None:
            self.speculator.record(plan, result, self._states)
        emitted: dict[str, int] = {}
        for update in self.scheduler.update(plan, result):
            if update.req_id not in states:
                continue  # a stop string ended it at an earlier token of this step
            i = emitted[update.req_id] = emitted.get(update.req_id, -1) + 1
            outputs.append(self._emit(update, token_result(result, update.req_id, i)))
        return outputs

    def _advance_matchers(self, sampled: dict[str, int]) -> None:
        """Feed each constrained request the token it just sampled (EOS ends it; not fed)."""
        for req_id, token_id in sampled.items():
            matcher = self._states[req_id].matcher
            if matcher is not None and token_id not in self.eos_token_ids and not matcher.accept(token_id):
                log.warning("request %s: token %d rejected by its grammar (%s)", req_id, token_id, matcher.error)

    def _emit(self, update, result) -> RequestOutput:
        out = self.outputs.process(self._states[update.req_id], update, result)
        if out.finished and update.finish_status is None:  # a stop string ended it
            self.scheduler.finish_request(update.req_id, RequestStatus.FINISHED_STOPPED)
        if out.finished:
            del self._states[update.req_id]
        return out

    # -- disaggregation (see kv_connector) -------------------------------------------------
    def write_kv_layer(self, block_ids: Sequence[int], layer: int, payload: torch.Tensor) -> None:
        """Copy one received layer into a WAITING_FOR_KV request's blocks (safe from another thread)."""
        self.kv_connector.write_layer(block_ids, layer, payload)

    def complete_remote_prefill(
        self, req_id: str, first_token_id: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput | None:
        """All KV landed and the prefill worker sampled the first token: start decoding."""
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        req = self.scheduler.awaiting_kv.get(req_id)
        if req is None:
            return None
        skip_draw(req.params, self._states[req_id].generator)
        self._advance_matchers({req_id: first_token_id})
        update = self.scheduler.complete_remote_prefill(req_id, first_token_id)
        result = StepResult(
            sampled={req_id: first_token_id},
            logprobs={req_id: logprob.logprob} if logprob else None,
            top_logprobs={req_id: list(logprob.top)} if logprob else None,
        )
        return self._emit(update, result)

    def fallback_to_local_prefill(self, req_id: str, num_computed_tokens: int | None = None) -> bool:
        """The remote prefill failed (or a pull brought the KV of `num_computed_tokens` tokens):
        compute the rest of the prompt locally."""
        return self.scheduler.fallback_to_local_prefill(req_id, num_computed_tokens)

    # -- convenience -----------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion (offline batch); returns the final output of each, in order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            if isinstance(prompt, str):
                ids.append(self.add_request(prompt, p))
            else:
                ids.append(self.add_request(params=p, prompt_token_ids=prompt))
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.req_id] = out
        return [final[i] for i in ids]
