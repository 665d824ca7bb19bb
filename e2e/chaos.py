"""Chaos soak: the whole stack on loopback under load while a seeded fault injector breaks it;
every request is accounted for.

    redis <- router A, router B (splitserve router --redis-url, gateway + KV-aware placement)
              -> decode-ucx, prefill-ucx, decode-tcp, prefill-tcp (splitserve worker, real model)
    load generator: threads sending mixed streamed / unstreamed, greedy / seeded requests with
    long shared prefixes to either router (a refused connection fails over to the other)
    fault injector (seeded): SIGKILL a worker (restarted), SIGSTOP then SIGCONT a worker,
    SIGKILL a router replica (restarted), restart Redis, a client that disconnects mid-stream,
    a worker restarted with a different model (layout mismatch; restarted right afterwards),
    delay and drops on the KV transport (e2e/kvproxy.py between prefill-tcp and decode-tcp)
    security: as `splitserve up`, mTLS between routers and workers and authenticated KV
    transfers with throwaway credentials (e2e/chaos_procs.py); `--no-tls` for plaintext

Outcomes: `ok` (the answer equals, token for token, the one the same request got in the
undisturbed warm-up), `error` (a documented status: 429/503 with an OpenAI error body, or a
replica's connection refused), `disconnected` (the injector's own cut streams),
`cut_by_router_kill` (the connection dropped while the injector SIGKILLed a router replica:
a killed gateway sends no status; the client retries), `wrong`,
`hung` (no answer within the deadline), `lost` (an undocumented status or a broken stream).
After quiescing: every worker's block pool holds no request (/debug/kv), every gateway's
admission queue is empty, each process' RSS grew at most MEMORY_BOUND_MIB, and (secured) every
worker refuses a plaintext client. Exit status 1 on any wrong / hung / lost request, leak or
security failure. The load is e2e/chaos_load.py, the processes e2e/chaos_procs.py.
Usage: python e2e/chaos.py --minutes 30 [--seed N] [--clients N] [--no-tls]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos_load import DEADLINE_S, Spec, Tally, make_specs, run_request  # noqa: E402
from chaos_procs import MODEL, Redis, RouterProc, Security, Worker, http_get, wait_for  # noqa: E402
from kvproxy import KVProxy  # noqa: E402

MEMORY_BOUND_MIB = 400           # RSS growth allowed per process over the soak (after warm-up)
NUM_CLIENTS = 12                 # load-generating threads (the workers batch their requests)
FAULT_KINDS = ("worker_sigkill", "worker_sigstop", "router_sigkill", "redis_restart", "client_disconnect",
               "layout_mismatch", "kv_delay", "kv_drop")


# ---- the soak ------------------------------------------------------------------------------
class Soak:
    def __init__(self, minutes: float, seed: int, logdir: str, num_clients: int = NUM_CLIENTS,
                 num_specs: int = 16, secure: bool = True):
        self.minutes, self.seed, self.logdir = minutes, seed, logdir
        os.makedirs(logdir, exist_ok=True)
        self.security = Security.make(os.path.join(logdir, "pki")) if secure else Security()
        self.rng = random.Random(seed)
        self.num_clients = num_clients
        self.specs = make_specs(random.Random(seed + 1), num_specs)
        self.reference: dict[Spec, str] = {}
        self.tally = Tally()
        self.stop = threading.Event()
        # a router SIGKILL counts as begun before the kill and done after it: a cut is the kill's
        # when a kill began after the last one that was done when its request started (a request
        # sent between the count and the kill is cut by it too)
        self.router_kills_begun = self.router_kills_done = 0
        self.redis = Redis(logdir)
        self.workers = [Worker(role, transport, logdir, self.security, proxied=(role, transport) == ("decode", "tcp"))
                        for transport in ("ucx", "tcp") for role in ("decode", "prefill")]
        self.remote_prefills = Counter()     # outcome -> count, banked from each decode worker before a restart
        self.proxy = KVProxy(next(w.kv_port for w in self.workers if w.proxied))
        url = f"redis://127.0.0.1:{self.redis.port}/0"
        self.routers = [RouterProc(f"router-{n}", self.workers, url, logdir, self.security) for n in "ab"]

    def procs(self):
        return [self.redis, *self.workers, *self.routers]

    def start(self) -> None:
        self.proxy.start()
        self.redis.start().wait_ready(30)
        for w in self.workers:
            w.start()
        for w in self.workers:
            w.wait_ready()
        for r in self.routers:
            r.start()
        for r in self.routers:
            r.wait_ready(120)

    def warm_up(self) -> None:
        """The undisturbed run: each spec once, its answer the reference for the soak."""
        for spec in self.specs:
            outcome, detail, text = run_request(self.routers, spec, self.rng)
            if outcome != "answer":
                raise RuntimeError(f"chaos: the undisturbed run failed: {outcome} {detail}")
            self.reference[spec] = text
        for p in self.procs():
            p.baseline_rss = p.rss_mib()

    def client(self, index: int) -> None:
        rng = random.Random(self.seed * 100 + index)
        while not self.stop.is_set():
            spec = rng.choice(self.specs)
            kills_done = self.router_kills_done
            outcome, detail, text = run_request(self.routers, spec, rng)
            if outcome == "cut":     # the connection dropped: documented only if a replica was SIGKILLed meanwhile
                outcome = "cut_by_router_kill" if self.router_kills_begun > kills_done else "lost"
            if outcome == "answer":
                outcome = "ok" if text == self.reference[spec] else "wrong"
                detail = f"{spec.prompt[-40:]!r}: got {text!r}, expected {self.reference[spec]!r}"
            self.tally.record(outcome, detail)

    def inject(self, kind: str) -> None:
        rng = self.rng
        self.tally.faults[kind] += 1
        self.tally.fault_times.append((kind, time.monotonic()))
        if kind == "worker_sigkill":
            self.restart(rng.choice(self.workers))
        elif kind == "worker_sigstop":
            w = rng.choice(self.workers)
            w.signal(signal.SIGSTOP)
            self.stop.wait(rng.uniform(1, 8))
            w.signal(signal.SIGCONT)
        elif kind == "router_sigkill":
            r = rng.choice(self.routers)
            self.router_kills_begun += 1
            r.kill()
            self.router_kills_done += 1
            r.start().wait_ready(120)
        elif kind == "redis_restart":
            self.redis.kill()
            self.redis.start().wait_ready(30)
        elif kind == "client_disconnect":
            spec = rng.choice([s for s in self.specs if s.stream])
            outcome, detail, _ = run_request(self.routers, spec, rng, disconnect=True)
            self.tally.record("disconnected" if outcome in ("disconnected", "answer") else outcome, detail)
        elif kind in ("kv_delay", "kv_drop"):     # on the TCP KV path into decode-tcp
            self.proxy.set_mode(kind.removeprefix("kv_"))
            self.stop.wait(rng.uniform(3, 8))
            self.proxy.set_mode("pass")
        elif kind == "layout_mismatch":
            w = rng.choice([w for w in self.workers if w.role == "decode"])
            self.restart(w, "random:tiny")
            self.stop.wait(rng.uniform(2, 6))        # the routers see it, mark it incompatible
            self.restart(w)

    def restart(self, w: Worker, model: str = MODEL) -> None:
        """SIGKILL `w` and start it again (serving `model`); a decode worker's remote-prefill
        counts are banked first, as its counters restart from 0."""
        self.bank_remote_prefills(w)
        w.kill()
        w.start(w.argv_for(model) if model != MODEL else None).wait_ready()

    def bank_remote_prefills(self, w: Worker) -> None:
        if w.role == "decode":
            for outcome in ("ok", "failed"):
                self.remote_prefills[outcome] += w.metric(f'splitserve_remote_prefills_total{{outcome="{outcome}"}}')

    def progress(self, t0: float) -> None:
        """One line a minute on stdout, so a long run can be followed (tail -f)."""
        t = self.tally
        with t.lock:
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(t.outcomes.items()))
        print(f"chaos: {(time.monotonic() - t0) / 60:.0f} min: {sum(t.faults.values())} faults, "
              f"{sum(t.outcomes.values())} requests ({outcomes})", flush=True)

    def injector(self, end: float) -> None:
        kinds = list(FAULT_KINDS)
        i = 0
        t0 = last_progress = time.monotonic()
        while (time.monotonic() < end or i < len(kinds)) and not self.stop.is_set():   # every kind at least once
            if time.monotonic() - last_progress >= 60:
                self.progress(t0)
                last_progress = time.monotonic()
            kind = kinds[i % len(kinds)] if i < len(kinds) else self.rng.choice(kinds)   # each kind once first
            i += 1
            try:
                self.inject(kind)
            except Exception as exc:  # noqa: BLE001 - a fault that cannot be undone is a failure
                self.tally.problems.append(("injector", f"{kind}: {exc}"))
                self.tally.outcomes["injector_failure"] += 1
            self.stop.wait(self.rng.uniform(1, 4))

    def quiesce_and_check(self) -> list[str]:
        leaks = []
        for w in self.workers:
            try:
                wait_for(lambda: (s := w.kv_state()) and s["num_requests"] == 0
                         and s["num_requests_holding_blocks"] == 0, 120, f"{w.name} idle")
            except TimeoutError:
                leaks.append(f"{w.name} still holds requests: {w.kv_state()}")
            state = w.kv_state()
            if state and not state.get("invariants_ok", False):
                leaks.append(f"{w.name}: block pool invariants: {state.get('error')}")
            self.bank_remote_prefills(w)
        for r in self.routers:
            status, body = http_get(r.url + "/metrics")
            if status != 200:
                leaks.append(f"{r.name}: /metrics answered {status}")
        for p in self.procs():
            growth = p.rss_mib() - p.baseline_rss
            if p.baseline_rss and growth > MEMORY_BOUND_MIB:
                leaks.append(f"{p.name}: RSS grew {growth:.0f} MiB (bound {MEMORY_BOUND_MIB})")
        return leaks

    def check_security(self) -> list[str]:
        """With security on: every worker refuses a plaintext gRPC client (mTLS was in force)."""
        if not self.security.is_on:
            return []
        return [f"{w.name} served a plaintext gRPC client although mTLS is on"
                for w in self.workers if not w.refuses_plaintext()]

    def recovery_times(self) -> dict[str, list[float]]:
        out = defaultdict(list)
        succ = sorted(self.tally.successes)
        for kind, t in self.tally.fault_times:
            after = next((s for s in succ if s > t), None)
            if after is not None:
                out[kind].append(after - t)
        return out

    def run(self) -> int:
        t0 = time.monotonic()
        try:
            self.start()
            self.warm_up()
            end = time.monotonic() + self.minutes * 60
            clients = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.num_clients)]
            for c in clients:
                c.start()
            self.injector(end)
            self.stop.set()
            for c in clients:
                c.join(DEADLINE_S + 30)
            leaks = self.quiesce_and_check() + self.check_security()
        finally:
            self.stop.set()
            for p in reversed(self.procs()):
                p.stop()
            self.proxy.stop()
        return self.report(leaks, time.monotonic() - t0)

    def report(self, leaks: list[str], seconds: float) -> int:
        t = self.tally
        print(f"chaos soak: seed {self.seed}, {self.minutes:g} min of faults, {seconds:.0f} s in all, "
              f"{self.num_clients} clients, " + ("mTLS and KV-transfer authentication on" if self.security.is_on
                                                 else "plaintext (--no-tls)"))
        print(f"faults injected ({sum(t.faults.values())}): " + ", ".join(f"{k} {t.faults[k]}" for k in FAULT_KINDS))
        print(f"requests ({sum(t.outcomes.values())}): " + ", ".join(f"{k} {v}" for k, v in sorted(t.outcomes.items())))
        for kind, times in sorted(self.recovery_times().items()):
            times.sort()
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            print(f"recovery after {kind}: p50 {statistics.median(times):.2f} s, p99 {p99:.2f} s (n={len(times)})")
        bad = sum(t.outcomes[k] for k in ("wrong", "hung", "lost", "injector_failure"))
        print(f"remote prefills (KV pushed to a decode worker): ok {self.remote_prefills['ok']:.0f}, "
              f"failed {self.remote_prefills['failed']:.0f} (then prefilled locally)")
        print(f"data lost: {t.outcomes['lost']} requests; wrong answers: {t.outcomes['wrong']}; "
              f"hung: {t.outcomes['hung']}; leaks and security failures: {len(leaks)}")
        for problem in t.problems[:20]:
            print("  problem:", *problem)
        for leak in leaks:
            print("  leak:", leak)
        missing = [k for k in FAULT_KINDS if not t.faults[k]]
        if missing:
            print("  fault kinds never injected:", ", ".join(missing))
        return 1 if bad or leaks or missing else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long faults are injected (default 30)")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--clients", type=int, default=NUM_CLIENTS, help=f"load-generating threads (default {NUM_CLIENTS})")
    p.add_argument("--logdir", default="")
    p.add_argument("--no-tls", action="store_true",
                   help="plaintext gRPC and unauthenticated KV transfers (default: both secured, as `splitserve up`)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1:
        p.error("--minutes must be > 0 and --clients >= 1")
    logdir = args.logdir or os.path.join("/tmp", f"splitserve-chaos-{os.getpid()}")
    os.makedirs(logdir, exist_ok=True)
    print(f"chaos soak: logs in {logdir}", flush=True)
    return Soak(args.minutes, args.seed, logdir, args.clients, secure=not args.no_tls).run()


if __name__ == "__main__":
    sys.exit(main())
