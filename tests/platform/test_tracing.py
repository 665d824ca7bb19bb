"""platform/observability/tracing.py and platform/observability/logfmt.py: spans exported over real OTLP gRPC to a receiver
(opentelemetry-proto's TraceService, tests/otlp_receiver.py), W3C propagation, parent-based
sampling, no cost when off, and log lines that carry the trace ids."""

import io
import json
import logging
import os
import subprocess
import sys
import time

import pytest
from otlp_receiver import OtlpReceiver

from splitserve.platform.errors import ConfigError
from splitserve.platform.observability import logfmt, tracing

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def traceparent(sampled: bool = True) -> str:
    return f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{'01' if sampled else '00'}"


@pytest.fixture
def receiver():
    with OtlpReceiver() as r:
        yield r


def tracer_to(receiver, role="router", ratio=1.0):
    return tracing.OtelTracer(tracing.TracingConfig(role=role, endpoint=receiver.endpoint, sample_ratio=ratio))


def test_off_imports_no_opentelemetry_and_spans_are_noop():
    code = (
        "import sys; from splitserve.platform.observability import tracing as t; "
        "tr = t.configure(t.config_from('router', env={})); s = tr.start('x', {'traceparent': 'junk'}); "
        "c = {}; s.inject(c); s.child('y').end(); "
        "print(tr.enabled, s is t.NOOP, c, sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "{}", "[]"]


def test_config_reads_flags_over_otel_env():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_SERVICE_NAME": "gw-eu",
    }
    cfg = tracing.config_from("router", env=env)
    assert (cfg.endpoint, cfg.sample_ratio, cfg.name, cfg.enabled) == ("http://collector:4317", 0.25, "gw-eu", True)
    cfg = tracing.config_from("decode", "http://other:4317", 1.0, env=env)
    assert (cfg.endpoint, cfg.sample_ratio) == ("http://other:4317", 1.0)
    assert tracing.config_from("decode", env={**env, "OTEL_SDK_DISABLED": "true"}).enabled is False
    assert tracing.config_from("prefill", env={}).name == "splitserve-prefill"
    assert tracing.tracing_argv(cfg)[:2] == ["--otlp-traces-endpoint", "http://other:4317"]


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        (dict(role="gateway"), {}, "allowed: router, decode, prefill, worker, epp"),
        (dict(role="router", sample_ratio=1.5), {}, "allowed: 0.0 to 1.0"),
        (dict(role="router"), {"OTEL_TRACES_SAMPLER_ARG": "half"}, "allowed: a number from 0.0 to 1.0"),
    ],
)
def test_bad_config_says_what_is_allowed(kwargs, env, message):
    with pytest.raises(ConfigError, match=message):
        tracing.config_from(kwargs.pop("role"), env=env, **kwargs)


def test_spans_honour_the_client_traceparent_and_nest(receiver):
    tracer = tracer_to(receiver, "decode")
    t0 = time.monotonic()
    root = tracer.start("worker.generate", {"traceparent": traceparent()}, attributes={"gen_ai.request.model": "m"})
    root.record("worker.queue", t0, t0 + 0.25)
    with root.child("kv.receive", attributes={"splitserve.kv.num_blocks": 3}) as kv:
        kv.set("splitserve.kv.num_bytes", 4096)
    carrier = {}
    root.inject(carrier)
    root.end()
    tracer.shutdown()
    spans = {s.name: s for s in receiver.wait_for(CLIENT_TRACE, {"worker.generate", "worker.queue", "kv.receive"})}
    assert set(spans) == {"worker.generate", "worker.queue", "kv.receive"}
    assert spans["worker.generate"].parent_id == CLIENT_SPAN
    assert spans["worker.queue"].parent_id == spans["kv.receive"].parent_id == spans["worker.generate"].span_id
    assert spans["worker.queue"].duration_s == pytest.approx(0.25, abs=1e-3)
    assert spans["kv.receive"].attributes == {"splitserve.kv.num_blocks": 3, "splitserve.kv.num_bytes": 4096}
    assert spans["worker.generate"].service == "splitserve-decode" and len(spans["worker.generate"].instance) == 32
    assert abs(spans["worker.generate"].start_s - time.time()) < 60  # monotonic times became wall-clock
    assert carrier["traceparent"] == f"00-{CLIENT_TRACE}-{spans['worker.generate'].span_id}-01"


def test_sampling_is_parent_based(receiver):
    tracer = tracer_to(receiver, ratio=0.0)
    own = tracer.start("dropped")  # no parent: the ratio (0) decides
    carrier = {}
    own.inject(carrier)
    own.end()
    sampled_flag = int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1
    assert not own.is_recording and sampled_flag == 0  # downstream drops it too
    kept = tracer.start("kept", {"traceparent": traceparent(sampled=True)})  # a sampled caller is honoured
    kept.end()
    unsampled = tracer.start("declined", {"traceparent": traceparent(sampled=False)})
    assert not unsampled.is_recording
    tracer.shutdown()
    assert [s.name for s in receiver.wait_for(CLIENT_TRACE, {"kept"})] == ["kept"]
    assert {s.name for s in receiver.spans} == {"kept"}


def test_failed_span_has_error_status(receiver):
    tracer = tracer_to(receiver)
    with pytest.raises(RuntimeError):
        with tracer.start("boom", {"traceparent": traceparent()}):
            raise RuntimeError("worker lost")
    tracer.shutdown()
    [span] = receiver.wait_for(CLIENT_TRACE, {"boom"})
    assert span.status_code == 2  # STATUS_CODE_ERROR


def test_metadata_helpers_keep_only_trace_headers():
    md = (("x-request-id", "r1"), ("traceparent", traceparent()), ("tracestate", "a=b"))
    assert tracing.metadata_carrier(md) == {"traceparent": traceparent(), "tracestate": "a=b"}
    assert tracing.outgoing_metadata(tracing.NOOP) is None


def _log_through(fmt: str, span) -> str:
    stream = io.StringIO()
    handler = logfmt.setup("INFO", fmt, stream)
    try:
        span.activate()
        logging.getLogger("splitserve.test").warning("remote prefill failed")
        tracing.current_ids.set(("", ""))
        logging.getLogger("splitserve.test").warning("outside a request")
    finally:
        logging.getLogger().removeHandler(handler)
    return stream.getvalue()


def test_log_lines_carry_trace_and_span_ids(receiver):
    tracer = tracer_to(receiver)
    span = tracer.start("worker.generate", {"traceparent": traceparent()})
    inside, outside = _log_through("json", span).splitlines()
    entry = json.loads(inside)
    assert (entry["trace_id"], entry["span_id"], entry["level"]) == (CLIENT_TRACE, span.span_id, "WARNING")
    assert entry["message"] == "remote prefill failed" and "trace_id" not in json.loads(outside)
    inside, outside = _log_through("text", span).splitlines()
    assert inside.endswith(f"remote prefill failed trace_id={CLIENT_TRACE} span_id={span.span_id}")
    assert outside.endswith("outside a request")
    span.end()
    tracer.shutdown()


def test_log_format_is_validated_and_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_LOG_FORMAT", "json")
    assert logfmt.log_format(None) == "json" and logfmt.log_format("text") == "text"
    with pytest.raises(ValueError, match="allowed: text, json"):
        logfmt.log_format("xml")
    env = {**os.environ, "SPLITSERVE_LOG_FORMAT": "yaml"}
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.platform.cli", "generate", "x"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and "allowed: text, json" in done.stderr
