"""Test kit for the inference-gateway path: `splitserve sidecar`, `splitserve epp` and Envoy as
real processes on 127.0.0.1, in front of WorkerProcs (tests/workerproc.py).

    EppStack(decode=[D1, D2], prefill=[P]).start()
        sidecars S1, S2 (one per decode worker), one EPP, and one Envoy per `envoys` entry
        (name -> fail_open, or None for round robin without an EPP)

Each process is started from the CLI a user would type; `stop()` ends them all (SIGTERM, then
SIGKILL). The router config the EPP and the sidecars share is written to a temporary file.
Secured as a deployment is: the EPP serves ext_proc over mTLS and each Envoy presents the test
process' throwaway client certificate (`epp_tls`). `debug_headers` keeps the x-splitserve-*-worker
response headers, which the tests read to see where a request went.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from routerkit import free_port
from workerproc import CLI, ROUTER_STALE_AFTER_S, security

from splitserve.router.epp.envoy import EppTls, envoy_config
from splitserve.router.epp.envoy_process import envoy_log, start_envoy


def http_get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


class CliProcess:
    """A `splitserve` subcommand; `wait(url)` polls until the URL answers 200."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(
            [CLI, "--log-level", "INFO", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, url: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while http_get(url, 5)[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not become ready at {url}:\n" + "".join(self.lines[-30:]))
            time.sleep(0.3)

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class EppStack:
    def __init__(
        self,
        decode: list,
        prefill: list,
        min_prefill_tokens: int = 128,
        envoys: dict[str, bool | None] | None = None,
        debug_headers: bool = True,
    ):
        self.debug_headers = debug_headers
        self.decode, self.prefill = decode, prefill
        self.envoys_wanted = envoys if envoys is not None else {"epp": False}
        self.tmp = tempfile.TemporaryDirectory(prefix="splitserve-epp-")
        self.config_path = os.path.join(self.tmp.name, "router.json")
        with open(self.config_path, "w") as f:
            json.dump(
                {
                    "discovery": {"stale_after_s": ROUTER_STALE_AFTER_S},
                    "placement": {"disaggregation": {"min_prefill_tokens": min_prefill_tokens}},
                },
                f,
            )
        tls = security().tls
        self.tls_args = ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]
        self.epp_tls = EppTls(tls.cert, tls.key, tls.ca)
        self.serve_tls_args = [
            "--serve-tls-cert",
            tls.cert,
            "--serve-tls-key",
            tls.key,
            "--serve-tls-client-ca",
            tls.ca,
        ]
        self.sidecar_ports = [free_port() for _ in decode]
        self.sidecars: list[CliProcess] = []
        self.epp: CliProcess | None = None
        self.envoys: dict[str, subprocess.Popen] = {}
        self.envoy_ports: dict[str, int] = {}
        self.grpc_port, self.health_port = free_port(), free_port()

    @property
    def sidecar_endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.sidecar_ports]

    @property
    def prefill_addresses(self) -> str:
        return ",".join(w.address for w in self.prefill)

    def start(self) -> EppStack:
        for worker, port in zip(self.decode, self.sidecar_ports, strict=True):
            self.sidecars.append(
                CliProcess(
                    f"sidecar {port}",
                    [
                        "sidecar",
                        "--config",
                        self.config_path,
                        "--decode",
                        worker.address,
                        "--workers",
                        self.prefill_addresses,
                        "--port",
                        str(port),
                        *self.tls_args,
                    ],
                )
            )
        self.start_epp()
        for sidecar, port in zip(self.sidecars, self.sidecar_ports, strict=True):
            sidecar.wait(f"http://127.0.0.1:{port}/ready")
        for name, fail_open in self.envoys_wanted.items():
            self.start_envoy(name, fail_open)
        return self

    def start_epp(self) -> None:
        workers = ",".join(w.address for w in self.decode + self.prefill)
        endpoints = [f"--endpoint={w.address}={e}" for w, e in zip(self.decode, self.sidecar_endpoints, strict=True)]
        self.epp = CliProcess(
            "epp",
            [
                "epp",
                "--config",
                self.config_path,
                "--workers",
                workers,
                *endpoints,
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(self.grpc_port),
                "--health-port",
                str(self.health_port),
                *self.tls_args,
                *self.serve_tls_args,
            ],
        )
        self.epp.wait(f"http://127.0.0.1:{self.health_port}/ready")

    def start_envoy(self, name: str, fail_open: bool | None) -> None:
        port, admin = free_port(), free_port()
        epp = None if fail_open is None else f"127.0.0.1:{self.grpc_port}"
        config = envoy_config(
            port,
            self.sidecar_endpoints,
            epp,
            admin,
            bool(fail_open),
            tls=self.epp_tls,
            debug_headers=self.debug_headers,
        )
        self.admin_ports = {**getattr(self, "admin_ports", {}), name: admin}
        path = os.path.join(self.tmp.name, f"envoy-{name}.yaml")
        proc = start_envoy(config, path)
        self.envoys[name], self.envoy_ports[name] = proc, port
        deadline = time.monotonic() + 60
        while http_get(f"http://127.0.0.1:{admin}/ready", 2)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"envoy {name} did not start:\n{envoy_log(path)}")
            time.sleep(0.2)

    def url(self, envoy: str = "epp") -> str:
        return f"http://127.0.0.1:{self.envoy_ports[envoy]}/v1"

    def stop(self) -> None:
        for proc in self.envoys.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        for p in [self.epp, *self.sidecars]:
            if p is not None:
                p.stop()
        self.tmp.cleanup()


