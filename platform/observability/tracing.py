"""Request traces: OpenTelemetry spans exported over OTLP gRPC, off by default.

One trace per request crosses the processes: the gateway, the decode worker, the prefill worker
and both ends of the KV transfer. The W3C `traceparent` header carries the context over HTTP
and in the workers' gRPC metadata; each process names itself in its resource (`service.name`:
splitserve-router, splitserve-decode, splitserve-prefill, splitserve-worker, splitserve-epp;
`service.instance.id`).

Switched on by `--otlp-traces-endpoint URL` (vLLM's flag) or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true`
keeps it off. Sampling is parent-based: a request whose caller sent a sampled `traceparent`
is traced, one that arrives without decides by the ratio (`--otlp-traces-sample-ratio`, or
`OTEL_TRACES_SAMPLER_ARG`, default 1.0). `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`
add to or override the resource. Spans carry token counts, never prompt text, unless
`--otlp-traces-include-prompt` asks.

Off costs nothing: `configure()` imports no OpenTelemetry module, and every span is the one
`NOOP` object whose methods do nothing. The callers hold spans explicitly (a child is made from
its parent), so nothing depends on a global context that an async generator could lose across
`yield`; `enter(span)` makes a span the running task's (and the tasks it starts): `current()`
returns it, and its ids go on the task's log lines (observability/logfmt.py); `Span.activate()` does
the latter alone. Times are `time.monotonic()` seconds, as everywhere else in splitserve,
converted to wall-clock nanoseconds here.

This module is torch-free: the router imports it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from splitserve.platform.errors import ConfigError

log = logging.getLogger(__name__)

ROLES = ("router", "decode", "prefill", "worker", "epp")
KINDS = ("internal", "server", "client")
TRACEPARENT = "traceparent"

# (trace_id, span_id) in hex of the span the running task works for; read by the log filter.
current_ids: contextvars.ContextVar[tuple[str, str]] = contextvars.ContextVar("trace_ids", default=("", ""))

_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as wall-clock nanoseconds since the epoch (what OTLP carries)."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


@dataclass(frozen=True)
class TracingConfig:
    """What a process exports. `endpoint` empty: tracing off."""

    role: str  # one of ROLES: service.name is splitserve-<role>
    endpoint: str = ""  # OTLP gRPC collector, e.g. http://otel-collector:4317
    sample_ratio: float = 1.0  # for requests that arrive without a sampled parent
    include_prompt: bool = False  # put prompt text on the request span
    service_name: str = ""  # overrides splitserve-<role> (OTEL_SERVICE_NAME)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"tracing role {self.role!r} is invalid; allowed: {', '.join(ROLES)}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"trace sample ratio {self.sample_ratio} is invalid; allowed: 0.0 to 1.0")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    @property
    def name(self) -> str:
        return self.service_name or f"splitserve-{self.role}"


def config_from(
    role: str,
    endpoint: str | None = None,
    sample_ratio: float | None = None,
    include_prompt: bool = False,
    env: Mapping[str, str] | None = None,
) -> TracingConfig:
    """A TracingConfig from the command line's values (None: not given) over the OTEL_* variables."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingConfig(role=role)
    if not endpoint:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or ""
    if sample_ratio is None:
        text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            sample_ratio = float(text) if text else 1.0
        except ValueError:
            raise ConfigError(
                f"OTEL_TRACES_SAMPLER_ARG={text!r} is invalid; allowed: a number from 0.0 to 1.0"
            ) from None
    return TracingConfig(
        role=role,
        endpoint=endpoint,
        sample_ratio=sample_ratio,
        include_prompt=include_prompt,
        service_name=env.get("OTEL_SERVICE_NAME", ""),
    )


def add_tracing_args(p) -> None:
    """The tracing flags every serving command takes (argparse)."""
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces to this OTLP gRPC collector, e.g. http://127.0.0.1:4317 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; empty: tracing off)",
    )
    p.add_argument(
        "--otlp-traces-sample-ratio",
        type=float,
        default=None,
        metavar="R",
        help="fraction of requests without a sampled traceparent that are traced, 0.0 to 1.0 "
        "(default: $OTEL_TRACES_SAMPLER_ARG or 1.0; a caller's sampled traceparent is always honoured)",
    )
    p.add_argument(
        "--otlp-traces-include-prompt",
        action="store_true",
        help="put the prompt text on the request span (default: token counts only)",
    )


def config_from_args(role: str, args) -> TracingConfig:
    return config_from(role, args.otlp_traces_endpoint, args.otlp_traces_sample_ratio, args.otlp_traces_include_prompt)


def tracing_argv(config: TracingConfig) -> list[str]:
    """The flags that give a child process (a worker started by `up`) the same exporter."""
    if not config.enabled:
        return []
    argv = ["--otlp-traces-endpoint", config.endpoint, "--otlp-traces-sample-ratio", repr(config.sample_ratio)]
    return argv + (["--otlp-traces-include-prompt"] if config.include_prompt else [])


