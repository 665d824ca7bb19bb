"""A QPS sweep of the routing arms on llm-d's shared-prefix workload: goodput at a p90 TTFT SLO.

    python bench/sweep.py [--write docs/benchmarks.md] [--plots docs/benchmarks]
        [--slo 2] [--search-slo S] [--rates 0.5,1,...] [--requests 24] [--arms round-robin,...]
        [--workload-param KEY=VALUE ...] [--kv-prefixes H] [--raw DIR [--report-only | --resume]]

Arms (all: two colocated workers, `--role both`, each pinned to one core with one torch thread
and the same KV budget; bench/serving_suite.py starts them):
    round-robin    the splitserve gateway, decode profile = round-robin alone, KV pull off: the
                   field's cache-blind baseline (llm-d's and Dynamo's round robin is vLLM pods
                   that each reuse only their own cache)
    round-robin+pull  round robin with the router's KV pull on (its default): a worker given a
                   prompt whose prefix the other holds copies it instead of computing it. The
                   pull reads the prefix index, so this arm is not cache-blind
    least-queue    queue-depth (weight 3) + pending-assignments (1)
    prefix+queue   the default decode profile (prefix-overlap, queue-depth, kv-usage, ...)
    expected-latency  the expected-latency scorer alone (the prefix hit and the load as prompt
                   tokens to compute before the first token; docs/router.md), default filters
    epp            Envoy with ext_proc to `splitserve epp` (the default profile) in front of
                   one sidecar per worker (bench/epp_w1.py's GatewayCluster)

The search. The rates form a ladder (--rates, ascending). Step k runs rate k for every arm still
in the search, one after another in an order that rotates with k (so no arm always runs first
on a drifting host), each on a fresh cluster: the warm-up sends each group's system prompt twice
(WARM_ROUNDS: the cache reaches steady state), then --requests measured requests arrive as a
Poisson stream at the rate. An arm leaves the search at the first rate where its p90 TTFT exceeds
the SLO or a request fails; the sweep ends when every arm has left or the ladder is done.

Goodput of an arm = the highest rate of the ladder at which it met the SLO, every lower rate
met too (`goodput`); 0 when it met it at no rate. Output tokens/s "there" is that point's
measured output throughput. The report gives, per rate, TTFT p50/p90, ITL p50, E2E p50/p90,
output tokens/s and the server-reported prefix-cache hit rate; per arm the goodput and the
output tokens/s there; and the ratios the acceptance reads: prefix+queue ÷ round robin (goodput,
and output tokens/s at each one's goodput), epp ÷ prefix+queue.

The KV budget (`kv_budget`) holds H system prompts per worker (--kv-prefixes, default half the
groups plus one) beside room for 4 requests' own question and output blocks: fewer than all
groups' prompts, so round robin, which sends every group to both workers, keeps evicting, while
a router that keeps each group on one worker fits its half of the groups.

Every point's bench JSON (and its workers' KV blocks) goes to --raw as it finishes, the run's
facts to --raw/sweep-meta.json before the first: `--report-only --raw DIR` writes the report of
a finished or interrupted run from them, and `--resume --raw DIR` (with the run's arguments) goes
on with an interrupted run, reading back the points whose seeds all finished. Before any
cluster starts it checks its imports (matplotlib for the plots). The lone prefills of one cold
and one warm request (`probe`) on a fresh cluster are printed and reported: the
cost of a miss against a hit on this host is what the ratio follows.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import markers, require, section_path, write_section  # noqa: E402

ARMS = ("round-robin", "round-robin+pull", "least-queue", "prefix+queue", "expected-latency", "epp")
NO_PULL = ("round-robin",)  # arms whose router has placement.kv_pull off
BLOCK_TOKENS = 16
ROOM_REQUESTS = 4  # requests in flight per worker whose own blocks the budget leaves room for
DEFAULT_RATES = (0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
# Warm-up requests per group: the first caches its system prompt, the second hits it. A block
# pool protects the blocks a request has hit (docs/engine.md, "Prefix-cache eviction"), which
# every active group's prompt is after a long run; with one warm-up each, a short trace would
# measure the start of the run instead of its steady state.
WARM_ROUNDS = 2


# ---- the search and its results (pure; tests/bench/test_sweep.py) ------------------------------------
@dataclasses.dataclass(frozen=True)
class Point:
    """One arm at one rate: what the sweep reads from a `splitserve bench` summary."""

    arm: str
    rate: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    output_tps: float
    prefix_hit: float | None
    completed: int
    failed: int
    prefix_pulled: float | None = None  # prompt tokens pulled from the other worker (None: not recorded)

    def meets(self, slo_s: float) -> bool:
        """Every request served and p90 TTFT within the SLO."""
        return self.failed == 0 and self.ttft_p90_ms is not None and self.ttft_p90_ms <= slo_s * 1000

    @classmethod
    def from_summary(cls, arm: str, rate: float, s: dict) -> Point:
        def get(metric, key):
            return s[metric][key] if s.get(metric) else None

        return cls(
            arm,
            rate,
            get("ttft_ms", "p50"),
            get("ttft_ms", "p90"),
            get("itl_ms", "p50"),
            get("e2e_ms", "p50"),
            get("e2e_ms", "p90"),
            s["output_throughput"],
            s["prefix_cache_hit_rate"],
            s["completed"],
            s["failed"],
            s.get("prefix_pull_rate"),  # absent from runs before it was recorded
        )


def check_rates(rates: list[float]) -> list[float]:
    if not rates or any(not r > 0 or math.isinf(r) for r in rates) or sorted(set(rates)) != list(rates):
        raise ValueError(f"rates must be finite, > 0, distinct and ascending, got {rates}")
    return list(rates)


def still_searching(arm: str, points: list[Point], slo_s: float) -> bool:
    """An arm stays in the search until its first rate that misses the SLO."""
    return all(p.meets(slo_s) for p in points if p.arm == arm)


def step_order(arms: tuple[str, ...], step: int) -> list[str]:
    """The arms in the order they run at `step`: rotated by one each step."""
    k = step % len(arms)
    return list(arms[k:] + arms[:k])


def goodput(points: list[Point], arm: str, slo_s: float) -> Point | None:
    """The arm's point at the highest rate meeting the SLO with every lower rate meeting it too
    (None: it met the SLO at no rate)."""
    best = None
    for p in sorted((p for p in points if p.arm == arm), key=lambda p: p.rate):
        if not p.meets(slo_s):
            break
        best = p
    return best


def at_rate(points: list[Point], arm: str, rate: float) -> Point | None:
    return next((p for p in points if p.arm == arm and p.rate == rate), None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The acceptance's ratios (None where a side has no value)."""

    goodput_ratio: float | None  # goodput of the arm (prefix+queue) ÷ round robin
    tps_at_goodput_ratio: float | None  # output tok/s, each at its own goodput rate
    tps_at_rr_rate_ratio: float | None  # output tok/s at round robin's goodput rate, both arms
    epp_vs_gateway: float | None  # goodput epp ÷ prefix+queue


