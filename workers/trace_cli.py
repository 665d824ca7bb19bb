"""`splitserve trace REQUEST_ID`: where one request's time went.

    splitserve trace chatcmpl-1f0c... --worker 10.0.0.7:9090 --worker 10.0.0.8:9090
    splitserve trace chatcmpl-1f0c... --spans traces.jsonl

With `--worker` (a worker's metrics port, repeatable): each worker's record of the request
(/debug/requests/<id>, workers/records.py), printed as the TTFT breakdown — queue, prefill (on
which prefill worker, how long its compute and the exposed KV transfer took), first token — and
the totals. Records are kept for the worker's last few thousand requests.

With `--spans FILE`: spans exported in OTLP JSON, one ExportTraceServiceRequest per line (the
OpenTelemetry Collector's `file` exporter writes this; so does `--spans-out` of the tests' OTLP
receiver). The request's trace (the one whose spans carry `splitserve.request_id`, or whose id
is REQUEST_ID) is printed as a tree: each span's service, start offset and duration.

Exit status 1 when nothing was found, 2 for bad arguments.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass


def register(subparsers) -> None:
    p = subparsers.add_parser("trace", help="show where one request's time went (worker records or exported spans)")
    p.add_argument("request_id", help="the request id (the response's `id`, the X-Request-Id header) or a trace id")
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a worker's metrics address to ask for its record of the request (repeatable)",
    )
    p.add_argument("--spans", default=None, metavar="FILE", help="OTLP JSON lines with exported spans")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args) -> int:
    if not args.worker and not args.spans:
        print("splitserve trace: give --worker HOST:PORT (repeatable) and/or --spans FILE", file=sys.stderr)
        return 2
    found = False
    for address in args.worker:
        record = fetch_record(address, args.request_id)
        if record is not None:
            found = True
            print(format_record(address, record))
    if args.spans:
        spans = trace_of(read_spans(args.spans), args.request_id)
        if spans:
            found = True
            print(format_tree(spans))
    if not found:
        print(f"splitserve trace: no record or span of {args.request_id!r} found", file=sys.stderr)
    return 0 if found else 1


# -- worker records ----------------------------------------------------------------------------
def fetch_record(address: str, request_id: str) -> dict | None:
    url = f"http://{address}/debug/requests/{urllib.parse.quote(request_id, safe='')}"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:9.1f} ms"


def format_record(address: str, r: dict) -> str:
    lines = [
        f"request {r['request_id']} on the {r.get('role', '?')} worker at {address}"
        + (f" (trace {r['trace_id']})" if r.get("trace_id") else "")
    ]
    tokens = f"{r.get('num_prompt_tokens', 0)} prompt tokens, {r.get('num_cached_tokens', 0)} cached"
    if "first_token_s" not in r:  # a prefill worker's record
        lines += [
            f"  prefill compute {_ms(r.get('prefill_s', 0.0))}   {tokens}",
            f"  KV transfer wait{_ms(r.get('transfer_wait_s', 0.0))}   {r.get('kv_bytes', 0)} bytes, "
            f"transfer {r.get('transfer_id', '')}",
        ]
        return "\n".join(lines)
    queue, prefill, wait = r.get("queue_s", 0.0), r.get("prefill_s", 0.0), r.get("transfer_wait_s", 0.0)
    where = (
        f"remote, on {r['prefill_worker']}"
        if r.get("prefill_worker")
        else "remote failed, then local"
        if r.get("remote_prefill")
        else "local"
    )
    lines += [
        f"  queue           {_ms(queue)}   until KV blocks were allocated",
        f"  prefill         {_ms(prefill)}   {where}; {tokens}",
    ]
    if wait:
        lines.append(f"  KV transfer wait{_ms(wait)}   exposed (not overlapped with compute)")
    if r.get("kv_pull_s"):
        lines.append(f"  KV pull         {_ms(r['kv_pull_s'])}")
    rest = r["first_token_s"] - queue - prefill - wait - r.get("kv_pull_s", 0.0)
    lines += [
        f"  to first token  {_ms(max(rest, 0.0))}   the rest: RPCs and the first decode step",
        f"  TTFT            {_ms(r['first_token_s'])}   on this worker",
    ]
    if "e2e_s" in r:
        lines.append(
            f"  total           {_ms(r['e2e_s'])}   {r.get('num_output_tokens', 0)} output tokens, "
            f"finish reason {r.get('finish_reason', '')}"
        )
    return "\n".join(lines)


# -- exported spans ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SpanRow:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict


def read_spans(path: str) -> list[SpanRow]:
    """Every span in an OTLP JSON lines file (ExportTraceServiceRequest / TracesData per line)."""
    from google.protobuf import json_format
    from opentelemetry.proto.trace.v1 import trace_pb2

    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            data = json_format.Parse(line, trace_pb2.TracesData(), ignore_unknown_fields=True)
            for rs in data.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {kv.key: json_format.MessageToDict(kv.value) for kv in s.attributes}
                        rows.append(
                            SpanRow(
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.name,
                                resource.get("service.name", ""),
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                {k: next(iter(v.values()), None) for k, v in attrs.items()},
                            )
                        )
    return rows


def trace_of(rows: list[SpanRow], request_id: str) -> list[SpanRow]:
    """The spans of the trace that served `request_id` (or of the trace with that id)."""
    trace_ids = {
        r.trace_id for r in rows if r.trace_id == request_id or r.attributes.get("splitserve.request_id") == request_id
    }
    return sorted((r for r in rows if r.trace_id in trace_ids), key=lambda r: r.start_ns)


def format_tree(rows: list[SpanRow]) -> str:
    ids = {r.span_id for r in rows}
    children: dict[str, list[SpanRow]] = {}
    for r in rows:
        children.setdefault(r.parent_id if r.parent_id in ids else "", []).append(r)
    t0 = min(r.start_ns for r in rows)
    lines = [f"trace {rows[0].trace_id}: {len(rows)} spans, {(max(r.end_ns for r in rows) - t0) / 1e6:.1f} ms"]

    def walk(parent: str, depth: int) -> None:
        for r in children.get(parent, []):
            label = f"{'  ' * depth}{r.name}"
            lines.append(
                f"  {label:<34} {r.service:<20} +{(r.start_ns - t0) / 1e6:9.1f} ms "
                f"{(r.end_ns - r.start_ns) / 1e6:9.1f} ms"
            )
            walk(r.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
