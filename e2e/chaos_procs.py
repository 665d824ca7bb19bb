"""The chaos soak's processes (e2e/chaos.py): Redis, router replicas and workers as restartable
children with their own log files, and the throwaway credentials that secure them.

Secure by default, as `splitserve up` is: `Security.make(folder)` calls the same
`throwaway_security` (launch/up.py) for a throwaway CA, one key pair and a KV-transfer secret;
every worker serves its gRPC API over mutual TLS and authenticates KV transfers (also through
the KV proxy, which forwards the handshake like any other bytes), and every router replica
dials the workers with the client certificate (`--tls-cert/--tls-key/--tls-ca`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import psutil

MODEL = "smollm2-135m"
BIN = os.path.join(os.path.dirname(sys.executable), "splitserve")


try:  # under pytest (tests/ is on the path): the suite's ports, below the ephemeral range (tests/ports.py)
    from ports import free_port
except ImportError:  # `make chaos`: nothing else runs beside the soak

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"chaos: {what} did not happen within {timeout:.0f} s")
        time.sleep(0.1)


def http_get(url: str, timeout: float = 10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


@dataclass(frozen=True)
class Security:
    """The flags that secure the stack: `worker_args` for every worker, `router_args` for every
    router replica; both empty for a plaintext run (`--no-tls`)."""

    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()

    @classmethod
    def make(cls, directory: str) -> Security:
        from splitserve.launch.up import throwaway_security
        from splitserve.platform.settings.worker_args import WorkerArgs

        _, files = throwaway_security(directory)
        worker_args = WorkerArgs(**files).to_argv()
        tls = dict(zip(worker_args[::2], worker_args[1::2]))
        router_args = ("--tls-cert", tls["--tls-cert"], "--tls-key", tls["--tls-key"], "--tls-ca", tls["--tls-ca"])
        return cls(tuple(worker_args), router_args)

    @property
    def is_on(self) -> bool:
        return bool(self.worker_args)


class Proc:
    """A child process started from argv (own session, output to a log file); restartable."""

    def __init__(self, name: str, argv: list[str], logdir: str, ready=None):
        self.name, self.argv, self.ready = name, argv, ready
        self.log = open(os.path.join(logdir, f"{name}.log"), "ab")
        self.proc: subprocess.Popen | None = None
        self.baseline_rss = 0

    def start(self, argv: list[str] | None = None) -> Proc:
        self.proc = subprocess.Popen(
            argv or self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, timeout: float = 300) -> Proc:
        wait_for(lambda: self.proc.poll() is not None or self.ready(), timeout, f"{self.name} ready")
        if self.proc.poll() is not None:
            raise RuntimeError(f"chaos: {self.name} exited with {self.proc.returncode}; see its log")
        return self

    def signal(self, sig) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_mib(self) -> float:
        try:
            return psutil.Process(self.proc.pid).memory_info().rss / 2**20
        except (psutil.Error, AttributeError):
            return 0.0


class Worker(Proc):
    def __init__(self, role: str, transport: str, logdir: str, security: Security, proxied: bool = False):
        # a proxied worker binds 127.0.0.2 and advertises 127.0.0.1, where the KV proxy listens
        self.host = "127.0.0.2" if proxied else "127.0.0.1"
        self.proxied = proxied
        self.security = security
        self.grpc_port, self.metrics_port, self.kv_port = free_port(), free_port(), free_port()
        self.address = f"{self.host}:{self.grpc_port}"
        self.role, self.transport = role, transport
        super().__init__(
            f"{role}-{transport}",
            self.argv_for(MODEL),
            logdir,
            ready=lambda: http_get(f"http://{self.host}:{self.metrics_port}/ready")[0] == 200,
        )

    def argv_for(self, model: str) -> list[str]:
        return [
            BIN,
            "--log-level",
            "WARNING",
            "worker",
            "--role",
            self.role,
            "--model",
            model,
            "--threads",
            "1",
            "--kv-transport",
            self.transport,
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            "--kv-port",
            str(self.kv_port),
            "--kv-cache-memory",
            "0.25",
            "--max-model-len",
            "2048",
            "--host",
            self.host,
            "--advertise-host",
            "127.0.0.1",
            *self.security.worker_args,
        ]

    def start(self, argv: list[str] | None = None) -> Proc:
        if self.proc is not None and not self.proxied:  # the proxy listens on the proxied one's port
            # a restart gets a fresh KV port (UCX keeps a killed listener's port busy for a while;
            # the routers learn the new KV address from WorkerInfo); the gRPC port stays
            self.kv_port = free_port()
            argv = argv or self.argv_for(MODEL)
            argv[argv.index("--kv-port") + 1] = str(self.kv_port)
        return super().start(argv)

    def kv_state(self) -> dict:
        status, body = http_get(f"http://{self.host}:{self.metrics_port}/debug/kv")
        return json.loads(body) if status == 200 else {}

    def refuses_plaintext(self) -> bool:
        """True when a plaintext gRPC client gets nothing from this worker (mTLS is in force)."""
        import grpc

        from splitserve.platform.wire import worker_pb2 as pb

        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_stream(
                "/splitserve.v1.Worker/WatchEvents",
                request_serializer=pb.WatchEventsRequest.SerializeToString,
                response_deserializer=pb.WorkerEvent.FromString,
            )
            try:
                next(iter(call(pb.WatchEventsRequest(), timeout=10)))
            except grpc.RpcError as err:
                return err.code() == grpc.StatusCode.UNAVAILABLE
        return False

    def metric(self, name: str) -> float:
        """Sum of the samples of a Prometheus metric whose line starts with `name`."""
        status, body = http_get(f"http://{self.host}:{self.metrics_port}/metrics")
        return (
            sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(name))
            if status == 200
            else 0.0
        )


class RouterProc(Proc):
    def __init__(self, name: str, workers: list[Worker], redis_url: str, logdir: str, security: Security):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            BIN,
            "--log-level",
            "WARNING",
            "router",
            "--model",
            MODEL,
            "--port",
            str(self.port),
            "--workers",
            ",".join(w.address for w in workers),
            "--redis-url",
            redis_url,
            *security.router_args,
        ]
        super().__init__(name, argv, logdir, ready=lambda: http_get(self.url + "/ready")[0] == 200)


class Redis(Proc):
    def __init__(self, logdir: str):
        self.port = free_port()
        super().__init__(
            "redis",
            ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
            logdir,
            ready=self._ping,
        )

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