class _NoopSpan:
    """The span of an untraced request: every method does nothing and costs one call."""

    is_recording = False
    trace_id = span_id = ""

    def child(self, name, start=None, kind="internal", attributes=None):
        return self

    def record(self, name, start, end, attributes=None):
        return self

    def set(self, key, value):
        pass

    def update(self, attributes):
        pass

    def event(self, name, attributes=None):
        pass

    def fail(self, exc):
        pass

    def end(self, at=None):
        pass

    def inject(self, carrier):
        pass

    def activate(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NOOP = _NoopSpan()


class Tracer:
    """The process' tracer. Off (the default): `start` returns NOOP."""

    enabled = False
    include_prompt = False

    def start(
        self,
        name: str,
        carrier: Mapping[str, str] | None = None,
        kind: str = "server",
        attributes: Mapping | None = None,
        start: float | None = None,
    ):
        """A root span of this process, parented by the `traceparent` in `carrier` (HTTP headers
        or gRPC metadata as a mapping) when there is one."""
        return NOOP

    def shutdown(self) -> None:
        pass


class _Span:
    __slots__ = ("_tracer", "_span")
    is_recording = True

    def __init__(self, tracer: OtelTracer, span):
        self._tracer, self._span = tracer, span

    @property
    def trace_id(self) -> str:
        return format(self._span.get_span_context().trace_id, "032x")

    @property
    def span_id(self) -> str:
        return format(self._span.get_span_context().span_id, "016x")

    def child(self, name, start=None, kind="internal", attributes=None):
        return self._tracer._open(name, self._tracer._api.set_span_in_context(self._span), kind, attributes, start)

    def record(self, name, start, end, attributes=None):
        """A finished child span whose times are already known (monotonic seconds)."""
        span = self.child(name, start=start, attributes=attributes)
        span.end(end)
        return span

    def set(self, key, value):
        if value is not None:
            self._span.set_attribute(key, value)

    def update(self, attributes):
        self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def event(self, name, attributes=None):
        self._span.add_event(name, attributes=attributes)

    def fail(self, exc):
        self._span.record_exception(exc)
        self._span.set_status(self._tracer._status_error, f"{type(exc).__name__}: {exc}")

    def end(self, at=None):
        self._span.end(end_time=wall_ns(at) if at is not None else None)

    def inject(self, carrier: MutableMapping[str, str]):
        self._tracer._propagator.inject(carrier, context=self._tracer._api.set_span_in_context(self._span))

    def activate(self):
        """Mark this span as the running task's: its log lines carry the trace and span ids."""
        current_ids.set((self.trace_id, self.span_id))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self.fail(exc)
        self.end()
        return False


class OtelTracer(Tracer):
    """Tracing on: the OpenTelemetry SDK with a batching OTLP gRPC exporter."""

    enabled = True

    def __init__(self, config: TracingConfig, exporter=None):
        from opentelemetry import trace as api
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.config = config
        self.include_prompt = config.include_prompt
        self._api = api
        self._kinds = {"internal": api.SpanKind.INTERNAL, "server": api.SpanKind.SERVER, "client": api.SpanKind.CLIENT}
        self._status_error = api.StatusCode.ERROR
        self._propagator = TraceContextTextMapPropagator()
        resource = Resource.create(
            {"service.name": config.name, "service.namespace": "splitserve", "service.instance.id": config.instance_id}
        )
        self._provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            endpoint = config.endpoint
            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("splitserve")

    def start(self, name, carrier=None, kind="server", attributes=None, start=None):
        parent = self._propagator.extract(carrier) if carrier else None
        return self._open(name, parent, kind, attributes, start)

    def _open(self, name, context, kind, attributes, start):
        if kind not in self._kinds:
            raise ConfigError(f"span kind {kind!r} is invalid; allowed: {', '.join(KINDS)}")
        span = self._tracer.start_span(
            name,
            context=context,
            kind=self._kinds[kind],
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
            start_time=wall_ns(start) if start is not None else None,
        )
        return _Span(self, span) if span.is_recording() else _Unsampled(self, span)

    def shutdown(self) -> None:
        """Export what is buffered and stop (at process exit; again: nothing)."""
        if self.enabled:
            self.enabled = False
            self._provider.shutdown()


class _Unsampled(_NoopSpan):
    """A span the sampler dropped: records nothing, but passes its (unsampled) context on so
    the processes downstream make the same decision."""

    def __init__(self, tracer: OtelTracer, span):
        self._tracer, self._span = tracer, span

    def inject(self, carrier):
        self._tracer._propagator.inject(carrier, context=self._tracer._api.set_span_in_context(self._span))


_tracer: Tracer = Tracer()
_current: contextvars.ContextVar = contextvars.ContextVar("current_span", default=NOOP)


def current():
    """The span the running task works for (NOOP when none)."""
    return _current.get()


def enter(span):
    """Make `span` the running task's current span (tasks started from here inherit it); returns
    what `leave` needs. Nothing to do for an unrecorded span."""
    if not span.is_recording:
        return None
    return _current.set(span), current_ids.set((span.trace_id, span.span_id))


def leave(tokens) -> None:
    if tokens is not None:
        _current.reset(tokens[0])
        current_ids.reset(tokens[1])


def configure(config: TracingConfig) -> Tracer:
    """Set this process' tracer (once, at start; again only in tests)."""
    global _tracer
    _tracer.shutdown()
    _tracer = OtelTracer(config) if config.enabled else Tracer()
    if config.enabled:
        log.info("tracing: exporting spans of %s (ratio %.3g) to %s", config.name, config.sample_ratio, config.endpoint)
    return _tracer


def tracer() -> Tracer:
    """This process' tracer (off until configure())."""
    return _tracer


def http_carrier(headers: Mapping[bytes, bytes]) -> dict[str, str]:
    """Raw ASGI headers (lower-case bytes names) as a carrier holding the trace headers only."""
    return {
        name: headers[key].decode("latin-1")
        for name in (TRACEPARENT, "tracestate")
        if (key := name.encode()) in headers
    }


def metadata_carrier(metadata) -> dict[str, str]:
    """gRPC invocation metadata (pairs) as a carrier holding the trace headers only."""
    return {k: v for k, v in (metadata or ()) if k in (TRACEPARENT, "tracestate")}


def outgoing_metadata(span) -> tuple[tuple[str, str], ...] | None:
    """The gRPC metadata that carries `span`'s context to the callee (None when untraced)."""
    carrier: dict[str, str] = {}
    span.inject(carrier)
    return tuple(carrier.items()) or None
