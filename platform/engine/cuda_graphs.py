"""CUDA graphs for pure-decode steps: batch-size buckets, static buffers, capture, replay.

A decode step of an 8B model launches hundreds of small kernels; at batch 1 the host takes longer
to launch them than the GPU takes to run them. A CUDA graph records the step's kernels once and
replays them with one launch. A graph replays fixed addresses and shapes, so:

- **Buckets.** One graph per row count in `capture_sizes(max_num_seqs)`: 1, 2, 4, then every
  multiple of 8 below 256, then every 16th up to max_num_seqs (vLLM's list), plus max_num_seqs
  itself so every batch the scheduler can form has a bucket. A step of B decode rows runs the
  smallest bucket >= B (`bucket_for`); the B..bucket rows are padding. A row is one token: a
  plain decode has one, a speculating request's verification slice 1 + k (its last token and
  its proposals, each row attending causally up to its own position), so speculative decoding
  replays the same graphs (a step with more rows than the largest bucket runs eagerly).
- **Static buffers** (`DecodeBuffers`), allocated once for the largest bucket: input ids,
  positions, slot mapping, context lengths (one flat int64 tensor, so a step copies them in one
  host-to-device transfer) and the block tables [max_num_seqs, ceil(max_model_len / block_size)]
  (a second transfer, of the bucket's rows only). `fill` writes a step's rows and the padding:
  token 0 at position 0, slot -1 (the KV write skips it), context length 1 over block 0, so a
  padded row reads finite values and writes nothing; rows are independent in every kernel of the
  forward, so padding never changes a real row.
- **Split count.** Decode attention splits the context (kernels/triton_split_decode.py) by a
  count fixed per bucket from the bucket, the kv heads, the SM count and max_model_len, never
  from this step's contexts, so the captured grid fits any step.
- **Capture** at start-up (`capture()`), largest bucket first, all graphs sharing one memory pool;
  each bucket runs once eagerly first, which compiles the Triton kernels. The graph covers the
  forward and the LM head: its output is static logits [bucket, vocab]; sampling runs after
  the replay on the real rows, outside the graph: its inputs (temperature, top-k/p, min-p, the
  rows' random numbers) go to the device in one copy per step (sampling/device_sampler.py), so
  penalties, seeds and truncation run with graphs on.
- **Eager replay.** `run()` without captured graphs (on a CPU, or before capture) runs the very
  same forward over the same static buffers eagerly. That is how the tests check bucketing,
  padding and buffer filling on CPU: a padded batch must give the same tokens as the plain runner.

What stays eager: prefill and mixed steps, steps with a KV export hook (P/D prefill), steps with
LoRA adapters, and steps with a structured-output (grammar) row (`can_run`), as does everything
with `--enforce-eager`. On CUDA the graphs need the Triton per-layer kernels (TritonOps; a model
family without them serves eagerly); on a CPU the eager replay needs the torch path (the fused CPU
kernels do not skip padded slots).

Memory: the graphs' pool holds the largest bucket's activations; `graph_memory_bytes` estimates
it before the KV cache is sized, so the KV budget leaves room for it (kv/cache.plan_num_blocks),
and `capture()` records what the capture really took (`captured_bytes`): the device's free
memory before minus after (`torch.cuda.mem_get_info`), measured with the caching allocator's
idle blocks handed back on both sides. Entering `torch.cuda.graph` empties that cache, so a
"before" read while the allocator still held idle blocks made the figure negative (seen on an
H100: "captured ... in -30 MiB"); `capture_cost` never reports less than 0.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from splitserve.platform.models.attention import AttentionMetadata, TritonAttentionMetadata
from splitserve.platform.sched.plan import ScheduledSeq

log = logging.getLogger(__name__)

PAD_SLOT = -1
# Fixed cost per captured graph besides the shared pool (driver-side graph objects, workspace).
GRAPH_OVERHEAD_BYTES = 2 * 1024**2


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch-size buckets for `max_num_seqs`, ascending (see the module doc)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs + 1, 16)]
    sizes = [s for s in sizes if s <= max_num_seqs]
    return sizes if sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding `batch` rows; None when the batch is larger than every bucket."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if batch >= 1 and i < len(sizes) else None


def graph_memory_bytes(
    max_num_seqs: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    dtype_bytes: int,
    max_splits: int = 16,
) -> int:
    """Estimate of the graph pool plus per-graph overhead: the largest bucket's live activations at
    the widest point of a layer (residual, normed input, fused qkv, attention output and split
    partials, gate|up and its product) plus the float logits, doubled for the allocator's rounding
    and the tensors freed late; and GRAPH_OVERHEAD_BYTES per bucket."""
    n = max_num_seqs
    per_row = dtype_bytes * (
        3 * hidden_size
        + (num_heads + 2 * num_kv_heads) * head_dim
        + num_heads * head_dim
        + 3 * intermediate_size
        + vocab_size
    )
    partials = 4 * num_heads * max_splits * (head_dim + 1)
    return 2 * n * (per_row + partials) + GRAPH_OVERHEAD_BYTES * len(capture_sizes(max_num_seqs))


class DecodeBuffers:
    """The static inputs of the decode graphs, sized for `max_rows` rows (see the module doc)."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device):
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.device = device
        pin = device.type == "cuda"
        self._host = torch.zeros(4 * max_rows, dtype=torch.long, pin_memory=pin)
        self._host_tables = torch.zeros(max_rows, max_blocks, dtype=torch.long, pin_memory=pin)
        self.flat = torch.zeros(4 * max_rows, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens = self.flat.view(4, max_rows)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.long, device=device)
        # The torch attention path (CPU) masks by position; the Triton kernels read context_lens.
        self.decode_mask = (
            torch.zeros(max_rows, max_blocks * block_size, dtype=torch.bool, device=device)
            if device.type == "cpu"
            else None
        )

    def fill(self, seqs: Sequence[ScheduledSeq], bucket: int) -> None:
        """Write the rows of `seqs` (decode slices: one row per token, so a verifying slice of
        1 + k tokens fills k + 1 rows, each with its own position and causal context) and pad up
        to `bucket` rows."""
        n, bs = num_rows(seqs), self.block_size
        assert 1 <= n <= bucket <= self.max_rows and all(s.is_decode for s in seqs)
        host = self._host.view(4, self.max_rows)
        ids, pos, slots, ctx = ([0] * bucket for _ in range(4))
        block_ids: list[int] = []
        counts: list[int] = []
        row = 0
        for seq in seqs:
            for i, token in enumerate(seq.token_ids):
                p = seq.start_pos + i
                ids[row], pos[row], ctx[row] = token, p, p + 1
                slots[row] = seq.block_ids[p // bs] * bs + p % bs
                counts.append(-(-(p + 1) // bs))
                block_ids += seq.block_ids[: counts[-1]]
                row += 1
        tables = self._host_tables
        tables[:bucket] = 0
        counts_t = torch.tensor(counts)
        starts = torch.repeat_interleave(counts_t.cumsum(0) - counts_t, counts_t)
        cols = torch.arange(len(block_ids)) - starts
        rows = torch.repeat_interleave(torch.arange(n), counts_t)
        tables.view(-1)[rows * self.max_blocks + cols] = torch.tensor(block_ids, dtype=torch.long)
        slots[n:] = [PAD_SLOT] * (bucket - n)
        ctx[n:] = [1] * (bucket - n)
        host[:, :bucket] = torch.tensor([ids, pos, slots, ctx], dtype=torch.long)
        self.flat.copy_(self._host, non_blocking=True)  # one transfer for the four vectors
        self.block_tables[:bucket].copy_(tables[:bucket], non_blocking=True)
        if self.decode_mask is not None:
            width = self.decode_mask.shape[1]
            positions = torch.arange(width, device=self.device)[None, :]
            self.decode_mask[:bucket] = positions < self.context_lens[:bucket, None]

    def fill_padding(self, bucket: int) -> None:
        """Every one of `bucket` rows padding: what a capture records depends on no step's values."""
        host = self._host.view(4, self.max_rows)
        host[:, :bucket] = torch.tensor([[0], [0], [PAD_SLOT], [1]], dtype=torch.long).expand(4, bucket)
        self.flat.copy_(self._host)
        self.block_tables[:bucket] = 0
        if self.decode_mask is not None:
            self.decode_mask[:bucket] = torch.arange(self.decode_mask.shape[1], device=self.device)[None, :] < 1

    def metadata(self, bucket: int, num_splits: int) -> AttentionMetadata:
        """The attention metadata of a `bucket`-row decode step, as views of the static buffers."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=bucket,
            decode_block_table=self.block_tables[:bucket],
            decode_mask=None if self.decode_mask is None else self.decode_mask[:bucket],
            prefills=[],
            decode_context_lens=self.context_lens[:bucket],
            decode_num_splits=num_splits,
        )
        if self.device.type == "cuda":
            meta.triton = TritonAttentionMetadata(self.context_lens[:bucket], None, None, None, 0)
        return meta


class DecodeGraphs:
    """Decode steps through the buckets' static buffers: graph replay once `capture()` ran, else the
    same forward run eagerly. Owned by the ModelRunner; `run()` returns logits of the real rows."""

    def __init__(self, model, kv_caches, block_size: int, device: torch.device, max_num_seqs: int, max_model_len: int):
        ops = getattr(model, "fused_ops", None)
        if not (getattr(ops, "attends_paged", False) or (ops is None and device.type == "cpu")):
            raise ValueError(
                "decode graphs need the Triton ops (CUDA) or the torch path (CPU): other paths "
                "would write the padded rows' KV (slot -1) out of bounds"
            )
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeBuffers(self.sizes[-1], -(-max_model_len // block_size), block_size, device)
        self.num_splits = {n: _num_splits(model, n, device, max_model_len) for n in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.captured_bytes = 0
        self.free_bytes_around_capture: tuple[int, int] | None = None  # (before, after), CUDA only

    def can_run(self, seqs: Sequence[ScheduledSeq], rows) -> bool:
        """A step of decode slices (single tokens, or a last token and its proposals) that all
        sample, without a grammar, whose rows fit the buckets."""
        return (
            bucket_for(num_rows(seqs), self.sizes) is not None
            and all(s.is_decode and s.do_sample for s in seqs)
            and all(getattr(rows[s.req_id], "matcher", None) is None for s in seqs)
        )

    @torch.inference_mode()
    def run(self, seqs: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Logits [rows, vocab] of a decode step, one row per token of `seqs` in order (can_run must hold)."""
        n = num_rows(seqs)
        bucket = bucket_for(n, self.sizes)
        self.buffers.fill(seqs, bucket)
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n]
        graph.replay()
        return self._logits[bucket][:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        b = self.buffers
        meta = b.metadata(bucket, self.num_splits[bucket])
        hidden = self.model(b.input_ids[:bucket], b.positions[:bucket], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, into one shared memory pool (CUDA only)."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: "before" without idle blocks
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            self.buffers.fill_padding(bucket)
            self._forward(bucket)  # compiles the Triton kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[bucket] = self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up forwards' blocks, outside the graphs' pool
        free_after = torch.cuda.mem_get_info(self.device)[0]
        self.free_bytes_around_capture = (free_before, free_after)
        self.captured_bytes = capture_cost(free_before, free_after)
        log.info(
            "captured %d decode graphs (batch %d..%d) in %.0f MiB",
            len(self._graphs),
            self.sizes[0],
            self.sizes[-1],
            self.captured_bytes / 2**20,
        )


def capture_cost(free_before: int, free_after: int) -> int:
    """Bytes a capture took: device free memory before minus after, never below 0. A negative
    difference means memory other than the graphs' was released meanwhile; it is logged, and
    the graphs are counted as taking nothing rather than a negative amount."""
    if free_before < 0 or free_after < 0:
        raise ValueError(f"free memory cannot be negative: before {free_before}, after {free_after}")
    cost = free_before - free_after
    if cost < 0:
        log.warning(
            "free device memory grew by %d bytes across the graph capture (memory released meanwhile); "
            "counting the graphs as 0 bytes",
            -cost,
        )
    return max(0, cost)


def num_rows(seqs: Sequence[ScheduledSeq]) -> int:
    """The decode rows of a step: one per token (a verifying slice has k + 1)."""
    return sum(s.num_tokens for s in seqs)


def _num_splits(model, batch: int, device: torch.device, max_model_len: int) -> int:
    if device.type != "cuda":
        return 1
    from splitserve.platform.kernels.triton_split_decode import choose_num_splits

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return choose_num_splits(batch, model.config.num_kv_heads, sms, max_model_len)


def uses_decode_graphs(enforce_eager: bool, device: torch.device) -> bool:
    """Whether an engine captures decode graphs: on CUDA with triton, unless --enforce-eager."""
    from splitserve.platform.kernels.dispatch import triton_available

    return not enforce_eager and triton_available(device)


def decode_graph_bytes(
    enforce_eager: bool, device: torch.device, model_config, max_num_seqs: int, dtype: torch.dtype
) -> int:
    """What the KV budget leaves for the decode graphs (0 when there are none)."""
    if not uses_decode_graphs(enforce_eager, device):
        return 0
    c = model_config
    return graph_memory_bytes(
        max_num_seqs,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        torch.empty((), dtype=dtype).element_size(),
    )
