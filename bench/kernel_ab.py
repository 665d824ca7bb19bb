"""A kernel change, before and after: the CPU kernels built from a git revision's sources against
the working tree's, side by side in one process (arms interleaved, best of --repeats, each call
timed by the calling thread's CPU clock so a busy machine's waiting is not counted).

What it times, at 1, 8, 16 and 32 rows (SmolLM2-135M's shapes): the activation quantizer
(two digits), the `w4a16` linears (quantizer included, as the model calls them) and the int8
LM head slice, then decode attention over 256 tokens of float16 context per sequence. Every pair
must give the same bits (a kernel change that alters numbers is a fidelity decision, not a speed
one); the script exits 1 if any differs. Then the engine's own decode step (SmolLM2, the
default `--quantization auto`) on each library at batch 1, 8 and 32 with 256 tokens of context:
the median CPU time of engine_speed.STEPS steps, arms interleaved, and the b8/b1 and b32/b1 ratios.

    python bench/kernel_ab.py --base c642ab0 [--threads 1] [--repeats 3] [--no-engine]
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from splitserve.platform.kernels import cpu_build
from splitserve.platform.kernels.cpu_ops import CpuOps
from splitserve.platform.quant import a8, formats

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import engine_speed  # noqa: E402  (its engine and its decode-step timing)

ROWS = (1, 8, 16, 32)
LINEARS = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}
HEAD = (8192, 576)  # a sixth of SmolLM2's vocabulary


def build(sources: list[pathlib.Path], out: pathlib.Path) -> CpuOps:
    cc = cpu_build._compiler()
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-o", str(out), *map(str, sources), "-lm"]
    subprocess.run(cmd, check=True)
    return CpuOps(cpu_build.declare(ctypes.CDLL(str(out))))


def sources_at(revision: str, folder: pathlib.Path) -> list[pathlib.Path]:
    """The kernel sources of `revision`, written into `folder`."""
    paths = []
    for path in cpu_build.SOURCES:
        rel = path.relative_to(pathlib.Path(__file__).resolve().parents[1])
        text = subprocess.run(["git", "show", f"{revision}:{rel}"], capture_output=True, check=True).stdout
        (folder / path.name).write_bytes(text)
        paths.append(folder / path.name)
    return paths


def per_call_us(fn, calls: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls * 1e6


def compare(label: str, arms: dict[str, callable], calls: int, repeats: int) -> tuple[dict[str, float], bool]:
    outs = {name: fn() for name, fn in arms.items()}
    first = next(iter(outs.values()))
    same = all(all(torch.equal(a, b) for a, b in zip(first, out)) for out in outs.values())
    best = {name: float("inf") for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            best[name] = min(best[name], per_call_us(fn, calls))
    base, new = best.values()
    print(f"| {label} | {base:.0f} | {new:.0f} | {base / new:.2f}x |{'' if same else ' BITS DIFFER'}")
    return best, same


def engine_on(ops: CpuOps):
    """An engine (bench/engine_speed.py's) whose kernels are `ops`' library."""
    load = cpu_build.load
    cpu_build.load = lambda: ops.lib  # the model binds its kernels when it is built
    try:
        return engine_speed.make_engine("auto")
    finally:
        cpu_build.load = load


def engine_steps(libs: dict[str, CpuOps], base: str, repeats: int) -> None:
    engines = {name: engine_on(ops) for name, ops in libs.items()}
    best = {name: {} for name in libs}
    for _ in range(repeats):
        for b in (1, 8, 32):
            for name, engine in engines.items():
                best[name][b] = min(
                    best[name].get(b, float("inf")), engine_speed.step_ms(engine, b, seed=b, clock=time.thread_time)
                )
    print(f"\n| decode step, CPU ms (best of {repeats}) | batch 1 | batch 8 | batch 32 | b8/b1 | b32/b1 |")
    print("|---|---|---|---|---|---|")
    for name, ms in best.items():
        label = base if name == "base" else "working tree"
        print(f"| {label} | {ms[1]:.1f} | {ms[8]:.1f} | {ms[32]:.1f} | {ms[8] / ms[1]:.2f}x | {ms[32] / ms[1]:.2f}x |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the git revision to compare the working tree against")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-engine", action="store_true", help="only the kernels, not the engine's decode step")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        folder = pathlib.Path(tmp)
        (folder / "base").mkdir()
        libs = {
            "base": build(sources_at(args.base, folder / "base"), folder / "base.so"),
            "tree": build(list(cpu_build.SOURCES), folder / "tree.so"),
        }
        for ops in libs.values():
            ops.set_amx(True)
        print(
            f"{args.base} against the working tree; threads {args.threads}; us per call, best of {args.repeats}; "
            f"kernel path {libs['tree'].a8_path}\n"
        )
        print(f"| kernel | {args.base} | working tree | speed-up |")
        print("|---|---|---|---|")
        same = True
        for m in ROWS:
            x = torch.randn(m, 576)
            _, ok = compare(
                f"quantize 2 digits, {m} x 576",
                {n: (lambda o=o, x=x: o.quantize_a8(x, 2)) for n, o in libs.items()},
                400,
                args.repeats,
            )
            same &= ok
        for label, (n, k) in LINEARS.items():
            w = torch.randn(n, k) * 0.05
            kernels = {name: a8.Int4A8Kernel(w, None, ops, 2) for name, ops in libs.items()}
            for m in ROWS:
                x = torch.randn(m, k)
                _, ok = compare(
                    f"w4a16 {label}, {m} rows",
                    {name: (lambda kk=kk, x=x: (kk(x),)) for name, kk in kernels.items()},
                    40,
                    args.repeats,
                )
                same &= ok
        table = formats.int8_groups(torch.randn(*HEAD))[0]
        heads = {name: a8.Int8A8Head(table.codes, table.scale, ops) for name, ops in libs.items()}
        for m in ROWS:
            x = torch.randn(m, HEAD[1])
            _, ok = compare(
                f"int8 head {HEAD[0]}x{HEAD[1]}, {m} rows",
                {name: (lambda h=h, x=x: (h(x),)) for name, h in heads.items()},
                10,
                args.repeats,
            )
            same &= ok
        for b in ROWS:
            bs, ctx = 16, 256
            kc = torch.randn(b * ctx // bs, bs, 3, 64).half()
            vc = torch.randn(b * ctx // bs, bs, 3, 64).half()
            bt = torch.arange(b * ctx // bs).view(b, ctx // bs).contiguous()
            cl = torch.full((b,), ctx, dtype=torch.int64)
            q = torch.randn(b, 9, 64)
            _, ok = compare(
                f"attention, {b} sequences x 256 tokens (float16 KV)",
                {
                    n: (lambda o=o, args=(q, kc, vc, bt, cl): (o.decode_attention(*args, 0.125),))
                    for n, o in libs.items()
                },
                20,
                args.repeats,
            )
            same &= ok
        print("\nsame bits on both sides: " + str(same))
        if not args.no_engine:
            engine_steps(libs, args.base, args.repeats)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
