"""Mixed-adapter batches: which rows of a step run which adapter, and the delta they add.

Punica/S-LoRA batch many adapters with one base matmul plus a per-adapter "shrink" (x @ A) and
"expand" (@ B) over each adapter's rows. On a CPU (float32) that is one C call per linear,
`CpuOps.lora_delta` (kernels/cpu_ops.c): each adapter's rows are gathered and run through the
fixed-order GEMM (`ss_gemm_fixed`) against that adapter's own A_T and B shards. Every output of that
GEMM is one chain of fused multiply-adds over its own row and column, so a request's delta has
the same bits alone, beside other adapters or beside base rows (a BLAS picks kernels by shape;
on an AVX2 host that gave a request in a mixed batch other greedy tokens than it got alone),
and no row computes another adapter's columns. The one-call decode step (kernels/cpu_decode.c)
makes the same call for each linear.

Elsewhere (a GPU, or 16-bit activations) every adapter of a step is handled in the same three
torch calls per linear, which costs fewer launches than a call per adapter:

    H = x @ A_cat                 A_cat = [A_T of adapter 1 | A_T of adapter 2 | ...]  [in, W]
    H *= mask                     mask[row, col] = 1 where col belongs to the row's adapter
    y += H @ B_cat                B_cat = [B_T of adapter 1; B_T of adapter 2; ...]    [W, out]

Rows without an adapter (base requests) have an all-zero mask row: they get exactly 0 added.
With one adapter on every row the mask is skipped.

What depends only on which adapters a step mixes (the C entries, or the concatenations) is
built on first use and cached (`PackedSet`, a few sets kept, least recently used dropped), so
steady decoding with an unchanged set of adapters builds nothing. The per-step part
(`LoraBatch`: each row's group) is computed once per step and published on the model's
LoraContext, which every fused linear of the model holds (`attach`); the linears read it,
nobody else writes it. The context is empty outside a step, so a batch without adapters pays one
attribute check per linear.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from collections.abc import Sequence

import torch

from splitserve.platform.kernels.cpu_ops import CpuOps, LoraEntry, cpu_ops
from splitserve.platform.lora.adapter import LinearLayout, LoraAdapter

MAX_PACKED_SETS = 4


class PackedSet:
    """What one tuple of adapters needs per fused linear: the C kernel's entries, or the
    concatenated weights (each built lazily)."""

    def __init__(self, adapters: tuple[LoraAdapter, ...]):
        self.adapters = adapters
        self._linears: dict[str, tuple[torch.Tensor, torch.Tensor, tuple] | None] = {}
        self._entries: dict[str, ctypes.Array | None] = {}
        self.decode_table = None  # the one-call decode step's table of this set (kernels/cpu_decode.py)

    def entries(self, key: str) -> ctypes.Array | None:
        """One LoraEntry per adapter (group order) for linear `key`, or None when no adapter touches
        it. The adapters' tensors live as long as this set, which holds the adapters."""
        if key not in self._entries:
            table = (LoraEntry * len(self.adapters))()
            for g, adapter in enumerate(self.adapters):
                if key in adapter.weights:
                    table[g] = LoraEntry.of(adapter.weights[key])
            self._entries[key] = table if any(e.a for e in table) else None
        return self._entries[key]

    def linear(self, key: str) -> tuple[torch.Tensor, torch.Tensor, tuple] | None:
        """(A_cat, B_cat, column signature) for linear `key`, or None when no adapter touches it.
        The signature lists (group, width) per adapter present: it defines the mask's columns."""
        if key not in self._linears:
            parts = [(g, a.weights[key]) for g, a in enumerate(self.adapters) if key in a.weights]
            if not parts:
                self._linears[key] = None
            else:
                a_cat = torch.cat([w.a_t for _, w in parts], dim=1).contiguous()
                b_cat = torch.cat([w.b_t() for _, w in parts], dim=0).contiguous()
                self._linears[key] = (a_cat, b_cat, tuple((g, w.a_t.shape[1]) for g, w in parts))
        return self._linears[key]


class LoraBatch:
    """One step: each row's adapter group (-1: base), the masks of the step's linears (torch
    path), and the C kernels where the step runs on a CPU (None: torch's matmul)."""

    def __init__(self, packed: PackedSet, row_group: torch.Tensor, is_uniform: bool, ops: CpuOps | None = None):
        self.packed = packed
        self.row_group = row_group
        self.is_uniform = is_uniform  # one adapter on every row: no mask needed
        self.ops = ops
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, signature: tuple, dtype: torch.dtype) -> torch.Tensor:
        m = self._masks.get(signature)
        if m is None:
            cols = torch.cat([torch.full((w,), g, dtype=torch.long) for g, w in signature]).to(self.row_group.device)
            m = self._masks[signature] = (self.row_group[:, None] == cols[None, :]).to(dtype)
        return m


class LoraContext:
    """The current step's LoraBatch, shared by every fused linear of one model."""

    def __init__(self):
        self.batch: LoraBatch | None = None
        self._packed: OrderedDict[tuple[int, ...], PackedSet] = OrderedDict()

    def begin(self, num_tokens: Sequence[int], adapters: Sequence[LoraAdapter | None], device) -> None:
        """Publish the step whose sequences have `num_tokens` rows each, in order, and `adapters`."""
        distinct = tuple(dict.fromkeys(a for a in adapters if a is not None))
        if not distinct:
            self.batch = None
            return
        group = {id(a): g for g, a in enumerate(distinct)}
        rows = [
            group[id(a)] if a is not None else -1 for a, n in zip(adapters, num_tokens, strict=True) for _ in range(n)
        ]
        row_group = torch.tensor(rows, dtype=torch.long, device=device)
        self.batch = LoraBatch(
            self._packed_set(distinct),
            row_group,
            is_uniform=len(distinct) == 1 and -1 not in rows,
            ops=cpu_ops() if torch.device(device).type == "cpu" else None,
        )

    def end(self) -> None:
        self.batch = None

    def _packed_set(self, adapters: tuple[LoraAdapter, ...]) -> PackedSet:
        key = tuple(id(a) for a in adapters)
        packed = self._packed.get(key)
        if packed is None or packed.adapters != adapters:
            packed = self._packed[key] = PackedSet(adapters)
        self._packed.move_to_end(key)
        while len(self._packed) > MAX_PACKED_SETS:
            self._packed.popitem(last=False)
        return packed

    def add_delta(self, key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the step's adapter deltas for linear `key` into `y` (in place)."""
        batch = self.batch
        ops = batch.ops
        if ops is not None and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and y.is_contiguous():
            entries = batch.packed.entries(key)
            if entries is not None:
                ops.lora_delta(x, entries, batch.row_group, y)
            return
        linear = batch.packed.linear(key)
        if linear is None:
            return
        a_cat, b_cat, signature = linear
        h = x @ a_cat
        if not batch.is_uniform:
            h.mul_(batch.mask(signature, h.dtype))
        y.addmm_(h, b_cat)


def attach(model: torch.nn.Module) -> tuple[LoraContext, dict[str, LinearLayout]]:
    """Give every fused linear of `model` a shared LoraContext (once; idempotent) and return it
    with the linears' layout (what adapters are packed against)."""
    from splitserve.platform.models.layers import MergedLinear

    context = getattr(model, "lora_context", None)
    if context is None:
        context = LoraContext()
        model.lora_context = context
    layout = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            module.lora_context, module.lora_key = context, name
            layout[name] = LinearLayout(module.in_features, dict(module.shard_offsets))
    return context, layout
