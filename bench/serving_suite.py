"""The serving suite of `make bench` (issue 6): W1–W4 against splitserve's own baselines, and a
peer (llama-cpp-python's OpenAI server) on the same machine, all through `splitserve bench`.

    python bench/serving_suite.py --write docs/benchmarks.md [--plots docs/bench] [--quick]
        [--only w1,w2,w3,w4,peer] [--peer-python .venv-peer/bin/python]

Every arm has the same resources: two worker processes pinned to one core each (`taskset`, one
torch thread), the same KV capacity per worker (`KV_BLOCKS` blocks, set through
--kv-cache-memory and read back from each worker's /debug/kv), the same model and dtype. The
router and the client are not pinned: they share the two cores with the workers, alike in every
arm (the client's CPU time is in each result). Between arms every process is restarted, so no
arm inherits another's prefix cache; the arms of one workload run back to back at each load
point (interleaved), so drift of the machine hits them alike. Workload definitions, expected
directions and falsifiers: docs/bench.md (written before any run).

Arms
- routing (W1, W2, W4): two colocated workers (`--role both`), the router's decode profile
  set to `round-robin`; `least-queue` (queue-depth + pending-assignments); `prefix-only`
  (prefix-overlap alone); `prefix+queue` (the default profile, ours); W1 also `no-cache`
  (ours with the workers' prefix caching off: the floor).
- disaggregation (W3, W4): `colocated` (two `both` workers, ours, no chunked prefill);
  `colocated+chunked` (chunks of CHUNK tokens); `1P1D` (one prefill + one decode worker, every
  prompt prefilled remotely, KV over UCX — TCP when ucxx is missing); `1P1D-conditional`
  (remote only when at least COND_TOKENS tokens are uncached).

Results: the section between <!-- serving:begin/end --> (docs/benchmarks/serving.md for --write
docs/benchmarks.md), PNG plots in --plots, the summaries (no per-request records) in
--plots/serving-summary.json, raw JSON in a temp folder.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import platform as stdlib_platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import cpu_model, markers, require, section_path, write_section  # noqa: E402

MODEL = "smollm2-135m"
# Per worker: 2,048 tokens in 16-token blocks. W1's 8 system prompts (8 x 16 blocks) fill one
# worker's pool with nothing left for the requests themselves, while 4 of them (one worker's share
# under prefix routing) fit with room to spare; W2's 6 sessions (~30 blocks each at the last
# turn) fit two workers, not one.
KV_BLOCKS = 128
# The workers store KV as float16 (`--kv-cache-dtype float16`, what `auto` picks in the fast modes),
# set explicitly so that the budget below gives KV_BLOCKS on every host. (Sized for float32 while
# `auto` already stored float16, the workers got 257 blocks, not 128, and W1's cache pressure was
# gone; the report printed both numbers.)
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 2  # K+V x 30 layers x 16 tokens x 3 KV heads x 64 dims x float16
CHUNK = 128  # prefill chunk of the chunked arm (tokens per step)
COND_TOKENS = 128  # conditional disaggregation threshold
SEED = 0
# W3's load, as docs/research's W3 defines it: long prompts arrive at a rate that keeps the single
# prefill core of 1P1D about half busy, beside 0.5-1 interactive requests/s. A fixed rate cannot
# do that on every host (0.24 long prompts/s kept it ~60 % busy when the rates were set, and 27 %
# on a Zen 4 EPYC: 1.12 s a prefill), so the suite first times one long prefill on this host.
# Load points: (prefill core busy, interactive requests/s).
W3_LONG = (512, 768)
W3_LOADS = ((0.5, 0.8), (0.3, 0.5))
W3_INTERACTIVE = 42  # interactive requests per arm and load point (quick: 14)
W3_FIXED = (0.8, 0.5)  # --w3-fixed: total req/s with 30 % long (the runs before calibration)


# ---- arms ----------------------------------------------------------------------------------------
SCORERS = {
    "round-robin": [{"name": "round-robin", "weight": 1}],
    "least-queue": [{"name": "queue-depth", "weight": 3}, {"name": "pending-assignments", "weight": 1}],
    "prefix-only": [{"name": "prefix-overlap", "weight": 1}],
    "prefix+queue": None,  # the default decode profile
    "expected-latency": [{"name": "expected-latency", "weight": 1}],  # bench/sweep.py's arm only
}


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    roles: tuple[str, ...] = ("both", "both")
    scorers: str = "prefix+queue"
    mode: str = "never"  # the router's disaggregation mode
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()  # extra, prefill role only
    kv_pull: bool = True  # the router's pull-instead-of-recompute (placement.kv_pull)

    def router_config(self, port: int, workers: list[str], max_model_len: int = 2048) -> dict:
        placement = {"disaggregation": {"mode": self.mode, "min_prefill_tokens": COND_TOKENS}}
        if SCORERS[self.scorers] is not None:
            placement["decode"] = {"scorers": SCORERS[self.scorers]}
        if not self.kv_pull:
            placement["kv_pull"] = {"enabled": False}
        return {
            "model": MODEL,
            "max_model_len": max_model_len,
            "gateway": {"host": "127.0.0.1", "port": port, "max_concurrent_requests": 512, "max_queued_requests": 4096},
            # a pinned worker on a busy host can report late: not down (as bench/epp_w1.py's EPP)
            "discovery": {"workers": workers, "stale_after_s": 30},
            "placement": placement,
        }


ROUTING = [Arm(name, scorers=name) for name in ("round-robin", "least-queue", "prefix-only", "prefix+queue")]
NO_CACHE = Arm("no-cache", worker_args=("--no-prefix-caching",))
DISAGG = [
    Arm("colocated", worker_args=("--no-chunked-prefill",)),
    Arm("colocated+chunked", worker_args=("--max-num-batched-tokens", str(CHUNK))),
    Arm("1P1D", roles=("prefill", "decode"), mode="always", worker_args=("--disaggregation", "always")),
    Arm(
        "1P1D-conditional",
        roles=("prefill", "decode"),
        mode="conditional",
        worker_args=("--disaggregation", "conditional", "--min-prefill-tokens", str(COND_TOKENS)),
    ),
]


@dataclasses.dataclass(frozen=True)
class Run:
    """One `splitserve bench` invocation against one arm."""

    workload: str
    arm: Arm
    num_requests: int
    rate: float | None = None
    concurrency: int | None = None
    warmup: int = 2
    params: tuple[tuple[str, str], ...] = ()
    extra_body: str = ""
    text_prompts: bool = False
    seed: int = SEED  # the workload's and the arrivals' seed

    @property
    def load(self) -> str:
        return f"rate {self.rate}/s" if self.rate else f"concurrency {self.concurrency}"

    def bench_args(self, url: str, output: str) -> list[str]:
        args = [
            "--url",
            url,
            "--model",
            MODEL,
            "--workload",
            self.workload,
            "--num-requests",
            str(self.num_requests),
            "--warmup",
            str(self.warmup),
            "--seed",
            str(self.seed),
            "--no-progress",
            "--output",
            output,
            "--request-timeout",
            "900",
        ]
        args += ["--rate", str(self.rate)] if self.rate else ["--concurrency", str(self.concurrency)]
        for key, value in self.params:
            args += ["--workload-param", f"{key}={value}"]
        if self.extra_body:
            args += ["--extra-body", self.extra_body]
        if self.text_prompts:
            args += ["--prompt-format", "text", "--tokenizer", MODEL]
        return args


def w3_plan(quick: bool, prefill_s: float | None) -> list[list[Run]]:
    """W3's groups: at each of W3_LOADS, long prompts at busy / prefill_s per second (the mean
    long prompt's prefill on one core takes prefill_s) beside the interactive rate; None: the
    fixed rates W3_FIXED with 30 % long."""
    if prefill_s is None:  # (total rate, long fraction, requests)
        points = [(rate, 0.3, 20 if quick else 60) for rate in (W3_FIXED[:1] if quick else W3_FIXED)]
    else:
        points = []
        for busy, interactive in W3_LOADS[:1] if quick else W3_LOADS:
            long_rate = busy / prefill_s
            fraction = long_rate / (long_rate + interactive)
            points.append(
                (round(long_rate + interactive, 2), fraction, round((14 if quick else W3_INTERACTIVE) / (1 - fraction)))
            )

    def params(fraction):
        return ("long_fraction", f"{fraction:.3f}"), ("long_min", str(W3_LONG[0])), ("long_max", str(W3_LONG[1]))

    return [
        [Run("w3", arm, n, rate=rate, warmup=2, params=params(fraction)) for arm in DISAGG]
        for rate, fraction, n in points
    ]


def w3_load_text(groups: list[list[Run]], prefill_s: float | None) -> str:
    """W3's load points in words, for the report."""
    points = []
    for group in groups:
        run = group[0]
        fraction = float(dict(run.params)["long_fraction"])
        busy = f", prefill core {run.rate * fraction * prefill_s:.0%} busy" if prefill_s else ""
        points.append(
            f"{run.rate} req/s ({run.rate * fraction:.2f} long + {run.rate * (1 - fraction):.2f} "
            f"interactive{busy}, {run.num_requests} requests)"
        )
    how = (
        f"rates derived from this host's {sum(W3_LONG) // 2}-token prefill on one core, {prefill_s:.2f} s, "
        "so that 1P1D's one prefill core is about half busy at the first point: "
        if prefill_s
        else "fixed rates (`--w3-fixed`): "
    )
    return how + "; ".join(points) + "."