def verdict(points: list[Point], slo_s: float, arm: str = "prefix+queue", base: str = "round-robin") -> Verdict:
    """`arm` against `base` (round robin); the EPP always against prefix+queue (the profile it runs)."""
    rr, pq, epp = (goodput(points, a, slo_s) for a in (base, arm, "epp"))
    gw = goodput(points, "prefix+queue", slo_s)
    same = at_rate(points, arm, rr.rate) if rr else None
    return Verdict(
        ratio(pq and pq.rate, rr and rr.rate),
        ratio(pq and pq.output_tps, rr and rr.output_tps),
        ratio(same and same.output_tps, rr and rr.output_tps),
        ratio(epp and epp.rate, gw and gw.rate),
    )


def kv_budget(system_len: int, question_len: int, output_len: int, prefixes: int) -> int:
    """Blocks per worker: `prefixes` system prompts plus ROOM_REQUESTS requests' own blocks."""
    system = math.ceil(system_len / BLOCK_TOKENS)
    own = math.ceil((system_len + question_len + output_len) / BLOCK_TOKENS) - system_len // BLOCK_TOKENS
    return prefixes * system + ROOM_REQUESTS * own


# ---- running ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setup:
    params: dict  # shared-prefix parameters (strings, as --workload-param)
    kv_blocks: int
    max_model_len: int
    requests: int
    slo_s: float  # the SLO whose first miss ends an arm's search
    seeds: int = 1  # traces per point: seeds 0..seeds-1, each on a fresh cluster, their requests pooled


