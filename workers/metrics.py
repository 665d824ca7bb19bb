"""Prometheus metrics of a worker.

Gauges use the names the Gateway API Inference Extension (and llm-d's scheduler) read from
vLLM, so other routers can use our workers: vllm:num_requests_waiting,
vllm:num_requests_running, vllm:kv_cache_usage_perc, vllm:cache_config_info, and
vllm:lora_requests_info (value: the time of the update; labels: max_lora and the comma-separated
names of the adapters with running and with waiting requests, as vLLM and GIE's model-server
protocol define it). Our own
histograms are splitserve_*. Each worker process has its own registry (tests run several).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
BYTES_BUCKETS = tuple(2**i for i in range(10, 34, 2))
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class WorkerMetrics:
    def __init__(self, role: str, model: str):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model}
        self._engine_gauges(r, labels)
        self._cache_and_spec(r, labels)
        self._latency_histograms(r, role)
        self._transfer(r)
        self._structured_and_lora(r)
        self._kv_reuse(r)
        self._seen_queries = self._seen_hits = self._seen_waits = 0
        self._seen_spec = (0, 0, 0)
        self._seen_lengths: tuple[int, ...] = ()
        self._update_lock = threading.Lock()
        self._role, self._model = role, model
        self.ttft, self.itl, self.e2e = self.latency("")
        self._seen_mask = (0.0, 0)
        self._seen_kinds: dict[str, int] = {}
        self._seen_tier = (0, 0, 0, 0)
        Info("splitserve_worker", "Worker identity", registry=r).info({"role": role, "model": model})

    def _engine_gauges(self, r: CollectorRegistry, labels: dict) -> None:
        """Gauges the GIE and llm-d read (vLLM's names), and the LoRA info."""
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled", ["model_name"], registry=r
        ).labels(**labels)
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch", ["model_name"], registry=r
        ).labels(**labels)
        self.kv_group_blocks = Gauge(
            "splitserve_kv_group_blocks",
            "Blocks per KV group (a model mixing layer types; docs/engine.md): held by requests (in_use) "
            "or registered in the prefix cache (cached)",
            ["group", "kind", "state"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", ["model_name"], registry=r
        ).labels(**labels)
        self.cache_info = Gauge(
            "vllm:cache_config_info", "KV cache configuration", ["block_size", "num_gpu_blocks", "role"], registry=r
        )
        self.lora_info = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters in use: running and waiting adapter names "
            "(comma-separated), the per-step adapter limit; value = update time",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=r,
        )

    def _cache_and_spec(self, r: CollectorRegistry, labels: dict) -> None:
        """The prefix cache and speculative decoding (vLLM's names where vLLM has one)."""
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["model_name"], registry=r
        ).labels(**labels)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", ["model_name"], registry=r
        ).labels(**labels)
        self.prefix_waits = Counter(
            "splitserve_prefix_waits",
            "Engine steps a waiting request sat out to reuse a prefix another request was computing",
            registry=r,
        )
        # Speculative decoding, with vLLM's names (platform/spec/): proposals, accepted proposals,
        # verification steps, and verification steps by how many proposals they accepted.
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts",
            "Verification steps (a request's proposals checked in one step)",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed", ["model_name"], registry=r
        ).labels(**labels)
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted", ["model_name"], registry=r
        ).labels(**labels)
        self.spec_accepted_length = Counter(
            "splitserve_spec_decode_accepted_length",
            "Verification steps by the number of proposals they accepted",
            ["accepted"],
            registry=r,
        )

    def _latency_histograms(self, r: CollectorRegistry, role: str) -> None:
        """Queued prompt tokens and the per-request latency histograms."""
        self.queued_prefill_tokens = Gauge(
            "splitserve_queued_prefill_tokens", "Prompt tokens not yet computed", registry=r
        )
        # Per request: labelled by the base model and the LoRA adapter ("" for none), so the
        # dashboards show TTFT and ITL by model and adapter; `latency(lora_name)` gives the children.
        per_request = ["role", "model_name", "lora_name"]
        self._ttft = Histogram(
            "splitserve_time_to_first_token_seconds",
            "Time to first token",
            per_request,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Time between output tokens",
            per_request,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            "splitserve_e2e_request_latency_seconds",
            "Request latency",
            per_request,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "splitserve_request_queue_time_seconds",
            "Time until KV blocks were allocated",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(role=role)

    def _transfer(self, r: CollectorRegistry) -> None:
        """KV transfers, remote prefills, finished requests and the security switches."""
        self.kv_transfer_bytes = Histogram(
            "splitserve_kv_transfer_bytes", "KV bytes per transfer", ["direction"], buckets=BYTES_BUCKETS, registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "splitserve_kv_transfer_seconds", "KV transfer duration", ["direction"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.remote_prefills = Counter(
            "splitserve_remote_prefills", "Remote prefill attempts by outcome", ["outcome"], registry=r
        )
        self.kv_transfers = Counter(
            "splitserve_kv_transfers",
            "KV transfers sent, by the path the KV took (cuda_ipc: device to device; tcp / ucx / inproc: bytes)",
            ["path"],
            registry=r,
        )
        self.kv_path_info = Gauge(
            "splitserve_kv_path_info",
            "The KV path --kv-transport resolved to: the byte transport, whether CUDA IPC is on, and why",
            ["transport", "cuda_ipc", "reason"],
            registry=r,
        )
        self.requests = Counter(
            "splitserve_requests", "Finished requests by finish reason", ["finish_reason"], registry=r
        )
        self.kv_auth_enabled = Gauge(
            "splitserve_kv_auth_enabled",
            "1 when KV-transfer connections must prove the "
            "service's secret (--kv-secret-file), 0 when anyone may send KV blocks",
            registry=r,
        )
        self.grpc_tls_enabled = Gauge(
            "splitserve_grpc_tls_enabled", "1 when the worker gRPC API requires mutual TLS", registry=r
        )
        self.kv_auth_failures = Counter(
            "splitserve_kv_auth_failures",
            "KV-transfer connections rejected for a wrong or missing token (transfer/auth.py)",
            registry=r,
        )

    def _structured_and_lora(self, r: CollectorRegistry) -> None:
        """Structured output and LoRA adapter reads."""
        self.grammar_compile = Histogram(
            "splitserve_grammar_compile_seconds",
            "Grammar compile time (cache misses)",
            buckets=COMPILE_BUCKETS,
            registry=r,
        )
        self.grammar_mask = Counter(
            "splitserve_grammar_mask_seconds",
            "Time spent computing and applying grammar masks (divide by _rows for the time per constrained row)",
            registry=r,
        )
        self.grammar_mask_rows = Counter("splitserve_grammar_mask_rows", "Constrained rows masked", registry=r)
        self.structured_requests = Counter(
            "splitserve_structured_requests", "Constrained requests by kind", ["kind"], registry=r
        )
        # an adapter a request named that was not in memory (evicted under --max-cpu-loras): its folder
        # was read again, and that request waited for the read (bench/lora.py's W5 reports these)
        self.lora_reads = Counter(
            "splitserve_lora_adapter_reads",
            "LoRA adapter folders read again from disk for a request (evicted from memory under --max-cpu-loras)",
            registry=r,
        )
        self.lora_read_seconds = Counter(
            "splitserve_lora_adapter_read_seconds",
            "Time requests waited for those reads (read, checksum and pack, off the engine thread)",
            registry=r,
        )
        self.lora_hinted_evictions = Counter(
            "splitserve_lora_adapter_hinted_evictions",
            "Adapters evicted from "
            "memory before less recently used ones because other workers also "
            "hold them (the router's lora_evict_first hint)",
            registry=r,
        )

    def _kv_reuse(self, r: CollectorRegistry) -> None:
        """KV reuse across workers and tiers (docs/kv-tiers.md)."""
        # KV reuse across workers and tiers (docs/kv-tiers.md)
        self.kv_tier_blocks = Counter(
            "splitserve_kv_tier_blocks",
            "Second KV tier: blocks stored (evicted from "
            "the cache), hits (copied back), evicted (dropped by the tier's LRU), "
            "rejected (failed verification)",
            ["event"],
            registry=r,
        )
        self.kv_tier_bytes = Gauge(
            "splitserve_kv_tier_bytes",
            "Prefix-cache KV bytes per tier (1: blocks of the cache registered under a hash, 2: the second tier)",
            ["tier"],
            registry=r,
        )
        self.kv_pull_blocks = Counter(
            "splitserve_kv_pull_blocks",
            "Prefix blocks pulled from another worker (in) or served to one (out)",
            ["direction"],
            registry=r,
        )
        self.kv_pulls = Counter(
            "splitserve_kv_pulls", "Pull attempts by outcome (ok, failed: recomputed)", ["outcome"], registry=r
        )
        self.kv_pull_seconds = Histogram(
            "splitserve_kv_pull_seconds",
            "Duration of a pull, asked to acknowledged",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def latency(self, lora_name: str = "") -> tuple:
        """The (TTFT, ITL, e2e) histograms of requests for `lora_name` ("": the base model)."""
        labels = dict(role=self._role, model_name=self._model, lora_name=lora_name)
        return self._ttft.labels(**labels), self._itl.labels(**labels), self._e2e.labels(**labels)

    def update_load(self, load) -> None:
        with self._update_lock:  # the counters advance by the difference to the last snapshot seen
            self._update_load(load)

    def _update_load(self, load) -> None:
        if (
            load.prefix_cache_queries < self._seen_queries
            or load.prefix_cache_hits < self._seen_hits
            or load.num_prefix_waits < self._seen_waits
        ):  # older than a snapshot already counted
            return
        self.waiting.set(load.num_waiting)
        self.running.set(load.num_running)
        self.kv_usage.set(load.kv_usage)
        for group, kind, in_use, cached in load.kv_groups:
            self.kv_group_blocks.labels(group=str(group), kind=kind, state="in_use").set(in_use)
            self.kv_group_blocks.labels(group=str(group), kind=kind, state="cached").set(cached)
        self.queued_prefill_tokens.set(load.queued_prefill_tokens)
        self.lora_info.clear()
        self.lora_info.labels(
            max_lora=str(load.max_loras),
            running_lora_adapters=",".join(load.running_loras),
            waiting_lora_adapters=",".join(load.waiting_loras),
        ).set(time.time())
        self.prefix_queries.inc(load.prefix_cache_queries - self._seen_queries)
        self.prefix_hits.inc(load.prefix_cache_hits - self._seen_hits)
        self.prefix_waits.inc(load.num_prefix_waits - self._seen_waits)
        self._seen_queries, self._seen_hits = load.prefix_cache_queries, load.prefix_cache_hits
        self._seen_waits = load.num_prefix_waits
        spec = (load.spec_num_drafts, load.spec_num_draft_tokens, load.spec_num_accepted_tokens)
        if spec[0] > self._seen_spec[0]:
            for counter, now, seen in zip(
                (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens), spec, self._seen_spec
            ):
                counter.inc(now - seen)
            seen_lengths = self._seen_lengths or (0,) * len(load.spec_accepted_lengths)
            for n, (now, seen) in enumerate(zip(load.spec_accepted_lengths, seen_lengths)):
                if now > seen:
                    self.spec_accepted_length.labels(str(n)).inc(now - seen)
            self._seen_spec, self._seen_lengths = spec, load.spec_accepted_lengths

    def update_kv_tier(self, stats, cache_bytes: int) -> None:
        """Export the second tier's TierStats (platform/kv/tier.py; None: no tier) and the bytes of
        the cache's prefix-cache blocks."""
        self.kv_tier_bytes.labels(tier="1").set(cache_bytes)
        if stats is None:
            return
        with self._update_lock:
            now = (stats.num_stored, stats.num_hits, stats.num_evictions, stats.num_rejected)
            for event, n, seen in zip(("stored", "hit", "evicted", "rejected"), now, self._seen_tier):
                if n > seen:
                    self.kv_tier_blocks.labels(event=event).inc(n - seen)
            self._seen_tier = now
            self.kv_tier_bytes.labels(tier="2").set(stats.num_bytes)

    def update_structured(self, stats) -> None:
        """Export the grammar backend's CompileStats (platform/sampling/structured.py), if any."""
        if stats is None:
            return
        for seconds in stats.take_compile_seconds():
            self.grammar_compile.observe(seconds)
        mask, rows = stats.mask_seconds, stats.mask_rows
        self.grammar_mask.inc(max(0.0, mask - self._seen_mask[0]))
        self.grammar_mask_rows.inc(rows - self._seen_mask[1])
        self._seen_mask = (mask, rows)
        for kind, count in list(stats.requests.items()):
            self.structured_requests.labels(kind=kind).inc(count - self._seen_kinds.get(kind, 0))
            self._seen_kinds[kind] = count

    def render(self, load=None, kv_tier=None) -> bytes:
        """The exposition; with `load` (the engine's latest snapshot) the load-derived gauges and
        counters are brought up to date first, so a scrape never lags the periodic load report
        (a stale prefix-cache counter read as a baseline double-counted the next request)."""
        if load is not None:
            self.update_load(load)
        if kv_tier is not None:
            self.update_kv_tier(*kv_tier)
        return generate_latest(self.registry)