def time_long_prefill(raw: pathlib.Path, workdir: pathlib.Path) -> float:
    """Seconds one pinned worker takes to prefill W3's mean long prompt (the median of 3 unique
    prompts after a warm-up, through the router, one at a time). Kept in --raw, so a resumed
    suite runs the load points it started with."""
    kept = raw / "w3-prefill.json"
    if kept.exists():
        return json.loads(kept.read_text())["prefill_s"]
    cluster = Cluster(DISAGG[0], workdir)
    try:
        rng = random.Random(SEED)
        times = []
        for _ in range(4):
            prompt = [rng.randrange(100, 40000) for _ in range(sum(W3_LONG) // 2)]
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
            request = urllib.request.Request(
                cluster.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            t0 = time.perf_counter()
            with urllib.request.urlopen(request, timeout=300) as resp:
                resp.read()
            times.append(time.perf_counter() - t0)
    finally:
        cluster.stop()
    prefill_s = statistics.median(times[1:])
    kept.write_text(json.dumps({"prefill_s": prefill_s, "times_s": times}))
    print(f"W3: a {sum(W3_LONG) // 2}-token prefill on one core takes {prefill_s:.3f} s", flush=True)
    return prefill_s


def plan(quick: bool, w3_prefill_s: float | None = None) -> dict[str, list[list[Run]]]:
    """Per workload, groups of runs; the runs of a group are the arms at one load point."""
    q = quick
    w1 = (("warm_prefixes", "1"), ("system_len", "256"), ("groups", "8"), ("per_group", "2" if q else "8"))
    w1_n = 16 if q else 64
    w1_rates = [0.7] if q else [0.7, 1.4]
    w2 = (("sessions", "4" if q else "6"), ("turns", "6"), ("think_s", "1.0"))
    w4 = (("output_min", "64"), ("output_max", "128"))
    groups = {
        "w1": [[Run("w1", arm, w1_n, rate=r, warmup=16, params=w1) for arm in ROUTING] for r in w1_rates]
        + [[Run("w1", NO_CACHE, w1_n, rate=w1_rates[0], warmup=16, params=w1)]],
        "w2": [
            [
                Run("w2", arm, 24 if q else 36, rate=0.5, warmup=2, params=w2)
                for arm in (ROUTING[0], ROUTING[3], dataclasses.replace(NO_CACHE))
            ]
        ],
        "w3": w3_plan(quick, w3_prefill_s),
        "w4": [
            [
                Run("w4", arm, 8 if q else 24, concurrency=8, warmup=2, params=w4)
                for arm in (ROUTING[0], ROUTING[3], DISAGG[2])
            ]
        ],
    }
    return groups


# ---- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process whose output is kept (last lines) and watched for a ready line."""

    def __init__(self, name: str, argv: list[str], ready_prefix: str | None = None, env: dict | None = None):
        self.name, self.argv, self.ready_prefix = name, argv, ready_prefix
        self.tail: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line])[-30:]
            if self.ready_prefix and line.startswith(self.ready_prefix):
                self.ready.set()
        self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready.wait(timeout_s) or self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.tail[-20:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


def wait_http(url: str, timeout_s: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_get(url)[0] == 200:
            return
        if proc.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name}: {url} not ready:\n" + "".join(proc.tail[-20:]))


def kv_transport() -> str:
    return "ucx" if importlib.util.find_spec("ucxx") is not None else "tcp"


def start_worker(
    name: str, index: int, role: str, kv_blocks: int, max_model_len: int, extra: tuple[str, ...] = ()
) -> tuple[Proc, str, int]:
    """One worker pinned to the index-th core of this process's (one torch thread), with
    `kv_blocks` float16 KV blocks: (its process, its gRPC address, its metrics port)."""
    gib = (kv_blocks * BLOCK_BYTES + BLOCK_BYTES // 2) / 2**30
    grpc_port, metrics_port, kv_port = free_port(), free_port(), free_port()
    cores = sorted(os.sched_getaffinity(0))
    argv = [
        "taskset",
        "-c",
        str(cores[index % len(cores)]),
        sys.executable,
        "-m",
        "splitserve.platform.cli",
        "--log-level",
        "WARNING",
        "worker",
        "--role",
        role,
        "--model",
        MODEL,
        "--threads",
        "1",
        "--kv-transport",
        kv_transport(),
        "--kv-cache-memory",
        f"{gib:.6f}",
        "--kv-cache-dtype",
        "float16",
        "--max-model-len",
        str(max_model_len),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        "--kv-port",
        str(kv_port),
        "--drain-grace",
        "2",
        *extra,
    ]
    return Proc(name, argv, ready_prefix="READY"), f"127.0.0.1:{grpc_port}", metrics_port


def read_kv_blocks(metrics_ports: list[int]) -> list[int]:
    """Each ready worker's KV blocks as it reports them (/debug/kv): what the budget became."""
    return [json.loads(http_get(f"http://127.0.0.1:{port}/debug/kv")[1])["num_blocks"] for port in metrics_ports]


class Cluster:
    """Two pinned workers and a router, for one arm."""

    def __init__(self, arm: Arm, workdir: pathlib.Path, kv_blocks: int = KV_BLOCKS, max_model_len: int = 2048):
        self.arm, self.procs, self.kv_blocks = arm, [], []
        self.kv_blocks_asked, self.max_model_len = kv_blocks, max_model_len
        try:
            self._start(arm, workdir)
        except BaseException:
            self.stop()  # a process that failed to start must not leave the others running
            raise

    def _start(self, arm: Arm, workdir: pathlib.Path) -> None:
        addresses, metrics = [], []
        for i, role in enumerate(arm.roles):
            proc, address, metrics_port = start_worker(
                f"{role} worker {i}",
                i,
                role,
                self.kv_blocks_asked,
                self.max_model_len,
                (*arm.worker_args, *(arm.prefill_args if role == "prefill" else ())),
            )
            self.procs.append(proc)
            addresses.append(address)
            metrics.append(metrics_port)
        for p in self.procs:
            p.wait_ready(300)
        self.kv_blocks = read_kv_blocks(metrics)
        port = free_port()
        config = workdir / f"router-{arm.name}.yaml"
        config.write_text(yaml.safe_dump(arm.router_config(port, addresses, self.max_model_len)))
        self.router = Proc(
            "router",
            [
                sys.executable,
                "-m",
                "splitserve.platform.cli",
                "--log-level",
                "WARNING",
                "router",
                "--config",
                str(config),
            ],
            ready_prefix="splitserve router",
        )
        self.procs.append(self.router)
        self.url = f"http://127.0.0.1:{port}"
        wait_http(self.url + "/ready", 120, self.router)
        self._wait_pool(len(arm.roles))

    def _wait_pool(self, n: int) -> None:
        """Until the router lists every worker as healthy (its /metrics pool gauge)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            _, body = http_get(self.url + "/metrics")
            healthy = sum(
                float(line.rsplit(" ", 1)[1])
                for line in body.decode().splitlines()
                if line.startswith("splitserve_router_workers{") and 'state="healthy"' in line
            )
            if healthy >= n:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the router did not see {n} healthy workers")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def bench(run: Run, url: str, raw: pathlib.Path, tag: str) -> dict:
    out = raw / f"{tag}.json"
    argv = [sys.executable, "-m", "splitserve.bench.loadgen.cli", *run.bench_args(url, str(out))]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench {tag} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    doc = json.loads(out.read_text())
    print(f"  {tag}: {time.monotonic() - t0:.0f} s\n" + proc.stdout, flush=True)
    return doc


def reused(raw: pathlib.Path, tag: str) -> dict | None:
    """A finished run's results from an interrupted suite (--raw DIR): the bench JSON plus the
    arm's facts written beside it (`<tag>.arm.json`)."""
    out, facts = raw / f"{tag}.json", raw / f"{tag}.arm.json"
    if not (out.exists() and facts.exists()):
        return None
    print(f"== {tag}: reused from {raw}", flush=True)
    return {**json.loads(out.read_text()), **json.loads(facts.read_text())}


def run_group(group: list[Run], raw: pathlib.Path, workdir: pathlib.Path) -> list[dict]:
    results = []
    for run in group:
        tag = f"{run.workload}-{run.arm.name}-{(run.load).replace(' ', '').replace('/', '')}"
        doc = reused(raw, tag)
        if doc is not None:
            results.append(doc)
            continue
        print(f"== {tag}", flush=True)
        cluster = Cluster(run.arm, workdir)
        try:
            doc = bench(run, cluster.url, raw, tag)
        finally:
            cluster.stop()
        facts = {"arm": run.arm.name, "kv_blocks": cluster.kv_blocks, "load": run.load}
        (raw / f"{tag}.arm.json").write_text(json.dumps(facts))
        results.append({**doc, **facts})
    return results


# ---- the peer ----------------------------------------------------------------------------------------
PEER_CONCURRENCY = (1, 4, 16)
# llama-cpp-python has no ignore_eos: ban SmolLM2's <|endoftext|> (0) and <|im_end|> (2) instead,
# so it generates max_tokens as splitserve does (the report flags any length mismatch).
PEER_NO_EOS = json.dumps({"logit_bias": {"0": -100, "2": -100}})


def peer_runs(quick: bool) -> list[Run]:
    sizes = {1: 4, 4: 8, 16: 16} if quick else {1: 8, 4: 16, 16: 48}
    return [
        Run(
            "random",
            ROUTING[3],
            sizes[c],
            concurrency=c,
            warmup=2,
            text_prompts=True,
            params=(("input_len", "128"), ("output_len", "64")),
        )
        for c in PEER_CONCURRENCY
    ]


def gguf_path() -> str:
    from splitserve.platform.model_source import resolve_model

    return resolve_model(MODEL).path


def run_peer(peer_python: str, quick: bool, raw: pathlib.Path, workdir: pathlib.Path) -> list[dict]:
    """splitserve (two colocated workers, ours) and llama-cpp-python's server (2 threads), each
    at concurrency 1, 4, 16, interleaved by concurrency."""
    results = []
    for run in peer_runs(quick):
        for server in ("splitserve", "llama.cpp"):
            tag = f"peer-{server}-c{run.concurrency}"
            doc = reused(raw, tag)
            if doc is not None:
                results.append(doc)
                continue
            print(f"== {tag}", flush=True)
            if server == "splitserve":
                cluster = Cluster(run.arm, workdir)
                url, stop = cluster.url, cluster.stop
            else:
                run = dataclasses.replace(run, extra_body=PEER_NO_EOS)
                port = free_port()
                proc = Proc(
                    "llama.cpp server",
                    [
                        peer_python,
                        "-m",
                        "llama_cpp.server",
                        "--model",
                        gguf_path(),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--n_threads",
                        "2",
                        "--n_threads_batch",
                        "2",
                        "--n_ctx",
                        "2048",
                        # default True: a new request cuts the one streaming
                        "--interrupt_requests",
                        "False",
                    ],
                )
                url, stop = f"http://127.0.0.1:{port}", proc.stop
            try:
                if server == "llama.cpp":
                    wait_http(url + "/v1/models", 120, proc)
                doc = bench(run, url, raw, tag)
            finally:
                stop()
            facts = {"arm": server, "load": run.load, "server": server}
            (raw / f"{tag}.arm.json").write_text(json.dumps(facts))
            results.append({**doc, **facts})
    return results


# ---- report ------------------------------------------------------------------------------------------
def _ms(stats: dict | None, key: str) -> str:
    return "–" if not stats or stats.get(key) is None else f"{stats[key]:.0f}"


def summary_row(doc: dict, category: str | None = None) -> str:
    s = doc["categories"][category] if category else doc["summary"]
    hit = doc["summary"]["prefix_cache_hit_rate"]
    return (
        f"| {doc['arm']} | {doc['load']} | {s['completed']}/{s['completed'] + s['failed']} | "
        f"{'–' if hit is None else f'{100 * hit:.0f} %'} | {_ms(s['ttft_ms'], 'p50')} | "
        f"{_ms(s['ttft_ms'], 'p90')} | {_ms(s['ttft_ms'], 'p99')} | {_ms(s['itl_ms'], 'p50')} | "
        f"{_ms(s['itl_ms'], 'p99')} | {_ms(s['tpot_ms'], 'p50')} | {s['output_throughput']:.1f} | "
        f"{100 * doc['client_cpu_fraction']:.0f} % |"
    )


HEADER = (
    "| arm | load | done | prefix hit | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | "
    "out tok/s | client CPU |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def pick(docs: list[dict], arm: str, load: str | None = None) -> dict | None:
    return next((d for d in docs if d["arm"] == arm and (load is None or d["load"] == load)), None)


def ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"


def stat(doc: dict | None, metric: str, key: str, category: str | None = None) -> float | None:
    if doc is None:
        return None
    s = doc["categories"].get(category) if category else doc["summary"]
    return None if not s or not s.get(metric) else s[metric].get(key)


def stall_share_text(colocated: dict | None) -> str:
    """The most of colocated's pooled interactive gaps that long prefills can make stalls. Each long
    prefill stops every stream running on its worker once, and Poisson arrivals meet as many running
    streams as there are on average, N; streams make N / ITL gaps per second. So stalls are at most
    (long prompts per second) x ITL of all gaps, whatever the placement, and pooled p99 ITL sees
    them only from 1 %."""
    long = colocated and colocated["categories"].get("long")
    itl = stat(colocated, "itl_ms", "p50", "interactive")
    if not long or not itl:
        return "stall share: –"
    share = long["request_throughput"] * itl / 1e3
    return (
        f"long prefills can make at most {share:.2%} of colocated's interactive gaps stalls "
        f"({long['request_throughput']:.2f} long prompts/s × ITL p50 {itl:.0f} ms): "
        + (
            "below 1 %, so no placement lets colocated's pooled p99 ITL see a stall."
            if share < 0.01
            else "pooled p99 ITL can see stalls."
        )
    )


def render(results: dict[str, list[dict]], plots: dict[str, str], meta: dict) -> str:
    begin, end = markers("serving")
    out = [
        begin,
        "## Serving suite: W1–W4 and the peer (issue 6)",
        "",
        f"Machine: {meta['machine']}. Run of {meta['date']}, {meta['minutes']:.0f} minutes, "
        f"command: `{meta['command']}`.",
        "",
        f"Every arm: 2 worker processes pinned to one core each (`taskset`, `--threads 1`), "
        f"{KV_BLOCKS} KV blocks ({KV_BLOCKS * 16} tokens) per worker (read back from /debug/kv: "
        f"{meta['kv_blocks']}), SmolLM2-135M Q4_1 in the workers' default --quantization auto, KV transfer over "
        f"{kv_transport().upper()}; router and client unpinned on the same 2 cores. Workers and router "
        "restarted for every arm; the arms of a load point run back to back. Latencies in ms; "
        "`prefix hit` is the server-reported cached share of prompt tokens.",
        "",
    ]
    w1 = results.get("w1", [])
    if w1:
        out += [
            "### W1: shared system prompts, routing arms",
            "",
            "8 groups × 256-token system prompt + a 16–48-token question, 16 output tokens; the warm-up "
            "(16 requests) carries the groups' system prompts (`warm_prefixes=1`), so the measured "
            "requests see a warm cluster.",
            "",
            HEADER,
        ]
        out += [summary_row(d) for d in w1]
        for load in dict.fromkeys(d["load"] for d in w1 if d["arm"] != "no-cache"):
            rr, ours = pick(w1, "round-robin", load), pick(w1, "prefix+queue", load)
            out.append(
                f"\n{load}: p90 TTFT round-robin ÷ prefix+queue = "
                f"**{ratio(stat(rr, 'ttft_ms', 'p90'), stat(ours, 'ttft_ms', 'p90'))}** (target ≥ 2×); "
                f"mean {ratio(stat(rr, 'ttft_ms', 'mean'), stat(ours, 'ttft_ms', 'mean'))}."
            )
        out += ["", f"![W1 TTFT vs load]({plots['w1']})", ""]
    w2 = results.get("w2", [])
    if w2:
        out += [
            "### W2: multi-turn sessions",
            "",
            "6 sessions × 6 turns (prompts 160 … 480 tokens, each turn's prompt a prefix of the next), "
            "32 output tokens, think time exp(1 s); sessions arrive at 0.5/s.",
            "",
            HEADER,
        ]
        out += [summary_row(d) for d in w2]
        turns = sorted({c for d in w2 for c in d["categories"]}, key=lambda c: int(c.split("-")[1]))
        out += [
            "",
            "Mean TTFT per turn (ms):",
            "",
            "| arm | " + " | ".join(turns) + " |",
            "|---|" + "---|" * len(turns),
        ]
        for d in w2:
            out.append(
                f"| {d['arm']} | " + " | ".join(_ms(d["categories"][t]["ttft_ms"], "mean") for t in turns) + " |"
            )
        out += ["", f"![W2 TTFT per turn]({plots['w2']})", ""]
    w3 = results.get("w3", [])
    if w3:
        out += [
            "### W3: long prompts beside interactive streams",
            "",
            f"Long requests (512–768-token prompts, 8 output tokens) among interactive ones "
            f"(32-token prompts, 64 output tokens), one Poisson stream thinned in two: {meta['w3']} "
            "Interactive requests:",
            "",
            HEADER,
        ]
        out += [summary_row(d, "interactive") for d in w3]
        out += ["", "Long requests:", "", HEADER] + [summary_row(d, "long") for d in w3]
        for load in dict.fromkeys(d["load"] for d in w3):
            a, b, c, dd = (pick(w3, arm.name, load) for arm in DISAGG)
            itl = [stat(x, "itl_ms", "p99", "interactive") for x in (a, b, c, dd)]
            out.append(
                f"\n{load}: interactive p99 ITL, colocated (no chunking) ÷ 1P1D = **{ratio(itl[0], itl[2])}** "
                f"(target ≥ 5×); ÷ 1P1D-conditional = {ratio(itl[0], itl[3])}; colocated+chunked ÷ 1P1D = "
                f"{ratio(itl[1], itl[2])}."
            )
            # A long prefill stops each stream on its worker once; among a stream's 64 gaps that is
            # under 1 %, so pooled p99 ITL can miss it while a user sees a freeze. Report both.
            for q in ("p90", "p99"):
                worst = [stat(x, "max_itl_ms", q, "interactive") for x in (a, b, c, dd)]
                shown = ", ".join(f"{arm.name} {'–' if w is None else f'{w:.0f}'}" for arm, w in zip(DISAGG, worst))
                out.append(
                    f"{load}: interactive requests' longest gap, {q} over requests (ms): {shown}; "
                    f"colocated ÷ 1P1D = {ratio(worst[0], worst[2])}."
                )
            out.append(f"{load}: {stall_share_text(a)}")
        out += ["", f"![W3 interactive ITL]({plots['w3']})", ""]
    w4 = results.get("w4", [])
    if w4:
        out += [
            "### W4: short prompts, long outputs (negative control)",
            "",
            "32–64-token prompts, 64–128 output tokens, concurrency 8.",
            "",
            HEADER,
        ]
        out += [summary_row(d) for d in w4]
        rr, ours, pd = pick(w4, "round-robin"), pick(w4, "prefix+queue"), pick(w4, "1P1D")

        def tput(d):
            return d and d["summary"]["output_throughput"]

        out += [
            "",
            f"Output tok/s 1P1D ÷ colocated (prefix+queue) = {ratio(tput(pd), tput(ours))}; "
            f"prefix+queue ÷ round-robin = {ratio(tput(ours), tput(rr))}.",
            "",
        ]
    peer = results.get("peer", [])
    if peer:
        out += [
            "### Peer: llama-cpp-python's OpenAI server on the same GGUF",
            "",
            "llama-cpp-python 0.3.36 built as `make peer` does (docs/design.md), `--n_threads 2 --n_threads_batch 2 "
            "--interrupt_requests False` (by default a new request cuts the one streaming), one "
            "process on both cores; splitserve: two colocated workers (one core each, prefix+queue "
            "routing). Workload `random`: 128-token prompts sent as text to both (llama.cpp takes no token "
            "ids), 64 output tokens (`ignore_eos`; llama.cpp gets its EOS tokens banned through "
            "`logit_bias` so it generates as many).",
            "",
            "| server | load | done | TTFT p50 | TTFT p99 | TPOT p50 | single-stream decode tok/s | out tok/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d in peer:
            s = d["summary"]
            tpot = stat(d, "tpot_ms", "p50")
            decode = f"{1000 / tpot:.1f}" if tpot and d["load"] == "concurrency 1" else ""
            out.append(
                f"| {d['server']} | {d['load']} | {s['completed']}/{s['completed'] + s['failed']} | "
                f"{_ms(s['ttft_ms'], 'p50')} | {_ms(s['ttft_ms'], 'p99')} | {_ms(s['tpot_ms'], 'p50')} | "
                f"{decode} | {s['output_throughput']:.1f} |"
            )
        ours, theirs = pick(peer, "splitserve", "concurrency 16"), pick(peer, "llama.cpp", "concurrency 16")
        if ours and theirs:
            out += [
                "",
                f"Output throughput at concurrency 16, splitserve ÷ llama.cpp = "
                f"**{ratio(ours['summary']['output_throughput'], theirs['summary']['output_throughput'])}** "
                "(target ≥ 1×).",
                "",
                f"![peer throughput]({plots['peer']})",
                "",
            ]
    out += [end]
    return "\n".join(out)


def make_plots(results: dict[str, list[dict]], folder: pathlib.Path, rel: str) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        paths[name.split("-")[0]] = f"{rel}/{name}"

    if results.get("w1"):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for arm in dict.fromkeys(d["arm"] for d in results["w1"]):
            docs = [d for d in results["w1"] if d["arm"] == arm]
            rates = [d["config"]["rate"] for d in docs]
            for ax, key in zip(axes, ("p50", "p90")):
                ax.plot(rates, [d["summary"]["ttft_ms"][key] for d in docs], marker="o", label=arm)
        for ax, key in zip(axes, ("p50", "p90")):
            ax.set(xlabel="request rate (req/s)", ylabel=f"TTFT {key} (ms)", title=f"W1 TTFT {key} vs load")
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        save(fig, "w1-ttft-vs-load.png")
    if results.get("w2"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for d in results["w2"]:
            turns = sorted(d["categories"], key=lambda c: int(c.split("-")[1]))
            ax.plot(
                [int(t.split("-")[1]) for t in turns],
                [d["categories"][t]["ttft_ms"]["mean"] for t in turns],
                marker="o",
                label=d["arm"],
            )
        ax.set(xlabel="turn", ylabel="mean TTFT (ms)", title="W2 TTFT per turn")
        ax.legend(fontsize=8)
        save(fig, "w2-ttft-per-turn.png")
    if results.get("w3"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for d in results["w3"]:
            itl = sorted(
                x * 1000 for r in d["requests"] if r["category"] == "interactive" and r["success"] for x in r["itl_s"]
            )
            if itl:
                ax.plot(
                    itl,
                    [(i + 1) / len(itl) for i in range(len(itl))],
                    label=f"{d['arm']}, {d['load']}",
                    linestyle="-" if d["load"] == results["w3"][0]["load"] else "--",
                )
        ax.set(xscale="log", xlabel="inter-token latency (ms)", ylabel="CDF", title="W3 interactive ITL")
        ax.legend(fontsize=8)
        save(fig, "w3-itl-cdf.png")
    if results.get("peer"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for server in ("splitserve", "llama.cpp"):
            docs = [d for d in results["peer"] if d["server"] == server]
            ax.plot(
                [d["config"]["concurrency"] for d in docs],
                [d["summary"]["output_throughput"] for d in docs],
                marker="o",
                label=server,
            )
        ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title="Output throughput, 2 cores")
        ax.set_xticks(list(PEER_CONCURRENCY), [str(c) for c in PEER_CONCURRENCY])
        ax.legend()
        save(fig, "peer-throughput.png")
    return paths


def machine() -> str:
    model = cpu_model()
    import torch

    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{len(os.sched_getaffinity(0))} vCPU {model}, {memory_gib:.0f} GiB, "
        f"torch {torch.__version__}, Python {stdlib_platform.python_version()}"
    )


def strip(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "requests"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="the benchmarks file to write the section into")
    ap.add_argument("--plots", default="docs/bench", help="folder for the PNG plots and the summary JSON")
    ap.add_argument("--only", default="w1,w2,w3,w4,peer", help="comma-separated subset")
    ap.add_argument("--quick", action="store_true", help="a few requests per arm (a smoke run, not a result)")
    ap.add_argument(
        "--raw",
        default=None,
        help="folder for the raw JSON (default: a new temp folder); runs "
        "already finished there are reused, so an interrupted suite resumes",
    )
    ap.add_argument(
        "--w3-fixed",
        action="store_true",
        help="W3 at the fixed rates 0.8 and 0.5 req/s with 30 %% long prompts, instead of rates "
        "derived from this host's prefill time (the suite's runs before that)",
    )
    ap.add_argument(
        "--peer-python",
        default=".venv-peer/bin/python",
        help="the Python with llama-cpp-python[server] installed (make bench builds it)",
    )
    args = ap.parse_args()
    require("bench/serving_suite.py", ["matplotlib"])  # the plots come last, after an hour of runs
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(only) - {"w1", "w2", "w3", "w4", "peer"})
    if unknown:
        ap.error(f"--only: unknown {unknown}; allowed: w1, w2, w3, w4, peer")
    if shutil.which("taskset") is None:
        ap.error("taskset (util-linux) is needed to pin each worker to one core")
    if "peer" in only and not os.access(args.peer_python, os.X_OK):
        ap.error(
            f"--peer-python {args.peer_python} is not executable; `make bench` builds it (or drop `peer` from --only)"
        )
    raw = pathlib.Path(args.raw) if args.raw else pathlib.Path(tempfile.mkdtemp(prefix="splitserve-serving-"))
    workdir = raw / "configs"
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"raw results in {raw}", flush=True)
    t0 = time.monotonic()
    results: dict[str, list[dict]] = {}
    w3_prefill_s = None if "w3" not in only or args.w3_fixed else time_long_prefill(raw, workdir)
    groups = plan(args.quick, w3_prefill_s)
    for name in only:
        if name == "peer":
            results["peer"] = run_peer(args.peer_python, args.quick, raw, workdir)
        else:
            results[name] = [doc for group in groups[name] for doc in run_group(group, raw, workdir)]
    plots_dir = pathlib.Path(args.plots)
    rel = os.path.relpath(plots_dir, section_path(args.write, "serving").parent) if args.write else str(plots_dir)
    plots = make_plots(results, plots_dir, rel)
    kv = sorted({b for docs in results.values() for d in docs for b in d.get("kv_blocks", [])})
    meta = {
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "minutes": (time.monotonic() - t0) / 60,
        "command": "make bench  # = python bench/serving_suite.py --write docs/benchmarks.md --plots docs/bench"
        + (" --quick" if args.quick else ""),
        "kv_blocks": ", ".join(map(str, kv)) or "–",
        "w3": w3_load_text(groups["w3"], w3_prefill_s),
    }
    (plots_dir / "serving-summary.json").write_text(
        json.dumps({"meta": meta, "results": {k: [strip(d) for d in v] for k, v in results.items()}}, indent=1) + "\n"
    )
    section = render(results, plots, meta)
    print(section)
    if args.write:
        write_section(args.write, "serving", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
