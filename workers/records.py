"""The worker's record of its recent requests: where each one's time went.

The servicer writes one record per request (on the event loop: the only writer), merging
fields as the request advances: its TTFT breakdown (queue, prefill, transfer wait, first token),
token counts, the prefill worker and transfer, the finish reason and the trace id when the
request was traced. The worker's HTTP side port serves a record at /debug/requests/<id>, which
`splitserve trace` reads. Bounded: the oldest records are dropped past `capacity`.
"""

from __future__ import annotations

from collections import OrderedDict

CAPACITY = 4096


class RequestRecords:
    def __init__(self, capacity: int = CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} is invalid; allowed: >= 1")
        self.capacity = capacity
        self._records: OrderedDict[str, dict] = OrderedDict()

    def update(self, req_id: str, **fields) -> None:
        """Merge `fields` into the request's record (created on first use)."""
        record = self._records.get(req_id)
        if record is None:
            record = self._records[req_id] = {"request_id": req_id}
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
        record.update({k: v for k, v in fields.items() if v is not None})

    def get(self, req_id: str) -> dict | None:
        record = self._records.get(req_id)
        return dict(record) if record is not None else None

    def __len__(self) -> int:
        return len(self._records)