def sidecar_log_decode(stack: EppStack) -> str:
    return "".join(line for s in stack.sidecars for line in s.lines if re.search("decode", line))


class PoolMember:
    """A stand-in sidecar (or, outside the pool, a decoy) on 127.0.0.1: /ready answers 200 while
    `is_ready`, any other request is recorded and answered with JSON naming this member and the
    x-prefiller-host-port it received. `close()` takes it away (its port refuses connections)."""

    def __init__(self, name: str):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        member = self
        self.name, self.is_ready = name, True
        self.hits: list[tuple[str, str, dict[str, str]]] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                if self.path == "/ready":
                    status, body = (200 if member.is_ready else 503), b"{}"
                else:
                    member.hits.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                    status = 200
                    body = json.dumps({"member": member.name, "prefiller": self.headers.get("x-prefiller-host-port")})
                    body = body.encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.send_header("x-splitserve-decode-worker", "10.1.2.3:50051")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def h2_request(
    port: int, path: str, headers: dict[str, str], body: bytes, trailers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/2 (prior knowledge, plaintext) request, with request trailers when given: the
    body then goes out without END_STREAM, and a HEADERS frame of trailers ends the stream."""
    import socket

    import h2.config
    import h2.connection
    import h2.events

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    answer: dict = {"status": 0, "headers": {}, "data": bytearray(), "done": False}

    def pump(sock) -> None:
        chunk = sock.recv(65536)
        if not chunk:
            answer["done"] = True
        for event in conn.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived):
                answer["headers"] = dict(event.headers)
                answer["status"] = int(answer["headers"][":status"])
            elif isinstance(event, h2.events.DataReceived):
                answer["data"] += event.data
                conn.acknowledge_received_data(event.flow_controlled_length, 1)
            elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                answer["done"] = True
        sock.sendall(conn.data_to_send())

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        conn.initiate_connection()
        request = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", f"127.0.0.1:{port}")]
        conn.send_headers(1, request + list(headers.items()))
        sock.sendall(conn.data_to_send())
        left = memoryview(body)
        while len(left) and not answer["done"]:
            size = min(len(left), conn.local_flow_control_window(1), conn.max_outbound_frame_size)
            if size == 0:
                pump(sock)  # wait for a window update
                continue
            conn.send_data(1, left[:size].tobytes())
            left = left[size:]
            sock.sendall(conn.data_to_send())
        if not answer["done"]:
            if trailers is not None:
                conn.send_headers(1, list(trailers.items()), end_stream=True)
            else:
                conn.end_stream(1)
            sock.sendall(conn.data_to_send())
        while not answer["done"]:
            pump(sock)
        return answer["status"], answer["headers"], bytes(answer["data"])