def start_cluster(arm: str, setup: Setup, workdir: pathlib.Path):
    from epp_w1 import GatewayCluster
    from serving_suite import Cluster

    if arm == "epp":
        return GatewayCluster("epp", workdir, setup.kv_blocks, setup.max_model_len)
    return Cluster(arm_of(arm), workdir, setup.kv_blocks, setup.max_model_len)


def arm_of(arm: str):
    """The serving suite's Arm for a gateway arm of the sweep."""
    from serving_suite import Arm

    return Arm(arm, scorers=arm.removesuffix("+pull"), kv_pull=arm not in NO_PULL)


def run_point(arm: str, rate: float, setup: Setup, raw: pathlib.Path) -> tuple[Point, list[int]]:
    """The arm at the rate: one run per seed, each on a fresh cluster, pooled into one point."""
    from serving_suite import Run, bench

    groups = int(setup.params["groups"])
    docs, kv = [], set()
    for seed in range(setup.seeds):
        run = Run(
            "shared-prefix",
            None,
            setup.requests,
            rate=rate,
            warmup=WARM_ROUNDS * groups,
            params=tuple(setup.params.items()),
            seed=seed,
        )
        tag = tag_of(arm, rate, seed)
        print(f"== {tag}", flush=True)
        cluster = start_cluster(arm, setup, raw)
        try:
            docs.append(bench(run, cluster.url, raw, tag))
        finally:
            cluster.stop()
        (raw / f"{tag}.kv.json").write_text(json.dumps(cluster.kv_blocks))
        kv.update(cluster.kv_blocks)
    return Point.from_summary(arm, rate, pooled_summary(docs)), sorted(kv)


def tag_of(arm: str, rate: float, seed: int) -> str:
    """The raw files' name of one run: `sweep-prefix-queue-r0.5`, `...-r0.5-s1` for seed 1."""
    return f"sweep-{arm.replace('+', '-')}-r{rate:g}" + (f"-s{seed}" if seed else "")


def finished_point(arm: str, rate: float, setup: Setup, raw: pathlib.Path) -> tuple[Point, list[int]] | None:
    """The point of an earlier run in `raw` when every seed of it finished there (--resume)."""
    paths = [raw / f"{tag_of(arm, rate, seed)}.json" for seed in range(setup.seeds)]
    if not all(path.is_file() for path in paths):
        return None
    docs = [json.loads(path.read_text()) for path in paths]
    kv = {blocks for path in paths for blocks in kv_blocks_of(path)}
    return Point.from_summary(arm, rate, pooled_summary(docs)), sorted(kv)


def kv_blocks_of(path: pathlib.Path) -> list[int]:
    """The KV blocks the workers of one raw run read back (its `.kv.json` beside it; none: [])."""
    kv_file = path.with_name(path.stem + ".kv.json")
    return json.loads(kv_file.read_text()) if kv_file.is_file() else []


def pooled_summary(docs: list[dict]) -> dict:
    """The summary of several runs of one point as one set of requests: percentiles over all of
    them, throughput over their summed durations (one run: its own summary)."""
    from splitserve.bench.loadgen import metrics
    from splitserve.bench.loadgen.report import from_record

    if len(docs) == 1:
        return docs[0]["summary"]
    results = [from_record(r) for doc in docs for r in doc["requests"]]
    return metrics.compute(results, sum(doc["duration_s"] for doc in docs), None)


def tag_arm(tag: str) -> str:
    """The arm of a raw file's tag (`sweep-prefix-queue-r0.5`, or `...-r0.5-s1` for seed 1 ->
    prefix+queue)."""
    name = tag.removeprefix("sweep-").rsplit("-r", 1)[0]
    return next(a for a in ARMS if a.replace("+", "-") == name)


