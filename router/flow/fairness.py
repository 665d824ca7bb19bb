"""One priority band's queue: a queue per flow, and weighted fair queuing between the flows.

Fairness is charged in tokens, as a virtual token counter per flow (the VTC scheme of Sheng et
al., "Fairness in Serving Large Language Models", OSDI 2024, which AIBrix also uses):

- Each flow (tenant) has a `weight` (the key file's, default 1) and a counter of the tokens it
  was served divided by its weight.
- The next request of the band comes from the backlogged flow with the smallest counter (ties:
  the flow that has waited longest); within a flow, the lowest body `priority` first (vLLM's
  meaning), then round robin between the flow's sub-flows (the fairness header's ids under one
  key: an item ranks after the items of its sub-flow already queued), then arrival order.
- At dispatch the flow is charged the request's reservation (prompt + max_tokens) / weight; when
  the request ends the charge is settled to what it used (prompt + completion tokens streamed),
  so a request that stopped early gives its unused share back.
- A flow that was idle is lifted to the band's floor (the counter of the last flow served) when
  it becomes backlogged again: idleness banks no credit, so a returning flow shares from now on
  instead of starving the others to catch up.

So two backlogged flows of equal weight get equal tokens whatever their concurrency: one that
floods only lengthens its own queue.

Memory is bounded by what is queued or running: a flow with nothing queued or running is kept
only while its counter is above the floor (its debt still matters), and of those at most
`MAX_IDLE_FLOWS`, the longest idle dropped first (dropping forgives a debt; it never grants credit).
Sub-flows hold no state of their own beyond their queued items. The band is a single-writer structure: the controller
(router/flow/controller.py) is the only caller.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

_sequence = itertools.count()
MAX_IDLE_FLOWS = 1024


@dataclass(eq=False)
class FlowItem:
    """One request in flow control: its identity, what it is charged, and when it came."""

    req_id: str
    band: int
    flow_id: str
    cost_tokens: int  # charged at dispatch: prompt tokens + max_tokens of every choice
    weight: float = 1.0
    priority: int = 0  # the body's `priority`: lower first within the flow (vLLM)
    sub_flow: str = ""  # the fairness header's id under the flow's key: round robin within the flow
    label: str = ""  # the metrics label (a key id, bounded); "" : the flow id
    enqueue_time: float = 0.0
    seq: int = field(default_factory=lambda: next(_sequence))
    is_dispatched: bool = False
    rank: int = 0  # set at push: items of its sub-flow queued ahead of it

    @property
    def is_sheddable(self) -> bool:
        return self.band < 0

    def order(self) -> tuple[int, int, int]:
        return self.priority, self.rank, self.seq


@dataclass
class _Flow:
    weight: float = 1.0
    counter: float = 0.0  # tokens served / weight
    queue: list[FlowItem] = field(default_factory=list)  # kept sorted by FlowItem.order()
    num_inflight: int = 0


class Band:
    """The queue of one band. `push`, `remove`, `pop` and `settle` are its only writers."""

    def __init__(self, band: int):
        self.band = band
        self.flows: dict[str, _Flow] = {}
        self.idle: dict[str, None] = {}  # idle flows kept for their debt, oldest first
        self.floor = 0.0
        self.num_queued = 0

    def push(self, item: FlowItem) -> None:
        flow = self.flows.get(item.flow_id)
        if flow is None:
            flow = self.flows[item.flow_id] = _Flow(counter=self.floor)
        self.idle.pop(item.flow_id, None)
        flow.weight = item.weight
        if not flow.queue:
            flow.counter = max(flow.counter, self.floor)
        item.rank = sum(other.sub_flow == item.sub_flow for other in flow.queue)
        position = len(flow.queue)
        while position and flow.queue[position - 1].order() > item.order():
            position -= 1
        flow.queue.insert(position, item)
        self.num_queued += 1

    def remove(self, item: FlowItem) -> bool:
        """Take a queued item out (its client left, its wait ran out); False if it is not queued."""
        flow = self.flows.get(item.flow_id)
        if flow is None or item not in flow.queue:
            return False
        flow.queue.remove(item)
        self.num_queued -= 1
        self._forget_if_idle(item.flow_id)
        return True

    def peek(self) -> FlowItem | None:
        """The item fair queuing serves next, left in place."""
        best: _Flow | None = None
        for flow in self.flows.values():
            if flow.queue and (best is None or (flow.counter, flow.queue[0].seq) < (best.counter, best.queue[0].seq)):
                best = flow
        return best.queue[0] if best is not None else None

    def pop(self) -> FlowItem | None:
        """Dispatch the next item: out of its queue, its flow charged its reservation."""
        item = self.peek()
        if item is None:
            return None
        flow = self.flows[item.flow_id]
        flow.queue.pop(0)
        self.num_queued -= 1
        self.floor = max(self.floor, flow.counter)
        flow.counter += item.cost_tokens / flow.weight
        flow.num_inflight += 1
        item.is_dispatched = True
        return item

    def settle(self, item: FlowItem, used_tokens: int | None) -> None:
        """A dispatched item ended: move its flow's charge from the reservation to `used_tokens`
        (None: the reservation stands)."""
        assert item.is_dispatched, f"{item.req_id} was never dispatched"
        flow = self.flows[item.flow_id]
        if used_tokens is not None:
            flow.counter += (used_tokens - item.cost_tokens) / flow.weight
        flow.num_inflight -= 1
        self._forget_if_idle(item.flow_id)

    def _forget_if_idle(self, flow_id: str) -> None:
        """A flow with nothing queued or running is dropped once it is at or below the floor
        (it would be lifted to the floor anyway); above it, it is kept as one of the band's idle
        flows, of which the oldest go beyond MAX_IDLE_FLOWS."""
        flow = self.flows[flow_id]
        if flow.queue or flow.num_inflight:
            return
        if flow.counter <= self.floor:
            del self.flows[flow_id]
            self.idle.pop(flow_id, None)
            return
        self.idle[flow_id] = None
        while len(self.idle) > MAX_IDLE_FLOWS:
            oldest = next(iter(self.idle))
            del self.idle[oldest], self.flows[oldest]

    # -- reading ------------------------------------------------------------------------------
    def queued_of(self, flow_id: str) -> int:
        flow = self.flows.get(flow_id)
        return len(flow.queue) if flow is not None else 0

    def most_over_share(self, newcomer: FlowItem) -> str | None:
        """When the band's queue is full: the flow holding the most queue slots beyond its
        weighted share of them (the newcomer's flow counted with its request), or None if no flow
        is over its share."""
        counts = {fid: len(f.queue) for fid, f in self.flows.items() if f.queue}
        weights = {fid: self.flows[fid].weight for fid in counts}
        counts[newcomer.flow_id] = counts.get(newcomer.flow_id, 0) + 1
        weights[newcomer.flow_id] = newcomer.weight
        total, total_weight = sum(counts.values()), sum(weights.values())
        excess = {fid: n - total * weights[fid] / total_weight for fid, n in counts.items()}
        worst = max(excess, key=lambda fid: (excess[fid], fid == newcomer.flow_id))
        return worst if excess[worst] > 0 else None

    def newest_of(self, flow_id: str) -> FlowItem:
        """The item of the flow that would be served last (the one to turn away first)."""
        return self.flows[flow_id].queue[-1]
