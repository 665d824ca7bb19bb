"""An OTLP trace receiver for tests: opentelemetry-proto's TraceService over grpcio.

It speaks the collector's real protocol (ExportTraceServiceRequest over gRPC on a loopback
port), so the exporters in the processes under test are unchanged: they are pointed at
`receiver.endpoint`. Received spans are flattened to `Span` records (hex ids, wall-clock
seconds, the resource's service.name and plain attribute values); `write_jsonl` saves what
arrived as OTLP JSON lines, as the Collector's file exporter does.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tsvc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsvc_grpc


@dataclass(frozen=True)
class Span:
    service: str
    instance: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_s: float
    end_s: float
    kind: int
    attributes: dict
    status_code: int

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver(tsvc_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[Span] = []
        self._requests: list = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tsvc_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        received = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(
                        Span(
                            service=resource.get("service.name", ""),
                            instance=resource.get("service.instance.id", ""),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_s=s.start_time_unix_nano / 1e9,
                            end_s=s.end_time_unix_nano / 1e9,
                            kind=s.kind,
                            attributes=_attributes(s.attributes),
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
            self._requests.append(request)
        return tsvc.ExportTraceServiceResponse()

    def write_jsonl(self, path) -> None:
        with self._lock, open(path, "w", encoding="utf-8") as f:
            for request in self._requests:
                f.write(json_format.MessageToJson(request, indent=None) + "\n")

    def shown_tree(self, cli: str, request_id: str, folder) -> tuple[str, dict[str, int]]:
        """`splitserve trace REQUEST_ID --spans FILE` over what arrived: its header line, and the
        indent of each span name in the tree it prints (deeper = nested further)."""
        import subprocess

        spans_file = folder / "spans.jsonl"
        self.write_jsonl(spans_file)
        shown = subprocess.run(
            [cli, "trace", request_id, "--spans", str(spans_file)], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        header, *lines = shown.stdout.splitlines()
        return header, {line.split()[0]: len(line) - len(line.lstrip()) for line in lines}

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30.0) -> list[Span]:
        """The trace's spans once every name in `names` arrived (or what came by the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=0)
