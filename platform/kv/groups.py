"""KV cache groups: one group per layer type, all allocated from one block pool.

A model whose layers all attend alike (every one full, or every one with the same window) has
one group holding every layer: a block of the pool is one block of tokens across all layers,
exactly the single block table the engine has always had.

A model that mixes layer types (Gemma 3: five sliding-window layers per full one; gpt-oss:
alternating 128-token windows and full layers) gets one group per run of layers of one type,
as vLLM's hybrid KV cache manager does:

* Every group has the same number of layers P (the greatest common divisor of the type
  counts), so a pool block has one size whatever group holds it: P layers' K and V for
  block_size tokens. The layers of a type are cut into consecutive runs of P, one group each
  (Gemma 3 270M: 3 full layers -> 1 group; 15 sliding layers -> 5 groups of 3; P = 3).
* The cache is P tensor pairs ("slots") of [num_blocks, block_size, kv_heads, head_dim]; the
  s-th layer of every group reads and writes slot s. Layers of different groups share a slot's
  memory, each through its own group's block ids, so memory is never split between the types
  up front: a block goes to whichever group asks for it.
* Each group has its own block table per request. A full group keeps every block. A
  sliding-window group of window W needs, for a query at position p, keys p - W < j <= p, so
  once a request has computed c tokens its blocks wholly before position c - W + 1 are never read
  again: they are released (back to the free queue, still carrying their hash, so a later prefix
  hit can revive them until they are evicted) and their table entries become holes
  (NULL_BLOCK_ID, a real block id that no kernel reads: every attention path masks or skips
  positions outside the window).

A sliding group therefore holds about cdiv(W - 1 + chunk, block_size) + 1 blocks of a request
however long it grows, where chunk is the most tokens one step computes for it.
`blocks_per_request` gives that need per group; the engine's start-up line, the KV sizing and
the acceptance tests read it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from splitserve.platform.config import ModelConfig

NULL_BLOCK_ID = 0  # what a hole in a sliding group's block table reads as (never attended to)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    """A run of layers of one type: their decoder-layer indices (slot s is layers[s]) and the
    sliding window in tokens (None: full attention; MLA counts as full)."""

    layers: tuple[int, ...]
    window: int | None

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the next query (at position num_computed_tokens) can still see."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // block_size

    def num_blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks this group holds for a request of num_tokens tokens computed chunk at a time."""
        full = cdiv(num_tokens, block_size)
        if self.window is None:
            return full
        return min(full, cdiv(self.window - 1 + chunk, block_size) + 1)

    def window_blocks(self, block_size: int) -> int:
        """How many blocks before a hit point the group needs (cdiv(W - 1, B)); 0: every one."""
        return 0 if self.window is None else max(1, cdiv(self.window - 1, block_size))

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"sliding_window_{self.window}"


@dataclass(frozen=True)
class KVLayout:
    """The groups of one model and, per decoder layer, its group and slot."""

    groups: tuple[KVGroup, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = {len(g.layers) for g in self.groups}
        assert len(sizes) == 1, f"groups of unequal sizes {sizes}"

    @property
    def is_single(self) -> bool:
        return len(self.groups) == 1

    @property
    def num_slots(self) -> int:
        """Layers per group: the tensor pairs the cache allocates (a pool block spans them)."""
        return len(self.groups[0].layers)

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Pool blocks one request of num_tokens tokens holds at most (chunk tokens per step)."""
        return sum(g.num_blocks_for(num_tokens, block_size, chunk) for g in self.groups)

    def sliding_groups(self) -> Iterator[tuple[int, KVGroup]]:
        return ((i, g) for i, g in enumerate(self.groups) if g.window is not None)


def single_layout(num_layers: int) -> KVLayout:
    """One group of every layer (today's cache; windows, if any, only mask)."""
    return KVLayout((KVGroup(tuple(range(num_layers)), None),), (0,) * num_layers, tuple(range(num_layers)))


def plan_layout(config: ModelConfig) -> KVLayout:
    """The model's groups: one (single_layout) unless its layers mix attention types.

    A model whose every layer has the same window (Mistral) keeps one group: its cache holds every
    position, the window only masks (docs/engine.md, "KV groups")."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    by_type: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_type.setdefault(window, []).append(layer)
    if len(by_type) == 1:
        return single_layout(config.num_layers)
    size = math.gcd(*(len(layers) for layers in by_type.values()))
    groups = []
    # full attention first: group 0's table is the request's complete one (KV export, P/D)
    for window in sorted(by_type, key=lambda w: -1 if w is None else w):
        layers = by_type[window]
        groups += [KVGroup(tuple(layers[i : i + size]), window) for i in range(0, len(layers), size)]
    layer_group = [0] * config.num_layers
    layer_slot = [0] * config.num_layers
    for g, group in enumerate(groups):
        for s, layer in enumerate(group.layers):
            layer_group[layer], layer_slot[layer] = g, s
    return KVLayout(tuple(groups), tuple(layer_group), tuple(layer_slot))


def max_concurrency(layout: KVLayout, num_blocks: int, num_tokens: int, block_size: int, chunk: int) -> float:
    """How many requests of num_tokens tokens the pool holds at once (vLLM's "Maximum concurrency")."""
    return num_blocks / layout.blocks_per_request(num_tokens, block_size, chunk)


def describe(layout: KVLayout, num_blocks: int, block_size: int, block_bytes: int, max_len: int, chunk: int) -> str:
    """The engine's start-up line: the pool, each group, and the concurrency at max_len tokens."""
    groups = "; ".join(
        f"group {g} {group.kind} layers {list(group.layers)}: "
        f"{group.num_blocks_for(max_len, block_size, chunk)} blocks per {max_len}-token request"
        for g, group in enumerate(layout.groups)
    )
    return (
        f"KV cache: {num_blocks} blocks of {block_size} tokens x {layout.num_slots} layers "
        f"({num_blocks * block_bytes / 2**30:.3f} GiB, one pool); {groups}; Maximum concurrency for "
        f"{max_len} tokens per request: {max_concurrency(layout, num_blocks, max_len, block_size, chunk):.2f}x"
    )


def first_blocks_sent(layout: KVLayout, num_prompt_tokens: int, block_size: int) -> tuple[int, ...]:
    """Per group, the first prompt block P/D moves: 0 for a full group; for a sliding group the
    first block its window still sees from the first decode step (at position num_prompt_tokens)."""
    return tuple(g.first_needed_block(num_prompt_tokens, block_size) for g in layout.groups)