def points_from_raw(raw: pathlib.Path) -> tuple[list[Point], list[int]]:
    """Every finished point of a run's raw folder (the bench JSON of each arm, rate and seed; a
    point's seeds pooled), and the KV blocks its workers read back: a finished or interrupted
    sweep is reported from these."""
    docs: dict[tuple[str, float], list[dict]] = {}
    kv = set()
    for path in sorted(raw.glob("sweep-*-r*.json")):
        if path.name.endswith(".kv.json"):
            continue
        doc = json.loads(path.read_text())
        docs.setdefault((tag_arm(path.stem), float(doc["config"]["rate"])), []).append(doc)
        kv.update(kv_blocks_of(path))
    points = [Point.from_summary(arm, rate, pooled_summary(d)) for (arm, rate), d in docs.items()]
    return points, sorted(kv)


def probe(setup: Setup, workdir: pathlib.Path) -> dict:
    """One cold request (system prompt + question, nothing cached) and one warm one (the same
    system prompt, a new question) alone on a fresh prefix+queue cluster: seconds to the answer
    of max_tokens=1, i.e. a miss's and a hit's prefill on one core of this host."""
    from serving_suite import MODEL

    cluster = start_cluster("prefix+queue", setup, workdir)
    rng = random.Random(1)
    system = [rng.randrange(100, 40000) for _ in range(int(setup.params["system_len"]))]

    def once(prompt):
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
        req = urllib.request.Request(cluster.url + "/v1/completions", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
        return time.perf_counter() - t0

    def question():
        return [rng.randrange(100, 40000) for _ in range(int(setup.params["question_len"]))]

    try:
        once(question())  # the first request of a worker pays one-time costs
        cold = once(system + question())
        warm = once(system + question())
    finally:
        cluster.stop()
    print(f"probe: a miss's prefill {cold:.2f} s, a hit's {warm:.2f} s", flush=True)
    return {"miss_s": cold, "hit_s": warm}


def sweep(
    arms: tuple[str, ...], rates: list[float], setup: Setup, raw: pathlib.Path, resume: bool = False
) -> tuple[list[Point], list]:
    """Every arm at rising rates until it misses the SLO. `resume`: a point whose seeds all
    finished in `raw` (a run that a crash or Ctrl-C ended) is read back instead of run again."""
    points, kv = [], set()
    for step, rate in enumerate(rates):
        active = [a for a in step_order(arms, step) if still_searching(a, points, setup.slo_s)]
        if not active:
            break
        for arm in active:
            done = finished_point(arm, rate, setup, raw) if resume else None
            point, blocks = done or run_point(arm, rate, setup, raw)
            points.append(point)
            kv.update(blocks)
            verdict_text = "meets" if point.meets(setup.slo_s) else "MISSES"
            print(f"   {arm} @ {rate:g}/s: p90 TTFT {_ms(point.ttft_p90_ms)} ms, {verdict_text} the SLO", flush=True)
    return points, sorted(kv)


# ---- report -------------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _per_point(meta: dict) -> str:
    seeds = meta.get("seeds", 1)
    if seeds == 1:
        return f"{meta['requests']} measured requests per rate"
    return (
        f"{meta['requests']} measured requests per run, {seeds} runs per arm and rate (seeds 0–{seeds - 1}, "
        f"the same {seeds} traces for every arm), each point the {seeds * meta['requests']} requests pooled"
    )


def _warm(meta: dict) -> str:
    rounds = meta.get("warm_rounds", 1)  # runs before WARM_ROUNDS warmed each group once
    return {1: "once", 2: "twice"}.get(rounds, f"{rounds} times")


def point_row(p: Point, slos: list[float]) -> str:
    hit, pulled = ("–" if v is None else f"{100 * v:.0f} %" for v in (p.prefix_hit, p.prefix_pulled))
    meets = " / ".join("yes" if p.meets(slo) else "**no**" for slo in slos)
    return (
        f"| {p.arm} | {p.rate:g} | {p.completed}/{p.completed + p.failed} | {_ms(p.ttft_p50_ms)} | "
        f"{_ms(p.ttft_p90_ms)} | {_ms(p.itl_p50_ms)} | {_ms(p.e2e_p50_ms)} | {_ms(p.e2e_p90_ms)} | "
        f"{p.output_tps:.1f} | {hit} | {pulled} | {meets} |"
    )


def goodput_cell(points: list[Point], arm: str, slo_s: float) -> str:
    """'rate (output tok/s there)', '< lowest rate', or 'rate+' when the ladder ended first."""
    g = goodput(points, arm, slo_s)
    if g is None:
        first = min((p.rate for p in points if p.arm == arm), default=math.nan)
        return f"< {first:g} (no rate met it)"
    top = " (the ladder's top: at least)" if all(p.meets(slo_s) for p in points if p.arm == arm) else ""
    return f"{g.rate:g}{top}; {g.output_tps:.1f} tok/s"


def verdict_lines(points: list[Point], slo_s: float) -> list[str]:
    v = verdict(points, slo_s)
    lines = [
        f"- at {slo_s:g} s: goodput prefix+queue ÷ round robin **{_x(v.goodput_ratio)}** (target ≥ 2×); "
        f"output tok/s, each at its goodput rate, **{_x(v.tps_at_goodput_ratio)}** (target ≥ 2×); "
        f"output tok/s at round robin's goodput rate {_x(v.tps_at_rr_rate_ratio)}; "
        f"goodput epp (Envoy) ÷ prefix+queue (splitserve gateway) **{_x(v.epp_vs_gateway)}** (target within 10 %)"
    ]
    if any(p.arm == "round-robin+pull" for p in points):
        b = verdict(points, slo_s, base="round-robin+pull")
        lines.append(
            f"- at {slo_s:g} s, against round robin with the KV pull: goodput prefix+queue ÷ round-robin+pull "
            f"**{_x(b.goodput_ratio)}**; output tok/s, each at its goodput rate, **{_x(b.tps_at_goodput_ratio)}**"
        )
    if any(p.arm == "expected-latency" for p in points):
        e = verdict(points, slo_s, "expected-latency")
        lines.append(
            f"- at {slo_s:g} s: goodput expected-latency ÷ round robin **{_x(e.goodput_ratio)}**; output tok/s, "
            f"each at its goodput rate, **{_x(e.tps_at_goodput_ratio)}**; at round robin's goodput rate "
            f"{_x(e.tps_at_rr_rate_ratio)}"
        )
    return lines


def render(points: list[Point], arms: tuple[str, ...], meta: dict, plots: dict[str, str]) -> str:
    begin, end = markers("sweep")
    slos = meta["slos"]
    named = " / ".join(f"{s:g} s" for s in slos)
    return "\n".join(
        [
            begin,
            "## Routing under load: shared-prefix QPS sweep to a p90 TTFT SLO (issue 54)",
            "",
            f"Host: {meta['machine']}; load average at the start {meta['loadavg']}. Run of {meta['date']}, "
            f"{meta['minutes']:.0f} minutes, command: `{meta['command']}`.",
            "",
            f"Workload `shared-prefix` ({meta['shape']}); {_per_point(meta)}, "
            f"Poisson arrivals, after a warm-up of each group's system prompt {_warm(meta)}. Every arm: two colocated "
            "workers pinned to one core each (one torch thread), "
            f"{meta['kv_blocks_asked']} KV blocks per worker (read back: {meta['kv_blocks']}): "
            f"{meta['kv_holds']}. A fresh cluster for every arm and rate; at each rate the arms run back "
            "to back, their order rotating. An SLO is met at a rate when p90 TTFT is within it and no request "
            f"failed; an arm left the search at its first rate missing {max(slos):g} s. "
            f"Lone prefills on this host at the start: a miss (system prompt + question) {meta['miss_s']:.2f} s, "
            f"a hit (question only) {meta['hit_s']:.2f} s.",
            "",
            "| arm | rate (req/s) | done | TTFT p50 | TTFT p90 | ITL p50 | E2E p50 | E2E p90 | out tok/s | "
            f"prefix hit | pulled | meets {named} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *[point_row(p, slos) for p in sorted(points, key=lambda p: (arms.index(p.arm), p.rate))],
            "",
            "Latencies in ms. *Prefix hit*: prompt tokens found in the serving worker's own cache; "
            "*pulled*: prompt tokens whose KV it pulled from the other worker instead of computing "
            "(x-splitserve-pulled-tokens); the rest were computed. Goodput = the highest rate meeting the SLO, every lower rate meeting it too, "
            "and the output tokens/s measured there:",
            "",
            "| arm | " + " | ".join(f"goodput at p90 TTFT ≤ {s:g} s" for s in slos) + " |",
            "|---|" + "---|" * len(slos),
            *[f"| {arm} | " + " | ".join(goodput_cell(points, arm, s) for s in slos) + " |" for arm in arms],
            "",
            *[line for s in slos for line in verdict_lines(points, s)],
            "",
            f"![TTFT vs load]({plots['ttft']})",
            "",
            f"![goodput per arm]({plots['goodput']})",
            end,
        ]
    )


def make_plots(points: list[Point], arms: tuple[str, ...], slos: list[float], folder: pathlib.Path, rel: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm in arms:
        mine = sorted((p for p in points if p.arm == arm), key=lambda p: p.rate)
        for ax, key in zip(axes, ("ttft_p50_ms", "ttft_p90_ms")):
            ax.plot([p.rate for p in mine], [getattr(p, key) for p in mine], marker="o", label=arm)
    for ax, name in zip(axes, ("p50", "p90")):
        for slo in slos:
            ax.axhline(slo * 1000, color="grey", linestyle="--", linewidth=1)
            ax.annotate(f"SLO {slo:g} s", (ax.get_xlim()[0], slo * 1000), fontsize=7, color="grey")
        ax.set(xlabel="arrival rate (req/s)", ylabel=f"TTFT {name} (ms)", title=f"TTFT {name} vs load", yscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "sweep-ttft-vs-load.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(slos)
    for i, slo in enumerate(slos):
        rates = [(g.rate if (g := goodput(points, a, slo)) else 0.0) for a in arms]
        xs = [k + (i - (len(slos) - 1) / 2) * width for k in range(len(arms))]
        ax.bar(xs, rates, width, label=f"p90 TTFT ≤ {slo:g} s")
    ax.set_xticks(range(len(arms)), list(arms))
    ax.set(ylabel="goodput (req/s)", title="Goodput per arm: the highest rate meeting the SLO")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "sweep-goodput.png", dpi=110)
    plt.close(fig)
    return {"ttft": f"{rel}/sweep-ttft-vs-load.png", "goodput": f"{rel}/sweep-goodput.png"}


# ---- the command --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", help="the benchmarks page to write the section into (docs/benchmarks.md)")
    ap.add_argument("--plots", default="docs/benchmarks", help="folder for the two PNG plots and the JSON summary")
    ap.add_argument("--slo", type=float, default=2.0, help="p90 TTFT SLO in seconds (default 2)")
    ap.add_argument(
        "--search-slo",
        type=float,
        default=None,
        help="the SLO that ends an arm's search (default --slo); a larger one also reports goodput at it, "
        "for a host where a lone miss already takes about --slo",
    )
    ap.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)), help="the ladder, ascending, req/s")
    ap.add_argument("--requests", type=int, default=24, help="measured requests per arm and rate (default 24)")
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per arm and rate, seeds 0..N-1 (each a fresh cluster), their requests pooled into one "
        "point: near the knee one trace's p90 moves by a second from seed to seed (default 1)",
    )
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    ap.add_argument("--workload-param", action="append", default=[], metavar="KEY=VALUE", help="shared-prefix shape")
    ap.add_argument("--kv-prefixes", type=int, default=None, help="system prompts one worker's KV holds")
    ap.add_argument("--raw", default=None, help="folder for the raw JSON (default: a new temp folder)")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run in --raw: the points whose seeds all finished there are read back, "
        "the rest run (same arguments as that run)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write the report of the (finished or interrupted) run in --raw",
    )
    args = ap.parse_args(argv)
    args.arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if not args.arms or set(args.arms) - set(ARMS):
        ap.error(f"--arms: unknown {sorted(set(args.arms) - set(ARMS))}; allowed: {', '.join(ARMS)}")
    try:
        args.rates = check_rates([float(r) for r in args.rates.split(",")])
    except ValueError as exc:
        ap.error(f"--rates: {exc}")
    if not 1 <= args.seeds <= 16:
        ap.error(f"--seeds must be in [1, 16], got {args.seeds}")
    if args.requests < 10 or not 0 < args.slo < math.inf:
        ap.error("--requests must be >= 10 (a p90 needs them) and --slo a positive number of seconds")
    args.search_slo = args.slo if args.search_slo is None else args.search_slo
    if not args.slo <= args.search_slo < math.inf:
        ap.error(f"--search-slo must be a number of seconds >= --slo ({args.slo:g}), got {args.search_slo:g}")
    args.slos = sorted({args.slo, args.search_slo})
    for flag in ("report_only", "resume"):
        if getattr(args, flag) and not (args.raw and pathlib.Path(args.raw, "sweep-meta.json").is_file()):
            ap.error(f"--{flag.replace('_', '-')} needs --raw DIR holding a run's sweep-meta.json")
    return args


