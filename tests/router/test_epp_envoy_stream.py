"""The ext_proc stream lives as long as the HTTP request, with no response chunk sent to the EPP.

The shipped Envoy config (`envoy_config`) asks for the response headers only (response body
NONE): the EPP learns of the first token from the headers and of the request's end from the
stream's end. This runs a real Envoy with that config in front of a stand-in sidecar that streams
four chunks half a second apart, and an ext_proc server in this process that records what it is
sent: Envoy must keep the stream open until the response is over (the EPP's pending count ends
with the response, not at its first token), and must send no response body message (each would
be a round trip to the EPP per token).
"""

from __future__ import annotations

import asyncio
import http.server
import socketserver
import threading
import time
import urllib.request

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from ports import free_port

from splitserve.router.epp.envoy import envoy_config
from splitserve.router.epp.envoy_process import envoy_log, start_envoy

CHUNKS = 4


class _Sidecar(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    events: list[str] = []

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(CHUNKS):
            data = f"data: {i}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.5)
        self.events.append("sidecar sent the last chunk")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def do_GET(self):  # Envoy's active health check
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class _Recorder(ep_grpc.ExternalProcessorServicer):
    def __init__(self, events: list[str]):
        self.events = events

    async def Process(self, request_iterator, context):
        answers = {
            "request_headers": lambda: ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
            "request_body": lambda: ep.ProcessingResponse(request_body=ep.BodyResponse()),
            "response_headers": lambda: ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
            "response_body": lambda: ep.ProcessingResponse(response_body=ep.BodyResponse()),
        }
        try:
            async for request in request_iterator:
                kind = request.WhichOneof("request")
                self.events.append(kind)
                yield answers.get(kind, lambda: ep.ProcessingResponse(response_trailers=ep.TrailersResponse()))()
        finally:
            self.events.append("ext_proc stream ended")


def _wait_ready(admin: int, proc, path: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("envoy did not start:\n" + envoy_log(path)) from None
            time.sleep(0.2)


def _stream_through(port: int) -> list[bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", b"{}", {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return [line for line in resp if line.strip()]


def test_the_ext_proc_stream_ends_with_the_response_and_carries_no_chunk(tmp_path):
    events: list[str] = []
    _Sidecar.events = events
    sidecar_port = free_port()
    sidecar = socketserver.ThreadingTCPServer(("127.0.0.1", sidecar_port), _Sidecar)
    threading.Thread(target=sidecar.serve_forever, daemon=True).start()

    async def run() -> list[bytes]:
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(_Recorder(events), server)
        grpc_port = free_port()
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        port, admin = free_port(), free_port()
        path = str(tmp_path / "envoy.yaml")
        envoy = start_envoy(envoy_config(port, [f"127.0.0.1:{sidecar_port}"], f"127.0.0.1:{grpc_port}", admin), path)
        try:
            await asyncio.to_thread(_wait_ready, admin, envoy, path)
            lines = await asyncio.to_thread(_stream_through, port)
            for _ in range(100):  # Envoy closes the stream once the response is done
                if "ext_proc stream ended" in events:
                    break
                await asyncio.sleep(0.05)
            return lines
        finally:
            envoy.terminate()
            envoy.wait(10)
            await server.stop(0)

    try:
        lines = asyncio.run(run())
    finally:
        sidecar.shutdown()
        sidecar.server_close()
    assert len(lines) == CHUNKS
    assert "response_body" not in events, events
    assert "response_headers" in events, events
    assert events.index("sidecar sent the last chunk") < events.index("ext_proc stream ended"), events
