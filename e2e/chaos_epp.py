"""Chaos through the inference-gateway path: every part behind Envoy SIGKILLed under load.

    load (threads, e2e/chaos_load.py requests) -> Envoy (fail-open, ext_proc over mTLS)
        -> `splitserve epp` -> sidecar-0 / sidecar-1 -> decode-0 / decode-1 (-> prefill)

Real processes throughout (the default model, TCP KV transport, mTLS between every splitserve
process and the workers as `splitserve up` secures them). Envoy is the config `splitserve
envoy-config --fail-open` prints and is never killed. The injector cycles through the parts:
a sidecar, a decode worker, the prefill worker and the EPP, each SIGKILLed, left down DOWN_S,
restarted and waited for, then SETTLE_S of calm; until the duration has passed and each kind
was killed at least `--kills` times.

Every request asks for its token ids; the reference is the same request's ids in an undisturbed
warm-up. A request counts against a part when it was *sent* while that part was down (from the
kill to its restart answering /ready). It holds when, per part killed:

    <= 1 % of those requests end other than complete and equal to the reference
    none, anywhere, is wrong (an answer that differs, or a cut whose tokens are no prefix of the
    reference), hung (nothing for 180 s) or lost (an undocumented status, a broken answer)

and afterwards every request of a final round succeeds and every worker holds no request and
no KV block, its pool invariants intact. Exit status 1 otherwise. The figures per part are the
table in docs/reliability.md ("Through the inference gateway").

Usage: python e2e/chaos_epp.py --minutes 3 [--seed N] [--clients N] [--kills N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos_load import Reply, Spec, run_request  # noqa: E402
from chaos_procs import BIN, MODEL, Proc, Security, Worker, free_port, http_get, wait_for  # noqa: E402

from splitserve.router.epp.envoy import EppTls, envoy_config  # noqa: E402
from splitserve.router.epp.envoy_process import envoy_log, start_envoy  # noqa: E402

PARTS = ("sidecar", "decode", "prefill", "epp")
MIN_PREFILL_TOKENS = 48  # the specs' prompts (~90 tokens) go to the prefill worker
DOWN_S = 4.0  # how long a killed part stays down before its restart
SETTLE_S = 3.0  # calm after a restart answered /ready
MAX_FAILED_SHARE = 0.01  # of the requests sent while a part is down


@dataclass
class Outage:
    part: str
    target: str
    start: float
    end: float = float("inf")


@dataclass
class PartTally:
    sent: int = 0
    ok: int = 0
    outcomes: Counter = field(default_factory=Counter)


def make_specs(rng: random.Random, n: int) -> list[Spec]:
    """Short prompts (this path runs five of our processes on loopback) sharing a prefix; greedy
    or seeded, streamed or not, so each has one right answer."""
    prefix = " ".join(f"Note {j}: the lamp by the river is lit at dusk." for j in range(6))
    specs = [
        Spec(f"{prefix}\nQuestion {i}: what happens at dusk?", bool(i % 2), None if i % 3 else 100 + i, 3 + i % 4)
        for i in range(n)
    ]
    rng.shuffle(specs)
    return specs


class EnvoyTarget:
    """What chaos_load.run_request calls a router: a name and a base URL."""

    def __init__(self, port: int):
        self.name, self.url = "envoy", f"http://127.0.0.1:{port}"


class Stack:
    def __init__(self, logdir: str):
        self.logdir = logdir
        self.security = Security.make(logdir)
        tls = dict(zip(self.security.router_args[::2], self.security.router_args[1::2]))
        self.tls = EppTls(tls["--tls-cert"], tls["--tls-key"], tls["--tls-ca"])
        self.config = os.path.join(logdir, "router.json")
        with open(self.config, "w") as f:
            json.dump({"placement": {"disaggregation": {"min_prefill_tokens": MIN_PREFILL_TOKENS}}}, f)
        self.decode = [self._worker("decode", i) for i in range(2)]
        self.prefill = self._worker("prefill", 0)
        self.sidecar_ports = [free_port() for _ in self.decode]
        self.sidecars = [self._sidecar(i) for i in range(2)]
        self.grpc_port, self.health_port = free_port(), free_port()
        self.epp = self._epp()
        self.envoy_port = free_port()
        self.envoy = None

    def _worker(self, role: str, index: int) -> Worker:
        w = Worker(role, "tcp", self.logdir, self.security)
        w.name = f"{role}-{index}"
        w.log = open(os.path.join(self.logdir, f"{w.name}.log"), "ab")
        return w

    def _sidecar(self, index: int) -> Proc:
        port = self.sidecar_ports[index]
        argv = [
            BIN, "--log-level", "WARNING", "sidecar", "--model", MODEL, "--config", self.config,
            "--decode", self.decode[index].address, "--workers", self.prefill.address,
            "--host", "127.0.0.1", "--port", str(port), *self.security.router_args,
        ]  # fmt: skip
        return Proc(f"sidecar-{index}", argv, self.logdir, ready=lambda: _ok(f"http://127.0.0.1:{port}/ready"))

    def _epp(self) -> Proc:
        endpoints = [
            f"--endpoint={w.address}=127.0.0.1:{p}" for w, p in zip(self.decode, self.sidecar_ports, strict=True)
        ]
        argv = [
            BIN, "--log-level", "WARNING", "epp", "--model", MODEL, "--config", self.config,
            "--workers", ",".join(w.address for w in [*self.decode, self.prefill]), *endpoints,
            "--grpc-port", str(self.grpc_port), "--health-port", str(self.health_port),
            *self.security.router_args,
            "--serve-tls-cert", self.tls.cert, "--serve-tls-key", self.tls.key, "--serve-tls-client-ca", self.tls.ca,
        ]  # fmt: skip
        return Proc("epp", argv, self.logdir, ready=lambda: _ok(f"http://127.0.0.1:{self.health_port}/ready"))

    @property
    def workers(self) -> list[Worker]:
        return [*self.decode, self.prefill]

    def start(self) -> None:
        for p in [*self.workers, *self.sidecars, self.epp]:
            p.start()
        for p in [*self.workers, *self.sidecars, self.epp]:
            p.wait_ready()
        sidecars = [f"127.0.0.1:{p}" for p in self.sidecar_ports]
        config = envoy_config(
            self.envoy_port,
            sidecars,
            f"127.0.0.1:{self.grpc_port}",
            free_port(),
            True,
            tls=self.tls,
            debug_headers=True,
        )
        path = os.path.join(self.logdir, "envoy.yaml")
        self.envoy = start_envoy(config, path)
        wait_for(lambda: self.envoy.poll() is not None or _ok(f"http://127.0.0.1:{self.envoy_port}/ready"), 60, "envoy")
        if self.envoy.poll() is not None:
            raise RuntimeError("chaos: envoy did not start:\n" + envoy_log(path))

    def stop(self) -> None:
        if self.envoy is not None and self.envoy.poll() is None:
            self.envoy.terminate()
            self.envoy.wait(10)
        for p in [self.epp, *self.sidecars, *self.workers]:
            p.stop()

    def part(self, kind: str, rng: random.Random) -> Proc:
        if kind == "sidecar":
            return rng.choice(self.sidecars)
        if kind == "decode":
            return rng.choice(self.decode)
        return self.prefill if kind == "prefill" else self.epp


def _ok(url: str) -> bool:
    return http_get(url, 2)[0] == 200


class Soak:
    def __init__(self, minutes: float, seed: int, logdir: str, num_clients: int = 2, kills: int = 2):
        self.minutes, self.seed, self.kills = minutes, seed, kills
        self.rng = random.Random(seed)
        self.stack = Stack(logdir)
        self.specs = make_specs(random.Random(seed), 12)
        self.reference: dict[Spec, list[int]] = {}
        self.num_clients = num_clients
        self.outages: list[Outage] = []
        self.replies: list[tuple[Spec, Reply]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self) -> int:
        t0 = time.monotonic()
        try:
            self.stack.start()
            target = EnvoyTarget(self.stack.envoy_port)
            for spec in self.specs:
                reply = run_request([target], spec, self.rng)
                if reply.kind != "answer" or not reply.token_ids:
                    raise RuntimeError(f"chaos: the undisturbed run failed: {reply.kind} {reply.detail}")
                self.reference[spec] = reply.token_ids
            print(f"chaos-epp: warm-up done, {len(self.specs)} references", flush=True)
            clients = [threading.Thread(target=self.client, args=(i, target)) for i in range(self.num_clients)]
            for c in clients:
                c.start()
            self.inject(time.monotonic() + self.minutes * 60)
            self.stop.set()
            for c in clients:
                c.join(300)
            problems = self.quiesce(target)
            return self.report(problems, time.monotonic() - t0)
        finally:
            self.stack.stop()

    def client(self, index: int, target: EnvoyTarget) -> None:
        rng = random.Random(self.seed * 100 + index)
        while not self.stop.is_set():
            spec = rng.choice(self.specs)
            reply = run_request([target], spec, rng)
            with self.lock:
                self.replies.append((spec, reply))

    def inject(self, end: float) -> None:
        count = Counter()
        turn = 0
        while time.monotonic() < end or min(count[k] for k in PARTS) < self.kills:
            kind = PARTS[turn % len(PARTS)]
            turn += 1
            proc = self.stack.part(kind, self.rng)
            outage = Outage(kind, proc.name, time.monotonic())
            self.outages.append(outage)
            proc.kill()
            print(f"chaos-epp: SIGKILL {proc.name} at {outage.start:.1f}", flush=True)
            time.sleep(DOWN_S)
            proc.start()
            proc.wait_ready()
            outage.end = time.monotonic()
            count[kind] += 1
            print(f"chaos-epp: {proc.name} back after {outage.end - outage.start:.1f} s", flush=True)
            time.sleep(SETTLE_S)

    def outcome(self, spec: Spec, reply: Reply) -> str:
        ref = self.reference[spec]
        if reply.kind == "answer":
            return "ok" if reply.token_ids == ref else "wrong"
        if reply.kind == "cut":
            return "cut" if reply.token_ids == ref[: len(reply.token_ids)] else "wrong"
        return reply.kind  # error (a documented 429/503), hung, lost

    def per_part(self) -> dict[str, PartTally]:
        tallies = {kind: PartTally() for kind in PARTS}
        for spec, reply in self.replies:
            down = {o.part for o in self.outages if o.start <= reply.started <= o.end}
            outcome = self.outcome(spec, reply)
            for kind in down:
                t = tallies[kind]
                t.sent += 1
                t.ok += outcome == "ok"
                t.outcomes[outcome] += 1
        return tallies

    def quiesce(self, target: EnvoyTarget) -> list[str]:
        problems = []
        final = [self.outcome(spec, run_request([target], spec, self.rng)) for spec in self.specs]
        if any(o != "ok" for o in final):
            problems.append(f"after the faults, not every request succeeded: {Counter(final)}")
        for w in self.stack.workers:
            idle = lambda w=w: (s := w.kv_state()) and s["num_requests"] == 0 and s["num_requests_holding_blocks"] == 0  # noqa: E731
            try:
                wait_for(idle, 120, f"{w.name} idle")
            except TimeoutError:
                problems.append(f"{w.name} still holds requests: {w.kv_state()}")
            state = w.kv_state()
            if state and not state.get("invariants_ok", False):
                problems.append(f"{w.name}: block pool invariants: {state.get('error')}")
        return problems

    def report(self, problems: list[str], seconds: float) -> int:
        everything = Counter(self.outcome(spec, reply) for spec, reply in self.replies)
        print(
            f"\nchaos-epp: {len(self.replies)} requests in {seconds:.0f} s, {len(self.outages)} kills: {dict(everything)}"
        )
        print("| part killed | kills | requests sent while down | complete and identical | other outcomes |")
        print("|---|---|---|---|---|")
        kills = Counter(o.part for o in self.outages)
        for kind, t in self.per_part().items():
            others = ", ".join(f"{k} {v}" for k, v in sorted(t.outcomes.items()) if k != "ok") or "none"
            share = (t.sent - t.ok) / t.sent if t.sent else 0.0
            print(f"| {kind} | {kills[kind]} | {t.sent} | {t.ok} ({100 * (1 - share):.1f} %) | {others} |")
            if share > MAX_FAILED_SHARE:
                problems.append(f"{kind}: {t.sent - t.ok} of {t.sent} requests sent while down did not complete")
        for bad in ("wrong", "hung", "lost"):
            if everything[bad]:
                problems.append(f"{everything[bad]} {bad} requests")
        failed = [(s, r) for s, r in self.replies if self.outcome(s, r) != "ok"]
        for spec, reply in failed[:20]:
            down = [
                f"{o.target} ({o.start:.1f}-{o.end:.1f})" for o in self.outages if o.start <= reply.started <= o.end
            ]
            print(
                f"chaos-epp: {self.outcome(spec, reply)} sent {reply.started:.1f}, ended {reply.ended:.1f}, "
                f"down: {', '.join(down) or 'none'}: {reply.detail[:200]}"
            )
        for problem in problems:
            print(f"chaos-epp: FAIL: {problem}")
        print("chaos-epp: " + ("FAILED" if problems else "passed") + "; KV blocks checked empty at the end")
        return 1 if problems else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--kills", type=int, default=2, help="each part is killed at least this often")
    parser.add_argument("--logdir", default=None, help="keep the processes' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.kills < 1:
        parser.error("need --minutes > 0, --clients >= 1 and --kills >= 1")
    with tempfile.TemporaryDirectory(prefix="chaos-epp-") as tmp:
        logdir = args.logdir or tmp
        os.makedirs(logdir, exist_ok=True)
        return Soak(args.minutes, args.seed, logdir, args.clients, args.kills).run()


if __name__ == "__main__":
    sys.exit(main())