def make_setup(args) -> tuple[Setup, str]:
    from splitserve.bench.loadgen.workloads import parse_params

    overrides = dict(item.split("=", 1) for item in args.workload_param)
    p = parse_params("shared-prefix", overrides)  # ConfigError names a bad key or value
    held = args.kv_prefixes or p.groups // 2 + 1
    if not 1 <= held < p.groups:
        raise SystemExit(f"--kv-prefixes must be in [1, groups - 1 = {p.groups - 1}] (fewer than all), got {held}")
    blocks = kv_budget(p.system_len, p.question_len, p.output_len, held)
    length = p.system_len + p.question_len + p.output_len
    setup = Setup(
        {k: str(v) for k, v in dataclasses.asdict(p).items()},
        blocks,
        -(-length // 256) * 256,
        args.requests,
        args.search_slo,
        args.seeds,
    )
    holds = (
        f"{held} of the {p.groups} system prompts ({held * math.ceil(p.system_len / BLOCK_TOKENS)} blocks) beside "
        f"{ROOM_REQUESTS} requests' own question and output blocks"
    )
    return setup, holds


def start_meta(args, setup: Setup, holds: str, argv: list[str] | None) -> dict:
    from serving_suite import machine

    p = setup.params
    return {
        "machine": machine(),
        "loadavg": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
        "date": datetime.date.today().isoformat(),
        "started": time.time(),
        "command": "python bench/sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shape": f"{p['groups']} groups × {p['system_len']}-token system prompt + {p['question_len']}-token "
        f"question → {p['output_len']} output tokens, group skew {p['group_skew']}",
        "requests": setup.requests,
        "seeds": setup.seeds,
        "warm_rounds": WARM_ROUNDS,
        "kv_blocks_asked": setup.kv_blocks,
        "kv_holds": holds,
        "slos": args.slos,
        "arms": list(args.arms),
    }


def report(raw: pathlib.Path, write: str | None, plots_dir: str) -> None:
    """The section, plots and summary of the run in `raw` (its sweep-meta.json and points)."""
    meta = json.loads((raw / "sweep-meta.json").read_text())
    points, kv = points_from_raw(raw)
    arms = tuple(meta["arms"])
    last = max((f.stat().st_mtime for f in raw.glob("sweep-*-r*.json")), default=meta["started"])
    meta.update(minutes=(last - meta["started"]) / 60, kv_blocks=", ".join(map(str, kv)) or "not recorded")
    folder = pathlib.Path(plots_dir)
    rel = os.path.relpath(folder, section_path(write, "sweep").parent) if write else str(folder)
    plots = make_plots(points, arms, meta["slos"], folder, rel)
    (folder / "sweep-summary.json").write_text(
        json.dumps({"meta": meta, "points": [dataclasses.asdict(p) for p in points]}, indent=1) + "\n"
    )
    section = render(points, arms, meta, plots)
    print(section)
    if write:
        write_section(write, "sweep", section)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running cluster's `finally` stops its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    require("bench/sweep.py", ["matplotlib", "yaml"])
    if args.report_only:
        report(pathlib.Path(args.raw), args.write, args.plots)
        return 0
    setup, holds = make_setup(args)
    raw = pathlib.Path(args.raw) if args.raw else pathlib.Path(tempfile.mkdtemp(prefix="splitserve-sweep-"))
    raw.mkdir(parents=True, exist_ok=True)
    print(f"raw results in {raw}; KV per worker: {setup.kv_blocks} blocks = {holds}", flush=True)
    if not args.resume:  # a resumed run keeps its first start's facts and probe
        meta = start_meta(args, setup, holds, argv)
        meta.update(probe(setup, raw))
        (raw / "sweep-meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    sweep(args.arms, args.rates, setup, raw, resume=args.resume)
    report(raw, args.write, args.plots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
