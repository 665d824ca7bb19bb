"""What one Generate reports besides its tokens: timings, the request record, metrics and spans.

`WorkerService._generate` streams the engine's outputs and decides where the prompt's KV comes
from; it tells a `GenerateObserver` what happened, in this order:

- `on_kv_ready()`: the engine allocated the prompt's blocks and parked the request for KV from
  elsewhere (a pull or a remote prefill): the queue time ends here;
- `on_kv_landed(...)`: the pull or the remote prefill ended (or fell back to local prefill);
- `on_token(out, msg, prefill_worker)` for every output: the first is the first token
  (`on_first_token`: TTFT, the timings on the message, the record), the others observe the
  inter-token latency, the finished one ends the request (`on_finish`: e2e, the finish reason).

A request prefilled here gets no on_kv_ready: its queue and prefill times come from the
engine's first-scheduling time instead. The record is what /debug/requests/<id> and
`splitserve trace` show; the span's children are worker.queue, worker.prefill or
worker.first_token (after KV from elsewhere).
"""

from __future__ import annotations

import time

from splitserve.platform.observability import tracing
from splitserve.platform.wire import worker_pb2 as pb
from splitserve.workers.records import RequestRecords


class GenerateObserver:
    def __init__(
        self,
        metrics,
        records: RequestRecords,
        req_id: str,
        role: str,
        lora_name: str,
        num_prompt_tokens: int,
        remote_prefill: bool,
        span=tracing.NOOP,
    ):
        self.metrics, self.records, self.span = metrics, records, span
        self.req_id, self.role = req_id, role
        self.num_prompt_tokens, self.remote_prefill = num_prompt_tokens, remote_prefill
        self.ttft, self.itl, self.e2e = metrics.latency(lora_name)
        self.t0 = time.monotonic()
        self.timings = pb.Timings()
        self.t_kv: float | None = None  # when the remote prefill or pull ended (the KV is here)
        self.t_last_token: float | None = None
        self.num_pulled_tokens = 0

    def on_kv_ready(self) -> None:
        self.timings.queue_s = time.monotonic() - self.t0
        self.metrics.queue_time.observe(self.timings.queue_s)
        self.span.record("worker.queue", self.t0, self.t0 + self.timings.queue_s)

    def on_kv_landed(self, prefill_s=0.0, transfer_wait_s=0.0, kv_pull_s=0.0, num_pulled_tokens=0) -> None:
        """The KV is here: pushed by a prefill worker (its prefill and transfer-wait seconds),
        pulled (its seconds and tokens), or neither (a fallback to local prefill: all zero)."""
        self.t_kv = time.monotonic()
        self.timings.prefill_s, self.timings.transfer_wait_s = prefill_s, transfer_wait_s
        self.timings.kv_pull_s, self.num_pulled_tokens = kv_pull_s, num_pulled_tokens

    def on_token(self, out, msg: pb.GenerateResponse, prefill_worker: str) -> None:
        now = time.monotonic()
        if self.t_last_token is None:
            self.on_first_token(out, msg, prefill_worker, now)
        elif out.new_token_ids:
            self.itl.observe(now - self.t_last_token)
        self.t_last_token = now
        if out.finished:
            self.on_finish(out, prefill_worker, now)

    def on_first_token(self, out, msg: pb.GenerateResponse, prefill_worker: str, now: float) -> None:
        timings = self.timings
        self._local_timings(out.first_scheduled_time, now)
        timings.first_token_s = now - self.t0
        msg.timings.CopyFrom(timings)
        self.records.update(
            self.req_id,
            role=self.role,
            queue_s=timings.queue_s,
            prefill_s=timings.prefill_s,
            transfer_wait_s=timings.transfer_wait_s,
            kv_pull_s=timings.kv_pull_s,
            first_token_s=timings.first_token_s,
            remote_prefill=self.remote_prefill,
            prefill_worker=prefill_worker,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            trace_id=self.span.trace_id or None,
        )
        self.ttft.observe(now - self.t0)
        self._trace_first_token(now)

    def on_finish(self, out, prefill_worker: str, now: float) -> None:
        self.e2e.observe(now - self.t0)
        self.records.update(
            self.req_id, e2e_s=now - self.t0, num_output_tokens=out.num_output_tokens, finish_reason=out.finish_reason
        )
        self.metrics.requests.labels(finish_reason=out.finish_reason).inc()
        if self.span.is_recording:
            self.span.update(
                {
                    "gen_ai.usage.output_tokens": out.num_output_tokens,
                    "gen_ai.response.finish_reasons": [out.finish_reason or ""],
                    "splitserve.cached_tokens": out.num_cached_tokens,
                    "splitserve.prefill_worker": prefill_worker or None,
                }
            )

    def _local_timings(self, first_scheduled: float | None, now: float) -> None:
        """A request prefilled here (no KVReady came): its queue (submitted -> first scheduled) and
        prefill (scheduled -> first token) from the engine's first-scheduling time."""
        if self.timings.queue_s or first_scheduled is None or first_scheduled < self.t0:
            return
        self.timings.queue_s = first_scheduled - self.t0
        self.timings.prefill_s = now - first_scheduled

    def _trace_first_token(self, now: float) -> None:
        """The first token's spans: a local prefill's queue and prefill, or, after a remote
        prefill or pull, the wait from the KV landing to the first token out."""
        span = self.span
        if not span.is_recording:
            return
        if self.t_kv is None:
            span.record("worker.queue", self.t0, self.t0 + self.timings.queue_s)
            span.record("worker.prefill", self.t0 + self.timings.queue_s, now)
        else:
            span.record("worker.first_token", self.t_kv, now)
        span.set("gen_ai.latency.time_to_first_token", self.timings.first_token_s)
