"""The model runner: turns a SchedulerPlan into tensors, runs the model, samples.

It owns the model, the KV cache tensors and the sampler, and touches no scheduler state:
`execute(plan, rows)` reads the plan and returns a StepResult.

With LoRA adapters in the step (`loras`: req_id -> adapter), each row's adapter is published
on the model's LoraContext for this one forward (platform/lora/batch.py).

On CUDA with triton the model runs its per-layer ops as Triton kernels (kernels/triton_ops.py)
and decode attention splits the context by `choose_num_splits`. With decode graphs enabled
(`enable_decode_graphs`, engine/cuda_graphs.py) a step of plain decodes runs through the graphs'
static buffers, replayed on CUDA; every other step runs eagerly here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch

from splitserve.platform.engine import prompt_logprobs as prompt_lp
from splitserve.platform.engine.cuda_graphs import DecodeGraphs
from splitserve.platform.kernels.dispatch import choose_num_splits, triton_available
from splitserve.platform.lora.adapter import LoraAdapter
from splitserve.platform.lora.batch import LoraContext
from splitserve.platform.models.attention import AttentionMetadata, PrefillChunk
from splitserve.platform.sampling.sampler import Sampler, SamplingRow
from splitserve.platform.sched.plan import ScheduledSeq, SchedulerPlan, StepResult
from splitserve.platform.spec.verify import verify

log = logging.getLogger(__name__)

MAX_RANK_ADAPTERS = 16


class ModelRunner:
    def __init__(
        self, model, kv_caches, block_size: int, device: torch.device, lora_context: LoraContext | None = None
    ):
        self.model = model
        self.lora_context = lora_context
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        self.executor = None  # parallel.executor.TPExecutor on rank 0 of a tensor-parallel group
        self.adapters: dict[str, LoraAdapter] = {}  # a rank > 0's LoRA shards, by lora_id, oldest first
        self.read_lora: Callable[[str, str], LoraAdapter] | None = None  # a rank > 0's adapter reader
        self.kv_shards = None  # a rank > 0's engine.kv_parallel.HeadShards (KV transfer's gathers)
        self._num_sms = 0
        # decoder layer -> KV group (kv/groups.KVLayout.layer_group); used when slices carry group tables
        self.layer_group: tuple[int, ...] = ()
        if model is not None and triton_available(device) and hasattr(model, "use_fused_ops"):
            from splitserve.platform.kernels.triton_ops import TritonOps

            if model.fused_ops is None:
                model.use_fused_ops(TritonOps())
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> DecodeGraphs | None:
        """Run plain decode steps through static buffers per batch bucket (engine/cuda_graphs.py);
        `capture`: record the CUDA graphs now (CUDA only), else the buffers run eagerly."""
        try:
            graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.device, max_num_seqs, max_model_len)
            if capture:
                graphs.capture()
        except Exception:  # serve eagerly rather than not at all; the log says why
            log.exception("CUDA graphs for decode are off; every step runs eagerly (as with --enforce-eager)")
            graphs = None
        self.graphs = graphs
        return graphs

    @torch.inference_mode()
    def execute(
        self,
        plan: SchedulerPlan,
        rows: dict[str, SamplingRow],
        eos_token_ids: Collection[int],
        layer_hook: Callable[[int], None] | None = None,
        loras: dict[str, LoraAdapter] | None = None,
        prompt_logprobs: dict[str, prompt_lp.Want] | None = None,
    ) -> StepResult:
        """`prompt_logprobs`: req_id -> the prompt positions of its slice to score (prompt_logprobs.py).
        Under tensor parallelism the step goes to the other ranks first (`executor`); they run the
        same forward (`follow`) and only this rank samples."""
        seqs = _decodes_first(plan.seqs)
        use_graphs = self.graphs is not None and not loras and layer_hook is None and self.graphs.can_run(seqs, rows)
        prompt_rows = _rows(seqs, prompt_logprobs) if prompt_logprobs else None
        if self.executor is None:
            return self._execute(seqs, rows, eos_token_ids, use_graphs, layer_hook, loras, prompt_rows)
        kv_exports = getattr(layer_hook, "block_ids", ())  # kv_parallel.ExportHook: the ranks gather too
        message = StepMessage(tuple(seqs), use_graphs, prompt_rows, *_lora_keys(seqs, loras), kv_exports)
        self.executor.send_step(message)
        try:
            return self._execute(seqs, rows, eos_token_ids, use_graphs, layer_hook, loras, prompt_rows)
        except Exception as exc:  # a collective failed or timed out: the ranks are out of step for good
            self.executor.fail(f"step failed on rank 0: {type(exc).__name__}: {exc}")
            self.executor.check()
            raise

    def _execute(self, seqs, rows, eos_token_ids, use_graphs, layer_hook, loras, prompt_rows) -> StepResult:
        if use_graphs:
            return self._pick(self.graphs.run(seqs), seqs, rows, eos_token_ids)
        hidden, sample_idx = self._forward(seqs, layer_hook, loras)
        scored = prompt_lp.compute(self.model, hidden, prompt_rows) if prompt_rows else None
        sampling = [s for s in seqs if s.do_sample]
        if not sampling:
            return StepResult(sampled={}, prompt_logprobs=scored)
        result = self._pick(self.model.compute_logits(hidden[sample_idx]), sampling, rows, eos_token_ids)
        embeddings = _embeddings(hidden, sample_idx, sampling, rows)
        if scored is None and embeddings is None:
            return result
        return replace(result, prompt_logprobs=scored, embeddings=embeddings)

    def _forward(self, seqs: list[ScheduledSeq], layer_hook, loras) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over the step's tokens: final hidden states and the rows that sample."""
        input_ids, positions, meta, sample_idx = self._prepare(seqs)
        if loras:
            assert self.lora_context is not None, "adapters in a step need the model's LoraContext"
            self.lora_context.begin([s.num_tokens for s in seqs], [loras.get(s.req_id) for s in seqs], self.device)
        try:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, layer_hook)
        finally:
            if loras:
                self.lora_context.end()
        return hidden, sample_idx

    @torch.inference_mode()
    def follow(self, message: StepMessage) -> None:
        """A rank > 0's step: the forward and the logits rank 0 computes, in the same order, so
        every collective meets its peers; nothing is sampled here."""
        seqs = list(message.seqs)
        if message.use_graphs:
            assert self.graphs is not None, "rank 0 replays decode graphs this rank could not capture"
            self.graphs.run(seqs)
            return
        loras = None
        if message.lora_keys:
            loras = {rid: self._adapter(key, message.lora_sources[key]) for rid, key in message.lora_keys.items()}
        hook = self.kv_shards.export_hook(message.kv_exports) if message.kv_exports else None
        hidden, sample_idx = self._forward(seqs, hook, loras)
        if message.prompt_rows:
            prompt_lp.compute(self.model, hidden, message.prompt_rows)
        if any(s.do_sample for s in seqs):
            self.model.compute_logits(hidden[sample_idx])

    def _adapter(self, lora_id: str, source: tuple[str, str]) -> LoraAdapter:
        """A rank > 0's shard of adapter `lora_id`, read from its folder the first time a step
        uses it (`read_lora`, set by parallel/rank.py); the most recent MAX_RANK_ADAPTERS kept."""
        adapter = self.adapters.pop(lora_id, None)
        if adapter is None:
            adapter = self.read_lora(*source)
            if adapter.lora_id != lora_id:
                raise RuntimeError(f"adapter folder {source[1]} changed since rank 0 read it ({lora_id})")
        self.adapters[lora_id] = adapter
        while len(self.adapters) > MAX_RANK_ADAPTERS:
            self.adapters.pop(next(iter(self.adapters)))
        return adapter

    def _pick(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledSeq],
        rows: dict[str, SamplingRow],
        eos_token_ids: Collection[int],
    ) -> StepResult:
        """Sample each slice's row, or verify a speculating slice's k + 1 rows."""
        if any(s.num_draft_tokens for s in sampling):
            return self._sample_with_verification(logits, sampling, rows, eos_token_ids)
        return self._sample(logits, sampling, rows, eos_token_ids)

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledSeq],
        rows: dict[str, SamplingRow],
        eos_token_ids: Collection[int],
    ) -> StepResult:
        out = self.sampler(logits, [rows[s.req_id] for s in sampling], eos_token_ids)
        ids = [s.req_id for s in sampling]
        return StepResult(
            sampled=dict(zip(ids, out.token_ids)),
            logprobs=dict(zip(ids, out.logprobs)) if out.logprobs is not None else None,
            top_logprobs=dict(zip(ids, out.top_logprobs)) if out.top_logprobs is not None else None,
        )

    def _sample_with_verification(self, logits, sampling: list[ScheduledSeq], rows, eos_token_ids) -> StepResult:
        """A step with speculating requests: each one's k + 1 logit rows are verified
        (platform/spec/verify.py); the other requests sample in one batch as usual."""
        offsets, start = {}, 0
        for s in sampling:
            offsets[s.req_id] = start
            start += s.num_draft_tokens + 1
        plain = [s for s in sampling if not s.num_draft_tokens]
        result = StepResult(sampled={}, spec_tokens={}, spec_logprobs={})
        if plain:
            index = torch.tensor([offsets[s.req_id] for s in plain], device=logits.device)
            out = self.sampler(logits.index_select(0, index), [rows[s.req_id] for s in plain], eos_token_ids)
            ids = [s.req_id for s in plain]
            result.sampled.update(zip(ids, out.token_ids))
            if out.logprobs is not None:
                result = replace(
                    result, logprobs=dict(zip(ids, out.logprobs)), top_logprobs=dict(zip(ids, out.top_logprobs))
                )
        for s in sampling:
            if not s.num_draft_tokens:
                continue
            first = offsets[s.req_id]
            tokens, logprobs = verify(
                self.sampler,
                logits[first : first + s.num_draft_tokens + 1],
                s.token_ids[-s.num_draft_tokens :],
                rows[s.req_id],
                eos_token_ids,
            )
            result.sampled[s.req_id] = tokens[0]
            result.spec_tokens[s.req_id] = tokens
            if logprobs is not None:
                result.spec_logprobs[s.req_id] = logprobs
        return result

    def _prepare(self, seqs: list[ScheduledSeq]):
        bs = self.block_size
        tokens, positions, slots, sample_idx = [], [], [], []
        for seq in seqs:
            start = len(tokens)
            tokens.extend(seq.token_ids)
            for pos in range(seq.start_pos, seq.context_len):
                positions.append(pos)
                slots.append(seq.block_ids[pos // bs] * bs + pos % bs)
            if seq.do_sample:  # a verifying slice samples at its last known token and each proposal
                sample_idx.extend(range(start + seq.num_tokens - 1 - seq.num_draft_tokens, start + seq.num_tokens))
        decodes = [s for s in seqs if s.is_decode]
        meta = self._metadata(seqs, decodes, slots)
        if seqs and seqs[0].group_block_ids is not None:
            meta.layer_metas = self._group_metadata(seqs, meta)
        dev = self.device
        return (
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(sample_idx, dtype=torch.long, device=dev),
        )

    def _metadata(self, seqs: list[ScheduledSeq], decodes: list[ScheduledSeq], slots: list[int]) -> AttentionMetadata:
        """The attention metadata of a step whose slices read `block_ids` (slots: theirs)."""
        num_decodes = sum(s.num_tokens for s in decodes)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=num_decodes,
            decode_block_table=None,
            decode_mask=None,
            prefills=self._prefill_chunks(seqs[len(decodes) :], num_decodes),
        )
        if num_decodes:
            meta.decode_block_table, meta.decode_mask, meta.decode_context_lens = self._decode_tables(decodes)
            if self._num_sms:
                meta.decode_num_splits = choose_num_splits(
                    num_decodes, self.model.config.num_kv_heads, self._num_sms, max(s.context_len for s in decodes)
                )
        return meta

    def _group_metadata(self, seqs: list[ScheduledSeq], meta: AttentionMetadata) -> tuple[AttentionMetadata, ...]:
        """Per decoder layer, the metadata of its KV group (platform/kv/groups.py): each group's
        slices read that group's block table; group 0's is `meta` itself."""
        bs = self.block_size
        metas = [meta]
        for g in range(1, len(seqs[0].group_block_ids)):
            group_seqs = [replace(s, block_ids=s.group_block_ids[g]) for s in seqs]
            slots = [s.block_ids[p // bs] * bs + p % bs for s in group_seqs for p in range(s.start_pos, s.context_len)]
            metas.append(self._metadata(group_seqs, [s for s in group_seqs if s.is_decode], slots))
        return tuple(metas[g] for g in self.layer_group)

    def _decode_tables(self, seqs: list[ScheduledSeq]):
        """One row per decode token: its sequence's block table and its own causal context length
        (a verifying slice's token i sees positions up to start_pos + i)."""
        bs = self.block_size
        lens = [s.start_pos + i + 1 for s in seqs for i in range(s.num_tokens)]
        width = -(-max(lens) // bs)
        table = []
        for s in seqs:
            row = list(s.block_ids[:width])
            table += [row + [0] * (width - len(row))] * s.num_tokens
        ctx = torch.tensor(lens, device=self.device)
        mask = torch.arange(width * bs, device=self.device)[None, :] < ctx[:, None]
        return torch.tensor(table, dtype=torch.long, device=self.device), mask, ctx

    def _prefill_chunks(self, seqs: list[ScheduledSeq], offset: int) -> list[PrefillChunk]:
        chunks = []
        q_start = offset
        for seq in seqs:
            table = mask = None
            if seq.start_pos > 0:
                n_blocks = -(-seq.context_len // self.block_size)
                table = torch.tensor(seq.block_ids[:n_blocks], dtype=torch.long, device=self.device)
                # query i (absolute position start_pos + i) sees keys 0..start_pos + i
                mask = torch.ones(seq.num_tokens, seq.context_len, dtype=torch.bool, device=self.device).tril(
                    seq.start_pos
                )
            chunks.append(PrefillChunk(q_start, seq.num_tokens, seq.start_pos, table, mask))
            q_start += seq.num_tokens
        return chunks


@dataclass(frozen=True)
class StepMessage:
    """What rank 0 sends the other ranks of a tensor-parallel group for one step: the slices
    (decodes first, as executed), whether the step replays decode graphs, the prompt-logprob
    rows (each adds logits gathers), each slice's adapter (by lora_id) and the block ids of each
    KV export (the ranks gather their heads of them after every layer, engine/kv_parallel.py)."""

    seqs: tuple[ScheduledSeq, ...]
    use_graphs: bool
    prompt_rows: dict | None
    lora_keys: dict[str, str] | None  # req_id -> lora_id
    lora_sources: dict[str, tuple[str, str]] | None  # lora_id -> (name, folder), to read it once
    kv_exports: tuple[tuple[int, ...], ...] = ()


def _lora_keys(seqs: list[ScheduledSeq], loras: dict[str, LoraAdapter] | None):
    if not loras:
        return None, None
    used = [loras[s.req_id] for s in seqs if s.req_id in loras]
    return (
        {s.req_id: loras[s.req_id].lora_id for s in seqs if s.req_id in loras},
        {a.lora_id: (a.name, a.path) for a in used},
    )


def _embeddings(
    hidden: torch.Tensor, sample_idx: torch.Tensor, sampling: list[ScheduledSeq], rows: dict[str, SamplingRow]
) -> dict[str, list[float]] | None:
    """Last-token pooling for the requests with params.embed whose prompt ends in this step: the
    final-norm hidden state of the prompt's last token, L2-normalized in float32. `sample_idx`
    holds each sampling slice's rows in order (a verifying slice has num_draft_tokens + 1, its
    last known token first)."""
    picked, offset = [], 0
    for s in sampling:
        row = rows[s.req_id]
        if row.params.embed and s.context_len == len(row.prompt_token_ids):
            picked.append((s.req_id, offset))
        offset += s.num_draft_tokens + 1
    if not picked:
        return None
    index = sample_idx[torch.tensor([o for _, o in picked], device=sample_idx.device)]
    vectors = torch.nn.functional.normalize(hidden[index].float(), dim=-1).tolist()
    return {req_id: v for (req_id, _), v in zip(picked, vectors)}


def _rows(seqs: list[ScheduledSeq], wants: dict[str, prompt_lp.Want]) -> dict[str, tuple[int, prompt_lp.Want]]:
    """Each wanted slice's first row in the step's flat batch (the order _prepare lays it out)."""
    rows, offset = {}, 0
    for seq in seqs:
        if seq.req_id in wants:
            rows[seq.req_id] = (offset, wants[seq.req_id])
        offset += seq.num_tokens
    return rows


def _decodes_first(seqs) -> list[ScheduledSeq]:
    """Decode slices first (batched decode attention, one row per token), then prefill chunks.
    On a CPU a step of decode slices only, verifying ones included, runs as one call of the fused
    decode kernel (kernels/cpu_decode.c)."""
    return [s for s in seqs if s.is_decode] + [s for s in seqs if not s.is_decode]
