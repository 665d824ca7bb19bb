"""Chaos soak: the whole stack on loopback under load while a seeded fault injector breaks it;
every request is accounted for, by token id and by cause.

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

Every request asks for its token ids (`return_token_ids`); the reference is the same request's
ids in the undisturbed warm-up. Outcomes, each with its cause (which fault, on which process):

    ok                the token ids equal the reference
    wrong             they differ, or a cut answer's tokens are not a prefix of the reference
    cut               the answer stopped early (an error event after some tokens, or the
                      connection dropped), its tokens a prefix of the reference, and a fault hit
                      a process on the request's own path (its router replica, the decode and
                      prefill workers named in the response headers, the KV path into that decode
                      worker) between its start and SETTLE_S after the fault ended
    cut_unexplained   a cut with no such fault (e.g. a kill on the other router replica)
    error             a documented 429/503 with OpenAI's error body before any output, or both
                      replicas refusing the connection; its cause is the fault on its path, else
                      any fault during it, else none
    disconnected      the injector's own cut streams
    hung              nothing received for 180 s
    lost              an undocumented status, a broken stream, an unparsable answer

After quiescing: every worker's block pool holds no request and passes its invariants
(/debug/kv), every gateway's admission holds no running or queued request and no open worker
call (/metrics), each process' RSS grew at most MEMORY_BOUND_MIB, and (secured) every worker
refuses a plaintext client. Exit status 1 on any wrong, hung, lost or unexplained cut, a leak,
a security failure, an injector failure or a fault kind never injected. The load is
e2e/chaos_load.py, the processes e2e/chaos_procs.py.
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
from chaos_load import DEADLINE_S, FAILING, Reply, Spec, Tally, make_specs, run_request  # noqa: E402
from chaos_procs import MODEL, Redis, RouterProc, Security, Worker, http_get, wait_for  # noqa: E402
from kvproxy import KVProxy  # noqa: E402

MEMORY_BOUND_MIB = 400  # RSS growth allowed per process over the soak (after warm-up)
NUM_CLIENTS = 12  # load-generating threads (the workers batch their requests)
FAULT_KINDS = (
    "worker_sigkill",
    "worker_sigstop",
    "router_sigkill",
    "redis_restart",
    "client_disconnect",
    "layout_mismatch",
    "kv_delay",
    "kv_drop",
)
SETTLE_S = 10.0  # a fault still explains a cut this long after it ended (detection, fail-over)
OUTCOMES = ("ok", "wrong", "cut", "cut_unexplained", "error", "disconnected", "hung", "lost")


class FaultEvent:
    """One injected fault: its kind, the process it hit (for KV faults `kv:<decode worker>`, the KV
    path into it), and when it began and ended (monotonic; `ended` is inf while it lasts)."""

    def __init__(self, kind: str, target: str):
        self.kind, self.target, self.began, self.ended = kind, target, time.monotonic(), float("inf")

    def overlaps(self, started: float, ended: float) -> bool:
        return self.began <= ended and self.ended + SETTLE_S >= started

    def __str__(self) -> str:
        return f"{self.kind} on {self.target}"


# ---- the soak ------------------------------------------------------------------------------
class Soak:
    def __init__(
        self,
        minutes: float,
        seed: int,
        logdir: str,
        num_clients: int = NUM_CLIENTS,
        num_specs: int = 16,
        secure: bool = True,
    ):
        self.minutes, self.seed, self.logdir = minutes, seed, logdir
        os.makedirs(logdir, exist_ok=True)
        self.security = Security.make(os.path.join(logdir, "pki")) if secure else Security()
        self.rng = random.Random(seed)
        self.num_clients = num_clients
        self.specs = make_specs(random.Random(seed + 1), num_specs)
        self.reference: dict[Spec, list[int]] = {}
        self.tally = Tally()
        self.stop = threading.Event()
        self.fault_log: list[FaultEvent] = []
        self.fault_lock = threading.Lock()
        self.redis = Redis(logdir)
        self.workers = [
            Worker(role, transport, logdir, self.security, proxied=(role, transport) == ("decode", "tcp"))
            for transport in ("ucx", "tcp")
            for role in ("decode", "prefill")
        ]
        self.remote_prefills = Counter()  # outcome -> count, banked from each decode worker before a restart
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
        """The undisturbed run: each spec once, its token ids the reference for the soak."""
        for spec in self.specs:
            reply = run_request(self.routers, spec, self.rng)
            if reply.kind != "answer" or not reply.token_ids:
                raise RuntimeError(f"chaos: the undisturbed run failed: {reply.kind} {reply.detail}")
            self.reference[spec] = reply.token_ids
        for p in self.procs():
            p.baseline_rss = p.rss_mib()

    def client(self, index: int) -> None:
        rng = random.Random(self.seed * 100 + index)
        while not self.stop.is_set():
            spec = rng.choice(self.specs)
            outcome, detail, cause = self.classify(spec, run_request(self.routers, spec, rng))
            self.tally.record(outcome, detail, cause)

    def classify(self, spec: Spec, reply: Reply) -> tuple[str, str, str]:
        """(outcome, detail, cause) of one reply (see the module doc)."""
        ref = self.reference[spec]
        on_path, during = self.faults_for(reply)
        cause = str(on_path[0]) if on_path else str(during[0]) if during else "no fault during the request"
        where = (
            f"router {reply.router}, decode {self.name_of(reply.decode) or '-'}, "
            f"prefill {self.name_of(reply.prefill) or '-'}"
        )
        if reply.kind == "answer":
            if reply.token_ids == ref:
                return "ok", "", ""
            return "wrong", f"{where}: token ids {reply.token_ids}, expected {ref}", cause
        if reply.kind == "cut":
            n = len(reply.token_ids)
            if reply.token_ids != ref[:n]:
                return "wrong", f"{where}: cut after {n} tokens {reply.token_ids}, not a prefix of {ref}", cause
            if on_path:
                return "cut", f"{where}: {reply.detail} ({n} tokens before)", cause
            return (
                "cut_unexplained",
                f"{where}: {reply.detail}; no fault on its path (during it: {', '.join(map(str, during)) or 'none'})",
                "no fault on its path",
            )
        return reply.kind, f"{where}: {reply.detail}", cause

    def name_of(self, address: str) -> str:
        return next((w.name for w in self.workers if w.address == address), address)

    def path_of(self, reply: Reply) -> set[str]:
        path = {reply.router, self.name_of(reply.decode), self.name_of(reply.prefill)} - {""}
        if reply.prefill and reply.decode:
            path.add(f"kv:{self.name_of(reply.decode)}")
        return path

    def faults_for(self, reply: Reply) -> tuple[list[FaultEvent], list[FaultEvent]]:
        """(faults on the reply's path, all faults) that overlap its time, SETTLE_S included."""
        with self.fault_lock:
            during = [f for f in self.fault_log if f.overlaps(reply.started, reply.ended)]
        path = self.path_of(reply)
        return [f for f in during if f.target in path], during

    def begin_fault(self, kind: str, target: str) -> FaultEvent:
        event = FaultEvent(kind, target)
        with self.fault_lock:
            self.fault_log.append(event)
        return event

    def inject(self, kind: str) -> None:
        rng = self.rng
        self.tally.faults[kind] += 1
        self.tally.fault_times.append((kind, time.monotonic()))
        if kind in ("worker_sigkill", "worker_sigstop"):
            w = rng.choice(self.workers)
            event = self.begin_fault(kind, w.name)
            if kind == "worker_sigkill":
                self.restart(w)
            else:
                w.signal(signal.SIGSTOP)
                self.stop.wait(rng.uniform(1, 8))
                w.signal(signal.SIGCONT)
        elif kind == "router_sigkill":
            r = rng.choice(self.routers)
            event = self.begin_fault(kind, r.name)
            r.kill()
            r.start().wait_ready(120)
        elif kind == "redis_restart":
            event = self.begin_fault(kind, "redis")
            self.redis.kill()
            self.redis.start().wait_ready(30)
        elif kind == "client_disconnect":
            event = self.begin_fault(kind, "client")
            spec = rng.choice([s for s in self.specs if s.stream])
            reply = run_request(self.routers, spec, rng, disconnect=True)
            if reply.kind in ("disconnected", "answer"):
                self.tally.record("disconnected")
            else:
                outcome, detail, cause = self.classify(spec, reply)
                self.tally.record(outcome, detail, cause)
        elif kind in ("kv_delay", "kv_drop"):  # on the TCP KV path into decode-tcp
            event = self.begin_fault(kind, f"kv:{next(w.name for w in self.workers if w.proxied)}")
            self.proxy.set_mode(kind.removeprefix("kv_"))
            self.stop.wait(rng.uniform(3, 8))
            self.proxy.set_mode("pass")
        elif kind == "layout_mismatch":
            w = rng.choice([w for w in self.workers if w.role == "decode"])
            event = self.begin_fault(kind, w.name)
            self.restart(w, "random:tiny")
            self.stop.wait(rng.uniform(2, 6))  # the routers see it, mark it incompatible
            self.restart(w)
        event.ended = time.monotonic()

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
        print(
            f"chaos: {(time.monotonic() - t0) / 60:.0f} min: {sum(t.faults.values())} faults, "
            f"{sum(t.outcomes.values())} requests ({outcomes})",
            flush=True,
        )

    def injector(self, end: float) -> None:
        kinds = list(FAULT_KINDS)
        i = 0
        t0 = last_progress = time.monotonic()
        while (time.monotonic() < end or i < len(kinds)) and not self.stop.is_set():  # every kind at least once
            if time.monotonic() - last_progress >= 60:
                self.progress(t0)
                last_progress = time.monotonic()
            kind = kinds[i % len(kinds)] if i < len(kinds) else self.rng.choice(kinds)  # each kind once first
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
                wait_for(
                    lambda w=w: (
                        (s := w.kv_state()) and s["num_requests"] == 0 and s["num_requests_holding_blocks"] == 0
                    ),
                    120,
                    f"{w.name} idle",
                )
            except TimeoutError:
                leaks.append(f"{w.name} still holds requests: {w.kv_state()}")
            state = w.kv_state()
            if state and not state.get("invariants_ok", False):
                leaks.append(f"{w.name}: block pool invariants: {state.get('error')}")
            self.bank_remote_prefills(w)
        for r in self.routers:
            try:
                wait_for(lambda r=r: self.router_is_idle(r), 60, f"{r.name} idle")
            except TimeoutError:
                leaks.append(f"{r.name} still holds requests: {self.router_counts(r)}")
        for p in self.procs():
            growth = p.rss_mib() - p.baseline_rss
            if p.baseline_rss and growth > MEMORY_BOUND_MIB:
                leaks.append(f"{p.name}: RSS grew {growth:.0f} MiB (bound {MEMORY_BOUND_MIB})")
        return leaks

    ROUTER_GAUGES = (
        'splitserve_router_admission_requests{state="running"}',
        'splitserve_router_admission_requests{state="queued"}',
        "splitserve_router_inflight_worker_calls",
    )

    def router_counts(self, r: RouterProc) -> dict[str, float] | str:
        """The gateway's admission and open worker calls from its /metrics (what must drain to 0)."""
        status, body = http_get(r.url + "/metrics")
        if status != 200:
            return f"/metrics answered {status}"
        text = body.decode() if isinstance(body, bytes) else str(body)
        found = {
            name: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            for name in self.ROUTER_GAUGES
            if line.startswith(name + " ")
        }
        return found if len(found) == len(self.ROUTER_GAUGES) else f"gauges missing from /metrics: {found}"

    def router_is_idle(self, r: RouterProc) -> bool:
        counts = self.router_counts(r)
        return isinstance(counts, dict) and not any(counts.values())

    def check_security(self) -> list[str]:
        """With security on: every worker refuses a plaintext gRPC client (mTLS was in force)."""
        if not self.security.is_on:
            return []
        return [
            f"{w.name} served a plaintext gRPC client although mTLS is on"
            for w in self.workers
            if not w.refuses_plaintext()
        ]

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
        print(
            f"chaos soak: seed {self.seed}, {self.minutes:g} min of faults, {seconds:.0f} s in all, "
            f"{self.num_clients} clients, "
            + ("mTLS and KV-transfer authentication on" if self.security.is_on else "plaintext (--no-tls)")
        )
        print(f"faults injected ({sum(t.faults.values())}): " + ", ".join(f"{k} {t.faults[k]}" for k in FAULT_KINDS))
        total = sum(t.outcomes.values())
        print(f"requests ({total}), compared by token id:")
        for outcome in OUTCOMES + tuple(k for k in t.outcomes if k not in OUTCOMES):
            n = t.outcomes[outcome]
            bound = "must be 0" if outcome in FAILING or outcome == "injector_failure" else "reported"
            causes = t.causes.get(outcome)
            why = ("; causes: " + ", ".join(f"{c} {k}" for c, k in causes.most_common(6))) if causes else ""
            print(f"  {outcome:16s} {n:6d}  ({100 * n / max(total, 1):5.2f} %, {bound}){why}")
        for kind, times in sorted(self.recovery_times().items()):
            times.sort()
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            print(f"recovery after {kind}: p50 {statistics.median(times):.2f} s, p99 {p99:.2f} s (n={len(times)})")
        bad = sum(t.outcomes[k] for k in (*FAILING, "injector_failure"))
        print(
            f"remote prefills (KV pushed to a decode worker): ok {self.remote_prefills['ok']:.0f}, "
            f"failed {self.remote_prefills['failed']:.0f} (then prefilled locally)"
        )
        print(
            f"wrong: {t.outcomes['wrong']}; hung: {t.outcomes['hung']}; lost: {t.outcomes['lost']}; "
            f"unexplained cuts: {t.outcomes['cut_unexplained']}; leaks and security failures: {len(leaks)} "
            f"(admission, open calls and KV blocks checked empty at the end)"
        )
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
    p.add_argument(
        "--no-tls",
        action="store_true",
        help="plaintext gRPC and unauthenticated KV transfers (default: both secured, as `splitserve up`)",
    )
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1:
        p.error("--minutes must be > 0 and --clients >= 1")
    logdir = args.logdir or os.path.join("/tmp", f"splitserve-chaos-{os.getpid()}")
    os.makedirs(logdir, exist_ok=True)
    print(f"chaos soak: logs in {logdir}", flush=True)
    return Soak(args.minutes, args.seed, logdir, args.clients, secure=not args.no_tls).run()


if __name__ == "__main__":
    sys.exit(main())
