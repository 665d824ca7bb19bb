"""The engine: requests in, tokens and text out, one `step()` at a time.

    step():  plan = scheduler.schedule()        # which tokens of which requests, no tensors
             result = runner.execute(plan)      # model forward + sampling
             updates = scheduler.update(plan, result)
             outputs = detokenize + stop strings (may finish requests early)

The engine is single-threaded: one caller drives add_request / abort / step (the async wrapper
does that from its own thread). A bad request raises InvalidRequestError from add_request and
never enters the scheduler, so the engine keeps serving the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.platform.config import EngineConfig, ModelConfig, resolve_kv_cache_dtype
from splitserve.platform.engine.kv_connector import KVExport, KVReady, export_layer, import_layer
from splitserve.platform.engine.output_processor import OutputProcessor
from splitserve.platform.engine.outputs import RequestOutput, TokenLogprob
from splitserve.platform.engine.runner import ModelRunner
from splitserve.platform.errors import ConfigError, InvalidRequestError
from splitserve.platform.hashing import BlockHasher, lora_extra_keys
from splitserve.platform.kv.block_pool import BlockPool, KVEvent
from splitserve.platform.kv.cache import allocate_kv_cache, plan_num_blocks
from splitserve.platform.kv.manager import KVCacheManager
from splitserve.platform.lora.adapter import LoraAdapter
from splitserve.platform.lora.batch import attach as attach_lora
from splitserve.platform.lora.registry import LoraRegistry
from splitserve.platform.model_source import resolve_model
from splitserve.platform.kernels.cpu_ops import KV_DTYPES, fused_cpu_ops
from splitserve.platform.models import build_model
from splitserve.platform.quant import resolve_quantization
from splitserve.platform.quant.report import describe_kernels, weight_nbytes
from splitserve.platform.sampling.params import SamplingParams
from splitserve.platform.sampling.sampler import SamplingRow, make_generator, skip_draw
from splitserve.platform.sampling.structured import GrammarBackend, Matcher
from splitserve.platform.sched.plan import StepResult
from splitserve.platform.sched.request import Request, RequestStatus
from splitserve.platform.sched.scheduler import Scheduler
from splitserve.platform.tokenizer import load_tokenizer
from splitserve.platform.weights import iter_weights, load_model_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSnapshot:
    num_waiting: int
    num_running: int            # includes requests waiting for remote KV
    kv_usage: float             # 0..1 of blocks in use
    queued_prefill_tokens: int  # prompt tokens admitted or waiting but not yet computed
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int = 0      # of which were found (counted once per request)
    num_prefix_waits: int = 0       # steps requests sat out to reuse a prefix in flight (scheduler rule 3)
    running_loras: tuple[str, ...] = ()   # adapters of running requests (names, sorted)
    waiting_loras: tuple[str, ...] = ()   # adapters of waiting requests (names, sorted)
    max_loras: int = 1
    resident_loras: tuple[str, ...] = ()  # adapters in memory (the --max-cpu-loras LRU; names, sorted)
    lora_adapters: tuple[tuple[str, bytes, str], ...] = ()   # (name, digest, folder) of known adapters

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None):
        """Load the model named by `config` (or reuse `model`, already loaded for the same
        config.model, dtype and device: tests and benchmarks share weights between engines)."""
        self.config = config
        if config.device.num_threads:
            torch.set_num_threads(config.device.num_threads)
        self.device = torch.device(config.device.device)
        self.dtype = DTYPES[config.device.dtype]
        self.quantization = resolve_quantization(config.device.quantization, config.device.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.device, self.quantization)
        self.kv_dtype = DTYPES[self.kv_cache_dtype]
        source = resolve_model(config.model)
        self.model_config: ModelConfig = load_model_config(source)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer is not None
                                       else self.model_config.eos_token_ids)
        t0 = time.perf_counter()
        if model is not None and getattr(model, "quantization", "none") != self.quantization:
            raise ConfigError(f"the model passed in was built with quantization {model.quantization!r}, "
                              f"this engine's config resolves to {self.quantization!r}")
        self.model = model if model is not None else self._load_model(source)
        if self.quantization != "none" and self.kv_dtype in KV_DTYPES:
            # The fast modes also take the fused CPU kernels; "none" stays the torch reference.
            self.model.use_fused_ops(fused_cpu_ops(self.device, self.dtype))
        log.info("loaded %s in %.1f s", config.model, time.perf_counter() - t0)
        self.max_model_len = min(config.scheduler.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        block_size = config.cache.block_size
        num_blocks = plan_num_blocks(config.cache, self.model_config, self.kv_dtype, self.max_model_len, self.device)
        self.pool = BlockPool(num_blocks, enable_caching=config.cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, block_size)
        self.hasher = BlockHasher(self.model_config.model_id, block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, max_loras=config.lora.max_loras)
        kv_caches = allocate_kv_cache(self.model_config, num_blocks, block_size, self.kv_dtype, self.device)
        lora_context, layout = attach_lora(self.model)
        self.loras = LoraRegistry(config.lora, layout, self.dtype)
        self.loras.load_modules()
        self._req_loras: dict[str, LoraAdapter] = {}
        self.runner = ModelRunner(self.model, kv_caches, block_size, self.device, lora_context)
        self.outputs = OutputProcessor(self.tokenizer)
        self._generators: dict[str, torch.Generator | None] = {}
        self._aborted: list[RequestOutput] = []
        self._exports: dict[str, KVExport] = {}
        self._exported: dict[str, int] = {}   # req_id -> prompt blocks exported so far
        self._ids = itertools.count()
        self._matchers: dict[str, Matcher] = {}
        self._grammars: GrammarBackend | None = None

    @property
    def grammars(self) -> GrammarBackend:
        """The grammar backend (built on first use; its compile() is safe from any thread)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.config.model!r} has no tokenizer; constraints need one")
            self._grammars = GrammarBackend(self.tokenizer)
            self.runner.sampler.stats = self._grammars.stats
        return self._grammars

    @property
    def grammar_stats(self):
        """The grammar backend's CompileStats, or None before the first constrained request."""
        return None if self._grammars is None else self._grammars.stats

    def _load_model(self, source):
        with torch.device(self.device):
            model = build_model(self.model_config, self.quantization).to(self.dtype)
        model.load_weights(iter_weights(source, self.model_config, self.dtype, self.device, seed=self.config.seed,
                                        keep_quantized=self.quantization != "none"))
        if self.quantization != "none":
            log.info("quantization %s: %s; weights resident %.0f MB", self.quantization,
                     describe_kernels(model), weight_nbytes(model) / 1e6)
        return model.eval()

    # -- requests --------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: Sequence[int] | None = None, req_id: str | None = None,
                    arrival_time: float | None = None, remote_prefill: bool = False,
                    kv_export: KVExport | None = None, resume_output_token_ids: Sequence[int] = (),
                    lora_name: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError.

        `remote_prefill`: the prompt's KV will be written from outside (see kv_connector);
        `kv_export`: export the prompt's KV layer by layer while it is computed;
        `resume_output_token_ids`: continue a request after these tokens, generated by an earlier
        attempt (on another worker), exactly as if this engine had generated them: they count as
        output (max_tokens, min_tokens, penalties; in `output_token_ids`/`num_output_tokens`), a
        seeded generator skips their draws, and new tokens and text are only those after them;
        `lora_name`: run the request through this loaded adapter (AdapterNotFoundError if unknown).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        token_ids = self._prompt_token_ids(prompt, prompt_token_ids)
        resumed = self._resume_token_ids(resume_output_token_ids, params, len(token_ids))
        if resumed and (remote_prefill or kv_export is not None):
            raise InvalidRequestError("a resumed request is prefilled locally; it cannot use remote prefill or export")
        if (params.prompt_logprobs is not None or params.embed) and remote_prefill:
            raise InvalidRequestError("prompt_logprobs and embed need the prompt computed here; not remote prefill")
        self._checked_ids("logit_bias", [t for t, _ in params.logit_bias])
        matcher = self._matcher(params, resumed)
        adapter = self.loras.get(lora_name) if lora_name is not None else None
        req = Request(req_id, token_ids, params, self.hasher, self.eos_token_ids, arrival_time,
                      remote_prefill=remote_prefill, output_token_ids=resumed,
                      lora_id=adapter.lora_id if adapter else None,
                      extra_keys=lora_extra_keys(lora_name, adapter.digest if adapter else None))
        if kv_export is not None:
            num_prompt_blocks = -(-len(token_ids) // self.config.cache.block_size)
            if not 0 <= kv_export.start_block < num_prompt_blocks:
                raise InvalidRequestError(
                    f"skip_blocks={kv_export.start_block} is invalid for a prompt of {len(token_ids)} tokens; "
                    f"allowed: 0 to {num_prompt_blocks - 1}")
            self._exports[req_id] = kv_export
            self._exported[req_id] = kv_export.start_block
        self._generators[req_id] = make_generator(params.seed, self.device)
        for _ in resumed:
            skip_draw(params, self._generators[req_id])
        if matcher is not None:
            self._matchers[req_id] = matcher
        if adapter is not None:
            self._req_loras[req_id] = adapter
        self.outputs.add(req)
        self.scheduler.add_request(req)
        return req_id

    def _matcher(self, params: SamplingParams, resumed: Sequence[int]) -> Matcher | None:
        """A fresh matcher for a constrained request, advanced past tokens it already generated."""
        if params.structured is None:
            return None
        matcher = self.grammars.matcher(params.structured)
        if not matcher.accept_all([t for t in resumed if t not in self.eos_token_ids]):
            raise InvalidRequestError("resume_output_token_ids do not follow the request's output constraint")
        return matcher

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: Sequence[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt (text) or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.config.model!r} has no tokenizer; pass prompt_token_ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = self._checked_ids("prompt_token_ids", prompt_token_ids)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; allowed: at least 1 token")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                f"allowed: at most {self.max_model_len - 1} prompt tokens (one is needed to generate)")
        return token_ids

    def _checked_ids(self, name: str, token_ids: Sequence[int]) -> list[int]:
        token_ids = list(token_ids)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{name} has invalid ids {bad[:5]}; allowed: integers in [0, {vocab})")
        return token_ids

    def _resume_token_ids(self, token_ids: Sequence[int], params: SamplingParams, num_prompt: int) -> list[int]:
        token_ids = self._checked_ids("resume_output_token_ids", token_ids)
        if not token_ids:
            return token_ids
        if len(token_ids) >= params.max_tokens:
            raise InvalidRequestError(f"{len(token_ids)} resumed tokens leave nothing to generate under "
                                      f"max_tokens={params.max_tokens}; allowed: fewer than max_tokens")
        if num_prompt + len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) and the resumed output ({len(token_ids)}) reach max_model_len "
                f"{self.max_model_len}; allowed: at most {self.max_model_len - 1} tokens together")
        return token_ids

    def abort(self, req_id: str) -> bool:
        """Stop a request now and free its KV blocks; its final output comes from the next step()."""
        req = self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        if req is None:
            return False
        self._forget(req_id)
        self._aborted.append(self.outputs.finish_aborted(req))
        return True

    def _forget(self, req_id: str) -> None:
        self._generators.pop(req_id, None)
        self._exports.pop(req_id, None)
        self._exported.pop(req_id, None)
        self._matchers.pop(req_id, None)
        self._req_loras.pop(req_id, None)

    def _advance_matchers(self, sampled: dict[str, int]) -> None:
        """Feed each constrained request the token it just sampled (EOS ends it; not fed)."""
        for req_id, token_id in sampled.items():
            matcher = self._matchers.get(req_id)
            if matcher is not None and token_id not in self.eos_token_ids and not matcher.accept(token_id):
                log.warning("request %s: token %d rejected by its grammar (%s)", req_id, token_id, matcher.error)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    def load(self) -> LoadSnapshot:
        """Queue depth and KV usage now (call on the engine thread; the snapshot is immutable)."""
        sched = self.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
        queued += sum(r.num_prompt_tokens - r.num_computed_tokens for r in sched.running
                      if r.num_computed_tokens < r.num_prompt_tokens)
        return LoadSnapshot(num_waiting=len(sched.waiting), num_running=len(sched.running) + len(sched.awaiting_kv),
                            kv_usage=self.pool.usage, queued_prefill_tokens=queued,
                            num_free_blocks=self.pool.num_free_blocks, num_total_blocks=self.pool.num_blocks,
                            prefix_cache_queries=sched.stats.num_prefix_query_tokens,
                            prefix_cache_hits=sched.stats.num_prefix_hit_tokens,
                            num_prefix_waits=sched.stats.num_prefix_waits,
                            running_loras=self._lora_names(sched.running), waiting_loras=self._lora_names(sched.waiting),
                            max_loras=self.config.lora.max_loras,
                            resident_loras=tuple(sorted(a.name for a in self.loras.loaded())),
                            lora_adapters=tuple(self.loras.known()))

    def _lora_names(self, reqs) -> tuple[str, ...]:
        return tuple(sorted({self._req_loras[r.req_id].name for r in reqs if r.req_id in self._req_loras}))

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

    def take_kv_events(self) -> list[KVEvent]:
        """BlockStored / BlockRemoved / AllCleared since the last call, in order."""
        return self.pool.take_events()

    def num_cached_prefix_tokens(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """How many leading tokens this engine's prefix cache holds (a read-only estimate)."""
        if not self.pool.enable_caching:
            return 0
        n = 0
        max_blocks = (len(token_ids) - 1) // self.config.cache.block_size
        for block_hash in self.hasher.hash_blocks(token_ids, self.lora_extra_keys(lora_name))[:max_blocks]:
            if not self.pool.peek(block_hash):
                break
            n += self.config.cache.block_size
        return n

    def has_work(self) -> bool:
        """Whether step() would do anything now (requests waiting for remote KV do not count)."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._aborted)

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        outputs += [self.outputs.kv_ready(req, self._kv_ready(req)) for req in self.scheduler.take_kv_ready()]
        if plan.is_empty:
            return outputs
        rows = {s.req_id: self._sampling_row(s.req_id) for s in plan.seqs if s.do_sample}
        loras = {s.req_id: self._req_loras[s.req_id] for s in plan.seqs if s.req_id in self._req_loras}
        wants = self.outputs.prompt_logprobs.wants(plan.seqs)
        result = self.runner.execute(plan, rows, self.eos_token_ids, self._export_hook(plan), loras, wants)
        self.outputs.prompt_logprobs.absorb(plan.seqs, result.prompt_logprobs)
        self._advance_matchers(result.sampled)
        for update in self.scheduler.update(plan, result):
            outputs.append(self._emit(update, result))
        return outputs

    def _emit(self, update, result) -> RequestOutput:
        out = self.outputs.process(update, result)
        if out.finished and update.finish_status is None:  # a stop string ended it
            self.scheduler.finish_request(update.req_id, RequestStatus.FINISHED_STOPPED)
        if out.finished:
            self._forget(update.req_id)
        return out

    # -- disaggregation (see kv_connector) -------------------------------------------------
    def _kv_ready(self, req: Request) -> KVReady:
        return KVReady(tuple(self.kv.block_ids(req.req_id)), req.num_cached_tokens, self.config.cache.block_size)

    def _export_hook(self, plan):
        """A per-layer hook exporting the prompt blocks this step completes, or None.

        A chunk that is not the prompt's last exports the blocks it filled (whole blocks only:
        a block the chunk fills partly goes with the next chunk); the last chunk exports the
        rest, its partial tail block included. So with chunked prefill the first chunks' KV
        travels while later chunks compute.
        """
        bs = self.config.cache.block_size
        exports = []
        for seq in plan.seqs:
            spec = self._exports.get(seq.req_id)
            if spec is None:
                continue
            first = self._exported[seq.req_id]
            end = -(-seq.context_len // bs) if seq.do_sample else seq.context_len // bs
            if end <= first:
                continue
            self._exported[seq.req_id] = end
            ids = torch.tensor(seq.block_ids[first:end], dtype=torch.long, device=self.device)
            exports.append((spec.sink, first - spec.start_block, ids))
        if not exports:
            return None

        def hook(layer: int) -> None:
            for sink, first_block, ids in exports:
                sink(layer, export_layer(self.runner.kv_caches, layer, ids), first_block)
        return hook

    def write_kv_layer(self, block_ids: Sequence[int], layer: int, payload: torch.Tensor) -> None:
        """Copy one received layer (or piece of one) into a WAITING_FOR_KV request's blocks.

        Safe from another thread: those blocks belong to a request no step touches until
        complete_remote_prefill / fallback_to_local_prefill is called on the engine thread.
        """
        import_layer(self.runner.kv_caches, layer, torch.tensor(block_ids, dtype=torch.long, device=self.device),
                     payload.to(self.device))

    def complete_remote_prefill(self, req_id: str, first_token_id: int,
                                logprob: TokenLogprob | None = None) -> RequestOutput | None:
        """All KV landed and the prefill worker sampled the first token: start decoding."""
        if not 0 <= first_token_id < self.model_config.vocab_size:
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        req = self.scheduler.awaiting_kv.get(req_id)
        if req is None:
            return None
        skip_draw(req.params, self._generators.get(req_id))
        self._advance_matchers({req_id: first_token_id})
        update = self.scheduler.complete_remote_prefill(req_id, first_token_id)
        result = StepResult(sampled={req_id: first_token_id},
                            logprobs={req_id: logprob.logprob} if logprob else None,
                            top_logprobs={req_id: list(logprob.top)} if logprob else None)
        return self._emit(update, result)

    def fallback_to_local_prefill(self, req_id: str) -> bool:
        """The remote prefill failed: compute the rest of the prompt locally."""
        return self.scheduler.fallback_to_local_prefill(req_id)

    def _sampling_row(self, req_id: str) -> SamplingRow:
        req = self.scheduler.requests[req_id]
        return SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, self._generators[req_id],
                           self._matchers.get(req_id))

    # -- convenience -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
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
