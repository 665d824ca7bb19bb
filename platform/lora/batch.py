"""Mixed-adapter batches: which rows of a step run which adapter, and the delta they add.

Punica/S-LoRA batch many adapters with one base matmul plus a per-adapter "shrink" (x @ A) and
"expand" (@ B) over each adapter's rows. On a CPU the cheapest form of that is contiguous row
segments: the model runner orders a step's sequences by adapter (within decodes and within
prefills, which it keeps apart), so each adapter owns at most two runs of rows, and every fused
linear adds, per run,

    y[start:end] += (x[start:end] @ A_T) @ B_T      (two matmuls on views; no gather, no scatter)

Rows without an adapter (base requests) are never touched. The segments are computed once per
step (`segments_for`) and published on the model's LoraContext, which every fused linear of
the model holds (`attach`); the linears read it, nobody else writes it. The context is empty
outside a step, so a model with no adapter in the batch pays one attribute check per linear.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.platform.lora.adapter import LinearLayout, LoraAdapter


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of the step's flat activations run `adapter`."""

    start: int
    end: int
    adapter: LoraAdapter


class LoraContext:
    """The current step's segments, shared by every fused linear of one model."""

    def __init__(self):
        self.segments: tuple[Segment, ...] = ()

    def add_delta(self, key: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each segment's adapter delta for linear `key` into `y` (in place)."""
        for seg in self.segments:
            packed = seg.adapter.weights.get(key)
            if packed is not None:
                a_t, b_t = packed
                y[seg.start:seg.end].addmm_(x[seg.start:seg.end] @ a_t, b_t)


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


def segments_for(num_tokens: Sequence[int], adapters: Sequence[LoraAdapter | None]) -> tuple[Segment, ...]:
    """Row segments of a step whose sequences have `num_tokens` rows each, in order, and
    `adapters` (None: base); consecutive sequences of one adapter merge into one segment."""
    segments: list[Segment] = []
    row = 0
    for n, adapter in zip(num_tokens, adapters, strict=True):
        if adapter is not None:
            if segments and segments[-1].adapter is adapter and segments[-1].end == row:
                segments[-1] = Segment(segments[-1].start, row + n, adapter)
            else:
                segments.append(Segment(row, row + n, adapter))
        row += n
    return tuple(segments)
