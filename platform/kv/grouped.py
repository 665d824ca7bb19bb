"""Per-request block tables for a model with several KV groups (platform/kv/groups.py).

The same interface as KVCacheManager (manager.py), which serves single-group models unchanged;
this one keeps one block table per group per request, all over one BlockPool.

Allocation. Before a request's next `num_new_tokens` are given slots, each sliding-window group
releases the blocks its window has left behind (those wholly before position
num_computed_tokens - W + 1, see KVGroup.first_needed_block): they go back to the pool's free
queue, still hashed (a later prefix hit may revive them until they are evicted), and the table
keeps a hole (NULL_BLOCK_ID) in their place, so block i still covers tokens [i*B, (i+1)*B).
Then every group needs blocks up to cdiv(num_computed_tokens + num_new_tokens, B), and a sliding
group also a block in every hole its window can see again (a request whose remote KV failed
recomputes from its own prefix hits); the request fits when the sum of the groups' new blocks
(plus cached hits revived from the free queue) fits the free queue. Releasing first is always
right (those blocks are never read again), so admission and preemption count what each group
really holds: a long request whose sliding layers hold a window of blocks is admitted where a
full-length table would not fit.

The pool's first block is the null block (BlockPool(null_block=True): set aside, never free) and
a hole reads as its id (NULL_BLOCK_ID), so a hole never names a block another request owns (a KV write that
lands on a hole, such as a pulled block out of the window, is dropped by the engine's connector).

Prefix hits. Block i of every group has the request's i-th block hash, in that group's own hash
map. A hit of L blocks (the next query at position L*B) needs every full group to hold blocks
[0, L) and every sliding group only the blocks its window still sees from there,
[first_needed_block(L*B), L). The longest such L, at most (num_tokens - 1) // B, is the hit; a
sliding group's table starts with holes before its window. The hit is exact: every position any
layer will attend to is cached under the hash of the tokens that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.platform.kv.block_pool import Block, BlockPool
from splitserve.platform.kv.groups import NULL_BLOCK_ID, KVLayout, cdiv
from splitserve.platform.sched.request import Request

Table = list[Block | None]  # None: a hole (released, out of the window)


@dataclass(frozen=True)
class GroupHits:
    """A prefix hit of `num_blocks` blocks: per group, the blocks to reference (None: a hole).
    len() is the hit in blocks, as the scheduler reads a single-group hit list."""

    num_blocks: int
    tables: tuple[Table, ...]

    def __len__(self) -> int:
        return self.num_blocks


class GroupedKVCacheManager:
    """Owns req_id -> one block table per group; the pool owns the blocks."""

    is_grouped = True

    def __init__(self, pool: BlockPool, block_size: int, layout: KVLayout):
        assert not layout.is_single, "a single-group model uses KVCacheManager"
        self.pool = pool
        self.tier = None  # the second tier serves single-group engines only (kv/tier.py)
        self.block_size = block_size
        self.layout = layout
        self._tables: dict[str, list[Table]] = {}
        self._num_registered: dict[str, int] = {}
        # per group, distinct blocks requests hold (a block is held by one group only): plain
        # ints, so /metrics may read them from another thread
        self.num_blocks_in_use = [0] * len(layout.groups)
        assert pool.null_block.block_id == NULL_BLOCK_ID, "a grouped cache needs BlockPool(null_block=True)"

    # -- prefix cache ----------------------------------------------------------------------
    def _hit_length(self, hashes) -> int:
        """The longest hit in blocks over `hashes` (module docstring); reads, changes nothing."""
        num = len(hashes)
        for g, group in enumerate(self.layout.groups):
            if group.window is None:
                num = next((i for i, h in enumerate(hashes[:num]) if not self.pool.peek(h, g)), num)
        for g, group in self.layout.sliding_groups():
            present = [self.pool.peek(h, g) for h in hashes[:num]]
            while num and not all(present[group.first_needed_block(num * self.block_size, self.block_size) : num]):
                num -= 1
        return num

    def _hit_tables(self, hashes, num: int) -> tuple[Table, ...]:
        tables = []
        for g, group in enumerate(self.layout.groups):
            start = group.first_needed_block(num * self.block_size, self.block_size)
            tables.append([None] * start + [self.pool.lookup(h, g) for h in hashes[start:num]])
        return tuple(tables)

    def find_cached_prefix(self, req: Request) -> GroupHits:
        """The longest exact hit of `req` (not yet referenced); none for prompt logprobs."""
        if not self.pool.enable_caching or req.params.prompt_logprobs is not None:
            return GroupHits(0, tuple([] for _ in self.layout.groups))
        hashes = req.block_hashes[: (req.num_tokens - 1) // self.block_size]
        num = self._hit_length(hashes)
        return GroupHits(num, self._hit_tables(hashes, num))

    def num_cached_prefix_tokens(self, num_tokens: int, block_hashes) -> int:
        """Leading tokens of a prompt with these hashes a request could reuse now (read-only)."""
        return self._hit_length(block_hashes[: (num_tokens - 1) // self.block_size]) * self.block_size

    # -- allocation ------------------------------------------------------------------------
    def release_out_of_window(self, req: Request, num_computed_tokens: int | None = None) -> int:
        """Release `req`'s blocks no sliding window can see any more; returns how many were
        held. `num_computed_tokens`: where the next query starts (default: the request's)."""
        tables = self._tables.get(req.req_id)
        if tables is None:
            return 0
        start = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_released = 0
        for g, group in self.layout.sliding_groups():
            table = tables[g]
            end = min(group.first_needed_block(start, self.block_size), len(table))
            dropped = [b for b in table[:end] if b is not None]
            if dropped:
                table[:end] = [None] * end
                self._release(g, dropped[::-1])
                num_released += len(dropped)
        return num_released

    def _holes_to_fill(self, group: int, table: Table, num_computed_tokens: int) -> list[int]:
        """Indices of holes in a sliding group's `table` that the next query (at position
        num_computed_tokens) can see; none for a full group (it has no holes)."""
        window_group = self.layout.groups[group]
        if window_group.window is None:
            return []
        start = window_group.first_needed_block(num_computed_tokens, self.block_size)
        return [i for i in range(start, len(table)) if table[i] is None]

    def _num_blocks_needed(self, req: Request, num_new_tokens: int, hits) -> int:
        num_tokens = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        own = self._tables.get(req.req_id)
        tables = own or (hits.tables if hits else None)
        need = 0
        for g in range(len(self.layout.groups)):
            held = len(tables[g]) if tables is not None else 0
            need += max(0, cdiv(num_tokens, self.block_size) - held)
            if own is not None:
                need += len(self._holes_to_fill(g, own[g], req.num_computed_tokens))
        if hits:
            need += sum(1 for table in hits.tables for b in table if b is not None and b.ref_cnt == 0)
        return need

    def can_fit(self, req: Request, num_new_tokens: int, cached=()) -> bool:
        self.release_out_of_window(req)
        return self._num_blocks_needed(req, num_new_tokens, cached) <= self.pool.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, cached=()) -> bool:
        """Make room for `num_new_tokens` more tokens of `req` in every group (after `cached`
        hits, if any), releasing what the windows left behind first. Returns False, changing
        nothing but those releases, when the pool cannot supply the blocks."""
        self.release_out_of_window(req)
        if self._num_blocks_needed(req, num_new_tokens, cached) > self.pool.num_free_blocks:
            return False
        tables = self._tables.get(req.req_id)
        if tables is None:
            tables = self._tables[req.req_id] = [[] for _ in self.layout.groups]
            self._num_registered[req.req_id] = 0
        if cached:
            for g, (table, hit) in enumerate(zip(tables, cached.tables, strict=True)):
                blocks = [b for b in hit if b is not None]
                self.num_blocks_in_use[g] += sum(b.ref_cnt == 0 for b in blocks)
                self.pool.touch(blocks, hit=True)
                table.extend(hit)
            self._num_registered[req.req_id] += len(cached)
        start = req.num_computed_tokens + len(cached) * self.block_size
        num_tokens = start + num_new_tokens
        for g, table in enumerate(tables):
            holes = self._holes_to_fill(g, table, start)
            for i, block in zip(holes, self.pool.allocate(len(holes))):
                table[i] = block
            self.num_blocks_in_use[g] += len(holes)
            num_new = cdiv(num_tokens, self.block_size) - len(table)
            if num_new > 0:
                table.extend(self.pool.allocate(num_new))
                self.num_blocks_in_use[g] += num_new
        return True

    def _release(self, group: int, blocks: list[Block]) -> None:
        """Drop one reference on `blocks` (in this order) of `group`."""
        self.pool.free(blocks)
        self.num_blocks_in_use[group] -= sum(b.ref_cnt == 0 for b in blocks)

    def register_computed_blocks(self, req: Request) -> None:
        """Put the blocks that are now full and computed into each group's prefix cache."""
        tables = self._tables.get(req.req_id)
        if not tables:
            return
        start = self._num_registered[req.req_id]
        end = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(tables[0]))
        if end <= start:
            return
        parent = req.block_hashes[start - 1] if start > 0 else None
        for g, table in enumerate(tables):
            pairs = [(b, h) for b, h in zip(table[start:end], req.block_hashes[start:end]) if b is not None]
            if pairs:
                window_blocks = self.layout.groups[g].window_blocks(self.block_size)
                self.pool.cache_blocks([b for b, _ in pairs], [h for _, h in pairs], parent, g, window_blocks)
        self._num_registered[req.req_id] = end

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free `req`'s blocks past those `num_tokens` tokens need, tail first, every group."""
        tables = self._tables.get(req.req_id)
        keep = cdiv(num_tokens, self.block_size)
        if not tables or len(tables[0]) <= keep:
            return
        assert self._num_registered[req.req_id] <= keep, "a registered block would be trimmed"
        for g, table in enumerate(tables):
            extra = [b for b in table[keep:] if b is not None]
            del table[keep:]
            self._release(g, extra[::-1])

    def free(self, req: Request) -> None:
        """Release all of `req`'s blocks, each group tail first."""
        tables = self._tables.pop(req.req_id, [])
        self._num_registered.pop(req.req_id, None)
        for g, table in enumerate(tables):
            self._release(g, [b for b in reversed(table) if b is not None])

    # -- queries ---------------------------------------------------------------------------
    def block_ids(self, req_id: str) -> list[int]:
        """Group 0's table (a full group when the model has one), holes as NULL_BLOCK_ID."""
        tables = self._tables.get(req_id)
        return _ids(tables[0]) if tables else []

    def group_block_ids(self, req_id: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(_ids(table)) for table in self._tables.get(req_id, ()))

    def num_blocks_held(self, req_id: str) -> list[int]:
        """Blocks `req_id` holds now, per group (holes not counted)."""
        return [sum(b is not None for b in table) for table in self._tables.get(req_id, ())]

    def group_usage(self) -> list[dict]:
        """Per group: its kind, layers, blocks held by requests and hashes cached (/debug/kv,
        /metrics; reads counters only)."""
        return [
            {
                "group": g,
                "kind": group.kind,
                "layers": list(group.layers),
                "num_blocks_in_use": self.num_blocks_in_use[g],
                "num_cached_blocks": self.pool.num_cached_blocks_of(g),
            }
            for g, group in enumerate(self.layout.groups)
        ]

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def check_invariants(self) -> None:
        """Pool invariants, plus: every held block's ref count covers its holders, and every
        table of a request covers the same blocks of tokens."""
        self.pool.check_invariants()
        holders: dict[int, int] = {NULL_BLOCK_ID: 1}  # the null block, set aside by the pool
        in_use = [set() for _ in self.layout.groups]
        for tables in self._tables.values():
            assert len({len(t) for t in tables}) == 1, "a request's group tables differ in length"
            for g, table in enumerate(tables):
                for b in table:
                    if b is not None:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
                        in_use[g].add(b.block_id)
        assert [len(s) for s in in_use] == self.num_blocks_in_use, (in_use, self.num_blocks_in_use)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held {holders.get(block.block_id, 0)} times"
            )


def _ids(table: Table) -> list[int]:
    return [NULL_BLOCK_ID if b is None else b.block_id for b in table]
