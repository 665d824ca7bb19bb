"""Worker processes for tests: real `splitserve worker` subprocesses on 127.0.0.1.

Secure by default, as `splitserve up` is: every WorkerProc serves its gRPC API over mutual TLS
and authenticates KV transfers with a secret, both from one throwaway CA, key pair and secret per
test process (`security()`, made by the same `throwaway_security` that `splitserve up` calls).
Tests reach a worker with `worker_channel(address)` (mTLS with that key pair) and configure a
router with `routerkit.router_config(..., tls=security().tls)`. `secure=False` is for a test that brings its
own credentials or needs a plaintext worker; it says why.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

from ports import free_port

from splitserve.platform.wire.grpc_tls import TlsFiles, aio_channel

CLI = str(pathlib.Path(sys.executable).parent / "splitserve")
# What `splitserve worker` and `splitserve up` serve by default (their --quantization default):
# tests that compare a worker's answer with an engine in the test process build that engine so.
WORKER_QUANTIZATION = "auto"
# discovery.stale_after_s of a test router in front of worker processes. A worker reports its
# load every 0.5 s, but one starved of CPU (nice 19 beside busy processes) can stay silent for
# many seconds, and a router that marks it down fails the requests in flight on it: a flake
# seen at 2 s. A SIGKILLed worker is noticed at once by its broken stream, not by this.
ROUTER_STALE_AFTER_S = 30.0


@dataclass(frozen=True)
class Security:
    """This test process' throwaway credentials: `tls` for clients and routers, `worker_args`
    (--tls-cert/--tls-key/--tls-ca/--kv-secret-file) for workers."""

    tls: TlsFiles
    worker_args: tuple[str, ...]


@functools.cache
def security() -> Security:
    """Made once per test process in a private temporary folder, removed at exit."""
    import shutil
    import tempfile

    from splitserve.launch.up import throwaway_security
    from splitserve.platform.settings.worker_args import WorkerArgs

    directory = tempfile.mkdtemp(prefix="splitserve-test-pki-")
    atexit.register(shutil.rmtree, directory, True)
    overrides, files = throwaway_security(directory)
    worker_args = WorkerArgs(**files).to_argv()
    tls = TlsFiles(overrides["discovery.tls_cert"], overrides["discovery.tls_key"], overrides["discovery.tls_ca"])
    return Security(tls, tuple(worker_args))


def worker_channel(address: str, options=(), tls: TlsFiles | None = None):
    """A grpc.aio channel to a worker started by WorkerProc (mTLS with `security()`); create it
    inside the event loop that uses it. `tls` overrides the credentials."""
    return aio_channel(address, tls or security().tls, options)


class WorkerProc:
    """One worker process; `start()` waits for its READY line. With `secure` (the default) it
    serves mTLS and authenticates KV transfers (the module docstring); `extra` arguments come
    after those flags, so a test's own --kv-secret-file or --tls-* wins."""

    def __init__(
        self,
        role: str,
        transport: str = "tcp",
        *extra: str,
        env: dict | None = None,
        kv_cache_gib: float = 0.25,
        ports: tuple[int, int, int] | None = None,
        secure: bool = True,
    ):
        self.role, self.transport = role, transport
        self.secure = secure
        self.grpc_port, self.metrics_port, self.kv_port = ports or (free_port(), free_port(), free_port())
        secure_args = security().worker_args if secure else ()
        self.args = [
            CLI,
            "--log-level",
            "INFO",
            "worker",
            "--role",
            role,
            "--model",
            "smollm2-135m",
            "--threads",
            "1",
            "--kv-transport",
            transport,
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            "--kv-port",
            str(self.kv_port),
            "--kv-cache-memory",
            str(kv_cache_gib),
            "--max-model-len",
            "2048",
            *secure_args,
            *extra,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def channel(self, options=()):
        """A grpc.aio channel to this worker: mTLS when it is secure, else plaintext."""
        return worker_channel(self.address, options) if self.secure else aio_channel(self.address, None, options)

    def start(self, timeout: float = 180) -> WorkerProc:
        self.lines = []
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env
        )
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(self.proc, ready), daemon=True).start()
        if not ready.wait(timeout):
            self.kill()
            raise RuntimeError(f"worker {self.role} did not become ready:\n" + "".join(self.lines[-30:]))
        return self

    def _pump(self, proc, ready) -> None:
        for line in proc.stdout:
            self.lines.append(line)
            if line.startswith("READY"):
                ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def kv_state(self) -> dict:
        return json.loads(self.get("/debug/kv")[1])

    def metric(self, name: str) -> float:
        """Sum of all samples of a Prometheus metric line prefix,
        e.g. 'splitserve_kv_transfer_bytes_sum{direction="in"}'."""
        text = self.get("/metrics")[1].decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def wait_idle(self, timeout: float = 30) -> dict:
        """Wait until no request holds blocks; returns the final kv state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.kv_state()
            if state["num_requests_holding_blocks"] == 0 and state["num_requests"] == 0:
                return state
            if time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    def terminate(self, timeout: float = 60) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def rank_processes(parent) -> list:
    """The live tensor-parallel rank processes below `parent` (a psutil.Process; zombies are gone already)."""
    import psutil

    ranks = []
    for p in parent.children(recursive=True):
        try:
            if "splitserve.platform.parallel.rank" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                ranks.append(p)
        except psutil.NoSuchProcess:
            pass
    return ranks
